/* tapegrad native runtime: kernels of the linalg family (included after runtime.c).
 *
 * T[5] is the LAPACK table (tapegrad.blas.lapack_pointers): potrf getrf gesv trsm trmm gemm, from the library the BLAS comes from, so its integers are tg_bint. Each tg_la_* call passes
 * exactly the arguments tapegrad.ops.linalg.Lapack passes on the tape: row-major buffers read as their
 * column-major transposes. On a LAPACK failure (a matrix that is not positive definite, or singular)
 * the node's value is filled with NaN: a C caller has no exception to catch, and NaN cannot be
 * mistaken for a result.
 */
typedef void (*tg_potrf_t)(char *, tg_bint *, real *, tg_bint *, tg_bint *);
typedef void (*tg_getrf_t)(tg_bint *, tg_bint *, real *, tg_bint *, tg_bint *, tg_bint *);
typedef void (*tg_gesv_t)(tg_bint *, tg_bint *, real *, tg_bint *, tg_bint *, real *, tg_bint *, tg_bint *);
typedef void (*tg_trsm_t)(char *, char *, char *, char *, tg_bint *, tg_bint *, real *, real *, tg_bint *,
                          real *, tg_bint *);
enum { TG_POTRF, TG_GETRF, TG_GESV, TG_TRSM, TG_TRMM, TG_GEMM };
#define TG_LA(T, r) (((void **)(T)[5])[r])

/* w = the lower triangle of (a + aᵀ)·½, zeros above (ops.linalg.sym_lower). */
TG_FN void tg_la_symlower(const real *a, real *w, long n)
{
    for (long i = 0; i < n; i++)
        for (long j = 0; j < n; j++)
        {
            const real s = (a[i * n + j] + a[j * n + i]) * R(0.5);
            w[i * n + j] = j <= i ? s : R(0.0);
        }
}

TG_FN long tg_la_potrf(void **T, real *w, long n)
{
    char uplo = 'U';
    tg_bint N = n, info = 0;
    ((tg_potrf_t)TG_LA(T, TG_POTRF))(&uplo, &N, w, &N, &info);
    return (long)info;
}

TG_FN long tg_la_getrf(void **T, real *w, tg_bint *ipiv, long n)
{
    tg_bint N = n, info = 0;
    ((tg_getrf_t)TG_LA(T, TG_GETRF))(&N, &N, w, &N, ipiv, &info);
    return (long)info;
}

/* M·X = B on column-major views: w (n×n) holds Mᵀ row-major, bt (k×n) holds B row-major (ops.linalg). */
TG_FN long tg_la_gesv(void **T, real *w, tg_bint *ipiv, real *bt, long n, long k)
{
    tg_bint N = n, K = k, info = 0;
    ((tg_gesv_t)TG_LA(T, TG_GESV))(&N, &K, w, &N, ipiv, bt, &N, &info);
    return (long)info;
}

/* row-major c = m⁻ᵀ (ops.linalg.inverse): gesv on the identity with w = mᵀ. */
TG_FN void tg_la_inverse(void **T, const real *m, real *w, tg_bint *ipiv, real *c, long n)
{
    for (long i = 0; i < n; i++)
        for (long j = 0; j < n; j++)
            w[i * n + j] = m[j * n + i];
    for (long i = 0; i < n * n; i++)
        c[i] = i % (n + 1) == 0 ? R(1.0) : R(0.0);
    tg_la_gesv(T, w, ipiv, c, n, n);
}

/* trsm / trmm on a row-major b (m×n) with a k×k triangular a: side and triangle flip. */
TG_FN void tg_la_tri(void **T, int r, int left, int lower, int trans, int unit, const real *a, real *b, long m,
                     long n, long k)
{
    char side = left ? 'R' : 'L', uplo = lower ? 'U' : 'L', tr = trans ? 'T' : 'N', dg = unit ? 'U' : 'N';
    tg_bint cm = n, cn = m, lda = k;
    real one = R(1.0);
    ((tg_trsm_t)TG_LA(T, r))(&side, &uplo, &tr, &dg, &cm, &cn, &one, (real *)a, &lda, b, &cm);
}

/* row-major c (m×n) = alpha·op(a)·op(b), inner dimension k (ops.linalg.Lapack.gemm). */
TG_FN void tg_la_gemm(void **T, int ta, int tb, real alpha, const real *a, const real *b, real *c, long m, long n,
                      long k)
{
    char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    tg_bint M = m, N = n, K = k, lda = ta ? m : k, ldb = tb ? k : n;
    real zero = R(0.0);
    ((tg_gemm_t)TG_LA(T, TG_GEMM))(&tB, &tA, &N, &M, &K, &alpha, (real *)b, &ldb, (real *)a, &lda, &zero, c, &N);
}

