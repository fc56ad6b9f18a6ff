"""Convolution and pooling: N-D convolution (strides, padding, dilations, feature groups), max and sum pooling.

Registry entries of this family (see ``tapegrad.ops.registry`` for what an entry holds).

``conv`` is computed as im2col + one GEMM per feature group, so the NumPy forward and the native
program make the very same BLAS calls (same shapes, same transposition flags, contiguous operands);
everything around the GEMMs is data movement (exact) or an accumulation in a fixed order:

  channels first (NCHW, kernel OIHW):  cols (C, *k, N, *o);  Y_g (Og, N·P) = W_g (Og, Cg·K) @ cols_g
  channels last  (NHWC, kernel HWIO):  cols (G, N, *o, *k, Cg);  Y_g (N·P, Og) = cols_g @ W_g (K·Cg, Og)

(K = kernel positions, P = output positions, Cg/Og = input/output channels per group). The VJPs are the
adjoints of those two linear steps: out = W·cols gives dcols = Wᵀ·g and dW = g·colsᵀ, and im2col's
adjoint col2im scatters dcols back onto the input, adding the kernel positions in row-major order
(the transposed-convolution / "backward data" and "backward filter" formulas, e.g. Dumoulin & Visin,
"A guide to convolution arithmetic for deep learning", 2016, sections 4-5).

Pooling walks the window positions in row-major order: ``sum_pool`` adds them in that order (starting
from the first one), ``max_pool`` keeps the running maximum, and its gradient goes to the FIRST input
element of the window (in that order) equal to the window's maximum — the rule of XLA's
``select_and_scatter_add`` with JAX's ``>=`` select, which ``jax.grad`` of ``reduce_window`` max uses.
"""
import itertools
import math
from typing import NamedTuple

import numpy as np

from .registry import Bad, op, real, spread

LAYOUTS = ("NCHW", "NHWC")


class Geo(NamedTuple):
    """The geometry of one convolution (channel-first and channel-last alike)."""
    last: bool          # channels last (NHWC / HWIO)
    n: int
    c: int
    o: int
    g: int
    cg: int
    og: int
    inp: tuple          # input spatial sizes
    k: tuple            # kernel spatial sizes
    out: tuple          # output spatial sizes
    st: tuple
    pads: tuple
    ld: tuple
    rd: tuple

    @property
    def kk(self):
        return math.prod(self.k)

    @property
    def p(self):
        return math.prod(self.out)

    @property
    def padded(self):
        return tuple((i - 1) * d + 1 + lo + hi for i, d, (lo, hi) in zip(self.inp, self.ld, self.pads))

    def window(self, kidx):
        """The slices of the padded input that kernel position ``kidx`` reads for every output position."""
        return tuple(slice(j * r, j * r + (m - 1) * s + 1, s) for j, r, m, s in zip(kidx, self.rd, self.out, self.st))

    def interior(self):
        """The slices of the padded input where the input itself sits."""
        return tuple(slice(lo, lo + (i - 1) * d + 1, d) for i, d, (lo, _) in zip(self.inp, self.ld, self.pads))


def _ints(name, v, n, least):
    if not isinstance(v, tuple) or len(v) != n or any(not isinstance(x, int) or x < least for x in v):
        raise Bad(f"{name} must be {n} integer(s) >= {least} (one per spatial dimension), got {v!r}")


