"""The CUDA source generator (tapegrad/gpu/source.py) on the graphs the MLP episodes of tests/test_gpu.py
do not build: layout ops, sums over some axes, broadcasting operands of every kind, three-input and
static-operand elementwise nodes, a bool mask, gradients that collect several contributions, targets
that are trained, softmax_xent over an inner axis, default-mode matmul gradients that accumulate, the
fusion rules and the custom call's table slots.

Each graph runs twice (forward and backward) in the host emulation of its CUDA program, fused and per
node, and must equal the native CPU program: bit for bit (``==``), except where a default-mode matmul
is a BLAS call on both sides (then within the "blas" bound, stated there).
"""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.gpu import source as gpu_source
from tapegrad.gpu.host import emulate
from tapegrad.gpu.source import CudaProgram

EPS = np.finfo(np.float64).eps


def run(build, backend, ordered, fuse=True, dtype="float64", episodes=2):
    """Values of the graph's outputs and gradients of its leaves after ``episodes`` forward + backward
    passes of ``build(tape, rng) -> (leaves, outputs, loss)`` captured for ``backend`` ("native", or
    "gpu": the host emulation of the CUDA program)."""
    tape = tg.Tape(ordered=ordered)
    leaves, outs, loss = build(tape, np.random.default_rng(7))
    prog = tg.capture(tape, loss, backend="native" if backend == "native" else "numpy", dtype=dtype, fuse=fuse)
    if backend == "gpu":
        emulate(prog, fuse)
    for _ in range(episodes):
        prog.forward()
        prog.backward()
    return [np.array(prog.value(o)) for o in outs] + [np.array(prog.grad(v)) for v in leaves]


def assert_equal_native(build, ordered=True, dtype="float64"):
    want = run(build, "native", ordered, dtype=dtype)
    for fuse in (True, False):
        got = run(build, "gpu", ordered, fuse, dtype)
        assert len(got) == len(want)
        for j, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and np.array_equal(g, w, equal_nan=True), (fuse, j, np.max(np.abs(g - w)))


def weighted(tape, rng, ys):
    """Σ_j Σ y_j · r_j with fixed random weights r_j: a scalar loss that reads every output element."""
    loss = None
    for y in ys:
        term = (y * tape.const(rng.standard_normal(y.shape))).sum()
        loss = term if loss is None else loss + term
    return loss


# ── layout ops and sums over some axes ──────────────────────────────────────

def layout(tape, rng):
    """transpose, reshape, broadcast_to and sums/means over some axes, each leaf read twice (so its
    gradient collects a second contribution after the first)."""
    x = tape.param(rng.standard_normal((2, 3, 4)))
    w = tape.param(rng.standard_normal((3, 1)))
    ys = [x.transpose((2, 0, 1)), x.transpose((1, 2, 0)) * 2.0, x.reshape(4, 6), x.reshape(6, 4) + 1.0,
          tg.broadcast_to(w, (2, 3, 5)), tg.broadcast_to(w, (3, 2)) * 3.0,
          x.sum(axis=1), x.sum(axis=(0, 2), keepdims=True), x.mean(axis=0), x.sum(), x.mean(axis=(1, 2)),
          x.sum(axis=2)]
    return [x, w], ys, weighted(tape, rng, ys)


@pytest.mark.parametrize("ordered", [True, False])
def test_layout_ops_and_partial_sums_equal_native(ordered):
    assert_equal_native(layout, ordered)


def long_rows(tape, rng):
    """Sums over trailing blocks of 20 and 300 elements (NumPy's pairwise order in default mode, serial in
    ordered mode: different roundings for these values) and the gradient of a (rows, 1) column stretched
    over 300 columns, read twice."""
    x = tape.param(rng.standard_normal((3, 300)) * np.exp(rng.uniform(-8, 8, (3, 300))))
    c = tape.param(rng.standard_normal((3, 1)))
    y = tape.param(rng.standard_normal((3, 4, 5)))
    ys = [x.sum(axis=1), y.sum(axis=(1, 2)), x * c, c * c]
    return [x, c, y], ys, weighted(tape, rng, ys)


@pytest.mark.parametrize("ordered", [True, False])
def test_sums_over_long_rows_equal_native(ordered):
    assert_equal_native(long_rows, ordered)


def test_default_mode_sums_over_trailing_axes_are_numpys_pairwise_sums():
    """The device's pairwise sum (tg_pw) is NumPy's own: equal to numpy.sum bit for bit, which a serial
    sum of these values is not."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((3, 300)) * np.exp(rng.uniform(-8, 8, (3, 300)))
    tape = tg.Tape()
    x = tape.param(xs)
    s = x.sum(axis=1)
    prog = emulate(tg.capture(tape, weighted(tape, rng, [s])))
    prog.forward()
    serial = np.cumsum(xs, axis=1)[:, -1]   # a serial sum in index order
    assert (prog.value(s) == xs.sum(axis=1)).all() and not (serial == xs.sum(axis=1)).all()


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 9), (4, 2, 3, 20)])
def test_a_gradient_summed_over_leading_and_trailing_axes_follows_numpys_order(shape):
    """A (3, 1) column stretched over leading and trailing axes: NumPy (and the native runtime's
    tg_reduce) sums each contiguous trailing block pairwise, then adds the block sums row by row. The
    device's reduction once summed all of it serially, a different rounding (a bug these values show)."""
    def build(tape, rng):
        w = tape.param(rng.standard_normal(shape[-2:-1] + (1,)))
        ys = [tg.broadcast_to(w, shape)]
        return [w], ys, weighted(tape, rng, ys)
    for ordered in (True, False):
        assert_equal_native(build, ordered)
