"""The non-elementwise ops' C: one forward and one backward printer per op name, each mirroring its
NumPy rule in ``tapegrad.ops`` step by step (one rounding per NumPy call, NumPy's reduction order).

A forward printer takes a ``Node`` and returns C lines; a backward printer returns ``(lines, done)``:
lines that write the contribution to ``n.dst`` (the gradient itself for a first contribution, else
scratch S0 that the emitter then adds), or, with ``done``, lines that already accumulated it. An op
missing here has no native form: the emitter raises naming it.

``SCRATCH[name](p, k)`` (optional) is how many elements each of the three scratch buffers S0..S2 must
hold for node ``k`` of program ``p``, when that is more than the largest node shape (im2col, say).
"""
import math
from typing import NamedTuple

from .. import ops as O


class Node(NamedTuple):
    em: object          # the Emitter (reduce/gather/scatter/acc/unbroadcast printers)
    name: str
    k: int
    a: int
    b: int
    s: object
    A: str              # value buffer names of a, b, the node, and the node's gradient
    B: str
    V: str
    G: str
    ash: tuple
    bsh: tuple
    osh: tuple
    side: str           # backward: "a" or "b"
    j: int              # backward: the input receiving the contribution
    dst: str            # backward: where the contribution goes
    first: bool
    d: object           # the dialect (literals)
    C: str = None       # the third (data) input's value buffer and shape, if the op has one
    csh: tuple = None


def c_array(vals):
    """A C initialiser for a ``static const long`` table (``{0}`` for an empty one)."""
    return "{" + ", ".join(str(int(v)) for v in vals) + "}" if vals else "{0}"


def strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def bstrides(xs, os_):
    """Element strides of an operand of shape xs read over out shape os_ (0 on broadcast axes)."""
    lead = len(os_) - len(xs)
    st = strides(xs)
    return tuple(0 if k < lead or xs[k - lead] == 1 else st[k - lead] for k in range(len(os_)))


def red_mask(shape, axes):
    axes = range(len(shape)) if axes is None else axes
    return tuple(1 if k in axes else 0 for k in range(len(shape)))


def keep(shape, s):
    axes = range(len(shape)) if s[0] is None else s[0]
    return tuple(1 if k in axes else n for k, n in enumerate(shape))


def axis3(shape, s):
    return math.prod(shape[:s]), shape[s], math.prod(shape[s + 1:])


def _loop(n, body):
    return f"for (long i = 0; i < {n}L; i++) {body}"


# ── forward ──────────────────────────────────────────────────────────────────

def reduce_fwd(n):
    """sum / max: NumPy's reduction order (runtime ``tg_reduce``); mean then divides by the count."""
    lines = n.em.reduce(1 if n.name == "max" else 0, n.A, n.V, n.ash, red_mask(n.ash, n.s[0]))
    if n.name == "mean":
        lines.append(_loop(math.prod(n.osh), f"{n.V}[i] = {n.V}[i] / {n.d.lit(float(O.count(n.ash, n.s)))};"))
    return lines


def matmul_fwd(n):
    return [f"tg_mm((tg_gemm_t)T[0], 0, 0, {n.ash[0]}, {n.bsh[1]}, {n.ash[1]}, {n.A}, {n.B}, {n.V});"]


def bmm_fwd(n):
    bs, m, kk = n.ash
    nn = n.bsh[2]
    return [f"for (long q = 0; q < {bs}L; q++) tg_mm((tg_gemm_t)T[0], 0, 0, {m}, {nn}, {kk}, "
            f"{n.A} + q * {m * kk}L, {n.B} + q * {kk * nn}L, {n.V} + q * {m * nn}L);"]


def transpose_fwd(n):
    st = strides(n.ash)
    return n.em.gather(n.V, n.A, n.osh, [st[j] for j in n.s])


def reshape_fwd(n):
    return [f"memcpy({n.V}, {n.A}, {math.prod(n.osh)}UL * sizeof(real));"]


def broadcast_to_fwd(n):
    return n.em.gather(n.V, n.A, n.osh, bstrides(n.ash, n.osh))


