"""Optimizer parity: tapegrad Adam (optax ε form) ± L2 ± clipping vs the matching optax chain, 100 steps.

Findings (also in interop/capture/parity.py):
- optax run op by op: bit-identical for Adam, Adam + L2 and SGD over 100 steps, and with clipping as
  long as it never triggers. With active clipping the global norm is summed in another order (BLAS
  dots added in registration order vs XLA's per-leaf reduction): parameters differ from the first
  clipped steps by about an ulp.
- optax inside jax.jit: XLA CPU fuses ``p + (−lr)·u`` (and the moment updates) into FMAs
  (``multiply_add_fusion``), one rounding instead of two, so parameters differ from step 1 by ~1 ulp.
"""
import numpy as np
import pytest

import tapegrad as tg

interop = pytest.importorskip("interop")
chex = pytest.importorskip("chex")
from interop import jnp  # noqa: E402
from interop.capture.parity import compare_with_optax, optax_chain  # noqa: E402

RNG = np.random.default_rng(0)
INIT = [RNG.standard_normal((8, 5)), RNG.standard_normal(5)]
NOISE = [[RNG.standard_normal(a.shape) for a in INIT] for _ in range(100)]


def grad_fn(k, ps):
    return [np.tanh(p * 1.7) + 0.3 * n for p, n in zip(ps, NOISE[k])]


def adam(clip=None, l2=(0.0, 0.0)):
    opt = tg.Adam(1e-2, clip=clip)
    opt.l2 = list(l2)  # compare_with_optax registers the parameters with these coefficients
    return opt


@pytest.mark.parametrize("make", [lambda: adam(), lambda: adam(l2=(1e-2, 0.0)), lambda: adam(clip=100.0),
                                  lambda: tg.SGD(0.1)], ids=["adam", "adam_l2", "adam_clip_inactive", "sgd"])
def test_bit_identical_to_optax_op_by_op(make):
    r = compare_with_optax(make(), INIT, grad_fn, steps=100, jit=False)
    assert r.identical and r.max_abs == 0.0, r


def test_adam_state_equals_optax_state_op_by_op():
    """Beyond the parameters compare_with_optax checks: the moments and the step count, leaf for leaf."""
    opt, tape = tg.Adam(1e-2), tg.Tape()
    ws = [tape.param(a) for a in INIT]
    for w in ws:
        opt.add(tape, w)
    mark = tape.mark()
    tx = optax_chain(opt)
    params = [jnp.asarray(a) for a in INIT]
    state = tx.init(params)
    for k in range(20):
        g = grad_fn(k, [np.asarray(tape.value(w)) for w in ws])
        tape.backward(sum((w * tape.const(gk)).sum() for w, gk in zip(ws, g)))   # injects g exactly
        opt.step()
        tape.reset_to(mark)
        updates, state = tx.update([jnp.asarray(gk) for gk in grad_fn(k, [np.asarray(p) for p in params])],
                                   state, params)
        params = [p + u for p, u in zip(params, updates)]
    ours = opt.state_dict()
    chex.assert_trees_all_equal(params, [tape.value(w) for w in ws])
    chex.assert_trees_all_equal((state[0].mu, state[0].nu), (ours["mu"], ours["nu"]))
    assert int(state[0].count) == ours["count"] == 20


@pytest.mark.parametrize("l2", [(0.0, 0.0), (1e-2, 0.0)], ids=["clip", "clip_l2"])
def test_active_clipping_differs_only_by_the_norm_rounding(l2):
    r = compare_with_optax(adam(clip=1.0, l2=l2), INIT, grad_fn, steps=100, jit=False)
    assert r.first_diff is not None and r.first_diff >= 1 and r.max_rel < 1e-14, r


def test_jitted_optax_differs_by_fma_contraction_only():
    r = compare_with_optax(adam(), INIT, grad_fn, steps=100, jit=True)
    assert r.first_diff == 1 and r.max_rel < 1e-14, r


def test_optax_chain_refuses_what_has_no_optax_twin():
    with pytest.raises(ValueError, match="eps_mode"):
        optax_chain(tg.Adam(1e-3, eps_mode="hat"))
    with pytest.raises(ValueError, match="clip_mode"):
        optax_chain(tg.Adam(1e-3, clip=1.0, clip_mode="torch"))
