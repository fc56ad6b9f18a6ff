"""The oracle's replay: a jaxpr flattened into steps, JAX's value of every step from one compiled call,
and the walk that records the differentiable steps on a tapegrad tape.

A ``Plan`` flattens a jaxpr: every call-like equation (one that carries a jaxpr taking and giving
exactly its operands' and results' types: ``jit``, ``remat2``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``, …) is inlined by its primal body, so each value of the computation gets one slot.
Its evaluator, compiled once, returns JAX's values of the slots the replay reads (``Plan.needed``;
every slot when a divergence must be located). ``Replay`` then walks the steps:
a step none of whose operands depends on the differentiated arguments is not replayed — its result
is JAX's value, entering the tape as a constant when a later step needs it (random keys, integer
arithmetic and masks never go through NumPy or the tape) — and every other step is recorded by its
rule (``rules``). ``scan``/``while`` are unrolled with their concrete trip counts and ``cond``
replays the branch JAX took; their bodies' values come from one compiled call per loop.
"""
import re
from typing import NamedTuple, Optional

import numpy as np

import tapegrad as tg

from .._jax import CPU_FUSION_EMITTERS_SWITCH, align_varying, jax, jnp
from .table import CONSTANT, CONTROL_RULES, CUSTOM, INDEX_MAPS, PER_OPERAND, RULES, VALUE_RULES, NotReplayable, missing
import jax.extend.core as _core  # noqa: E402

CONTROL = ("scan", "while", "cond")
# primitives that move, select or pass values without rounding them: a lower precision there is no computation in it
MOVES = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
                   "dynamic_update_slice", "concatenate", "pad", "rev", "gather", "select_n", "copy", "copy_p",
                   "stop_gradient", "tapegrad_with_grad", "optimization_barrier"})
NOT_CALLS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                       "scatter-max", "scatter_min", "scatter_max", "reduce", "reduce_window", "sort",
                       "custom_linear_solve", "select_and_scatter", "select_and_gather_add", "argsort"})
Literal = _core.Literal


_KIND = {}   # dtype -> "key", or NumPy's kind letter (asking JAX about a dtype costs ~50 µs)


def kind(dtype):
    """"key", or NumPy's kind letter, "f" for every real float: ml_dtypes' bfloat16 and float8 types
    have NumPy kind "V" but are floats to JAX (and to the replay, which computes them in float64)."""
    k = _KIND.get(dtype)
    if k is None:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            k = "key"
        elif jax.dtypes.issubdtype(dtype, np.floating):
            k = "f"
        else:
            k = np.dtype(dtype).kind
        _KIND[dtype] = k
    return k


_kind = kind


def is_key(aval):
    return _kind(aval.dtype) == "key"


def is_float(aval):
    return _kind(aval.dtype) == "f"


# JAX's side is compiled once per function and run a few times on small inputs, so it is compiled
# for compile time: LLVM's cheapest pipeline and XLA's older CPU fusion emitters (a switch jaxlib
# 0.11.1 removed) cut a transformer block's compile about 3× here (4–5 s → 1.1–1.4 s under load);
# the HLO passes (fusion, algebraic simplification) still run, so values agree with a default jit to rounding.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                **({"xla_cpu_use_fusion_emitters": False} if CPU_FUSION_EMITTERS_SWITCH else {})}