def softmax_fwd(n):
    outer, m, inner = axis3(n.ash, n.s)
    return [f"tg_softmax({int(n.name == 'logsoftmax')}, {n.A}, {n.V}, S0, S2, {outer}L, {m}L, {inner}L);"]


def xent_fwd(n):
    """−Σ b · logsoftmax(a) over every element (pairwise, as NumPy's full reduction) / −rows."""
    outer, m, inner = axis3(n.ash, n.s)
    tot = math.prod(n.ash)
    return [f"tg_softmax(1, {n.A}, S0, S1, S2, {outer}L, {m}L, {inner}L);",
            _loop(tot, f"S0[i] = {n.B}[i] * S0[i];")] + n.em.reduce(0, "S0", n.V, (tot,), (1,)) + \
        [f"{n.V}[0] = {n.V}[0] / {n.d.lit(float(-(outer * inner)))};"]


def window(n):
    """A (strided) slice as an offset and element strides into the input."""
    st = strides(n.ash)
    sl = O.steps(n.s)
    return sum(lo * m for (lo, _, _), m in zip(sl, st)), [m * step for (_, _, step), m in zip(sl, st)]


def slice_fwd(n):
    off, st = window(n)
    return n.em.gather(n.V, f"{n.A} + {off}L", n.osh, st)


def concat_fwd(n):
    ost = strides(n.osh)
    off = n.ash[n.s] * ost[n.s]
    return n.em.scatter(n.V, ost, n.A, n.ash, True) + n.em.scatter(f"{n.V} + {off}L", ost, n.B, n.bsh, True)


FORWARD = {"sum": reduce_fwd, "mean": reduce_fwd, "max": reduce_fwd, "matmul": matmul_fwd, "bmm": bmm_fwd,
           "transpose": transpose_fwd, "reshape": reshape_fwd, "broadcast_to": broadcast_to_fwd,
           "softmax": softmax_fwd, "logsoftmax": softmax_fwd, "softmax_xent": xent_fwd, "slice": slice_fwd,
           "concat": concat_fwd}


# ── backward ─────────────────────────────────────────────────────────────────

def spread_da(n):
    """sum: g spread over the reduced axes; mean: then divided by the count."""
    lines = n.em.gather(n.dst, n.G, n.ash, bstrides(keep(n.ash, n.s), n.ash))
    if n.name == "mean":
        lines.append(_loop(math.prod(n.ash), f"{n.dst}[i] = {n.dst}[i] / {n.d.lit(float(O.count(n.ash, n.s)))};"))
    return lines, False


def max_da(n):
    """hit = (a == out); ties = Σ hit; c = hit · g / ties (tied maxima share the gradient)."""
    st = bstrides(keep(n.ash, n.s), n.ash)
    size, osize = math.prod(n.ash), math.prod(n.osh)
    one, zero = n.d.lit(1.0), n.d.lit(0.0)
    lines = n.em.gather("S1", n.V, n.ash, st)
    lines.append(_loop(size, f"{n.dst}[i] = {n.A}[i] == S1[i] ? {one} : {zero};"))
    lines += n.em.reduce(0, n.dst, "S2", n.ash, red_mask(n.ash, n.s[0]))
    lines.append(_loop(osize, f"S2[i] = {n.G}[i] / S2[i];"))
    lines += n.em.gather("S1", "S2", n.ash, st)
    lines.append(_loop(size, f"{n.dst}[i] = {n.dst}[i] * S1[i];"))
    return lines, False


def matmul_d(n):
    """da = g @ bᵀ, db = aᵀ @ g (``tg_mm``: BLAS with the transpose flags NumPy passes, or the
    small-product kernel)."""
    m, kk = n.ash
    nn = n.bsh[1]
    if n.side == "a":
        return [f"tg_mm((tg_gemm_t)T[0], 0, 1, {m}, {kk}, {nn}, {n.G}, {n.B}, {n.dst});"], False
    return [f"tg_mm((tg_gemm_t)T[0], 1, 0, {kk}, {nn}, {m}, {n.A}, {n.G}, {n.dst});"], False


