"""A JAX function as a tapegrad program: ``capture_jax`` and the replay that records it (``_Capture``).

``fn``'s jaxpr is flattened into the oracle's ``Plan`` — each custom derivative rule replaced by its
expansion (``expand``), so the program differentiates as ``jax.grad`` does — and its differentiable steps,
those that depend on the float leaves of ``argnums`` (the parameters), are recorded on a tape by the
oracle's rules, then captured. Every other value a recorded step reads is one of three things:

- a **constant of the function** (it depends on no argument: a literal, an iota, a closed-over
  array): baked into the program;
- **computed by the program**: ``stop_gradient`` of a value on the tape, and comparisons and logical ops
  of such values, recorded as float masks (``tg.greater``…, ``tg.where`` by a float mask);
- **fed**: JAX computes it on every call and passes it as an operand of the custom call: the values that
  depend on the data arguments only (a mask from lengths, the index map of a gather from integer
  labels, random bits from a key), and any other value of the parameters without a gradient. Float
  values become the program's constants (inputs), integer and boolean ones its data slots
  (``program_call(..., data=True)``).

So nothing that changes between calls is frozen into the program. What cannot be captured raises
``CaptureError`` or ``UnsupportedPrimitiveError`` naming the equation: a rule that would keep a value of
the example (``pow`` with a traced exponent, ``sort``, ``eigh``…), integer data read inside a loop body,
a ``while_loop`` whose trip count depends on the arguments, a step below the program's precision.
``cond``/``switch`` on an index that changes between calls records every branch and selects with
``tg.where``. The faces inside ``jax.jit`` (``value_and_grad``, ``train_step``) are ``train``'s.
"""
import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

import tapegrad as tg

from .._jax import jax, jnp
from . import expand
from .expand import CaptureError
from ..oracle.check import TracingError
from ..oracle.replay import EXPAND, Literal, Plan, Replay, is_float, is_key, summary
from ..oracle.rules import _flat, _max, _min, _out_shape, _reshape
from ..oracle.table import CONTROL_RULES, RULES, UnsupportedPrimitiveError

# rules that read JAX's values of their operands or results as numbers, so a program would keep the
# values of the capture's example: not capturable (the oracle, which checks one point, uses them)
_FREEZING = frozenset({"cbrt", "rem", "pow", "top_k", "sort", "argsort", "lu", "custom_linear_solve",
                       "scatter-mul", "scatter_mul", "scatter-min", "scatter-max", "scatter_min", "scatter_max",
                       # the oracle's rules that take JAX's value (derivative written here): frozen at the example
                       "erf_inv", "bessel_i0e", "bessel_i1e", "polygamma", "igamma", "igammac", "eigh", "qr", "svd"})
# the rules below take integer or boolean operands, and feed them per call
_TAKES_DATA = frozenset({"select_n", "gather", "scatter-add", "scatter_add", "scatter"})


def _depends(plan, seeds):
    """Slots of ``plan`` that depend on ``seeds`` (a loop or call depends on all its operands)."""
    dep = set(seeds)
    for st in plan.steps:
        if any(not isinstance(s, Literal) and s in dep for s in st.ins):
            dep.update(st.outs)
    return dep


