"""The gradient oracle: replay a ``jax.numpy`` function's jaxpr on a tapegrad tape, compare with ``jax.grad``.

``check_grads(f, *args)`` traces ``f`` to a jaxpr, records every equation on a tape with registry ops
(calls, ``custom_jvp``/``custom_vjp`` and nested ``jit`` are inlined by their *primal* body, so a
hand-written rule is checked against the derivative of what it claims to differentiate), runs
tapegrad's backward and compares with ``jax.grad(f)``. Both are exact reverse-mode sweeps in float64;
they differ only where XLA and NumPy round or sum in another order, so the default bound is
``rtol=1e-12`` normwise per argument: ``max|Δ| <= rtol · max|jax.grad|``.

When they disagree, the report names the first equation where the two differ: first by forward value
(each equation is also evaluated by JAX on JAX's own values), then — forward values agreeing — by a
local VJP check of each equation with a random cotangent (the custom rule's ``jax.vjp`` against the
tape's backward of its primal body).
"""
import re
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import tapegrad as tg
from tapegrad import ops as O

from ._jax import jax, jnp

import jax.extend.core as _core  # noqa: E402


class UnsupportedPrimitiveError(NotImplementedError):
    """The jaxpr uses primitives the tape cannot replay on differentiable values (named in the message)."""


@dataclass
class Divergence:
    """Where tapegrad and JAX first disagree: equation index (in replay order), its text, and by how much."""
    index: int
    eqn: str
    kind: str          # "value" (forward values differ) or "vjp" (the equation's local VJP differs)
    max_abs: float
    max_rel: float

    def __str__(self):
        return (f"equation {self.index} ({self.kind}): {self.eqn}  max|Δ|={self.max_abs:.3g}  "
                f"rel={self.max_rel:.3g}")


@dataclass
class GradReport:
    """Result of ``check_grads``: tapegrad's gradients next to ``jax.grad``'s, per argument."""
    ok: bool
    grads: Any                     # tapegrad's gradients: a tuple, one per argument (pytrees kept)
    jax_grads: Any
    value: float                   # f on the tape
    jax_value: float
    max_abs: tuple                 # per argument leaf: max |tapegrad − jax|
    max_rel: tuple                 # per argument leaf: max |Δ| / max |jax|
    rtol: float
    first_divergence: Optional[Divergence] = None
    n_eqns: int = 0
    notes: list = field(default_factory=list)

    def __str__(self):
        head = f"check_grads: {'ok' if self.ok else 'MISMATCH'} (rtol {self.rtol:g}, {self.n_eqns} equations)"
        rows = [f"  arg {k}: max|Δ|={a:.3g} rel={r:.3g}" for k, (a, r) in enumerate(zip(self.max_abs, self.max_rel))]
        tail = [f"  first divergence: {self.first_divergence}"] if self.first_divergence else []
        return "\n".join([head, *rows, *tail])


# ── primitive rules: (replay, invals as Var|ndarray, eqn params, out aval) -> Var ─────────────

def _un(opname):
    return lambda r, xs, p, aval: r.tape.apply(getattr(O, opname), r.var(xs[0]))


def _bin(fn):
    return lambda r, xs, p, aval: fn(r.var(xs[0]), r.var(xs[1]))


def _neg(t, v):
    return t.apply(O.neg, v)


def _min(r, xs, p, aval):
    t = r.tape
    return _neg(t, tg.maximum(_neg(t, r.var(xs[0])), _neg(t, r.var(xs[1]))))


def _integer_pow(r, xs, p, aval):
    x, y = r.var(xs[0]), int(p["y"])
    if y == 1:
        return x
    if y == 2:
        return r.tape.apply(O.square, x)
    if y == -1:
        return r.tape.apply(O.rdivs, x, None, 1.0)
    return r.tape.apply(O.pow, x, None, float(y))


def _pow(r, xs, p, aval):
    if not isinstance(xs[1], np.ndarray) or xs[1].ndim:
        raise UnsupportedPrimitiveError("pow: only a constant scalar exponent can be replayed on the tape")
    return r.tape.apply(O.pow, r.var(xs[0]), None, float(xs[1]))


