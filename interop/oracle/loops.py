"""The oracle's loops, branches and solves: ``scan``/``while`` unrolled on the tape with their concrete
trip counts, ``cond``/``switch`` by the branch JAX takes, ``custom_linear_solve`` by one refinement step.

Each gets JAX's values of its body from one compiled call (``Plan.scan_values``: a ``lax.scan`` whose
outputs are every body slot at every iteration; a ``while`` first counts its trips in JAX), so the
replay of iteration ``t`` compares with, and takes constants from, JAX's own iteration ``t``.
"""
import numpy as np

import tapegrad as tg

from .._jax import jax, jnp, scan_counts
from .replay import Plan, compiled
from .table import CONTROL_RULES

_LOOP_FNS = {}   # (kind, equation id, operand types) -> (equation, compiled trip counter)


def row(r, x, t):
    """Row ``t`` of a Var along axis 0, the axis dropped."""
    s = tuple([(t, t + 1)] + [(0, n) for n in x.shape[1:]])
    v = r.tape.apply(tg.ops.slice, x, None, s)
    return r.tape.apply(tg.ops.reshape, v, None, tuple(x.shape[1:]))


def _unroll(r, body, jvals, order, consts, carry, xs_rows, nk):
    """Replay ``body`` once per iteration ``t`` in ``order``; returns the final carry and ys per iteration."""
    ys = {}
    for t in order:
        env = jvals.at(t)
        ins = list(consts) + list(carry) + [row(r, x, t) if x is not None else None for x in xs_rows]
        tenv = {s: v for s, v in zip(body.in_slots, ins) if v is not None}
        r.where.append(f"iteration {t}")
        outs = r.run(body, tenv, env)
        r.where.pop()
        carry = outs[:nk]
        ys[t] = (outs[nk:], env)
    return carry, ys


def _sig(jin):
    return tuple((tuple(jax.typeof(a).shape), str(jax.typeof(a).dtype)) for a in jin)


def scan_env(eqn, jin):
    """(body plan, per-iteration values, iteration order) of a ``scan`` at JAX's operands ``jin``."""
    p = eqn.params
    (nc, nk), n, rev = scan_counts(p), p["length"], p["reverse"]
    body = Plan.of(p["jaxpr"])
    jvals = body.scan_values(("scan", n, rev, nc, _sig(jin)), jin[:nc], jin[nc:nc + nk], jin[nc + nk:], n, rev, nc)
    return body, jvals, (range(n - 1, -1, -1) if rev else range(n))


def batched(eqn):
    """Whether a ``while``'s predicate is a vector (``vmap`` of a loop whose stopping depends on the example)."""
    return tuple(eqn.params["cond_jaxpr"].out_avals[0].shape) != ()


def _frozen_body(eqn):
    """A batched ``while``'s body as JAX runs it: its lanes advance where the predicate holds and stay
    frozen where it does not, ``select(pred, body(c), c)``, the predicate broadcast along the carries'
    leading axes. Its inputs are the cond constants, the body constants, then the carry."""
    hit = _LOOP_FNS.get(("frozen", id(eqn)))
    if hit is None or hit[0] is not eqn:
        p = eqn.params
        cn, bn, cj, bj = p["cond_nconsts"], p["body_nconsts"], p["cond_jaxpr"], p["body_jaxpr"]

        def frozen(*ins):
            carry = list(ins[cn + bn:])
            pred = jax.core.eval_jaxpr(cj.jaxpr, cj.consts, *ins[:cn], *carry)[0]
            new = jax.core.eval_jaxpr(bj.jaxpr, bj.consts, *ins[cn:cn + bn], *carry)
            return [jax.lax.select(jax.lax.broadcast_in_dim(pred, jnp.shape(c), tuple(range(pred.ndim))), n, c)
                    for n, c in zip(new, carry)]
        closed = jax.make_jaxpr(frozen)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars])
        hit = _LOOP_FNS[("frozen", id(eqn))] = (eqn, closed)
    return Plan.of(hit[1])


