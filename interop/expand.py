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

from ._jax import jax
from .oracle_replay import CUSTOM_CALLS, bind, custom_name, is_float, summary

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
        and any(is_float(v.aval) for v in eqn.invars) and any(is_float(v.aval) for v in eqn.outvars)


def expansion(eqn):
    """``eqn``'s expansion as a closed jaxpr over the same operand and result types (cached per equation)."""
    hit = _CACHE.get(id(eqn))
    if hit is None or hit[0] is not eqn:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        hit = _CACHE[id(eqn)] = (eqn, _trace(eqn))
    return hit[1]


def _what(eqn):
    name = custom_name(eqn)
    return f"the custom rule {name!r}" if name else f"{eqn.primitive.name}"


def _trace(eqn):
    diff = [is_float(v.aval) for v in eqn.invars]

    def expanded(*xs):
        xs = list(xs)
        primals = [jax.lax.stop_gradient(x) if d else x for x, d in zip(xs, diff)]
        call = lambda *a: bind(eqn, a)   # noqa: E731
        if eqn.primitive.name == "custom_vjp_call":
            ys, vjp = jax.vjp(call, *primals)
            cts = tuple(x if d else np.zeros(np.shape(x), jax.dtypes.float0) for x, d in zip(xs, diff))
            (ts,) = jax.linear_transpose(vjp, ys)(cts)
        else:
            tangents = [x if d else np.zeros(np.shape(x), jax.dtypes.float0) for x, d in zip(xs, diff)]
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
