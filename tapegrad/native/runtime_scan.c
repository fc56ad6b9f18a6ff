/* tapegrad native runtime: kernels of the scan family (included after runtime.c).
 *
 * An array is viewed as (outer, m, inner) around the scanned axis of length m: element (o, j, i) lies at
 * (o·m + j)·inner + i. A reverse scan visits j = m − 1 … 0. Each kernel repeats its NumPy rule in
 * tapegrad/ops/scan.py operation by operation; NumPy's accumulations are sequential, and so are these.
 */

#define TG_AT(o, j, i) (((o) * m + (rev ? m - 1 - (j) : (j))) * inner + (i))

/* out = running sum (mode 0), product (1) or max (2, NumPy's maximum: NaN propagates, ties give the new
 * element) of x along the axis. */
TG_FN void tg_scan(int mode, const real *x, real *out, long outer, long m, long inner, int rev)
{
    for (long o = 0; o < outer; o++) {
        for (long i = 0; i < inner; i++)
            out[TG_AT(o, 0, i)] = x[TG_AT(o, 0, i)];
        for (long j = 1; j < m; j++)
            for (long i = 0; i < inner; i++) {
                const real p = out[TG_AT(o, j - 1, i)], c = x[TG_AT(o, j, i)];
                out[TG_AT(o, j, i)] = mode == 0 ? p + c : mode == 1 ? p * c : (p > c ? p : (p != p ? p : c));
            }
    }
}

/* cumprod's VJP: S_{m−1} = g_{m−1}, S_j = g_j + x_{j+1}·S_{j+1}; d_j = out_{j−1}·S_j (d_0 = S_0). */
TG_FN void tg_cumprod_da(const real *x, const real *out, const real *g, real *d, long outer, long m, long inner,
                         int rev)
{
    for (long o = 0; o < outer; o++) {
        for (long i = 0; i < inner; i++)
            d[TG_AT(o, m - 1, i)] = g[TG_AT(o, m - 1, i)];
        for (long j = m - 2; j >= 0; j--)
            for (long i = 0; i < inner; i++)
                d[TG_AT(o, j, i)] = g[TG_AT(o, j, i)] + x[TG_AT(o, j + 1, i)] * d[TG_AT(o, j + 1, i)];
        for (long j = 1; j < m; j++)
            for (long i = 0; i < inner; i++)
                d[TG_AT(o, j, i)] = out[TG_AT(o, j - 1, i)] * d[TG_AT(o, j, i)];
    }
}

/* cummax's VJP (c is scratch of x's size): hit_j = [x_j = out_j]; c_0 = hit_0,
 * c_k = hit_k + [out_{k−1} = out_k]·c_{k−1} (the tie count); c = g / c; then from the end
 * c_j = c_j + [out_{j+1} = out_j]·c_{j+1}; d = hit · c. */
TG_FN void tg_cummax_da(const real *x, const real *out, const real *g, real *d, real *c, long outer, long m,
                        long inner, int rev)
{
    const real one = R(1.0), zero = R(0.0);
    for (long o = 0; o < outer; o++) {
        for (long j = 0; j < m; j++)
            for (long i = 0; i < inner; i++)
                d[TG_AT(o, j, i)] = x[TG_AT(o, j, i)] == out[TG_AT(o, j, i)] ? one : zero;
        for (long i = 0; i < inner; i++)
            c[TG_AT(o, 0, i)] = d[TG_AT(o, 0, i)];
        for (long k = 1; k < m; k++)
            for (long i = 0; i < inner; i++) {
                const real e = out[TG_AT(o, k - 1, i)] == out[TG_AT(o, k, i)] ? one : zero;
                c[TG_AT(o, k, i)] = d[TG_AT(o, k, i)] + e * c[TG_AT(o, k - 1, i)];
            }
        for (long j = 0; j < m; j++)
            for (long i = 0; i < inner; i++)
                c[TG_AT(o, j, i)] = g[TG_AT(o, j, i)] / c[TG_AT(o, j, i)];
        for (long j = m - 2; j >= 0; j--)
            for (long i = 0; i < inner; i++) {
                const real e = out[TG_AT(o, j + 1, i)] == out[TG_AT(o, j, i)] ? one : zero;
                c[TG_AT(o, j, i)] = c[TG_AT(o, j, i)] + e * c[TG_AT(o, j + 1, i)];
            }
        for (long j = 0; j < m; j++)
            for (long i = 0; i < inner; i++)
                d[TG_AT(o, j, i)] = d[TG_AT(o, j, i)] * c[TG_AT(o, j, i)];
    }
}

/* NumPy's sort order: ascending, NaN after every number. */
TG_FN int tg_before(real u, real v)
{
    return u < v || (u == u && v != v);
}

/* The stable argsort of the m elements x[0], x[inner], … into idx (indices held as reals, exact below
 * 2^24 even in float), by a bottom-up merge sort (tmp: m more reals). Stable: of equal elements the
 * earlier comes first, as NumPy's kind="stable". */
TG_FN void tg_argsort(const real *x, long inner, long m, real *idx, real *tmp)
{
    real *src = idx, *dst = tmp;
    for (long i = 0; i < m; i++)
        idx[i] = (real)i;
    for (long w = 1; w < m; w *= 2) {
        for (long lo = 0; lo < m; lo += 2 * w) {
            const long mid = lo + w < m ? lo + w : m, hi = lo + 2 * w < m ? lo + 2 * w : m;
            long i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                const real sj = src[j], si = src[i];
                const int t = tg_before(x[(long)sj * inner], x[(long)si * inner]);
                dst[k++] = t ? sj : si;
                j += t;
                i += 1 - t;
            }
            while (i < mid)
                dst[k++] = src[i++];
            while (j < hi)
                dst[k++] = src[j++];
        }
        real *t = src;
        src = dst;
        dst = t;
    }
    if (src != idx)
        memcpy(idx, src, (size_t)m * sizeof(real));
}

/* sort (back = 0): out_j = x_{p(j)}; its VJP (back = 1): d_{p(j)} = g_j; p the stable argsort of each line. */
TG_FN void tg_sort(int back, const real *x, const real *g, real *y, real *idx, real *tmp, long outer, long m,
                   long inner)
{
    for (long o = 0; o < outer; o++)
        for (long i = 0; i < inner; i++) {
            const long base = o * m * inner + i;
            tg_argsort(x + base, inner, m, idx, tmp);
            for (long j = 0; j < m; j++) {
                const long p = base + (long)idx[j] * inner, q = base + j * inner;
                if (back)
                    y[p] = g[q];
                else
                    y[q] = x[p];
            }
        }
}

/* prod's VJP on rows of n reduced elements (x: rows × n): d_i = (Π_{j<i} x_j · Π_{j>i} x_j) · g_row,
 * each product sequential (prefix from the left, suffix from the right); no division. */
TG_FN void tg_prod_da(const real *x, const real *g, real *d, long rows, long n)
{
    for (long r = 0; r < rows; r++) {
        const real *xr = x + r * n;
        real *dr = d + r * n;
        dr[0] = R(1.0);
        for (long i = 1; i < n; i++)
            dr[i] = dr[i - 1] * xr[i - 1];
        real suf = R(1.0);
        for (long i = n - 1; i >= 0; i--) {
            dr[i] = dr[i] * suf * g[r];
            suf = suf * xr[i];
        }
    }
}

#undef TG_AT
