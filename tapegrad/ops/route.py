"""Routing ops: float masks from comparisons, a select by such a mask, and ``with_grad``.

A mask here is a float array of 1.0 (true) and 0.0 (false) computed on the tape, so a captured program
decides ``jnp.where(x > 0, …)`` itself instead of taking the mask as an operand every call. Comparisons
pass no gradient (their inputs are "n"), and ``select`` routes the gradient to the branch taken, exactly
as ``where`` does with a bool data mask. ``with_grad(a, b)`` is ``a``'s value with ``b``'s gradient: how
a custom derivative rule is recorded (a straight-through estimator is ``with_grad(round(x), x)``), so its
backward is deliberately not the derivative of its forward (``Op.derivative`` is False).
"""
import numpy as np

from .core import BIN, broadcast, into
from .registry import Bad, op, real


def few(rng, shape):
    """Small integers as floats: comparisons see equal, smaller and larger pairs."""
    return rng.integers(-2, 3, shape).astype(np.float64)


def mask01(rng, shape):
    return rng.integers(0, 2, shape).astype(np.float64)


def _no_grad(g, out, a, b, s, t):
    t.fill(0.0)


def compare(name, ufunc, c_op, doc):
    def fwd(a, b, s, out, ws):
        ufunc(a, b, out=out)

    return op(name, 2, broadcast, inputs="nn", fwd=fwd, da=into(_no_grad), db=into(_no_grad),
              ref=lambda jnp, a, b, s: jnp.where(getattr(jnp, name)(a, b), 1.0, 0.0),
              c_fwd=f"a {c_op} b ? 1.0 : 0.0", c_da="0.0", c_db="0.0", domain=(few, few), cases=BIN,
              doc=f"1.0 where {doc}, else 0.0 (broadcasting; no gradient)")


greater = compare("greater", np.greater, ">", "a > b")
greater_equal = compare("greater_equal", np.greater_equal, ">=", "a ≥ b")
equal = compare("equal", np.equal, "==", "a == b")
not_equal = compare("not_equal", np.not_equal, "!=", "a ≠ b (NaN ≠ anything)")


def select_shape(a, b, s, c):
    try:
        return np.broadcast_shapes(a, b, c)
    except ValueError:
        raise Bad(f"shapes {a} (taken where the mask is nonzero), {b} (elsewhere) and mask {c} do not "
                  f"broadcast") from None


def _held(c, ws):
    return np.not_equal(c, 0.0, out=ws.take_mask(c.shape))


def select_fwd(a, b, s, out, ws, c):
    np.copyto(out, b)
    np.copyto(out, a, where=_held(c, ws))


def select_da(g, out, a, b, s, ws, c):
    t = ws.take(g.shape)
    t.fill(0.0)
    np.copyto(t, g, where=_held(c, ws))
    return t


def select_db(g, out, a, b, s, ws, c):
    t = ws.take(g.shape)
    np.copyto(t, g)
    np.copyto(t, 0.0, where=_held(c, ws))
    return t


select = op("select", 3, select_shape, inputs="ffn", fwd=select_fwd, da=select_da, db=select_db,
            ref=lambda jnp, a, b, s, c: jnp.where(c != 0, a, b),
            c_fwd="c != 0.0 ? a : b", c_da="c != 0.0 ? g : 0.0", c_db="c != 0.0 ? 0.0 : g",
            domain=(real, real, mask01),
            cases=(((3, 4), (3, 4), None, (3, 4)), ((3, 4), (4,), None, (3, 1)), ((), (2, 3), None, (2, 3)),
                   ((2, 1), (1, 3), None, (3,))),
            doc="a where the float mask c is nonzero, else b (broadcasting); the untaken branch gets exact zeros")


def with_grad_shape(a, b, s):
    if tuple(a) != tuple(b):
        raise Bad(f"the value {a} and the gradient path {b} must have the same shape")
    return a


with_grad = op("with_grad", 2, with_grad_shape, inputs="nf", aliases=True, derivative=False,
               fwd=lambda a, b, s, out, ws: np.copyto(out, a), da=into(_no_grad),
               db=lambda g, out, a, b, s, ws: g,
               ref=lambda jnp, a, b, s: jnp.lax.stop_gradient(a) + (b - jnp.lax.stop_gradient(b)),
               c_fwd="a", c_da="0.0", c_db="g", domain=(real, real),
               cases=(((3, 4), (3, 4), None), ((5,), (5,), None), ((), (), None)),
               doc="a's value with b's gradient (a custom derivative rule, a straight-through estimator)")
