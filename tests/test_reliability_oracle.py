"""The oracle on real code with a Python ``if`` on a traced value: ``check_grads`` tries the jax.jit-style
trace, and where it fails that way, the ``concrete=True`` trace (as ``jax.grad`` runs f), saying so in the
report. Before, both cases raised ``TracingError`` unless the caller knew to pass ``concrete=True``.
Each gradient is checked against ``jax.grad`` (the report's own comparison) and central differences."""
import numpy as np
import pytest

import interop
from interop import jax, jnp

optax = pytest.importorskip("optax")


def central(f, x, h):
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        out[i] = (f(x + e) - f(x - e)) / (2 * h)
    return out


def auto_noted(r):
    return r.concrete and any(n.startswith("concrete, chosen automatically: f branches in Python on a traced value")
                              and "concrete=False refuses such an f instead" in n for n in r.notes)


def inner(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def meta_loss(peak, w, x, y):
    """The loss after four SGD steps whose learning rate follows optax's warmup-cosine schedule of peak
    ``peak``: its meta-gradient in ``peak`` (the schedule reads ``peak_value == 0.0`` in Python)."""
    sched = optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps=2, decay_steps=8, end_value=1e-3)
    opt = optax.sgd(sched)
    state = opt.init(w)
    for _ in range(4):
        u, state = opt.update(jax.grad(inner)(w, x, y), state, w)
        w = optax.apply_updates(w, u)
    return inner(w, x, y)


def test_an_optax_schedules_meta_gradient_is_checked_concretely_and_says_so():
    rng = np.random.default_rng(0)
    w, x, y = (jnp.asarray(rng.standard_normal(s)) for s in ((3, 2), (8, 3), (8, 2)))
    peak = jnp.asarray(0.3)
    r = interop.check_grads(meta_loss, peak, w, x, y, argnums=(0, 1))
    assert r.ok and r.verdict == "agree", str(r)
    assert auto_noted(r) and len(r.branches) == 1 and "peak_value == 0.0" in r.branches[0], str(r)
    with jax.enable_x64(True):
        fd_peak = central(lambda p: float(meta_loss(jnp.asarray(p), w, x, y)), 0.3, 1e-6)
        fd_w = central(lambda v: float(meta_loss(peak, jnp.asarray(v), x, y)), np.asarray(w), 1e-6)
    np.testing.assert_allclose(float(r.grads[0]), fd_peak, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.grads[1]), fd_w, rtol=1e-5, atol=1e-9)
    again = interop.check_grads(meta_loss, peak, w, x, y, argnums=(0, 1))   # known now: concrete at once
    assert again.ok and auto_noted(again) and "as on an earlier call" in str(again)


def rollout(state, restitution):
    """A ball under gravity on a floor, 60 steps of semi-implicit Euler: it bounces (a Python branch on
    the traced height) and loses energy at each bounce; the loss is the final height plus speed²/2."""
    h, v = state[0], state[1]
    dt, g = 0.02, 9.81
    for _ in range(60):
        v = v - g * dt
        h = h + v * dt
        if h < 0:
            h, v = -h * restitution, -v * restitution
    return h + 0.5 * v * v


def test_a_physics_rollout_with_a_python_branch_is_checked_concretely_and_says_so():
    state, e = jnp.asarray([0.5, 0.3]), jnp.asarray(0.8)
    with pytest.raises(interop.TracingError, match="traces f the way jax.jit does"):
        interop.check_grads(rollout, state, e, concrete=False)
    r = interop.check_grads(rollout, state, e)
    assert r.ok and r.verdict == "agree", str(r)
    assert auto_noted(r) and len(r.branches) == 1 and "if h < 0" in r.branches[0], str(r)
    assert "bool → False" in r.branches[0] and ", True, " in r.branches[0]   # it flew, bounced twice, flew
    with jax.enable_x64(True):
        want = jax.grad(rollout, argnums=(0, 1))(jnp.asarray([0.5, 0.3], jnp.float64), jnp.asarray(0.8, jnp.float64))
        fd_state = central(lambda s: float(rollout(jnp.asarray(s), e)), np.asarray([0.5, 0.3]), 1e-7)
        fd_e = central(lambda k: float(rollout(state, jnp.asarray(k))), 0.8, 1e-7)
    np.testing.assert_allclose(np.asarray(r.grads[0]), np.asarray(want[0]), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(r.grads[0]), fd_state, rtol=1e-6)
    np.testing.assert_allclose(float(r.grads[1]), fd_e, rtol=1e-6)


def test_what_the_concrete_trace_cannot_run_either_says_it_was_tried():
    f = lambda x: jnp.sin(x).sum() * float(x.sum())  # noqa: E731
    with pytest.raises(interop.TracingError, match=r"^f branches in Python on a traced value, so check_grads ran it as "
                                                   r"concrete=True runs it, after the jax.jit-style trace failed: f with "
                                                   r"its arguments' values readable, as jax.grad does, but f needs a "
                                                   r"value that is abstract even there: float\(\)"):
        interop.check_grads(f, jnp.ones(3))
