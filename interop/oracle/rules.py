"""The oracle's primitive rules: how each JAX primitive is recorded on a tapegrad tape.

A rule ``(r, xs, eqn) -> Var`` (a list for multi-result primitives) gets the step's operands as Vars
(values that depend on the differentiated arguments) or NumPy arrays (JAX's values of everything
else) and records the primitive with registry ops. ``CONSTANT`` primitives are piecewise constant:
their results are JAX's values, entering the tape as constants. Any step whose results are all
non-float (comparisons, integer arithmetic, random bits, keys) is likewise JAX's. Loops and branches
are ``loops``'; calls are inlined by the replay before any rule is consulted. The rules register into
``table`` (``rule``); ``table.primitive_table()`` is docs/oracle.md's table of what is covered.
"""
import math

import numpy as np
import scipy.special as sc

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.errors import TapeError

from .._jax import align_varying, jax, jnp
from .replay import CONTROL
from .table import (CONSTANT, DOCS, INDEX_MAPS, NEEDS, PER_OPERAND, RULES, VALUE_RULES, NotReplayable,  # noqa: F401
                    UnsupportedPrimitiveError, missing, rule)


# ── helpers ──────────────────────────────────────────────────────────────────

def _reshape(r, v, shape):
    shape = tuple(int(n) for n in shape)
    return v if tuple(v.shape) == shape else r.tape.apply(O.reshape, v, None, shape)


def _permute(r, v, perm):
    perm = tuple(int(k) for k in perm)
    return v if perm == tuple(range(v.ndim)) else r.tape.apply(O.transpose, v, None, perm)


def _neg(r, v):
    return r.tape.apply(O.neg, v)


def _flat(r, x):
    return _reshape(r, r.var(x), (int(np.prod(np.shape(r.value(x)) if not isinstance(x, tg.Var) else x.shape)),))


def _out_shape(eqn, i=0):
    return tuple(eqn.outvars[i].aval.shape)


def _ties(a, b):
    return int(np.sum(np.asarray(a) == np.asarray(b)))


# ── elementwise ──────────────────────────────────────────────────────────────

def _binary(fn):
    return lambda r, xs, eqn: fn(r.var(xs[0]), r.var(xs[1]))


rule("add", "add_any", doc="`a + b`")(_binary(lambda a, b: a + b))
rule("sub", doc="`a − b`")(_binary(lambda a, b: a - b))
rule("mul", doc="`a · b`")(_binary(lambda a, b: a * b))
rule("div", doc="`a / b`")(_binary(lambda a, b: a / b))


@rule("max", doc="`maximum` (ties share the gradient, as JAX's `max`)")
def _max(r, xs, eqn):
    r.kink(_ties(r.value(xs[0]), r.value(xs[1])), "ties of max (a == b)")
    return tg.maximum(r.var(xs[0]), r.var(xs[1]))


@rule("min", doc="`−maximum(−a, −b)`")
def _min(r, xs, eqn):
    r.kink(_ties(r.value(xs[0]), r.value(xs[1])), "ties of min (a == b)")
    return _neg(r, tg.maximum(_neg(r, r.var(xs[0])), _neg(r, r.var(xs[1]))))


def _unary(opname):
    def f(r, xs, eqn):
        return r.tape.apply(getattr(O, opname), r.var(xs[0]))
    return f


for _p, _o in (("neg", "neg"), ("exp", "exp"), ("log", "log"), ("tanh", "tanh"), ("logistic", "sigmoid"),
               ("sqrt", "sqrt"), ("square", "square")):
    rule(_p, doc=f"`{_o}`")(_unary(_o))


@rule("abs", doc="`abs` (gradient 0 at 0, as JAX)")
def _abs(r, xs, eqn):
    r.kink(int(np.sum(r.value(xs[0]) == 0)), "abs at 0")
    return r.tape.apply(O.abs, r.var(xs[0]))


def _fn(name, arity=1):
    def f(r, xs, eqn):
        return getattr(tg, name)(*(r.var(x) for x in xs[:arity]))
    return f


for _p in ("log1p", "expm1", "erf", "erfc", "lgamma", "digamma", "sin", "cos", "tan", "asinh"):
    rule(_p, doc=f"`tg.{_p}`", needs=(_p,))(_fn(_p))
rule("atan2", doc="`tg.atan2`", needs=("atan2",))(_fn("atan2", 2))


# ── special functions the tape has no op for: JAX's value, the derivative written here ────────────

def _at_value(r, x, y, d):
    """``y + d · (x − x₀)`` at the point ``x₀ = x``: the value JAX computed (``y``) and the derivative ``d``
    this rule computes independently, exact for the one reverse sweep the oracle runs (``d`` is a constant
    of the tape, so a second derivative through it would be wrong: the jaxpr carries JAX's own derivative
    equations for any inner grad, which are replayed step by step)."""
    x = r.var(x)
    return r.var(y) + r.var(d) * (x - r.var(r.value(x)))


def _special(derivative):
    def f(r, xs, eqn):
        *fixed, x = xs
        if any(isinstance(v, tg.Var) for v in fixed):
            raise NotReplayable(f"{eqn.primitive.name} differentiated in its first operand (only the last has "
                                f"a derivative here)")
        y = r.jout()
        with np.errstate(all="ignore"):
            d = derivative(*(r.value(v) for v in fixed), r.value(x), y)
        return _at_value(r, x, y, d)
    return f


def _i1e_slope(x, y):
    safe = np.where(x == 0, 1.0, x)
    return np.where(x == 0, 0.5, sc.i0e(x) - y * (np.sign(x) + 1.0 / safe))


def _igamma_slope(a, x, y):
    """d P(a, x)/dx = x^(a−1) e^(−x) / Γ(a), in logs (no overflow at large a or x)."""
    return np.exp((a - 1.0) * np.log(x) - x - sc.gammaln(a))


rule("erf_inv", doc="JAX's value; derivative √π/2 · e^(y²)")(
    _special(lambda x, y: 0.5 * math.sqrt(math.pi) * np.exp(y * y)))
rule("bessel_i0e", doc="JAX's value; derivative i1e(x) − sign(x) · y (scipy.special.i1e)")(
    _special(lambda x, y: sc.i1e(x) - np.sign(x) * y))
