"""Scans and reductions beyond sum/mean/max: cumulative sums, products and maxima, sort, min, prod, logsumexp.

Registry entries of this family (see ``tapegrad.ops.registry`` for what an entry holds). A scan's static operand
is ``(axis, reverse)``; ``reverse=True`` scans from the end of the axis (as ``lax.cumsum(..., reverse=True)``).
NumPy's accumulations (``np.add.accumulate``, ``np.multiply.accumulate``, ``np.maximum.accumulate``)
and its product reduction are sequential loops, so each rule below fixes one order of rounding, which
the native kernels (``runtime_scan.c``) repeat.
"""
import builtins
import math

import numpy as np

from .core import RED, keepdims, max_da, reduced
from .registry import Bad, away0, op, real, spread


def scan_shape(a, b, s):
    axis, reverse = s
    if not isinstance(axis, int) or not 0 <= axis < len(a):
        raise Bad(f"axis {axis!r} is out of range for an input of shape {a} (ndim {len(a)})")
    return a


def sort_shape(a, b, s):
    return scan_shape(a, b, (s, False))


def along(x, axis, reverse):
    """x itself, or the view of x reversed along ``axis``: a reverse scan is a forward scan of this view."""
    return x[(builtins.slice(None),) * axis + (builtins.slice(None, None, -1),)] if reverse else x


def at(axis, i):
    """The index of position ``i`` along ``axis`` (keeping the axis, so every selection is a view)."""
    return (builtins.slice(None),) * axis + (builtins.slice(i, i + 1),)


def accumulate(ufunc):
    def fwd(a, b, s, out, ws):
        axis, reverse = s
        ufunc.accumulate(along(a, axis, reverse), axis=axis, out=along(out, axis, reverse))
    return fwd


def cumsum_da(g, out, a, b, s, ws):
    # d out_k/d a_i = 1 for every k at or after i: a cumulative sum of g in the other direction
    axis, reverse = s
    t = ws.take(a.shape)
    np.add.accumulate(along(g, axis, not reverse), axis=axis, out=along(t, axis, not reverse))
    return t


def cumprod_da(g, out, a, b, s, ws):
    """d/da_i Σ_k g_k·Π_{j<=k} a_j = out_{i−1} · S_i with S_i = Σ_{k>=i} g_k·Π_{i<j<=k} a_j, by the reverse
    recurrence S_i = g_i + a_{i+1}·S_{i+1} (out_{−1} = 1). No division, so zeros in a are exact."""
    axis, reverse = s
    A, O, G = (along(x, axis, reverse) for x in (a, out, g))
    t = ws.take(a.shape)
    T = along(t, axis, reverse)
    m = a.shape[axis]
    np.copyto(T[at(axis, m - 1)], G[at(axis, m - 1)])
    for i in range(m - 2, -1, -1):
        np.multiply(A[at(axis, i + 1)], T[at(axis, i + 1)], out=T[at(axis, i)])
        np.add(G[at(axis, i)], T[at(axis, i)], out=T[at(axis, i)])
    for i in range(1, m):
        np.multiply(O[at(axis, i - 1)], T[at(axis, i)], out=T[at(axis, i)])
    return t


def cummax_da(g, out, a, b, s, ws):
    """g_k goes to the inputs equal to the running max out_k, shared equally between tied ones (as the
    gradient of ``max`` is). With c_k = #{j <= k: a_j = out_k} (c_k = [a_k = out_k] + [out_{k−1} = out_k]·c_{k−1})
    and h = g / c: d/da_j = [a_j = out_j] · R_j, R_j = h_j + [out_{j+1} = out_j]·R_{j+1}, since the k that
    a_j ties with are the run of k >= j where the running max stays out_j."""
    axis, reverse = s
    A, O, G = (along(x, axis, reverse) for x in (a, out, g))
    t, c = ws.take(a.shape), ws.take(a.shape)
    T, C = along(t, axis, reverse), along(c, axis, reverse)
    m = a.shape[axis]
    e = ws.take(a.shape[:axis] + (1,) + a.shape[axis + 1:])
    np.equal(A, O, out=T)
    np.copyto(C[at(axis, 0)], T[at(axis, 0)])
    for k in range(1, m):
        np.equal(O[at(axis, k - 1)], O[at(axis, k)], out=e)
        np.multiply(e, C[at(axis, k - 1)], out=C[at(axis, k)])
        np.add(T[at(axis, k)], C[at(axis, k)], out=C[at(axis, k)])
    np.divide(G, C, out=C)
    for j in range(m - 2, -1, -1):
        np.equal(O[at(axis, j + 1)], O[at(axis, j)], out=e)
        np.multiply(e, C[at(axis, j + 1)], out=e)
        np.add(C[at(axis, j)], e, out=C[at(axis, j)])
    np.multiply(T, C, out=T)
    return t


def sort_fwd(a, b, s, out, ws):
    out[...] = np.sort(a, axis=s, kind="stable")


def sort_da(g, out, a, b, s, ws):
    # out_k = a_{p(k)} with p the stable argsort: g_k goes back to position p(k), a permutation
    t = ws.take(a.shape)
    np.put_along_axis(t, np.argsort(a, axis=s, kind="stable"), g, axis=s)
    return t


def min_fwd(a, b, s, out, ws):
    np.minimum.reduce(a, axis=s[0], keepdims=s[1], out=out)


