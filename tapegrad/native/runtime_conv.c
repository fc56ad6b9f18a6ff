/* tapegrad native runtime: kernels of the conv family (included after runtime.c).
 *
 * Window geometry arrives as two tables printed by kernels/conv.py:
 *   cv  = {nsp, last, N, C, G, in[nsp], k[nsp], o[nsp]}   (pooling: {nd, 0, 1, 1, 1, in[nd], w[nd], o[nd]})
 *   tab = per spatial dim d, per kernel/window index j, per output index m: the input index read there,
 *         or -1 where that is padding or an lhs-dilation hole.
 * Everything here is data movement or an addition in the order of ops/conv.py's NumPy rules: kernel
 * (window) positions in row-major order, each position's additions landing on distinct elements. */

typedef struct {
    int nsp, last;
    long n, c, g, kk, p, isp, ol, rows;
    long in[TG_MAXD], k[TG_MAXD], o[TG_MAXD], toff[TG_MAXD], ist[TG_MAXD];
} tg_cgeo;

TG_FN tg_cgeo tg_cgeo_of(const long *cv)
{
    tg_cgeo q = {0};   /* entries past nsp stay 0 (GCC otherwise warns that they may be read uninitialised) */
    q.nsp = (int)cv[0];
    q.last = (int)cv[1];
    q.n = cv[2];
    q.c = cv[3];
    q.g = cv[4];
    q.kk = q.p = q.isp = 1;
    long t = 0;
    for (int d = 0; d < q.nsp; d++) {
        q.in[d] = cv[5 + d];
        q.k[d] = cv[5 + q.nsp + d];
        q.o[d] = cv[5 + 2 * q.nsp + d];
        q.toff[d] = t;
        t += q.k[d] * q.o[d];
        q.kk *= q.k[d];
        q.p *= q.o[d];
    }
    for (int d = q.nsp - 1; d >= 0; d--) {
        q.ist[d] = q.isp;
        q.isp *= q.in[d];
    }
    q.ol = q.o[q.nsp - 1];
    q.rows = q.p / q.ol;
    return q;
}

/* dst (x, y, p) = src (y, x, p): the layout changes around the convolution GEMMs (contiguous blocks of p) */
TG_FN void tg_swap01(real *restrict dst, const real *restrict src, long x, long y, long p)
{
    for (long i = 0; i < x; i++)
        for (long j = 0; j < y; j++) {
            real *restrict d = dst + (i * y + j) * p;
            const real *restrict s = src + (j * x + i) * p;
            for (long k = 0; k < p; k++)
                d[k] = s[k];
        }
}

/* kernel position kk as per-dim indices kd[] (row-major) */
TG_FN void tg_kdecode(const tg_cgeo *q, long kk, long *kd)
{
    for (int d = q->nsp - 1; d >= 0; d--) {
        kd[d] = kk % q->k[d];
        kk /= q->k[d];
    }
}

/* the spatial offset in the input of the output row at idx[] (every dim but the last) read by kernel
 * position kd, or -1 when that row falls on padding; rows advance with tg_row_next (no divisions) */
TG_FN long tg_row_base(const tg_cgeo *q, const long *tab, const long *kd, const long *idx)
{
    long off = 0;
    for (int d = 0; d < q->nsp - 1; d++) {
        long i = tab[q->toff[d] + kd[d] * q->o[d] + idx[d]];
        if (i < 0)
            return -1;
        off += i * q->ist[d];
    }
    return off;
}

TG_FN void tg_row_next(const tg_cgeo *q, long *idx)
{
    for (int d = q->nsp - 2; d >= 0; d--) {
        if (++idx[d] < q->o[d])
            return;
        idx[d] = 0;
    }
}

#define TG_LASTROW(q, tab, kd) ((tab) + (q).toff[(q).nsp - 1] + (kd)[(q).nsp - 1] * (q).ol)

/* src[t], read whatever t is: padding (t < 0) reads element 0, so the load is never conditional
 * (runtime.c: no element is loaded under a condition); the caller selects the padding value. */
static inline real tg_padded(const real *src, long t)
{
    return src[t < 0 ? 0 : t];
}