def geometry(xs, ws, s):
    """Check a convolution's shapes against its static operand; raises ``Bad`` saying what does not fit."""
    if not isinstance(s, tuple) or len(s) != 6:
        raise Bad(f"expected s = (layout, strides, padding, lhs_dilation, rhs_dilation, groups), got {s!r}")
    layout, st, pads, ld, rd, g = s
    if layout not in LAYOUTS:
        raise Bad(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    if len(xs) < 3:
        raise Bad(f"expected an input of rank >= 3 (batch, channels, spatial...), got shape {xs}")
    if len(ws) != len(xs):
        raise Bad(f"expected a kernel of rank {len(xs)} like the input {xs}, got shape {ws}")
    nsp = len(xs) - 2
    _ints("strides", st, nsp, 1)
    _ints("lhs_dilation", ld, nsp, 1)
    _ints("rhs_dilation", rd, nsp, 1)
    if not isinstance(pads, tuple) or len(pads) != nsp or any(
            not isinstance(p, tuple) or len(p) != 2 or any(not isinstance(x, int) or x < 0 for x in p) for p in pads):
        raise Bad(f"padding must be {nsp} (low, high) pairs of integers >= 0, got {pads!r}")
    if not isinstance(g, int) or g < 1:
        raise Bad(f"groups must be an integer >= 1, got {g!r}")
    last = layout == "NHWC"
    n, c, inp = (xs[0], xs[-1], xs[1:-1]) if last else (xs[0], xs[1], xs[2:])
    o, ci, k = (ws[-1], ws[-2], ws[:-2]) if last else (ws[0], ws[1], ws[2:])
    kname = "HWIO" if last else "OIHW"
    if c % g:
        raise Bad(f"groups={g} must divide the {c} input channels of {xs}")
    if o % g:
        raise Bad(f"groups={g} must divide the {o} output channels of the {kname} kernel {ws}")
    if ci != c // g:
        raise Bad(f"the {kname} kernel {ws} has {ci} input channels; expected {c // g} "
                  f"(the input's {c} channels / groups={g})")
    out = []
    for d in range(nsp):
        span = (inp[d] - 1) * ld[d] + 1 + pads[d][0] + pads[d][1]
        ext = (k[d] - 1) * rd[d] + 1
        if inp[d] < 1 or k[d] < 1 or span < ext:
            raise Bad(f"spatial dim {d}: the dilated kernel spans {ext} but the padded input has {span} "
                      f"(input {inp[d]}, padding {pads[d]}, lhs_dilation {ld[d]})")
        out.append((span - ext) // st[d] + 1)
    return Geo(last, n, c, o, g, c // g, o // g, tuple(inp), tuple(k), tuple(out), st, pads, ld, rd)


def conv_shape(a, b, s):
    geo = geometry(a, b, s)
    return (geo.n,) + geo.out + (geo.o,) if geo.last else (geo.n, geo.o) + geo.out


def _padded(x, geo, ws):
    """The input with its padding and lhs dilation as zeros (x itself when there is neither)."""
    if all(p == (0, 0) for p in geo.pads) and all(d == 1 for d in geo.ld):
        return x
    sp = geo.padded
    xp = ws.take((geo.n,) + sp + (geo.c,) if geo.last else (geo.n, geo.c) + sp)
    xp.fill(0.0)
    xp[_full(geo, geo.interior())] = x
    return xp


def _full(geo, spatial):
    return (slice(None),) + spatial + (slice(None),) if geo.last else (slice(None), slice(None)) + spatial


def _kidx(geo):
    return itertools.product(*[range(k) for k in geo.k])


def im2col(x, geo, ws):
    """cols (C, *k, N, *o) (channels first) or (G, N, *o, *k, Cg) (channels last), a copy of input windows."""
    xp = _padded(x, geo, ws)
    nsp = len(geo.k)
    if not geo.last:
        cols = ws.take((geo.c,) + geo.k + (geo.n,) + geo.out)
        perm = (1, 0) + tuple(range(2, 2 + nsp))
        for kidx in _kidx(geo):
            np.copyto(cols[(slice(None),) + kidx], xp[_full(geo, geo.window(kidx))].transpose(perm))
        return cols
    cols = ws.take((geo.g, geo.n) + geo.out + geo.k + (geo.cg,))
    xg = xp.reshape(xp.shape[:-1] + (geo.g, geo.cg))
    perm = (nsp + 1, 0) + tuple(range(1, nsp + 1)) + (nsp + 2,)
    for kidx in _kidx(geo):
        win = xg[(slice(None),) + geo.window(kidx) + (slice(None), slice(None))]
        np.copyto(cols[(slice(None),) * (2 + nsp) + kidx], win.transpose(perm))
    return cols


def col2im(dcols, geo, ws):
    """The adjoint of ``im2col``: the windows added back onto a zero input, kernel positions in row-major order."""
    sp = geo.padded
    dxp = ws.take((geo.n,) + sp + (geo.c,) if geo.last else (geo.n, geo.c) + sp)
    dxp.fill(0.0)
    nsp = len(geo.k)
    if not geo.last:
        perm = (1, 0) + tuple(range(2, 2 + nsp))
        for kidx in _kidx(geo):
            win = dxp[_full(geo, geo.window(kidx))]
            np.add(win, dcols[(slice(None),) + kidx].transpose(perm), out=win)
    else:
        xg = dxp.reshape(dxp.shape[:-1] + (geo.g, geo.cg))
        perm = tuple(range(1, nsp + 2)) + (0, nsp + 2)
        for kidx in _kidx(geo):
            win = xg[(slice(None),) + geo.window(kidx) + (slice(None), slice(None))]
            np.add(win, dcols[(slice(None),) * (2 + nsp) + kidx].transpose(perm), out=win)
    if all(p == (0, 0) for p in geo.pads) and all(d == 1 for d in geo.ld):
        return dxp
    dx = ws.take((geo.n,) + geo.inp + (geo.c,) if geo.last else (geo.n, geo.c) + geo.inp)
    np.copyto(dx, dxp[_full(geo, geo.interior())])
    return dx


def _gfirst(g, geo, ws):
    """The cotangent regrouped for the GEMMs: (O, N·P) channels first, (G, N·P, Og) channels last."""
    if not geo.last:
        t = ws.take((geo.o, geo.n, geo.p))
        np.copyto(t, g.reshape(geo.n, geo.o, geo.p).transpose(1, 0, 2))
        return t.reshape(geo.g, geo.og, geo.n * geo.p)
    if geo.g == 1:
        return g.reshape(1, geo.n * geo.p, geo.o)
    t = ws.take((geo.g, geo.n * geo.p, geo.og))
    np.copyto(t, g.reshape(geo.n * geo.p, geo.g, geo.og).transpose(1, 0, 2))
    return t


def _wgroups(w, geo, ws):
    """The kernel as per-group GEMM operands: (G, Og, Cg·K) channels first, (G, K·Cg, Og) channels last."""
    if not geo.last:
        return w.reshape(geo.g, geo.og, geo.cg * geo.kk)
    w2 = w.reshape(geo.kk * geo.cg, geo.o)
    if geo.g == 1:
        return w2.reshape(1, geo.kk * geo.cg, geo.o)
    t = ws.take((geo.g, geo.kk * geo.cg, geo.og))
    np.copyto(t, w2.reshape(geo.kk * geo.cg, geo.g, geo.og).transpose(1, 0, 2))
    return t


def conv_fwd(a, b, s, out, ws):
    geo = geometry(a.shape, b.shape, s)
    cols = im2col(a, geo, ws)
    wg = _wgroups(b, geo, ws)
    npn = geo.n * geo.p
    if not geo.last:
        cols = cols.reshape(geo.g, geo.cg * geo.kk, npn)
        y = ws.take((geo.g, geo.og, npn))
        for j in range(geo.g):
            np.matmul(wg[j], cols[j], out=y[j])
        np.copyto(out.reshape(geo.n, geo.o, geo.p), y.reshape(geo.o, geo.n, geo.p).transpose(1, 0, 2))
        return
    cols = cols.reshape(geo.g, npn, geo.kk * geo.cg)
    if geo.g == 1:
        np.matmul(cols[0], wg[0], out=out.reshape(npn, geo.o))
        return
    y = ws.take((geo.g, npn, geo.og))
    for j in range(geo.g):
        np.matmul(cols[j], wg[j], out=y[j])
    np.copyto(out.reshape(npn, geo.g, geo.og), y.transpose(1, 0, 2))


def conv_da(g, out, a, b, s, ws):
    # dcols = Wᵀ · g per group, then col2im (the "backward data" transposed convolution)
    geo = geometry(a.shape, b.shape, s)
    gg = _gfirst(g, geo, ws)
    wg = _wgroups(b, geo, ws)
    npn, ck = geo.n * geo.p, geo.cg * geo.kk
    if not geo.last:
        dcols = ws.take((geo.c,) + geo.k + (geo.n,) + geo.out)
        d2 = dcols.reshape(geo.g, ck, npn)
        for j in range(geo.g):
            np.matmul(wg[j].T, gg[j], out=d2[j])
    else:
        dcols = ws.take((geo.g, geo.n) + geo.out + geo.k + (geo.cg,))
        d2 = dcols.reshape(geo.g, npn, ck)
        for j in range(geo.g):
            np.matmul(gg[j], wg[j].T, out=d2[j])
    return col2im(dcols, geo, ws)


def conv_db(g, out, a, b, s, ws):
    # dW = g · colsᵀ per group (the "backward filter" correlation of the input with the cotangent)
    geo = geometry(a.shape, b.shape, s)
    cols = im2col(a, geo, ws)
    gg = _gfirst(g, geo, ws)
    npn, ck = geo.n * geo.p, geo.cg * geo.kk
    dw = ws.take(b.shape)
    if not geo.last:
        cols = cols.reshape(geo.g, ck, npn)
        d2 = dw.reshape(geo.g, geo.og, ck)
        for j in range(geo.g):
            np.matmul(gg[j], cols[j].T, out=d2[j])
        return dw
    cols = cols.reshape(geo.g, npn, ck)
    if geo.g == 1:
        np.matmul(cols[0].T, gg[0], out=dw.reshape(ck, geo.o))
        return dw
    y = ws.take((geo.g, ck, geo.og))
    for j in range(geo.g):
        np.matmul(cols[j].T, gg[j], out=y[j])
    np.copyto(dw.reshape(ck, geo.g, geo.og), y.transpose(1, 0, 2))
    return dw


def conv_ref(jnp, a, b, s):
    lax = jnp.lax
    layout, st, pads, ld, rd, g = s
    nsp = a.ndim - 2
    sp = "DHW"[3 - nsp:] if nsp <= 3 else "".join(chr(ord("a") + d) for d in range(nsp))
    dn = ("N" + sp + "C", sp + "IO", "N" + sp + "C") if layout == "NHWC" else ("NC" + sp, "OI" + sp, "NC" + sp)
    return lax.conv_general_dilated(a, b, st, pads, lhs_dilation=ld, rhs_dilation=rd, dimension_numbers=dn,
                                    feature_group_count=g, precision=lax.Precision.HIGHEST)


def _c(layout, st, pads, ld=None, rd=None, g=1):
    n = len(st)
    return (layout, st, pads, ld or (1,) * n, rd or (1,) * n, g)


CONV_CASES = (
    ((2, 3, 7), (4, 3, 3), _c("NCHW", (1,), ((0, 0),))),                                        # 1-D
    ((2, 2, 6, 5), (3, 2, 3, 2), _c("NCHW", (2, 1), ((1, 1), (0, 2)))),                          # strides, pads
    ((1, 4, 5, 5), (4, 2, 2, 2), _c("NCHW", (1, 1), ((1, 0), (0, 1)), (2, 1), (1, 2), 2)),       # dilations, groups
    ((2, 5, 4, 3), (2, 2, 3, 4), _c("NHWC", (1, 2), ((1, 1), (1, 0)))),                          # NHWC
    ((1, 4, 5, 4), (3, 2, 2, 6), _c("NHWC", (2, 1), ((0, 1), (2, 0)), (1, 2), (2, 1), 2)),       # NHWC groups
    ((1, 2, 3, 4, 3), (2, 2, 2, 2, 2), _c("NCHW", (1, 2, 1), ((0, 0), (1, 0), (0, 1)))),         # 3-D
)

conv = op("conv", 2, conv_shape, fwd=conv_fwd, da=conv_da, db=conv_db, ref=conv_ref,
          tier="blas", kind="conv", domain=(real, real), cases=CONV_CASES,
          doc="N-D convolution (lax.conv_general_dilated): im2col + one BLAS GEMM per feature group; "
              "s = (layout, strides, padding, lhs_dilation, rhs_dilation, groups)")


# ── pooling (reduce_window over every axis) ──────────────────────────────────

def pool_geometry(xs, s):
    """The output shape of a pooling node; raises ``Bad`` saying what does not fit."""
    if not isinstance(s, tuple) or len(s) != 3:
        raise Bad(f"expected s = (window, strides, padding), one entry per axis, got {s!r}")
    win, st, pads = s
    nd = len(xs)
    _ints("window", win, nd, 1)
    _ints("strides", st, nd, 1)
    if not isinstance(pads, tuple) or len(pads) != nd or any(
            not isinstance(p, tuple) or len(p) != 2 or any(not isinstance(x, int) or x < 0 for x in p) for p in pads):
        raise Bad(f"padding must be {nd} (low, high) pairs of integers >= 0 (one per axis), got {pads!r}")
    out = []
    for d in range(nd):
        span = xs[d] + pads[d][0] + pads[d][1]
        if span < win[d] or xs[d] < 1:
            raise Bad(f"axis {d}: the window ({win[d]}) is larger than the padded input ({span} = {xs[d]} + "
                      f"padding {pads[d]})")
        out.append((span - win[d]) // st[d] + 1)
    return tuple(out)


def pool_shape(a, b, s):
    return pool_geometry(a, s)


def _pool_windows(x, s, fill, ws):
    """Yield (k, view of the padded input read by window position k) in row-major window order."""
    win, st, pads = s
    out = pool_geometry(x.shape, s)
    if any(p != (0, 0) for p in pads):
        xp = ws.take(tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, pads)))
        xp.fill(fill)
        xp[tuple(slice(lo, lo + n) for n, (lo, _) in zip(x.shape, pads))] = x
    else:
        xp = x
    for k, kidx in enumerate(itertools.product(*[range(w) for w in win])):
        yield k, xp[tuple(slice(j, j + (m - 1) * t + 1, t) for j, m, t in zip(kidx, out, st))]


def _pool_scatter(x_shape, s, ws, add):
    """The adjoint walk: ``add(k, view)`` on a zero padded input per window position, then the crop."""
    pads = s[2]
    padded = any(p != (0, 0) for p in pads)
    dxp = ws.take(tuple(n + lo + hi for n, (lo, hi) in zip(x_shape, pads)))
    dxp.fill(0.0)
    for k, view in _pool_windows(dxp, (s[0], s[1], ((0, 0),) * len(pads)), 0.0, ws):
        add(k, view)
    if not padded:
        return dxp
    dx = ws.take(x_shape)
    np.copyto(dx, dxp[tuple(slice(lo, lo + n) for n, (lo, _) in zip(x_shape, pads))])
    return dx


def sum_pool_fwd(a, b, s, out, ws):
    for k, view in _pool_windows(a, s, 0.0, ws):
        if k == 0:
            np.copyto(out, view)
        else:
            np.add(out, view, out=out)


def sum_pool_da(g, out, a, b, s, ws):
    return _pool_scatter(a.shape, s, ws, lambda k, view: np.add(view, g, out=view))


def max_pool_fwd(a, b, s, out, ws):
    for k, view in _pool_windows(a, s, -np.inf, ws):
        if k == 0:
            np.copyto(out, view)
        else:
            np.maximum(out, view, out=out)


def max_pool_arg(a, out, s, ws):
    """Per output element, the first window position (row-major) equal to the maximum (-1 where none is:
    a window holding NaN)."""
    arg = ws.take(out.shape)
    arg.fill(-1.0)
    hit = ws.take_mask(out.shape)
    free = ws.take_mask(out.shape)
    for k, view in _pool_windows(a, s, -np.inf, ws):
        np.equal(view, out, out=hit)
        np.less(arg, 0.0, out=free)
        np.logical_and(hit, free, out=hit)
        np.copyto(arg, float(k), where=hit)
    return arg


def max_pool_da(g, out, a, b, s, ws):
    # the gradient of each window goes to its first maximum (select_and_scatter_add with a >= select)
    arg = max_pool_arg(a, out, s, ws)
    sel = ws.take_mask(out.shape)

    def add(k, view):
        np.equal(arg, float(k), out=sel)
        np.add(view, g, out=view, where=sel)
    return _pool_scatter(a.shape, s, ws, add)


def _reduce_window(jnp, a, s, init, name):
    # lax.max / lax.add are the monoids JAX differentiates (max through select_and_scatter_add)
    win, st, pads = s
    return jnp.lax.reduce_window(a, init, getattr(jnp.lax, name), win, st, pads)


POOL_CASES = (
    ((2, 3, 6, 6), None, ((1, 1, 2, 2), (1, 1, 2, 2), ((0, 0),) * 4)),
    ((2, 5, 5, 3), None, ((1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))),
    ((3, 7), None, ((2, 3), (1, 2), ((0, 1), (2, 0)))),
    ((2, 2, 3, 4, 3), None, ((1, 1, 2, 2, 2), (1, 1, 1, 2, 1), ((0, 0), (0, 0), (1, 0), (0, 0), (0, 1)))),
)

max_pool = op("max_pool", 1, pool_shape, fwd=max_pool_fwd, da=max_pool_da,
              ref=lambda jnp, a, b, s: _reduce_window(jnp, a, s, -np.inf, "max"),
              kind="pool", domain=(spread,), cases=POOL_CASES,
              doc="reduce_window max (padding is −inf); the gradient goes to the first maximum of each "
                  "window in row-major window order; s = (window, strides, padding), one entry per axis")
sum_pool = op("sum_pool", 1, pool_shape, fwd=sum_pool_fwd, da=sum_pool_da,
              ref=lambda jnp, a, b, s: _reduce_window(jnp, a, s, 0.0, "add"),
              kind="pool", domain=(real,), cases=POOL_CASES,
              doc="reduce_window add (padding is 0), window positions added in row-major order; "
                  "s = (window, strides, padding)")
