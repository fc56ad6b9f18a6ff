"""The core ops: leaves, arithmetic, elementwise functions, reductions, products, layout, softmax.

Also the shape rules, helpers and example cases the other families reuse (``same``, ``broadcast``,
``reduced``, ``keepdims``, ``into``, ``UN``/``BIN``/``RED``). What an entry holds: ``tapegrad.ops.registry``.
"""
import builtins
import math

import numpy as np

from .registry import Bad, away0, between, op, positive, real, spread


# ── shape rules ──────────────────────────────────────────────────────────────

def same(a, b, s):
    return a


def broadcast(a, b, s):
    try:
        return np.broadcast_shapes(a, b)
    except ValueError:
        raise Bad(f"shapes {a} and {b} do not broadcast (NumPy rules: trailing dims equal or 1)") from None


def check_axes(a, axes):
    """Normalise an axis argument to a sorted tuple of non-negative ints (None = all axes)."""
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    nd = len(a)
    out = []
    for ax in axes:
        if not isinstance(ax, (int, np.integer)) or not -nd <= ax < nd:
            raise Bad(f"axis {ax!r} is out of range for an input of shape {a} (ndim {nd})")
        out.append(int(ax) % nd)
    if len(set(out)) != len(out):
        raise Bad(f"axis {axes!r} repeats an axis")
    return tuple(sorted(out))


def reduced(a, b, s):
    axes, keep = s
    axes = tuple(range(len(a))) if axes is None else axes
    return tuple(1 if k in axes else n for k, n in enumerate(a) if keep or k not in axes)


def matmul_shape(a, b, s):
    if len(a) != 2 or len(b) != 2:
        raise Bad(f"expected two 2-D operands, got shapes {a} and {b}")
    if a[1] != b[0]:
        raise Bad(f"inner dimensions differ: {a} @ {b} ({a[1]} != {b[0]})")
    return (a[0], b[1])


def bmm_shape(a, b, s):
    if len(a) != 3 or len(b) != 3:
        raise Bad(f"expected two 3-D operands (batch, m, k) and (batch, k, n), got {a} and {b}")
    if a[0] != b[0] or a[2] != b[1]:
        raise Bad(f"expected (B, m, k) @ (B, k, n), got {a} @ {b}")
    return (a[0], a[1], b[2])


def transpose_shape(a, b, s):
    if sorted(s) != list(range(len(a))):
        raise Bad(f"axes {s} are not a permutation of range({len(a)}) for shape {a}")
    return tuple(a[k] for k in s)


def reshape_shape(a, b, s):
    if math.prod(s) != math.prod(a) or any(n < 0 for n in s):
        raise Bad(f"cannot reshape {a} ({math.prod(a)} elements) into {s}")
    return s


def broadcast_to_shape(a, b, s):
    if broadcast(a, s, None) != s:
        raise Bad(f"cannot broadcast {a} to {s}")
    return s


def axis_shape(a, b, s):
    if not 0 <= s < len(a):
        raise Bad(f"axis {s} is out of range for shape {a}")
    return a


def steps(s):
    """A slice operand as (start, stop, step) per axis; (start, stop) means step 1. Read as Python's
    ``range`` (no wrap-around): ``slice.indices(n)`` gives exactly this form."""
    return tuple((t[0], t[1], t[2] if len(t) == 3 else 1) for t in s)


def slice_shape(a, b, s):
    if len(s) != len(a):
        raise Bad(f"expected one (start, stop[, step]) per axis of {a}, got {len(s)}")
    out = []
    for k, ((lo, hi, st), n) in enumerate(zip(steps(s), a)):
        r = range(lo, hi, st) if st else range(0)
        if st == 1 and not 0 <= lo < hi <= n:
            raise Bad(f"axis {k}: range {lo}:{hi} is empty or outside 0:{n}")
        if not r or not (0 <= r[0] < n and 0 <= r[-1] < n):
            raise Bad(f"axis {k}: range {lo}:{hi}:{st} is empty or outside 0:{n}")
        out.append(len(r))
    return tuple(out)


