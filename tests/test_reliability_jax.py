"""The JAX-facing layer under unusual calls: each answered by JAX's own behaviour (as lax.scan or jax.grad
would answer) or by our error naming the argument and the fix, never by an internal call's error."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import interop  # noqa: E402


def loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)


def setup(opt=None):
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    step, state = interop.train_step(loss, p, x, optimizer=opt or optax.adam(1e-2))
    return p, x, step, state


def test_jax_grad_through_a_training_step_says_the_step_is_not_differentiable():
    p, x, step, state = setup()
    with pytest.raises(interop.TransformError, match=r"program_episode: a training episode .* is not "
                                                     r"differentiable: differentiate the loss"):
        jax.grad(lambda w: step((w, state[1]), x)[0])(state[0])


def test_grad_of_value_and_grad_s_value_under_checkpoint_says_first_order_only():
    p, x, _, _ = setup()
    vg = interop.value_and_grad(loss)
    for f in (lambda p: vg(p, x)[0], jax.checkpoint(lambda p: vg(p, x)[0])):
        with pytest.raises(interop.TransformError, match=r"program_call: forward-mode and higher-order "
                                                         r"differentiation .* first-order only"):
            jax.grad(f)(p)


def test_an_optax_count_that_is_not_a_scalar_is_named():
    p, x, step, state = setup()
    adam, *rest = state[1]
    bad = (state[0], (adam._replace(count=jnp.zeros((1,), jnp.int32)), *rest))
    with pytest.raises(interop.ProgramError, match=r"the step count must be a scalar integer \(optax's count is "
                                                   r"int32\[\]\), got int32\[1\]"):
        step(bad, x)


def test_an_empty_parameter_leaf_gets_an_empty_gradient_and_trains_as_optax():
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((3, 2))), "none": jnp.zeros((0, 2))}
    x = jnp.asarray(rng.standard_normal((4, 3)))
    fn = lambda p, x: jnp.sum((x @ p["w"]) ** 2) + jnp.sum(p["none"])   # noqa: E731
    with jax.enable_x64(True):
        p, x = jax.tree.map(lambda a: a.astype(jnp.float64), p), x.astype(jnp.float64)
        (v, g), (jv, jg) = interop.value_and_grad(fn)(p, x), jax.value_and_grad(fn)(p, x)
        assert g["none"].shape == (0, 2) and np.allclose(g["w"], jg["w"], rtol=1e-12, atol=0)
        opt = optax.adam(0.1)
        step, state = interop.train_step(fn, p, x, optimizer=opt)
        assert step.native_update, step.why
        ref = (p, opt.init(p))
        for _ in range(3):
            _, state = step(state, x)
            u, s = opt.update(jax.grad(fn)(ref[0], x), ref[1], ref[0])
            ref = (optax.apply_updates(ref[0], u), s)
        assert state[0]["none"].shape == (0, 2) and state[1][0].mu["none"].shape == (0, 2)
        assert np.allclose(state[0]["w"], ref[0]["w"], rtol=1e-10, atol=0)


def test_a_nan_in_the_example_batch_keeps_the_native_update_and_trains_as_optax():
    p, x, _, _ = setup()
    x = x.at[0, 0].set(jnp.nan)
    opt = optax.adam(1e-2)
    step, state = interop.train_step(loss, p, x, optimizer=opt)
    assert step.native_update, step.why
    _, state = step(state, x)
    ref = optax.apply_updates(p, opt.update(jax.grad(loss)(p, x), opt.init(p), p)[0])
    for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref)):
        assert np.array_equal(np.isnan(a), np.isnan(b))