/* cols = im2col(x): (C, K, N, P) channels first, (G, N, P, K, Cg) channels last; 0 on padding */
TG_FN void tg_im2col(const long *cv, const long *tab, const real *restrict x, real *restrict cols)
{
    tg_cgeo q = tg_cgeo_of(cv);
    long kd[TG_MAXD];
    long cg = q.c / q.g;
    for (long kk = 0; kk < q.kk; kk++) {
        tg_kdecode(&q, kk, kd);
        const long *tl = TG_LASTROW(q, tab, kd);
        long idx[TG_MAXD] = {0};
        for (long r = 0; r < q.rows; r++, tg_row_next(&q, idx)) {
            long b = tg_row_base(&q, tab, kd, idx);
            if (!q.last) {
                for (long c = 0; c < q.c; c++)
                    for (long n = 0; n < q.n; n++) {
                        real *restrict dst = cols + ((c * q.kk + kk) * q.n + n) * q.p + r * q.ol;
                        const real *restrict src = x + (n * q.c + c) * q.isp + (b < 0 ? 0 : b);
                        for (long m = 0; m < q.ol; m++) {
                            const real v = tg_padded(src, tl[m]);
                            dst[m] = (b < 0 || tl[m] < 0) ? R(0.0) : v;
                        }
                    }
            } else {
                for (long g = 0; g < q.g; g++)
                    for (long n = 0; n < q.n; n++)
                        for (long m = 0; m < q.ol; m++) {
                            real *restrict dst = cols + (((g * q.n + n) * q.p + r * q.ol + m) * q.kk + kk) * cg;
                            if (b < 0 || tl[m] < 0) {
                                for (long j = 0; j < cg; j++)
                                    dst[j] = R(0.0);
                            } else {
                                const real *restrict src = x + (n * q.isp + b + tl[m]) * q.c + g * cg;
                                for (long j = 0; j < cg; j++)
                                    dst[j] = src[j];
                            }
                        }
            }
        }
    }
}

/* dx = col2im(dcols): dx zeroed, then each kernel position's window added, positions in row-major order */
TG_FN void tg_col2im(const long *cv, const long *tab, const real *restrict dcols, real *restrict dx)
{
    tg_cgeo q = tg_cgeo_of(cv);
    long kd[TG_MAXD];
    long cg = q.c / q.g;
    tg_fill(dx, q.n * q.c * q.isp, R(0.0));
    for (long kk = 0; kk < q.kk; kk++) {
        tg_kdecode(&q, kk, kd);
        const long *tl = TG_LASTROW(q, tab, kd);
        long idx[TG_MAXD] = {0};
        for (long r = 0; r < q.rows; r++, tg_row_next(&q, idx)) {
            long b = tg_row_base(&q, tab, kd, idx);
            if (b < 0)
                continue;
            if (!q.last) {
                for (long c = 0; c < q.c; c++)
                    for (long n = 0; n < q.n; n++) {
                        const real *restrict src = dcols + ((c * q.kk + kk) * q.n + n) * q.p + r * q.ol;
                        real *restrict dst = dx + (n * q.c + c) * q.isp + b;
                        for (long m = 0; m < q.ol; m++)
                            if (tl[m] >= 0)
                                dst[tl[m]] = dst[tl[m]] + src[m];
                    }
            } else {
                for (long g = 0; g < q.g; g++)
                    for (long n = 0; n < q.n; n++)
                        for (long m = 0; m < q.ol; m++) {
                            if (tl[m] < 0)
                                continue;
                            const real *restrict src = dcols + (((g * q.n + n) * q.p + r * q.ol + m) * q.kk + kk) * cg;
                            real *restrict dst = dx + (n * q.isp + b + tl[m]) * q.c + g * cg;
                            for (long j = 0; j < cg; j++)
                                dst[j] = dst[j] + src[j];
                        }
            }
        }
    }
}