def bmm_d(n):
    bs, m, kk = n.ash
    nn = n.bsh[2]
    if n.side == "a":
        call = (f"tg_mm((tg_gemm_t)T[0], 0, 1, {m}, {kk}, {nn}, {n.G} + q * {m * nn}L, {n.B} + q * {kk * nn}L, "
                f"{n.dst} + q * {m * kk}L);")
    else:
        call = (f"tg_mm((tg_gemm_t)T[0], 1, 0, {kk}, {nn}, {m}, {n.A} + q * {m * kk}L, {n.G} + q * {m * nn}L, "
                f"{n.dst} + q * {kk * nn}L);")
    return [f"for (long q = 0; q < {bs}L; q++) {call}"], False


def transpose_da(n):
    inv = [n.s.index(d) for d in range(len(n.s))]
    st = strides(n.osh)
    return n.em.gather(n.dst, n.G, n.ash, [st[d] for d in inv]), False


def reshape_da(n):
    return n.em.acc(n.j, n.G, n.first), True


def broadcast_to_da(n):
    return n.em.unbroadcast(n.G, n.osh, n.j, n.first), True


def softmax_da(n):
    outer, m, inner = axis3(n.ash, n.s)
    return [f"tg_softmax_da({int(n.name == 'logsoftmax')}, {n.G}, {n.V}, {n.dst}, S2, {outer}L, {m}L, "
            f"{inner}L);"], False


def xent_d(n):
    """da = (softmax(a) · Σ_axis b − b) · (g / rows);  db = logsoftmax(a) · (−g / rows)."""
    outer, m, inner = axis3(n.ash, n.s)
    rows = n.d.lit(float(outer * inner))
    if n.side == "b":
        return [f"tg_softmax(1, {n.A}, {n.dst}, S1, S2, {outer}L, {m}L, {inner}L);",
                f"{{ const real q = (-{n.G}[0]) / {rows};",
                f"  {_loop(math.prod(n.ash), f'{n.dst}[i] = {n.dst}[i] * q; }}')}"], False
    lines = [f"tg_softmax(0, {n.A}, {n.dst}, S1, S2, {outer}L, {m}L, {inner}L);"]
    lines += n.em.reduce(0, n.B, "S2", (outer, m, inner), (0, 1, 0))
    lines += [f"{{ const real q = {n.G}[0] / {rows};",
              f"  for (long o = 0; o < {outer}L; o++) for (long jj = 0; jj < {m}L; jj++) "
              f"for (long ii = 0; ii < {inner}L; ii++) {{",
              f"    const long i = (o * {m}L + jj) * {inner}L + ii;",
              f"    real t = {n.dst}[i] * S2[o * {inner}L + ii];",
              f"    t = t - {n.B}[i];",
              f"    {n.dst}[i] = t * q; }} }}"]
    return lines, False


def slice_da(n):
    """zeros, then g placed in the window."""
    off, st = window(n)
    return [f"tg_fill({n.dst}, {math.prod(n.ash)}L, {n.d.lit(0.0)});"] + \
        n.em.scatter(f"{n.dst} + {off}L", st, n.G, n.osh, True), False


def concat_d(n):
    ost = strides(n.osh)
    off = 0 if n.side == "a" else n.ash[n.s] * ost[n.s]
    return n.em.gather(n.dst, f"{n.G} + {off}L", n.ash if n.side == "a" else n.bsh, ost), False


BACKWARD = {"sum": spread_da, "mean": spread_da, "max": max_da, "matmul": matmul_d, "bmm": bmm_d,
            "transpose": transpose_da, "reshape": reshape_da, "broadcast_to": broadcast_to_da,
            "softmax": softmax_da, "logsoftmax": softmax_da, "softmax_xent": xent_d, "slice": slice_da,
            "concat": concat_d}

SCRATCH = {}

# The op families' printers register themselves here on import (one module per family, as in tapegrad.ops).
from . import kernels_special, kernels_scan, kernels_index, kernels_conv, kernels_linalg, kernels_ordered  # noqa: E402,F401,E501