class _Capture(Replay):
    """The oracle's replay, with every value read from JAX fed per call or proven constant."""

    def __init__(self, tape, plan):
        super().__init__(tape, rtol=0.0, compare=False)
        self.plan = plan
        self.varying = _depends(plan, plan.in_slots)          # depends on some argument
        self.feeds = {}     # slot -> its leaf Var (fed with JAX's value of the slot)
        self.derived = []   # (leaf Var, fn(vals, aux) -> array): fed with a function of JAX's values
        self.keep_slots, self.keep_steps = set(), set()
        self._body_dep = {}
        self._plans = []
        self._producers = {}

    def rules(self):
        return _RULES

    def skips(self, name, constant):
        return name in constant and name != "stop_gradient"   # recorded: tg.stop_gradient, in the program

    def producer(self, s):
        """The step of the plan being replayed that computes slot ``s`` (None: an input or a constant)."""
        plan = self._plans[-1][0]
        made = self._producers.get(id(plan))
        if made is None:
            made = self._producers[id(plan)] = (plan, {o: st for st in plan.steps for o in st.outs})
        return made[1].get(s)

    def run(self, plan, tenv, jenv, *args, **kw):
        self._plans.append((plan, set()))
        try:
            return super().run(plan, tenv, jenv, *args, **kw)
        finally:
            self._plans.pop()

    def entered(self, plan, tenv):
        if plan is not self.plan:
            key = (id(plan), frozenset(tenv))
            if key not in self._body_dep:
                self._body_dep[key] = _depends(plan, tenv)
            self._plans[-1] = (plan, self._body_dep[key])

    def at_top(self):
        """Whether the steps being replayed are the function's own (not a loop body's or a branch's)."""
        return self._plans[-1][0] is self.plan

    def moving(self):
        """The slots of the plan being replayed that change between calls or depend on the tape."""
        return self.varying if self.at_top() else self._plans[-1][1]

    def step_text(self):
        return f"equation {self.top_k} ({summary(self._st[1].eqn)})" + (f" in {self.path()}" if self.where else "")

    def operand(self, plan, s, var, jenv):
        if isinstance(s, Literal) or is_key(var.aval):
            return super().operand(plan, s, var, jenv)
        m = self._tenv.get(("m", s)) if self._tenv is not None else None
        if m is not None:
            return m
        name = self._st[1].eqn.primitive.name
        if plan is not self.plan:
            if s in self.moving():
                raise CaptureError(f"capture_jax: {self.step_text()} reads a value computed inside a loop body "
                                   f"without a gradient from traced values; loop bodies may only compute such "
                                   f"values from constants")
            return super().operand(plan, s, var, jenv)
        if s not in self.varying:
            return super().operand(plan, s, var, jenv)
        if is_float(var.aval):
            return self.feed(s, jenv)
        if name in _TAKES_DATA:
            return super().operand(plan, s, var, jenv)   # the capture rule feeds it (see _data_feed)
        raise CaptureError(f"capture_jax: {self.step_text()} reads integer or boolean data that changes between "
                           f"calls ({var.aval.str_short()}); the program has no rule to take it as an operand")

    def reads_mask(self, st, tenv):
        return any(not isinstance(s, Literal) and ("m", s) in tenv for s in st.ins)

    def data_step(self, plan, st, xs, tenv, jenv):
        """A comparison of values on the tape, or a logical op of such masks, recorded as a float mask
        (``tg.greater``…): the program computes it itself instead of JAX computing it every call."""
        eqn = st.eqn
        name = eqn.primitive.name
        rule = _MASK_RULES.get(name)
        if rule is None or len(eqn.outvars) != 1:
            return
        masks = [tenv.get(("m", s)) if not isinstance(s, Literal) else None for s in st.ins]
        if name in _COMPARE:
            if not all(is_float(v.aval) for v in eqn.invars) or not any(isinstance(x, tg.Var) for x in xs):
                return
            args = [x if isinstance(x, tg.Var) else self.operand(plan, s, v, jenv)
                    for x, s, v in zip(xs, st.ins, eqn.invars)]
        else:
            if not any(m is not None for m in masks):
                return
            args = [m if m is not None else self._as_float(plan, s, v, jenv)
                    for m, s, v in zip(masks, st.ins, eqn.invars)]
        tenv[("m", st.outs[0])] = rule(*(self.var(a) for a in args))

    def _as_float(self, plan, s, var, jenv):
        """A bool operand that is not a mask on the tape as 0/1 floats: a constant, or fed every call."""
        if isinstance(s, Literal) or s not in self.moving():
            return np.asarray(jenv.np(s), self.tape.dtype)
        if plan is not self.plan:
            raise CaptureError(f"capture_jax: {self.step_text()} reads a mask computed inside a loop body from "
                               f"values without a gradient; loop bodies may only compute such values from constants")
        self.keep_slots.add(s)
        return self.derive(lambda vals, aux: jnp.asarray(vals[s], self.tape.dtype), np.asarray(jenv.np(s), float))

    def feed(self, s, jenv):
        v = self.feeds.get(s)
        if v is None:
            v = self.feeds[s] = self.tape.const(np.asarray(jenv.np(s), self.tape.dtype))
            self.keep_slots.add(s)
        return v

    def derive(self, fn, example):
        """A data (or float) leaf fed with ``fn(vals, aux)`` on every call; ``example`` its value now."""
        example = np.asarray(example)
        v = self.tape.const(np.asarray(example, self.tape.dtype) if example.dtype.kind == "f" else example)
        self.derived.append((v, fn))
        return v


def _slot(r, i):
    return r._st[1].ins[i]


def _data_feed(r, i, transform, example, slot=None):
    """Operand ``i`` of the current step (or ``slot``), transformed by ``transform`` (jnp → jnp), as a data
    leaf fed per call when it varies, else the transformed example (a constant)."""
    s = _slot(r, i) if slot is None else slot
    if isinstance(s, Literal) or s not in r.varying or not r.at_top():
        return transform(jnp.asarray(example))
    r.keep_slots.add(s)
    return r.derive(lambda vals, aux: transform(vals[s]), np.asarray(transform(jnp.asarray(example))))


def _select_n(r, xs, eqn):
    pred, cases = xs[0], xs[1:]
    shape = _out_shape(eqn)
    y = _finite_or_zero(r, xs)
    if y is not None:
        return tg.finite_or_zero(y)
    if isinstance(pred, tg.Var) and len(cases) == 2:     # a mask the program computes
        return tg.where(pred, _uniform(r, cases[1]), _uniform(r, cases[0]))
    out = r.var(cases[0])
    for k in range(1, len(cases)):
        mask = _data_feed(r, 0, lambda p, k=k: jnp.broadcast_to(p if p.dtype == bool else p == k, shape), pred)
        out = tg.where(mask if isinstance(mask, tg.Var) else np.asarray(mask), r.var(cases[k]), out)
    return out