def prod_fwd(a, b, s, out, ws):
    np.multiply.reduce(a, axis=s[0], keepdims=s[1], out=out)


def split(shape, axes):
    """(kept axes + reduced axes, rows, n): a reduction as rows of its n reduced elements in C order."""
    axes = tuple(range(len(shape))) if axes is None else axes
    kept = tuple(k for k in range(len(shape)) if k not in axes)
    n = math.prod([shape[k] for k in axes])
    return kept + axes, math.prod(shape) // n if n else 0, n


def prod_da(g, out, a, b, s, ws):
    """d/da_i Π_j a_j = Π_{j<i} a_j · Π_{j>i} a_j (exclusive prefix times exclusive suffix, each a
    sequential product over the reduced elements in C order): no division, exact with zeros."""
    perm, rows, n = split(a.shape, s[0])
    x = ws.take((rows, n))
    np.copyto(x.reshape([a.shape[k] for k in perm]), a.transpose(perm))
    p, q = ws.take((rows, n)), ws.take((rows, n))
    p[:, 0] = 1.0
    np.multiply.accumulate(x[:, :-1], axis=1, out=p[:, 1:])
    q[:, -1] = 1.0
    np.multiply.accumulate(x[:, :0:-1], axis=1, out=q[:, -2::-1])
    np.multiply(p, q, out=p)
    np.multiply(p, g.reshape(rows, 1), out=p)
    t = ws.take(a.shape)
    np.copyto(t, p.reshape([a.shape[k] for k in perm]).transpose(np.argsort(perm)))
    return t


def logsumexp_fwd(a, b, s, out, ws):
    # m + log Σ exp(a − m) with m = max (0 where the max is ±inf or NaN, as jax.nn.logsumexp): no overflow
    r = ws.take(reduced(a.shape, None, (s[0], True)))
    np.maximum.reduce(a, axis=s[0], keepdims=True, out=r)
    np.copyto(r, 0.0, where=~np.isfinite(r))
    t = ws.take(a.shape)
    np.subtract(a, r, out=t)
    np.exp(t, out=t)
    np.add.reduce(t, axis=s[0], keepdims=s[1], out=out)
    np.log(out, out=out)
    np.add(out, r.reshape(out.shape), out=out)


def logsumexp_da(g, out, a, b, s, ws):
    # g · exp(a − out), the softmax over the reduced axes
    t = ws.take(a.shape)
    np.subtract(a, keepdims(out, a.shape, s), out=t)
    np.exp(t, out=t)
    return np.multiply(keepdims(g, a.shape, s), t, out=t)


SCAN = (((3, 4), None, (1, False)), ((3, 4), None, (0, True)), ((2, 3, 4), None, (1, False)),
        ((5,), None, (0, True)), ((2, 3, 2), None, (2, True)))
SORT = (((3, 4), None, 1), ((4, 3), None, 0), ((2, 3, 4), None, 1), ((6,), None, 0))

cumsum = op("cumsum", 1, scan_shape, fwd=accumulate(np.add), da=cumsum_da,
            ref=lambda jnp, a, b, s: jnp.lax.cumsum(a, s[0], reverse=s[1]),
            kind="scan", domain=(real,), cases=SCAN,
            doc="running sum along an axis, s = (axis, reverse); sequential, as NumPy's")
cumprod = op("cumprod", 1, scan_shape, fwd=accumulate(np.multiply), da=cumprod_da,
             ref=lambda jnp, a, b, s: jnp.lax.cumprod(a, s[0], reverse=s[1]),
             kind="scan", domain=(away0,), cases=SCAN,
             doc="running product along an axis; the gradient needs no division (exact with zeros)")
cummax = op("cummax", 1, scan_shape, fwd=accumulate(np.maximum), da=cummax_da,
            ref=lambda jnp, a, b, s: jnp.lax.cummax(a, s[0], reverse=s[1]),
            kind="scan", domain=(spread,), cases=SCAN,
            doc="running max along an axis; tied inputs share each output's gradient equally")
sort = op("sort", 1, sort_shape, fwd=sort_fwd, da=sort_da,
          ref=lambda jnp, a, b, s: jnp.sort(a, axis=s),
          kind="scan", domain=(spread,), cases=SORT,
          doc="ascending stable sort along axis s (NaN last); the gradient follows the stable argsort")
min = op("min", 1, reduced, fwd=min_fwd, da=max_da,
         ref=lambda jnp, a, b, s: jnp.min(a, axis=s[0], keepdims=s[1]),
         kind="reduce", domain=(spread,), cases=RED,
         doc="min over axes; tied minima share the gradient equally")
prod = op("prod", 1, reduced, fwd=prod_fwd, da=prod_da,
          ref=lambda jnp, a, b, s: jnp.prod(a, axis=s[0], keepdims=s[1]),
          tier="order", kind="reduce", domain=(away0,), cases=RED,
          doc="Π over axes (NumPy's sequential order); gradient by prefix·suffix products, exact with zeros")
logsumexp = op("logsumexp", 1, reduced, fwd=logsumexp_fwd, da=logsumexp_da,
               ref=lambda jnp, a, b, s: jnp.scipy.special.logsumexp(a, axis=s[0], keepdims=s[1]),
               tier="libm", ulps=(8, 1.0), kind="reduce", domain=(real,), cases=RED,
               doc="log Σ exp over axes, shifted by the max (no overflow); gradient g·exp(a − out)")
