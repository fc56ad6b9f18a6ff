"""Native reductions and fusion at their edges, compared with the tape bit for bit.

- NumPy's pairwise sum changes method at 8 and 128 elements: blocks of exactly those sizes (and one
  either side) must sum in NumPy's order.
- max propagates NaN along both of the runtime's paths (reduced trailing block; kept trailing axis).
- Tied maxima share the gradient equally (``[1, 3, 3] → [0, ½, ½]``) on the tape and every replay.
- Two broadcast inputs receiving elementwise contributions in one backward segment must not share a
  scratch row: each gets its own reduction.
"""
import numpy as np
import pytest

import tapegrad as tg

RNG = np.random.default_rng(23)
SIZES = (7, 8, 9, 16, 127, 128, 129, 256, 257, 300)

pytestmark = pytest.mark.matrix   # re-run by CI under every compiler x target x BLAS kernel


def wild(shape):
    """Values over eight decades: the order of summation shows in the last bits."""
    return RNG.standard_normal(shape) * 10.0 ** RNG.integers(-4, 4, shape)


def unit_shape(rng, lengths, most=3000):
    """A random shape of rank 1-4 over ``lengths`` (length 1 among them), at most ``most`` elements."""
    while True:
        shape = tuple(int(rng.choice(lengths)) for _ in range(rng.integers(1, 5)))
        if np.prod(shape) <= most:
            return shape


def run(tape, loss, backend, fuse=True):
    prog = tg.capture(tape, loss, backend=backend, fuse=fuse)
    prog.forward()
    prog.backward()
    return prog


def test_summation_order_is_observable_at_eight_elements():
    rows = wild((6, 8))
    sequential = [float(sum(r.tolist())) for r in rows]
    assert np.add.reduce(rows, axis=1).tolist() != sequential


def test_native_sums_of_blocks_at_the_pairwise_thresholds_equal_the_tape():
    tape = tg.Tape()
    items, loss = [], None
    for n in SIZES:
        whole = tape.param(wild(n))
        rows = tape.param(wild((5, n)))
        cols = tape.param(wild((n, 3)))
        ys = [whole.sum(), rows.sum(axis=1), cols.sum(axis=0), rows.mean(axis=1)]
        items += [(n, y) for y in ys]
        for y in ys:
            term = (y * tape.const(wild(y.shape))).sum()
            loss = term if loss is None else loss + term
    tape.backward(loss)
    prog = run(tape, loss, "native")
    for n, y in items:
        assert np.array_equal(prog.value(y), tape.value(y)), (n, y.shape)


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_max_propagates_nan_along_every_path(backend):
    tape = tg.Tape()
    nan = np.nan
    whole = tape.param(np.array([1.0, nan, 5.0, 2.0, 7.0]))
    first = tape.param(np.array([nan, 9.0, 3.0]))
    rows = tape.param(np.array([[1.0, 2.0, nan, 0.5], [4.0, 3.0, 2.0, 1.0], [nan, 8.0, 9.0, 1.0]]))
    cols = tape.param(np.array([[1.0, 2.0, 3.0], [nan, 0.0, 4.0], [2.0, nan, 1.0], [5.0, 1.0, 0.0]]))
    ys = [whole.max(), first.max(), rows.max(axis=1), cols.max(axis=0), rows.max(axis=0)]
    loss = ys[0]
    for y in ys[1:]:
        loss = loss + y.sum()
    prog = tg.capture(tape, loss, backend=backend)
    prog.forward()
    want = [[nan], [nan], [nan, 4.0, nan], [nan, nan, 4.0], [nan, 8.0, nan, 1.0]]
    for y, w in zip(ys, want):
        assert np.array_equal(np.ravel(tape.value(y)), w, equal_nan=True)
        assert np.array_equal(np.ravel(prog.value(y)), w, equal_nan=True), (backend, y.shape)


@pytest.mark.parametrize("backend", ["tape", "numpy", "native"])
def test_tied_maxima_share_the_gradient_equally(backend):
    tape = tg.Tape()
    a = tape.param(np.array([1.0, 3.0, 3.0]))
    m = tape.param(np.array([[2.0, 2.0, 2.0, 1.0], [0.0, 5.0, 1.0, 5.0]]))
    c = tape.param(np.array([[1.0, 4.0], [1.0, 4.0], [0.5, 4.0]]))
    loss = a.max() + (m.max(axis=1) * tape.const(np.array([3.0, 1.0]))).sum() + c.max(axis=0).sum()
    tape.backward(loss)
    src = tape if backend == "tape" else run(tape, loss, backend)
    assert np.array_equal(src.grad(a), [0.0, 0.5, 0.5])
    assert np.array_equal(src.grad(m), [[1.0, 1.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.5]])
    assert np.array_equal(src.grad(c), [[0.5, 1.0 / 3.0], [0.5, 1.0 / 3.0], [0.0, 1.0 / 3.0]])