rule("bessel_i1e", doc="JAX's value; derivative i0e(x) − y · (sign(x) + 1/x), ½ at 0")(_special(_i1e_slope))
rule("polygamma", doc="JAX's value; derivative ψ⁽ⁿ⁺¹⁾(x) (scipy.special.polygamma; n is not differentiated)")(
    _special(lambda n, x, y: sc.polygamma(np.asarray(n, np.int64) + 1, x)))
rule("igamma", doc="JAX's value of P(a, x); derivative in x: x^(a−1)e^(−x)/Γ(a) (a not differentiated)")(
    _special(_igamma_slope))
rule("igammac", doc="JAX's value of Q(a, x) = 1 − P(a, x); derivative in x: −x^(a−1)e^(−x)/Γ(a)")(
    _special(lambda a, x, y: -_igamma_slope(a, x, y)))


def _half(v):
    return v.tape.apply(O.muls, v, None, 0.5)


@rule("sinh", doc="`(expm1(a) − expm1(−a)) / 2`", needs=("expm1",))
def _sinh(r, xs, eqn):
    x = r.var(xs[0])
    return _half(tg.expm1(x) - tg.expm1(_neg(r, x)))


@rule("cosh", doc="`(exp(a) + exp(−a)) / 2`")
def _cosh(r, xs, eqn):
    x = r.var(xs[0])
    return _half(r.tape.apply(O.exp, x) + r.tape.apply(O.exp, _neg(r, x)))


@rule("atanh", doc="`(log1p(a) − log1p(−a)) / 2`", needs=("log1p",))
def _atanh(r, xs, eqn):
    x = r.var(xs[0])
    return _half(tg.log1p(x) - tg.log1p(_neg(r, x)))


def _sqrt_one_minus_square(r, x):
    return r.tape.apply(O.sqrt, r.tape.apply(O.adds, _neg(r, r.tape.apply(O.square, x)), None, 1.0))


@rule("atan", doc="`atan2(a, 1)`", needs=("atan2",))
def _atan(r, xs, eqn):
    x = r.var(xs[0])
    return tg.atan2(x, r.var(np.ones(x.shape)))


@rule("asin", doc="`atan2(a, √(1 − a²))`", needs=("atan2",))
def _asin(r, xs, eqn):
    x = r.var(xs[0])
    return tg.atan2(x, _sqrt_one_minus_square(r, x))


@rule("asinpi", doc="`asin(a) / π` (jax >= 0.12.1's primitive)", needs=("atan2",))
def _asinpi(r, xs, eqn):
    return _asin(r, xs, eqn) / np.pi


@rule("sinpi", doc="`sin(π·a)` (jax >= 0.12.1's primitive)", needs=("sin",))
def _sinpi(r, xs, eqn):
    return tg.sin(r.var(xs[0]) * np.pi)


@rule("polynomial", doc="Horner's rule `a₀ + x·(a₁ + x·(… + x·a_N))` (jax >= 0.12.1's primitive; XLA rounds "
      "each step once, with fmuladd)")