/* Pooling over every axis (cv's spatial dims are all the input's axes; N = C = G = 1).
 * mode 0: out = Σ windows (padding 0, the first position assigned, later ones added);
 * mode 1: out = max of windows (padding -inf; NaN propagates as np.maximum);
 * mode 2: arg = the input index of the first window position (row-major) whose value equals out
 *         (-1 if none, -2 if that position is padding);
 * mode 3: dx += g over every window position (dx zeroed first): sum_pool's gradient;
 * mode 4: dx += g at the input index arg only (dx zeroed first), window positions in row-major order:
 *         max_pool's gradient, the order of NumPy's rule when windows overlap;
 * mode 5: the same when windows do not overlap, in one pass over the outputs. */
TG_FN void tg_pool(int mode, const long *cv, const long *tab, const real *restrict x, real *restrict out,
                   real *restrict arg, const real *restrict g)
{
    tg_cgeo q = tg_cgeo_of(cv);
    long kd[TG_MAXD];
    if (mode == 2)
        tg_fill(arg, q.p, R(-1.0));
    if (mode >= 3)
        tg_fill(out, q.isp, R(0.0));
    if (mode == 5) {   /* windows that do not overlap: each input element gets at most one addition */
        for (long i = 0; i < q.p; i++)
            if (arg[i] >= R(0.0))
                out[(long)arg[i]] = out[(long)arg[i]] + g[i];
        return;
    }
    for (long kk = 0; kk < q.kk; kk++) {
        tg_kdecode(&q, kk, kd);
        const long *tl = TG_LASTROW(q, tab, kd);
        int full = 1;   /* no padding along the last axis for this window position */
        for (long m = 0; m < q.ol; m++)
            full &= tl[m] >= 0;
        long idx[TG_MAXD] = {0};
        for (long r = 0; r < q.rows; r++, tg_row_next(&q, idx)) {
            long b = tg_row_base(&q, tab, kd, idx);
            const real *restrict src = b < 0 ? x : x + b;
            real *restrict o = out + r * q.ol;
            if (mode == 0) {
                for (long m = 0; m < q.ol; m++) {
                    const real x = tg_padded(src, tl[m]);
                    const real v = (b < 0 || tl[m] < 0) ? R(0.0) : x;
                    if (kk == 0)
                        o[m] = v;
                    else
                        o[m] = o[m] + v;
                }
            } else if (mode == 1) {
                for (long m = 0; m < q.ol; m++) {
                    const real x = tg_padded(src, tl[m]);
                    const real v = (b < 0 || tl[m] < 0) ? -INFINITY : x;
                    if (kk == 0) {
                        o[m] = v;
                    } else {
                        const real w = o[m];
                        o[m] = w > v ? w : (w != w ? w : v);
                    }
                }
            } else if (mode == 2) {
                /* ties make branches unpredictable: rows without padding take a branch-free loop */
                real *restrict a = arg + r * q.ol;
                const real *restrict mx = out + r * q.ol;
                if (b >= 0 && full) {
                    for (long m = 0; m < q.ol; m++) {   /* -1 → index by adding hit · (index + 1): exact integers */
                        long i = b + tl[m];
                        real hit = (real)((a[m] == R(-1.0)) & (src[tl[m]] == mx[m]));
                        a[m] = a[m] + hit * (real)(i + 1);
                    }
                } else {
                    for (long m = 0; m < q.ol; m++) {
                        int ok = b >= 0 && tl[m] >= 0;
                        const real x = tg_padded(src, tl[m]);
                        const real v = ok ? x : -INFINITY;
                        a[m] = ((a[m] == R(-1.0)) & (v == mx[m])) ? (ok ? (real)(b + tl[m]) : R(-2.0)) : a[m];
                    }
                }
            } else {
                if (b < 0)
                    continue;
                real *restrict dx = out + b;
                const real *restrict gr = g + r * q.ol;
                const real *restrict a = arg + r * q.ol;
                if (mode == 3) {
                    for (long m = 0; m < q.ol; m++)
                        if (tl[m] >= 0)
                            dx[tl[m]] = dx[tl[m]] + gr[m];
                } else {
                    for (long m = 0; m < q.ol; m++)
                        if (tl[m] >= 0 && a[m] == (real)(b + tl[m]))
                            dx[tl[m]] = dx[tl[m]] + gr[m];
                }
            }
        }
    }
}
