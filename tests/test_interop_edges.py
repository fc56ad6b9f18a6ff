"""interop edge cases: every argument judged by check_grads, the 64-byte rule, cotangents through program_call."""
import warnings

import numpy as np
import pytest

import tapegrad as tg

interop = pytest.importorskip("interop")
from interop import CopyWarning, jax, jnp  # noqa: E402
from interop.xla import program as P  # noqa: E402

RNG = np.random.default_rng(17)


# ── check_grads judges every argument ────────────────────────────────────────

@jax.custom_vjp
def scaled(x, y):
    return x * y


# correct on x, wrong (by 1e-9 relative) on y
scaled.defvjp(lambda x, y: (x * y, (x, y)), lambda res, g: (g * res[1], g * res[0] * (1 + 1e-9)))


def test_check_grads_catches_a_wrong_vjp_on_the_second_argument():
    x, y = jnp.asarray(RNG.standard_normal(4)), jnp.asarray(RNG.standard_normal(4))
    r = interop.check_grads(lambda x, y: scaled(x, y).sum(), x, y)
    assert not r.ok
    assert r.max_rel[0] <= 1e-12 < r.max_rel[1]
    assert r.first_divergence is not None and "custom_vjp_call" in r.first_divergence.eqn


def test_check_grads_catches_a_wrong_vjp_in_a_later_pytree_leaf():
    args = {"a": jnp.asarray(RNG.standard_normal(3)), "b": jnp.asarray(RNG.standard_normal(3))}
    r = interop.check_grads(lambda p: (jnp.tanh(p["a"]) + scaled(p["a"], p["b"])).sum(), args)
    assert not r.ok and r.max_rel[0] <= 1e-12 < r.max_rel[1]


# ── zero copy needs 64-byte alignment, not 16 or 32 ──────────────────────────

def at_offset(nbytes, n=8):
    """A float64[n] whose data pointer is ``nbytes`` past a 64-byte boundary (a view of a writable buffer)."""
    raw = np.empty(n * 8 + 128, np.uint8)
    start = -raw.ctypes.data % 64 + nbytes
    a = raw[start:start + n * 8].view(np.float64)
    a[:] = np.arange(n)
    assert a.ctypes.data % 64 == nbytes
    return a


@pytest.mark.parametrize("off", [16, 32, 48])
def test_an_array_aligned_to_less_than_64_bytes_is_not_shared(off):
    a = at_offset(off)
    with pytest.raises(ValueError, match=f"{off} bytes past a 64-byte boundary"):
        interop.to_jax(a, copy=False)
    with pytest.warns(CopyWarning, match="64-byte"):
        j = interop.to_jax(a)
    assert j.unsafe_buffer_pointer() != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(j), a)


def test_an_array_on_a_64_byte_boundary_is_shared():
    a = at_offset(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        j = interop.to_jax(a, copy=False)
    assert j.unsafe_buffer_pointer() == a.ctypes.data


# ── program_call's backward scales by the cotangent ──────────────────────────

X = RNG.standard_normal((5, 4))
Y = np.eye(3)[RNG.integers(0, 3, 5)]
W0, B0 = RNG.standard_normal((4, 3)) * 0.5, RNG.standard_normal(3) * 0.1
BACKENDS = ["native", "numpy"] if P.native_library() is not None else ["numpy"]


def model(W, b, x, y):
    return tg.softmax_cross_entropy((x @ W + b).tanh(), y)


def tape_grads():
    tape = tg.Tape()
    W, b = tape.param(W0), tape.param(B0)
    loss = model(W, b, tape.const(X), tape.const(Y))
    tape.backward(loss)
    return np.array(tape.grad(W)), np.array(tape.grad(b)), (tape, loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_program_call_backward_scales_the_gradients_by_the_cotangent(backend):
    gW, gb, (tape, loss) = tape_grads()
    f = interop.program_call(tg.capture(tape, loss, backend=backend))
    args = tuple(jnp.asarray(a) for a in (W0, B0, X, Y))
    one = jax.jit(jax.grad(f, (0, 1)))(*args)
    # cotangent 1: the program's own gradients (== the tape's for the NumPy replay, within ulps natively)
    np.testing.assert_allclose(np.asarray(one[0]), gW, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(one[1]), gb, rtol=1e-12, atol=1e-15)
    if backend == "numpy":
        assert np.array_equal(np.asarray(one[0]), gW) and np.array_equal(np.asarray(one[1]), gb)
    gW, gb = np.asarray(one[0]), np.asarray(one[1])
    dW, db = jax.jit(jax.grad(lambda W, b, x, y: 3.0 * f(W, b, x, y), (0, 1)))(*args)
    assert np.array_equal(np.asarray(dW), 3.0 * gW) and np.array_equal(np.asarray(db), 3.0 * gb)
    _, vjp = jax.vjp(lambda W, b: f(W, b, *args[2:]), *args[:2])
    dW, db = vjp(jnp.asarray(-0.625))
    assert np.array_equal(np.asarray(dW), -0.625 * gW) and np.array_equal(np.asarray(db), -0.625 * gb)