def _polynomial(r, xs, eqn):
    x, *coeffs = xs
    x = r.var(x)
    acc = r.var(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = r.var(c) + x * acc
    return _bcast(r, acc, _out_shape(eqn))


@rule("acos", doc="`atan2(√(1 − a²), a)`", needs=("atan2",))
def _acos(r, xs, eqn):
    x = r.var(xs[0])
    return tg.atan2(_sqrt_one_minus_square(r, x), x)


@rule("one_minus_square", doc="`1 − a²` for a² < ¼, else `(1 + a)·(1 − a)` as XLA lowers it (jax ≥ 0.11): "
      "the value and the derivative −2a accurate on both sides", needs=("where",))
def _one_minus_square(r, xs, eqn):
    x = r.var(xs[0])
    small = r.tape.apply(O.adds, _neg(r, r.tape.apply(O.square, x)), None, 1.0)
    large = r.tape.apply(O.adds, x, None, 1.0) * r.tape.apply(O.adds, _neg(r, x), None, 1.0)
    return tg.where(np.abs(r.value(xs[0])) < 0.5, small, large)


@rule("cbrt", doc="`sign(a) · |a|^(1/3)` (the sign a constant)")
def _cbrt(r, xs, eqn):
    x = r.var(xs[0])
    return r.tape.apply(O.pow, r.tape.apply(O.abs, x), None, 1.0 / 3.0) * r.var(np.sign(r.value(x)))


@rule("exp2", doc="`exp(a · ln 2)`")
def _exp2(r, xs, eqn):
    return r.tape.apply(O.exp, r.tape.apply(O.muls, r.var(xs[0]), None, math.log(2.0)))


@rule("log2", doc="`log(a) / ln 2` (a primitive of its own since jax 0.12)")
def _log2(r, xs, eqn):
    return r.tape.apply(O.muls, r.tape.apply(O.log, r.var(xs[0])), None, 1.0 / math.log(2.0))


@rule("rsqrt", doc="`1 / sqrt(a)`")
def _rsqrt(r, xs, eqn):
    return r.tape.apply(O.rdivs, r.tape.apply(O.sqrt, r.var(xs[0])), None, 1.0)


@rule("integer_pow", doc="`square` and `mul` by repeated squaring as XLA lowers it (x³ = x·(x·x)), then "
      "`1/a` for a negative exponent", needs=("square", "mul"))
def _integer_pow(r, xs, eqn):
    x, y = r.var(xs[0]), int(eqn.params["y"])
    if y == 0:
        return r.var(np.ones(x.shape))
    n, acc = abs(y), None
    while n:
        if n & 1:
            acc = x if acc is None else acc * x
        n >>= 1
        if n:
            x = r.tape.apply(O.square, x)   # x·x, the same rounding as XLA's mul(x, x)
    return r.tape.apply(O.rdivs, acc, None, 1.0) if y < 0 else acc


@rule("pow", doc="`pow` for a constant scalar exponent, else `sign · exp(b · log|a|)` (the sign a constant)")
def _pow(r, xs, eqn):
    a, b = xs
    if not isinstance(b, tg.Var) and np.ndim(b) == 0 and isinstance(a, tg.Var):
        return r.tape.apply(O.pow, a, None, float(b))
    out = r.tape.apply(O.exp, r.var(b) * r.tape.apply(O.log, r.tape.apply(O.abs, r.var(a))))
    sign = np.sign(r.jout())                   # a negative base only has a real power at integer exponents
    return out if np.all(sign >= 0) else out * r.var(sign)


@rule("rem", doc="`a − b · trunc(a / b)` (the quotient a constant, as JAX's rule)")
def _rem(r, xs, eqn):
    q = np.trunc(r.value(xs[0]) / r.value(xs[1]))
    return r.var(xs[0]) - r.var(xs[1]) * r.var(q)


@rule("select_n", doc="`tg.where` per case (the untaken branch gets an exact zero)", needs=("where",))
def _select_n(r, xs, eqn):
    pred, cases = np.asarray(xs[0]), xs[1:]
    shape = _out_shape(eqn)
    out = r.var(cases[0])
    for k in range(1, len(cases)):
        mask = np.broadcast_to(pred if pred.dtype == bool else pred == k, shape)
        out = tg.where(mask, r.var(cases[k]), out)
    return out


@rule("clamp", doc="`tg.where` with JAX's rule: no gradient to any side at a tie", needs=("where",))
def _clamp(r, xs, eqn):
    lo, x, hi = xs
    shape = _out_shape(eqn)
    vl, vx, vh = (np.broadcast_to(r.value(v), shape) for v in (lo, x, hi))
    r.kink(int(np.sum((vx == vl) | (vx == vh))), "clamp at a bound")
    mid, below, above = (vx > vl) & (vx < vh), (vl > vx) & (vl < vh), vh < vx
    tie = r.var(np.asarray(r.jout(), np.float64))
    out = tg.where(above, _bcast(r, hi, shape), tie)
    out = tg.where(below, _bcast(r, lo, shape), out)
    return tg.where(mid, _bcast(r, x, shape), out)


def _bcast(r, v, shape):
    v = r.var(v)
    if tuple(v.shape) == shape:
        return v
    v = _reshape(r, v, (1,) * (len(shape) - v.ndim) + tuple(v.shape))
    return r.tape.apply(O.broadcast_to, v, None, shape)


def _identity(r, xs, eqn):
    return r.var(xs[0])


rule("copy", "copy_p", "reduce_precision", doc="identity")(_identity)


@rule("convert_element_type", doc="identity (the tape keeps float64; a lower precision is reported, not replayed)")
def _convert(r, xs, eqn):
    return r.var(xs[0])


@rule("optimization_barrier", doc="identity on every operand")
def _barrier(r, xs, eqn):
    return [x if isinstance(x, tg.Var) else None for x in xs]


# ── layout ───────────────────────────────────────────────────────────────────

@rule("broadcast_in_dim", doc="`reshape` + `broadcast_to`")
def _broadcast_in_dim(r, xs, eqn):
    shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
    v = r.var(xs[0])
    mid = [1] * len(shape)
    for k, d in enumerate(dims):
        mid[d] = v.shape[k]
    v = _reshape(r, v, mid)
    return v if tuple(v.shape) == shape else r.tape.apply(O.broadcast_to, v, None, shape)


@rule("reshape", "squeeze", "expand_dims", doc="`reshape`")
def _reshape_rule(r, xs, eqn):
    return _reshape(r, r.var(xs[0]), _out_shape(eqn))


@rule("transpose", doc="`transpose`")
def _transpose(r, xs, eqn):
    return _permute(r, r.var(xs[0]), eqn.params["permutation"])


@rule("slice", doc="`slice` (strided: `x[::k]`)")
def _slice(r, xs, eqn):
    p = eqn.params
    strides = p.get("strides") or (1,) * len(p["start_indices"])
    x = r.var(xs[0])
    if all(s == 1 for s in strides):
        s = tuple((int(lo), int(hi)) for lo, hi in zip(p["start_indices"], p["limit_indices"]))
        return r.tape.apply(O.slice, x, None, s)
    bounds = zip(p["start_indices"], p["limit_indices"], strides)
    return x[tuple(slice(int(lo), int(hi), int(st)) for lo, hi, st in bounds)]


@rule("concatenate", doc="`concat`")
def _concatenate(r, xs, eqn):
    return tg.concat([r.var(x) for x in xs], axis=int(eqn.params["dimension"]))


@rule("stack", doc="`tg.stack`", needs=("stack",))
def _stack(r, xs, eqn):
    return tg.stack([r.var(x) for x in xs], axis=int(eqn.params["axis"]))


@rule("split", doc="one `slice` per piece")
def _split(r, xs, eqn):
    x, axis = r.var(xs[0]), int(eqn.params["axis"])
    out, lo = [], 0
    for n in eqn.params["sizes"]:
        s = tuple((lo, lo + int(n)) if k == axis else (0, d) for k, d in enumerate(x.shape))
        out.append(r.tape.apply(O.slice, x, None, s))
        lo += int(n)
    return out


@rule("tile", doc="`broadcast_to` of the operand with a unit axis before each, then `reshape`")
def _tile(r, xs, eqn):
    reps = tuple(int(k) for k in eqn.params["reps"])
    x = r.var(xs[0])
    shape = (1,) * (len(reps) - x.ndim) + tuple(x.shape)
    spread = tuple(d for n in shape for d in (1, n))
    x = _bcast(r, _reshape(r, x, spread), tuple(d for k, n in zip(reps, shape) for d in (k, n)))
    return _reshape(r, x, _out_shape(eqn))


@rule("rev", doc="`tg.flip` per axis", needs=("flip",))
def _rev(r, xs, eqn):
    x = r.var(xs[0])
    for d in eqn.params["dimensions"]:
        x = tg.flip(x, int(d))
    return x


def _clamped_starts(xs, shape, sizes):
    return [int(np.clip(int(np.asarray(s)), 0, n - k)) for s, n, k in zip(xs, shape, sizes)]


@rule("dynamic_slice", doc="`slice` at the concrete start (clamped as JAX does)")
def _dynamic_slice(r, xs, eqn):
    x = r.var(xs[0])
    sizes = eqn.params["slice_sizes"]
    st = _clamped_starts(xs[1:], x.shape, sizes)
    return r.tape.apply(O.slice, x, None, tuple((a, a + int(k)) for a, k in zip(st, sizes)))


def _positions(shape, lo, counts, steps=None):
    """Flat indices, in an array of ``shape``, of the block starting at ``lo`` with ``counts`` elements per axis."""
    steps = steps or (1,) * len(shape)
    grids = np.meshgrid(*[a + s * np.arange(c) for a, c, s in zip(lo, counts, steps)], indexing="ij")
    return np.ravel_multi_index([g.reshape(-1) for g in grids], shape) if shape else np.zeros(1, np.int64)


@rule("dynamic_update_slice", doc="`tg.index_set` at the block's flat indices", needs=("index_set",))
def _dynamic_update_slice(r, xs, eqn):
    x, u = xs[0], xs[1]
    shape = _out_shape(eqn)
    ushape = np.shape(r.value(u)) if not isinstance(u, tg.Var) else u.shape
    st = _clamped_starts(xs[2:], shape, ushape)
    idx = _positions(shape, st, ushape)
    return _reshape(r, tg.index_set(_flat(r, x), idx, _flat(r, u), axis=0), shape)


@rule("pad", doc="`tg.index_set` of the operand into the padding value", needs=("index_set", "take"))
def _pad(r, xs, eqn):
    x, pv = xs
    shape = _out_shape(eqn)
    xshape = x.shape if isinstance(x, tg.Var) else np.shape(x)
    src, dst = [], []
    for d, (lo, hi, interior) in enumerate(eqn.params["padding_config"]):
        pos = lo + np.arange(xshape[d]) * (interior + 1)
        keep = (pos >= 0) & (pos < shape[d])
        src.append(np.nonzero(keep)[0])
        dst.append(pos[keep])
    sg = np.meshgrid(*src, indexing="ij")
    dg = np.meshgrid(*dst, indexing="ij")
    si = np.ravel_multi_index([g.reshape(-1) for g in sg], xshape) if xshape else np.zeros(1, np.int64)
    di = np.ravel_multi_index([g.reshape(-1) for g in dg], shape) if shape else np.zeros(1, np.int64)
    base = _reshape(r, _bcast(r, pv, shape), (int(np.prod(shape)),))
    vals = _flat(r, x)
    if si.size != vals.shape[0]:
        vals = tg.take(vals, si, axis=0)
    return _reshape(r, tg.index_set(base, di, vals, axis=0), shape)


# ── gather and scatter: index maps computed by JAX on iota, replayed as flat take / index_add ─────

def _gather_map(eqn, args):
    op, idx = args[0], args[1]
    n = int(np.prod(op.shape))
    iota = jnp.arange(1, n + 1, dtype=jax.dtypes.canonicalize_dtype(jnp.int64)).reshape(op.shape)
    params = dict(eqn.params, fill_value=0)
    return jax.lax.gather_p.bind(*align_varying((iota, idx)), **params)


def _scatter_map(eqn, args):
    op, idx, upd = args[0], args[1], args[2]
    dn = eqn.params["dimension_numbers"]
    gdn = jax.lax.GatherDimensionNumbers(
        offset_dims=tuple(dn.update_window_dims), collapsed_slice_dims=tuple(dn.inserted_window_dims),
        start_index_map=tuple(dn.scatter_dims_to_operand_dims),
        operand_batching_dims=tuple(dn.operand_batching_dims),
        start_indices_batching_dims=tuple(dn.scatter_indices_batching_dims))
    sizes, pos = [], 0
    for d in range(op.ndim):
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(upd.shape[dn.update_window_dims[pos]])
            pos += 1
    n = int(np.prod(op.shape))
    iota = jnp.arange(1, n + 1, dtype=jax.dtypes.canonicalize_dtype(jnp.int64)).reshape(op.shape)
    iota, idx = align_varying((iota, idx))
    return jax.lax.gather(iota, idx, gdn, tuple(sizes), mode=eqn.params["mode"], fill_value=0)


INDEX_MAPS.update({"gather": _gather_map, "scatter-add": _scatter_map, "scatter_add": _scatter_map,
                   "scatter": _scatter_map, "scatter-max": _scatter_map, "scatter_max": _scatter_map,
                   "scatter-min": _scatter_map, "scatter_min": _scatter_map})


@rule("gather", doc="`tg.take` of the flat operand at indices JAX computes by gathering an iota "
      "(filled elements: `tg.where`)", needs=("take", "where"))
def _gather(r, xs, eqn):
    m = r.aux()
    shape = _out_shape(eqn)
    idx = np.maximum(m.reshape(-1) - 1, 0)
    out = _reshape(r, tg.take(_flat(r, xs[0]), idx, axis=0), shape)
    if not m.all():
        out = tg.where(m.reshape(shape) != 0, out, r.var(np.asarray(r.jout(), np.float64)))
    return out


def _scatter(fn_name):
    def f(r, xs, eqn):
        x, u = xs[0], xs[2]
        m = r.aux().reshape(-1)
        keep = np.nonzero(m)[0]
        vals = _flat(r, u)
        if keep.size != m.size:
            vals = tg.take(vals, keep, axis=0)
        return _reshape(r, getattr(tg, fn_name)(_flat(r, x), m[keep] - 1, vals, axis=0), _out_shape(eqn))
    return f


def _scatter_extremal(sign):
    """scatter-max (sign 1) and scatter-min (−1): each result element is the max (min) of its operand
    element and the updates JAX's index map sends there, replayed as a row-wise ``max`` of a masked
    (result × candidates) matrix, so ties share the gradient as JAX's rule splits it."""
    def f(r, xs, eqn):
        m = r.aux().reshape(-1)
        keep = np.nonzero(m)[0]
        x, vals = _flat(r, xs[0]), _flat(r, xs[2])
        if keep.size != m.size:
            vals = tg.take(vals, keep, axis=0)
        cand = tg.concat([x, vals], axis=0)
        if sign < 0:
            cand = _neg(r, cand)
        n = x.shape[0]
        to = np.concatenate([np.arange(n), m[keep] - 1])
        dense = tg.where(to[None, :] == np.arange(n)[:, None], _bcast(r, cand, (n, to.size)), -np.inf)
        out = r.tape.apply(O.max, dense, None, ((1,), False))
        r.kink(_max_ties(r.value(dense), (1,), r.value(out)), "tied scatter extrema")
        return _reshape(r, out if sign > 0 else _neg(r, out), _out_shape(eqn))
    return f


rule("scatter-max", "scatter_max", doc="row-wise `max` of a masked (result × candidates) matrix at the flat "
     "indices JAX computes on an iota", needs=("where", "max", "concat"))(_scatter_extremal(1))
rule("scatter-min", "scatter_min", doc="the same with `−max(−a)`",
     needs=("where", "max", "concat"))(_scatter_extremal(-1))
rule("scatter-add", "scatter_add", doc="`tg.index_add` at the flat indices JAX computes on an iota",
     needs=("index_add", "take"))(_scatter("index_add"))
rule("scatter", doc="`tg.index_set` at the flat indices JAX computes on an iota",
     needs=("index_set", "take"))(_scatter("index_set"))


# ── reductions and scans ─────────────────────────────────────────────────────

def _axes(eqn):
    return tuple(sorted(int(a) for a in eqn.params["axes"]))


@rule("reduce_sum", doc="`sum`")
def _reduce_sum(r, xs, eqn):
    return r.tape.apply(O.sum, r.var(xs[0]), None, (_axes(eqn), False))


@rule("psum", doc="`sum` over its positional axes (a `vmap` axis name, e.g. BatchNorm under "
      "`vmap(axis_name=...)`, is batched into one); a mesh axis name is not replayed")
def _psum(r, xs, eqn):
    axes = tuple(eqn.params["axes"])
    if not all(isinstance(a, (int, np.integer)) for a in axes):
        raise NotReplayable(f"psum over named axes {axes} (a collective of shard_map/pmap)")
    axes = tuple(int(a) for a in axes)
    outs = [r.tape.apply(O.sum, r.var(x), None, (axes, False)) if isinstance(x, tg.Var) else None for x in xs]
    return outs if eqn.primitive.multiple_results else outs[0]   # one operand: not a multiple-results bind


def _max_ties(v, axes, out):
    return int(np.sum(v == np.expand_dims(out, axes))) - int(np.size(out))


@rule("reduce_max", doc="`max` (tied maxima share the gradient, as JAX)")
def _reduce_max(r, xs, eqn):
    out = r.tape.apply(O.max, r.var(xs[0]), None, (_axes(eqn), False))
    r.kink(_max_ties(r.value(xs[0]), _axes(eqn), r.value(out)), "tied maxima")
    return out


@rule("reduce_min", doc="`−max(−a)`")
def _reduce_min(r, xs, eqn):
    out = _neg(r, r.tape.apply(O.max, _neg(r, r.var(xs[0])), None, (_axes(eqn), False)))
    r.kink(_max_ties(r.value(xs[0]), _axes(eqn), r.value(out)), "tied minima")
    return out


@rule("reduce_prod", doc="`tg.prod`", needs=("prod",))
def _reduce_prod(r, xs, eqn):
    return tg.prod(r.var(xs[0]), axis=_axes(eqn))


def _cum(name):
    def f(r, xs, eqn):
        return getattr(tg, name)(r.var(xs[0]), axis=int(eqn.params["axis"]), reverse=bool(eqn.params["reverse"]))
    return f


for _p in ("cumsum", "cumprod", "cummax"):
    rule(_p, doc=f"`tg.{_p}`", needs=(_p,))(_cum(_p))


@rule("cumlogsumexp", doc="`logsumexp` over the last axis of a (…, n, n) matrix holding each prefix, "
      "the rest −∞ (stable at any spread of values; the gradient is each prefix's softmax)",
      needs=("logsumexp", "where"))
def _cumlogsumexp(r, xs, eqn):
    axis = int(eqn.params["axis"]) % len(xs[0].shape)
    x = r.var(xs[0])
    perm = [k for k in range(x.ndim) if k != axis] + [axis]
    x = _permute(r, x, perm)
    n = x.shape[-1]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    prefix = j >= i if eqn.params["reverse"] else j <= i
    rows = _bcast(r, _reshape(r, x, tuple(x.shape[:-1]) + (1, n)), tuple(x.shape[:-1]) + (n, n))
    out = tg.logsumexp(tg.where(prefix, rows, -np.inf), axis=-1)
    return _permute(r, out, np.argsort(perm))


@rule("cummin", doc="`−cummax(−a)`", needs=("cummax",))
def _cummin(r, xs, eqn):
    return _neg(r, tg.cummax(_neg(r, r.var(xs[0])), axis=int(eqn.params["axis"]), reverse=bool(eqn.params["reverse"])))


@rule("sort", doc="`tg.take_along_axis` by the permutation of JAX's keys (stable)", needs=("take_along_axis",))
def _sort(r, xs, eqn):
    dim, nk = int(eqn.params["dimension"]), int(eqn.params["num_keys"])
    env, st = r._st
    keys = [np.moveaxis(env.np(s), dim, -1) for s in st.ins[:nk]]
    perm = np.lexsort(keys[::-1], axis=-1) if nk > 1 else np.argsort(keys[0], axis=-1, kind="stable")
    srt = np.take_along_axis(keys[0], perm, -1)
    r.kink(int(np.sum(srt[..., 1:] == srt[..., :-1])), "tied sort keys")
    perm = np.moveaxis(perm, -1, dim)
    return [tg.take_along_axis(x, perm, axis=dim) if isinstance(x, tg.Var) else None for x in xs]


@rule("top_k", doc="`tg.take_along_axis` at JAX's indices", needs=("take_along_axis",))
def _top_k(r, xs, eqn):
    return [tg.take_along_axis(r.var(xs[0]), r.jout(1), axis=-1), None]


# ── products ─────────────────────────────────────────────────────────────────

def _float(r, x):
    """A float Var of operand ``x``: a bool or integer one (``dot_general`` takes mixed dtypes with a
    ``preferred_element_type``, e.g. a matmul of a mask) promoted as JAX promotes it, into a constant."""
    v = r.var(x)
    if r.value(v).dtype.kind in "fc":
        return v
    return r.tape.const(r.value(v).astype(r.tape.dtype))


@rule("dot_general", doc="`matmul` / `bmm` after `transpose` + `reshape`")
def _dot_general(r, xs, eqn):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = _float(r, xs[0]), _float(r, xs[1])
    lf = [k for k in range(a.ndim) if k not in lc and k not in lb]
    rf = [k for k in range(b.ndim) if k not in rc and k not in rb]
    sa, sb = a.shape, b.shape
    nb = int(np.prod([sa[k] for k in lb]))
    m, n = int(np.prod([sa[k] for k in lf])), int(np.prod([sb[k] for k in rf]))
    kk = int(np.prod([sa[k] for k in lc]))
    a = _permute(r, a, list(lb) + lf + list(lc))
    b = _permute(r, b, list(rb) + list(rc) + rf)
    if lb:
        out = tg.bmm(_reshape(r, a, (nb, m, kk)), _reshape(r, b, (nb, kk, n)))
    else:
        out = tg.matmul(_reshape(r, a, (m, kk)), _reshape(r, b, (kk, n)))
    return _reshape(r, out, _out_shape(eqn))


def _cropped(x, padding, dilation):
    """``(x', padding')`` with no negative padding: a negative (lo, hi) crops the (lhs-dilated) input, as
    JAX's own transpose of a strided convolution asks; a crop of the dilated sequence is a slice of ``x``
    plus the zeros of the dilation it leaves at the ends."""
    keep, pads = [slice(None)] * 2, []
    for n, (lo, hi), d in zip(x.shape[2:], padding, dilation):
        lo, hi, d = int(lo), int(hi), int(d)
        first, last = max(-lo, 0), (n - 1) * d - max(-hi, 0)   # the kept span of the dilated input
        i0, i1 = -(-first // d), last // d
        if i1 < i0:
            raise NotReplayable(f"padding {(lo, hi)} crops the whole input")
        keep.append(slice(i0, i1 + 1))
        pads.append((max(lo, 0) + i0 * d - first, max(hi, 0) + last - i1 * d))
    return (x[tuple(keep)] if any(k != slice(None) for k in keep[2:]) else x), pads


@rule("conv_general_dilated", doc="`tg.conv` in NCHW/OIHW after `transpose` by the dimension numbers "
      "(a negative padding: a slice first)",
      needs=("conv",))
def _conv(r, xs, eqn):
    p = eqn.params
    if p.get("batch_group_count", 1) != 1:
        raise NotReplayable("batch_group_count > 1")
    lhs, rhs, out = p["dimension_numbers"]
    x = _permute(r, r.var(xs[0]), lhs)
    w = _permute(r, r.var(xs[1]), rhs)
    x, padding = _cropped(x, p["padding"], p["lhs_dilation"])
    y = tg.conv(x, w, stride=tuple(p["window_strides"]), padding=padding,
                lhs_dilation=tuple(p["lhs_dilation"]), rhs_dilation=tuple(p["rhs_dilation"]),
                groups=int(p["feature_group_count"]), layout="NCHW" if x.ndim == 4 else ("NCW", "NCDHW")[x.ndim == 5])
    return _permute(r, y, np.argsort(out))


def _window(name):
    def f(r, xs, eqn):
        p = eqn.params
        if any(d != 1 for d in tuple(p["base_dilation"]) + tuple(p["window_dilation"])):
            raise NotReplayable("dilated windows")
        return getattr(tg, name)(r.var(xs[0]), tuple(p["window_dimensions"]), tuple(p["window_strides"]),
                                 [tuple(q) for q in p["padding"]])
    return f


rule("reduce_window_max", doc="`tg.max_pool` (first maximum of a window takes its gradient, as JAX)",
     needs=("max_pool",))(_window("max_pool"))
rule("reduce_window_sum", doc="`tg.sum_pool`", needs=("sum_pool",))(_window("sum_pool"))


# ── linear algebra ───────────────────────────────────────────────────────────

def _batched_matmul(a, b):
    if a.ndim == 2:
        return tg.matmul(a, b)
    n = a.shape[-1]
    return tg.reshape(tg.bmm(tg.reshape(a, (-1, n, n)), tg.reshape(b, (-1, n, n))), a.shape)


_CHOLESKY_TANGENT = []


def jax_cholesky_mirrors_its_tangent():
    """Whether JAX's cholesky JVP reads only the tangent's lower triangle, mirrored (as LAPACK reads the
    input; jax 0.12), or takes the tangent as given (jax 0.10): asked of the installed JAX once, on a
    2 × 2 matrix with a tangent above the diagonal only (zero derivative when mirrored)."""
    if not _CHOLESKY_TANGENT:
        with jax.ensure_compile_time_eval():
            x, t = np.array([[1.0, 1.0], [1.0, 2.0]], np.float32), np.array([[0.0, 1.0], [0.0, 0.0]], np.float32)
            f = lambda x: jax.lax.linalg.cholesky(x, symmetrize_input=False)   # noqa: E731
            _CHOLESKY_TANGENT.append(not np.any(np.asarray(jax.jvp(f, (x,), (t,))[1])))
    return _CHOLESKY_TANGENT[0]


@rule("cholesky", doc="`tg.cholesky` of the lower triangle (mirrored), the triangle LAPACK and JAX read, with "
      "the derivative written here as the installed JAX's rule takes it: dL = L Φ(L⁻¹ dA L⁻ᵀ), Φ the lower "
      "triangle with its diagonal halved, dA as given (jax 0.10: `cho_factor` does not symmetrise its input) "
      "or its lower triangle mirrored (jax 0.12); above the diagonal, which JAX leaves unspecified, JAX's "
      "value without gradient", needs=("cholesky", "triangular_solve", "stop_gradient", "bmm"))
def _cholesky(r, xs, eqn):
    a = r.var(xs[0])
    n = a.shape[-1]
    below = np.broadcast_to(np.tril(np.ones((n, n)), -1), a.shape).astype(r.tape.dtype)
    diag = r.var(np.broadcast_to(np.eye(n), a.shape).astype(r.tape.dtype))
    perm = tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2)

    def mirrored(v):    # the lower triangle, mirrored above the diagonal
        low = v * below
        return low + _permute(r, low, perm) + v * diag

    fixed = tg.stop_gradient(a)
    L = tg.cholesky(mirrored(fixed))     # a constant of the tape (no gradient through it): JAX's value
    delta = a - fixed                    # 0, with dA as its derivative
    if jax_cholesky_mirrors_its_tangent():
        delta = mirrored(delta)
    x = tg.triangular_solve(L, tg.triangular_solve(L, delta, left_side=True, lower=True), left_side=False,
                            lower=True, transpose_a=True)              # L⁻¹ dA L⁻ᵀ
    phi = r.var(np.broadcast_to(np.tril(np.ones((n, n)), -1) + 0.5 * np.eye(n), a.shape).astype(r.tape.dtype))
    out = L + _batched_matmul(L, x * phi)
    jax_above = np.triu(r.jout(0), 1)
    if np.array_equal(jax_above, np.triu(r.value(a), 1)):    # LAPACK leaves the input there (CPU)
        return out + fixed * r.var((1.0 - np.tril(np.ones((n, n)))) * np.ones(a.shape, r.tape.dtype))
    return out + r.var(jax_above)


@rule("triangular_solve", doc="`tg.triangular_solve`", needs=("triangular_solve",))
def _triangular_solve(r, xs, eqn):
    p = eqn.params
    return tg.triangular_solve(r.var(xs[0]), r.var(xs[1]), left_side=bool(p["left_side"]), lower=bool(p["lower"]),
                               transpose_a=bool(p["transpose_a"]), unit_diagonal=bool(p["unit_diagonal"]))


@rule("lu", doc="Doolittle elimination (slices, outer products) on the rows in JAX's pivot order",
      needs=("take",))
def _lu(r, xs, eqn):
    a = r.var(xs[0])
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise NotReplayable(f"lu of shape {a.shape} (square 2-D only)")
    n = a.shape[0]
    s = tg.take(a, np.asarray(r.jout(2), np.int64), axis=0)       # the rows in pivot order: P·A = L·U
    pieces, where = [], []
    for k in range(n):
        m = n - k
        urow = r.tape.apply(O.slice, s, None, ((0, 1), (0, m)))
        pieces.append(_reshape(r, urow, (m,)))
        where += [k * n + j for j in range(k, n)]
        if m == 1:
            break
        pivot = _reshape(r, r.tape.apply(O.slice, s, None, ((0, 1), (0, 1))), ())
        lcol = r.tape.apply(O.slice, s, None, ((1, m), (0, 1))) / pivot
        pieces.append(_reshape(r, lcol, (m - 1,)))
        where += [i * n + k for i in range(k + 1, n)]
        rest = r.tape.apply(O.slice, s, None, ((1, m), (1, m)))
        s = rest - tg.matmul(lcol, r.tape.apply(O.slice, urow, None, ((0, 1), (1, m))))
    flat = tg.concat(pieces, axis=0)
    order = np.empty(n * n, np.int64)
    order[np.asarray(where)] = np.arange(n * n)
    return [_reshape(r, tg.take(flat, order, axis=0), (n, n)), None, None]


# A relative eigenvalue gap below this makes eigenvector derivatives (1/gap) meaningless to compare
EIGH_GAP = 1e-8


@rule("eigh", doc="JAX's (v, w) with the derivative written here: dw = diag(Vᵀ dA V), dV = V (F ∘ Vᵀ dA V), "
      "F = 1/(w_j − w_i) off the diagonal (2-D; near-degenerate spectra refused as ill-conditioned)",
      needs=("matmul",))
def _eigh(r, xs, eqn):
    a = r.var(xs[0])
    if a.ndim != 2 or eqn.params.get("subset_by_index") not in (None, (0, a.shape[0])):
        raise NotReplayable(f"eigh of shape {a.shape} or of a subset (the full spectrum of one matrix only)")
    v, w = r.jout(0), r.jout(1)
    n = w.shape[0]
    gaps = np.where(np.eye(n, dtype=bool), np.inf, np.abs(w[None, :] - w[:, None]))
    scale = max(float(np.max(np.abs(w))), np.finfo(float).tiny)
    i, j = np.unravel_index(np.argmin(gaps), gaps.shape)
    if gaps[i, j] <= EIGH_GAP * scale:
        raise NotReplayable(f"eigh: eigenvalues {i} and {j} agree to {gaps[i, j] / scale:.1e} relative (below "
                            f"{EIGH_GAP:g}): the eigenvectors' gradient (1/gap) is ill-conditioned, JAX's as well")
    with np.errstate(divide="ignore"):
        F = np.where(np.eye(n, dtype=bool), 0.0, 1.0 / (w[None, :] - w[:, None]))
    jw = np.einsum("ak,bk->kab", v, v).reshape(n, n * n)
    jv = np.einsum("ik,kj,ak,bj->ijab", v, F, v, v).reshape(n * n, n * n)
    delta = _reshape(r, a - r.var(r.value(a)), (n * n, 1))
    dv = _reshape(r, tg.matmul(r.var(jv), delta), (n, n))
    dw = _reshape(r, tg.matmul(r.var(jw), delta), (n,))
    return [r.var(v) + dv, r.var(w) + dw]


@rule("qr", doc="JAX's (Q, R) with the derivative written here: C = Qᵀ dA R⁻¹, Ω = tril(C, −1) − tril(C, −1)ᵀ, "
      "dR = (C − Ω) R, dQ = dA R⁻¹ − Q (C − Ω) (2-D reduced, m ≥ n, unpivoted)", needs=("matmul",))
def _qr(r, xs, eqn):
    a = r.var(xs[0])
    m, n = a.shape if a.ndim == 2 else (0, 1)
    if a.ndim != 2 or m < n or eqn.params.get("pivoting") or (eqn.params.get("full_matrices") and m > n):
        raise NotReplayable(f"qr of shape {a.shape} with {dict(eqn.params)} (a reduced, unpivoted m >= n matrix only)")
    q, rr = r.jout(0), r.jout(1)
    rinv = np.linalg.inv(rr)
    basis = np.eye(m * n).reshape(m * n, m, n)                        # every direction dA at once
    c = np.einsum("ji,kjl,lp->kip", q, basis, rinv)
    low = np.tril(c, -1)
    c_minus_omega = c - (low - np.swapaxes(low, 1, 2))
    jr = np.einsum("kij,jl->kil", c_minus_omega, rr).reshape(m * n, n * n).T
    jq = (np.einsum("kij,jl->kil", basis, rinv) - np.einsum("ij,kjl->kil", q, c_minus_omega)).reshape(m * n, m * n).T
    delta = _reshape(r, a - r.var(r.value(a)), (m * n, 1))
    dq = _reshape(r, tg.matmul(r.var(jq), delta), (m, n))
    dr = _reshape(r, tg.matmul(r.var(jr), delta), (n, n))
    return [r.var(q) + dq, r.var(rr) + dr]


# The explicit Jacobian an svd's derivative is recorded with (entries); a larger one is refused by name
SVD_JACOBIAN = 1 << 24


def _svd_vjp(u, s, v, gu=None, gs=None, gv=None):
    """The thin-SVD reverse rule (A = U S Vᵀ, m × n, k = min(m, n)) for a batch of cotangents (b, m, k),
    (b, k), (b, n, k) of U, s and V: Ā = U [(F ∘ (UᵀŪ − ŪᵀU)) S + diag(s̄) + S (F ∘ (VᵀV̄ − V̄ᵀV))] Vᵀ
    + (I − UUᵀ) Ū S⁻¹ Vᵀ + U S⁻¹ V̄ᵀ (I − VVᵀ), F_ij = 1/(s_j² − s_i²) off the diagonal (the last two
    terms only where U, or V, is not square)."""
    (m, k), n = u.shape, v.shape[0]
    b = next(len(g) for g in (gu, gs, gv) if g is not None)
    off = ~np.eye(k, dtype=bool)
    F = np.zeros((k, k))
    with np.errstate(divide="ignore"):    # a degenerate pair is refused before F is used
        F[off] = 1.0 / (s[None, :] ** 2 - s[:, None] ** 2)[off]
    inner, extra = np.zeros((b, k, k)), np.zeros((b, m, n))
    if gs is not None:
        inner += gs[:, :, None] * np.eye(k)
    if gu is not None:
        c = u.T @ gu
        inner += F * (c - np.swapaxes(c, 1, 2)) * s[None, None, :]
        if m > k:
            extra += ((gu - u @ c) / s) @ v.T
    if gv is not None:
        c = v.T @ gv
        inner += s[None, :, None] * (F * (c - np.swapaxes(c, 1, 2)))
        if n > k:
            extra += (u / s) @ np.swapaxes(gv - v @ c, 1, 2)
    return u @ inner @ v.T + extra


@rule("svd", doc="JAX's (s, U, Vᵀ) with the thin-SVD reverse rule written here: Ā = U [(F ∘ (UᵀŪ − ŪᵀU)) S "
      "+ diag(s̄) + S (F ∘ (VᵀV̄ − V̄ᵀV))] Vᵀ + (I − UUᵀ) Ū S⁻¹ Vᵀ + U S⁻¹ V̄ᵀ (I − VVᵀ), F = 1/(s_j² − s_i²) "
      "off the diagonal; singular values only: Ā = U diag(s̄) Vᵀ (2-D; `full_matrices` of a non-square matrix "
      "and near-degenerate or zero singular values under differentiated vectors refused)", needs=("matmul",))
def _svd(r, xs, eqn):
    a, p = r.var(xs[0]), eqn.params
    m, n = a.shape if a.ndim == 2 else (0, 0)
    if a.ndim != 2 or p.get("subset_by_index") not in (None, (0, min(m, n))):
        raise NotReplayable(f"svd of shape {a.shape} or of a subset (all singular values of one matrix only)")
    vectors = bool(p.get("compute_uv", True))
    if vectors and p.get("full_matrices") and m != n:
        raise NotReplayable(f"svd with full_matrices=True of a {m} × {n} matrix: the complete basis' extra "
                            "vectors have no derivative (JAX's rule refuses them too); full_matrices=False replays")
    k = min(m, n)
    s = r.jout(0)
    outputs = k + (m * k + k * n if vectors else 0)
    if outputs * m * n > SVD_JACOBIAN:
        raise NotReplayable(f"svd of a {m} × {n} matrix: its explicit Jacobian ({outputs} × {m * n}) is over "
                            f"the oracle's {SVD_JACOBIAN} entries")
    scale = max(float(np.max(s)), np.finfo(float).tiny)
    gaps = np.where(np.eye(k, dtype=bool), np.inf, np.abs(s[None, :] - s[:, None]))
    i, j = np.unravel_index(np.argmin(gaps), gaps.shape)
    if vectors:
        u, v = r.jout(1), r.jout(2).T
        if gaps[i, j] <= EIGH_GAP * scale:
            raise NotReplayable(f"svd: singular values {i} and {j} agree to {gaps[i, j] / scale:.1e} relative "
                                f"(below {EIGH_GAP:g}): the singular vectors' gradient (1/gap) is ill-conditioned, "
                                "JAX's as well")
        if m != n and s[-1] <= EIGH_GAP * scale:
            raise NotReplayable(f"svd: singular value {k - 1} is {s[-1] / scale:.1e} of the largest (below "
                                f"{EIGH_GAP:g}) in a {m} × {n} matrix: the singular vectors' gradient (1/s) is "
                                "ill-conditioned, JAX's as well")
    else:
        u, _, vt = np.linalg.svd(r.value(a), full_matrices=False)   # only the products u_k v_kᵀ are used
        v = vt.T
        r.kink(int(np.sum(np.triu(gaps <= EIGH_GAP * scale, 1))), "degenerate singular values (svd)")
    delta = _reshape(r, a - r.var(r.value(a)), (m * n, 1))

    def moved(value, jac):
        return r.var(value) + _reshape(r, tg.matmul(r.var(jac.reshape(-1, m * n)), delta), value.shape)

    ds = moved(s, _svd_vjp(u, s, v, gs=np.eye(k)))
    if not vectors:
        return [ds]
    du = moved(u, _svd_vjp(u, s, v, gu=np.eye(m * k).reshape(m * k, m, k)))
    dvt = moved(v.T, _svd_vjp(u, s, v, gv=np.swapaxes(np.eye(k * n).reshape(k * n, k, n), 1, 2)))
    return [ds, du, dvt]


# ── control flow and solves (loops) ────────────────────────────────────────

DOCS.update({"scan": "unrolled: the body replayed once per iteration (`reverse` honoured; ys stacked)",
             "while": "unrolled with the trip count JAX's own loop takes (`fori_loop`, `while_loop`)",
             "cond": "the branch JAX takes (`cond`, `switch`)",
             "custom_linear_solve": "`x₀ + solve(b − matvec(x₀))` at JAX's solution x₀: the value is x₀ and the "
                                    "derivative A⁻¹(db − dA·x), both jaxprs replayed"})