def _dot_general(r, xs, p, aval):
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    a, b = r.var(xs[0]), r.var(xs[1])
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
    return _reshape(r, out, aval.shape)


def _permute(r, v, perm):
    perm = tuple(perm)
    return v if perm == tuple(range(v.ndim)) else r.tape.apply(O.transpose, v, None, perm)


def _reshape(r, v, shape):
    shape = tuple(int(n) for n in shape)
    return v if tuple(v.shape) == shape else r.tape.apply(O.reshape, v, None, shape)


def _broadcast_in_dim(r, xs, p, aval):
    shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    v = r.var(xs[0])
    mid = [1] * len(shape)
    for k, d in enumerate(dims):
        mid[d] = v.shape[k]
    v = _reshape(r, v, mid)
    return v if tuple(v.shape) == shape else r.tape.apply(O.broadcast_to, v, None, shape)


def _reduce(opname):
    def rule(r, xs, p, aval):
        return r.tape.apply(getattr(O, opname), r.var(xs[0]), None, (tuple(sorted(p["axes"])), False))
    return rule


def _reduce_min(r, xs, p, aval):
    t = r.tape
    m = t.apply(O.max, _neg(t, r.var(xs[0])), None, (tuple(sorted(p["axes"])), False))
    return _neg(t, m)


def _slice(r, xs, p, aval):
    if p.get("strides") not in (None, ()) and any(s != 1 for s in p["strides"]):
        raise UnsupportedPrimitiveError(f"slice: strides {p['strides']} (only step 1 replays on the tape)")
    s = tuple((int(lo), int(hi)) for lo, hi in zip(p["start_indices"], p["limit_indices"]))
    return r.tape.apply(O.slice, r.var(xs[0]), None, s)


def _concatenate(r, xs, p, aval):
    return tg.concat([r.var(x) for x in xs], axis=int(p["dimension"]))


def _select_n(r, xs, p, aval):
    pred, cases = xs[0], xs[1:]
    if not isinstance(pred, np.ndarray):
        raise UnsupportedPrimitiveError("select_n: the mask depends on the arguments through a differentiable path")
    # Σ_k case_k · [pred == k]: exact for finite cases (x·1 + y·0 = x); an inf/nan in an unselected
    # branch poisons the result, which JAX's select would hide.
    out = None
    for k, c in enumerate(cases):
        m = np.broadcast_to(np.asarray(pred).astype(np.int64) == k, aval.shape).astype(r.tape.dtype)
        term = r.var(c) * m
        out = term if out is None else out + term
    return out


def _identity(r, xs, p, aval):
    return r.var(xs[0])


def _convert(r, xs, p, aval):
    if np.dtype(p["new_dtype"]).kind != "f":
        raise UnsupportedPrimitiveError(f"convert_element_type to {p['new_dtype']} of a differentiable value")
    return r.var(xs[0])  # the tape keeps its own dtype (float64): a cast to float32 is not replayed


