/* tapegrad native runtime: the generic kernels a generated program calls.
 *
 * Included verbatim after the generated prologue, which defines `real` (double or float), R(x) (a
 * literal of type real), the libm names RSQRT/REXP/RLOG/RFMA/RFABS, and `tg_gemm_t`/`tg_dot_t`. Every
 * kernel repeats the NumPy rule's arithmetic step by step (one rounding per NumPy ufunc call), and every
 * reduction follows NumPy's order: outer indices row-major into an accumulator that starts at 0,
 * the trailing contiguous reduced block summed pairwise (8 accumulators, blocks of 128).
 *
 * Inside loops no element is loaded under a condition: both sides of a select are read first (an
 * index that may point at padding is clamped to a valid element), so the vectoriser emits blends of
 * loaded values and never masked loads or stores, which GCC 11 and 12 get wrong at -O3 with AVX2
 * (tests/test_codegen_compilers.py).
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#ifndef TG_MAXD   /* the largest rank in the program (codegen defines it when a program exceeds 8) */
#define TG_MAXD 8
#endif

/* NumPy's pairwise summation (DOUBLE_pairwise_sum / FLOAT_pairwise_sum), contiguous input. */
TG_FN real tg_pairwise(const real *a, long n)
{
    if (n < 8) {
        real res = R(0.0);
        for (long i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        real r[8];
        long i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        real res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    long n2 = n / 2;
    n2 -= n2 % 8;
    return tg_pairwise(a, n2) + tg_pairwise(a + n2, n - n2);
}

/* The running max (hi) or min of m and a[0..n), in index order: an element replaces m when it is
 * strictly beyond it or NaN, and a NaN m stays. */
TG_FN real tg_extreme_in_order(int hi, real m, const real *a, long n)
{
    for (long i = 0; i < n; i++) {
        const real v = a[i];
        m = (m == m && ((hi ? v > m : v < m) || v != v)) ? v : m;
    }
    return m;
}

/* tg_extreme_in_order, eight lanes at a time. Order shows only in which of several equal elements
 * wins: equal doubles differ in bits only as 0.0 and -0.0, which the "order" tier counts as equal
 * (NumPy's own vectorised max picks either), and as NaNs: a row holding a NaN is walked in order, so
 * its first NaN comes out, as NumPy's does. */
TG_FN real tg_extreme(int hi, real m, const real *a, long n)
{
    if (n < 16)
        return tg_extreme_in_order(hi, m, a, n);
    real r[8];
    int odd = 0;
    for (int j = 0; j < 8; j++)
        r[j] = a[j];
    long i = 8;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            const real v = a[i + j];
            r[j] = (hi ? v > r[j] : v < r[j]) ? v : r[j];
        }
    real e = r[0];
    for (int j = 1; j < 8; j++)
        e = (hi ? r[j] > e : r[j] < e) ? r[j] : e;
    for (; i < n; i++)
        e = (hi ? a[i] > e : a[i] < e) ? a[i] : e;
    for (long q = 0; q < n; q++)
        odd |= a[q] != a[q];
    if (odd)
        return tg_extreme_in_order(hi, m, a, n);
    return (m == m && (hi ? e > m : e < m)) ? e : m;
}

/* out = Σ of x (shape[nd], C-contiguous) over the axes with red[k] = 1; out is the kept-axes array.
 * mode 0: sum; mode 1: max, mode 2: min (NaN propagates); mode 3: product (sequential, as NumPy's multiply
 * reduction, which is not pairwise). When the last axis is kept, each row of the trailing kept
 * block is added into out element by element (NumPy's inner loop; vectorisable, still one ordered chain
 * per output element); when it is reduced, the trailing reduced block is summed pairwise. */
TG_FN void tg_reduce(int mode, const real *x, real *out, int nd0, const long *shape0, const unsigned char *red0)
{
    /* NumPy's iterator drops axes of length 1 before it picks an order: (4, 9, 1) summed over axis 1
     * is pairwise over rows of 9, like (4, 9) over axis 1 */
    long shape[TG_MAXD];
    unsigned char red[TG_MAXD];
    int nd = 0;
    for (int k = 0; k < nd0; k++)
        if (shape0[k] != 1) {
            shape[nd] = shape0[k];
            red[nd++] = red0[k];
        }
    long inner = 1, run = 1, nout = 1;
    int t = nd;
    while (t > 0 && red[t - 1]) {
        t--;
        inner *= shape[t];
    }
    if (t == nd)                      /* the last axis is kept: the trailing kept block is contiguous */
        while (t > 0 && !red[t - 1]) {
            t--;
            run *= shape[t];
        }
    long ost[TG_MAXD], idx[TG_MAXD];
    long s = 1;
    for (int k = nd - 1; k >= 0; k--) {
        ost[k] = red[k] ? 0 : s;
        if (!red[k])
            s *= shape[k];
    }
    nout = s;
    for (long i = 0; i < nout; i++)
        out[i] = mode == 0 ? R(0.0) : mode == 1 ? -INFINITY : mode == 2 ? INFINITY : R(1.0);
    long nouter = 1;
    for (int k = 0; k < t; k++) {
        nouter *= shape[k];
        idx[k] = 0;
    }
    const real *p = x;
    for (long q = 0; q < nouter; q++) {
        long o = 0;
        for (int k = 0; k < t; k++)
            o += idx[k] * ost[k];
        if (run > 1 || inner == 1) {
            real *restrict dst = out + o;
            const real *restrict src = p;
            if (mode == 0) {
                for (long j = 0; j < run; j++)
                    dst[j] = dst[j] + src[j];
            } else if (mode == 1) {
                for (long j = 0; j < run; j++) {
                    const real d = dst[j], v = src[j];
                    dst[j] = (d == d && (v > d || v != v)) ? v : d;
                }
            } else if (mode == 2) {
                for (long j = 0; j < run; j++) {
                    const real d = dst[j], v = src[j];
                    dst[j] = (d == d && (v < d || v != v)) ? v : d;
                }
            } else {
                for (long j = 0; j < run; j++)
                    dst[j] = dst[j] * src[j];
            }
            p += run;
        } else {
            if (mode == 0) {
                out[o] += tg_pairwise(p, inner);
            } else if (mode == 3) {
                real m = out[o];
                for (long i = 0; i < inner; i++)
                    m = m * p[i];
                out[o] = m;
            } else {
                out[o] = tg_extreme(mode == 1, out[o], p, inner);
            }
            p += inner;
        }
        for (int k = t - 1; k >= 0; k--) {
            if (++idx[k] < shape[k])
                break;
            idx[k] = 0;
        }
    }
}

/* Walks the outer axes of shape[nd] (all but the last) in row-major order: o is the source (or
 * destination) offset of each row's first element under the element strides st[nd]; returns 0 after
 * the last row. The rows themselves are the callers' plain loops, which the compiler widens. */
TG_FN int tg_next_row(long *idx, long *o, int nd, const long *shape, const long *st)
{
    for (int k = nd - 2; k >= 0; k--) {
        *o += st[k];
        if (++idx[k] < shape[k])
            return 1;
        *o -= st[k] * shape[k];
        idx[k] = 0;
    }
    return 0;
}

#if defined(__AVX512F__) || (defined(__AVX__) && TG_REAL_BYTES == 4)
/* tg_gather's transposing case, where the source's contiguous axis k is not dst's last one (an attention
 * head's (B, H, D, T) from (B, T, H, D), an LSTM's gates back from (4H, B), NCHW from NHWC): element by
 * element each load is a strided one (0.7-1.4 cycles per float here); in blocks of 8 x 8 it is 8 vector
 * loads, 24 shuffles and 8 vector stores (0.2-0.3). Plain copies: the same bits in another order. Vectors
 * of 8 reals are cheap with AVX for float, with AVX-512 for double (GCC splits them badly, up to 4x
 * slower than the element loop, on narrower units), so only there. */
typedef real tg_v8 __attribute__((vector_size(8 * sizeof(real))));
typedef tg_rint tg_v8m __attribute__((vector_size(8 * sizeof(real))));   /* a shuffle's indices */
#if defined(__clang__) || __GNUC__ >= 12
#define TG_SHUF(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define TG_SHUF(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (tg_v8m){i0, i1, i2, i3, i4, i5, i6, i7})
#endif

/* dst[i·ds + j] = src[j·ss + i] for i, j < 8: interleave pairs, then pairs of pairs, then halves. (No
 * function takes or returns the vectors: a 64-byte one outside AVX-512 changes the ABI, GCC warns.) */
static inline void tg_tr8(real *restrict dst, long ds, const real *restrict src, long ss)
{
    tg_v8 r0, r1, r2, r3, r4, r5, r6, r7;
    memcpy(&r0, src, sizeof r0);
    memcpy(&r1, src + ss, sizeof r1);
    memcpy(&r2, src + 2 * ss, sizeof r2);
    memcpy(&r3, src + 3 * ss, sizeof r3);
    memcpy(&r4, src + 4 * ss, sizeof r4);
    memcpy(&r5, src + 5 * ss, sizeof r5);
    memcpy(&r6, src + 6 * ss, sizeof r6);
    memcpy(&r7, src + 7 * ss, sizeof r7);
    tg_v8 t0 = TG_SHUF(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = TG_SHUF(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    tg_v8 t2 = TG_SHUF(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = TG_SHUF(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    tg_v8 t4 = TG_SHUF(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = TG_SHUF(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    tg_v8 t6 = TG_SHUF(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = TG_SHUF(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    tg_v8 u0 = TG_SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), u1 = TG_SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    tg_v8 u2 = TG_SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), u3 = TG_SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    tg_v8 u4 = TG_SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), u5 = TG_SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    tg_v8 u6 = TG_SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), u7 = TG_SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    r0 = TG_SHUF(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11);
    r1 = TG_SHUF(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11);
    r2 = TG_SHUF(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11);
    r3 = TG_SHUF(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11);
    r4 = TG_SHUF(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15);
    r5 = TG_SHUF(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15);
    r6 = TG_SHUF(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15);
    r7 = TG_SHUF(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15);
    memcpy(dst, &r0, sizeof r0);
    memcpy(dst + ds, &r1, sizeof r1);
    memcpy(dst + 2 * ds, &r2, sizeof r2);
    memcpy(dst + 3 * ds, &r3, sizeof r3);
    memcpy(dst + 4 * ds, &r4, sizeof r4);
    memcpy(dst + 5 * ds, &r5, sizeof r5);
    memcpy(dst + 6 * ds, &r6, sizeof r6);
    memcpy(dst + 7 * ds, &r7, sizeof r7);
}

/* Returns 0 (nothing done) where the case does not apply. */
TG_FN int tg_gather_blocks(real *dst, const real *src, int nd, const long *shape, const long *sst)
{
    const int l = nd - 1;
    int k = -1;
    if (nd < 2 || sst[l] == 1 || sst[l] == 0 || shape[l] < 8)
        return 0;
    for (int d = l - 1; d >= 0 && k < 0; d--)
        if (sst[d] == 1 && shape[d] >= 8 && shape[d] * shape[l] >= 256)
            k = d;
    if (k < 0)
        return 0;
    long dstr[TG_MAXD], idx[TG_MAXD] = {0}, s = 1;
    for (int d = l; d >= 0; d--) {
        dstr[d] = s;
        s *= shape[d];
    }
    const long nk = shape[k], nl = shape[l], sl = sst[l], dk = dstr[k];
    for (;;) {
        long so = 0, dof = 0;
        for (int d = 0; d < l; d++)
            if (d != k) {
                so += idx[d] * sst[d];
                dof += idx[d] * dstr[d];
            }
        real *restrict d0 = dst + dof;
        const real *restrict s0 = src + so;
        long i0 = 0;
        for (; i0 + 8 <= nk; i0 += 8) {
            long j0 = 0;
            for (; j0 + 8 <= nl; j0 += 8)
                tg_tr8(d0 + i0 * dk + j0, dk, s0 + i0 + j0 * sl, sl);
            for (long i = i0; i < i0 + 8; i++)
                for (long j = j0; j < nl; j++)
                    d0[i * dk + j] = s0[i + j * sl];
        }
        for (long i = i0; i < nk; i++)
            for (long j = 0; j < nl; j++)
                d0[i * dk + j] = s0[i + j * sl];
        int d = l - 1;
        for (; d >= 0; d--) {
            if (d == k)
                continue;
            if (++idx[d] < shape[d])
                break;
            idx[d] = 0;
        }
        if (d < 0)
            return 1;
    }
}
#else
#define tg_gather_blocks(dst, src, nd, shape, sst) 0
#endif

/* dst (C-contiguous, shape[nd]) = src read with element strides sst[nd] (0 = broadcast). */
TG_FN void tg_gather(real *dst, const real *src, int nd, const long *shape, const long *sst)
{
    long idx[TG_MAXD] = {0}, o = 0, n = 1;
    for (int k = 0; k < nd; k++)
        n *= shape[k];
    if (n == 0 || tg_gather_blocks(dst, src, nd, shape, sst))
        return;
    const long w = nd ? shape[nd - 1] : 1, s = nd ? sst[nd - 1] : 0;
    do {
        for (long j = 0; j < w; j++)
            dst[j] = src[o + j * s];
        dst += w;
    } while (tg_next_row(idx, &o, nd, shape, sst));
}

/* dst read with element strides dstr[nd] ← (first ? src : dst + src), src C-contiguous of shape[nd];
 * element by element in src's order (a stride of 0 adds into one element, in that order). */
TG_FN void tg_scatter(real *dst, const long *dstr, const real *src, int nd, const long *shape, int first)
{
    long idx[TG_MAXD] = {0}, o = 0, n = 1;
    for (int k = 0; k < nd; k++)
        n *= shape[k];
    if (n == 0)
        return;
    const long w = nd ? shape[nd - 1] : 1, s = nd ? dstr[nd - 1] : 0;
    do {
        for (long j = 0; j < w; j++) {
            const real v = src[j], d = dst[o + j * s];
            dst[o + j * s] = first ? v : d + v;
        }
        src += w;
    } while (tg_next_row(idx, &o, nd, shape, dstr));
}

/* gradient accumulation: the first contribution is copied, later ones added (Tape._accumulate). */
TG_FN void tg_acc(real *restrict gbuf, const real *restrict c, long n, int first)
{
    if (first)
        memcpy(gbuf, c, (size_t)n * sizeof(real));
    else
        for (long i = 0; i < n; i++)
            gbuf[i] = gbuf[i] + c[i];
}

TG_FN void tg_fill(real *p, long n, real v)
{
    for (long i = 0; i < n; i++)
        p[i] = v;
}

/* Small products in C: C[m,n] = op(A) @ op(B) row-major without a BLAS call. A 4 x 2-vector block of
 * C stays in registers across k (GNU C vector types of 32 bytes, which the compiler maps onto whatever
 * the CPU has: one AVX register, two SSE registers, ...). Every element is one chain over k in order
 * from 0 of `acc + a * b`, which this one function lets the compiler contract into a fused multiply-add
 * where the CPU has one (everything else is built with -ffp-contract=off). That is the accumulation
 * OpenBLAS's Haswell/Zen double-precision kernels perform within one K block (bit-identical products
 * measured), and in every case one fixed order: the result does not depend on alignment, blocking or
 * the thread that runs it, and stays within the "blas" tier's bound of any BLAS. A transposed B (tb) is
 * first copied into a [k, n] panel. */
#if defined(__clang__)
#define TG_CONTRACT_FN
#define TG_CONTRACT _Pragma("clang fp contract(fast)")
#else
#define TG_CONTRACT_FN __attribute__((optimize("fp-contract=fast")))
#define TG_CONTRACT
#endif
#define TG_MM_PANEL 16384   /* largest k·n of a transposed B this path copies (128 KiB of doubles) */
#if defined(__AVX__)   /* 32-byte vectors; without AVX (x86-64-v2, other CPUs) 16, the widest there */
#define TG_VBYTES 32
#else
#define TG_VBYTES 16
#endif
#define TG_VW ((int)(TG_VBYTES / sizeof(real)))
typedef real tg_vr __attribute__((vector_size(TG_VBYTES)));
typedef real tg_vh __attribute__((vector_size(TG_VBYTES / 2)));

static inline tg_vr tg_vload(const real *p)
{
    tg_vr v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void tg_vstore(real *p, tg_vr v)
{
    memcpy(p, &v, sizeof v);
}

static inline tg_vh tg_hload(const real *p)
{
    tg_vh v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void tg_hstore(real *p, tg_vh v)
{
    memcpy(p, &v, sizeof v);
}

TG_CONTRACT_FN TG_FN void tg_mm_block(long i0, long j0, int rows, int cols, long k, long sa, long sp,
                                      const real *A, const real *B, long n, real *C)
{
    TG_CONTRACT
    const real *a = A + i0 * sa;
    if (rows == 4 && cols == 2 * TG_VW) {
        tg_vr c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
        for (long p = 0; p < k; p++) {
            const real *b = B + p * n + j0;
            const tg_vr b0 = tg_vload(b), b1 = tg_vload(b + TG_VW);
            const real a0 = a[p * sp], a1 = a[sa + p * sp], a2 = a[2 * sa + p * sp], a3 = a[3 * sa + p * sp];
            c00 = c00 + a0 * b0;
            c01 = c01 + a0 * b1;
            c10 = c10 + a1 * b0;
            c11 = c11 + a1 * b1;
            c20 = c20 + a2 * b0;
            c21 = c21 + a2 * b1;
            c30 = c30 + a3 * b0;
            c31 = c31 + a3 * b1;
        }
        real *o = C + i0 * n + j0;
        tg_vstore(o, c00);
        tg_vstore(o + TG_VW, c01);
        tg_vstore(o + n, c10);
        tg_vstore(o + n + TG_VW, c11);
        tg_vstore(o + 2 * n, c20);
        tg_vstore(o + 2 * n + TG_VW, c21);
        tg_vstore(o + 3 * n, c30);
        tg_vstore(o + 3 * n + TG_VW, c31);
        return;
    }
    if (rows == 4 && cols == TG_VW) {
        tg_vr c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
        for (long p = 0; p < k; p++) {
            const tg_vr b0 = tg_vload(B + p * n + j0);
            c0 = c0 + a[p * sp] * b0;
            c1 = c1 + a[sa + p * sp] * b0;
            c2 = c2 + a[2 * sa + p * sp] * b0;
            c3 = c3 + a[3 * sa + p * sp] * b0;
        }
        real *o = C + i0 * n + j0;
        tg_vstore(o, c0);
        tg_vstore(o + n, c1);
        tg_vstore(o + 2 * n, c2);
        tg_vstore(o + 3 * n, c3);
        return;
    }
    if (rows == 4 && cols == TG_VW / 2) {
        tg_vh c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
        for (long p = 0; p < k; p++) {
            const tg_vh b0 = tg_hload(B + p * n + j0);
            c0 = c0 + a[p * sp] * b0;
            c1 = c1 + a[sa + p * sp] * b0;
            c2 = c2 + a[2 * sa + p * sp] * b0;
            c3 = c3 + a[3 * sa + p * sp] * b0;
        }
        real *o = C + i0 * n + j0;
        tg_hstore(o, c0);
        tg_hstore(o + n, c1);
        tg_hstore(o + 2 * n, c2);
        tg_hstore(o + 3 * n, c3);
        return;
    }
    real acc[4][2 * TG_VW];   /* an edge block: the same chains, p outermost so they overlap */
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            acc[r][c] = R(0.0);
    for (long p = 0; p < k; p++) {
        const real *b = B + p * n + j0;
        for (int r = 0; r < rows; r++) {
            const real ar = a[r * sa + p * sp];
            for (int c = 0; c < cols; c++)
                acc[r][c] = acc[r][c] + ar * b[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            C[(i0 + r) * n + j0 + c] = acc[r][c];
}

TG_FN void tg_mm_small(int ta, int tb, long m, long n, long k, const real *A, const real *B, real *C)
{
    real panel[tb ? k * n : 1];
    if (tb) {
        for (long p = 0; p < k; p++)
            for (long j = 0; j < n; j++)
                panel[p * n + j] = B[j * k + p];
        B = panel;
    }
    long sa = ta ? 1 : k, sp = ta ? m : 1;   /* op(A)[i, p] = A[i * sa + p * sp] */
    for (long i = 0; i < m; i += 4) {
        int rows = m - i < 4 ? (int)(m - i) : 4;
        for (long j = 0; j < n;) {   /* two-vector blocks, then one vector, a half, the scalar rest */
            int cols = n - j >= 2 * TG_VW ? 2 * TG_VW : n - j >= TG_VW ? TG_VW : n - j >= TG_VW / 2 ? TG_VW / 2
                       : (int)(n - j);
            tg_mm_block(i, j, rows, cols, k, sa, sp, A, B, n, C);
            j += cols;
        }
    }
}

/* A caller that runs a program on a thread pool (the XLA handler) puts a tg_team at T[6]: products of
 * at least min_mnk multiply-adds are then split by rows into `parts` independent BLAS calls that
 * `run` executes on the pool (each C element is computed by one call, in BLAS's own order), and an
 * optimizer update of at least min_upd parameters is split into `parts` ranges of elements (each
 * element's update is the same arithmetic whichever part runs it). 0: never. */
typedef struct tg_team {
    void (*run)(struct tg_team *self, int parts, void (*fn)(void *, int), void *arg);
    long min_mnk;
    int parts;
    long min_upd;
} tg_team;

/* The team of a program called directly (the native runner; XLA's handler brings its own pool): part 0
 * runs on the caller, the others on threads started for the call and joined before it returns; a part
 * whose thread cannot start runs on the caller. */
typedef struct {
    void (*fn)(void *, int);
    void *arg;
    int part;
} tg_thread_part;

static void *tg_thread_main(void *arg)
{
    const tg_thread_part *t = (const tg_thread_part *)arg;
    t->fn(t->arg, t->part);
    return NULL;
}

#define TG_THREADS_MAX 64

TG_FN void tg_threads_run(tg_team *self, int parts, void (*fn)(void *, int), void *arg)
{
    pthread_t th[TG_THREADS_MAX];
    tg_thread_part job[TG_THREADS_MAX];
    int up[TG_THREADS_MAX];
    (void)self;
    for (int i = 1; i < parts; i++) {
        job[i] = (tg_thread_part){fn, arg, i};
        up[i] = pthread_create(&th[i], NULL, tg_thread_main, &job[i]) == 0;
    }
    fn(arg, 0);
    for (int i = 1; i < parts; i++) {
        if (up[i])
            pthread_join(th[i], NULL);
        else
            fn(arg, i);
    }
}

static tg_team tg_threads = {tg_threads_run, 0, 1, 0};

/* The direct caller's team, for T[6]: an optimizer update of at least min_upd parameters is split into
 * `parts` (at most TG_THREADS_MAX) element ranges, the same arithmetic per element; products are left
 * to BLAS's own threads. */
void *tg_threads_team(int parts, long min_upd)
{
    tg_threads.parts = parts < 1 ? 1 : parts > TG_THREADS_MAX ? TG_THREADS_MAX : parts;
    tg_threads.min_upd = min_upd;
    return &tg_threads;
}

/* products of fewer multiply-adds run on one BLAS thread (side by side on 2 cores, a 128^3 product was
 * 1.45x faster on BLAS's two threads, a 128x32x128 one no faster, and the flax encoder's program 1.2x
 * slower, 1.5x at the 20th percentile on a loaded machine) */
#define TG_MM_SERIAL (1L << 21)

static _Thread_local void **tg_cur;   /* the table of the running entry point (set on entry) */

typedef struct {
    tg_gemm_t gemm;
    int ta, tb, m, n, k, parts;
    const real *A, *B;
    real *C;
} tg_mm_job;

TG_FN void tg_mm_rows(tg_gemm_t gemm, int ta, int tb, int r0, int r1, int m, int n, int k, const real *A,
                      const real *B, real *C)
{
    char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    tg_bint M = n, N = r1 - r0, K = k, lda = ta ? m : k, ldb = tb ? k : n, ldc = n;
    real one = R(1.0), zero = R(0.0);
    gemm(&tB, &tA, &M, &N, &K, &one, (real *)B, &ldb, (real *)(ta ? A + r0 : A + (long)r0 * k), &lda, &zero,
         C + (long)r0 * n, &ldc);
}

TG_FN void tg_mm_part(void *arg, int i)
{
    const tg_mm_job *j = (const tg_mm_job *)arg;
    int r0 = (int)((long)j->m * i / j->parts), r1 = (int)((long)j->m * (i + 1) / j->parts);
    if (r1 > r0)
        tg_mm_rows(j->gemm, j->ta, j->tb, r0, r1, j->m, j->n, j->k, j->A, j->B, j->C);
}

/* row-major C[m,n] = op(A) @ op(B) (ta/tb: the operand is stored transposed): products of at most
 * TG_MM_SMALL multiply-adds in C above, larger ones through the Fortran BLAS gemm (split over the
 * caller's pool when it gave one). */
TG_FN void tg_mm(tg_gemm_t gemm, int ta, int tb, int m, int n, int k, const real *A, const real *B, real *C)
{
    if (m == 0 || n == 0)
        return;
    if (k == 0) {
        tg_fill(C, (long)m * n, R(0.0));
        return;
    }
    if ((long)m * n * k <= TG_MM_SMALL && (!tb || (long)k * n <= TG_MM_PANEL)) {
        tg_mm_small(ta, tb, m, n, k, A, B, C);
        return;
    }
    tg_team *pool = tg_cur ? (tg_team *)tg_cur[6] : NULL;
    if (pool && pool->parts > 1 && pool->min_mnk > 0 && (long)m * n * k >= pool->min_mnk && m >= 2 * pool->parts) {
        tg_mm_job job = {gemm, ta, tb, m, n, k, pool->parts, A, B, C};
        pool->run(pool, pool->parts, tg_mm_part, &job);
        return;
    }
    /* BLAS's own threads cost more than they save on a product this small (and inside jax.jit they would
     * compete with XLA's): on one thread where the BLAS lets this thread alone ask for it (T[7]) */
    int (*one_thread)(int) = tg_cur && (long)m * n * k < TG_MM_SERIAL ? (int (*)(int))tg_cur[7] : NULL;
    int prior = one_thread ? one_thread(1) : 0;
    tg_mm_rows(gemm, ta, tb, 0, m, m, n, k, A, B, C);
    if (one_thread)
        one_thread(prior);
}

/* The loops of a softmax step over (outer, n, inner), each element's row value r[o·inner + i] at hand:
 * STEP runs once per element, p its flat index and v its row's value. Over rows of n when inner is 1
 * (a last axis: contiguous, what the compiler widens), over runs of inner otherwise. */
#define TG_ROWWISE(outer, n, inner, r, STEP)                                                    \
    do {                                                                                      \
        if ((inner) == 1) {                                                                   \
            for (long o_ = 0; o_ < (outer); o_++) {                                           \
                const real v = (r)[o_];                                                       \
                for (long p = o_ * (n); p < (o_ + 1) * (n); p++) {                            \
                    STEP;                                                                     \
                }                                                                             \
            }                                                                                 \
        } else {                                                                              \
            for (long o_ = 0; o_ < (outer); o_++)                                             \
                for (long j_ = 0; j_ < (n); j_++)                                             \
                    for (long i_ = 0; i_ < (inner); i_++) {                                   \
                        const long p = (o_ * (n) + j_) * (inner) + i_;                        \
                        const real v = (r)[o_ * (inner) + i_];                                \
                        STEP;                                                                 \
                    }                                                                         \
        }                                                                                     \
    } while (0)

/* softmax / logsoftmax over the middle axis of (outer, n, inner); r: scratch of outer·inner. The NumPy
 * rule's steps, each rounded as its ufunc rounds it: max, a − max, exp (the runtime's, tier libm), the sum
 * in NumPy's order, then the division (softmax) or the log and its subtraction (logsoftmax). */
TG_FN void tg_softmax(int log_, const real *restrict a, real *restrict out, real *restrict e, real *restrict r,
                      long outer, long n, long inner)
{
    long sh[3] = {outer, n, inner};
    const unsigned char red[3] = {0, 1, 0};
    tg_reduce(1, a, r, 3, sh, red);
    if (!log_) {
        TG_ROWWISE(outer, n, inner, r, out[p] = tg_exp(a[p] - v));
        tg_reduce(0, out, r, 3, sh, red);
        TG_ROWWISE(outer, n, inner, r, out[p] = out[p] / v);
    } else {
        TG_ROWWISE(outer, n, inner, r, {
            const real d = a[p] - v;
            out[p] = d;
            e[p] = tg_exp(d);
        });
        tg_reduce(0, e, r, 3, sh, red);
        for (long q = 0; q < outer * inner; q++)
            r[q] = tg_log(r[q]);
        TG_ROWWISE(outer, n, inner, r, out[p] = out[p] - v);
    }
}

/* d softmax: c = out · (g − Σ g·out);  d logsoftmax: c = g − exp(out) · Σ g. */
TG_FN void tg_softmax_da(int log_, const real *restrict g, const real *restrict out, real *restrict c,
                         real *restrict r, long outer, long n, long inner)
{
    long sh[3] = {outer, n, inner};
    const unsigned char red[3] = {0, 1, 0};
    long total = outer * n * inner;
    if (!log_) {
        for (long p = 0; p < total; p++)
            c[p] = g[p] * out[p];
        tg_reduce(0, c, r, 3, sh, red);
        TG_ROWWISE(outer, n, inner, r, {
            const real t = g[p] - v;
            c[p] = out[p] * t;
        });
    } else {
        tg_reduce(0, g, r, 3, sh, red);
        TG_ROWWISE(outer, n, inner, r, {
            real t = tg_exp(out[p]);
            t = t * v;
            c[p] = g[p] - t;
        });
    }
}

/* ── the optimizer (optim.py's l2_grad, clip, sgd_update, adam_update, step_scalars) ──────────── */

/* cfg: [kind (0 none, 1 SGD, 2 Adam), lr, b1, b2, eps, eps_mode (0 optax, 1 hat), clip (<= 0: off),
 *       clip_mode (0 optax, 1 seed, 2 torch), nparams, momentum (SGD), nesterov (SGD), ...,
 *       l2[k] at 16 + k, Adam's decoupled weight decay wd[k] at 16 + nparams + k]
 * pinfo (long long, 8 per registered param): [w, g, gt, mu, nu, n, touched, 0] buffer indices into T
 *       (momentum SGD keeps its trace in mu).
 * sc: [count, s0, s1, s2, norm, clipped, lr given, lr]: count advances here, s* are step_scalars(count);
 *       with sc[6] != 0 the step's learning rate is sc[7] instead of cfg's (a schedule's value). */
#define TG_B(i) ((real *)T[TG_FIRST + (i)])

/* x / c, the very bits of the division, at the rate of fused multiply-adds: with y = 1/c rounded to
 * nearest, q = x·y is within two ulps of x/c; a correction q + (x - c·q)·y (the residual exact by FMA)
 * makes it faithful, and a second one rounds it correctly (Markstein's theorem: q faithful and y within
 * half an ulp of 1/c give RN(q + (x - c·q)·y) = RN(x/c)). The residuals are exact away from underflow
 * and overflow: for c with tg_qdiv_by(c) and a run of x with tg_qdiv_ok. ±0 is its own quotient: the
 * compiler may turn a correction's -(q·c - x) into x - q·c, which loses the sign of a zero. Adam's bias
 * corrections are such divisions by a per-step constant, which otherwise bind its step to the divider. */
#define TG_QRUN 256
#define TG_QLO ((real)(sizeof(real) == 4 ? 0x1p-60 : 0x1p-900))
#define TG_QHI ((real)(sizeof(real) == 4 ? 0x1p60 : 0x1p900))
#define TG_CLO ((real)(sizeof(real) == 4 ? 0x1p-30 : 0x1p-60))
static inline real tg_qdiv(real x, real c, real y)
{
    real q = x * y;
    real r = RFMA(q, c, -x);
    q = RFMA(-r, y, q);
    r = RFMA(q, c, -x);
    q = RFMA(-r, y, q);
    return x == R(0.0) ? x : q;
}

/* tg_qdiv may divide by c: c in [TG_CLO, 1], and the CPU has FMA (elsewhere fma() is a library call,
 * slower than the divider) */
TG_FN int tg_qdiv_by(real c)
{
#ifdef __FMA__
    return c >= TG_CLO && c <= R(1.0);
#else
    (void)c;
    return 0;
#endif
}

/* tg_qdiv may divide every x[i], i < n: each is 0 or has |x| in [TG_QLO, TG_QHI] */
TG_FN int tg_qdiv_ok(const real *x, long n)
{
    int wild = 0;
    for (long i = 0; i < n; i++) {
        real m = RFABS(x[i]);
        wild |= (!(m >= TG_QLO) | !(m <= TG_QHI)) & (m != R(0.0));   /* no && (a branch per element) */
    }
    return !wild;
}

/* The update of parameter k's elements [i0, i1): SGD, or Adam in optax's or the seed's order. */
typedef struct {
    void **T;
    const double *cfg;
    const long long *pi;
    int np_, kind, hat, nesterov;
    double lr, b1, b2, eps, maxn, mom;
    long total;   /* elements of the touched parameters */
    int parts;    /* part i updates elements [total·i/parts, total·(i+1)/parts) of their concatenation */
} tg_upd;

TG_FN void tg_upd_range(const tg_upd *up, int k, long i0, long i1)
{
    void **T = up->T;
    const long long *p = up->pi + 8 * k;
    const double *sc = (const double *)T[2];
    real *restrict w = TG_B(p[0]);
    const real *restrict gt = (up->cfg[16 + k] == 0.0 && up->maxn <= 0.0) ? TG_B(p[1]) : TG_B(p[2]);
    if (up->kind == 1 && up->mom == 0.0) {
        real l = (real)up->lr;
        for (long i = i0; i < i1; i++) {
            real t = l * gt[i];
            w[i] = w[i] - t;
        }
        return;
    }
    if (up->kind == 1) {   /* optax's trace: tr = g + m·tr; d = tr, or g + m·tr (Nesterov) */
        real l = (real)up->lr, m = (real)up->mom;
        real *restrict tr = TG_B(p[3]);
        for (long i = i0; i < i1; i++) {
            real t = m * tr[i];
            real d = gt[i] + t;
            tr[i] = d;
            if (up->nesterov) {
                t = m * d;
                d = gt[i] + t;
            }
            t = l * d;
            w[i] = w[i] - t;
        }
        return;
    }
    real *restrict mu = TG_B(p[3]), *restrict nu = TG_B(p[4]);
    double b1 = up->b1, b2 = up->b2;
    real rb1 = (real)b1, rb2 = (real)b2, c1 = (real)(1.0 - b1), c2 = (real)(1.0 - b2), re = (real)up->eps;
    real wd = (real)up->cfg[16 + up->np_ + k];   /* AdamW: u + wd·w before the learning rate */
    if (!up->hat) {
        real nlr = (real)sc[1], bc1 = (real)sc[2], bc2 = (real)sc[3], y1 = R(1.0) / bc1, y2 = R(1.0) / bc2;
        int by = tg_qdiv_by(bc1) && tg_qdiv_by(bc2);
        for (long s = i0; s < i1; s += TG_QRUN) {   /* runs: m and v, then the step */
            long e = i1 - s < TG_QRUN ? i1 : s + TG_QRUN;
            for (long i = s; i < e; i++) {
                real gi = gt[i];
                real t = c1 * gi;
                real m = rb1 * mu[i];
                m = t + m;
                mu[i] = m;
                t = gi * gi;
                t = c2 * t;
                real v = rb2 * nu[i];
                v = t + v;
                nu[i] = v;
            }
            /* two loops: GCC vectorises a select between the forms by running both (0.77x measured) */
            int quick = by && tg_qdiv_ok(mu + s, e - s) && tg_qdiv_ok(nu + s, e - s);
            if (quick && wd == R(0.0)) {
                for (long i = s; i < e; i++) {
                    real t = tg_qdiv(nu[i], bc2, y2);
                    t = RSQRT(t);
                    t = t + re;
                    real u = tg_qdiv(mu[i], bc1, y1);
                    u = u / t;
                    u = nlr * u;
                    w[i] = w[i] + u;
                }
            } else if (wd == R(0.0)) {
                for (long i = s; i < e; i++) {
                    real t = nu[i] / bc2;
                    t = RSQRT(t);
                    t = t + re;
                    real u = mu[i] / bc1;
                    u = u / t;
                    u = nlr * u;
                    w[i] = w[i] + u;
                }
            } else {   /* decoupled decay: one form (the slower divider) keeps four loops at three */
                for (long i = s; i < e; i++) {
                    real t = nu[i] / bc2;
                    t = RSQRT(t);
                    t = t + re;
                    real u = mu[i] / bc1;
                    u = u / t;
                    t = wd * w[i];
                    u = u + t;
                    u = nlr * u;
                    w[i] = w[i] + u;
                }
            }
        }
    } else {
        real lrt = (real)sc[1];
        for (long i = i0; i < i1; i++) {
            real gi = gt[i];
            real m = rb1 * mu[i];
            real t = c1 * gi;
            m = m + t;
            mu[i] = m;
            real v = rb2 * nu[i];
            t = gi * gi;
            t = c2 * t;
            v = v + t;
            nu[i] = v;
            t = RSQRT(v);
            t = t + re;
            t = m / t;
            t = lrt * t;
            w[i] = w[i] - t;
        }
    }
}

TG_FN void tg_upd_part(void *arg, int part)
{
    const tg_upd *u = (const tg_upd *)arg;
    long lo = u->total * part / u->parts, hi = u->total * (part + 1) / u->parts, off = 0;
    for (int k = 0; k < u->np_ && off < hi; k++) {
        const long long *p = u->pi + 8 * k;
        if (!p[6])
            continue;
        long n = (long)p[5], i0 = lo > off ? lo - off : 0, i1 = hi - off < n ? hi - off : n;
        if (i1 > i0)
            tg_upd_range(u, k, i0, i1);
        off += n;
    }
}

TG_FN void tg_opt_step(void **T)
{
    double *sc = (double *)T[2];
    const double *cfg = (const double *)T[3];
    const long long *pi = (const long long *)T[4];
    int kind = (int)cfg[0], np_ = (int)cfg[8];
    if (kind == 0)
        return;
    double lr = sc[6] != 0.0 ? sc[7] : cfg[1], b1 = cfg[2], b2 = cfg[3], eps = cfg[4], maxn = cfg[6];
    int hat = (int)cfg[5], cmode = (int)cfg[7];
    double count = sc[0] + 1.0;
    sc[0] = count;
    if (kind == 2)
        tg_adam_scalars(lr, b1, b2, hat, count, sc + 1);
    for (int k = 0; k < np_; k++) {
        const long long *p = pi + 8 * k;
        if (!p[6])
            continue;
        real *w = TG_B(p[0]), *g = TG_B(p[1]), *gt = TG_B(p[2]);
        long n = (long)p[5];
        double l2 = cfg[16 + k];
        if (l2 == 0.0 && maxn <= 0.0)
            continue;   /* the update reads g itself (see below): no copy */
        if (l2 != 0.0) {
            real l = (real)l2;
            for (long i = 0; i < n; i++) {
                real t = l * w[i];
                gt[i] = g[i] + t;
            }
        } else {
            memcpy(gt, g, (size_t)n * sizeof(real));
        }
    }
    sc[4] = 0.0;
    sc[5] = 0.0;
    if (maxn > 0.0) {
        double total = 0.0;
        int any = 0;
        tg_dot_t dot = (tg_dot_t)T[1];
        for (int k = 0; k < np_; k++) {
            const long long *p = pi + 8 * k;
            if (!p[6])
                continue;
            tg_bint n = (tg_bint)p[5], one = 1;
            total += (double)dot(&n, TG_B(p[2]), &one, TG_B(p[2]), &one);
            any = 1;
        }
        double norm = sqrt(total);
        sc[4] = norm;
        /* optim.clips, comparison for comparison: a NaN norm clips in optax's and torch's modes (every g NaN) */
        int clip = !any ? 0 : cmode == 0 ? !(norm < maxn) : cmode == 1 ? norm > maxn : !(maxn / (norm + 1e-6) >= 1.0);
        if (clip) {
            sc[5] = 1.0;
            real rn = (real)norm, rm = (real)maxn;
            real f = cmode == 1 ? (real)(maxn / norm) : (real)(maxn / (norm + 1e-6));
            for (int k = 0; k < np_; k++) {
                const long long *p = pi + 8 * k;
                if (!p[6])
                    continue;
                real *gt = TG_B(p[2]);
                long n = (long)p[5];
                if (cmode == 0)
                    for (long i = 0; i < n; i++) {
                        real t = gt[i] / rn;
                        gt[i] = t * rm;
                    }
                else
                    for (long i = 0; i < n; i++)
                        gt[i] = gt[i] * f;
            }
        }
    }
    tg_upd u = {T, cfg, pi, np_, kind, hat, cfg[10] != 0.0, lr, b1, b2, eps, maxn, cfg[9], 0, 1};
    for (int k = 0; k < np_; k++)
        if (pi[8 * k + 6])
            u.total += (long)pi[8 * k + 5];
    tg_team *pool = (tg_team *)T[6];
    if (pool && pool->parts > 1 && pool->min_upd > 0 && u.total >= pool->min_upd) {
        u.parts = pool->parts;
        pool->run(pool, u.parts, tg_upd_part, &u);
    } else {
        tg_upd_part(&u, 0);
    }
}
