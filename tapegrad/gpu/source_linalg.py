"""CUDA kernels of the linear-algebra family: cholesky, triangular_solve, solve, logdet, logabsdet, det_sign.

The native program calls LAPACK (potrf, getrf, gesv, trsm, trmm, gemm: tier "blas"); the device has no
LAPACK of its own here, so each matrix (or each right-hand side of a triangular solve) is one thread
running the textbook serial algorithm: Cholesky–Crout by columns, LU with partial pivoting (the first
largest |entry| as pivot, as getrf's idamax), forward and back substitution, every sum serial in index
order. The results agree with the native program within the "blas" bound (stated and tested in
``tests/test_gpu_ops_more.py``), not bit for bit. The formulas around them are the registry's
(``tapegrad/ops/linalg.py``: Murray's Cholesky gradient, Giles's inverse-product and determinant rules).

As in the native program, a matrix that is not positive definite (cholesky, logdet) or exactly singular
(solve) fills the whole node's value with NaN: the per-matrix kernel raises a flag in scratch S4 and a
second kernel, one thread per output element, reads the flags.
"""
import math

HELPERS = r"""/* tapegrad.gpu.source_linalg: serial dense linear algebra, one thread per matrix */
__device__ static __attribute__((unused)) void tg_trsv(const real *A, long n, int lower, int trans, int unit,
                                                      real *x, long xs)
{   /* x <- op(T)⁻¹ x, T the lower (or upper) triangle of A, op(T) = T or Tᵀ, x strided by xs */
    if (lower != trans) {
        for (long i = 0; i < n; i++) {
            real s = x[i * xs];
            for (long j = 0; j < i; j++)
                s = TG_SUB(s, TG_MUL(trans ? A[j * n + i] : A[i * n + j], x[j * xs]));
            x[i * xs] = unit ? s : TG_DIV(s, A[i * n + i]);
        }
    } else {
        for (long i = n - 1; i >= 0; i--) {
            real s = x[i * xs];
            for (long j = i + 1; j < n; j++)
                s = TG_SUB(s, TG_MUL(trans ? A[j * n + i] : A[i * n + j], x[j * xs]));
            x[i * xs] = unit ? s : TG_DIV(s, A[i * n + i]);
        }
    }
}

__device__ static __attribute__((unused)) long tg_chol(real *L, long n)
{   /* Cholesky–Crout in place on the lower triangle (zeros above stay); 0, or k + 1 when the leading
       minor of order k + 1 is not positive definite */
    for (long j = 0; j < n; j++) {
        real d = L[j * n + j];
        for (long t = 0; t < j; t++)
            d = TG_SUB(d, TG_MUL(L[j * n + t], L[j * n + t]));
        if (!(d > (real)0))
            return j + 1;
        d = TG_SQRT(d);
        L[j * n + j] = d;
        for (long i = j + 1; i < n; i++) {
            real s = L[i * n + j];
            for (long t = 0; t < j; t++)
                s = TG_SUB(s, TG_MUL(L[i * n + t], L[j * n + t]));
            L[i * n + j] = TG_DIV(s, d);
        }
    }
    return 0;
}

__device__ static __attribute__((unused)) long tg_lu(real *W, long n, real *piv)
{   /* LU with partial pivoting in place (unit lower factor below the diagonal); piv[k] = the row swapped
       with row k; 0, or k + 1 for the first exactly zero pivot U[k][k] */
    long info = 0;
    for (long k = 0; k < n; k++) {
        long p = k;
        for (long i = k + 1; i < n; i++)
            if (fabs(W[i * n + k]) > fabs(W[p * n + k]))
                p = i;
        piv[k] = (real)p;
        if (p != k)
            for (long j = 0; j < n; j++) {
                const real t = W[k * n + j];
                W[k * n + j] = W[p * n + j];
                W[p * n + j] = t;
            }
        const real d = W[k * n + k];
        if (d == (real)0) {
            if (!info)
                info = k + 1;
            continue;
        }
        for (long i = k + 1; i < n; i++) {
            const real l = TG_DIV(W[i * n + k], d);
            W[i * n + k] = l;
            for (long j = k + 1; j < n; j++)
                W[i * n + j] = TG_SUB(W[i * n + j], TG_MUL(l, W[k * n + j]));
        }
    }
    return info;
}

__device__ static __attribute__((unused)) void tg_lu_solve(const real *W, const real *piv, long n, real *X, long k)
{   /* X (n×k) <- M⁻¹ X for the LU factors W, piv of M */
    for (long i = 0; i < n; i++) {
        const long p = (long)piv[i];
        if (p != i)
            for (long c = 0; c < k; c++) {
                const real t = X[i * k + c];
                X[i * k + c] = X[p * k + c];
                X[p * k + c] = t;
            }
    }
    for (long c = 0; c < k; c++) {
        for (long i = 0; i < n; i++) {
            real s = X[i * k + c];
            for (long j = 0; j < i; j++)
                s = TG_SUB(s, TG_MUL(W[i * n + j], X[j * k + c]));
            X[i * k + c] = s;
        }
        for (long i = n - 1; i >= 0; i--) {
            real s = X[i * k + c];
            for (long j = i + 1; j < n; j++)
                s = TG_SUB(s, TG_MUL(W[i * n + j], X[j * k + c]));
            X[i * k + c] = TG_DIV(s, W[i * n + i]);
        }
    }
}
"""


