"""The gradient oracle: replay a JAX function's jaxpr on a tapegrad tape and compare with ``jax.grad``.

``check_grads(f, *args, argnums=…, has_aux=…)`` traces ``f`` as ``jax.jit`` would, records every
step that depends on the differentiated arguments on a tape (``replay``, ``rules``),
runs tapegrad's reverse sweep and compares it with ``jax.value_and_grad`` of the same jaxpr. Both
are exact reverse-mode sweeps in float64, so they differ only where XLA and NumPy round or sum in
another order: the default bound is ``rtol=1e-12`` normwise per leaf, ``max|Δ| <= rtol·max|jax.grad|``
(or over the whole gradient, for a leaf whose gradient is at rounding level next to the others).
JAX's side is one compiled call computing its value, its gradients and the few step values the
replay reads (constants, loop operands, index maps).

Calls (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``, …) are replayed by their primal body,
so a hand-written rule is checked against the derivative of what it claims to differentiate. When
the two disagree, the report locates the first step where they part: by forward value (every step
is then compared with JAX's value of it), else by a local VJP check of each equation with a random
cotangent, descending into calls, loop iterations and branches. Differences that vanish when the
equation's inputs are nudged off an exact non-differentiable point (a relu at 0, tied maxima) are
kinks, listed with what each side's rule gives there; a float32/bfloat16 step on a differentiable
path moves the comparison to that precision's bound, which the report names.

Everything runs inside a scoped ``jax.enable_x64(True)``: the caller's configuration is untouched.
"""
import contextlib
import hashlib
import linecache
import os
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

import tapegrad as tg
from tapegrad.errors import TapeError

from .._jax import jax, jnp
import jax.extend.core as _core  # noqa: E402
from .loops import loop_envs
from .replay import (CONTROL, CUSTOM_CALLS, TRUST, JEnv, Literal, Plan, Replay, bind, compiled, custom_name,
                            diff, is_data, is_float, is_key, kind, lowp_bound, of_floats, summary)
from .table import CONSTANT, CONTROL_RULES, RULES, UnsupportedPrimitiveError, missing, primitive_table

__all__ = ["check_grads", "assert_grads", "GradReport", "Divergence", "Kink", "Precision",
           "UnsupportedPrimitiveError", "TracingError", "GradientMismatchError", "CheckGradsError", "primitive_table"]


class TracingError(TapeError, TypeError):
    """Raised where ``f`` needs a traced value as a Python value, which its trace cannot give.

    ``check_grads`` traces ``f`` as ``jax.jit`` does (unless ``concrete`` says otherwise) and
    ``capture_jax`` always does, so Python control flow (``if``, ``while``, ``bool()``, ``int()``) on a
    value computed from the arguments cannot run there; the message says what to use instead. Traced
    concretely, as ``jax.grad`` runs ``f``, it means ``f`` needs a value that is abstract even there:
    ``float()`` of a traced value, or a Python branch inside a ``jax.jit``, ``lax`` or custom-rule body.

    Examples:
        >>> import jax.numpy as jnp, interop
        >>> def f(x):
        ...     return jnp.sum(x) if x[0] > 0 else -jnp.sum(x)
        >>> try:
        ...     interop.check_grads(f, jnp.ones(2), concrete=False)
        ... except interop.TracingError:
        ...     print("refused: f branches on a traced value")
        refused: f branches on a traced value
    """


class CheckGradsError(TapeError, ValueError):
    """Raised for a function or arguments that ``check_grads`` cannot check.

    That is: ``argnums`` out of range, nothing float to differentiate, complex numbers on the
    differentiable path, an output that is not one real scalar (with ``has_aux``: not a pair), a
    ``trust`` name of no custom rule of ``f``, or an unknown ``precision`` or ``concrete``. The message
    names the argument (its leaf path) or the equation.
    """


class GradientMismatchError(TapeError, AssertionError):
    """Raised by ``assert_grads`` where tapegrad and ``jax.grad`` disagree; the message is the report."""


@dataclass
class Divergence:
    """Where tapegrad and JAX first part: the step, its text, how, and by how much.

    Attributes:
        index: The step's number among the steps of ``f``'s jaxpr with calls inlined (what the report
            calls "equation k"); a step inside a loop or branch has the number of the top-level step
            that holds it, and ``where`` says where inside.
        eqn: The step's text.
        kind: "value" (the forward values differ) or "vjp" (the equation's local VJP differs).
        max_abs: The largest absolute difference.
        max_rel: The largest difference relative to JAX's largest magnitude.
        where: Inside loops and branches, the path to the step (e.g.
            ``"scan (step 3) › iteration 2"``); empty at the top level.
        rule: The name of the ``custom_vjp``/``custom_jvp`` rule whose gradient differs from its
            body's; empty where the step is no such rule.
    """
    index: int
    eqn: str
    kind: str          # "value" (forward values differ) or "vjp" (the equation's local VJP differs)
    max_abs: float
    max_rel: float
    where: str = ""    # inside loops and branches: e.g. "scan (step 3) › iteration 2"
    rule: str = ""     # the custom_vjp/custom_jvp rule whose gradient differs from its body's, by its name

    def __str__(self):
        at = f" in {self.where}" if self.where else ""
        kind = f"{self.kind} of custom rule {self.rule}" if self.rule else self.kind
        return (f"equation {self.index}{at} ({kind}): {self.eqn}  max|Δ|={self.max_abs:.3g}  "
                f"rel={self.max_rel:.3g}")


@dataclass
class Kink:
    """A difference confined to elements at an exact non-differentiable point, and each side's convention.

    Attributes:
        index: The step's number, as ``Divergence.index``.
        eqn: The step's text.
        elements: How many input elements' gradients differ.
        jax: What JAX's rule gives there (e.g. ``"d/dx = 0"``).
        tape: What the tape (the primal body) gives there.
        detail: The kink the replay saw (ties, zeros).
        where: Inside loops and branches, the path to the step; empty at the top level.
    """
    index: int
    eqn: str
    elements: int      # input elements whose gradient differs
    jax: str           # what JAX's rule gives there
    tape: str          # what the tape (the primal body) gives there
    detail: str = ""   # the kink the replay saw (ties, zeros)
    where: str = ""

    def __str__(self):
        at = f" in {self.where}" if self.where else ""
        return (f"equation {self.index}{at}: {self.eqn}: gradients differ at {self.elements} element(s), all at "
                f"a kink ({self.detail}); JAX gives {self.jax}, the tape gives {self.tape}")


@dataclass
class Precision:
    """The first step on a differentiable path computed below float64, and the bound it implies.

    Attributes:
        dtype: The lower precision (e.g. ``"float32"``).
        eqn: The step's text.
        index: The step's number, as ``Divergence.index``.
        bound: The bound it implies: √eps of ``dtype`` (at least ``rtol``).
    """
    dtype: str
    eqn: str
    index: int
    bound: float

    def __str__(self):
        return (f"computes in {self.dtype} from equation {self.index} ({self.eqn}): compared at "
                f"√eps({self.dtype}) = {self.bound:.2g}")


