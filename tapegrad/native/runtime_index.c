/* tapegrad native runtime: kernels of the index family (included after runtime.c).
 *
 * A gather along one axis sees its input as (outer, n, inner) and its indices as nq positions; every
 * scatter-add runs over positions in increasing order, one element at a time, as numpy.add.at does,
 * so each destination element receives its contributions in the same order as on the tape. Indices
 * were range-checked on the host (tape or set_input); negative ones count from the end.
 */

TG_FN long tg_wrap(long long j, long n)
{
    return (long)(j < 0 ? j + n : j);
}

/* out[o, q, :] = a[o, idx[q], :] */
TG_FN void tg_take(real *out, const real *a, const long long *idx, long outer, long n, long nq, long inner)
{
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++)
            memcpy(out + (o * nq + q) * inner, a + (o * n + tg_wrap(idx[q], n)) * inner,
                   (size_t)inner * sizeof(real));
}

/* dst[o, idx[q], :] += src[o, q, :] in increasing q (dst zeroed first when zero is set) */
TG_FN void tg_take_add(real *dst, const real *src, const long long *idx, long outer, long n, long nq, long inner,
                       int zero)
{
    if (zero)
        for (long i = 0; i < outer * n * inner; i++)
            dst[i] = R(0.0);
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++) {
            real *d = dst + (o * n + tg_wrap(idx[q], n)) * inner;
            const real *s = src + (o * nq + q) * inner;
            for (long i = 0; i < inner; i++)
                d[i] = d[i] + s[i];
        }
}

/* take_along_axis: out[o, q, i] = a[o, idx[o, q, i], i] */
TG_FN void tg_along(real *out, const real *a, const long long *idx, long outer, long n, long nq, long inner)
{
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++)
            for (long i = 0; i < inner; i++) {
                const long at = (o * nq + q) * inner + i;
                out[at] = a[(o * n + tg_wrap(idx[at], n)) * inner + i];
            }
}

/* its VJP: dst[o, idx[o, q, i], i] += g[o, q, i], positions in row-major (increasing q) order */
TG_FN void tg_along_add(real *dst, const real *g, const long long *idx, long outer, long n, long nq, long inner)
{
    for (long i = 0; i < outer * n * inner; i++)
        dst[i] = R(0.0);
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++)
            for (long i = 0; i < inner; i++) {
                const long at = (o * nq + q) * inner + i;
                real *d = dst + (o * n + tg_wrap(idx[at], n)) * inner + i;
                *d = *d + g[at];
            }
}

/* index_set: dst[o, idx[q], :] = src[o, q, :] in increasing q (the last write of an index wins) */
TG_FN void tg_take_set(real *dst, const real *src, const long long *idx, long outer, long n, long nq, long inner)
{
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++)
            memcpy(dst + (o * n + tg_wrap(idx[q], n)) * inner, src + (o * nq + q) * inner,
                   (size_t)inner * sizeof(real));
}

/* dst[o, idx[q], :] = 0 */
TG_FN void tg_take_zero(real *dst, const long long *idx, long outer, long n, long nq, long inner)
{
    for (long o = 0; o < outer; o++)
        for (long q = 0; q < nq; q++) {
            real *d = dst + (o * n + tg_wrap(idx[q], n)) * inner;
            for (long i = 0; i < inner; i++)
                d[i] = R(0.0);
        }
}

/* index_set's VJP for the values: g gathered at the surviving (last) occurrence of each index, 0 at
 * overwritten ones; mark (n elements of scratch) records which indices a later position already took */
TG_FN void tg_take_winners(real *out, const real *g, const long long *idx, long outer, long n, long nq, long inner,
                           real *mark)
{
    for (long j = 0; j < n; j++)
        mark[j] = R(0.0);
    for (long q = nq - 1; q >= 0; q--) {
        const long j = tg_wrap(idx[q], n);
        const int win = mark[j] == R(0.0);
        mark[j] = R(1.0);
        for (long o = 0; o < outer; o++)
            for (long i = 0; i < inner; i++)
            {
                const real x = g[(o * n + j) * inner + i];
                out[(o * nq + q) * inner + i] = win ? x : R(0.0);
            }
    }
}

/* The element offset of a dynamic window: a negative start counts from the end, then every start is
 * clamped so the window fits (lax.dynamic_slice's rule). */
TG_FN long tg_window(const long long *starts, int nd, const long *shape, const long *sizes, const long *st)
{
    long off = 0;
    for (int d = 0; d < nd; d++) {
        long x = (long)(starts[d] < 0 ? starts[d] + shape[d] : starts[d]);
        if (x < 0)
            x = 0;
        if (x > shape[d] - sizes[d])
            x = shape[d] - sizes[d];
        off += x * st[d];
    }
    return off;
}

/* dst[window] = v: the window's elements at strides st (dst already offset to the window's start) */
TG_FN void tg_window_fill(real *dst, int nd, const long *shape, const long *st, real v)
{
    long idx[TG_MAXD] = {0}, n = 1, o = 0;
    for (int k = 0; k < nd; k++)
        n *= shape[k];
    for (long i = 0; i < n; i++) {
        dst[o] = v;
        for (int k = nd - 1; k >= 0; k--) {
            o += st[k];
            if (++idx[k] < shape[k])
                break;
            o -= st[k] * shape[k];
            idx[k] = 0;
        }
    }
}