def _finite_or_zero(r, xs):
    """``select_n(is_finite(y), 0, y)`` (JAX's shift of a stable softmax, logsumexp) with y on the tape:
    y's Var, so the program computes the select itself instead of JAX computing the mask each call."""
    ins = r._st[1].ins
    if len(ins) != 3 or isinstance(ins[0], Literal) or not isinstance(xs[2], tg.Var) or isinstance(xs[1], tg.Var):
        return None
    made = r.producer(ins[0])
    if made is None or made.eqn.primitive.name != "is_finite" or made.ins[0] != ins[2]:
        return None
    if not isinstance(ins[1], Literal) and ins[1] in r.moving():
        return None
    return xs[2] if np.all(np.asarray(xs[1]) == 0.0) else None


def _uniform(r, x):
    """A select's case: a Var, or a constant — one number when every element is the same (``select``
    broadcasts it), so a zero branch costs no buffer."""
    if isinstance(x, tg.Var):
        return x
    x = np.asarray(x)
    return r.var(x.reshape(-1)[:1].reshape(()) if x.size and np.all(x == x.reshape(-1)[0]) else x)


def _stop_gradient(r, xs, eqn):
    return tg.stop_gradient(r.var(xs[0]))


def _with_grad(r, xs, eqn):
    value = r.var(xs[0])
    return tg.with_grad(value, xs[1]) if isinstance(xs[1], tg.Var) else value


def _tape_op(r, xs, eqn):
    """A rule that one registry op computes exactly (``expand.KNOWN``: jax.nn.relu, jax.nn.softmax)."""
    return r.tape.apply(tg.ops.OPS[expand.KNOWN[eqn.params["rule"]][0]], r.var(xs[0]), None, eqn.params["s"])


def _clamp_value(r, xs, eqn):
    """clamp's value (its gradient is JAX's JVP rule, recorded by the expansion: ``expand.BY_JVP``)."""
    lo, x, hi = xs
    return _min(r, [_max(r, [x, lo], eqn), hi], eqn)


# masks of float values (recorded when one operand is on the tape) and logical ops of masks
_COMPARE = {"gt": lambda a, b: tg.greater(a, b), "ge": lambda a, b: tg.greater_equal(a, b),
            "lt": lambda a, b: tg.greater(b, a), "le": lambda a, b: tg.greater_equal(b, a),
            "eq": lambda a, b: tg.equal(a, b), "ne": lambda a, b: tg.not_equal(a, b)}
_MASK_RULES = {**_COMPARE, "and": lambda a, b: a * b, "or": lambda a, b: tg.maximum(a, b),
               "not": lambda a: 1.0 - a, "xor": lambda a, b: tg.not_equal(a, b)}


def _index_map(r):
    """The current gather/scatter's index map (1 + flat operand index, 0 where dropped), fed per call."""
    k, s = r._k, _slot(r, 1)      # the indices operand
    varying = not isinstance(s, Literal) and s in r.varying and r.at_top()
    m = r.aux().reshape(-1)
    if varying:
        r.keep_steps.add(k)
    return m, varying, k


def _gather(r, xs, eqn):
    m, varying, k = _index_map(r)
    shape = _out_shape(eqn)
    flat = _flat(r, xs[0])
    mode = str(eqn.params.get("mode"))
    fills = "FILL" in mode
    if varying:
        idx = r.derive(lambda vals, aux: jnp.maximum(aux[k].reshape(-1) - 1, 0), np.maximum(m - 1, 0))
        mask = r.derive(lambda vals, aux: jnp.reshape(aux[k] != 0, shape), (m != 0).reshape(shape)) if fills \
            else None
    else:
        idx, mask = np.maximum(m - 1, 0), ((m != 0).reshape(shape) if not m.all() else None)
    out = _reshape(r, tg.take(flat, idx, axis=0), shape)
    if mask is not None:
        fill = eqn.params.get("fill_value")
        fill = np.nan if fill is None else float(fill)
        out = tg.where(mask, out, r.var(np.full(shape, fill)))
    return out