def helpers(f32):
    """The helpers above with the dialect's arithmetic (``__d*_rn``/``__f*_rn``: nothing contracts)."""
    r = "f" if f32 else "d"
    return [f"#define TG_ADD(x, y) __{r}add_rn(x, y)", f"#define TG_SUB(x, y) __{r}sub_rn(x, y)",
            f"#define TG_MUL(x, y) __{r}mul_rn(x, y)", f"#define TG_DIV(x, y) __{r}div_rn(x, y)",
            f"#define TG_SQRT(x) {'sqrtf' if f32 else 'sqrt'}(x)", HELPERS]


def _dims(g, a):
    sh = g.p.shapes[a]
    return math.prod(sh[:-2]), sh[-1]


def _per_matrix(g, tag, nb, lines):
    g.linalg = True
    return g.flat(tag, nb, ["const long q = i;"] + lines)


def _nan_fill(g, k, nb):
    """The node's value all NaN when any matrix raised its flag (S4), as the native program does."""
    return g.flat(f"n{k}", g.n(k), ["int bad = 0;", f"for (long q = 0; q < {nb}L; q++) bad |= S4[q] != {g.d.lit(0.0)};",
                                    f"if (bad) v{k}[i] = NAN;"])


def _sym(g, dst, src, n, lower_only):
    """dst = (src + srcᵀ)·½ (only its lower triangle, zeros above, with ``lower_only``: ops.linalg.sym_lower)."""
    e = g.mul(g.add(f"{src}[r * {n}L + c]", f"{src}[c * {n}L + r]"), g.d.lit(0.5))
    if lower_only:
        e = f"c <= r ? {e} : {g.d.lit(0.0)}"
    return [f"for (long r = 0; r < {n}L; r++)", f"    for (long c = 0; c < {n}L; c++) {dst}[r * {n}L + c] = {e};"]


# ── cholesky ─────────────────────────────────────────────────────────────────

def cholesky_fwd(g, k, op, a, b, s):
    nb, n = _dims(g, a)
    g.scratch(4, nb)
    lines = [f"real *L = v{k} + q * {n * n}L;", f"const real *A = v{a} + q * {n * n}L;"] + _sym(g, "L", "A", n, True) \
        + [f"S4[q] = tg_chol(L, {n}L) ? {g.d.lit(1.0)} : {g.d.lit(0.0)};"]
    return [_per_matrix(g, f"f{k}", nb, lines), _nan_fill(g, k, nb)]


def cholesky_da(g, k, side, first):
    """Murray 2016: P = Lᵀ·tril(ḡ); Φ = tril(P), diagonal halved; P = L⁻ᵀ Φ L⁻¹; ā = (P + Pᵀ)/2"""
    _, a, _, _ = g.p.nodes[k]
    nb, n = _dims(g, a)
    g.scratch(1, nb * n * n)
    zero, half = g.d.lit(0.0), g.d.lit(0.5)
    term = g.mul(f"L[t * {n}L + r]", f"G[t * {n}L + c]")
    lines = [f"const real *L = v{k} + q * {n * n}L, *G = g{k} + q * {n * n}L;", f"real *P = S1 + q * {n * n}L;",
             f"for (long r = 0; r < {n}L; r++)",
             f"    for (long c = 0; c < {n}L; c++) {{",
             f"        real acc = {zero};",
             f"        for (long t = r > c ? r : c; t < {n}L; t++) acc = {g.add('acc', term)};",
             f"        P[r * {n}L + c] = c < r ? acc : (c == r ? {g.mul('acc', half)} : {zero});",
             "    }",
             f"for (long c = 0; c < {n}L; c++) tg_trsv(L, {n}L, 1, 1, 0, P + c, {n}L);",
             f"for (long r = 0; r < {n}L; r++) tg_trsv(L, {n}L, 1, 1, 0, P + r * {n}L, 1L);",
             f"real *C = g{a} + q * {n * n}L;",
             f"for (long r = 0; r < {n}L; r++)",
             f"    for (long c = 0; c < {n}L; c++)",
             "        " + g.put(f"C[r * {n}L + c]", g.mul(g.add(f"P[r * {n}L + c]", f"P[c * {n}L + r]"), half), first)]
    return [_per_matrix(g, f"da{k}", nb, lines)]