@dataclass
class GradReport:
    """The result of ``check_grads``: tapegrad's gradients next to ``jax.grad``'s.

    ``str(report)`` is the readable report: a line per differentiated leaf (a leaf whose gradient is
    zero up to rounding on both sides reads ``both ≈ 0: rounding noise``), then the precision,
    branches, kinks, first divergence and notes.

    Attributes:
        ok: Whether the values and gradients agree within ``bound``, or every difference is a kink.
        grads: Tapegrad's gradients, in ``jax.grad``'s form for ``argnums`` (a tuple over all
            arguments when it is None; non-float leaves are None).
        jax_grads: ``jax.grad``'s gradients, in the same form.
        value: Tapegrad's value of ``f``.
        jax_value: JAX's value of ``f``.
        max_abs: The largest absolute difference of each differentiated leaf's gradient, one entry
            per leaf named in ``leaves``.
        max_rel: That difference relative to the leaf's largest ``|jax.grad|``, per leaf.
        rtol: The ``rtol`` asked for.
        first_divergence: Where the two sides first part, located after a mismatch (else None).
        n_eqns: How many equations were replayed.
        notes: What the reader should know about how the check ran (arguments upgraded to float64,
            static leaves, a concrete trace, a custom rule to trust).
        verdict: "agree", "kink", "mismatch", or "nonfinite" (the value or a gradient is NaN or inf
            in JAX as on the tape: nothing could be checked, so ``ok`` is False).
        bound: The bound the difference is held to: ``rtol``, or the lower precision's √eps.
        error: The gradients' difference held to ``bound``: the largest, over the leaves, of the
            smaller of ``max_rel`` and ``max_abs`` over ``scale``.
        precision: The first step on a differentiable path computed below float64 (else None).
        kinks: The differences confined to kinks, each a ``Kink``.
        leaves: The differentiated leaves' names (e.g. ``"arg 0['w']"``).
        aux: JAX's ``aux`` output of ``f`` with ``has_aux`` (else None).
        jax_max: The largest ``|jax.grad|`` of each leaf.
        scale: The largest ``|jax.grad|`` over the whole gradient.
        mode: The precision as run: "float64" (leaves upgraded) or "as_given".
        checked: The precision compared at: "float64", or the lower one whose √eps is ``bound``.
        branches: Under a concrete trace, each site of ``f``'s code that read a traced value, and
            what it read.
        concrete: Whether ``f`` was traced with its values readable (``concrete=True``, asked or
            chosen automatically).
    """
    ok: bool
    grads: Any
    jax_grads: Any
    value: float
    jax_value: float
    max_abs: tuple
    max_rel: tuple
    rtol: float
    first_divergence: Optional[Divergence] = None
    n_eqns: int = 0
    notes: list = field(default_factory=list)
    verdict: str = "agree"
    bound: float = 0.0
    error: float = 0.0   # the gradients' difference held to ``bound``: max over leaves of min(rel, |Δ|/max|whole|)
    precision: Optional[Precision] = None
    kinks: list = field(default_factory=list)
    leaves: tuple = ()
    aux: Any = None
    jax_max: tuple = ()  # max |jax.grad| per leaf
    scale: float = 0.0   # max |jax.grad| over the whole gradient
    mode: str = "float64"     # check_grads' precision as run: "float64" (leaves upgraded) or "as_given"
    checked: str = "float64"  # the precision compared at: "float64", or the lower one whose √eps is ``bound``
    branches: tuple = ()      # concrete=True: each site of f's code that read a traced value, and what it read
    concrete: bool = False    # f was traced with its values readable (concrete=True, asked or chosen automatically)

    def _noise(self, a, m):
        """A leaf whose gradient is zero on both sides up to rounding: both sides, and their difference,
        at most ``bound`` times the whole gradient's scale (a relative error there means nothing)."""
        return m is not None and self.scale > 0 and max(a, m) <= self.bound * self.scale

    def __str__(self):
        word = {"agree": "ok", "kink": "ok (differences only at kinks)", "mismatch": "MISMATCH",
                "nonfinite": "NOT CHECKED (not finite on either side)"}[self.verdict]
        head = (f"check_grads: {word} (gradient error {self.error:.2g}, bound {self.bound:.2g}; {self.n_eqns} "
                f"equations replayed; value {self.value:.17g} vs jax {self.jax_value:.17g})")
        rows = [f"  {n}: max|Δ|={a:.3g} " + (f"both ≈ 0: rounding noise (max|jax.grad| {m:.2g}, "
                                              f"{m / self.scale:.2g} of the largest gradient)" if self._noise(a, m)
                                              else f"rel={r:.3g}")
                for n, a, r, m in zip(self.leaves, self.max_abs, self.max_rel, self.jax_max or [None] * len(self.leaves))]
        if self.mode == "as_given":
            rows.append(f"  precision: checked as given, in {self.checked} (jax.grad at the arguments' own "
                        f"precision), at √eps({self.checked}) = {self.bound:.2g}")
        if self.precision and not (self.mode == "as_given" and self.precision.dtype == self.checked):
            rows.append(f"  precision: {self.precision}")
        rows += [f"  branch: {b}" for b in self.branches]
        rows += [f"  kink: {k}" for k in self.kinks]
        if self.first_divergence:
            rows.append(f"  first divergence: {self.first_divergence}")
        rows += [f"  note: {n}" for n in self.notes]
        return "\n".join([head, *rows])


# ── preparing f: trace once per (f, argument types), compile JAX's side once ───────────────────

_PREP = {}
FULL_EVALUATIONS = [0]   # how often JAX's value of every step was needed (only to locate a divergence)


def clear_caches():
    """Forget every cached trace and compiled JAX side (the next check of each function is cold)."""
    _PREP.clear()
    _VJP.clear()
    _AUTO.clear()


class _Prepared:
    pass


_AUTO = {}   # id(f) -> f: functions whose jax.jit-style trace failed on a Python branch (traced concretely since)


def _leaf(x, upgrade=True):
    if isinstance(x, jax.Array) and is_key(jax.typeof(x)):
        return x
    a = np.asarray(x) if not isinstance(x, jax.Array) else x
    if upgrade and kind(a.dtype) == "f":   # float16 and bfloat16 too: checked in float64, as float32 is
        return jnp.asarray(a, jnp.float64)
    return jnp.asarray(a)


PRECISIONS = ("float64", "as_given")


def _leaves(all_p, pos, given):
    """The array leaves as check_grads runs them: float ones upgraded to float64 (x64 on), or as
    ``jax.grad`` would see them in the caller's configuration (``given``: that x64 setting)."""
    if given is None:
        return [_leaf(all_p[i][1]) for i in pos]
    with jax.enable_x64(given):
        return [_leaf(all_p[i][1], upgrade=False) for i in pos]