def _scatter(fn_name):
    def rule(r, xs, eqn):
        m, varying, k = _index_map(r)
        x, u = xs[0], xs[2]
        vals = _flat(r, u)
        if varying:   # dropped updates are masked to zeros and added (or set) at index 0: exact for add
            if fn_name == "index_set":
                raise CaptureError(f"capture_jax: {r.step_text()}: a scatter at indices that change between "
                                   f"calls can only be captured as a scatter-add")
            keep = r.derive(lambda vals_, aux: aux[k].reshape(-1) != 0, m != 0)
            idx = r.derive(lambda vals_, aux: jnp.maximum(aux[k].reshape(-1) - 1, 0), np.maximum(m - 1, 0))
            vals = tg.where(keep, vals, r.var(np.zeros(vals.shape)))
        else:
            keep_i = np.nonzero(m)[0]
            if keep_i.size != m.size:
                vals = tg.take(vals, keep_i, axis=0)
            idx = m[keep_i] - 1
        return _reshape(r, getattr(tg, fn_name)(_flat(r, x), idx, vals, axis=0), _out_shape(eqn))
    return rule


_CAPTURE_RULES = {"select_n": _select_n, "stop_gradient": _stop_gradient, "tapegrad_with_grad": _with_grad,
                  "tapegrad_op": _tape_op,
                  "clamp": _clamp_value, "gather": _gather,
                  "scatter-add": _scatter("index_add"), "scatter_add": _scatter("index_add"),
                  "scatter": _scatter("index_set")}


def _while_rule(r, st, xs, jenv):
    """A ``while`` whose trip count is the same on every call (its predicate reads only constants and counters)."""
    p = st.eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cplan, body = Plan.of(p["cond_jaxpr"]), Plan.of(p["body_jaxpr"])
    varying = r.moving()

    def moves(j):   # operand j is on the tape or changes between calls
        s = st.ins[j]
        return xs[j] is not None or (not isinstance(s, Literal) and s in varying)
    nk = len(xs) - cn - bn
    carry = {j for j in range(nk) if moves(cn + bn + j)}
    seeds = {body.in_slots[j] for j in range(bn) if moves(cn + j)}
    while True:
        dep = _depends(body, seeds | {body.in_slots[bn + j] for j in carry})
        grown = carry | {j for j, o in enumerate(body.out_slots) if not isinstance(o, Literal) and o in dep}
        if grown == carry:
            break
        carry = grown
    cdep = _depends(cplan, [cplan.in_slots[j] for j in range(cn) if moves(j)] + [cplan.in_slots[cn + j] for j in carry])
    out = cplan.out_slots[0]
    if not isinstance(out, Literal) and out in cdep:
        raise CaptureError(f"capture_jax: {r.step_text()}: a while_loop whose trip count depends on the arguments "
                           f"cannot be a static program (fori_loop/scan with static bounds can)")
    return CONTROL_RULES["while"](r, st, xs, jenv)


def _fed(rule, first=0):
    """A loop rule whose operands (from ``first`` on) that change between calls are fed (floats) or refused (data)."""
    def run(r, st, xs, jenv):
        xs = list(xs)
        for j, (s, v) in enumerate(zip(st.ins, st.eqn.invars)):
            if j >= first and xs[j] is None and not isinstance(s, Literal) and not is_key(v.aval):
                if r.at_top() and s in r.varying and is_float(v.aval):
                    xs[j] = r.feed(s, jenv)
                elif s in r.moving():
                    raise CaptureError(f"capture_jax: {r.step_text()}: operand {j} ({v.aval.str_short()}) of the "
                                       f"loop or branch changes between calls and is not a float; loops and "
                                       f"branches may read such integer data only as constants")
        return rule(r, st, xs, jenv)
    return run


def _cond_rule(r, st, xs, jenv):
    """``cond``/``switch``: on a constant index the branch taken; on one that changes between calls every
    branch, joined by ``tg.where`` on the index JAX computes each call (``vmap``'s semantics)."""
    s = st.ins[0]
    if isinstance(s, Literal) or (s not in r.moving() and xs[0] is None):
        return CONTROL_RULES["cond"](r, st, xs, jenv)
    if not r.at_top():
        raise CaptureError(f"capture_jax: {r.step_text()}: lax.cond/switch on a value computed inside a loop body "
                           f"is not capturable; use jnp.where (lax.select) for values")
    if xs[0] is not None:
        raise CaptureError(f"capture_jax: {r.step_text()}: the cond's index is a float on the tape")
    xs = _fed(lambda r, st, xs, jenv: xs, first=1)(r, st, xs, jenv)
    branches = st.eqn.params["branches"]
    jin = [jenv.jax(x) for x in st.ins[1:]]
    outs = []
    for k, branch in enumerate(branches):
        plan = Plan.of(branch)
        tenv = {t: v for t, v in zip(plan.in_slots, xs[1:]) if v is not None}
        r.where.append(f"branch {k}")
        bouts = r.run(plan, tenv, plan.values(jin))
        r.where.pop()
        outs.append(bouts)
    n = len(branches)
    joined = []
    for j, v in enumerate(st.eqn.outvars):
        vals = [b[j] for b in outs]
        if all(x is None for x in vals):
            joined.append(None)
            continue
        if any(x is None for x in vals) or not is_float(v.aval):
            raise CaptureError(f"capture_jax: {r.step_text()}: result {j} of the branches is on the tape in some "
                               f"branches only; every branch must compute it from the differentiated arguments")
        shape = tuple(v.aval.shape)
        out = vals[0]
        for k in range(1, n):
            mask = _data_feed(r, 0, lambda p, k=k: jnp.broadcast_to(jnp.clip(p, 0, n - 1) == k, shape),
                              jenv.np(s), slot=s)
            out = tg.where(mask, vals[k], out)
        joined.append(out)
    return joined


