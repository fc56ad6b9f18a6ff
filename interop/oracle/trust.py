"""Trusted custom rules (``check_grads(trust=…)``): a ``custom_vjp``/``custom_jvp`` call replayed with the
derivative JAX gives it rather than its primal body's.

A rule meant to differ from its body (``optax.scale_gradient``, gradient reversal, straight-through
estimators) is linear in the cotangent at the point JAX ran it, so the tape records it as that
linear map: ``y = y₀ + J·(x − x₀)`` with ``y₀``, ``x₀`` JAX's values and ``J`` the Jacobian
``jax.jacrev`` builds from the custom rule itself. The value is JAX's (``x − x₀`` is zero up to the
replay's rounding), and the tape's backward gives ``Jᵀ·g``: the rule's VJP.
"""
import numpy as np

import tapegrad as tg

from .._jax import jax
from .replay import compiled, custom_name, is_float, of_floats
from .table import CUSTOM, NotReplayable

MAX_ENTRIES = 1 << 24   # the Jacobian is materialised: refused above 16M entries (128 MiB in float64)

_JAC = {}


def _jacobian_fn(eqn, fl, fo):
    key = (id(eqn), tuple(fl), tuple(fo))
    hit = _JAC.get(key)
    if hit is None or hit[0] is not eqn:
        def run(diff_vals, all_vals):
            return jax.jacrev(of_floats(eqn, all_vals, fl, fo), argnums=tuple(range(len(fl))))(*diff_vals)
        if len(_JAC) > 256:
            _JAC.clear()
        hit = _JAC[key] = (eqn, compiled(run))
    return hit[1]


def trusted_rule(r, st, xs, jenv):
    """The step's results on the tape as JAX's values plus the custom rule's linear map of the inputs."""
    eqn = st.eqn
    fl = [i for i, (x, v) in enumerate(zip(xs, eqn.invars)) if isinstance(x, tg.Var) and is_float(v.aval)]
    fo = [j for j, v in enumerate(eqn.outvars) if is_float(v.aval)]
    jin = [jenv.jax(s) for s in st.ins]
    sizes = [int(np.prod(eqn.outvars[j].aval.shape)) * int(np.prod(eqn.invars[i].aval.shape)) for j in fo for i in fl]
    if sum(sizes) > MAX_ENTRIES:
        raise NotReplayable(f"trusted custom rule {custom_name(eqn)}: its Jacobian would have {sum(sizes)} entries "
                            f"(at most {MAX_ENTRIES})")
    jac = _jacobian_fn(eqn, fl, fo)([jin[i] for i in fl], list(jin))
    outs = [None] * len(eqn.outvars)
    for jj, j in enumerate(fo):
        shape = tuple(eqn.outvars[j].aval.shape)
        m = int(np.prod(shape))
        y = r.var(jenv.np(st.outs[j]))
        for ii, i in enumerate(fl):
            n = int(np.prod(eqn.invars[i].aval.shape))
            dx = xs[i] - r.var(jenv.np(st.ins[i]))
            dx = r.tape.apply(tg.ops.reshape, dx, None, (n, 1)) if tuple(dx.shape) != (n, 1) else dx
            J = r.var(np.asarray(jac[jj][ii], np.float64).reshape(m, n))
            term = tg.matmul(J, dx)
            y = y + (r.tape.apply(tg.ops.reshape, term, None, shape) if shape != (m, 1) else term)
        outs[j] = y
    return outs


CUSTOM["trusted"] = trusted_rule
