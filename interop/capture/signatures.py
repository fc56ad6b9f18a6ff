"""One capture per input signature, as ``jax.jit`` keeps one trace per signature.

``Signatures(fn, …).lookup(args)`` traces ``fn`` at ``args`` (every call, as ``jax.value_and_grad`` does, so
a closure always reads its current values) and returns the capture for that signature, capturing on a
miss. A signature is what decides the program: the jaxpr (its text, and the expansion of every custom
rule in it), the operands' shapes and dtypes, the values ``fn`` closes over, and the capture's settings.

Values ``fn`` closes over that are traced by an enclosing ``jax.jit`` (flax's ``loss_fn`` closing over the
batch inside a jitted step) are hoisted into operands of the call; concrete ones are constants of the
program. Under ``jit`` the arguments themselves are abstract: the capture then records the program at
stand-in values of their types (``placeholder``), which is sound because a program never keeps a value
that changes between calls (capture_jax's module docstring), and first-run verification happens on the
first real call.

Captures are also shared across the process, as ``jax.jit``'s compilation cache is: a second
``value_and_grad`` or ``train_step`` of a function whose signature was captured before (the same jaxpr,
rules, types, closed-over values, settings and, for a native training step, the same optimizer
program) takes that capture instead of capturing again (``clear_caches`` empties it).
"""
import os
from collections import OrderedDict

import numpy as np

from .._jax import jax, varying, x64_enabled
from . import expand
from .capture import CaptureError, TracingError, _argnums, _flatten_args, _capture
from ..oracle.replay import CUSTOM_CALLS, Literal, call_body, is_float

from jax.extend.core import ClosedJaxpr  # noqa: E402

# Captures kept per function (least recently used first out). Each one's program stays loaded for the
# life of the process all the same: a jitted executable may call it at any later time, as JAX keeps
# every executable it compiled.
CACHE_SIZE = 8
# A closed-over NumPy array up to this many bytes is keyed by its contents, a larger one (or a jax.Array,
# which cannot change) by its identity.
HASHED_BYTES = 1 << 20
# Captures shared by every Signatures of the process. Each program stays pinned for the life of the
# process anyway (interop.xla.program), so sharing them costs no memory.
SHARED_SIZE = 64
_SHARED = OrderedDict()


def clear_caches() -> None:
    """Forget the captures shared across the process: the next ``value_and_grad`` or ``train_step`` of
    any function captures afresh (as ``jax.clear_caches()`` makes ``jax.jit`` trace and compile again).
    Steps already made keep their captures.

    >>> import interop
    >>> interop.clear_caches()
    """
    _SHARED.clear()