def _is_array(x):
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _prepare(f, args, argnums, has_aux, trust=frozenset(), precision="float64", x64=True, concrete=False):
    """Trace ``f`` (cached per function and argument types) and compile JAX's side: (prepared, leaves).

    ``precision="float64"`` upgrades float leaves (traced with x64 on); "as_given" keeps them and traces
    in the caller's x64 setting ``x64``, as the caller's own ``jax.grad`` runs f. ``concrete``: trace with
    the arguments' values readable by Python, as ``jax.grad`` runs f (``_Reads``); the cache is then per
    value of everything read.
    """
    all_p, tree = jax.tree_util.tree_flatten_with_path(args)
    # non-array leaves (an equinox module's activation functions, strings, None-like markers) are static,
    # as eqx.filter_grad treats them: closed over in the trace, their gradient None
    pos = [i for i, (_, x) in enumerate(all_p) if _is_array(x)]
    static = {i: x for i, (_, x) in enumerate(all_p) if not _is_array(x)}
    leaves_p = [all_p[i] for i in pos]
    given = None if precision == "float64" else bool(x64)
    leaves = _leaves(all_p, pos, given)
    key = (id(f), tree, tuple((tuple(jax.typeof(x).shape), str(jax.typeof(x).dtype)) for x in leaves), argnums,
           has_aux, trust, tuple((i, id(x)) for i, x in static.items()), given)
    hit = _PREP.get(key)
    if not concrete and hit is not None and hit.f is f and all(hit.static[i] is x for i, x in static.items()):
        return hit, (leaves if hit.given == given else _leaves(all_p, pos, hit.given))
    p = _Prepared()
    p.f, p.tree, p.pos, p.static, p.n_all = f, tree, pos, static, len(all_p)
    p.given, p.fallback, p.reads = given, None, None
    p.static_names = [f"arg {all_p[i][0][0].idx}{jax.tree_util.keystr(all_p[i][0][1:])}" for i in static]
    nargs = len(args)
    which = tuple(range(nargs)) if argnums is None else ((argnums,) if isinstance(argnums, int) else tuple(argnums))
    for a in which:
        if not -nargs <= a < nargs:
            raise CheckGradsError(f"check_grads: argnums {argnums!r} is out of range for {nargs} positional "
                                  f"arguments")
    which = tuple(a % nargs for a in which)
    p.argnums, p.which = argnums, which
    p.arg_of = [path[0].idx for path, _ in leaves_p]
    p.names = [f"arg {path[0].idx}{jax.tree_util.keystr(path[1:])}" for path, _ in leaves_p]
    for i, x in enumerate(leaves):
        if p.arg_of[i] in which and _is_complex(jax.typeof(x)):
            raise CheckGradsError(f"check_grads: {p.names[i]} is complex ({_typ(jax.typeof(x))}); {_NO_COMPLEX}")
    p.diff = [i for i, x in enumerate(leaves) if p.arg_of[i] in which and not is_key(jax.typeof(x))
              and is_float(jax.typeof(x))]
    if not p.diff:
        raise CheckGradsError(f"check_grads: no float leaf to differentiate in arguments {which} (integer, boolean "
                         f"and key leaves are data, never differentiated)")
    reads = [None]

    def flat(*xs):
        if reads[0] is not None:
            reads[0].start(xs)
        full = [None] * len(all_p)
        for i, x in zip(pos, xs):
            full[i] = x
        for i, x in static.items():
            full[i] = x
        return f(*jax.tree.unflatten(tree, full))

    def trace(ls, x64_on):
        reads[0] = _Reads(ls) if concrete else None
        with jax.enable_x64(x64_on), (reads[0] if concrete else contextlib.nullcontext()):
            return jax.make_jaxpr(flat, return_shape=True)(*ls)
    try:
        try:
            closed, out_shape = trace(leaves, True if given is None else given)
        except jax.errors.ConcretizationTypeError:
            raise
        except TypeError as e:
            # A float64 retrace can conflict with float32 values f makes itself (flax's initialize_carry,
            # a float32 zeros carry): a scan/while/cond whose carry or branches change type. f as given
            # traces, so check it as given, saying why (never silently).
            if given is not None:
                raise
            as_given = _leaves(all_p, pos, bool(x64))
            lowered = sorted({str(jax.typeof(x).dtype) for i, x in enumerate(as_given)
                              if i in p.diff and str(jax.typeof(x).dtype) != "float64"})
            if not lowered:
                raise
            try:
                closed, out_shape = trace(as_given, bool(x64))
            except Exception:
                raise e from None
            leaves, p.given = as_given, bool(x64)
            said = " ".join([ln.strip(" *;") for ln in str(e).splitlines() if ln.strip()][:2])[:400]
            p.fallback = (f"f does not trace with its float leaves upgraded to float64 (JAX said: {said}): it makes "
                          f"{'/'.join(lowered)} values of its own (a carry, as flax's initialize_carry makes one) that "
                          f"the upgrade conflicts with, so it was checked at the arguments' own precision, "
                          f"{'/'.join(lowered)}, as precision='as_given' checks it")
    except jax.errors.ConcretizationTypeError as e:
        if concrete:
            raise TracingError(
                ("check_grads(concrete=True) runs" if concrete is True else
                 "f branches in Python on a traced value, so check_grads ran it as concrete=True runs it, after the "
                 "jax.jit-style trace failed:") + " f with its arguments' values readable, as jax.grad does, but f "
                "needs a value that is abstract even there: float() of a traced value (jax.grad refuses it too: "
                "use it as an array), or a Python branch inside a jax.jit, lax.cond/scan/while body or custom_jvp/"
                "custom_vjp function, traced without values under jax.grad as well (use lax.cond / jnp.where "
                f"there). JAX said: {str(e).splitlines()[0]}") from e
        raise TracingError(
            "check_grads traces f the way jax.jit does, so Python control flow (if/while/bool()/int()) on a "
            "value computed from the arguments cannot run: use jnp.where or lax.select for values, lax.cond / "
            "lax.switch for branches, lax.fori_loop / lax.while_loop / lax.scan for loops, or close over a "
            "Python value that should stay static (check_grads(lambda x: f(x, flag), x)); or leave concrete unset "
            "(or pass concrete=True) to check f as jax.grad runs it, Python branches taken at these argument values. "
            "JAX said: "
            f"{str(e).splitlines()[0]}") from e
    closed = _shared_bodies(closed)
    if concrete:
        p.reads = reads[0]
        key = key + (reads[0].digest(),)
        hit = _PREP.get(key)
        if hit is not None and hit.f is f and all(hit.static[i] is x for i, x in static.items()):
            return hit, leaves
    outs = jax.tree.leaves(out_shape)
    if has_aux:
        if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
            raise CheckGradsError("check_grads: has_aux=True needs f to return a pair (value, aux)")
        value_shape = out_shape[0]
    else:
        value_shape = out_shape
    if not hasattr(value_shape, "shape") or value_shape.shape != () or kind(value_shape.dtype) != "f":
        got = [f"{o.dtype}{list(o.shape)}" for o in outs] if not has_aux else [str(value_shape)]
        raise CheckGradsError(f"check_grads: f must return one scalar (a real float, as jax.grad needs), got {got}"
                              + (f"; {_NO_COMPLEX}" if _is_complex(value_shape) else
                                 "" if has_aux else "; pass has_aux=True if f returns (value, aux)"))
    if trust:
        names = _custom_names(closed.jaxpr)
        unknown = sorted(t for t in trust if t not in names and t not in {n.lstrip("_") for n in names})
        if unknown:
            raise CheckGradsError(f"check_grads: trust names {unknown}, but f has no custom_vjp/custom_jvp rule of "
                                  f"that name (its custom rules: {sorted(names) or 'none'})")
    p.closed, p.plan = closed, Plan(closed)
    p.aux_tree = jax.tree.structure(out_shape[1]) if has_aux else None
    fun = jax.extend.core.jaxpr_as_fun(closed)
    diff_idx = p.diff

    keep = p.plan.needed([p.plan.in_slots[i] for i in diff_idx])
    _refuse_complex(p)

    def jax_side(consts, xs):
        vals, aux = p.plan.evaluate(consts, xs, keep)

        def loss(*d):
            ls = list(xs)
            for i, v in zip(diff_idx, d):
                ls[i] = v
            o = fun(*ls)
            return (o[0], o[1:]) if has_aux else o[0]
        (v, aux_out), g = jax.value_and_grad(lambda *d: (loss(*d) if has_aux else (loss(*d), ())),
                                             argnums=tuple(range(len(diff_idx))), has_aux=True)(
            *[xs[i] for i in diff_idx])
        return vals, aux, v, g, aux_out
    p.jax_side = compiled(jax_side)
    if len(_PREP) > 128:
        _PREP.clear()
    _PREP[key] = p
    return p, leaves


# ── one object per distinct loop body ──────────────────────────────────────────────────────────

_LOOPS = frozenset({"scan", "while", "cond"})


def _shared_bodies(closed):
    """``closed`` with identical loop and branch bodies made one object (an optimizer step calling
    ``tx.update`` twice traces muon's Newton–Schulz ``scan`` twice, two equal jaxprs): the replay keys
    a body's plan and its compiled per-iteration values by the body object, so each distinct body is
    then compiled once. Bodies are equal when their text and their constants (by identity) are."""
    seen, memo = {}, {}

    def walk_jaxpr(jx):
        hit = memo.get(id(jx))
        if hit is not None:
            return hit[1]
        eqns, changed = [], False
        for e in jx.eqns:
            loop = e.primitive.name in _LOOPS
            new = {}
            for k, v in e.params.items():
                nv = walk(v, loop)
                if nv is not v:
                    new[k] = nv
            if new:
                e = e.replace(params={**e.params, **new})
                changed = True
            eqns.append(e)
        out = jx.replace(eqns=eqns) if changed else jx
        memo[id(jx)] = (jx, out)
        return out

    def walk(v, loop):
        if isinstance(v, tuple):
            items = tuple(walk(x, loop) for x in v)
            return items if any(a is not b for a, b in zip(items, v)) else v
        if isinstance(v, _core.ClosedJaxpr):
            inner = walk_jaxpr(v.jaxpr)
            w = v if inner is v.jaxpr else v.replace(jaxpr=inner)
            key = (1, str(w.jaxpr), tuple(id(c) for c in w.consts))
        elif isinstance(v, _core.Jaxpr):
            w = walk_jaxpr(v)
            key = (0, str(w), ())
        else:
            return v
        return seen.setdefault(key, w) if loop else w

    return walk(closed, False)