@pytest.mark.parametrize("fuse", [False, True])
def test_two_broadcast_inputs_in_one_fused_backward_segment_get_their_own_sums(fuse):
    """t = x·b1; u = t·b2 with b1, b2 of shape (6,): both multiplications land in one backward segment,
    and each bias row receives its own column sums."""
    tape = tg.Tape()
    x = tape.param(wild((4, 6)))
    b1, b2 = tape.param(wild(6)), tape.param(wild(6))
    u = (x * b1) * b2
    loss = (u * tape.const(wild((4, 6)))).sum()
    tape.backward(loss)
    prog = run(tape, loss, "native", fuse=fuse)
    for v in (x, b1, b2, u):
        assert np.array_equal(prog.grad(v), tape.grad(v))


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_max_of_negative_values_along_every_path(backend):
    """A max accumulator must start below every value (at -inf), not at 0."""
    tape = tg.Tape()
    whole = tape.param(-RNG.uniform(1.0, 2.0, 9))
    rows = tape.param(-RNG.uniform(1.0, 2.0, (3, 5)))
    cols = tape.param(-RNG.uniform(1.0, 2.0, (4, 3)))
    ys = [whole.max(), rows.max(axis=1), cols.max(axis=0), rows.max(axis=(0, 1), keepdims=True)]
    loss = ys[0] + ys[1].sum() + ys[2].sum() + ys[3].sum()
    tape.backward(loss)
    prog = run(tape, loss, backend)
    for y in ys:
        assert np.all(tape.value(y) < 0) and np.array_equal(prog.value(y), tape.value(y))
    for v in (whole, rows, cols):
        assert np.array_equal(prog.grad(v), tape.grad(v))


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_an_empty_inner_dimension_sums_to_zero(backend):
    """(3, 0) @ (0, 4) is a sum over nothing: zeros, written even over a buffer that held other values."""
    tape = tg.Tape()
    a, b = tape.param(np.ones((3, 0))), tape.param(np.ones((0, 4)))
    y = a @ b
    loss = (y * tape.const(np.arange(12.0).reshape(3, 4))).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend=backend)
    prog.val[y.id][...] = 7.0          # stale values from an earlier episode must not survive
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.value(y), np.zeros((3, 4))) and float(prog.loss()) == 0.0
    assert prog.grad(a).shape == (3, 0) and prog.grad(b).shape == (0, 4)


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_softmax_of_large_logits_stays_finite(backend):
    """exp(a − max): logits near 1000 would overflow exp(a) itself."""
    tape = tg.Tape()
    a = tape.param(np.array([[1000.0, 1001.0, 999.0], [-5.0, 700.0, 710.0]]))
    s, ls = a.softmax(axis=1), a.log_softmax(axis=1)
    loss = (s * tape.const(np.arange(6.0).reshape(2, 3))).sum() + ls.sum()
    tape.backward(loss)
    prog = run(tape, loss, backend)
    for v in (s, ls):
        assert np.all(np.isfinite(prog.value(v)))
        np.testing.assert_allclose(prog.value(v), tape.value(v), rtol=1e-14, atol=0)
    assert np.all(np.isfinite(prog.grad(a)))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # inf - inf: NaN on both sides