# what the replay records with (built once: ``run`` asks for them on every loop iteration)
_RULES = ({**{n: f for n, f in RULES.items() if n not in _FREEZING}, **_CAPTURE_RULES},
          {"scan": _fed(CONTROL_RULES["scan"]), "while": _fed(_while_rule), "cond": _cond_rule})


class Captured:
    """A captured JAX function: its tapegrad program and the JAX-side values of the program's operands.

    Made by ``capture_jax`` (and by ``value_and_grad`` and ``train_step``, once per input signature).
    Inside ``jax.jit`` the program runs as ``interop.program_call(cap.program, data=True)``, called
    with the parameters, inputs and data that ``operands(*args)`` computes from new arguments.

    Attributes:
        program: The tapegrad ``Program`` of ``fn``'s differentiable part.
        fn: The captured function.
        tree: The pytree structure of the arguments it was captured at.
        plan: The oracle's flattened jaxpr of ``fn``, which ``operands`` evaluates.
        diff: The positions, among the arguments' leaves, of the program's parameters (the non-empty
            float leaves of ``argnums``).
        has_aux: Whether ``fn`` returns ``(value, aux)``.
        aux_tree: The pytree structure of ``aux`` (None without ``has_aux``).
        argnums: The differentiated positional arguments, as non-negative positions.
        nargs: The number of positional arguments.
        tape: The tape the program was captured from.
        param_vars: The parameters' Vars on ``tape``, in the program's order (what a native
            optimizer registers).

    Examples:
        >>> import jax.numpy as jnp, interop
        >>> loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)
        >>> w, x, y = jnp.zeros(3), jnp.eye(3), jnp.ones(3)
        >>> cap = interop.capture_jax(loss, w, x, y, backend="numpy")
        >>> call = interop.program_call(cap.program, data=True)
        >>> params, inputs, data, aux = cap.operands(w, 2 * x, y)
        >>> float(call(*params, *inputs, *data))
        1.0
    """

    def __init__(self, fn, tree, leaves, plan, diff, program, feeds, has_aux, aux_tree, aux_slots,
                 argnums, nargs):
        self.fn, self.tree, self.plan, self.diff, self.program = fn, tree, plan, diff, program
        self._feeds, self.has_aux, self.aux_tree, self._aux_slots = feeds, has_aux, aux_tree, aux_slots
        self.argnums, self.nargs = argnums, nargs
        self._avals = [jax.typeof(x) for x in leaves]

    @property
    def fed(self) -> list[tuple[int, ...]]:
        """Shapes of the float inputs JAX computes on every call, in the program's input order.

        They are data batches and values without gradient that JAX cannot leave to the program;
        constants of ``fn`` are not fed.
        """
        consts = self.program.consts
        return [tuple(self.program.shapes[k]) for k, (kind, _) in zip(consts, self._feeds[2]) if kind != "const"]

    def _leaves(self, who, args):
        leaves, tree = jax.tree.flatten(args)
        if tree != self.tree:
            raise CaptureError(f"{who}: the arguments' structure {tree} is not the captured one {self.tree}")
        out = []
        for k, (x, a) in enumerate(zip(leaves, self._avals)):
            x = jnp.asarray(x)
            t = jax.typeof(x)
            if tuple(t.shape) != tuple(a.shape) or (t.dtype != a.dtype and not is_key(a)):
                raise CaptureError(f"{who}: argument leaf {k} must be {a.str_short()} (as captured), got "
                                   f"{t.str_short()}")
            out.append(x)
        return out

    def params(self, *args: Any) -> list[Any]:
        """The differentiated leaves of ``args``, in the program's order.

        Args:
            *args: Arguments of ``fn``, of the structure, shapes and dtypes captured.

        Returns:
            The arrays that are the program's parameters, a list.

        Raises:
            CaptureError: If the arguments' structure, or a leaf's shape or dtype, is not the captured
                one.
        """
        leaves = self._leaves("capture_jax", args)
        return [leaves[i] for i in self.diff]

    def operands(self, *args: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """The operands of a call of the program at ``args``, with ``fn``'s ``aux``.

        Traceable: it runs inside ``jax.jit``, JAX computing there the values the program is fed.

        Args:
            *args: Arguments of ``fn``, of the structure, shapes and dtypes captured.

        Returns:
            ``(params, inputs, data, aux)``, each a list: the program's parameters, its float inputs
            (in the program's dtype), its integer and boolean data, and the leaves of ``fn``'s
            ``aux`` (empty without ``has_aux``).

        Raises:
            CaptureError: If the arguments' structure, or a leaf's shape or dtype, is not the captured
                one.
        """
        leaves = self._leaves("capture_jax", args)
        slots, steps, feed_slot, derived = self._feeds
        vals, aux = self.plan.evaluate(self.plan.const_vals, leaves, (sorted(slots), steps))
        dt = self.program.dtype
        inputs, data = [], []
        for kind, what in feed_slot:
            x = vals[what] if kind == "slot" else what(vals, aux) if kind == "fn" else what
            inputs.append(jnp.asarray(x, dt))
        for kind, what in derived:
            data.append(jnp.asarray(what(vals, aux) if kind == "fn" else what))
        aux_out = [self.plan.out_value(vals, s) for s in self._aux_slots]
        return [leaves[i] for i in self.diff], inputs, data, aux_out


def capture_jax(fn: Callable[..., Any], *example_args: Any, argnums: Union[int, Sequence[int]] = 0,
                has_aux: bool = False, backend: str = "native", dtype: Optional[Any] = None,
                memory: str = "keep") -> Captured:
    """Record ``fn``'s differentiable part on a tape and capture it as a tapegrad program.

    The float leaves of the arguments ``argnums`` are the program's parameters; every other leaf is
    data for it (integer labels, token ids, masks, keys, float batches), taken on every call. Values
    that depend on the data only, or carry no gradient, are computed by JAX on every call and fed to
    the program; nothing that changes between calls is frozen into it.

    Where ``fn`` calls a ``custom_jvp`` or ``custom_vjp`` function, the program follows its rule as
    ``jax.grad`` does (``interop.capture.expand``); ``check_grads``, the oracle, replays the rule's
    body instead.

    Args:
        fn: The function, as for ``jax.value_and_grad``: it returns a float scalar (with
            ``has_aux``: ``(scalar, aux)``).
        *example_args: Arguments to trace ``fn`` at, as ``jax.jit`` traces it: arrays or pytrees
            of arrays.
        argnums: The differentiated positional arguments (their float leaves), as in ``jax.grad``.
        has_aux: ``fn`` returns ``(value, aux)``.
        backend: The program's backend: "native" (generated C, the default), "numpy" or "cupy".
        dtype: The program's dtype, float32 or float64. None (the default): float64 where the
            parameters or what is computed from them are float64 (float32 parameters are then cast
            up on the way in and their gradients down, as JAX's ``convert_element_type`` and its
            transpose do), else float32.
        memory: "keep" (every node's value and gradient readable on ``program``) or "reuse" (the
            intermediate buffers assigned by liveness, as ``value_and_grad`` and ``train_step``
            capture: ``tapegrad.capture``'s ``memory``).

    Returns:
        A ``Captured``: the ``program``, and ``operands(*args)`` for calls at other arguments.

    Raises:
        CaptureError: If ``argnums`` is out of range, an argument leaf is not an array, no float
            leaf is differentiated (or a differentiated argument holds a non-float leaf), ``fn``
            does not return one float scalar (with ``has_aux``: a pair), its value does not depend
            on the parameters, ``dtype`` is not float32 or float64, the parameters are of another
            float dtype, a step computes in a lower precision than the program's, a custom rule
            cannot be followed, or a step cannot take what changes between calls as an operand
            (named by its equation: integer data or a mask computed inside a loop body, a
            ``while_loop`` whose trip count depends on the arguments, a scatter at changing indices
            that does not add).
        UnsupportedPrimitiveError: If ``fn`` uses primitives the capture has no rule for, those
            whose rule would freeze the example's values included (``sort``, ``pow`` with a traced
            exponent): each is named by its first equation, with what to write instead.
        TracingError: If ``fn`` branches in Python on a traced value.

    Examples:
        The program's parameter is ``w``; its constants are ``x`` and ``y`` (fed on every call)
        and the mean's 1/n:

        >>> import jax.numpy as jnp, interop
        >>> loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)
        >>> cap = interop.capture_jax(loss, jnp.ones(3), jnp.eye(3),
        ...                           jnp.arange(3.0), backend="numpy")
        >>> len(cap.program.params), len(cap.program.consts)
        (1, 3)
    """
    which = _argnums(argnums, len(example_args), "capture_jax")
    leaves_p, tree = _flatten_args("capture_jax", example_args)

    def flat(*xs):
        return fn(*jax.tree.unflatten(tree, list(xs)))
    try:
        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*[x for _, x in leaves_p])
    except jax.errors.ConcretizationTypeError as e:
        raise TracingError(f"capture_jax traces fn as jax.jit does, so Python control flow on traced values "
                           f"cannot run; JAX said: {str(e).splitlines()[0]}") from e
    return _capture(fn, closed, out_shape, leaves_p, tree, which, len(example_args), has_aux, backend, dtype,
                    memory=memory)


