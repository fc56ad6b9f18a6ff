"""interop.check_grads: jaxpr replay on a tape against jax.grad."""
import numpy as np
import pytest

interop = pytest.importorskip("interop")
from interop import jax, jnp  # noqa: E402

RNG = np.random.default_rng(3)
X = jnp.asarray(RNG.standard_normal((6, 4)))
Y = jnp.asarray(np.eye(3)[RNG.integers(0, 3, 6)])
PARAMS = {"W1": jnp.asarray(RNG.standard_normal((4, 5)) * 0.5), "b1": jnp.zeros(5),
          "W2": jnp.asarray(RNG.standard_normal((5, 3)) * 0.5), "b2": jnp.zeros(3)}


def mlp_loss(p):
    h = jax.nn.relu(X @ p["W1"] + p["b1"])
    logits = h @ p["W2"] + p["b2"]
    return -jnp.mean(jnp.sum(Y * jax.nn.log_softmax(logits), axis=-1))


@jax.custom_vjp
def good_tanh(x):
    return jnp.tanh(x)


good_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda t, g: (g * (1.0 - t * t),))


@jax.custom_vjp
def bad_tanh(x):
    return jnp.tanh(x)


bad_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda t, g: (g * (1.0 - t * t) * (1 + 1e-9),))


def test_mlp_pytree_agrees_with_jax_grad():
    r = interop.check_grads(mlp_loss, PARAMS)
    assert r.ok, str(r)
    (g,) = r.grads
    assert set(g) == set(PARAMS) and g["W1"].shape == (4, 5)
    assert max(r.max_rel) <= 1e-12 and r.first_divergence is None
    assert abs(r.value - r.jax_value) <= 1e-12 * abs(r.jax_value)


def test_many_primitives():
    def f(x, w):
        z = jax.lax.stop_gradient(jax.nn.sigmoid(x))
        return (jnp.sum(jnp.where(x > 0, x, 0.0) ** 3 * z) + jax.jit(jnp.tanh)(x).sum() + jnp.max(x)
                + jnp.min(x) + jnp.square(x).sum() + jnp.concatenate([x, 2 * x]).sum() + (x[1:3] @ w)[0]
                + jnp.einsum("ij,kj->ik", w, w).sum() + jnp.exp(-x).mean() + jnp.log(x * x + 1).sum()
                + (1.0 / jnp.sqrt(x * x + 2)).sum() + w.T.reshape(-1)[2] + jnp.abs(x).sum() / x.shape[0]
                + jnp.maximum(x, 0.3).sum() + good_tanh(x).sum() + jnp.expand_dims(x, 0).squeeze().sum()
                + jnp.einsum("bij,bjk->bik", w[None] * x[:2, None, None], w[None]).sum())
    r = interop.check_grads(f, jnp.asarray(RNG.standard_normal(4)), jnp.asarray(RNG.standard_normal((2, 2))))
    assert r.ok, str(r)


def test_wrong_custom_vjp_is_caught_and_located():
    r = interop.check_grads(lambda x: bad_tanh(x * 2.0).sum() + x.sum(), jnp.linspace(-1, 1, 5))
    assert not r.ok and r.max_rel[0] > 1e-12
    d = r.first_divergence
    assert d.kind == "vjp" and "custom_vjp_call" in d.eqn and "bad_tanh" in d.eqn and d.index == 1
    assert "MISMATCH" in str(r)


def test_unsupported_primitives_are_all_named():
    with pytest.raises(interop.UnsupportedPrimitiveError, match=r"\['cumsum', 'sin'\]"):
        interop.check_grads(lambda x: jnp.sin(x).sum() + jnp.cumsum(x).sum(), jnp.ones(3))
    # on constants only they are fine: JAX evaluates them
    r = interop.check_grads(lambda x: (x * jnp.sin(jnp.arange(3.0))).sum(), jnp.ones(3))
    assert r.ok


def test_non_scalar_output_is_refused():
    with pytest.raises(ValueError, match="one scalar"):
        interop.check_grads(lambda x: x * 2, jnp.ones(3))


def test_forward_divergence_is_located():
    # The tape keeps float64 through a cast to float32 (documented); JAX rounds. Gradients agree
    # (the cast's derivative is 1), but the forward values part at the cast: equation 0.
    r = interop.check_grads(lambda x: (x.astype(jnp.float32).astype(jnp.float64) * 3.0).sum(), jnp.linspace(0.1, 1, 4))
    assert r.ok
    d = r.first_divergence
    assert d.kind == "value" and d.index == 0 and "convert_element_type" in d.eqn and 1e-9 < d.max_rel < 1e-6