# ── triangular_solve ─────────────────────────────────────────────────────────

def _tri_vectors(g, tag, k, a, bshape, s, trans, src, dst, put_first=None):
    """One thread per right-hand side: dst's vector = op(T)⁻¹ src's (left) or src·op(T)⁻¹ (right), with
    op's transpose flag ``trans``; ``put_first`` set: dst is a gradient, the solve goes through S1."""
    left, lower, _, unit = s
    nb, n = math.prod(bshape[:-2]), bshape[-2:]
    m, c = n
    nv, size = (c, m) if left else (m, c)
    xs = c if left else 1
    nn = g.p.shapes[a][-1]
    lines = [f"const long q = i / {nv}L, v = i % {nv}L;",
             f"const long off = q * {m * c}L + {'v' if left else f'v * {c}L'};"]
    work = dst if put_first is None else "S1"
    if put_first is not None:
        g.scratch(1, nb * m * c)
    lines += [f"for (long j = 0; j < {size}L; j++) {work}[off + j * {xs}L] = {src}[off + j * {xs}L];",
              f"tg_trsv(v{a} + q * {nn * nn}L, {nn}L, {int(lower)}, {int(trans != (not left))}, {int(unit)}, "
              f"{work} + off, {xs}L);"]
    if put_first is not None:
        lines += [f"for (long j = 0; j < {size}L; j++)",
                  "    " + g.put(f"{dst}[off + j * {xs}L]", f"S1[off + j * {xs}L]", put_first)]
    g.linalg = True
    return g.flat(tag, nb * nv, lines)


def trisolve_fwd(g, k, op, a, b, s):
    return [_tri_vectors(g, f"f{k}", k, a, g.p.shapes[b], s, s[2], f"v{b}", f"v{k}")]


def trisolve_d(g, k, side, first):
    """b̄ = the same solve with the transpose flag flipped, on ḡ; ā = −b̄ xᵀ (left) or −xᵀ b̄ (right),
    transposed for op(a) = aᵀ, restricted to the triangle the solve reads (Giles 2008)"""
    _, a, b, s = g.p.nodes[k]
    left, lower, trans, unit = s
    bshape = g.p.shapes[b]
    if side == "b":
        return [_tri_vectors(g, f"db{k}", k, a, bshape, s, not trans, f"g{k}", f"g{b}", first)]
    bbar = _tri_vectors(g, f"bb{k}", k, a, bshape, s, not trans, f"g{k}", "S3")
    g.scratch(3, math.prod(bshape))
    nb, n = _dims(g, a)
    m, c = bshape[-2:]
    X, B = f"v{k}[q * {m * c}L + ", f"S3[q * {m * c}L + "
    if left:   # C[r][c'] = −Σ_t P[r][t]·Q[c'][t] over the k columns: (P, Q) = (B̄, X), or (X, B̄) transposed
        P, Q = (X, B) if trans else (B, X)
        term, count = g.mul(f"{P}r * {c}L + t]", f"{Q}cc * {c}L + t]"), c
    else:      # C[r][c'] = −Σ_t P[t][r]·Q[t][c'] over the m rows
        P, Q = (B, X) if trans else (X, B)
        term, count = g.mul(f"{P}t * {n}L + r]", f"{Q}t * {n}L + cc]"), m
    keep = ("cc < r" if lower else "cc > r") if unit else ("cc <= r" if lower else "cc >= r")
    lines = [f"const long q = i / {n * n}L, r = (i / {n}L) % {n}L, cc = i % {n}L;",
             f"real acc = {g.d.lit(0.0)};",
             f"if ({keep}) {{",
             f"    for (long t = 0; t < {count}L; t++) acc = {g.add('acc', term)};",
             "    acc = -acc;", "}",
             g.put(f"g{a}[i]", "acc", first)]
    return [bbar, g.flat(f"da{k}", nb * n * n, lines)]