def _argnums(argnums, nargs, who):
    """``argnums`` as a tuple of non-negative positions, checked against ``nargs`` positional arguments."""
    which = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in which:
        if not isinstance(a, (int, np.integer)) or not -nargs <= a < nargs:
            raise CaptureError(f"{who}: argnums {argnums!r} is out of range for {nargs} positional arguments")
    return tuple(int(a) % nargs for a in which)


def _flatten_args(who, args):
    """``(leaves with paths, tree)`` of ``args``, every leaf an array (a CaptureError naming the leaf otherwise)."""
    leaves_p, tree = jax.tree_util.tree_flatten_with_path(args)
    out = []
    for path, x in leaves_p:
        try:
            out.append((path, x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x)))
        except TypeError:
            raise CaptureError(f"{who}: argument leaf {jax.tree_util.keystr(path)} is a "
                               f"{type(x).__name__}, not an array; pass a module's arrays and close over the rest "
                               f"(equinox: arrays, static = eqx.partition(model, eqx.is_array), and "
                               f"eqx.combine(arrays, static) inside fn)") from None
    return out, tree


def _capture(fn, closed, out_shape, leaves_p, tree, which, nargs, has_aux, backend, dtype, who="capture_jax",
             memory="keep"):
    """``closed`` (fn's jaxpr over the leaves ``leaves_p`` of its arguments) captured as a program."""
    leaves = [x for _, x in leaves_p]
    arg_of = [path[0].idx for path, _ in leaves_p]
    # an empty leaf has an empty gradient: it is no parameter of the program (train.grads_like fills it in)
    diff = [i for i, x in enumerate(leaves) if arg_of[i] in which and is_float(jax.typeof(x)) and np.size(x)]
    if not diff:
        raise CaptureError(f"{who}: no float leaf to differentiate in arguments {which}")
    for i, x in enumerate(leaves):
        if arg_of[i] in which and not is_float(jax.typeof(x)):
            raise CaptureError(f"{who}: leaf {jax.tree_util.keystr(leaves_p[i][0])} of a differentiated "
                               f"argument is {jax.typeof(x).str_short()}: as for jax.grad, differentiated "
                               f"arguments hold floats only (pass integers and masks as other arguments)")
    if has_aux and not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
        raise CaptureError(f"{who}: has_aux=True needs fn to return a pair (value, aux), got "
                           f"{jax.tree.structure(out_shape)}")
    value_shape = out_shape[0] if has_aux else out_shape
    if not hasattr(value_shape, "shape") or value_shape.shape != () or np.dtype(value_shape.dtype).kind != "f":
        raise CaptureError(f"{who}: fn must return one float scalar, got {jax.tree.map(_short, value_shape)}"
                           + ("" if has_aux else "; pass has_aux=True if fn returns (value, aux)"))
    with _expanding(), np.errstate(all="ignore"):
        plan = Plan(closed)
        dt = _program_dtype(who, dtype, [(jax.tree_util.keystr(leaves_p[i][0]), jax.typeof(leaves[i]).dtype)
                                         for i in diff], _computed_dtypes(plan, [plan.in_slots[i] for i in diff]))
        tape = tg.Tape(dtype=dt, sources=False)
        params = {i: tape.param(np.asarray(leaves[i], dt), name=jax.tree_util.keystr(leaves_p[i][0])) for i in diff}
        tenv = {plan.in_slots[i]: v for i, v in params.items()}
        r = _Capture(tape, plan)
        jenv = plan.values(leaves)
        outs = r.run(plan, tenv, jenv, top=True)
    if r.unsupported:
        raise UnsupportedPrimitiveError(_unsupported(who, r))
    if r.coarsest is not None and jnp.finfo(r.coarsest[0].dtype).eps > np.finfo(dt).eps:
        low, eqn_text, index, where = r.coarsest
        low = low.dtype
        raise CaptureError(f"{who}: equation {index} ({eqn_text}){' in ' + where if where else ''} computes "
                           f"in {low}, which the program would compute in {dt} (a silent upgrade); cast to "
                           f"{dt} before it, or train this function with jax.jit")
    loss = outs[0]
    if not isinstance(loss, tg.Var):
        raise CaptureError(f"{who}: fn's value does not depend on the differentiated arguments")
    prog = tg.capture(tape, loss, backend=backend, dtype=str(dt), memory=memory)
    # the program's operands, in its registration order: each const is a fed slot or a constant, each data
    # slot a derived feed or a constant
    fed = {v.id: s for s, v in r.feeds.items()}
    derived = {v.id: fn_ for v, fn_ in r.derived}
    feed_slot = []
    for k in prog.consts:
        if k in fed:
            feed_slot.append(("slot", fed[k]))
        elif k in derived:
            feed_slot.append(("fn", derived[k]))
        else:
            feed_slot.append(("const", np.array(prog.val[k])))
    data_feeds = []
    for k in prog.data:
        data_feeds.append(("fn", derived[k]) if k in derived else ("value", np.array(prog.val[k])))
    aux_slots = [s for s in plan.out_slots[1:]] if has_aux else []
    slots = set(r.keep_slots) | {s for s in aux_slots if not isinstance(s, Literal)}

    feeds = (slots, r.keep_steps, feed_slot, data_feeds)
    cap = Captured(fn, tree, leaves, plan, diff, prog, feeds, has_aux,
                   jax.tree.structure(out_shape[1]) if has_aux else None, aux_slots, which, nargs)
    cap.tape, cap.param_vars = tape, [params[i] for i in diff]   # what a native optimizer registers
    return cap


