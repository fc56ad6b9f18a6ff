"""The native C of the conv family's ops: printers registered into ``registry.FORWARD``/``BACKWARD``.

Each printer makes the BLAS calls of its NumPy rule in ``tapegrad.ops.conv`` (same shapes, same
transposition flags, contiguous operands) and replaces the data movement around them by the runtime's
``tg_im2col``/``tg_col2im``/``tg_pool``/``tg_swap01`` (runtime_conv.c). So on the BLAS
NumPy itself calls, a conv replays the tape to the bit whenever NumPy takes its GEMM path (every GEMM
dimension > 1); the registry's "blas" tier bounds the rest.

im2col + GEMM over direct loops, measured (float64, one BLAS thread, shared 2-core Xeon, median µs):
a direct NCHW loop nest (for n, o, c, i, j: out[n, o] += w[o, c, i, j] · shifted x[n, c], vectorised
along the output row) against a captured program's forward (the conv, then an output-sized product and
sum, which alone took 160 at the first layer's output size) at the benchmark CNN's two layers:
32×1×28×28 ∗ 8×1×3×3: direct 302, im2col + GEMM program 467; 32×8×13×13 ∗ 16×8×3×3: direct 1,227,
im2col + GEMM program 441. The GEMM wins 3x once channels grow and ties at one input channel, and it is
the path that reproduces NumPy's bits, so it is the only one kept.
"""
import math

from ...errors import TapeError, at
from ...ops.conv import geometry, pool_geometry
from .registry import BACKWARD, FORWARD, SCRATCH, c_array as _arr

MAXD = 8   # runtime.c's TG_MAXD: the most spatial dims (conv) or axes (pooling) the C loops index



