"""The native C of the core ops that are not elementwise: reductions, products, layout, softmax, slices.

Printers registered into ``registry.FORWARD``/``BACKWARD`` (what a printer takes and returns is there).
"""
import math

from ... import ops as O
from .registry import BACKWARD, FORWARD, _loop, axis3, bstrides, keep, red_mask, strides


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


FORWARD.update({"sum": reduce_fwd, "mean": reduce_fwd, "max": reduce_fwd, "matmul": matmul_fwd, "bmm": bmm_fwd,
                "transpose": transpose_fwd, "reshape": reshape_fwd, "broadcast_to": broadcast_to_fwd,
                "softmax": softmax_fwd, "logsoftmax": softmax_fwd, "softmax_xent": xent_fwd, "slice": slice_fwd,
                "concat": concat_fwd})


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
    """zeros, then g placed in the window; a later contribution adds g into the window of the gradient
    itself (the tape adds a whole array of zeros around it: x + 0 is x, but for the sign of a zero, which
    the tiers count equal), not a zeroed scratch of the input's size added element by element."""
    off, st = window(n)
    if not n.first:
        return n.em.scatter(f"g{n.j} + {off}L", st, n.G, n.osh, False), True
    return [f"tg_fill({n.dst}, {math.prod(n.ash)}L, {n.d.lit(0.0)});"] + \
        n.em.scatter(f"{n.dst} + {off}L", st, n.G, n.osh, True), False


def concat_d(n):
    ost = strides(n.osh)
    off = 0 if n.side == "a" else n.ash[n.s] * ost[n.s]
    return n.em.gather(n.dst, f"{n.G} + {off}L", n.ash if n.side == "a" else n.bsh, ost), False


BACKWARD.update({"sum": spread_da, "mean": spread_da, "max": max_da, "matmul": matmul_d, "bmm": bmm_d,
                 "transpose": transpose_da, "reshape": reshape_da, "broadcast_to": broadcast_to_da,
                 "softmax": softmax_da, "logsoftmax": softmax_da, "softmax_xent": xent_d, "slice": slice_da,
                 "concat": concat_d})