def _settings():
    """What decides a program besides its function: the compiler and tapegrad's settings."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k == "CC" or k.startswith("TAPEGRAD_")))


def _is_tracer(x):
    return isinstance(x, jax.core.Tracer)


def placeholder(aval, rng):
    """A concrete stand-in of type ``aval``: floats in [0.5, 1.5) (finite under log, sqrt, division),
    integers 0 (an index in range of any axis), False, keys of zeros."""
    shape, dtype = tuple(aval.shape), aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        impl = dtype._impl
        return jax.random.wrap_key_data(np.zeros(shape + tuple(impl.key_shape), np.uint32), impl=impl)
    if jax.dtypes.issubdtype(dtype, np.floating) or jax.dtypes.issubdtype(dtype, np.complexfloating):
        return np.asarray(rng.uniform(0.5, 1.5, shape), dtype)
    return np.zeros(shape, dtype)


def _rule_texts(jaxpr, out, depth=0, tangent=None):
    """The expansion of every custom rule the capture of ``jaxpr`` follows (in its sub-jaxprs and expansions
    too): what the jaxpr's text does not show of a rule (``jvp=name`` names a function, not what it
    computes). Inside an expansion (``tangent``: its variables carrying the tangent) a call on values
    carrying none is only its body, which the text shows, as ``Plan`` inlines it."""
    if depth > 16:
        raise CaptureError("capture_jax: custom derivative rules nested more than 16 deep")
    for eqn in jaxpr.eqns:
        moved = tangent is not None and any(not isinstance(v, Literal) and v in tangent for v in eqn.invars)
        if eqn.primitive.name in CUSTOM_CALLS and expand.expands(eqn) and (tangent is None or moved):
            e = expand.expansion(eqn)
            out.append(str(e))
            _rule_texts(e.jaxpr, out, depth + 1, {v for v in e.jaxpr.invars if is_float(v.aval)})
        elif moved and (body := call_body(eqn)) is not None:
            inner = eqn.invars[len(eqn.invars) - len(body[0].invars):]
            _rule_texts(body[0], out, depth + 1, {bv for bv, v in zip(body[0].invars, inner)
                                                  if not isinstance(v, Literal) and v in tangent})
        elif tangent is None:
            for v in eqn.params.values():
                for sub in (v if isinstance(v, tuple) else (v,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        _rule_texts(sub, out, depth + 1)
        if moved and eqn.primitive.name != "stop_gradient":
            tangent.update(eqn.outvars)
    return out


def _const_key(c, keep):
    if isinstance(c, np.ndarray) and c.nbytes <= HASHED_BYTES:
        return ("np", c.shape, c.dtype.str, hash(c.tobytes()))
    if isinstance(c, (np.ndarray, jax.Array)):
        keep.append(c)   # alive while its key is: an id is never reused meanwhile
        return ("id", id(c))
    return ("value", repr(c))


def _aval_key(x):
    a = jax.typeof(x)
    return tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))


class Signatures:
    """Captures of ``fn``, one per input signature, ``CACHE_SIZE`` at most (``lookup``)."""

    def __init__(self, fn, argnums, has_aux, backend, dtype=None, who="value_and_grad", attached=None):
        self.fn, self.argnums, self.has_aux, self.backend, self.dtype = fn, argnums, has_aux, backend, dtype
        # what train_step attaches to the captures' programs (its native optimizer's program settings): a
        # capture is shared only with Signatures that attach the same
        self.who, self.attached = who, attached
        self._lru = OrderedDict()
        self.last = None
        self.captures = 0   # how many signatures this one met (a test counts re-captures), shared ones included

    def lookup(self, args):
        """``(captured, full_args)``: the capture for ``args`` and the arguments its operands take (``args``,
        then a tuple of the hoisted closure values)."""
        which = _argnums(self.argnums, len(args), self.who)
        leaves_p, tree = _flatten_args(self.who, args)
        leaves = [x for _, x in leaves_p]
        out_tree = []

        def flat(*xs):
            out = self.fn(*jax.tree.unflatten(tree, list(xs)))
            flat_out, t = jax.tree.flatten(out)
            out_tree.append(t)
            return flat_out
        # per shard under shard_map: the program is the function of one shard's values, traced without the
        # manual axes (as a capture at a shard's example would be); Captured.operands aligns them per call
        shard = any(varying(x) for x in leaves)
        at = [jax.ShapeDtypeStruct(jax.typeof(x).shape, jax.typeof(x).dtype, weak_type=jax.typeof(x).weak_type)
              for x in leaves] if shard else leaves
        try:
            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*at)
        except jax.errors.ConcretizationTypeError as e:
            raise TracingError(f"{self.who} traces fn as jax.jit does, so Python control flow on traced values "
                               f"cannot run; JAX said: {str(e).splitlines()[0]}") from e
        out_shape = jax.tree.unflatten(out_tree[-1], out_shape)
        hoisted = [c for c in closed.consts if _is_tracer(c)]
        if any(varying(c) for c in hoisted):
            raise CaptureError(f"{self.who}: under shard_map, fn closes over values of the shards "
                               f"({', '.join(jax.typeof(c).str_short() for c in hoisted if varying(c))}); pass "
                               f"them to it as arguments instead (vg(params, x, y), not vg(params) over x and y)")
        keep = []
        key = (tree, tuple(map(_aval_key, leaves)), tuple(map(_aval_key, hoisted)), which, self.has_aux,
               self.backend, None if self.dtype is None else str(np.dtype(self.dtype)), x64_enabled(),
               str(closed.jaxpr), tuple(_rule_texts(closed.jaxpr, [])),
               tuple(None if _is_tracer(c) else _const_key(c, keep) for c in closed.consts))
        full = (*args, tuple(hoisted))
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            self.last = hit[0]
            return hit[0], full
        shared = (key, self.attached, _settings())
        hit = _SHARED.get(shared)
        if hit is not None:
            _SHARED.move_to_end(shared)
            cap = hit[0]
        else:
            cap = self._capture(closed, out_shape, full, which, len(args))
            _SHARED[shared] = (cap, keep)
            if len(_SHARED) > SHARED_SIZE:
                _SHARED.popitem(last=False)
        self._lru[key] = (cap, keep)
        if len(self._lru) > CACHE_SIZE:
            self._lru.popitem(last=False)
        self.last = cap
        self.captures += 1
        return cap, full

    def _capture(self, closed, out_shape, full, which, nargs):
        """The capture of ``closed`` with its traced constants as operands, at stand-in values where the
        arguments are abstract."""
        j = closed.jaxpr
        traced = [v for v, c in zip(j.constvars, closed.consts) if _is_tracer(c)]
        if traced:
            j = j.replace(constvars=[v for v in j.constvars if v not in traced], invars=list(j.invars) + traced)
            closed = ClosedJaxpr(j, [c for c in closed.consts if not _is_tracer(c)])
        leaves_p, tree = jax.tree_util.tree_flatten_with_path(full)
        rng = np.random.default_rng(0)
        with jax.ensure_compile_time_eval():
            example = [(p, placeholder(jax.typeof(x), rng) if _is_tracer(x) else x) for p, x in leaves_p]
            # the program's intermediate buffers assigned by liveness (as XLA assigns its own): the call
            # reads only parameters, inputs, the loss and parameter gradients
            return _capture(self.fn, closed, out_shape, example, tree, which, nargs, self.has_aux, self.backend,
                            self.dtype, self.who, memory="reuse")