RULES = {
    "add": _bin(lambda a, b: a + b), "add_any": _bin(lambda a, b: a + b),
    "sub": _bin(lambda a, b: a - b), "mul": _bin(lambda a, b: a * b), "div": _bin(lambda a, b: a / b),
    "max": _bin(tg.maximum), "min": _min,
    "neg": _un("neg"), "exp": _un("exp"), "log": _un("log"), "tanh": _un("tanh"), "logistic": _un("sigmoid"),
    "sqrt": _un("sqrt"), "abs": _un("abs"), "square": _un("square"),
    "rsqrt": lambda r, xs, p, aval: r.tape.apply(O.rdivs, r.tape.apply(O.sqrt, r.var(xs[0])), None, 1.0),
    "integer_pow": _integer_pow, "pow": _pow,
    "dot_general": _dot_general, "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda r, xs, p, aval: _reshape(r, r.var(xs[0]), aval.shape),
    "squeeze": lambda r, xs, p, aval: _reshape(r, r.var(xs[0]), aval.shape),
    "expand_dims": lambda r, xs, p, aval: _reshape(r, r.var(xs[0]), aval.shape),
    "transpose": lambda r, xs, p, aval: _permute(r, r.var(xs[0]), p["permutation"]),
    "reduce_sum": _reduce("sum"), "reduce_max": _reduce("max"), "reduce_min": _reduce_min,
    "slice": _slice, "concatenate": _concatenate, "select_n": _select_n,
    "convert_element_type": _convert, "copy": _identity, "copy_p": _identity, "optimization_barrier": _identity,
}
# Piecewise-constant results (zero derivative): evaluated on the values, recorded as constants.
CONSTANT = {"eq", "ne", "gt", "ge", "lt", "le", "sign", "floor", "ceil", "round", "argmax", "argmin",
            "and", "or", "not", "xor", "is_finite", "iota", "stop_gradient", "population_count"}
# Calls replayed by their primal body (param holding it).
INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