# ── concrete=True: the trace with the arguments' values readable, as jax.grad runs f ─────────────

_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
_HERE = os.path.abspath(__file__)
_CONVERSIONS = {"__bool__": "bool", "__int__": "int", "__index__": "index", "concrete_or_error": "value",
                "concrete_dim_or_error": "int", "_item": "item"}
_READS_LOCK = threading.Lock()


class _Reads:
    """While ``make_jaxpr`` traces f: a tracer of its top-level trace answers "what is your value?" with
    the value it has at the arguments (its equation's inputs evaluated eagerly, each equation once), as
    ``jax.grad``'s JVP tracers answer with their primal. So every Python ``if``/``while``/``int()``/
    ``.item()`` on a traced value runs as under ``jax.grad`` at these values and the jaxpr is the path
    that ran. Values inside ``jax.jit``, loop/branch bodies and custom rules stay abstract, as they are
    under ``jax.grad``; ``float()`` of a traced value raises, as it does there.

    Reads through JAX's tracer classes' ``to_concrete_value`` (the one hook ``bool``/``int``/
    ``operator.index``/``concrete_or_error`` share), patched for the trace only, in this thread only.
    """

    def __init__(self, leaves):
        self.leaves, self.frame, self.env = leaves, None, {}
        self.answers = []    # every value given, in order (the cache key: another value, another trace)
        self.seen = []       # (file, line, conversion, Python value) of each read by f's own code

    def start(self, xs):
        from jax._src.interpreters import partial_eval as pe
        tracers = [x for x in xs if isinstance(x, pe.DynamicJaxprTracer)]
        self.frame = tracers[0]._trace.frame if tracers else None
        for x, v in zip(xs, self.leaves):
            if isinstance(x, pe.DynamicJaxprTracer):
                self.env[x.val] = v

    def __enter__(self):
        from jax._src.interpreters import partial_eval as pe
        _READS_LOCK.acquire()
        cls, me, owner = pe.DynamicJaxprTracer, self, threading.get_ident()
        self._cls, self._had = cls, "to_concrete_value" in cls.__dict__
        self._saved = cls.__dict__.get("to_concrete_value")
        base = self._saved or super(cls, cls).to_concrete_value

        def to_concrete_value(t):
            if threading.get_ident() == owner and me.frame is not None and t._trace.frame is me.frame:
                v = me.value(t)
                if v is not None:
                    return v
            return base(t)
        cls.to_concrete_value = to_concrete_value
        return self

    def __exit__(self, *exc):
        try:
            if self._had:
                self._cls.to_concrete_value = self._saved
            else:
                del self._cls.to_concrete_value
        finally:
            _READS_LOCK.release()

    def _known(self, u):
        a = u.val
        if isinstance(a, Literal):
            return True, a.val
        if a in self.env:
            return True, self.env[a]
        if a in self.frame.constvar_to_val:
            return True, self.frame.constvar_to_val[a]
        return False, None

    def value(self, t):
        try:
            stack = [t]
            while stack:
                u = stack[-1]
                if self._known(u)[0]:
                    stack.pop()
                    continue
                eqn = getattr(u, "parent", None)
                if eqn is None:
                    return None      # an input of an inner trace: abstract, as under jax.grad
                pending = [w for w in eqn.in_tracers if not self._known(w)[0]]
                if pending:
                    stack.extend(pending)
                    continue
                with jax.ensure_compile_time_eval():
                    outs = bind(eqn, [self._known(w)[1] for w in eqn.in_tracers])
                self.env.update(zip(eqn.outvars, outs))
                stack.pop()
            v = self._known(t)[1]
        except Exception:   # noqa: BLE001 — a value JAX cannot compute here stays abstract (the trace says why)
            return None
        self.answers.append(v)
        self._note(v)
        return v

    def _note(self, v):
        """Remember the read when it is a conversion by f's own code (not JAX asking itself)."""
        fr, how = sys._getframe(2), None
        while fr is not None and (fr.f_code.co_filename.startswith(_JAX_DIR) or fr.f_code.co_filename == _HERE):
            if how is None and fr.f_code.co_name == "is_concrete":
                return    # bool()/int()/index() ask is_concrete first, then read: one conversion, noted then
            how = how or _CONVERSIONS.get(fr.f_code.co_name)
            fr = fr.f_back
        if how is None or fr is None:
            return
        a = np.asarray(v)
        shown = (bool(a) if how == "bool" else int(a) if how in ("int", "index") else a.item()) if a.size == 1 \
            else f"{a.dtype}{list(a.shape)}"
        self.seen.append((fr.f_code.co_filename, fr.f_lineno, how, shown))

    def digest(self):
        h = hashlib.sha1()
        for v in self.answers:
            a = np.asarray(v)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def branches(self):
        """One line per site of f's code that read a value: where, its text, what it read (runs counted)."""
        order, by = [], {}
        for file, line, how, shown in self.seen:
            k = (file, line)
            if k not in by:
                order.append(k)
                by[k] = []
            by[k].append((how, shown))
        out = []
        for file, line in order:
            runs = []
            for how, shown in by[(file, line)]:
                if runs and runs[-1][0] == (how, shown):
                    runs[-1][1] += 1
                else:
                    runs.append([(how, shown), 1])
            text = linecache.getline(file, line).strip()
            vals = ", ".join(f"{s!r}" + (f" ×{n}" if n > 1 else "") for (how, s), n in runs)
            kind = "/".join(dict.fromkeys(how for (how, _), _ in runs))
            out.append(f"{_short(file)}:{line} {kind} → {vals}" + (f"  ({text[:80]})" if text else ""))
        return out


def _short(file):
    parts = file.replace(os.sep, "/").split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    return "/".join(parts[-3:])


_NO_COMPLEX = ("complex numbers are not supported (the tape holds real float32/float64 values): pass real and "
               "imaginary parts as separate real arrays")


def _is_complex(aval):
    return hasattr(aval, "dtype") and not is_key(aval) and np.dtype(aval.dtype).kind == "c"


def _typ(aval):
    return f"{aval.dtype}{list(aval.shape)}"


def _refuse_complex(p):
    """CheckGradsError for complex values on the differentiable path (the replay would cast them to real):
    naming the argument when one is complex, else the first equation that computes in complex. Left to
    the unsupported-primitive error when a step has no rule (it names them all, after the replay)."""
    steps = list(_replayed(p.plan, [p.plan.in_slots[i] for i in p.diff]))
    # a step making complex values (jax >= 0.12.1's `complex` promoting a real operand) is itself the refusal
    if any(st.eqn.primitive.name not in CONTROL_RULES and (st.eqn.primitive.name not in RULES
                                                          or missing(st.eqn.primitive.name))
           and not any(_is_complex(v.aval) for v in st.eqn.outvars) for _, st, _ in steps):
        return
    first = next(((k, st, v) for k, st, _ in steps
                  for v in list(st.eqn.invars) + list(st.eqn.outvars) if _is_complex(v.aval)), None)
    if first is None:
        return
    # a complex argument meets the path where a value made from it first enters a replayed step: directly
    # (jax 0.10's `mul w z`), or through its parts (0.12.1 splits it: `real z`, `mul w c`, ..., `complex`)
    leaf_of = {s: i for i, s in enumerate(p.plan.in_slots)}
    origin, aval = {}, {}
    for st in p.plan.steps:
        for v, s in zip(st.eqn.invars, st.ins):
            if isinstance(s, int) and s in leaf_of and _is_complex(v.aval):
                origin.setdefault(s, s)
                aval.setdefault(s, v.aval)
        src = next((origin[s] for s in st.ins if isinstance(s, int) and s in origin), None)
        for s in st.outs if src is not None else ():
            origin.setdefault(s, src)
    for k, st, top in steps:
        src = next((origin[s] for s in st.ins if top and isinstance(s, int) and s in origin), None)
        if src is not None:
            raise CheckGradsError(f"check_grads: {p.names[leaf_of[src]]} ({_typ(aval[src])}) meets the "
                                  f"differentiated arguments at equation {k} ({summary(st.eqn)}): {_NO_COMPLEX}")
    k, st, v = first
    raise CheckGradsError(f"check_grads: equation {k} ({summary(st.eqn)}) computes in {v.aval.dtype} on values "
                          f"that depend on the differentiated arguments; {_NO_COMPLEX}")