# ── solve ────────────────────────────────────────────────────────────────────

def _lu_into(g, n, src, transpose):
    """Lines: W (S1) = the matrix q of src (or its transpose), factored; pivots in S2; ``info`` set."""
    at = f"{src}[q * {n * n}L + c * {n}L + r]" if transpose else f"{src}[q * {n * n}L + r * {n}L + c]"
    return [f"real *W = S1 + q * {n * n}L, *piv = S2 + q * {n}L;",
            f"for (long r = 0; r < {n}L; r++)", f"    for (long c = 0; c < {n}L; c++) W[r * {n}L + c] = {at};",
            f"const long info = tg_lu(W, {n}L, piv);", "(void)info;"]


def _lu_scratch(g, nb, n):
    g.scratch(1, nb * n * n)
    g.scratch(2, nb * n)


def solve_fwd(g, k, op, a, b, s):
    nb, n = _dims(g, a)
    kc = g.p.shapes[b][-1]
    _lu_scratch(g, nb, n)
    g.scratch(4, nb)
    lines = _lu_into(g, n, f"v{a}", False) + [
        f"real *X = v{k} + q * {n * kc}L;",
        f"for (long j = 0; j < {n * kc}L; j++) X[j] = v{b}[q * {n * kc}L + j];",
        f"tg_lu_solve(W, piv, {n}L, X, {kc}L);",
        f"S4[q] = info ? {g.d.lit(1.0)} : {g.d.lit(0.0)};"]
    return [_per_matrix(g, f"f{k}", nb, lines), _nan_fill(g, k, nb)]


def solve_d(g, k, side, first):
    """Y = a⁻ᵀ ḡ (S3); b̄ = Y, ā = −Y xᵀ (Giles 2008)"""
    _, a, b, _ = g.p.nodes[k]
    nb, n = _dims(g, a)
    kc = g.p.shapes[b][-1]
    _lu_scratch(g, nb, n)
    g.scratch(3, nb * n * kc)
    lines = _lu_into(g, n, f"v{a}", True) + [
        f"real *Y = S3 + q * {n * kc}L;",
        f"for (long j = 0; j < {n * kc}L; j++) Y[j] = g{k}[q * {n * kc}L + j];",
        f"tg_lu_solve(W, piv, {n}L, Y, {kc}L);"]
    y = _per_matrix(g, f"y{side}{k}", nb, lines)
    if side == "b":
        return [y, g.flat(f"db{k}", nb * n * kc, [g.put(f"g{b}[i]", "S3[i]", first)])]
    term = g.mul(f"S3[q * {n * kc}L + r * {kc}L + t]", f"v{k}[q * {n * kc}L + cc * {kc}L + t]")
    lines = [f"const long q = i / {n * n}L, r = (i / {n}L) % {n}L, cc = i % {n}L;", f"real acc = {g.d.lit(0.0)};",
             f"for (long t = 0; t < {kc}L; t++) acc = {g.add('acc', term)};", g.put(f"g{a}[i]", "(-acc)", first)]
    return [y, g.flat(f"da{k}", nb * n * n, lines)]


# ── logdet, logabsdet, det_sign ──────────────────────────────────────────────

def logdet_fwd(g, k, op, a, b, s):
    """2·Σ log Lᵢᵢ summed in order in double, rounded once (as the native program)"""
    nb, n = _dims(g, a)
    g.scratch(1, nb * n * n)
    g.scratch(4, nb)
    lines = [f"real *W = S1 + q * {n * n}L;", f"const real *A = v{a} + q * {n * n}L;"] + _sym(g, "W", "A", n, True) + [
        f"S4[q] = tg_chol(W, {n}L) ? {g.d.lit(1.0)} : {g.d.lit(0.0)};",
        "double acc = 0.0;",
        f"for (long j = 0; j < {n}L; j++) acc = __dadd_rn(acc, log((double)W[j * {n + 1}L]));",
        f"v{k}[q] = (real)__dmul_rn(2.0, acc);"]
    return [_per_matrix(g, f"f{k}", nb, lines), _nan_fill(g, k, nb)]