def compiled(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def is_data(aval):
    """Integers, booleans and keys: never differentiable (their results are JAX's values)."""
    return _kind(aval.dtype) in ("key", "b", "i", "u")


def open_jaxpr(j):
    """(jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    return (j.jaxpr, list(j.consts)) if hasattr(j, "consts") else (j, [])


def _same_types(vs, avals):
    return len(vs) == len(avals) and all(
        tuple(v.aval.shape) == tuple(a.shape) and v.aval.dtype == a.dtype for v, a in zip(vs, avals))


def call_body(eqn):
    """The body of a call-like equation, (jaxpr, consts), or None.

    Call-like: not a loop or branch, and exactly one jaxpr among its parameters whose inputs are the
    equation's last operands and whose outputs are its results, type for type. No primitive names.
    """
    name = eqn.primitive.name
    if name in CONTROL or name in NOT_CALLS:
        return None
    if name == "call_hi_primitive":
        return hi_body(eqn.params["_prim"])
    found = []
    for val in eqn.params.values():
        for v in (val if isinstance(val, tuple) else (val,)):
            if isinstance(v, (_core.Jaxpr, _core.ClosedJaxpr)):
                found.append(v)
    if len(found) != 1:
        return None
    body, consts = open_jaxpr(found[0])
    n = len(body.invars)
    if n > len(eqn.invars) or not _same_types(body.invars, [v.aval for v in eqn.invars[len(eqn.invars) - n:]]):
        return None
    if not _same_types(body.outvars, [v.aval for v in eqn.outvars]):
        return None
    return body, consts


_HI_BODIES = {}


def hi_body(prim):
    """The lowering of a high-level primitive (jax >= 0.12's ``call_hi_primitive``: ``lax.custom_root``
    is one) as (jaxpr, consts): its ``expand``, traced on its operands' types, cached per primitive."""
    body = _HI_BODIES.get(id(prim))
    if body is None or body[0] is not prim:
        tree = jax.tree_util

        def flat(*xs):
            return tree.tree_leaves(prim.expand(*tree.tree_unflatten(prim.in_tree, xs)))
        closed = jax.make_jaxpr(flat)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in prim.in_avals_flat])
        body = _HI_BODIES[id(prim)] = (prim, closed)
    return open_jaxpr(body[1])


CUSTOM_CALLS = ("custom_vjp_call", "custom_jvp_call")
TRUST = [frozenset()]   # the custom rules check_grads was asked to trust (set for the length of one check)
# A capture's (interop.capture.expand): (expands(eqn) -> bool, expansion(eqn) -> ClosedJaxpr), set for the length of
# one capture, so its plans (loop bodies included) record derivative rules as JAX follows them
EXPAND = [None]


def custom_name(eqn):
    """The name JAX records for a custom_vjp/custom_jvp call (its primal function's), or None."""
    if eqn.primitive.name not in CUSTOM_CALLS:
        return None
    info = getattr(eqn.params.get("call_jaxpr"), "jaxpr", None)
    info = getattr(info, "debug_info", None)
    return getattr(info, "func_name", None) or "?"


def trusted(eqn):
    """Whether ``eqn`` is a custom rule to replay as JAX gives it (``check_grads(trust=…)``): matched by
    the recorded name, or that name without leading underscores (optax's ``_scale_gradient``)."""
    name = custom_name(eqn) if TRUST[0] else None
    return name is not None and (name in TRUST[0] or name.lstrip("_") in TRUST[0])


class Step(NamedTuple):
    eqn: object
    ins: tuple     # slot ints or Literals
    outs: tuple    # slot ints


class Unit(NamedTuple):
    """An equation as the user's jaxpr has it: steps ``[start, end)`` of the flat list; calls have children."""
    start: int
    end: int
    eqn: object
    ins: tuple
    outs: tuple    # slot ints or Literals (a call may return a constant or an operand)
    children: Optional[list]