@pytest.mark.parametrize("inner", [1, 3])
def test_reductions_over_a_middle_axis_equal_the_tape(inner):
    """sum, max, min and prod over axis 1 of (4, n, inner), with NaN and infinities, bit for bit: rows
    accumulated in order along a strided axis (inner 3), pairwise along an axis padded by one of length 1
    (inner 1), as NumPy does."""
    tape = tg.Tape()
    ys = []
    for n in (1, 2, 7, 9):
        a = wild((4, n, inner))
        a[0, n // 2, 0] = np.nan
        a[1, :, -1] = -np.inf
        a[2, 0, 0] = np.inf
        x = tape.param(a)
        ys += [x.sum(axis=1), x.max(axis=1), tg.min(x, axis=1), tg.prod(x * 0.5, axis=1)]
    prog = tg.capture(tape, ys[0].sum(), backend="native")
    prog.forward()
    for y in ys:
        assert np.array_equal(prog.value(y), tape.value(y), equal_nan=True), y.shape


def test_reductions_over_random_shapes_with_unit_axes_equal_the_tape():
    """60 random reductions (ranks 1-4, axes of length 1 anywhere, one axis or several, signed zeros,
    NaN and infinities mixed in) in one program: NumPy's iterator drops length-1 axes before choosing
    between pairwise sums and row-by-row accumulation, and so must the runtime."""
    rng = np.random.default_rng(7)
    tape = tg.Tape()
    ys = []
    with np.errstate(invalid="ignore"):   # inf - inf in a sum: NaN on the tape and in the program alike
        for _ in range(60):
            shape = unit_shape(rng, (1, 1, 2, 3, 9, 130))
            a = wild(shape)
            a.ravel()[rng.random(a.size) < 0.1] = -0.0
            if a.size > 4 and rng.random() < 0.3:
                a.ravel()[rng.integers(0, a.size, 2)] = rng.choice([np.nan, np.inf, -np.inf], 2)
            k = rng.integers(1, len(shape) + 1)
            axis = tuple(sorted(rng.choice(len(shape), k, replace=False).tolist()))
            x = tape.param(a)
            ys += [x.sum(axis=axis), x.max(axis=axis), tg.min(x, axis=axis), tg.prod(x * 0.9, axis=axis),
                   x.mean(axis=axis)]
    prog = tg.capture(tape, ys[0].sum(), backend="native")
    prog.forward()
    for y in ys:
        got, want = prog.value(y), tape.value(y)
        assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want)), \
            (y, tape.value(y).shape)


def test_gradients_summed_back_over_random_broadcasts_equal_the_tape():
    """40 random broadcasts (an operand with axes of length 1 anywhere, or fewer axes) through add, mul and
    maximum: each operand's gradient is the output gradient summed over the stretched axes, in NumPy's
    order on the tape and in the native program alike, bit for bit."""
    rng = np.random.default_rng(11)
    tape = tg.Tape()
    pairs, loss = [], None
    for _ in range(40):
        shape = unit_shape(rng, (1, 2, 3, 9, 130))
        small = tuple(1 if rng.random() < 0.5 else m for m in shape)[rng.integers(0, len(shape)):]
        x, b = tape.param(wild(shape)), tape.param(wild(small))
        op = rng.choice(["add", "mul", "maximum"])
        y = x + b if op == "add" else x * b if op == "mul" else tg.maximum(x, b)
        term = (y * tape.const(wild(shape))).sum()
        loss = term if loss is None else loss + term
        pairs.append((shape, small, op, x, b))
    tape.backward(loss)
    prog = run(tape, loss, "native")
    for shape, small, op, x, b in pairs:
        assert np.array_equal(prog.grad(b), tape.grad(b)), (shape, small, op)
        assert np.array_equal(prog.grad(x), tape.grad(x)), (shape, small, op)


@pytest.mark.parametrize("width", [15, 16, 17, 24, 40, 131])
def test_max_and_min_of_rows_eight_lanes_at_a_time_equal_numpy_s_with_nans_ties_and_carried_extremes(width):
    """Rows of 16 or more are reduced eight lanes at a time: NaN anywhere in a row, repeated extremes,
    zeros of both signs (equal under the "order" tier, as NumPy's own vectorised max treats them) and
    outer reduced axes (an extreme carried from row to row) must give NumPy's values."""
    rows = []
    for k in range(12):
        r = RNG.standard_normal(width)
        if k % 4 == 1:   # the extreme is a zero, both signs present
            r = -np.abs(r) if k % 8 == 1 else np.abs(r)
            r[RNG.choice(width, 4, replace=False)] = [0.0, -0.0, -0.0, 0.0]
        elif k % 4 == 2:
            r[RNG.integers(width)] = np.nan
        elif k % 4 == 3:   # a repeated nonzero extreme
            r[RNG.choice(width, 3, replace=False)] = r.max() + 1.0
        rows.append(r)
    x = np.array(rows).reshape(3, 4, width)
    tape = tg.Tape()
    v = tape.param(x)
    ys = [v.max(axis=2), v.min(axis=2), v.max(axis=(0, 2)), v.min(axis=(1, 2))]
    loss = ys[0].sum()
    for y in ys[1:]:
        loss = loss + y.sum()
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    for y in ys:
        assert np.array_equal(prog.value(y), tape.value(y), equal_nan=True), (width, y.shape)
    assert np.isnan(tape.value(ys[0])).sum() == 3 and (tape.value(ys[0]) == 0.0).sum() == 2   # the cases occur
