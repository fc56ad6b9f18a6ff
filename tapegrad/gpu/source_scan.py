"""CUDA kernels of the scan family (cumsum, cumprod, cummax, sort): one thread per line.

A tensor is seen as (outer, m, inner) around the scanned axis; line (o, ii) is one thread, which walks
its m elements in order (reversed for ``reverse=True``) with the native C's operations one by one
(``tapegrad/native/runtime_scan.c``), so the family stays exact (== the tape) on the device. Per-line
intermediates (cumprod's and cummax's backward, sort's argsort) live in scratch buffers S1/S2.
"""
from ..errors import TapeError, at
from ..native.kernels import axis3


def _line(g, tag, k, shape, axis, rev, body):
    """A kernel with one thread per line; ``body(AT)`` gives its lines, ``AT(j)`` element j's index."""
    outer, m, inner = axis3(shape, axis)

    def AT(j):
        j = f"({m - 1}L - ({j}))" if rev else f"({j})"
        return f"(o * {m}L + {j}) * {inner}L + ii"

    lines = [f"const long o = i / {inner}L, ii = i % {inner}L;"] + body(AT, m)
    return g.flat(tag, outer * inner, lines)


def _combine(g, name):
    if name == "cumsum":
        return g.add
    if name == "cumprod":
        return g.mul
    return lambda p, c: f"({p} > {c} ? {p} : ({p} != {p} ? {p} : {c}))"   # NumPy's maximum: NaN sticks


def scan_fwd(g, k, op, a, b, s):
    f = _combine(g, op.name)

    def body(AT, m):
        return [f"real r = v{a}[{AT('0L')}];", f"v{k}[{AT('0L')}] = r;",
                f"for (long j = 1; j < {m}L; j++) {{", "    const real c = v{0}[{1}];".format(a, AT("j")),
                f"    r = {f('r', 'c')};", f"    v{k}[{AT('j')}] = r;", "}"]
    return [_line(g, f"f{k}", k, g.p.shapes[a], s[0], s[1], body)]


def cumsum_da(g, k, side, first):
    """the running sum of g in the other direction"""
    _, a, _, s = g.p.nodes[k]

    def body(AT, m):
        J = AT("j")
        return [f"real r = g{k}[{AT('0L')}];", g.put(f"g{a}[{AT('0L')}]", "r", first),
                f"for (long j = 1; j < {m}L; j++) {{", f"    r = {g.add('r', f'g{k}[{J}]')};",
                "    " + g.put(f"g{a}[{J}]", "r", first), "}"]
    return [_line(g, f"da{k}", k, g.p.shapes[a], s[0], not s[1], body)]


def cumprod_da(g, k, side, first):
    """S_{m−1} = g_{m−1}, S_j = g_j + x_{j+1}·S_{j+1}; d_j = out_{j−1}·S_j (d_0 = S_0), S in S1"""
    _, a, _, s = g.p.nodes[k]
    g.scratch(1, g.n(k))

    def body(AT, m):
        last, J, prev, nxt = AT(f"{m - 1}L"), AT("j"), AT("j - 1"), AT("j + 1")
        return [f"S1[{last}] = g{k}[{last}];",
                f"for (long j = {m - 2}L; j >= 0; j--)",
                f"    S1[{J}] = {g.add(f'g{k}[{J}]', g.mul(f'v{a}[{nxt}]', f'S1[{nxt}]'))};",
                f"for (long j = 1; j < {m}L; j++)",
                f"    S1[{J}] = {g.mul(f'v{k}[{prev}]', f'S1[{J}]')};",
                f"for (long j = 0; j < {m}L; j++)",
                "    " + g.put(f"g{a}[{J}]", f"S1[{J}]", first)]
    return [_line(g, f"da{k}", k, g.p.shapes[a], s[0], s[1], body)]


def cummax_da(g, k, side, first):
    """hit_j = [x_j = out_j] (S1); tie counts c (S2): c_0 = hit_0, c_j = hit_j + [out_{j−1} = out_j]·c_{j−1};
    c = g / c; from the end c_j = c_j + [out_{j+1} = out_j]·c_{j+1}; d = hit · c"""
    _, a, _, s = g.p.nodes[k]
    g.scratch(1, g.n(k))
    g.scratch(2, g.n(k))
    one, zero = g.d.lit(1.0), g.d.lit(0.0)

    def body(AT, m):
        J = AT("j")
        prev, nxt = AT("j - 1"), AT("j + 1")
        return [f"for (long j = 0; j < {m}L; j++) S1[{J}] = v{a}[{J}] == v{k}[{J}] ? {one} : {zero};",
                f"S2[{AT('0L')}] = S1[{AT('0L')}];",
                f"for (long j = 1; j < {m}L; j++) {{",
                f"    const real e = v{k}[{prev}] == v{k}[{J}] ? {one} : {zero};",
                f"    S2[{J}] = {g.add(f'S1[{J}]', g.mul('e', f'S2[{prev}]'))};", "}",
                f"for (long j = 0; j < {m}L; j++) S2[{J}] = {g.div(f'g{k}[{J}]', f'S2[{J}]')};",
                f"for (long j = {m - 2}L; j >= 0; j--) {{",
                f"    const real e = v{k}[{nxt}] == v{k}[{J}] ? {one} : {zero};",
                f"    S2[{J}] = {g.add(f'S2[{J}]', g.mul('e', f'S2[{nxt}]'))};", "}",
                f"for (long j = 0; j < {m}L; j++)",
                "    " + g.put(f"g{a}[{J}]", g.mul(f"S1[{J}]", f"S2[{J}]"), first)]
    return [_line(g, f"da{k}", k, g.p.shapes[a], s[0], s[1], body)]