def _short(x):
    return x.str_short() if hasattr(x, "str_short") else jax.typeof(x).str_short() if hasattr(x, "shape") else x


# What to write instead, per primitive a capture has no rule for. A program keeps no value of the example,
# so the oracle's rules that take JAX's value of a result (eigh, svd, sorting…) are not capture rules.
_TAKES_VALUE = ("the oracle takes JAX's value of it at one point, which a program would keep for every "
                "later call")
ADVICE = {
    "sort": "sorting values the parameters move would freeze the example's order; sort outside fn (on data) or "
            "train this function with jax.jit",
    "pow": "a power with a traced exponent: write jnp.exp(y * jnp.log(x)) for positive x, or make the exponent "
           "a Python number (x ** 3 is integer_pow, which is captured)",
    "cbrt": "write jnp.sign(x) * jnp.exp(jnp.log(jnp.abs(x)) / 3) away from 0",
    "rem": "x % y of values on the tape: write x - y * jnp.floor(x / y) (the floor has no gradient, as here)",
    "custom_linear_solve": "an iterative solver (jax.scipy.sparse.linalg): solve with jnp.linalg.solve, or train "
                           "this function with jax.jit",
}
for _p in ("argsort", "top_k"):
    ADVICE[_p] = ADVICE["sort"]
