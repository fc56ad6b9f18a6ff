"""CUDA kernels of the index family (take, take_along_axis, index_add, index_set, dynamic slices).

Each mirrors the native C (``tapegrad/native/runtime_index.c``) element for element, one thread per
element written: a gather reads its source; a scatter-add gives each destination element one thread
that adds its contributions in increasing index position — ``numpy.add.at``'s order — so the family
stays exact (== the tape) on the device too. Integer operands are the program's ``long long`` buffers;
a negative index counts from the end (range-checked on the host). Tensors are seen as
(outer, n, inner) around the indexed axis.
"""
import math

from ..native.kernels import strides


def _split(shape, axis):
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def _wrap(x, n):
    return f"(long)({x} < 0 ? {x} + {n}L : {x})"


def _gather_rows(g, tag, dst, src, idx, ash, axis, nq, first=None):
    """dst[o, q, ii] (=|+=) src[o, idx[q], ii]: take's forward, index_add's db."""
    outer, n, inner = _split(ash, axis)
    put = (lambda e: f"{dst}[i] = {e};") if first is None else (lambda e: g.put(f"{dst}[i]", e, first))
    return g.flat(tag, outer * nq * inner, [f"const long o = i / {nq * inner}L, q = (i / {inner}L) % {nq}L, "
                                            f"ii = i % {inner}L;",
                                            f"const long j = {_wrap(f'{idx}[q]', n)};",
                                            put(f"{src}[(o * {n}L + j) * {inner}L + ii]")])


def _over_dst(ash, axis):
    outer, n, inner = _split(ash, axis)
    return [f"const long o = i / {n * inner}L, j = (i / {inner}L) % {n}L, ii = i % {inner}L;"], outer, n, inner


# ── take / take_along_axis ───────────────────────────────────────────────────

def take_fwd(g, k, op, a, b, s):
    return [_gather_rows(g, f"f{k}", f"v{k}", f"v{a}", f"v{b}", g.p.shapes[a], s, math.prod(g.p.shapes[b]))]


def take_da(g, k, side, first):
    """g_a[o, j, ii] (+)= Σ_q [idx_q = j] g[o, q, ii], q increasing"""
    _, a, b, s = g.p.nodes[k]
    head, outer, n, inner = _over_dst(g.p.shapes[a], s)
    nq = math.prod(g.p.shapes[b])
    lines = head + [f"real acc = {g.d.lit(0.0)};",
                    f"for (long q = 0; q < {nq}L; q++)",
                    f"    if ({_wrap(f'v{b}[q]', n)} == j) acc = {g.add('acc', f'g{k}[(o * {nq}L + q) * {inner}L + ii]')};",
                    g.put(f"g{a}[i]", "acc", first)]
    return [g.flat(f"da{k}", outer * n * inner, lines)]


def along_fwd(g, k, op, a, b, s):
    outer, n, inner = _split(g.p.shapes[a], s)
    nq = g.p.shapes[b][s]
    return [g.flat(f"f{k}", outer * nq * inner, [f"const long o = i / {nq * inner}L, ii = i % {inner}L;",
                                                 f"v{k}[i] = v{a}[(o * {n}L + {_wrap(f'v{b}[i]', n)}) * {inner}L + ii];"])]


def along_da(g, k, side, first):
    """g_a[o, j, ii] (+)= Σ_q [idx[o, q, ii] = j] g[o, q, ii], q increasing"""
    _, a, b, s = g.p.nodes[k]
    head, outer, n, inner = _over_dst(g.p.shapes[a], s)
    nq = g.p.shapes[b][s]
    lines = head + [f"real acc = {g.d.lit(0.0)};",
                    f"for (long q = 0; q < {nq}L; q++) {{",
                    f"    const long at = (o * {nq}L + q) * {inner}L + ii;",
                    f"    if ({_wrap(f'v{b}[at]', n)} == j) acc = {g.add('acc', f'g{k}[at]')};",
                    "}", g.put(f"g{a}[i]", "acc", first)]
    return [g.flat(f"da{k}", outer * n * inner, lines)]


# ── index_add / index_set (a = x, b = values, c = indices) ───────────────────

def _scatter_fwd(g, k, a, b, c, s, combine):
    head, outer, n, inner = _over_dst(g.p.shapes[a], s)
    nq = math.prod(g.p.shapes[c])
    lines = head + [f"real acc = v{a}[i];",
                    f"for (long q = 0; q < {nq}L; q++)",
                    f"    if ({_wrap(f'v{c}[q]', n)} == j) acc = {combine('acc', f'v{b}[(o * {nq}L + q) * {inner}L + ii]')};",
                    f"v{k}[i] = acc;"]
    return [g.flat(f"f{k}", outer * n * inner, lines)]


def index_add_fwd(g, k, op, a, b, s):
    return _scatter_fwd(g, k, a, b, g.p.third[k], s, g.add)


def index_set_fwd(g, k, op, a, b, s):
    return _scatter_fwd(g, k, a, b, g.p.third[k], s, lambda acc, x: x)   # the last write of an index wins


def index_add_d(g, k, side, first):
    _, a, b, s = g.p.nodes[k]
    if side == "a":
        return [g.flat(f"da{k}", g.n(k), [g.put(f"g{a}[i]", f"g{k}[i]", first)])]
    c = g.p.third[k]
    return [_gather_rows(g, f"db{k}", f"g{b}", f"g{k}", f"v{c}", g.p.shapes[a], s, math.prod(g.p.shapes[c]), first)]