def conv_tables(geo):
    """(cv, tab) of runtime_conv.c for a convolution."""
    cv = [len(geo.k), int(geo.last), geo.n, geo.c, geo.g, *geo.inp, *geo.k, *geo.out]
    tab = []
    for n, k, m, st, (lo, _), ld, rd in zip(geo.inp, geo.k, geo.out, geo.st, geo.pads, geo.ld, geo.rd):
        for j in range(k):
            for i in range(m):
                pos = i * st + j * rd - lo
                tab.append(pos // ld if pos >= 0 and pos % ld == 0 and pos // ld < n else -1)
    return cv, tab


def pool_tables(shape, s):
    win, st, pads = s
    out = pool_geometry(shape, s)
    cv = [len(shape), 0, 1, 1, 1, *shape, *win, *out]
    tab = []
    for n, w, m, t, (lo, _) in zip(shape, win, out, st, pads):
        for j in range(w):
            for i in range(m):
                pos = i * t + j - lo
                tab.append(pos if 0 <= pos < n else -1)
    return cv, tab


def _fits(n, nd):
    if nd > MAXD:
        raise TapeError(f"{at(n.name, n.k)}: the native backend handles at most {MAXD} windowed dimensions, "
                        f"got {nd}; use backend='numpy'")


def _call(fn, cv, tab, args):
    return [f"{{ static const long cv[] = {_arr(cv)}; static const long tb[] = {_arr(tab)}; "
            f"{fn}(cv, tb, {args}); }}"]


def _swap(dst, src, x, y, p):
    """dst (x, y, p) = src (y, x, p) with its first two axes swapped (blocks of p contiguous elements)."""
    return [f"tg_swap01({dst}, {src}, {x}L, {y}L, {p}L);"]


def _mm(ta, tb, m, n, k, A, B, C):
    return f"tg_mm((tg_gemm_t)T[0], {ta}, {tb}, {m}, {n}, {k}, {A}, {B}, {C});"


def _at(buf, off):
    return f"{buf} + {off}L" if off else buf


def sizes(geo):
    """Elements of cols, of the output, of the kernel."""
    return geo.c * geo.kk * geo.n * geo.p, geo.o * geo.n * geo.p, geo.kk * geo.cg * geo.o


def conv_scratch(p, k):
    op, a, b, s = p.nodes[k]
    return sum(sizes(geometry(p.shapes[a], p.shapes[b], s)))


def _regroup_g(n, geo, dst):
    """The cotangent as the GEMMs read it (``ops.conv._gfirst``): returns (lines, buffer)."""
    npn = geo.n * geo.p
    if not geo.last:
        return _swap(dst, n.G, geo.o, geo.n, geo.p), dst
    if geo.g == 1:
        return [], n.G
    return _swap(dst, n.G, geo.g, npn, geo.og), dst


def _regroup_w(n, geo, dst):
    """The HWIO kernel as (G, K·Cg, Og) (``ops.conv._wgroups``, channels last with groups)."""
    if geo.g == 1:
        return [], n.B
    return _swap(dst, n.B, geo.g, geo.kk * geo.cg, geo.og), dst


def conv_fwd(n):
    geo = geometry(n.ash, n.bsh, n.s)
    _fits(n, len(geo.k))
    cv, tab = conv_tables(geo)
    npn, ck = geo.n * geo.p, geo.cg * geo.kk
    lines = _call("tg_im2col", cv, tab, f"{n.A}, S0")
    if not geo.last:
        for j in range(geo.g):
            lines.append(_mm(0, 0, geo.og, npn, ck, _at(n.B, j * geo.og * ck), _at("S0", j * ck * npn),
                             _at("S1", j * geo.og * npn)))
        return lines + _swap(n.V, "S1", geo.n, geo.o, geo.p)
    if geo.g == 1:
        return lines + [_mm(0, 0, npn, geo.o, ck, "S0", n.B, n.V)]
    wl, w = _regroup_w(n, geo, "S1")
    lines += wl
    for j in range(geo.g):
        lines.append(_mm(0, 0, npn, geo.og, ck, _at("S0", j * npn * ck), _at(w, j * ck * geo.og),
                         _at("S2", j * npn * geo.og)))
    return lines + _swap(n.V, "S2", npn, geo.g, geo.og)


def conv_d(n):
    """da: dcols = Wᵀ·g per group, then col2im; db: dW = g·colsᵀ per group (cols recomputed)."""
    geo = geometry(n.ash, n.bsh, n.s)
    cv, tab = conv_tables(geo)
    ncols, nout, nw = sizes(geo)
    npn, ck = geo.n * geo.p, geo.cg * geo.kk
    if n.side == "a":
        if not geo.last:
            lines, gg = _regroup_g(n, geo, "S1")
            for j in range(geo.g):
                lines.append(_mm(1, 0, ck, npn, geo.og, _at(n.B, j * geo.og * ck), _at(gg, j * geo.og * npn),
                                 _at("S2", j * ck * npn)))
            return lines + _call("tg_col2im", cv, tab, f"S2, {n.dst}"), False
        lines, gg = _regroup_g(n, geo, "S1")
        wl, w = _regroup_w(n, geo, "S2")
        dcols = "S1" if geo.g == 1 else f"S2 + {nw}L"
        lines += wl
        for j in range(geo.g):
            lines.append(_mm(0, 1, npn, ck, geo.og, _at(gg, j * npn * geo.og), _at(w, j * ck * geo.og),
                             _at(dcols, j * npn * ck)))
        return lines + _call("tg_col2im", cv, tab, f"{dcols}, {n.dst}"), False
    if not geo.last:
        lines, gg = _regroup_g(n, geo, "S1")
        lines += _call("tg_im2col", cv, tab, f"{n.A}, S2")
        for j in range(geo.g):
            lines.append(_mm(0, 1, geo.og, ck, npn, _at(gg, j * geo.og * npn), _at("S2", j * ck * npn),
                             _at(n.dst, j * geo.og * ck)))
        return lines, False
    lines = _call("tg_im2col", cv, tab, f"{n.A}, S1")
    if geo.g == 1:
        return lines + [_mm(1, 0, ck, geo.o, npn, "S1", n.G, n.dst)], False
    gl, gg = _regroup_g(n, geo, "S2")
    lines += gl
    y = f"S2 + {nout}L"
    for j in range(geo.g):
        lines.append(_mm(1, 0, ck, geo.og, npn, _at("S1", j * npn * ck), _at(gg, j * npn * geo.og),
                         _at(y, j * ck * geo.og)))
    return lines + _swap(n.dst, y, ck, geo.g, geo.og), False


def pool_fwd(n):
    _fits(n, len(n.ash))
    cv, tab = pool_tables(n.ash, n.s)
    return [f"{{ static const long cv[] = {_arr(cv)}; static const long tb[] = {_arr(tab)}; "
            f"tg_pool({int(n.name == 'max_pool')}, cv, tb, {n.A}, {n.V}, 0, 0); }}"]


def pool_da(n):
    """sum_pool: g added over every window position; max_pool: the first maximum's input index (in S1),
    then g added there only (one pass over the outputs when windows do not overlap, else window
    positions in row-major order as the NumPy rule adds them)."""
    cv, tab = pool_tables(n.ash, n.s)
    head = f"{{ static const long cv[] = {_arr(cv)}; static const long tb[] = {_arr(tab)}; "
    if n.name == "sum_pool":
        return [head + f"tg_pool(3, cv, tb, {n.A}, {n.dst}, 0, {n.G}); }}"], False
    if str(n.em.p.dtype) == "float32" and math.prod(n.ash) > 2 ** 24:
        raise TapeError(f"{at(n.name, n.k)}: a float32 program keeps max pooling's argmax indices in float32, "
                        f"exact up to 2**24 elements; got {math.prod(n.ash)}; capture in float64")
    win, st, _ = n.s
    mode = 5 if all(t >= w for w, t in zip(win, st)) else 4
    return [head + f"tg_pool(2, cv, tb, {n.A}, {n.V}, S1, 0); tg_pool({mode}, cv, tb, {n.A}, {n.dst}, S1, {n.G}); }}"], \
        False


FORWARD.update({"conv": conv_fwd, "max_pool": pool_fwd, "sum_pool": pool_fwd})
BACKWARD.update({"conv": conv_d, "max_pool": pool_da, "sum_pool": pool_da})
SCRATCH["conv"] = conv_scratch