for _p in ("eigh", "qr", "svd", "lu", "erf_inv", "bessel_i0e", "bessel_i1e", "polygamma", "igamma", "igammac"):
    ADVICE[_p] = _TAKES_VALUE + "; train this function with jax.jit (interop.check_grads still checks it)"
for _p in ("scatter-mul", "scatter_mul", "scatter-min", "scatter-max", "scatter_min", "scatter_max"):
    ADVICE[_p] = "a scatter that multiplies or takes extremes reads the example's values; use .at[].add, or train " \
                 "this function with jax.jit"


def _unsupported(who, r):
    """The refusal of primitives with no capture rule: each one's first equation, why, and what to write."""
    parts = []
    for name, why in r.unsupported.items():
        index, text, where = r.unsupported_at.get(name, (None, "", ""))
        at = f"equation {index} ({text}){' in ' + where if where else ''}" if index is not None else name
        reason = ADVICE.get(name) or (f"tapegrad lacks {', '.join(why)}" if isinstance(why, list) and why else
                                      str(why) if why else "the capture has no rule for it; train this function "
                                      "with jax.jit (interop.check_grads still checks it where it can)")
        parts.append(f"{at} uses {name}: {reason}")
    return f"{who}: " + "; ".join(parts)


def _computed_dtypes(plan, seeds):
    """The float dtypes of the plan's values that depend on ``seeds`` (the differentiated leaves)."""
    dep = _depends(plan, seeds)
    return {np.dtype(v.aval.dtype) for st in plan.steps for s, v in zip(st.outs, st.eqn.outvars)
            if s in dep and is_float(v.aval)}


def _program_dtype(who, dtype, params, computed):
    """The program's dtype: ``dtype``, else float64 where the parameters or what is computed from them are
    float64 (float32 parameters are then cast up on the way in and their gradients down, as JAX's
    convert_element_type and its transpose do), else float32."""
    if dtype is not None:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise CaptureError(f"{who}: dtype must be float32 or float64, got {dt}")
        return dt
    low = [(name, np.dtype(d)) for name, d in params if np.dtype(d) not in (np.dtype(np.float32), np.dtype(np.float64))]
    if low:
        names = ", ".join(name for name, d in low[:3])
        raise CaptureError(f"{who}: the parameters {names} are {low[0][1]}; a tapegrad program computes in "
                           f"float32 or float64. Keep parameters in float32 (mixed precision casts them to "
                           f"{low[0][1]} inside fn)")
    f64 = np.dtype(np.float64)
    return f64 if f64 in computed or any(np.dtype(d) == f64 for _, d in params) else np.dtype(np.float32)


@contextlib.contextmanager
def _expanding():
    """Plans built and replayed inside record derivative rules as JAX follows them (``interop.capture.expand``)."""
    saved = EXPAND[0]
    EXPAND[0] = (expand.expands, expand.expansion)
    try:
        yield
    finally:
        EXPAND[0] = saved