def _custom_names(jx):
    """The names of every custom_vjp/custom_jvp call in a jaxpr, nested ones included."""
    names = set()
    for eqn in jx.eqns:
        if eqn.primitive.name in CUSTOM_CALLS:
            names.add(custom_name(eqn))
        for val in eqn.params.values():
            for j in (val if isinstance(val, tuple) else (val,)):
                if hasattr(j, "eqns") or hasattr(j, "jaxpr"):
                    names |= _custom_names(getattr(j, "jaxpr", j))
    return names


def _replayed(plan, tainted, top=None):
    """(step index, step, whether at the top level) of each step of ``plan`` that depends on the slots
    ``tainted`` and would be replayed, taint passing through float and complex results (``Plan.needed``
    stops at complex ones). Loop and branch bodies are looked into, every float body input counted as
    tainted (iterations mix carries), their steps indexed by the step ``top`` holding them."""
    tainted = set(tainted)
    for k, st in enumerate(plan.steps):
        name = st.eqn.primitive.name
        if (not any(isinstance(s, int) and s in tainted for s in st.ins) or name in CONSTANT
                or all(is_data(v.aval) for v in st.eqn.outvars)):
            continue
        tainted.update(s for s, v in zip(st.outs, st.eqn.outvars) if is_float(v.aval) or _is_complex(v.aval))
        at = k if top is None else top
        yield at, st, top is None
        for val in st.eqn.params.values() if name in CONTROL_RULES else ():
            for j in (val if isinstance(val, tuple) else (val,)):
                if hasattr(j, "eqns") or hasattr(j, "jaxpr"):
                    sub = Plan.of(j)
                    yield from _replayed(sub, [sl for sl, a in zip(sub.in_slots, sub.in_avals) if is_float(a)], at)


# ── check_grads ──────────────────────────────────────────────────────────────

