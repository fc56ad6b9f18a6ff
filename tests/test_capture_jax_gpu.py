"""capture_jax on the GPU backend (a stand-in cupy runs the CUDA source as host C++), and the calls whose
custom call runs on the CPU refusing backend='cupy' by name instead of reading host copies of device
buffers (value_and_grad returned 4.7e-310 for a loss)."""
import sys

import numpy as np
import pytest

import fake_cupy

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from interop.capture.capture import CaptureError  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64")


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make())


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(8, param_dtype=jnp.float64)(x))
        return nn.Dense(3, param_dtype=jnp.float64)(x)


def _model():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 5)))
    y = jnp.asarray(rng.integers(0, 3, 4))
    m = MLP()
    params = m.init(jax.random.key(0), x)["params"]

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m.apply({"params": p}, x), y).mean()
    return loss, params, x, y


def test_a_flax_loss_captured_for_cupy_is_verified_and_matches_jax_grad(cupy):
    loss, params, x, y = _model()
    cap = interop.capture_jax(loss, params, x, y, backend="cupy")
    prog = cap.program
    assert prog.backend == "cupy" and {"values", "gradients"} <= prog.verified   # checked on its first run
    prog.forward()
    prog.backward()
    want, grads = jax.value_and_grad(loss)(params, x, y)
    assert abs(float(prog.loss()) - float(want)) <= 1e-12 * abs(float(want))
    got = {name: prog.grad(name) for name in prog.param_names}
    flat = jax.tree.leaves(grads)
    assert len(got) == len(flat)
    for g, w in zip(got.values(), flat):
        np.testing.assert_allclose(g, np.asarray(w), rtol=0, atol=1e-12 * max(1.0, float(np.max(np.abs(w)))))


@pytest.mark.parametrize("make", [
    lambda loss, p, x, y: interop.value_and_grad(loss, p, x, y, backend="cupy"),
    lambda loss, p, x, y: interop.train_step(loss, p, x, y, optimizer=optax.adam(1e-3), backend="cupy"),
], ids=["value_and_grad", "train_step"])
def test_cpu_custom_calls_refuse_backend_cupy_by_name(cupy, make):
    loss, params, x, y = _model()
    with pytest.raises(CaptureError, match=r"(value_and_grad|train_step): backend='cupy' is not a backend of "
                                           r"this call.*capture_jax\(fn, \.\.\., backend='cupy'\)"):
        make(loss, params, x, y)


def test_program_call_and_episode_refuse_a_cupy_program(cupy):
    import tapegrad as tg
    loss, params, x, y = _model()
    prog = interop.capture_jax(loss, params, x, y, backend="cupy").program
    with pytest.raises(interop.ProgramError, match=r"program_call: the program was captured with "
                                                   r"backend='cupy'.*program_episode_gpu"):
        interop.program_call(prog, data=True)
    prog.attach(tg.Adam(1e-3))
    with pytest.raises(interop.ProgramError, match=r"program_episode: the program was captured with "
                                                   r"backend='cupy'"):
        interop.program_episode(prog, data=True)
