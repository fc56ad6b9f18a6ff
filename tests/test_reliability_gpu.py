"""Re-attaching an optimizer to a CuPy program keeps what the device trained (under the fake CuPy,
tests/fake_cupy.py). ``attach`` rebuilds the device buffers from the program's host arrays, which the
device's steps never wrote: the parameters went back to where they were before those steps."""
import sys

import numpy as np
import pytest

import tapegrad as tg

import fake_cupy
from test_gpu import episode_program


@pytest.fixture
def cupy(monkeypatch):
    mod = fake_cupy.make()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


def run(backend, reset_w0=None):
    """An Adam episode per batch, then SGD attached in Adam's place and two more; the parameters after each phase."""
    prog, params, x, y, data = episode_program("adam", "mse", True, backend)
    for xb, yb in data:
        prog.episode({x: xb, y: yb})
    trained = [np.array(prog.value(p)) for p in params]
    if reset_w0 is not None:   # a parameter given anew on the host between the two: that value wins
        prog.set_input(params[0], reset_w0)
    sgd = tg.SGD(0.05)
    for p in params:
        sgd.add(params[0].tape, p)
    prog.attach(sgd)
    for xb, yb in data[:2]:
        prog.episode({x: xb, y: yb})
    return trained, [np.array(prog.value(p)) for p in params]


@pytest.mark.parametrize("given", [False, True], ids=["as trained", "one parameter given anew"])
def test_reattaching_keeps_the_parameters_the_device_trained(cupy, given):
    w0 = np.full(episode_program("adam", "mse", True, "numpy")[1][0].shape, 0.25) if given else None
    want_mid, want_end = run("native", w0)
    got_mid, got_end = run("cupy", w0)
    assert all(np.array_equal(a, b) for a, b in zip(got_mid, want_mid))   # ordered mode: bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(got_end, want_end))
    assert not np.array_equal(got_end[1], got_mid[1])   # SGD moved them on from where Adam left them