def check_grads(f: Callable[..., Any], *args: Any, argnums: Union[None, int, Sequence[int]] = None,
                has_aux: bool = False, rtol: float = 1e-12, seed: int = 0, trust: Sequence[str] = (),
                precision: str = "float64", concrete: Optional[bool] = None) -> GradReport:
    """Check ``jax.grad(f, argnums, has_aux)`` against tapegrad's reverse sweep of ``f``'s jaxpr.

    ``f`` is a scalar-valued JAX function (``jax.numpy``, ``lax``, ``jax.nn``, control flow,
    ``custom_vjp``…). By default float leaves are checked in float64 (inside a scoped x64 context),
    where both sides are exact reverse sweeps. float16 and bfloat16 are floats as float32 is: such
    arguments are checked in float64 (a note says so) and a step computing in them is compared at that
    precision's bound. A leaf whose gradient is zero up to rounding on both sides is reported as
    ``both ≈ 0: rounding noise``. Like ``jax.jit``, the trace and JAX's compiled side are cached per
    function and argument types. Where ``jax.grad`` itself cannot differentiate ``f``, JAX's error is
    raised again, saying there is nothing to check against.

    A ``custom_vjp``/``custom_jvp`` call is replayed by its primal body, so its rule is checked against
    the body's derivative: that is the oracle's job. ``interop.value_and_grad``, ``train_step`` and
    ``capture_jax``, which stand in for ``jax.grad``, follow the rule instead. A ``while`` with a
    batched predicate (``vmap`` of a per-example stopping rule) runs while any lane is active,
    finished lanes frozen, as JAX runs it.

    Args:
        f: The function: it returns one real float scalar (with ``has_aux``: ``(value, aux)``).
        *args: Its arguments, arrays or pytrees. Integer, boolean and key leaves are data, never
            differentiated or cast; non-array leaves (an equinox module's functions) are static, as
            ``eqx.filter_grad`` treats them.
        argnums: The differentiated arguments, as in ``jax.grad``; None (the default) differentiates
            every argument.
        has_aux: ``f`` returns ``(value, aux)``; the report's ``aux`` is JAX's ``aux``.
        rtol: The bound on the difference, normwise per leaf: ``max|Δ| <= rtol·max|jax.grad|`` (or
            over the whole gradient, for a leaf whose gradient is at rounding level next to the
            others); the values are held to it too.
        seed: Seeds the random cotangents (and the nudges off kinks) that locate a divergence.
        trust: Names of ``custom_vjp``/``custom_jvp`` rules (as JAX records them, leading underscores
            optional; one name or several) to replay as JAX gives them instead of checking them
            against their primal body, for rules meant to differ (gradient scaling or reversal,
            straight-through estimators). A custom rule that differs is otherwise located by name
            (``first_divergence.rule``).
        precision: "float64" (the default) upgrades float leaves to float64, so both sides are exact
            reverse sweeps held to ``rtol``. "as_given" keeps float32/bfloat16/float16 leaves and
            traces ``f`` in the caller's x64 setting: what is compared is the caller's own
            ``jax.grad`` at that precision, held to its bound √eps (float32: 3.5e-4, the bound the
            replay states for any lower-precision step); ``report.mode`` and ``report.checked`` say
            which. When ``f`` does not trace upgraded (it makes float32 values of its own, e.g.
            flax's ``initialize_carry``, and a scan carry changes type), it is checked as given and a
            note says why.
        concrete: True: ``f`` may branch in Python on traced values (``if x > 0``, a ``while`` until
            converged, optax's ``warmup_cosine_decay_schedule``), as ``jax.grad`` allows: it is
            traced with its values readable, each Python branch taking the way it takes under
            ``jax.grad`` at these arguments, and that path is checked, at these values only
            (``report.branches`` lists what ran). None (the default): ``f`` is traced as ``jax.jit``
            traces it, and if that fails on a Python branch (or ``int()``, an index) of a traced
            value, as ``concrete=True`` traces it; ``report.concrete`` and a note say so. False:
            such an ``f`` is refused.

    Returns:
        A ``GradReport``: whether the two sides agree, both sides' values and gradients, and where
        they first part.

    Raises:
        CheckGradsError: If ``f`` or its arguments cannot be checked at all: ``argnums`` out of
            range, nothing float to differentiate, complex numbers on the differentiable path, an
            output that is not one real scalar (with ``has_aux``: not a pair), a ``trust`` name of no
            custom rule of ``f``, or a ``precision`` or ``concrete`` that is none of its values.
        UnsupportedPrimitiveError: If the tape cannot replay primitives applied to values that
            depend on the differentiated arguments (the message names them all).
        TracingError: If ``f`` needs a traced value as a Python value: any Python branch on one with
            ``concrete=False``, else one that even ``jax.grad``'s trace cannot give (the message says
            what to use instead).

    Examples:
        >>> import jax, jax.numpy as jnp, interop
        >>> r = interop.check_grads(lambda w: jnp.tanh(w @ w).sum(), jnp.eye(3))
        >>> r.ok, r.grads[0].shape, r.max_rel[0] <= 1e-12
        (True, (3, 3), True)

        Integer labels are data; ``argnums=0`` differentiates the weights only:

        >>> def loss(w, x, labels):
        ...     logp = jax.nn.log_softmax(x @ w)
        ...     return -jnp.take_along_axis(logp, labels[:, None], 1).mean()
        >>> r = interop.check_grads(loss, jnp.ones((3, 2)), jnp.eye(3),
        ...                         jnp.array([0, 1, 1]), argnums=0)
        >>> r.ok, r.grads.shape
        (True, (3, 2))

        ``precision="as_given"`` checks the caller's own float32 ``jax.grad``:

        >>> w32 = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
        >>> r = interop.check_grads(lambda w: jnp.sum(jnp.tanh(w) ** 2), w32,
        ...                         precision="as_given")
        >>> r.ok, r.mode, r.checked, r.jax_grads[0].dtype, round(r.bound, 6)
        (True, 'as_given', 'float32', dtype('float32'), 0.000345)

        ``concrete=True`` checks a Python loop on traced values, as it ran:

        >>> def newton_sqrt(a):
        ...     x = a
        ...     while jnp.abs(x * x - a) > 1e-12 * a:
        ...         x = 0.5 * (x + a / x)
        ...     return x
        >>> r = interop.check_grads(newton_sqrt, jnp.asarray(2.0), concrete=True)
        >>> r.ok, round(float(r.grads[0]), 6), len(r.branches)
        (True, 0.353553, 1)
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise CheckGradsError(f"check_grads: precision must be 'float64' (float leaves upgraded to float64, the "
                              f"default) or 'as_given' (float32/bfloat16/float16 leaves kept: the caller's own "
                              f"jax.grad checked at that precision's bound), got {precision!r}")
    if concrete is not None and not isinstance(concrete, (bool, np.bool_)):
        raise CheckGradsError(f"check_grads: concrete must be None (automatic), True or False, got {concrete!r}")
    x64 = bool(jax.config.jax_enable_x64)   # the caller's setting: precision="as_given" traces f in it
    with jax.enable_x64(True), np.errstate(all="ignore"):   # non-finite values are reported, not warned
        trusted = frozenset((trust,) if isinstance(trust, str) else trust)
        saved, TRUST[0] = TRUST[0], trusted
        try:
            return _check(f, args, argnums, has_aux, rtol, seed, trusted, precision, x64,
                          None if concrete is None else bool(concrete))
        finally:
            TRUST[0] = saved


def assert_grads(f: Callable[..., Any], *args: Any, argnums: Union[None, int, Sequence[int]] = None,
                 has_aux: bool = False, rtol: float = 1e-12, seed: int = 0, trust: Sequence[str] = (),
                 allow_kinks: bool = True, precision: str = "float64", concrete: Optional[bool] = None) -> GradReport:
    """Run ``check_grads`` and raise ``GradientMismatchError`` (an ``AssertionError``) where it fails.

    The form of ``jax.test_util.check_grads``. Whatever ``check_grads`` raises passes through.

    Args:
        f: The function: it returns one real float scalar (with ``has_aux``: ``(value, aux)``).
        *args: Its arguments, as for ``check_grads``.
        argnums: The differentiated arguments, as in ``jax.grad`` (None: every argument).
        has_aux: ``f`` returns ``(value, aux)``.
        rtol: The bound on the difference, as for ``check_grads``.
        seed: Seeds the random cotangents that locate a divergence.
        trust: Names of custom rules to replay as JAX gives them, as for ``check_grads``.
        allow_kinks: Whether gradients that differ only at kinks (a relu at 0, tied maxima) pass.
        precision: "float64" or "as_given", as for ``check_grads``.
        concrete: Whether ``f`` is traced with its values readable, as for ``check_grads``.

    Returns:
        The ``GradReport``, when the gradients agree (or differ only at kinks, unless
        ``allow_kinks=False``).

    Raises:
        GradientMismatchError: If the report is not ok (a mismatch, or nothing finite to check), or
            it found kinks and ``allow_kinks`` is False; the message is the report.

    Examples:
        >>> import jax, jax.numpy as jnp, interop
        >>> x = jnp.linspace(0.0, 1.0, 4)
        >>> _ = interop.assert_grads(lambda x: jnp.sum(jnp.tanh(x) ** 2), x)

        A custom rule that is not its body's derivative fails:

        >>> @jax.custom_vjp
        ... def double(x):
        ...     return 2 * x
        >>> double.defvjp(lambda x: (2 * x, None), lambda _, g: (3 * g,))
        >>> try:
        ...     interop.assert_grads(lambda x: double(x).sum(), x)
        ... except interop.GradientMismatchError:
        ...     print("mismatch")
        mismatch
    """
    report = check_grads(f, *args, argnums=argnums, has_aux=has_aux, rtol=rtol, seed=seed, trust=trust,
                         precision=precision, concrete=concrete)
    if not report.ok or (report.verdict == "kink" and not allow_kinks):
        raise GradientMismatchError(str(report))
    return report


def _traced(f, args, argnums, has_aux, trust, precision, x64, concrete):
    """``(prepared, leaves, automatic)``: ``_prepare`` as ``concrete`` asks; unset, the jax.jit-style trace
    first and, where it fails on a traced value Python needed (``if``, ``int()``), the concrete one
    (``automatic``: JAX's words about the first failure; the function is traced concretely from then on)."""
    if concrete is None and _AUTO.get(id(f)) is not f:
        try:
            return (*_prepare(f, args, argnums, has_aux, trust, precision, x64, False), None)
        except TracingError as e:
            if not isinstance(e.__cause__, jax.errors.ConcretizationTypeError):
                raise
            said = str(e.__cause__).splitlines()[0]
        _AUTO[id(f)] = f
    elif concrete is None:
        said = "as on an earlier call"
    p, leaves = _prepare(f, args, argnums, has_aux, trust, precision, x64, True if concrete else
                         (False if concrete is False else "auto"))
    return p, leaves, (said if concrete is None else None)


def _check(f, args, argnums, has_aux, rtol, seed, trust, precision="float64", x64=True, concrete=None):
    p, leaves, auto = _traced(f, args, argnums, has_aux, trust, precision, x64, concrete)
    try:
        vals, aux, jvalue, jgrads, jaux = p.jax_side(p.plan.const_vals, leaves)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise type(e)(f"check_grads: jax.grad itself cannot differentiate f, so there is nothing to check "
                      f"against: {str(e).splitlines()[0]}") from e
    full = []

    def full_env():
        """JAX's value of every step (compiled only when a divergence must be located)."""
        if not full:
            FULL_EVALUATIONS[0] += 1
            full.append(p.plan.values(leaves))
        return full[0]

    r, out, params = _replay(p, leaves, JEnv(vals, aux, full_env), rtol, compare=False)
    if r.unsupported:
        raise UnsupportedPrimitiveError(_unsupported_message(r.unsupported))
    tape = r.tape
    if isinstance(out, tg.Var):
        tape.backward(out)
        grads = [np.array(tape.grad(params[i])) for i in p.diff]
        value = float(tape.value(out))
    else:
        grads, value = [np.zeros(np.shape(leaves[i])) for i in p.diff], float(jvalue)
    jgrads = [np.asarray(g) for g in jgrads]
    bound, precision = rtol, None
    if r.lowp is not None:
        dt, text, index, _ = r.lowp
        bound = lowp_bound(float(jnp.finfo(dt).eps), rtol)
        precision = Precision(str(dt), text, index, bound)
    checked = "float64"
    if p.given is not None:
        # as given: the differentiated leaves' own precision bounds the comparison (jax.grad computes in
        # it), the same √eps bound the replay states for a lower-precision step
        dts = [np.dtype(jax.typeof(leaves[i]).dtype) for i in p.diff] + ([np.dtype(r.lowp[0])] if r.lowp else [])
        worst = max(dts, key=lambda d: float(jnp.finfo(d).eps))
        bound = max(bound, lowp_bound(float(jnp.finfo(worst).eps), rtol))
        checked = str(worst)
    elif precision is not None:
        checked = precision.dtype
    diffs = [diff(g, jg) for g, jg in zip(grads, jgrads)]
    vdiff = diff(value, float(jvalue))
    # Normwise per leaf; a leaf whose gradient is at rounding level next to the others (a bias whose
    # terms cancel) is held to the bound normwise over the whole gradient instead.
    whole = max([float(np.abs(np.where(np.isfinite(g), g, 0.0)).max(initial=0.0)) for g in jgrads] + [0.0])
    error = max([min(rel, a / whole if whole else (0.0 if a == 0 else np.inf)) for a, rel in diffs] + [0.0])
    grads_ok = error <= bound
    value_ok = vdiff[1] <= bound
    report = GradReport(ok=grads_ok and value_ok, grads=_shape_like(p, leaves, grads),
                        jax_grads=_shape_like(p, leaves, jgrads), value=value, jax_value=float(jvalue),
                        max_abs=tuple(a for a, _ in diffs), max_rel=tuple(x for _, x in diffs), rtol=rtol,
                        n_eqns=r.index, bound=bound, error=error, precision=precision,
                        leaves=tuple(p.names[i] for i in p.diff), scale=whole,
                        jax_max=tuple(float(np.abs(np.where(np.isfinite(g), g, 0.0)).max(initial=0.0)) for g in jgrads),
                        aux=jax.tree.unflatten(p.aux_tree, list(jaux)) if has_aux else None,
                        mode="float64" if p.given is None else "as_given", checked=checked,
                        branches=tuple(p.reads.branches()) if p.reads is not None else (),
                        concrete=p.reads is not None)
    lowered = sorted({str(np.dtype(x.dtype)) for x in jax.tree.leaves(args)
                      if hasattr(x, "dtype") and kind(x.dtype) == "f" and np.dtype(x.dtype).itemsize < 8})
    if p.fallback:
        report.notes.append(p.fallback)
    elif lowered and p.given is None:
        report.notes.append(f"{'/'.join(lowered)} arguments were checked in float64")
    if auto is not None:
        report.notes.append(
            f"concrete, chosen automatically: f branches in Python on a traced value, which a jax.jit-style trace "
            f"cannot run (JAX said: {auto}), so f ran as jax.grad runs it, its Python control flow reading "
            f"{len(p.reads.seen)} traced value(s) (report.branches); the path that ran is what is checked, at these "
            f"argument values only (as jax.grad's gradient is); concrete=False refuses such an f instead")
    elif p.reads is not None:
        report.notes.append(
            f"concrete=True: f ran as jax.grad runs it, its Python control flow reading {len(p.reads.seen)} traced "
            f"value(s) at these arguments; the path that ran is what is checked, at these argument values only "
            f"(as jax.grad's gradient is)" + ("" if p.reads.seen else ": none was read"))
    if p.static:
        shown = ", ".join(f"{n} ({type(x).__name__})" for n, x in zip(p.static_names[:4], list(p.static.values())[:4]))
        more = f" and {len(p.static) - 4} more" if len(p.static) > 4 else ""
        report.notes.append(f"{len(p.static)} non-array leaves held static, their gradient None (as eqx.filter_grad "
                            f"does): {shown}{more}")
    finite = np.isfinite(value) and all(np.isfinite(g).all() for g in jgrads)
    if report.ok and not finite:   # NaN == NaN on both sides is no agreement: nothing could be checked
        report.ok, report.verdict = False, "nonfinite"
        report.notes.append("the value or a gradient is not finite at these arguments, in JAX as on the tape: "
                            "nothing can be checked here")
        return report
    if report.ok:
        return report
    report.verdict = "mismatch"
    env = full_env()
    located, _, _ = _replay(p, leaves, env, rtol, compare=True)
    if located.divergence is not None:
        index, text, where, a, rel = located.divergence
        report.first_divergence = Divergence(index, text, "value", a, rel, where)
        if not value_ok:
            return report
    if not value_ok and located.divergence is None:
        report.notes.append("the values differ although every step agrees with JAX's own evaluation of it: a "
                            "custom_jvp/custom_vjp rule returns another primal output than its body computes")
    failures = []
    _search(p.plan, env, p.plan.units, "", rtol, np.random.default_rng(seed), failures,
            (located.tainted, located.slots))
    kinks = [k for _, k in failures if isinstance(k, Kink)]
    if failures and value_ok and len(kinks) == len(failures):
        report.ok, report.verdict, report.kinks = True, "kink", kinks
        report.first_divergence = None
        return report
    report.kinks = kinks
    for d, k in failures:
        if not isinstance(k, Kink):
            report.first_divergence = report.first_divergence or d
            break
    d = report.first_divergence
    if d is not None and d.rule:
        rule = d.rule
        report.notes.append(f"the custom rule {rule} gives another gradient than the derivative of its primal body; "
                            f"if it is meant to (gradient scaling or reversal, a straight-through estimator), "
                            f"check_grads(..., trust=({rule.lstrip('_')!r},)) checks the rest of f with JAX's rule for it")
    return report


def _replay(p, leaves, jenv, rtol, compare):
    """Record ``f`` on a fresh tape: (the Replay, the loss Var or None, {leaf index: param Var})."""
    tape = tg.Tape(sources=False)
    params = {i: tape.param(np.asarray(leaves[i], np.float64)) for i in p.diff}   # bfloat16 as given too
    tenv = {p.plan.in_slots[i]: v for i, v in params.items()}
    r = Replay(tape, rtol, compare=compare)
    out = r.run(p.plan, tenv, jenv, top=True)[0]
    r.slots = set(tenv)    # the top-level slots that depend on the differentiated arguments
    return r, out, params


def _shape_like(p, leaves, grads):
    """Gradients in ``jax.grad``'s form for the argnums: per argument pytrees, None for non-float leaves."""
    full = [None] * p.n_all
    for i, g in zip(p.diff, grads):
        full[p.pos[i]] = g
    per_arg = jax.tree.unflatten(p.tree, full)
    if p.argnums is None:
        return tuple(per_arg)
    if isinstance(p.argnums, int):
        return per_arg[p.which[0]]
    return tuple(per_arg[a] for a in p.which)


def _unsupported_message(found):
    parts = []
    for name in sorted(found):
        why = found[name]
        if isinstance(why, list) and why:
            parts.append(f"{name} (needs tg.{', tg.'.join(why)}, which this tapegrad lacks)")
        elif isinstance(why, str):
            parts.append(f"{name} ({why})")
        else:
            parts.append(name)
    return (f"check_grads: cannot replay {sorted(found)} on a tape (applied to values that depend on the "
            f"differentiated arguments): {'; '.join(parts)}. Everything computed from constants, integers or keys "
            f"only is evaluated by JAX; interop.oracle.primitive_table() lists what replays")


# ── locating a divergence: local VJP checks, descending into calls, loops and branches ─────────

_VJP = {}


def _vjp_fn(eqn, fl, fo):
    key = (id(eqn), tuple(fl), tuple(fo))
    hit = _VJP.get(key)
    if hit is None or hit[0] is not eqn:
        def run(diff_vals, all_vals, cts):
            return jax.vjp(of_floats(eqn, all_vals, fl, fo), *diff_vals)[1](cts)
        if len(_VJP) > 2048:
            _VJP.clear()
        hit = _VJP[key] = (eqn, compiled(run))
    return hit[1]


def _local(plan, jenv, u, rtol, rng, ins=None, ct=None):
    """Tape backward of unit ``u`` vs ``jax.vjp`` of its equation at JAX's inputs; None when they agree.

    Returns ``(max_abs, max_rel, replay, grads by slot, jax grads by slot, inputs, cotangents)``.
    """
    eqn = u.eqn
    jin = [jenv.jax(s) for s in u.ins] if ins is None else ins
    fl = [i for i, (s, v) in enumerate(zip(u.ins, eqn.invars))
          if not isinstance(s, Literal) and is_float(v.aval)]
    fo = [j for j, v in enumerate(eqn.outvars) if is_float(v.aval)]
    if not fl or not fo:
        return None
    if ct is None:
        ct = [rng.standard_normal(tuple(eqn.outvars[j].aval.shape)) for j in fo]
    cts = [jnp.asarray(c, eqn.outvars[j].aval.dtype) for c, j in zip(ct, fo)]
    jg = _vjp_fn(eqn, fl, fo)([jin[i] for i in fl], list(jin), cts)
    tape = tg.Tape(sources=False)
    r = Replay(tape, rtol, compare=False)
    slots = []
    for i in fl:
        if u.ins[i] not in slots:
            slots.append(u.ins[i])
    first = {s: fl[[u.ins[i] for i in fl].index(s)] for s in slots}
    tenv = {s: tape.param(np.asarray(jin[first[s]], np.float64)) for s in slots}
    params = dict(tenv)
    if ins is None:
        r.run(plan, tenv, jenv, u.start, u.end)
    else:   # the equation alone at other inputs, JAX's intermediate values recomputed there
        _run_sub(r, eqn, u, tenv, jin)
    loss = None
    for c, j in zip(ct, fo):
        s = u.outs[j]
        o = None if isinstance(s, Literal) else tenv.get(s)
        if isinstance(o, tg.Var):
            term = (o * r.var(c)).sum() if o.ndim else o * r.var(c)
            loss = term if loss is None else loss + term
    tg_grads = {s: np.zeros(np.shape(jin[first[s]])) for s in slots}
    if loss is not None:
        tape.backward(loss)
        tg_grads = {s: np.array(tape.grad(params[s])) for s in slots}
    j_grads = {s: np.zeros(np.shape(jin[first[s]])) for s in slots}
    for i, g in zip(fl, jg):
        j_grads[u.ins[i]] = j_grads[u.ins[i]] + np.asarray(g, np.float64)
    # an operand below float64 (a float32 constant) makes JAX's own VJP of the step round at its precision
    eps = max([float(jnp.finfo(r.lowp[0]).eps) if r.lowp else 0.0] +
              [float(jnp.finfo(v.aval.dtype).eps) for v in eqn.invars if is_float(v.aval)])
    bound = lowp_bound(eps, rtol) if eps > 1e-15 else rtol
    whole = max(float(np.abs(np.where(np.isfinite(g), g, 0.0)).max(initial=0.0)) for g in j_grads.values())
    worst = (0.0, 0.0)
    for s in slots:
        a, rel = diff(tg_grads[s], j_grads[s])
        if rel > bound and a > bound * whole:   # the same whole-gradient floor as the global comparison
            worst = max(worst, (a, rel), key=lambda d: d[1])
    if worst == (0.0, 0.0):
        return None
    return worst + (r, tg_grads, j_grads, jin, ct)


def _sub_plan(eqn):
    """A one-equation plan (the call inlined) for evaluating ``eqn`` at other inputs."""
    key = ("sub", id(eqn))
    hit = _VJP.get(key)
    if hit is None or hit[0] is not eqn:
        seen, invars = set(), []
        for v in eqn.invars:
            if not isinstance(v, Literal) and v not in seen:
                seen.add(v)
                invars.append(v)
        jx = SimpleNamespace(constvars=[], invars=invars, outvars=list(eqn.outvars), eqns=[eqn])  # what Plan reads
        hit = _VJP[key] = (eqn, Plan(jx), invars)
    return hit[1], hit[2]


def _run_sub(r, eqn, u, tenv, jin):
    """Replay ``eqn`` alone at inputs ``jin`` (JAX's intermediate values recomputed there)."""
    plan, invars = _sub_plan(eqn)
    by_var = {}
    for v, s, x in zip(eqn.invars, u.ins, jin):
        if not isinstance(v, Literal):
            by_var[v] = (s, x)
    env_ins = [by_var[v][1] for v in invars]
    jenv = plan.values(env_ins)
    sub = {ps: tenv[by_var[v][0]] for ps, v in zip(plan.in_slots, invars) if by_var[v][0] in tenv}
    outs = r.run(plan, sub, jenv)
    for s, o in zip(u.outs, outs):
        if o is not None and not isinstance(s, Literal):
            tenv[s] = o



def _nudged(u, jin, rng):
    out = list(jin)
    for i, (s, v) in enumerate(zip(u.ins, u.eqn.invars)):
        if not isinstance(s, Literal) and is_float(v.aval):
            x = np.asarray(jin[i], np.float64)
            scale = 1e-7 * (float(np.abs(x).max()) + 1.0) if x.size else 0.0
            out[i] = jnp.asarray(x + scale * rng.uniform(0.5, 1.0, x.shape) * rng.choice([-1.0, 1.0], x.shape),
                                 v.aval.dtype)
    return out


def _classify(plan, jenv, u, res, index, where, rtol, rng):
    """A Kink when the difference sits at an exact kink and vanishes with the inputs nudged off it."""
    a, rel, r, tg_g, j_g, jin, ct = res
    if not r.kinks:
        return None
    try:
        again = _local(plan, jenv, u, rtol, rng, ins=_nudged(u, jin, rng))
    except Exception:   # noqa: BLE001 — a nudge that JAX cannot evaluate says nothing either way
        return None
    if again is not None:
        return None
    elements, jtxt, ttxt = 0, "", ""
    for s in tg_g:
        d = np.abs(tg_g[s] - j_g[s]) > rtol * max(1.0, float(np.abs(j_g[s]).max(initial=0.0)))
        elements += int(d.sum())
    fl = [i for i, (s, v) in enumerate(zip(u.ins, u.eqn.invars)) if not isinstance(s, Literal) and is_float(v.aval)]
    fo = [j for j, v in enumerate(u.eqn.outvars) if is_float(v.aval)]
    if len(fl) == 1 and len(fo) == 1 and tuple(u.eqn.outvars[fo[0]].aval.shape) == np.shape(jin[fl[0]]):
        ones = [np.ones(np.shape(ct[0]))]
        d1 = _local(plan, jenv, u, rtol, rng, ins=None, ct=ones)
        if d1 is not None:
            s = u.ins[fl[0]]
            m = np.abs(d1[3][s] - d1[4][s]) > 0
            jtxt = "d/dx = " + ", ".join(f"{v:g}" for v in np.unique(d1[4][s][m]))
            ttxt = "d/dx = " + ", ".join(f"{v:g}" for v in np.unique(d1[3][s][m]))
    if not jtxt:
        jtxt, ttxt = "one gradient", "another (non-elementwise rule)"
    detail = "; ".join(k[3] for k in r.kinks[:3])
    return Kink(index, summary(u.eqn), elements, jtxt, ttxt, detail, where)


def _search(plan, jenv, units, where, rtol, rng, out, tainted=None, top=None):
    """Append ``(Divergence, Kink or None)`` for every innermost unit whose local VJP differs.

    ``top``: the top-level step inside which this plan runs (None at the top level itself).
    """
    for u in units:
        if tainted is not None and not any(k in tainted[0] for k in range(u.start, u.end)) and not (
                u.start == u.end and any(isinstance(s, int) and s in tainted[1] for s in u.ins)):
            continue   # (a call whose body has no step of its own, an identity, is judged by its operands)
        try:
            res = _local(plan, jenv, u, rtol, rng)
        except ValueError:   # a while loop JAX cannot reverse-differentiate: judged by its iterations only
            if u.children:   # (or a call holding one: judged by its steps)
                _search(plan, jenv, u.children, where, rtol, rng, out, tainted, top)
            elif u.eqn.primitive.name == "while":
                _descend(u, jenv, where, rtol, rng, out, u.start if top is None else top)
            else:
                raise
            continue
        if res is None:
            continue
        index = u.start if top is None else top
        n0 = len(out)
        if u.children:
            _search(plan, jenv, u.children, where, rtol, rng, out, tainted, top)
        elif u.eqn.primitive.name in CONTROL:
            _descend(u, jenv, where, rtol, rng, out, index)
        if len(out) == n0:
            d = Divergence(index, summary(u.eqn), "vjp", res[0], res[1], where, custom_name(u.eqn) or "")
            out.append((d, _classify(plan, jenv, u, res, index, where, rtol, rng)))


def _descend(u, jenv, where, rtol, rng, out, index):
    """``_search`` every iteration of a loop unit ``u``, or the branch taken."""
    here = f"{where} › " if where else ""
    for label, body, env in loop_envs(u.eqn, [jenv.jax(s) for s in u.ins]):
        _search(body, env, body.units, f"{here}{u.eqn.primitive.name} (step {index}) › {label}", rtol, rng, out, None,
                index)