def _open(j):
    """(jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    return (j.jaxpr, list(j.consts)) if hasattr(j, "consts") else (j, [])


def _scan(jaxpr, tainted, bad):
    """Which outputs depend on the arguments; collect primitives that cannot replay on such values."""
    env = {}

    def t(x):
        return False if isinstance(x, _core.Literal) else env.get(x, False)

    for v, flag in zip(jaxpr.invars, tainted):
        env[v] = flag
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [t(x) for x in eqn.invars]
        if name in INLINE:
            body, _ = _open(eqn.params[INLINE[name]])
            outs = _scan(body, ins[len(ins) - len(body.invars):], bad)
        elif name in CONSTANT or not any(ins):
            outs = [False] * len(eqn.outvars)
        else:
            if name not in RULES:
                bad.add(name)
            outs = [True] * len(eqn.outvars)
        for v, flag in zip(eqn.outvars, outs):
            env[v] = flag
    return [t(x) for x in jaxpr.outvars]


def _summary(eqn):
    """One line for an equation; a call shows its name instead of its body."""
    lines = str(eqn).strip().splitlines()
    if len(lines) == 1:
        return lines[0]
    name = re.search(r"\bname=(\S+)", str(eqn))
    return f"{lines[0]}name={name.group(1) if name else '?'}{lines[-1].strip()}"


def _eval_jax(eqn, vals):
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _diff(t, j):
    t, j = np.asarray(t, np.float64), np.asarray(j, np.float64)
    if t.shape != j.shape:
        return np.inf, np.inf
    if not t.size:
        return 0.0, 0.0
    both = np.isnan(t) & np.isnan(j) | (t == j)
    d = np.where(both, 0.0, np.abs(t - j))
    a = float(d.max())
    scale = float(np.abs(np.where(np.isfinite(j), j, 0.0)).max())
    return a, (a / scale if scale else (0.0 if a == 0 else np.inf))


class _Replay:
    """Walks a jaxpr, recording each equation on the tape and evaluating it with JAX alongside."""

    def __init__(self, tape, rtol, compare=True):
        self.tape, self.rtol, self.compare = tape, rtol, compare
        self.index = 0
        self.divergence = None
        self.eqns = []           # (index, eqn, tape invals, jax invals) in replay order

    def var(self, x):
        if isinstance(x, tg.Var):
            return x
        return self.tape.const(np.asarray(x, dtype=self.tape.dtype))

    def value(self, x):
        return np.asarray(self.tape.value(x)) if isinstance(x, tg.Var) else np.asarray(x)

    def run(self, jaxpr, consts, args, jargs):
        env, jenv = {}, {}

        def read(x):
            if isinstance(x, _core.Literal):
                return np.asarray(x.val), x.val
            return env[x], jenv[x]

        for v, c in zip(jaxpr.constvars, consts):
            env[v], jenv[v] = np.asarray(c), c
        for v, a, j in zip(jaxpr.invars, args, jargs):
            env[v], jenv[v] = a, j
        for eqn in jaxpr.eqns:
            ins = [read(x) for x in eqn.invars]
            xs, js = [i[0] for i in ins], [i[1] for i in ins]
            name = eqn.primitive.name
            if name in INLINE:
                body, bconsts = _open(eqn.params[INLINE[name]])
                n = len(body.invars)
                outs, jouts = self.run(body, bconsts, xs[len(xs) - n:], js[len(js) - n:])
            else:
                k = self.index
                self.index += 1
                self.eqns.append((k, eqn, xs, js))
                jouts = _eval_jax(eqn, js)
                if name in CONSTANT or not any(isinstance(x, tg.Var) for x in xs):
                    outs = [np.asarray(o) for o in _eval_jax(eqn, [self.value(x) for x in xs])]
                else:
                    outs = [RULES[name](self, xs, eqn.params, eqn.outvars[0].aval)]
                if self.compare and self.divergence is None:
                    for o, jo in zip(outs, jouts):
                        if np.asarray(jo).dtype.kind == "f":
                            a, rel = _diff(self.value(o), jo)
                            if rel > self.rtol:
                                self.divergence = Divergence(k, _summary(eqn), "value", a, rel)
                                break
            for v, o, jo in zip(eqn.outvars, outs, jouts):
                env[v], jenv[v] = o, jo
        return [read(x)[0] for x in jaxpr.outvars], [read(x)[1] for x in jaxpr.outvars]


def _local_vjp(eqn, jvals, rtol, rng):
    """Tape backward vs ``jax.vjp`` of one equation at JAX's input values; None when they agree."""
    idx = [k for k, (x, v) in enumerate(zip(eqn.invars, jvals))
           if not isinstance(x, _core.Literal) and np.asarray(v).dtype.kind == "f"]
    if not idx or len(eqn.outvars) != 1 or np.dtype(eqn.outvars[0].aval.dtype).kind != "f":
        return None

    def f(*diff):
        vals = list(jvals)
        for k, d in zip(idx, diff):
            vals[k] = d
        return _eval_jax(eqn, vals)[0]

    out, vjp = jax.vjp(f, *(jnp.asarray(jvals[k]) for k in idx))
    ct = rng.standard_normal(np.shape(out))
    jgrads = vjp(jnp.asarray(ct, out.dtype))
    tape = tg.Tape()
    xs = [tape.param(np.asarray(v, np.float64)) if k in idx else np.asarray(v) for k, v in enumerate(jvals)]
    r = _Replay(tape, rtol, compare=False)
    jaxpr = SimpleNamespace(constvars=[], invars=[v for v in eqn.invars if not isinstance(v, _core.Literal)],
                            outvars=eqn.outvars, eqns=[eqn])  # all _Replay.run reads of a jaxpr
    args = [x for x, v in zip(xs, eqn.invars) if not isinstance(v, _core.Literal)]
    (y,), _ = r.run(jaxpr, [], args, [jvals[k] for k, v in enumerate(eqn.invars) if not isinstance(v, _core.Literal)])
    if not isinstance(y, tg.Var):
        return None
    tape.backward(y, seed=ct)
    worst = (0.0, 0.0)
    for k, jg in zip(idx, jgrads):
        worst = max(worst, _diff(tape.grad(xs[k]), jg), key=lambda d: d[1])
    return worst if worst[1] > rtol else None