def _inverse_lines(g, n, src, transpose):
    """Lines leaving in Y (S3) the inverse of matrix q of src (or of its transpose): LU, then the identity solved."""
    return _lu_into(g, n, src, transpose) + [
        f"real *Y = S3 + q * {n * n}L;",
        f"for (long j = 0; j < {n * n}L; j++) Y[j] = j % {n + 1}L == 0 ? {g.d.lit(1.0)} : {g.d.lit(0.0)};",
        f"tg_lu_solve(W, piv, {n}L, Y, {n}L);"]


def logdet_da(g, k, side, first):
    """ā = ḡ · sym(m⁻¹), m = (a + aᵀ)/2 (Giles 2008, determinant; m⁻¹ symmetrised exactly)"""
    _, a, _, _ = g.p.nodes[k]
    nb, n = _dims(g, a)
    _lu_scratch(g, nb, n)
    g.scratch(3, nb * n * n)
    g.scratch(5, nb * n * n)
    half = g.d.lit(0.5)
    sym = g.mul(g.add(f"Y[r * {n}L + c]", f"Y[c * {n}L + r]"), half)
    lines = [f"real *M = S5 + q * {n * n}L;", f"const real *A = v{a} + q * {n * n}L;"] + _sym(g, "M", "A", n, False) \
        + _inverse_lines(g, n, "S5", False) + [
        f"for (long r = 0; r < {n}L; r++)", f"    for (long c = 0; c < {n}L; c++)",
        "        " + g.put(f"g{a}[q * {n * n}L + r * {n}L + c]", g.mul(sym, f"g{k}[q]"), first)]
    return [_per_matrix(g, f"da{k}", nb, lines)]


def slogdet_fwd(g, k, op, a, b, s):
    """LU of aᵀ (getrf on the row-major buffer): logabsdet Σ log|Uᵢᵢ| in double (−inf at a zero);
    det_sign Π sign(Uᵢᵢ)·(−1 per row interchange)"""
    nb, n = _dims(g, a)
    _lu_scratch(g, nb, n)
    lines = _lu_into(g, n, f"v{a}", True)
    if op.name == "logabsdet":
        lines += ["double acc = 0.0;",
                  f"for (long j = 0; j < {n}L; j++) {{", f"    const real d = W[j * {n + 1}L];",
                  "    acc = __dadd_rn(acc, d == (real)0 ? -(double)INFINITY : log(fabs((double)d)));", "}",
                  f"v{k}[q] = (real)acc;"]
    else:
        one, zero = g.d.lit(1.0), g.d.lit(0.0)
        lines += [f"real sign = {one};",
                  f"for (long j = 0; j < {n}L; j++) {{", f"    const real d = W[j * {n + 1}L];",
                  f"    sign = {g.mul(g.mul('sign', f'(d > {zero} ? {one} : d < {zero} ? -{one} : {zero})'), f'(piv[j] == (real)j ? {one} : -{one})')};",
                  "}", f"v{k}[q] = sign;"]
    return [_per_matrix(g, f"f{k}", nb, lines)]


def logabsdet_da(g, k, side, first):
    """ā = ḡ · a⁻ᵀ (Giles 2008, determinant)"""
    _, a, _, _ = g.p.nodes[k]
    nb, n = _dims(g, a)
    _lu_scratch(g, nb, n)
    g.scratch(3, nb * n * n)
    lines = _inverse_lines(g, n, f"v{a}", True) + [
        f"for (long j = 0; j < {n * n}L; j++)",
        "    " + g.put(f"g{a}[q * {n * n}L + j]", g.mul("Y[j]", f"g{k}[q]"), first)]
    return [_per_matrix(g, f"da{k}", nb, lines)]


def zero_da(g, k, side, first):
    a = g.p.nodes[k][1]
    return [g.flat(f"da{k}", g.n(a), [g.put(f"g{a}[i]", g.d.lit(0.0), first)])]


FORWARD = {"cholesky": cholesky_fwd, "triangular_solve": trisolve_fwd, "solve": solve_fwd, "logdet": logdet_fwd,
           "logabsdet": slogdet_fwd, "det_sign": slogdet_fwd}
BACKWARD = {"cholesky": cholesky_da, "triangular_solve": trisolve_d, "solve": solve_d, "logdet": logdet_da,
            "logabsdet": logabsdet_da, "det_sign": zero_da}
