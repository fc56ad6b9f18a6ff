"""Derivative rules as the capture records them: a ``custom_jvp``/``custom_vjp`` call (and a primitive the
tape has no derivative rule for, like ``clamp``) expanded into the value it computes and the linear map
JAX differentiates it by, joined by ``with_grad``.

For a call ``y = f(x)`` the expansion is ``with_grad(f(sg(x)), T(sg(x), x))``, ``sg`` being
``stop_gradient``: the value is the call's own, computed from inputs that carry no gradient, and ``T`` is
the tangent map JAX's ``jvp`` gives the call at ``x`` — its rule, not its body — applied to ``x`` itself.
``T`` is linear in its second argument, so the tape's backward through it is ``Jᵀ·g``: exactly what
``jax.grad`` computes through the rule (relu's 0 at 0, a straight-through estimator's identity, a reversal
layer's ``−λ·g``). A ``custom_vjp`` call's tangent map is the transpose of its ``bwd``
(``jax.linear_transpose``), so its ``bwd`` must be linear in the cotangent, as every rule that
``jax.grad`` can transpose again is; one that is not (clipping the cotangent) is refused by name.

The oracle (``check_grads``) never expands: it replays a call by its body, because checking a rule
against its body is its job.
"""
import numpy as np

from tapegrad.errors import TapeError

from .._jax import jax
from ..oracle.replay import CUSTOM_CALLS, Literal, bind, custom_name, is_float, summary

from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import ad, batching, mlir  # noqa: E402


class CaptureError(TapeError, ValueError):
    """A JAX function (or one of its equations) that cannot become a tapegrad program; the message says why."""


# ── with_grad: the value of one operand, the gradient of the other ───────────

with_grad_p = Primitive("tapegrad_with_grad")
with_grad_p.def_impl(lambda value, path: value)
with_grad_p.def_abstract_eval(lambda value, path: value)


def _with_grad_jvp(primals, tangents):
    value, path = primals
    return with_grad_p.bind(value, path), ad.instantiate_zeros(tangents[1])


ad.primitive_jvps[with_grad_p] = _with_grad_jvp
batching.defbroadcasting(with_grad_p)
mlir.register_lowering(with_grad_p, mlir.lower_fun(lambda value, path: [value], multiple_results=True))


# ── tape_op: a rule that one tapegrad op computes exactly ─────────────────────

# name -> (tapegrad op, the JAX function it stands for given its static operand, the static operands to
# try for an operand type). A custom_jvp call whose expansion is, text for text, the expansion of one of
# these functions at the same type is recorded as that op: one node instead of the rule's several.
KNOWN = {
    "relu": ("relu", lambda s: jax.nn.relu, lambda aval: [None]),
    "softmax": ("softmax", lambda s: lambda x: jax.nn.softmax(x, axis=s), lambda aval: range(aval.ndim)),
}

tape_op_p = Primitive("tapegrad_op")


def _tape_op_fn(x, *, rule, s):
    return KNOWN[rule][1](s)(x)


def _tape_op_batch(args, dims, *, rule, s):
    (x,), (d,) = args, dims
    x = jax.numpy.moveaxis(x, d, 0)
    return tape_op_p.bind(x, rule=rule, s=None if s is None else s + 1), 0


tape_op_p.def_impl(_tape_op_fn)
tape_op_p.def_abstract_eval(lambda x, *, rule, s: x)
batching.primitive_batchers[tape_op_p] = _tape_op_batch
mlir.register_lowering(tape_op_p, mlir.lower_fun(lambda x, *, rule, s: [_tape_op_fn(x, rule=rule, s=s)],
                                                 multiple_results=True))
_CANON = {}


def _custom_eqn(j):
    """The first custom call in a jaxpr, looking inside calls."""
    for e in j.eqns:
        if e.primitive.name in CUSTOM_CALLS:
            return e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found = _custom_eqn(inner)
                if found is not None:
                    return found
    return None


def _canonical(rule, s, aval):
    """``KNOWN[rule]`` at operand type ``aval``: (the text of its expansion, the values of its other operands,
    which must be literals), or None where it has no custom call (jax.nn.softmax without
    ``jax_softmax_custom_jvp``)."""
    key = (rule, s, aval.shape, aval.dtype, getattr(aval, "weak_type", False),
           bool(getattr(jax.config, "jax_softmax_custom_jvp", False)))   # jax.nn.softmax's form follows it
    if key not in _CANON:
        fn = KNOWN[rule][1](s)
        arg = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
        e = _custom_eqn(jax.make_jaxpr(fn)(arg).jaxpr)
        rest = None if e is None else [getattr(v, "val", None) for v in e.invars[1:]]
        ok = e is not None and all(r is not None for r in rest)
        _CANON[key] = (str(_trace(e)), rest) if ok else None
    return _CANON[key]