def check_grads(f, *args, rtol=1e-12, seed=0):
    """Check ``jax.grad(f)`` against tapegrad's reverse sweep of ``f``'s jaxpr; returns a ``GradReport``.

    ``f`` is any scalar-valued function written in ``jax.numpy``/``lax``; ``args`` are float arrays or
    pytrees of them (every leaf is differentiated). Unsupported primitives on differentiable values
    raise ``UnsupportedPrimitiveError`` naming all of them; anything computed from constants only is
    evaluated by JAX and enters the tape as a constant. Replayed in float64.

    >>> import interop
    >>> r = interop.check_grads(lambda w: interop.jnp.tanh(w @ w).sum(), interop.jnp.eye(3))
    >>> r.ok, r.grads[0].shape, r.max_rel[0] <= 1e-12
    (True, (3, 3), True)
    """
    leaves, tree = jax.tree.flatten(args)
    leaves = [jnp.asarray(x, jnp.float64) if np.asarray(x).dtype.kind in "fiu" else jnp.asarray(x) for x in leaves]
    flat = lambda *xs: f(*jax.tree.unflatten(tree, list(xs)))  # noqa: E731
    closed = jax.make_jaxpr(flat)(*leaves)
    jaxpr, consts = closed.jaxpr, closed.consts
    if len(jaxpr.outvars) != 1 or np.shape(jaxpr.outvars[0].aval) != ():
        raise ValueError(f"check_grads: f must return one scalar (as jax.grad needs), got "
                         f"{[str(v.aval) for v in jaxpr.outvars]}")
    bad = set()
    _scan(jaxpr, [True] * len(leaves), bad)
    if bad:
        raise UnsupportedPrimitiveError(f"check_grads: cannot replay {sorted(bad)} on a tape (applied to values "
                                        f"that depend on the arguments); supported: {sorted(RULES)} plus "
                                        f"calls {sorted(INLINE)} and piecewise-constant {sorted(CONSTANT)}")
    tape = tg.Tape()
    params = [tape.param(np.asarray(x)) for x in leaves]
    rep = _Replay(tape, rtol)
    (out,), (jout,) = rep.run(jaxpr, consts, params, leaves)
    jvalue, jgrads = jax.value_and_grad(flat, argnums=tuple(range(len(leaves))))(*leaves)
    if isinstance(out, tg.Var):
        tape.backward(out)
        grads = [np.array(tape.grad(p)) for p in params]
        value = float(tape.value(out))
    else:
        grads, value = [np.zeros(np.shape(x)) for x in leaves], float(out)
    diffs = [_diff(g, jg) for g, jg in zip(grads, jgrads)]
    ok = all(r <= rtol for _, r in diffs)
    report = GradReport(ok=ok, grads=jax.tree.unflatten(tree, grads),
                        jax_grads=jax.tree.unflatten(tree, [np.asarray(g) for g in jgrads]),
                        value=value, jax_value=float(jvalue), max_abs=tuple(a for a, _ in diffs),
                        max_rel=tuple(r for _, r in diffs), rtol=rtol, first_divergence=rep.divergence,
                        n_eqns=rep.index)
    if not ok and rep.divergence is None:
        rng = np.random.default_rng(seed)
        for k, eqn, _, js in _top_level(jaxpr, consts, leaves, rep):
            d = _local_vjp(eqn, js, rtol, rng)
            if d is not None:
                report.first_divergence = Divergence(k, _summary(eqn), "vjp", *d)
                break
    return report


def _top_level(jaxpr, consts, leaves, rep):
    """Equations in evaluation order with JAX's input values, calls as single units before their bodies.

    The local VJP check must see a ``custom_vjp_call`` whole (that is where a user's rule lives), so
    this walks the jaxpr again, yielding each call before the equations inside it.
    """
    out = []
    k = [0]

    def walk(jx, cs, vals):
        env = dict(zip(jx.constvars, cs))
        env.update(zip(jx.invars, vals))
        read = lambda x: x.val if isinstance(x, _core.Literal) else env[x]  # noqa: E731
        for eqn in jx.eqns:
            js = [read(x) for x in eqn.invars]
            name = eqn.primitive.name
            if name in INLINE:
                out.append((k[0], eqn, None, js))
                body, bcs = _open(eqn.params[INLINE[name]])
                res = walk(body, bcs, js[len(js) - len(body.invars):])
            else:
                out.append((k[0], eqn, None, js))
                k[0] += 1
                res = _eval_jax(eqn, js)
            env.update(zip(eqn.outvars, res))
        return [read(x) for x in jx.outvars]

    walk(jaxpr, consts, leaves)
    return out