def _argsort(g, a, m, inner):
    """The stable argsort of line (o, ii) into S1[line·m …] (indices as reals; S2 the merge buffer):
    tg_argsort's bottom-up merge sort, ascending with NaN last, the earlier of equal elements first."""
    g.sort_helper = True
    return [f"real *idx = S1 + (o * {inner}L + ii) * {m}L, *tmp = S2 + (o * {inner}L + ii) * {m}L;",
            f"tg_argsort_line(v{a} + o * {m * inner}L + ii, {inner}L, {m}L, idx, tmp);"]


def _sort_line(g, k, a, s):
    outer, m, inner = axis3(g.p.shapes[a], s)
    if g.f32 and m > 2 ** 24:
        raise TapeError(f"{at('sort', k)}: a float32 program sorts lines of at most 2**24 elements (its argsort "
                        f"indices are floats); got {m}; capture in float64")
    g.scratch(1, g.n(k))
    g.scratch(2, g.n(k))
    return outer, m, inner


def sort_fwd(g, k, op, a, b, s):
    outer, m, inner = _sort_line(g, k, a, s)
    lines = [f"const long o = i / {inner}L, ii = i % {inner}L;"] + _argsort(g, a, m, inner) + [
        f"for (long j = 0; j < {m}L; j++)",
        f"    v{k}[o * {m * inner}L + j * {inner}L + ii] = v{a}[o * {m * inner}L + (long)idx[j] * {inner}L + ii];"]
    return [g.flat(f"f{k}", outer * inner, lines)]


def sort_da(g, k, side, first):
    """d_{p(j)} = g_j, p the stable argsort of the line"""
    _, a, _, s = g.p.nodes[k]
    outer, m, inner = _sort_line(g, k, a, s)
    lines = [f"const long o = i / {inner}L, ii = i % {inner}L;"] + _argsort(g, a, m, inner) + [
        f"for (long j = 0; j < {m}L; j++)",
        "    " + g.put(f"g{a}[o * {m * inner}L + (long)idx[j] * {inner}L + ii]",
                       f"g{k}[o * {m * inner}L + j * {inner}L + ii]", first)]
    return [g.flat(f"da{k}", outer * inner, lines)]


def argsort_source():
    """The device helper of sort (emitted once per program that sorts)."""
    return ["/* NumPy's sort order: ascending, NaN after every number */",
            "__device__ static int tg_before(real u, real v) { return u < v || (u == u && v != v); }",
            "__device__ static void tg_argsort_line(const real *x, long inner, long m, real *idx, real *tmp)",
            "{",
            "    real *src = idx, *dst = tmp;",
            "    for (long i = 0; i < m; i++) idx[i] = (real)i;",
            "    for (long w = 1; w < m; w *= 2) {",
            "        for (long lo = 0; lo < m; lo += 2 * w) {",
            "            const long mid = lo + w < m ? lo + w : m, hi = lo + 2 * w < m ? lo + 2 * w : m;",
            "            long i = lo, j = mid, k = lo;",
            "            while (i < mid && j < hi)",
            "                dst[k++] = tg_before(x[(long)src[j] * inner], x[(long)src[i] * inner]) ? src[j++] : src[i++];",
            "            while (i < mid) dst[k++] = src[i++];",
            "            while (j < hi) dst[k++] = src[j++];",
            "        }",
            "        real *t = src;", "        src = dst;", "        dst = t;",
            "    }",
            "    if (src != idx)",
            "        for (long i = 0; i < m; i++) idx[i] = src[i];",
            "}", ""]


FORWARD = {"cumsum": scan_fwd, "cumprod": scan_fwd, "cummax": scan_fwd, "sort": sort_fwd}
BACKWARD = {"cumsum": cumsum_da, "cumprod": cumprod_da, "cummax": cummax_da, "sort": sort_da}
