"""The GPU custom call under jax.jit on a real GPU (skipped without CuPy, a CUDA device and JAX's CUDA
backend; experiments/gpu_check.py runs it where they exist): the jitted CUDA episode of a CuPy-captured
ordered program equals the native CPU program's episodes bit for bit, and one platform_dependent step
runs it on the GPU."""
import numpy as np
import pytest

import tapegrad as tg
from interop import jax
from interop.xla.gpu_call import platform_episode, program_episode_gpu
from interop.xla.program import episode_state

SIZES = (6, 8, 3)


def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        return jax.devices("cuda")[0]
    except Exception as e:
        pytest.skip(f"needs a CUDA GPU with CuPy and JAX's CUDA backend ({type(e).__name__})")


def build(backend):
    rng = np.random.default_rng(3)
    tape = tg.Tape(ordered=True)
    w1, b1 = tape.param(rng.standard_normal(SIZES[:2]) * 0.4), tape.param(np.zeros(SIZES[1]))
    w2, b2 = tape.param(rng.standard_normal(SIZES[1:]) * 0.4), tape.param(np.zeros(SIZES[2]))
    x, y = tape.const(rng.standard_normal((5, SIZES[0]))), tape.const(rng.standard_normal((5, SIZES[2])))
    opt = tg.Adam(1e-2)
    for p in (w1, b1, w2, b2):
        opt.add(tape, p)
    prog = tg.capture(tape, tg.mse((x @ w1 + b1).relu() @ w2 + b2, y), backend=backend)
    prog.attach(opt)
    data = [(rng.standard_normal((5, SIZES[0])), rng.standard_normal((5, SIZES[2]))) for _ in range(4)]
    return prog, (x, y), data


def test_jitted_gpu_episodes_equal_the_native_program():
    dev = _gpu()
    gpu, _, data = build("cupy")
    cpu, (x, y), _ = build("native")
    params, opt_state = jax.device_put(episode_state(cpu), dev)
    step = jax.jit(program_episode_gpu(gpu))
    for xb, yb in data:
        loss, params, opt_state = step(params, opt_state, jax.device_put((xb, yb), dev))
        assert float(loss) == cpu.episode({x: xb, y: yb})
    want, _ = episode_state(cpu)
    assert all((np.asarray(params[k]) == np.asarray(want[k])).all() for k in want)
    assert int(opt_state.count) == len(data)


def test_platform_dependent_step_on_the_gpu():
    dev = _gpu()
    gpu, _, data = build("cupy")
    cpu, (x, y), _ = build("native")
    twin, _, _ = build("native")
    step = jax.jit(platform_episode(twin, gpu))
    params, opt_state = jax.device_put(episode_state(cpu), dev)
    loss, params, opt_state = step(params, opt_state, jax.device_put(data[0], dev))
    assert float(loss) == cpu.episode({x: data[0][0], y: data[0][1]})