/* zero the entries of a row-major n×n c outside the triangle a solve reads (ops.linalg.trisolve_da). */
TG_FN void tg_la_keep_triangle(real *c, long n, int lower, int unit)
{
    /* each row's zeros as one range: a conditional store per element became a masked store */
    for (long i = 0; i < n; i++) {
        const long lo = lower ? i + !unit : 0, hi = lower ? n : i + (unit != 0);
        for (long j = lo; j < hi; j++)
            c[i * n + j] = R(0.0);
    }
}

TG_FN void tg_la_nan(real *x, long n)
{
    for (long i = 0; i < n; i++)
        x[i] = NAN;
}

/* cholesky: out = L of (a + aᵀ)/2 for each of nb matrices. */
TG_FN void tg_cholesky(void **T, const real *a, real *out, long nb, long n)
{
    for (long q = 0; q < nb; q++) {
        tg_la_symlower(a + q * n * n, out + q * n * n, n);
        if (tg_la_potrf(T, out + q * n * n, n)) {
            tg_la_nan(out, nb * n * n);
            return;
        }
    }
}

/* cholesky_da (Murray 2016): c = sym(L⁻ᵀ Φ(Lᵀ tril(g)) L⁻¹), in place in c. */
TG_FN void tg_cholesky_da(void **T, const real *L, const real *g, real *c, long nb, long n)
{
    for (long q = 0; q < nb; q++) {
        const real *l = L + q * n * n;
        real *m = c + q * n * n;
        for (long i = 0; i < n * n; i++)
        {
            const real x = g[q * n * n + i];
            m[i] = (i % n) > (i / n) ? R(0.0) : x;
        }
        tg_la_tri(T, TG_TRMM, 1, 1, 1, 0, l, m, n, n, n);
        for (long i = 0; i < n; i++) {
            for (long j = i + 1; j < n; j++)
                m[i * n + j] = R(0.0);
            m[i * n + i] = m[i * n + i] * R(0.5);
        }
        tg_la_tri(T, TG_TRSM, 1, 1, 1, 0, l, m, n, n, n);
        tg_la_tri(T, TG_TRSM, 0, 1, 0, 0, l, m, n, n, n);
        for (long i = 0; i < n; i++)
            for (long j = i; j < n; j++) {
                real s = (m[i * n + j] + m[j * n + i]) * R(0.5);
                m[i * n + j] = s;
                m[j * n + i] = s;
            }
    }
}

/* triangular_solve: x = op(a)⁻¹ b or b op(a)⁻¹ in place in x (a copy of b); a: nb × k×k, x: nb × m×n. */
TG_FN void tg_trisolve(void **T, int left, int lower, int trans, int unit, const real *a, real *x, long nb, long m,
                       long n)
{
    long k = left ? m : n;
    for (long q = 0; q < nb; q++)
        tg_la_tri(T, TG_TRSM, left, lower, trans, unit, a + q * k * k, x + q * m * n, m, n, k);
}

/* triangular_solve_da: c = the triangle of −B̄ Xᵀ / −X B̄ᵀ (left) or −Xᵀ B̄ / −B̄ᵀ X (right). */
TG_FN void tg_trisolve_da(void **T, int left, int lower, int trans, int unit, const real *x, const real *bbar,
                          real *c, long nb, long m, long n)
{
    long k = left ? m : n;
    for (long q = 0; q < nb; q++) {
        const real *X = x + q * m * n, *B = bbar + q * m * n;
        real *C = c + q * k * k;
        if (left)
            tg_la_gemm(T, 0, 1, R(-1.0), trans ? X : B, trans ? B : X, C, k, k, n);
        else
            tg_la_gemm(T, 1, 0, R(-1.0), trans ? B : X, trans ? X : B, C, k, k, m);
        tg_la_keep_triangle(C, k, lower, unit);
    }
}

