"""CUDA kernels of slice and concat: data movement, one thread per element written.

Each mirrors the native C element for element (``native.kernels.core``'s slice and concat printers):
a strided window gathered, its gradient zeros with g at the window's elements; concat's halves read
from and written back to the two inputs.
"""
import math

from .. import ops as O
from ..native.kernels import strides


def _coords(var, shape, name):
    return [f"const long {name}{d} = ({var} / {st}L) % {m}L;" for d, (m, st) in enumerate(zip(shape, strides(shape)))]


# ── slice / concat ───────────────────────────────────────────────────────────

def slice_fwd(g, k, op, a, b, s):
    st = strides(g.p.shapes[a])
    sl = O.steps(s)
    off = sum(lo * m for (lo, _, _), m in zip(sl, st))
    return [g.gather(f"f{k}", f"v{k}", f"(v{a} + {off}L)", g.p.shapes[k], [m * step for (_, _, step), m in zip(sl, st)])]


def slice_da(g, k, side, first):
    """zeros, with g at the window's elements: x = lo + j·step, 0 <= j < m on every axis"""
    _, a, _, s = g.p.nodes[k]
    ash, osh = g.p.shapes[a], g.p.shapes[k]
    ost = strides(osh)
    lines = _coords("i", ash, "x")
    inside, at = [], []
    for d, ((lo, _, step), m) in enumerate(zip(O.steps(s), osh)):
        lines.append(f"const long j{d} = (x{d} - {lo}L) / {step}L;")
        inside.append(f"(x{d} - {lo}L) % {step}L == 0 && j{d} >= 0 && j{d} < {m}L")
        at.append(f"j{d} * {ost[d]}L")
    cond = " && ".join(inside) or "1"
    lines.append(g.put(f"g{a}[i]", f"(({cond}) ? g{k}[{' + '.join(at) or '0L'}] : {g.d.lit(0.0)})", first))
    return [g.flat(f"da{k}", math.prod(ash), lines)]


def _concat_split(g, k):
    _, a, b, s = g.p.nodes[k]
    osh = g.p.shapes[k]
    return math.prod(osh[:s]), g.p.shapes[a][s], g.p.shapes[b][s], math.prod(osh[s + 1:])


def concat_fwd(g, k, op, a, b, s):
    outer, na, nb, inner = _concat_split(g, k)
    n = na + nb
    lines = [f"const long o = i / {n * inner}L, c = (i / {inner}L) % {n}L, ii = i % {inner}L;",
             f"v{k}[i] = c < {na}L ? v{a}[(o * {na}L + c) * {inner}L + ii] : v{b}[(o * {nb}L + c - {na}L) * {inner}L + ii];"]
    return [g.flat(f"f{k}", g.n(k), lines)]


def concat_d(g, k, side, first):
    _, a, b, s = g.p.nodes[k]
    outer, na, nb, inner = _concat_split(g, k)
    mine, shift, j = (na, 0, a) if side == "a" else (nb, na, b)
    lines = [f"const long o = i / {mine * inner}L, c = (i / {inner}L) % {mine}L, ii = i % {inner}L;",
             g.put(f"g{j}[i]", f"g{k}[(o * {na + nb}L + c + {shift}L) * {inner}L + ii]", first)]
    return [g.flat(f"d{side}{k}", outer * mine * inner, lines)]


FORWARD = {"slice": slice_fwd, "concat": concat_fwd}
BACKWARD = {"slice": slice_da, "concat": concat_d}