def concat_shape(a, b, s):
    if len(a) != len(b) or not 0 <= s < len(a) or any(x != y for k, (x, y) in enumerate(zip(a, b)) if k != s):
        raise Bad(f"shapes {a} and {b} cannot be joined along axis {s} (other dims must match)")
    return tuple(x + y if k == s else x for k, (x, y) in enumerate(zip(a, b)))


# ── helpers the rules share ──────────────────────────────────────────────────

def keepdims(g, a_shape, s):
    """An upstream gradient of a reduction, reshaped so it broadcasts against the input."""
    axes, keep = s
    if keep:
        return g
    axes = range(len(a_shape)) if axes is None else axes
    return g.reshape(tuple(1 if k in axes else n for k, n in enumerate(a_shape)))


def slices(s):
    return tuple(builtins.slice(lo, hi if hi >= 0 else None, st) for lo, hi, st in steps(s))


def count(a_shape, s):
    axes = range(len(a_shape)) if s[0] is None else s[0]
    return math.prod([a_shape[k] for k in axes])


# ── forward and backward bodies that need more than one line ────────────────

def sigmoid_fwd(a, b, s, out, ws):
    # e = exp(-|a|) never overflows; a >= 0: 1/(1+e), a < 0: e/(1+e).
    e = ws.take(a.shape)
    np.abs(a, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.add(1.0, e, out=out)
    np.copyto(e, 1.0, where=np.greater_equal(a, 0.0, out=ws.take_mask(a.shape)))
    np.divide(e, out, out=out)


def abs_da(g, out, a, b, s, ws):
    t = np.sign(a, out=ws.take(g.shape))
    return np.multiply(g, t, out=t)


def maximum_d(x, y):
    """d max(x, y)/dx = 1 where x wins, 1/2 on ties (JAX's balanced rule), 0 where y wins."""
    def d(g, out, a, b, s, ws):
        t = ws.take(g.shape)
        u = ws.take(g.shape)
        np.greater(x(a, b), y(a, b), out=t)
        np.equal(a, b, out=u)
        np.multiply(0.5, u, out=u)
        np.add(t, u, out=t)
        return np.multiply(g, t, out=t)
    return d


def reduce_sum_fwd(a, b, s, out, ws):
    np.add.reduce(a, axis=s[0], keepdims=s[1], out=out)


def mean_fwd(a, b, s, out, ws):
    np.add.reduce(a, axis=s[0], keepdims=s[1], out=out)
    np.divide(out, count(a.shape, s), out=out)


def spread_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    np.copyto(t, keepdims(g, a.shape, s))
    return t


def mean_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    np.divide(keepdims(g, a.shape, s), count(a.shape, s), out=t)
    return t


def max_fwd(a, b, s, out, ws):
    np.maximum.reduce(a, axis=s[0], keepdims=s[1], out=out)


def max_da(g, out, a, b, s, ws):
    # The gradient is shared equally between tied maxima (as jax.grad of jnp.max does).
    hit = ws.take(a.shape)
    np.equal(a, keepdims(out, a.shape, s), out=hit)
    ties = ws.take(out.shape)
    np.add.reduce(hit, axis=s[0], keepdims=s[1], out=ties)
    np.divide(g, ties, out=ties)
    return np.multiply(hit, keepdims(ties, a.shape, s), out=hit)


def matmul_fwd(a, b, s, out, ws):
    np.matmul(a, b, out=out)


def bmm_da(g, out, a, b, s, ws):
    return np.matmul(g, b.transpose(0, 2, 1), out=ws.take(a.shape))


def bmm_db(g, out, a, b, s, ws):
    return np.matmul(a.transpose(0, 2, 1), g, out=ws.take(b.shape))


def transpose_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    np.copyto(t, g.transpose(np.argsort(s)))
    return t


def softmax_fwd(a, b, s, out, ws):
    # exp(a - max) / Σ exp(a - max): no overflow for any finite logits.
    r = ws.take(a.shape[:s] + (1,) + a.shape[s + 1:])
    np.maximum.reduce(a, axis=s, keepdims=True, out=r)
    np.subtract(a, r, out=out)
    np.exp(out, out=out)
    np.add.reduce(out, axis=s, keepdims=True, out=r)
    np.divide(out, r, out=out)


def softmax_da(g, out, a, b, s, ws):
    # out · (g − Σ g·out)
    t = ws.take(a.shape)
    r = ws.take(a.shape[:s] + (1,) + a.shape[s + 1:])
    np.multiply(g, out, out=t)
    np.add.reduce(t, axis=s, keepdims=True, out=r)
    np.subtract(g, r, out=t)
    return np.multiply(out, t, out=t)


def logsoftmax_fwd(a, b, s, out, ws):
    # (a − max) − log Σ exp(a − max)
    r = ws.take(a.shape[:s] + (1,) + a.shape[s + 1:])
    log_softmax(a, s, out, ws.take(a.shape), r, r)


def log_softmax(a, s, out, e, r, lse):
    """out = (a − max) − log Σ e along axis s, leaving e = exp(a − max) and r = Σ e (lse: row scratch,
    may be r)."""
    np.maximum.reduce(a, axis=s, keepdims=True, out=lse)
    np.subtract(a, lse, out=out)
    np.exp(out, out=e)
    np.add.reduce(e, axis=s, keepdims=True, out=r)
    np.log(r, out=lse)
    np.subtract(out, lse, out=out)


def logsoftmax_da(g, out, a, b, s, ws):
    # g − exp(out) · Σ g
    t = ws.take(a.shape)
    r = ws.take(a.shape[:s] + (1,) + a.shape[s + 1:])
    np.add.reduce(g, axis=s, keepdims=True, out=r)
    np.exp(out, out=t)
    np.multiply(t, r, out=t)
    return np.subtract(g, t, out=t)


def xent_shape(a, b, s):
    if a != b:
        raise Bad(f"logits {a} and targets {b} must have the same shape")
    axis_shape(a, None, s)
    return ()


def xent_rows(a_shape, s):
    return math.prod(a_shape) // a_shape[s]


def xent_keep(a, s):
    """exp(a − max) and its sums along the class axis: the softmax the gradient needs, for free."""
    return a, a[:s] + (1,) + a[s + 1:]


def xent_fwd(a, b, s, out, ws, kept):
    # −Σ b · log_softmax(a) / rows, one reduction over every element
    e, r = kept
    t = ws.take(a.shape)
    log_softmax(a, s, t, e, r, ws.take(r.shape))
    np.multiply(b, t, out=t)
    np.add.reduce(t, axis=None, out=out)
    np.divide(out, -xent_rows(a.shape, s), out=out)


def xent_da(g, out, a, b, s, ws, kept):
    # (softmax(a) · Σ b − b) · g / rows, softmax(a) = e / Σ e as softmax_fwd rounds it
    e, r = kept
    t = ws.take(a.shape)
    q = ws.take(r.shape)
    np.divide(e, r, out=t)
    np.add.reduce(b, axis=s, keepdims=True, out=q)
    np.multiply(t, q, out=t)
    np.subtract(t, b, out=t)
    return np.multiply(t, float(g) / xent_rows(a.shape, s), out=t)


def xent_db(g, out, a, b, s, ws, kept):
    # −log_softmax(a) · g / rows
    t = ws.take(a.shape)
    logsoftmax_fwd(a, None, s, t, ws)
    return np.multiply(t, -float(g) / xent_rows(a.shape, s), out=t)


def slice_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    t.fill(0.0)
    t[slices(s)] = g
    return t


def concat_fwd(a, b, s, out, ws):
    np.concatenate((a, b), axis=s, out=out)


def concat_da(g, out, a, b, s, ws):
    return g[(builtins.slice(None),) * s + (builtins.slice(0, a.shape[s]),)]


def concat_db(g, out, a, b, s, ws):
    return g[(builtins.slice(None),) * s + (builtins.slice(a.shape[s], None),)]


def into(f, like=0):
    """A rule whose ``f(g, out, a, b, s, t)`` writes the contribution into a fresh scratch ``t`` shaped like
    argument ``like`` (0: ``g``, the default; 2: ``a``; 3: ``b``)."""
    def rule(g, out, a, b, s, ws):
        t = ws.take((g, out, a, b)[like].shape)
        f(g, out, a, b, s, t)
        return t
    # A recorded sweep (tapegrad.schedule) calls f directly: on the same scratch, or on the input's
    # gradient buffer itself where the contribution would only be copied there.
    rule.into = f
    return rule


# ── the registry ─────────────────────────────────────────────────────────────

BIN = (((3, 4), (3, 4), None), ((3, 4), (4,), None), ((2, 1, 4), (3, 1), None), ((), (2, 3), None),
       ((5, 1), (1, 1), None))
UN = (((3, 4), None, None), ((7,), None, None), ((), None, None), ((2, 3, 2), None, None))
RED = (((3, 4), None, (None, False)), ((3, 4), None, ((1,), True)), ((2, 3, 4), None, ((0, 2), False)),
       ((5,), None, ((0,), False)))

param = op("param", 0, same, kind="leaf", doc="a trainable leaf (copied in)")
const = op("const", 0, same, kind="leaf", doc="a constant leaf (no gradient flows into it)")
data = op("data", 0, same, kind="leaf",
          doc="integer or bool data (indices, masks): ``tape.const`` of such an array; never differentiated")

add = op("add", 2, broadcast, doc="a + b, broadcasting", aliases=True,
         fwd=lambda a, b, s, out, ws: np.add(a, b, out=out),
         da=lambda g, out, a, b, s, ws: g,
         db=lambda g, out, a, b, s, ws: g,
         ref=lambda jnp, a, b, s: a + b,
         c_fwd="a + b", c_da="g", c_db="g", domain=(real, real), cases=BIN)
sub = op("sub", 2, broadcast, doc="a − b, broadcasting", aliases=True,
         fwd=lambda a, b, s, out, ws: np.subtract(a, b, out=out),
         da=lambda g, out, a, b, s, ws: g,
         db=into(lambda g, out, a, b, s, t: np.negative(g, out=t)),
         ref=lambda jnp, a, b, s: a - b,
         c_fwd="a - b", c_da="g", c_db="-g", domain=(real, real), cases=BIN)
mul = op("mul", 2, broadcast, doc="a · b, broadcasting",
         fwd=lambda a, b, s, out, ws: np.multiply(a, b, out=out),
         da=into(lambda g, out, a, b, s, t: np.multiply(g, b, out=t)),
         db=into(lambda g, out, a, b, s, t: np.multiply(g, a, out=t)),
         ref=lambda jnp, a, b, s: a * b,
         c_fwd="a * b", c_da="g * b", c_db="g * a", domain=(real, real), cases=BIN)


def div_db(g, out, a, b, s, ws):
    # d(a/b)/db = −a/b² = −out/b
    t = ws.take(g.shape)
    np.multiply(g, out, out=t)
    np.divide(t, b, out=t)
    return np.negative(t, out=t)


div = op("div", 2, broadcast, doc="a / b, broadcasting",
         fwd=lambda a, b, s, out, ws: np.divide(a, b, out=out),
         da=into(lambda g, out, a, b, s, t: np.divide(g, b, out=t)),
         db=div_db,
         ref=lambda jnp, a, b, s: a / b,
         c_fwd="a / b", c_da="g / b", c_db="-(g * out / b)", domain=(real, positive), cases=BIN)
maximum = op("maximum", 2, broadcast,
             fwd=lambda a, b, s, out, ws: np.maximum(a, b, out=out),
             da=maximum_d(lambda a, b: a, lambda a, b: b),
             db=maximum_d(lambda a, b: b, lambda a, b: a),
             ref=lambda jnp, a, b, s: jnp.maximum(a, b),
             c_fwd="a > b ? a : (a != a ? a : b)",  # NumPy: NaN propagates, ties give b
             c_da="g * ((a > b ? 1.0 : 0.0) + 0.5 * (a == b ? 1.0 : 0.0))",
             c_db="g * ((b > a ? 1.0 : 0.0) + 0.5 * (a == b ? 1.0 : 0.0))",
             domain=(spread, between), cases=BIN,
             doc="elementwise max; ties share the gradient equally, as in JAX")

neg = op("neg", 1, same, doc="−a",
         fwd=lambda a, b, s, out, ws: np.negative(a, out=out),
         da=into(lambda g, out, a, b, s, t: np.negative(g, out=t)),
         ref=lambda jnp, a, b, s: -a,
         c_fwd="-a", c_da="-g", domain=(real,), cases=UN)
adds = op("adds", 1, same, aliases=True,
          fwd=lambda a, b, s, out, ws: np.add(a, s, out=out),
          da=lambda g, out, a, b, s, ws: g,
          ref=lambda jnp, a, b, s: a + s,
          c_fwd="a + s", c_da="g", domain=(real,), cases=tuple((x, None, 1.5) for x, _, _ in UN),
          doc="a + scalar")
muls = op("muls", 1, same,
          fwd=lambda a, b, s, out, ws: np.multiply(a, s, out=out),
          da=into(lambda g, out, a, b, s, t: np.multiply(g, s, out=t)),
          ref=lambda jnp, a, b, s: a * s,
          c_fwd="a * s", c_da="g * s", domain=(real,), cases=tuple((x, None, -0.75) for x, _, _ in UN),
          doc="a · scalar")


divs = op("divs", 1, same,
          fwd=lambda a, b, s, out, ws: np.divide(a, s, out=out),
          da=into(lambda g, out, a, b, s, t: np.divide(g, s, out=t)),
          ref=lambda jnp, a, b, s: a / s,
          c_fwd="a / s", c_da="g / s", domain=(real,), cases=tuple((x, None, 4.0) for x, _, _ in UN),
          doc="a / scalar (rounded as a division, not as a product with 1/s)")


def rdivs_da(g, out, a, b, s, ws):
    # d(s/a)/da = −s/a² = −out/a
    t = ws.take(g.shape)
    np.multiply(g, out, out=t)
    np.divide(t, a, out=t)
    return np.negative(t, out=t)


rdivs = op("rdivs", 1, same,
           fwd=lambda a, b, s, out, ws: np.divide(s, a, out=out),
           da=rdivs_da,
           ref=lambda jnp, a, b, s: s / a,
           c_fwd="s / a", c_da="-(g * out / a)", domain=(positive,),
           cases=tuple((x, None, 2.5) for x, _, _ in UN), doc="scalar / a")


def square_da(g, out, a, b, s, ws):
    t = ws.take(g.shape)
    np.multiply(2.0, a, out=t)
    return np.multiply(g, t, out=t)


square = op("square", 1, same, doc="a² (exact gradient 2a)",
            fwd=lambda a, b, s, out, ws: np.multiply(a, a, out=out),
            da=square_da,
            ref=lambda jnp, a, b, s: a ** 2,
            c_fwd="a * a", c_da="g * (2.0 * a)", domain=(real,), cases=UN)


def pow_da(g, out, a, b, s, ws):
    # p · a^(p−1)
    t = ws.take(g.shape)
    np.power(a, s - 1.0, out=t)
    np.multiply(s, t, out=t)
    return np.multiply(g, t, out=t)


pow = op("pow", 1, same,
         fwd=lambda a, b, s, out, ws: np.power(a, s, out=out),
         da=pow_da,
         ref=lambda jnp, a, b, s: jnp.power(a, s),
         c_fwd="pow(a, s)", c_da="g * (s * pow(a, s - 1.0))", tier="libm",
         domain=(positive,), cases=tuple((x, None, p) for (x, _, _), p in zip(UN, (3.0, -1.5, 0.5, 2.5))),
         doc="a ** constant (positive a)")
def relu_da(g, out, a, b, s, ws):
    # a select, as jax.nn.relu's rule: exact zeros where a <= 0 (or NaN), whatever g holds there
    t = ws.take(g.shape)
    t.fill(0.0)
    np.copyto(t, g, where=np.greater(a, 0.0, out=ws.take_mask(a.shape)))
    return t


relu = op("relu", 1, same, doc="max(a, 0); gradient 0 at 0 (as JAX)",
          fwd=lambda a, b, s, out, ws: np.maximum(a, 0.0, out=out),
          da=relu_da,
          ref=lambda jnp, a, b, s: jnp.where(a > 0, a, 0.0),
          c_fwd="a > 0.0 ? a : (a != a ? a : 0.0)", c_da="a > 0.0 ? g : 0.0", domain=(away0,), cases=UN)
stop_gradient = op("stop_gradient", 1, same, inputs="n", doc="a, through which no gradient flows (JAX's stop_gradient)",
                   fwd=lambda a, b, s, out, ws: np.copyto(out, a),
                   # its result has no gradient path, so a backward reaches it only as the loss itself
                   da=into(lambda g, out, a, b, s, t: t.fill(0.0)),
                   ref=lambda jnp, a, b, s: jnp.lax.stop_gradient(a),
                   c_fwd="a", c_da="0.0", domain=(real,), cases=UN)


def finite_or_zero_fwd(a, b, s, out, ws):
    np.copyto(out, a)
    np.copyto(out, 0.0, where=np.logical_not(np.isfinite(a, out=ws.take_mask(a.shape))))


finite_or_zero = op("finite_or_zero", 1, same, doc="a where finite, else 0 (the shift of JAX's stable softmax)",
                    fwd=finite_or_zero_fwd,
                    da=into(lambda g, out, a, b, s, t: (np.isfinite(a, out=t), np.multiply(g, t, out=t))),
                    ref=lambda jnp, a, b, s: jnp.where(jnp.isfinite(a), a, 0.0),
                    c_fwd="a - a == 0.0 ? a : 0.0", c_da="a - a == 0.0 ? g : 0.0", domain=(real,), cases=UN)
abs = op("abs", 1, same, doc="|a|; gradient sign(a), 0 at 0",
         fwd=lambda a, b, s, out, ws: np.abs(a, out=out),
         da=abs_da,
         ref=lambda jnp, a, b, s: jnp.abs(a),
         c_fwd="fabs(a)", c_da="g * (a > 0.0 ? 1.0 : (a < 0.0 ? -1.0 : (a == 0.0 ? 0.0 : a)))", domain=(away0,),
         cases=UN)
sigmoid = op("sigmoid", 1, same,
             fwd=sigmoid_fwd,
             da=into(lambda g, out, a, b, s, t: (np.subtract(1.0, out, out=t), np.multiply(out, t, out=t),
                                                    np.multiply(g, t, out=t))),
             ref=lambda jnp, a, b, s: 0.5 * (jnp.tanh(0.5 * a) + 1.0),
             c_fwd="(a >= 0.0 ? 1.0 : exp(-fabs(a))) / (1.0 + exp(-fabs(a)))",
             c_da="g * (out * (1.0 - out))", tier="libm", domain=(real,), cases=UN,
             doc="1/(1+e^-a), evaluated without overflow for any finite a")
tanh = op("tanh", 1, same, doc="tanh a; gradient 1 − out²",
          fwd=lambda a, b, s, out, ws: np.tanh(a, out=out),
          da=into(lambda g, out, a, b, s, t: (np.multiply(out, out, out=t), np.subtract(1.0, t, out=t),
                                                 np.multiply(g, t, out=t))),
          ref=lambda jnp, a, b, s: jnp.tanh(a),
          c_fwd="tanh(a)", c_da="g * (1.0 - out * out)", tier="libm", domain=(real,), cases=UN)
exp = op("exp", 1, same, doc="eᵃ; gradient reuses out",
         fwd=lambda a, b, s, out, ws: np.exp(a, out=out),
         da=into(lambda g, out, a, b, s, t: np.multiply(g, out, out=t)),
         ref=lambda jnp, a, b, s: jnp.exp(a),
         c_fwd="exp(a)", c_da="g * out", tier="libm", domain=(real,), cases=UN)
log = op("log", 1, same, doc="natural log (positive a)",
         fwd=lambda a, b, s, out, ws: np.log(a, out=out),
         da=into(lambda g, out, a, b, s, t: np.divide(g, a, out=t)),
         ref=lambda jnp, a, b, s: jnp.log(a),
         c_fwd="log(a)", c_da="g / a", tier="libm", domain=(positive,), cases=UN)
sqrt = op("sqrt", 1, same, doc="√a; gradient 1/(2·out)",
          fwd=lambda a, b, s, out, ws: np.sqrt(a, out=out),
          da=into(lambda g, out, a, b, s, t: (np.multiply(2.0, out, out=t), np.divide(g, t, out=t))),
          ref=lambda jnp, a, b, s: jnp.sqrt(a),
          c_fwd="sqrt(a)", c_da="g / (2.0 * out)", domain=(positive,), cases=UN)

sum = op("sum", 1, reduced, fwd=reduce_sum_fwd, da=spread_da,
         ref=lambda jnp, a, b, s: jnp.sum(a, axis=s[0], keepdims=s[1]),
         tier="order", kind="reduce", domain=(real,), cases=RED,
         doc="Σ over axes (None = all); s = (axes, keepdims)")
mean = op("mean", 1, reduced, fwd=mean_fwd, da=mean_da,
          ref=lambda jnp, a, b, s: jnp.mean(a, axis=s[0], keepdims=s[1]),
          tier="order", kind="reduce", domain=(real,), cases=RED,
          doc="Σ/n over axes; the gradient is exactly g/n")
max = op("max", 1, reduced, fwd=max_fwd, da=max_da,
         ref=lambda jnp, a, b, s: jnp.max(a, axis=s[0], keepdims=s[1]),
         kind="reduce", domain=(spread,), cases=RED,
         doc="max over axes; tied maxima share the gradient equally")

matmul = op("matmul", 2, matmul_shape, fwd=matmul_fwd,
            da=into(lambda g, out, a, b, s, t: np.matmul(g, b.T, out=t), like=2),
            db=into(lambda g, out, a, b, s, t: np.matmul(a.T, g, out=t), like=3),
            ref=lambda jnp, a, b, s: jnp.einsum("ik,kj->ij", a, b),
            tier="blas", kind="matmul", domain=(real, real),
            cases=(((3, 4), (4, 5), None), ((1, 7), (7, 1), None), ((6, 2), (2, 3), None)),
            doc="(m, k) @ (k, n) through BLAS")
bmm = op("bmm", 2, bmm_shape, fwd=matmul_fwd, da=bmm_da, db=bmm_db,
         ref=lambda jnp, a, b, s: jnp.einsum("bik,bkj->bij", a, b),
         tier="blas", kind="matmul", domain=(real, real),
         cases=(((2, 3, 4), (2, 4, 5), None), ((3, 1, 2), (3, 2, 2), None)),
         doc="(B, m, k) @ (B, k, n)")

transpose = op("transpose", 1, transpose_shape,
               fwd=lambda a, b, s, out, ws: np.copyto(out, a.transpose(s)),
               da=transpose_da,
               ref=lambda jnp, a, b, s: jnp.transpose(a, s),
               kind="layout", domain=(real,),
               cases=(((3, 4), None, (1, 0)), ((2, 3, 4), None, (2, 0, 1)), ((5,), None, (0,))),
               doc="permute axes (s = the permutation)")
reshape = op("reshape", 1, reshape_shape, doc="a copy with a new shape", aliases=True,
             fwd=lambda a, b, s, out, ws: np.copyto(out, a.reshape(s)),
             da=lambda g, out, a, b, s, ws: g.reshape(a.shape),
             ref=lambda jnp, a, b, s: jnp.reshape(a, s),
             kind="layout", domain=(real,),
             cases=(((3, 4), None, (12,)), ((2, 6), None, (3, 2, 2)), ((4,), None, (1, 4))))
broadcast_to = op("broadcast_to", 1, broadcast_to_shape, doc="NumPy broadcasting to a shape; the gradient sums back", aliases=True,
                  fwd=lambda a, b, s, out, ws: np.copyto(out, a),
                  da=lambda g, out, a, b, s, ws: g,
                  ref=lambda jnp, a, b, s: jnp.broadcast_to(a, s),
                  kind="layout", domain=(real,),
                  cases=(((4,), None, (3, 4)), ((3, 1), None, (3, 5)), ((), None, (2, 2))))
softmax = op("softmax", 1, axis_shape, fwd=softmax_fwd, da=softmax_da,
             ref=lambda jnp, a, b, s: jnp.exp(a) / jnp.sum(jnp.exp(a), axis=s, keepdims=True),
             tier="libm", kind="softmax", domain=(real,),
             cases=(((3, 4), None, 1), ((3, 4), None, 0), ((2, 3, 5), None, 1), ((6,), None, 0)),
             doc="exp(a − max)/Σ exp(a − max) along one axis")
logsoftmax = op("logsoftmax", 1, axis_shape, fwd=logsoftmax_fwd, da=logsoftmax_da,
                ref=lambda jnp, a, b, s: a - jnp.log(jnp.sum(jnp.exp(a), axis=s, keepdims=True)),
                tier="libm", kind="softmax", domain=(real,),
                cases=(((3, 4), None, 1), ((4, 3), None, 0), ((6,), None, 0)),
                doc="a − max − log Σ exp(a − max) along one axis (for cross-entropy)")
softmax_xent = op("softmax_xent", 2, xent_shape, fwd=xent_fwd, da=xent_da, db=xent_db, keep=xent_keep,
                  ref=lambda jnp, a, b, s: -jnp.sum(b * (a - jnp.log(jnp.sum(jnp.exp(a), axis=s, keepdims=True))))
                  / (a.size // a.shape[s]),
                  tier="libm", kind="softmax", domain=(real, positive),
                  cases=(((4, 3), (4, 3), 1), ((3, 5), (3, 5), 0), ((2, 3, 4), (2, 3, 4), 2)),
                  doc="softmax cross-entropy −Σ targets·log_softmax(logits) / rows (s = the class axis)")
slice = op("slice", 1, slice_shape,
           fwd=lambda a, b, s, out, ws: np.copyto(out, a[slices(s)]),
           da=slice_da,
           ref=lambda jnp, a, b, s: a[slices(s)],
           kind="layout", domain=(real,),
           cases=(((5, 4), None, ((1, 4), (0, 2))), ((6,), None, ((2, 5),)), ((2, 3, 4), None, ((0, 2), (1, 2), (1, 4))),
                  ((7, 4), None, ((0, 7, 2), (3, -1, -1))), ((6,), None, ((5, 0, -2),))),
           doc="a[lo:hi:step, …] (s = one (lo, hi[, step]) per axis, read as range(lo, hi, step))")
concat = op("concat", 2, concat_shape, fwd=concat_fwd, da=concat_da, db=concat_db, aliases=True,
            ref=lambda jnp, a, b, s: jnp.concatenate([a, b], axis=s),
            kind="layout", domain=(real, real),
            cases=(((2, 3), (4, 3), 0), ((2, 3), (2, 1), 1), ((3,), (2,), 0)),
            doc="join a and b along axis s")