/* solve: x = a⁻¹ b by gesv on column-major copies (ops.linalg.solve_fwd); w: n×n, bt: k×n, ipiv: n. */
TG_FN void tg_solve(void **T, const real *a, const real *b, real *x, real *w, real *bt, tg_bint *ipiv, long nb,
                    long n, long k)
{
    for (long q = 0; q < nb; q++) {
        for (long i = 0; i < n; i++)
            for (long j = 0; j < n; j++)
                w[i * n + j] = a[q * n * n + j * n + i];
        for (long i = 0; i < n; i++)
            for (long j = 0; j < k; j++)
                bt[j * n + i] = b[q * n * k + i * k + j];
        if (tg_la_gesv(T, w, ipiv, bt, n, k)) {
            tg_la_nan(x, nb * n * k);
            return;
        }
        for (long i = 0; i < n; i++)
            for (long j = 0; j < k; j++)
                x[q * n * k + i * k + j] = bt[j * n + i];
    }
}

/* B̄ᵀ = (a⁻ᵀ g)ᵀ for each matrix (ops.linalg.solve_bbar): yt is nb × k×n. */
TG_FN void tg_solve_bbar(void **T, const real *a, const real *g, real *yt, real *w, tg_bint *ipiv, long nb, long n,
                         long k)
{
    for (long q = 0; q < nb; q++) {
        memcpy(w, a + q * n * n, (size_t)(n * n) * sizeof(real));
        for (long i = 0; i < n; i++)
            for (long j = 0; j < k; j++)
                yt[q * n * k + j * n + i] = g[q * n * k + i * k + j];
        tg_la_gesv(T, w, ipiv, yt + q * n * k, n, k);
    }
}

/* logdet: 2·Σ log Lᵢᵢ summed in order in double with the C library's log, rounded once (ops.linalg). */
TG_FN void tg_logdet(void **T, const real *a, real *out, real *w, long nb, long n)
{
    for (long q = 0; q < nb; q++) {
        tg_la_symlower(a + q * n * n, w, n);
        if (tg_la_potrf(T, w, n)) {
            tg_la_nan(out, nb);
            return;
        }
        double acc = 0.0;
        for (long i = 0; i < n; i++)
            acc = acc + log((double)w[i * n + i]);
        out[q] = (real)(2.0 * acc);
    }
}

/* logdet_da: c = g · sym(m⁻ᵀ), m = (a + aᵀ)/2 (ops.linalg.logdet_da); w, m: n×n scratch. */
TG_FN void tg_logdet_da(void **T, const real *a, const real *g, real *c, real *w, real *m, tg_bint *ipiv, long nb,
                        long n)
{
    for (long q = 0; q < nb; q++) {
        const real *A = a + q * n * n;
        real *C = c + q * n * n;
        for (long i = 0; i < n; i++)
            for (long j = 0; j < n; j++)
                m[i * n + j] = (A[i * n + j] + A[j * n + i]) * R(0.5);
        tg_la_inverse(T, m, w, ipiv, C, n);
        for (long i = 0; i < n; i++)
            for (long j = 0; j < n; j++)
                m[i * n + j] = (C[i * n + j] + C[j * n + i]) * R(0.5);
        for (long i = 0; i < n * n; i++)
            C[i] = m[i] * g[q];
    }
}

/* logabsdet: Σ log|Uᵢᵢ| of the LU factors in order in double (log 0 = −inf); det_sign: Π sign(Uᵢᵢ) times
 * −1 per row interchange (ops.linalg.logabsdet_fwd / det_sign_fwd). */
TG_FN void tg_slogdet(void **T, int sign, const real *a, real *out, real *w, tg_bint *ipiv, long nb, long n)
{
    for (long q = 0; q < nb; q++) {
        memcpy(w, a + q * n * n, (size_t)(n * n) * sizeof(real));
        tg_la_getrf(T, w, ipiv, n);
        double acc = sign ? 1.0 : 0.0;
        for (long i = 0; i < n; i++) {
            double d = (double)w[i * n + i];
            if (sign)
                acc = acc * (d > 0.0 ? 1.0 : d < 0.0 ? -1.0 : 0.0) * (ipiv[i] == i + 1 ? 1.0 : -1.0);
            else
                acc = acc + (d == 0.0 ? -INFINITY : log(fabs(d)));
        }
        out[q] = (real)acc;
    }
}

/* logabsdet_da: c = g · A⁻ᵀ (ops.linalg.logabsdet_da). */
TG_FN void tg_logabsdet_da(void **T, const real *a, const real *g, real *c, real *w, tg_bint *ipiv, long nb, long n)
{
    for (long q = 0; q < nb; q++) {
        real *C = c + q * n * n;
        tg_la_inverse(T, a + q * n * n, w, ipiv, C, n);
        for (long i = 0; i < n * n; i++)
            C[i] = C[i] * g[q];
    }
}