def while_env(eqn, jin):
    """(body plan, per-iteration values, trip count) of a ``while`` at JAX's operands ``jin``.

    A batched predicate runs the loop while any lane is active, finished lanes frozen (``_frozen_body``,
    whose constants are the cond's and the body's)."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cplan = Plan.of(p["cond_jaxpr"])
    body = _frozen_body(eqn) if batched(eqn) else Plan.of(p["body_jaxpr"])
    b0 = 0 if batched(eqn) else cn     # where the body's constants start among the operands
    sig = _sig(jin)
    count = _LOOP_FNS.get(("count", id(eqn), sig))
    if count is None or count[0] is not eqn:
        def trips(cc_consts, bc_consts, cconsts, bconsts, init):
            def cond(c):
                vals, _ = cplan.evaluate(cc_consts, list(cconsts) + list(c[0]))
                return jnp.any(cplan.out_value(vals, cplan.out_slots[0]))

            def step(c):
                vals, _ = body.evaluate(bc_consts, list(bconsts) + list(c[0]))
                new = [jnp.asarray(body.out_value(vals, s), a.dtype) for s, a in zip(body.out_slots, c[0])]
                return new, c[1] + 1
            return jax.lax.while_loop(cond, step, (list(init), jnp.int64(0)))[1]
        if len(_LOOP_FNS) > 256:
            _LOOP_FNS.clear()
        count = _LOOP_FNS[("count", id(eqn), sig)] = (eqn, compiled(trips))
    n = int(count[1](cplan.const_vals, body.const_vals, jin[:cn], jin[b0:cn + bn], jin[cn + bn:]))
    jvals = body.scan_values(("while", n, sig), jin[b0:cn + bn], jin[cn + bn:], [], n, False, cn + bn - b0)
    return body, jvals, n


def cond_env(eqn, jin):
    """(branch index, branch plan, its values) of the branch JAX takes."""
    branches = eqn.params["branches"]
    k = int(np.clip(int(np.asarray(jin[0])), 0, len(branches) - 1))
    plan = Plan.of(branches[k])
    return k, plan, plan.values(jin[1:])


def loop_envs(eqn, jin):
    """``(label, plan, values)`` for each iteration or the branch taken, in execution order."""
    name = eqn.primitive.name
    if name == "scan":
        body, jvals, order = scan_env(eqn, jin)
        return [(f"iteration {t}", body, jvals.at(t)) for t in order]
    if name == "while":
        body, jvals, n = while_env(eqn, jin)
        return [(f"iteration {t}", body, jvals.at(t)) for t in range(n)]
    k, plan, env = cond_env(eqn, jin)
    return [(f"branch {k}", plan, env)]


def scan_rule(r, st, xs, jenv):
    eqn = st.eqn
    p = eqn.params
    (nc, nk), n = scan_counts(p), p["length"]
    body, jvals, order = scan_env(eqn, [jenv.jax(s) for s in st.ins])
    carry, ys = _unroll(r, body, jvals, order, xs[:nc], xs[nc:nc + nk], xs[nc + nk:], nk)
    outs = list(carry)
    for j in range(len(eqn.outvars) - nk):
        rows = [ys[t][0][j] for t in range(n)]
        if not n or all(v is None for v in rows):
            outs.append(None)
            continue
        rows = [v if v is not None else r.var(ys[t][1].np(body.out_slots[nk + j])) for t, v in enumerate(rows)]
        outs.append(tg.stack(rows, axis=0))
    return outs


def while_rule(r, st, xs, jenv):
    p = st.eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    body, jvals, n = while_env(st.eqn, [jenv.jax(s) for s in st.ins])
    b0 = 0 if batched(st.eqn) else cn
    carry, _ = _unroll(r, body, jvals, range(n), xs[b0:cn + bn], xs[cn + bn:], [], len(xs) - cn - bn)
    return list(carry)


def cond_rule(r, st, xs, jenv):
    k, plan, env = cond_env(st.eqn, [jenv.jax(s) for s in st.ins])
    tenv = {s: v for s, v in zip(plan.in_slots, xs[1:]) if v is not None}
    r.where.append(f"branch {k}")
    outs = r.run(plan, tenv, env)
    r.where.pop()
    return outs


def linear_solve_rule(r, st, xs, jenv):
    """``custom_linear_solve`` as one refinement step from JAX's solution x₀: x = x₀ + solve(b − matvec(x₀)).

    The residual is at rounding level, so the value is x₀; the tape differentiates the replayed
    ``matvec`` (its constants hold A) and the replayed ``solve`` (linear in its right-hand side), which
    gives dx = A⁻¹(db − dA·x₀): the derivative of the solution, whatever the solver.
    """
    eqn = st.eqn
    p = eqn.params
    cl, jx = p["const_lengths"], p["jaxprs"]
    n_mv, n_vm, n_s = cl.matvec, cl.vecmat, cl.solve
    nc = n_mv + n_vm + n_s + cl.transpose_solve
    x0 = [jenv.np(s) for s in st.outs]
    mv = Plan.of(jx.matvec)
    mv_env = mv.values([jenv.jax(s) for s in st.ins[:n_mv]] + [jenv.jax(s) for s in st.outs])
    tenv = {s: v for s, v in zip(mv.in_slots, list(xs[:n_mv])) if v is not None}
    ax = r.run(mv, tenv, mv_env)
    resid, jres = [], []
    for b, sb, a, sa in zip(xs[nc:], st.ins[nc:], ax, mv.out_slots):
        bv = b if b is not None else r.var(jenv.np(sb))
        av = a if a is not None else r.var(mv_env.np(sa))
        resid.append(bv - av)
        jres.append(jnp.asarray(jenv.np(sb) - mv_env.np(sa)))
    sv = Plan.of(jx.solve)
    s_ins = list(range(n_mv + n_vm, n_mv + n_vm + n_s))
    s_env = sv.values([jenv.jax(st.ins[k]) for k in s_ins] + jres)
    tenv = {s: v for s, v in zip(sv.in_slots, [xs[k] for k in s_ins] + resid) if v is not None}
    dx = r.run(sv, tenv, s_env)
    return [r.var(x) + d if d is not None else None for x, d in zip(x0, dx)]


CONTROL_RULES.update({"scan": scan_rule, "while": while_rule, "cond": cond_rule,
                      "custom_linear_solve": linear_solve_rule})
