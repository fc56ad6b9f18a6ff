"""Transposes in native programs: the runtime copies them in 8 x 8 blocks of vector shuffles where the
source's contiguous axis is not the destination's last (runtime.c, tg_gather_blocks), element by element
elsewhere; either way the same copies, so values and gradients equal the tape's bit for bit, edges
(extents that are not multiples of 8) and NaN payloads included."""
import numpy as np
import pytest

import tapegrad as tg

pytestmark = pytest.mark.matrix

CASES = [((256, 32), (1, 0)), ((32, 256), (1, 0)), ((37, 21), (1, 0)), ((8, 32, 4, 16), (0, 2, 3, 1)),
         ((8, 32, 4, 16), (0, 2, 1, 3)), ((4, 28, 28, 16), (0, 3, 1, 2)), ((3, 13, 9), (2, 0, 1)),
         ((2, 5, 3, 17, 11), (4, 1, 0, 3, 2))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_transposes_equal_the_tape_bit_for_bit(dtype):
    rng = np.random.default_rng(4)
    tape = tg.Tape(dtype)
    loss, xs, ys = None, [], []
    for shape, perm in CASES:
        a = rng.standard_normal(shape).astype(dtype)
        a.flat[::7] = np.nan   # copied as they are, not computed
        x = tape.param(a)
        y = x.transpose(perm)
        term = (y * tape.const(rng.standard_normal(y.shape).astype(dtype))).sum()
        loss = term if loss is None else loss + term
        xs.append(x)
        ys.append(y)
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native", dtype=dtype, verify=False)
    prog.forward()
    prog.backward()
    for x, y, (shape, perm) in zip(xs, ys, CASES):
        got, want = np.array(prog.value(y)), np.transpose(np.array(tape.value(x)), perm)
        assert got.tobytes() == want.tobytes(), (shape, perm)
        assert np.array_equal(prog.grad(x), tape.grad(x), equal_nan=True), (shape, perm)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_slices_that_share_a_gradient_equal_the_tape(dtype):
    """An LSTM's gates: four slices of one pre-activation, each adding its gradient into the window of the
    input's gradient (the first one zero-filled), interleaved with a contribution over the whole input."""
    rng = np.random.default_rng(5)
    tape = tg.Tape(dtype)
    z = tape.param(rng.standard_normal((32, 256)).astype(dtype))
    gates = [z[:, 64 * i:64 * (i + 1)] for i in range(4)]
    h = gates[0] * gates[2] + gates[1] * gates[3] - gates[2]   # exact ops: the gradient is the tape's bits
    loss = (h * h).sum() + (z * z).mean() + z[3:20:2, 7:200:3].sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native", dtype=dtype)
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.grad(z), tape.grad(z))