def _same_literals(vs, vals):
    return all(isinstance(v, Literal) and np.array_equal(np.asarray(v.val), np.asarray(w), equal_nan=True)
               for v, w in zip(vs, vals))


def _known(eqn, traced):
    """``(rule, s)`` when ``eqn`` is one of ``KNOWN`` (its expansion ``traced`` is that rule's, its other
    operands the same literals), else None."""
    if eqn.primitive.name != "custom_jvp_call" or len(eqn.outvars) != 1:
        return None
    aval, text = eqn.invars[0].aval, None
    for rule, (_, _, statics) in KNOWN.items():
        for s in statics(aval):
            canon = _canonical(rule, s, aval)
            if canon is None or len(canon[1]) != len(eqn.invars) - 1 or not _same_literals(eqn.invars[1:], canon[1]):
                continue
            text = str(traced) if text is None else text
            if canon[0] == text:
                return rule, s
    return None


def _as_tape_op(eqn, rule, s):
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
            for v in eqn.invars]
    return jax.make_jaxpr(lambda x, *rest: tape_op_p.bind(x, rule=rule, s=s))(*args)


# ── expansions ───────────────────────────────────────────────────────────────

# primitives the capture records by JAX's own JVP rule, for its convention at a kink (the value comes from
# the replay's own rule): clamp's ties pass no gradient; abs at 0 has slope 1 in jax >= 0.10 (select(x >= 0,
# g, -g)), where the oracle's abs (and tapegrad's) has 0
BY_JVP = frozenset({"clamp", "abs"})
_CACHE = {}


def expands(eqn):
    """Whether the capture replaces ``eqn`` by its expansion (a rule of float values: one that takes or
    gives none has no derivative to follow)."""
    return (eqn.primitive.name in CUSTOM_CALLS or eqn.primitive.name in BY_JVP) \
        and any(is_float(v.aval) and not isinstance(v, Literal) for v in eqn.invars) \
        and any(is_float(v.aval) for v in eqn.outvars)


def expansion(eqn):
    """``eqn``'s expansion as a closed jaxpr over the same operand and result types (cached per equation)."""
    hit = _CACHE.get(id(eqn))
    if hit is None or hit[0] is not eqn:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        traced = _trace(eqn)
        known = _known(eqn, traced)
        hit = _CACHE[id(eqn)] = (eqn, traced if known is None else _as_tape_op(eqn, *known))
    return hit[1]


def _what(eqn):
    name = custom_name(eqn)
    return f"the custom rule {name!r}" if name else f"{eqn.primitive.name}"


def _trace(eqn):
    # the tangent flows through the float operands; a literal one (clamp's bounds) is a constant of the rule
    diff = [is_float(v.aval) and not isinstance(v, Literal) for v in eqn.invars]
    fixed = {k: v.val for k, v in enumerate(eqn.invars) if isinstance(v, Literal)}
    moving = [k for k, d in enumerate(diff) if d]

    def expanded(*xs):
        xs = [fixed.get(k, x) for k, x in enumerate(xs)]

        def call(*a):
            full = list(xs)
            for k, x in zip(moving, a):
                full[k] = x
            return bind(eqn, full)
        primals = [jax.lax.stop_gradient(xs[k]) for k in moving]
        tangents = [xs[k] for k in moving]
        if eqn.primitive.name == "custom_vjp_call":
            ys, vjp = jax.vjp(call, *primals)
            (ts,) = jax.linear_transpose(vjp, ys)(tuple(tangents))
        else:
            ys, ts = jax.jvp(call, primals, tangents)
        return [with_grad_p.bind(y, t) if is_float(v.aval) else y for y, t, v in zip(ys, ts, eqn.outvars)]

    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
            for v in eqn.invars]
    try:
        return jax.make_jaxpr(expanded)(*args)
    except Exception as e:   # noqa: BLE001 - JAX's reason is passed on whole
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if eqn.primitive.name == "custom_vjp_call":
            raise CaptureError(
                f"capture_jax: {_what(eqn)} ({summary(eqn)}): its bwd is not linear in the cotangent, so the "
                f"program cannot record it as a backward (JAX said: {why}). jax.grad calls such a bwd as "
                f"Python; to capture the function, write the rule as a custom_jvp, or make bwd linear in the "
                f"cotangent (a clip of the cotangent belongs in the optimizer: optax.clip)") from None
        raise CaptureError(f"capture_jax: {_what(eqn)} ({summary(eqn)}): its derivative rule does not trace "
                           f"(JAX said: {why})") from None