def bind(eqn, args):
    out = eqn.primitive.bind(*align_varying(args), **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def of_floats(eqn, all_vals, fl, fo):
    """``eqn`` as a function of its operands ``fl`` (the others fixed at ``all_vals``) giving its results ``fo``."""
    def g(*d):
        vals = list(all_vals)
        for i, v in zip(fl, d):
            vals[i] = v
        outs = bind(eqn, vals)
        return [outs[j] for j in fo]
    return g


class Plan:
    """A jaxpr flattened into ``steps`` over numbered slots, with a compiled evaluator of every slot.

    ``Plan.of(jaxpr)`` caches one plan per jaxpr object (the cache keeps the jaxpr alive, so an id is
    never reused while its entry exists).
    """
    _CACHE = {}

    @classmethod
    def of(cls, j):
        key = (id(j), TRUST[0], EXPAND[0] is not None)
        hit = cls._CACHE.get(key)
        if hit is None or hit[0] is not j:
            if len(cls._CACHE) > 512:
                cls._CACHE.clear()
            hit = cls._CACHE[key] = (j, cls(j))
        return hit[1]

    def __init__(self, j):
        jx, consts = open_jaxpr(j)
        self.n = 0
        self.steps = []
        self.const_slots, self.const_vals = [], []
        self.in_slots = [self._new() for _ in jx.invars]
        self.in_avals = [v.aval for v in jx.invars]
        self.units = []
        self.out_slots = self._flatten(jx, consts, self.in_slots, self.units)
        self._fn = None
        self._eval_cache = {}
        self._live_cache = {}

    def _new(self):
        self.n += 1
        return self.n - 1

    def _flatten(self, jx, consts, ins, units, tangent=None):
        """Flatten ``jx`` into steps. Under a capture (``EXPAND``) every custom rule becomes its expansion;
        inside an expansion (``tangent``: its variables that carry the tangent) a custom call on values
        that carry none is inlined by its body, which is then only the value."""
        env = {}
        for v, c in zip(jx.constvars, consts):
            s = self._new()
            self.const_slots.append(s)
            self.const_vals.append(c)
            env[v] = s
        env.update(zip(jx.invars, ins))

        def read(x):
            return x if isinstance(x, Literal) else env[x]

        for eqn in jx.eqns:
            xs = tuple(read(x) for x in eqn.invars)
            moved = tangent is not None and any(not isinstance(v, Literal) and v in tangent for v in eqn.invars)
            if EXPAND[0] is not None and (tangent is None or moved) and EXPAND[0][0](eqn):
                ej, econsts = open_jaxpr(EXPAND[0][1](eqn))
                start, children = len(self.steps), []
                outs = self._flatten(ej, econsts, xs, children, tangent={v for v in ej.invars if is_float(v.aval)})
                units.append(Unit(start, len(self.steps), eqn, xs, tuple(outs), children))
            elif (body := None if trusted(eqn) else call_body(eqn)) is not None:
                bj, bconsts = body
                inner = xs[len(xs) - len(bj.invars):]
                btangent = None if tangent is None else {
                    bv for bv, v in zip(bj.invars, eqn.invars[len(xs) - len(bj.invars):])
                    if not isinstance(v, Literal) and v in tangent}
                start, children = len(self.steps), []
                outs = self._flatten(bj, bconsts, inner, children, btangent)
                units.append(Unit(start, len(self.steps), eqn, xs, tuple(outs), children))
            else:
                outs = tuple(self._new() for _ in eqn.outvars)
                units.append(Unit(len(self.steps), len(self.steps) + 1, eqn, xs, outs, None))
                self.steps.append(Step(eqn, xs, outs))
            if moved and eqn.primitive.name != "stop_gradient":
                tangent.update(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        return [read(x) for x in jx.outvars]

    # ── JAX's values ─────────────────────────────────────────────────────────

    def evaluate(self, consts, ins, keep=None):
        """Slot values (traceable: runs inside ``jax.jit``), and the index maps of gathers/scatters.

        ``keep``: (slots, steps) to return the values and index maps of (None: all of them, as a list).
        """
        vals = [None] * self.n
        for s, c in zip(self.const_slots, consts):
            vals[s] = c
        for s, v in zip(self.in_slots, ins):
            vals[s] = v
        aux = {}
        live = None if keep is None else self._live(keep)
        for k, st in enumerate(self.steps):
            mapped = keep is None or k in keep[1]
            if live is not None and k not in live and not mapped:
                continue
            args = [x.val if isinstance(x, Literal) else vals[x] for x in st.ins]
            if live is None or k in live:
                for s, o in zip(st.outs, bind(st.eqn, args)):
                    vals[s] = o
            maps = INDEX_MAPS.get(st.eqn.primitive.name)
            if maps is not None and is_float(st.eqn.outvars[0].aval) and mapped:
                # an index map reads the float operands' shapes only: zeros stand in for values not computed
                args = [a if a is not None else jnp.zeros(v.aval.shape, v.aval.dtype)
                        for a, v in zip(args, st.eqn.invars)]
                aux[k] = maps(st.eqn, args)
        if keep is None:
            return vals, aux
        return {s: vals[s] for s in keep[0]}, aux

    def _live(self, keep):
        """The steps ``evaluate(keep=…)`` must run: those computing a kept slot or a kept step's integer
        operands (its index map reads only the shapes of the float ones), and what they read. Tracing
        only these keeps the model's forward out of a capture's per-call JAX work, and out of shard_map's
        typing (binding an unneeded step of replicated and per-shard values is a type error there)."""
        key = (tuple(keep[0]), tuple(sorted(keep[1])))
        live = self._live_cache.get(key)
        if live is not None:
            return live
        want = set(keep[0])
        for k in keep[1]:   # an index map needs the indices' values, of the float operands only the shapes
            st = self.steps[k]
            want.update(x for x, v in zip(st.ins, st.eqn.invars) if not isinstance(x, Literal) and not is_float(v.aval))
        live = set()
        for k in range(len(self.steps) - 1, -1, -1):
            st = self.steps[k]
            if any(o in want for o in st.outs):
                live.add(k)
                want.update(x for x in st.ins if not isinstance(x, Literal))
        self._live_cache[key] = live
        return live

    def needed(self, tainted_ins):
        """What the replay needs of JAX's values when the inputs ``tainted_ins`` are differentiated.

        Taint is propagated statically (as the replay does); the replay reads JAX's values only of
        untainted operands of tainted steps, of every operand and result of loops, branches and the
        rules that read results (``VALUE_RULES``), and the index maps of tainted gathers/scatters.
        Returns ``(slots, steps)`` for ``evaluate(keep=…)``.
        """
        tainted = set(tainted_ins)
        slots, steps = {s for s in self.out_slots if not isinstance(s, Literal)}, set()   # Literals are unhashable
        for k, st in enumerate(self.steps):
            name = st.eqn.primitive.name
            ins = [s for s in st.ins if not isinstance(s, Literal)]
            if not any(s in tainted for s in ins):
                continue
            if name in CONSTANT or all(is_data(v.aval) for v in st.eqn.outvars):
                continue
            steps.add(k)
            slots.update(s for s in ins if s not in tainted)
            if name in CONTROL or name in VALUE_RULES or name in CUSTOM_CALLS:
                slots.update(ins)
                slots.update(st.outs)
            for i, (s, v) in enumerate(zip(st.outs, st.eqn.outvars)):
                if name in PER_OPERAND and not (isinstance(st.ins[i], int) and st.ins[i] in tainted):
                    slots.add(s)
                elif is_float(v.aval) and not np.prod(v.aval.shape):
                    slots.add(s)            # an empty result is JAX's value
                elif is_float(v.aval):
                    tainted.add(s)
        return sorted(slots), steps

    def out_value(self, vals, s):
        return jnp.asarray(s.val, s.aval.dtype) if isinstance(s, Literal) else vals[s]

    def values(self, ins):
        """``JEnv`` of JAX's values of every slot for inputs ``ins`` (one compiled call)."""
        if self._fn is None:
            self._fn = compiled(self.evaluate)
        vals, aux = self._fn(self.const_vals, list(ins))
        return JEnv(vals, aux)

    def scan_values(self, key, consts, init, xs, length, reverse, nconst):
        """JAX's values of every body slot at every iteration of a scan over this body (one compiled call)."""
        fn = self._eval_cache.get(key)
        if fn is None:
            nk = len(init)
            stack = [s for s in range(self.n) if s not in set(self.const_slots) | set(self.in_slots[:nconst])]

            def run(bconsts, consts, init, xs):
                def body(carry, x):
                    vals, aux = self.evaluate(bconsts, list(consts) + list(carry) + list(x or ()))
                    new = [self.out_value(vals, s) for s in self.out_slots[:nk]]
                    new = [jnp.asarray(a, c.dtype) for a, c in zip(new, carry)]
                    return new, ([vals[s] for s in stack], aux)
                _, (stacked, aux) = jax.lax.scan(body, list(init), list(xs) if xs else None, length=length,
                                                 reverse=reverse)
                return stacked, aux
            fn = self._eval_cache[key] = (compiled(run), stack)
        run, stack = fn
        stacked, aux = run(self.const_vals, list(consts), list(init), list(xs))
        return Stacked(self, dict(zip(stack, stacked)), list(consts), nconst, aux)


class JEnv:
    """JAX's values of a plan's slots: ``np(s)`` as NumPy (converted once), ``jax(s)`` as given.

    ``vals``: a list over all slots, or a dict of some; ``full()`` gives the complete ``JEnv`` when a
    slot outside the dict is asked for (computed once, on demand).
    """

    def __init__(self, vals, aux, full=None):
        self.vals, self.aux, self.full = vals, aux, full
        self._np = {}

    def jax(self, s):
        if isinstance(s, Literal):
            return s.val
        if isinstance(self.vals, dict) and s not in self.vals:
            return self.full().jax(s)
        return self.vals[s]

    def np(self, s):
        if isinstance(s, Literal):
            return np.asarray(s.val)
        a = self._np.get(s)
        if a is None:
            a = self._np[s] = np.asarray(self.jax(s))
        return a

    def aux_of(self, k):
        if k not in self.aux:
            return self.full().aux_of(k)
        return np.asarray(self.aux[k])


class Stacked:
    """A loop body's slot values at every iteration; ``at(t)`` is iteration ``t``'s ``JEnv``."""

    def __init__(self, plan, stacked, consts, nconst, aux):
        self.plan, self.stacked, self.aux = plan, stacked, aux
        self.fixed = dict(zip(plan.const_slots, plan.const_vals))
        self.fixed.update(zip(plan.in_slots[:nconst], consts))
        self._np = {}

    def np_all(self, s):
        a = self._np.get(s)
        if a is None:
            a = self._np[s] = np.asarray(self.stacked[s])
        return a

    def at(self, t):
        return _IterEnv(self, t)


class _IterEnv(JEnv):
    def __init__(self, st, t):
        self.st, self.t = st, t
        self._np = {}

    def jax(self, s):
        if isinstance(s, Literal):
            return s.val
        if s in self.st.fixed:
            return self.st.fixed[s]
        a = self.st.stacked[s]
        return a[self.t] if is_key(jax.typeof(a)) else jnp.asarray(self.st.np_all(s)[self.t])

    def np(self, s):
        if isinstance(s, Literal):
            return np.asarray(s.val)
        if s in self.st.fixed:
            return np.asarray(self.st.fixed[s])
        return self.st.np_all(s)[self.t]

    def aux_of(self, k):
        return np.asarray(self.st.aux[k])[self.t]


def summary(eqn):
    """One line for an equation; a call shows its name instead of its body."""
    lines = str(eqn).strip().splitlines()
    if len(lines) == 1:
        return lines[0]
    name = re.search(r"\bname=(\S+)", str(eqn))
    return f"{lines[0]}name={name.group(1) if name else '?'}{lines[-1].strip()}"


def diff(t, j, scale=0.0):
    """(max |t − j|, that over max(max |j|, scale)); a non-finite value on one side only is infinitely far."""
    t, j = np.asarray(t, np.float64), np.asarray(j, np.float64)
    if t.shape != j.shape:
        return np.inf, np.inf
    if not t.size:
        return 0.0, 0.0
    same = (t == j) | (np.isnan(t) & np.isnan(j))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(same, 0.0, np.abs(t - j))
    d = np.where(np.isnan(d), np.inf, d)
    a = float(d.max())
    scale = max(float(np.abs(np.where(np.isfinite(j), j, 0.0)).max()), scale)
    return a, (a / scale if scale else (0.0 if a == 0 else np.inf))


def lowp_bound(eps, rtol):
    """The bound used where a value went through a lower precision: √eps of that precision (≥ rtol)."""
    return max(rtol, float(np.sqrt(eps)))


class Replay:
    """Records the differentiable steps of plans on ``tape``, comparing each with JAX's value as it goes."""

    def __init__(self, tape, rtol, compare=True):
        self.tape, self.rtol, self.compare = tape, rtol, compare
        self.index = 0              # steps replayed so far (loop iterations count each time)
        self.divergence = None      # (index, eqn, where, max_abs, max_rel) of the first value divergence
        self.lowp = None            # (dtype, eqn summary, index, where) of the first low-precision step
        self.coarsest = None        # (aval, eqn summary, index, where) of the first step in the coarsest one
        self.kinks = []             # (index, eqn summary, where, what)
        self.where = []             # the loop/branch path being replayed
        self.tainted = set()        # top-level step indices that were replayed
        self._tenv = None           # the slot -> Var map of the step being replayed
        self._st = None             # (JEnv, step) being replayed (for rules: jout, aux)
        self._k = None
        self.top_k = 0              # the top-level step being replayed (what reports call "equation k")
        self.unsupported = {}       # primitive -> missing tapegrad functions (None: no rule at all)
        self.unsupported_at = {}    # primitive -> (equation index, its summary, loop path) where first met

    # ── helpers for rules ─────────────────────────────────────────────────────

    def skips(self, name, constant):
        """Whether a step of primitive ``name`` is left to JAX (its value enters as a constant): by
        default the ``constant`` ones (no gradient flows through them: stop_gradient, sign, floor…)."""
        return name in constant

    def var(self, x):
        """A Var for a step operand: Vars pass through, values become constants (data stays data)."""
        if isinstance(x, tg.Var):
            return x
        x = np.asarray(x)
        if kind(x.dtype) in "fc":
            return self.tape.const(np.asarray(x, dtype=self.tape.dtype))
        return self.tape.const(x)

    def value(self, x):
        return np.asarray(self.tape.value(x)) if isinstance(x, tg.Var) else np.asarray(x)

    def jout(self, i=0):
        """JAX's value of the current step's result ``i`` (NumPy)."""
        plan_env, st = self._st
        return plan_env.np(st.outs[i])

    def aux(self):
        env, st, k = self._st[0], self._st[1], self._k
        return env.aux_of(k)

    def kink(self, count, what):
        if count:
            self.kinks.append((self.top_k, summary(self._st[1].eqn), self.path(), f"{int(count)} {what}"))

    def _operand_scale(self, st, jenv):
        """The largest finite float operand of a step: forward errors are relative to it (a − b cancels)."""
        m = 0.0
        for s, v in zip(st.ins, st.eqn.invars):
            if is_float(v.aval) and np.size(jenv.np(s)) and v.aval.ndim <= 8:
                a = np.abs(jenv.np(s))
                m = max(m, float(np.where(np.isfinite(a), a, 0.0).max()))
        return m

    def path(self):
        return " › ".join(self.where)

    # ── what a capture (interop.capture) overrides ───────────────────────

    def rules(self):
        """(rules, control rules) this replay records steps with."""
        return RULES, CONTROL_RULES

    def entered(self, plan, tenv):
        """Called as ``run`` starts on ``plan`` with the Vars ``tenv`` holds."""

    def reads_mask(self, st, tenv):
        """Whether a step none of whose operands is on the tape reads a mask computed there (a capture's)."""
        return False

    def data_step(self, plan, st, xs, tenv, jenv):
        """A step with integer or bool results and an operand on the tape: JAX's values (a capture may record
        a comparison as a float mask on the tape instead)."""

    def operand(self, plan, s, var, jenv):
        """What a rule gets for an operand ``var`` (slot ``s``) that is not on the tape: JAX's value (None
        for a key)."""
        return None if is_key(var.aval) else jenv.np(s)

    # ── the walk ──────────────────────────────────────────────────────────────

    def run(self, plan, tenv, jenv, lo=0, hi=None, prec=None, top=False):
        """Replay steps ``[lo, hi)`` of ``plan``; ``tenv`` maps slots to Vars (updated in place).

        Returns the plan's outputs as Vars, or None where JAX's value is the output (not differentiable).
        """
        prec = {} if prec is None else prec
        steps = plan.steps
        hi = len(steps) if hi is None else hi
        RULES, CONTROL_RULES = self.rules()
        self.entered(plan, tenv)
        for k in range(lo, hi):
            st = steps[k]
            xs = [None if isinstance(s, Literal) else tenv.get(s) for s in st.ins]
            if not any(x is not None for x in xs) and not self.reads_mask(st, tenv):
                continue
            eqn = st.eqn
            name = eqn.primitive.name
            if all(is_data(v.aval) for v in eqn.outvars):
                self.data_step(plan, st, xs, tenv, jenv)
                continue
            if self.skips(name, CONSTANT):
                continue
            self._tenv = tenv
            if top:
                self.tainted.add(k)
                self.top_k = k
            index = self.top_k
            self.index += 1
            self._st, self._k = (jenv, st), k
            if name in CONTROL_RULES:
                self.where.append(f"{name} (step {index})")
                outs = CONTROL_RULES[name](self, st, xs, jenv)
                self.where.pop()
            elif name in CUSTOM_CALLS:    # not inlined: a trusted rule
                outs = CUSTOM["trusted"](self, st, xs, jenv)
            elif all(is_data(v.aval) or not np.prod(v.aval.shape) for v in eqn.outvars):
                outs = [None] * len(eqn.outvars)    # empty results carry no gradient: JAX's (empty) values
            elif name not in RULES or missing(name):
                self.unsupported.setdefault(name, missing(name) if name in RULES else None)
                self.unsupported_at.setdefault(name, (index, summary(eqn), self.path()))
                outs = [None] * len(eqn.outvars)
            else:
                args = [x if x is not None else self.operand(plan, s, v, jenv)
                        for x, s, v in zip(xs, st.ins, eqn.invars)]
                try:
                    outs = RULES[name](self, args, eqn)
                    outs = list(outs) if eqn.primitive.multiple_results else [outs]
                except NotReplayable as e:
                    self.unsupported.setdefault(name, str(e))
                    self.unsupported_at.setdefault(name, (index, summary(eqn), self.path()))
                    outs = [None] * len(eqn.outvars)
            eps = max([prec.get(s, 0.0) for s in st.ins if not isinstance(s, Literal) and s in tenv] + [0.0])
            for s, o, v in zip(st.outs, outs, eqn.outvars):
                if not isinstance(o, tg.Var):
                    continue
                tenv[s] = o
                e = max(eps, _eps(v.aval))
                if e:
                    prec[s] = e
                    low = _eps(v.aval)
                    if low and name not in MOVES and (self.coarsest is None or low > _eps(self.coarsest[0])):
                        self.coarsest = (v.aval, summary(eqn), index, self.path())
                    if self.lowp is None and low:
                        self.lowp = (np.dtype(v.aval.dtype), summary(eqn), index, self.path())
                if self.compare and self.divergence is None:
                    bound = lowp_bound(e, self.rtol) if e else self.rtol
                    a, rel = diff(self.tape.value(o), jenv.np(s), self._operand_scale(st, jenv))
                    if rel > bound:
                        self.divergence = (index, summary(eqn), self.path(), a, rel)
        return [None if isinstance(s, Literal) else tenv.get(s) for s in plan.out_slots]


def _eps(aval):
    if not is_float(aval):
        return 0.0
    e = float(jnp.finfo(aval.dtype).eps)
    return e if e > 1e-15 else 0.0