def index_set_d(g, k, side, first):
    """da: g where no index wrote, else 0; db: g at each index's last occurrence, 0 at overwritten ones"""
    _, a, b, s = g.p.nodes[k]
    c = g.p.third[k]
    nq = math.prod(g.p.shapes[c])
    zero = g.d.lit(0.0)
    if side == "a":
        outer, n, inner = _split(g.p.shapes[a], s)
        lines = [f"const long j = (i / {inner}L) % {n}L;", "int hit = 0;", f"for (long q = 0; q < {nq}L; q++) hit |= {_wrap(f'v{c}[q]', n)} == j;",
                        g.put(f"g{a}[i]", f"(hit ? {zero} : g{k}[i])", first)]
        return [g.flat(f"da{k}", outer * n * inner, lines)]
    outer, n, inner = _split(g.p.shapes[a], s)
    lines = [f"const long o = i / {nq * inner}L, q = (i / {inner}L) % {nq}L, ii = i % {inner}L;",
             f"const long j = {_wrap(f'v{c}[q]', n)};", "int win = 1;",
             f"for (long r = q + 1; r < {nq}L; r++) win &= {_wrap(f'v{c}[r]', n)} != j;",
             g.put(f"g{b}[i]", f"(win ? g{k}[(o * {n}L + j) * {inner}L + ii] : {zero})", first)]
    return [g.flat(f"db{k}", outer * nq * inner, lines)]


# ── dynamic slices: data-dependent starts, clamped as lax.dynamic_slice does ───

def _starts(starts, shape, sizes):
    """Lines defining ``s<d>``, the clamped start of the window on each axis (tg_window's rule)."""
    out = []
    for d, (n, m) in enumerate(zip(shape, sizes)):
        out.append(f"long s{d} = {_wrap(f'{starts}[{d}]', n)};")
        out.append(f"if (s{d} < 0) s{d} = 0;")
        out.append(f"if (s{d} > {n - m}L) s{d} = {n - m}L;")
    return out


def _coords(var, shape, name):
    return [f"const long {name}{d} = ({var} / {st}L) % {m}L;" for d, (m, st) in enumerate(zip(shape, strides(shape)))]


def _offset(terms):
    return " + ".join(terms) or "0L"


def _inside(shape, sizes):
    return " && ".join(f"x{d} >= s{d} && x{d} < s{d} + {m}L" for d, m in enumerate(sizes)) or "1"


def dslice_fwd(g, k, op, a, b, s):
    ash, osh = g.p.shapes[a], g.p.shapes[k]
    st = strides(ash)
    lines = _starts(f"v{b}", ash, osh) + _coords("i", osh, "y")
    lines.append(f"v{k}[i] = v{a}[{_offset([f'(s{d} + y{d}) * {st[d]}L' for d in range(len(ash))])}];")
    return [g.flat(f"f{k}", g.n(k), lines)]


def dslice_da(g, k, side, first):
    _, a, b, s = g.p.nodes[k]
    ash, osh = g.p.shapes[a], g.p.shapes[k]
    ost = strides(osh)
    lines = _starts(f"v{b}", ash, osh) + _coords("i", ash, "x")
    at = _offset([f"(x{d} - s{d}) * {ost[d]}L" for d in range(len(ash))])
    lines.append(g.put(f"g{a}[i]", f"(({_inside(ash, osh)}) ? g{k}[{at}] : {g.d.lit(0.0)})", first))
    return [g.flat(f"da{k}", math.prod(ash), lines)]


def dus_fwd(g, k, op, a, b, s):
    c = g.p.third[k]
    ash, bsh = g.p.shapes[a], g.p.shapes[b]
    bst = strides(bsh)
    lines = _starts(f"v{c}", ash, bsh) + _coords("i", ash, "x")
    at = _offset([f"(x{d} - s{d}) * {bst[d]}L" for d in range(len(ash))])
    lines.append(f"v{k}[i] = ({_inside(ash, bsh)}) ? v{b}[{at}] : v{a}[i];")
    return [g.flat(f"f{k}", g.n(k), lines)]


def dus_d(g, k, side, first):
    _, a, b, s = g.p.nodes[k]
    c = g.p.third[k]
    ash, bsh = g.p.shapes[a], g.p.shapes[b]
    st = strides(ash)
    if side == "a":
        lines = _starts(f"v{c}", ash, bsh) + _coords("i", ash, "x")
        lines.append(g.put(f"g{a}[i]", f"(({_inside(ash, bsh)}) ? {g.d.lit(0.0)} : g{k}[i])", first))
        return [g.flat(f"da{k}", math.prod(ash), lines)]
    lines = _starts(f"v{c}", ash, bsh) + _coords("i", bsh, "y")
    lines.append(g.put(f"g{b}[i]", f"g{k}[{_offset([f'(s{d} + y{d}) * {st[d]}L' for d in range(len(ash))])}]", first))
    return [g.flat(f"db{k}", math.prod(bsh), lines)]


FORWARD = {"take": take_fwd, "take_along_axis": along_fwd, "index_add": index_add_fwd,
           "index_set": index_set_fwd, "dynamic_slice": dslice_fwd, "dynamic_update_slice": dus_fwd}
BACKWARD = {"take": take_da, "take_along_axis": along_da, "index_add": index_add_d,
            "index_set": index_set_d, "dynamic_slice": dslice_da, "dynamic_update_slice": dus_d}
