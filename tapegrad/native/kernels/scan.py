"""The native C of the scan family's ops: printers registered into ``registry.FORWARD``/``BACKWARD``.

Tiers (``tapegrad.ops.scan``): cumsum, cumprod, cummax, sort and min replay == the tape (sequential
scans in NumPy's order, comparisons, data movement); prod follows NumPy's sequential multiply reduction
through ``tg_reduce`` (== as well, tier "order" like ``sum``); logsumexp calls exp/log ("libm").
"""
import math

from ...errors import TapeError, at
from .core import max_da
from .registry import BACKWARD, FORWARD, _loop, axis3, bstrides, keep, red_mask, strides

SCAN_MODE = {"cumsum": 0, "cumprod": 1, "cummax": 2}   # tg_scan: running sum, product, max


def scan_fwd(n):
    outer, m, inner = axis3(n.ash, n.s[0])
    return [f"tg_scan({SCAN_MODE[n.name]}, {n.A}, {n.V}, {outer}L, {m}L, {inner}L, {int(n.s[1])});"]


def cumsum_da(n):
    """the running sum of g in the other direction"""
    outer, m, inner = axis3(n.ash, n.s[0])
    return [f"tg_scan(0, {n.G}, {n.dst}, {outer}L, {m}L, {inner}L, {int(not n.s[1])});"], False


def cumprod_da(n):
    outer, m, inner = axis3(n.ash, n.s[0])
    return [f"tg_cumprod_da({n.A}, {n.V}, {n.G}, {n.dst}, {outer}L, {m}L, {inner}L, {int(n.s[1])});"], False


def cummax_da(n):
    outer, m, inner = axis3(n.ash, n.s[0])
    return [f"tg_cummax_da({n.A}, {n.V}, {n.G}, {n.dst}, S1, {outer}L, {m}L, {inner}L, {int(n.s[1])});"], False


def sort_line(n):
    """(outer, m, inner) of a sort; its argsort holds indices as reals, exact up to 2**24 in float32."""
    outer, m, inner = axis3(n.ash, n.s)
    if n.d.real == "float" and m > 2 ** 24:
        raise TapeError(f"{at('sort', n.k)}: a float32 program sorts lines of at most 2**24 elements (its "
                        f"argsort indices are floats); got {m}; capture in float64")
    return outer, m, inner


def sort_fwd(n):
    outer, m, inner = sort_line(n)
    return [f"tg_sort(0, {n.A}, {n.A}, {n.V}, S1, S2, {outer}L, {m}L, {inner}L);"]


def sort_da(n):
    outer, m, inner = sort_line(n)
    return [f"tg_sort(1, {n.A}, {n.G}, {n.dst}, S1, S2, {outer}L, {m}L, {inner}L);"], False


def reduce_fwd(n):
    """min: tg_reduce's mode 2; prod: mode 3 (sequential, NumPy's order)."""
    return n.em.reduce(2 if n.name == "min" else 3, n.A, n.V, n.ash, red_mask(n.ash, n.s[0]))


def prod_da(n):
    """a's reduced elements gathered as rows (kept axes first) into S1, prefix·suffix products into S2,
    scattered back into a's layout."""
    axes = tuple(range(len(n.ash))) if n.s[0] is None else n.s[0]
    perm = tuple(k for k in range(len(n.ash)) if k not in axes) + axes
    st = strides(n.ash)
    tsh = tuple(n.ash[k] for k in perm)
    tst = strides(tsh)
    size = math.prod(n.ash)
    rows = math.prod(n.osh)
    lines = n.em.gather("S1", n.A, tsh, [st[k] for k in perm])
    lines.append(f"tg_prod_da(S1, {n.G}, S2, {rows}L, {size // rows}L);")
    lines += n.em.gather(n.dst, "S2", n.ash, [tst[perm.index(k)] for k in range(len(n.ash))])
    return lines, False


def logsumexp_fwd(n):
    """r = max (0 where not finite); S2 = exp(a − r); out = Σ S2 (NumPy's order); out = log(out) + r."""
    red = red_mask(n.ash, n.s[0])
    size, osize = math.prod(n.ash), math.prod(n.osh)
    zero = n.d.lit(0.0)
    lines = n.em.reduce(1, n.A, "S1", n.ash, red)
    lines.append(_loop(osize, f"{{ const real r = S1[i]; S1[i] = isfinite(r) ? r : {zero}; }}"))
    lines += n.em.gather("S2", "S1", n.ash, bstrides(keep(n.ash, n.s), n.ash))
    lines.append(_loop(size, f"S2[i] = tg_exp({n.A}[i] - S2[i]);"))
    lines += n.em.reduce(0, "S2", n.V, n.ash, red)
    lines.append(_loop(osize, f"{n.V}[i] = tg_log({n.V}[i]) + S1[i];"))
    return lines


def logsumexp_da(n):
    """g · exp(a − out), out and g spread over the reduced axes."""
    st = bstrides(keep(n.ash, n.s), n.ash)
    lines = n.em.gather("S1", n.V, n.ash, st) + n.em.gather("S2", n.G, n.ash, st)
    lines.append(_loop(math.prod(n.ash), f"{n.dst}[i] = S2[i] * tg_exp({n.A}[i] - S1[i]);"))
    return lines, False


FORWARD.update({"cumsum": scan_fwd, "cumprod": scan_fwd, "cummax": scan_fwd, "sort": sort_fwd,
                  "min": reduce_fwd, "prod": reduce_fwd, "logsumexp": logsumexp_fwd})
BACKWARD.update({"cumsum": cumsum_da, "cumprod": cumprod_da, "cummax": cummax_da, "sort": sort_da,
                   "min": max_da, "prod": prod_da, "logsumexp": logsumexp_da})
