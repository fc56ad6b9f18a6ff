"""The oracle on products of a bool or integer operand with a float one: ``dot_general`` takes mixed
dtypes with a ``preferred_element_type`` (a matmul of a mask, of an integer one-hot matrix), and the
replay promotes the data operand as JAX does (it raised ``ArgumentError: matmul ... got bool data``)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import interop  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))


def _fd(f, w, eps=1e-6):
    """Central differences of f at w, element by element (the reference independent of both AD sides)."""
    w = np.asarray(w)
    g = np.zeros_like(w)
    for i in np.ndindex(w.shape):
        d = np.zeros_like(w)
        d[i] = eps
        g[i] = (float(f(jnp.asarray(w + d))) - float(f(jnp.asarray(w - d)))) / (2 * eps)
    return g


@pytest.mark.parametrize("data", ["bool mask", "int8 one-hot"])
def test_a_product_of_data_and_floats_replays_and_matches_finite_differences(data):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        W = jnp.asarray(rng.standard_normal((5, 3)))
        x = jnp.asarray(rng.standard_normal((4, 5)))
        labels = jnp.asarray(rng.integers(0, 5, 4))

        def f(W, x, labels):
            m = x > 0.2 if data == "bool mask" else jax.nn.one_hot(labels, 5, dtype=jnp.int8)
            h = lax.dot_general(m, W, DIMS, preferred_element_type=jnp.float64)
            return jnp.sum(jnp.tanh(h * (x @ W)))

        report = interop.check_grads(f, W, x, labels, argnums=0)
        assert report.ok, str(report)   # within check_grads' rtol of 1e-12 against jax.grad
        want = jax.grad(f)(W, x, labels)
        fd = _fd(lambda w: f(w, x, labels), W)
        np.testing.assert_allclose(np.asarray(want), fd, rtol=0, atol=1e-7)
