"""Device forms of the index and scan families, slice, concat, max, min, prod, softmax, logsoftmax,
logsumexp, lgamma and digamma (the native runtime's tg_digamma/tg_trigamma compiled for the device): the
CUDA kernels, run as host C++ by the grid emulation, equal the native CPU program bit for bit (values
and gradients, every registry case, ordered mode; the libm-tier ones too, since the emulation calls the
host's exp, log and lgamma), and the generated source compiles with nvcc (warnings as errors)."""
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.gpu import source_scan
from tapegrad.gpu.host import emulate
from tapegrad.gpu.source import CudaProgram, device_form

from op_cases import floats, make, record
from test_gpu import NVCC

FAMILY = ["take", "take_along_axis", "index_add", "index_set", "dynamic_slice", "dynamic_update_slice",
          "cumsum", "cumprod", "cummax", "sort", "slice", "concat", "max", "min", "prod", "softmax", "logsoftmax",
          "logsumexp", "lgamma", "digamma"]


def every_case(backend, dtype="float64", names=FAMILY):
    """One ordered tape with every case of the ops ``names``, weighted into one loss, captured."""
    rng = np.random.default_rng(5)
    tape = tg.Tape(ordered=True)
    items, loss = [], None
    for name in names:
        op = O.OPS[name]
        for case in op.cases:
            arrays, s = make(op, case, rng)
            vs, y = record(tape, op, arrays, s)
            term = (y * tape.const(rng.standard_normal(y.shape))).sum()
            loss = term if loss is None else loss + term
            items.append((name, case, floats(op, vs), y))
    prog = tg.capture(tape, loss, backend=backend, dtype=dtype)
    return prog, items


def ran(tape, loss, backend, episodes=1):
    """``loss`` captured on ``backend`` ("numpy": the program emulated as the device), then ``episodes``
    forward and backward passes."""
    prog = tg.capture(tape, loss, backend=backend)
    if backend == "numpy":
        emulate(prog)
    for _ in range(episodes):
        prog.forward()
        prog.backward()
    return prog


@pytest.fixture(scope="module")
def programs():
    """An op's name -> the native program and the emulated device program (fused, per-node) of its cases,
    built on first use: one op per program, so each op's kernels are generated inside the tests that
    check them (mutation testing tries a mutant only against the tests that reach its code)."""
    cache = {}

    def get(name):
        if name not in cache:
            out = cache[name] = {}
            for key in ("native", True, False):
                prog, items = every_case("native" if key == "native" else "numpy", names=[name])
                if key != "native":
                    emulate(prog, key)
                for _ in range(2):   # the second pass overwrites the first: each first contribution assigns
                    prog.forward()
                    prog.backward()
                out[key] = (prog, items)
        return cache[name]
    return get


def test_every_family_op_has_a_device_form():
    assert all(device_form(O.OPS[name]) for name in FAMILY)


@pytest.mark.matrix
@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("fuse", [True, False])
def test_emulated_device_kernels_equal_native(programs, name, fuse):
    built = programs(name)
    (native, want), (dev, got) = built["native"], built[fuse]
    checked = 0
    for (op_name, case, xs, y), (_, _, xd, yd) in zip(want, got):
        if op_name != name:
            continue
        assert np.array_equal(dev.value(yd), native.value(y), equal_nan=True), (name, case, "value")
        for v, vd in zip(xs, xd):
            assert np.array_equal(dev.grad(vd), native.grad(v), equal_nan=True), (name, case, "grad")
        checked += 1
    assert checked == len(O.OPS[name].cases)


def test_scatter_add_sums_repeated_indices_in_position_order():
    """index_add with one index repeated: the contributions arrive in increasing position (numpy.add.at),
    which a different order would round differently for these values."""
    b = np.array([1e16, 1.0, -1e16, 1.0])
    c = np.array([0, 0, 0, 0])
    got = {}
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        a = tape.param(np.zeros(2))
        vb = tape.param(b)
        y = tape.apply(O.OPS["index_add"], a, vb, 0, tape.const(c))
        prog = tg.capture(tape, (y * tape.const(np.array([1.0, 2.0]))).sum(), backend=backend)
        if backend == "numpy":
            emulate(prog)
        prog.forward()
        got[backend] = np.array(prog.value(y))
    want = np.zeros(2)
    np.add.at(want, c, b)
    assert (got["native"] == want).all() and (got["numpy"] == want).all() and want[0] == 1.0


@pytest.mark.compilers
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_family_kernels_compile_with_nvcc(tmp_path, dtype):
    prog, _ = every_case("numpy", dtype)
    tape = tg.Tape()
    w = tape.param(np.ones((2, 3, 4)))
    bmm = tg.capture(tape, tape.apply(O.OPS["bmm"], w, tape.const(np.ones((2, 4, 5))), None).sum(), dtype=dtype)
    for name, p in (("family", prog), ("bmm", bmm)):
        path = tmp_path / f"{name}.cu"
        path.write_text(CudaProgram(p).src)
        r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--fmad=false", "-Werror", "all-warnings", str(path),
                            "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]

@pytest.mark.matrix
@pytest.mark.parametrize("name", ["max", "min", "prod"])
def test_extremes_ties_nans_signed_zeros_and_zero_products_equal_native(name):
    """Tied extremes share the gradient, NaN propagates, the first of ±0 stays, prod's gradient needs no
    division (zeros in a row): the emulated kernels give the native program's bits on all of them."""
    a = np.array([[1.0, 3.0, 3.0, -0.0], [-0.0, 0.0, -2.0, -3.0], [0.0, -0.0, 2.0, 3.0], [np.nan, 1.0, -1.0, 0.0],
                  [2.0, 0.0, 0.0, 5.0]])
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        x = tape.param(a)
        ys = [tape.apply(O.OPS[name], x, None, s) for s in ((None, False), ((1,), False), ((0,), True))]
        loss = None
        for k, y in enumerate(ys):
            term = (y * tape.const(np.full(y.shape, 1.0 + k))).sum()
            loss = term if loss is None else loss + term
        prog = ran(tape, loss, backend)
        got.append(([np.array(prog.value(y)) for y in ys], np.array(prog.grad(x))))
    (vn, gn), (ve, ge) = got
    assert all(np.array_equal(u, v, equal_nan=True) and (np.signbit(u) == np.signbit(v)).all() for u, v in zip(vn, ve))
    assert np.array_equal(gn, ge, equal_nan=True) and (np.signbit(gn) == np.signbit(ge)).all()


def test_bmm_within_the_blas_bound_of_native():
    """bmm is tier "blas": a serial dot per element against NumPy's BLAS, within rtol 1e-12."""
    op = O.OPS["bmm"]
    rng = np.random.default_rng(2)
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        vs, ys = [], []
        for case in op.cases:
            arrays, s = make(op, case, np.random.default_rng(len(ys)))
            v, y = record(tape, op, arrays, s)
            vs += v
            ys.append(y)
        loss = None
        for y in ys:
            term = (y * tape.const(rng.standard_normal(y.shape))).sum()
            loss = term if loss is None else loss + term
        prog = ran(tape, loss, backend)
        got.append([np.array(prog.value(y)) for y in ys] + [np.array(prog.grad(v)) for v in vs])
        rng = np.random.default_rng(2)
    assert all(np.allclose(e, n, rtol=1e-12, atol=1e-14) for n, e in zip(*got))


@pytest.mark.parametrize("axis", [0, 1])
def test_cummax_ties_across_lines_and_a_long_unchanged_maximum_equal_native(axis):
    """All-equal lines (every element ties, and so does the next line's start) and a 1100-long line whose
    running maximum never changes (tie counts up to 1100): the emulated kernels give the native bits."""
    tied = np.full((3, 4), 2.0)
    long = np.concatenate([np.full((1, 1), 9.0), np.linspace(-1.0, 1.0, 1099)[None, :]], axis=1)
    cases = [(tied, axis), (long if axis else long.T, axis)]
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        xs = [tape.param(a) for a, _ in cases]
        ys = [tape.apply(O.OPS["cummax"], x, None, (ax, False)) for x, (_, ax) in zip(xs, cases)]
        loss = None
        for k, y in enumerate(ys):
            term = (y * tape.const(np.linspace(0.5, 1.5, y.size).reshape(y.shape) + k)).sum()
            loss = term if loss is None else loss + term
        prog = ran(tape, loss, backend)
        got.append([np.array(prog.grad(x)) for x in xs])
    (gn, ge) = got
    assert all(np.array_equal(u, v) for u, v in zip(gn, ge)) and np.isfinite(ge[1]).all()


def test_a_float32_program_refuses_sort_lines_past_2_to_the_24():
    """Its argsort indices are floats: a line of 2**24 elements is the longest a float32 program sorts."""
    from types import SimpleNamespace
    for m, ok in ((2 ** 24, True), (2 ** 24 + 1, False), (3000, True)):
        g = SimpleNamespace(f32=True, p=SimpleNamespace(shapes={4: (2, m)}), sizes=[],
                            n=lambda k, m=m: 2 * m)
        g.scratch = lambda j, n, g=g: g.sizes.append(n)
        if ok:
            assert source_scan._sort_line(g, 7, 4, 1) == (2, m, 1) and g.sizes == [2 * m, 2 * m]
            continue
        with pytest.raises(tg.TapeError) as e:
            source_scan._sort_line(g, 7, 4, 1)
        assert str(e.value) == (f"sort (node 7): a float32 program sorts lines of at most 2**24 elements (its "
                                f"argsort indices are floats); got {m}; capture in float64") and g.sizes == []
        g.f32 = False
        assert source_scan._sort_line(g, 7, 4, 1) == (2, m, 1)


def test_scatters_with_a_constant_target_a_shared_source_and_zero_dimensional_slices_equal_native():
    """index_add, index_set and dynamic_update_slice into a constant (only the source's gradient), the
    source read again before (so the scatter's gradient is not its first contribution), and 0-d dynamic
    slices (no axes, no starts): the emulated kernels give the native bits."""
    rng = np.random.default_rng(8)
    idx = np.array([3, 0, -1, 3])
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        a = tape.const(rng.standard_normal((5, 3)))
        b = tape.param(rng.standard_normal((4, 3)))
        w = tape.param(rng.standard_normal((2, 3)))
        z = tape.param(np.array(3.0))
        c = tape.const(idx)
        ys = [tape.apply(O.OPS["index_add"], a, b, 0, c), tape.apply(O.OPS["index_set"], a, b, 0, c),
              tape.apply(O.OPS["dynamic_update_slice"], a, w, None, tape.const(np.array([2, 0]))),
              tape.apply(O.OPS["dynamic_slice"], z, tape.const(np.zeros(0, np.int64)), ()),
              tape.apply(O.OPS["dynamic_update_slice"], z, z * 2.0, None, tape.const(np.zeros(0, np.int64)))]
        extra = (b * b).sum() + (w * w).sum()
        loss = extra
        for k, y in enumerate(ys):
            loss = loss + (y * tape.const(np.linspace(1.0, 2.0, y.size).reshape(y.shape) + k)).sum()
        prog = ran(tape, loss, backend, episodes=2)
        got.append([np.array(prog.value(y)) for y in ys] + [np.array(prog.grad(v)) for v in (b, w, z)])
        rng = np.random.default_rng(8)
    assert all(np.array_equal(u, v) for u, v in zip(*got))


def test_logsumexp_over_leading_middle_and_long_trailing_axes_equals_native():
    """NumPy's summation order in each of tg_reduce's shapes: reduced axes before a kept one (serial in
    row-major order), a trailing block of 9 (the pairwise unrolled loop) and of 300 (split in halves)."""
    rng = np.random.default_rng(12)
    cases = [((9, 3), ((0,), False)), ((3, 4, 5), ((0, 2), True)), ((2, 9), ((1,), False)),
             ((2, 300), ((1,), True)), ((3, 2, 50), (None, False))]
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        xs = [tape.param(rng.standard_normal(sh) * 3.0) for sh, _ in cases]
        ys = [tape.apply(O.OPS["logsumexp"], x, None, s) for x, (_, s) in zip(xs, cases)]
        loss = None
        for k, y in enumerate(ys):
            term = (y * tape.const(np.linspace(0.5, 1.5, y.size).reshape(y.shape) + k)).sum()
            loss = term if loss is None else loss + term
        prog = ran(tape, loss, backend)
        got.append([np.array(prog.value(y)) for y in ys] + [np.array(prog.grad(x)) for x in xs])
        rng = np.random.default_rng(12)
    assert all(np.array_equal(u, v) for u, v in zip(*got))


def test_sums_over_axes_next_to_unit_axes_equal_native_and_the_tape():
    """NumPy's iterator drops axes of length 1 before choosing between pairwise sums and row-by-row
    accumulation: (4, 9, 1) summed over axis 1 is pairwise over rows of 9, and so is a gradient summed
    back onto a (1, 1, 1) bias. The emulated device kernels, the native program and the tape agree bit
    for bit (sum, mean, logsumexp; values and gradients)."""
    cases = [((4, 9, 1), (1,)), ((9, 1), (0,)), ((1, 9), (1,)), ((4, 1, 9, 1), (2,)), ((2, 1, 9, 1), None),
             ((3, 9, 1), (0, 1))]
    got = []
    for backend in ("tape", "native", "numpy"):
        rng = np.random.default_rng(13)
        tape = tg.Tape()
        xs = [tape.param(rng.standard_normal(sh) * 10.0 ** rng.integers(-6, 6, sh)) for sh, _ in cases]
        bias = tape.param(np.zeros((1, 1, 1)))
        ys = [x.sum(axis=ax) for x, (_, ax) in zip(xs, cases)] + [x.mean(axis=ax) for x, (_, ax) in zip(xs, cases)]
        ys += [tape.apply(O.OPS["logsumexp"], x, None, (ax, False)) for x, (_, ax) in zip(xs, cases) if ax]
        ys.append(xs[0] + bias)
        loss = None
        for y in ys:
            term = (y * tape.const(rng.standard_normal(y.shape) * 10.0 ** rng.integers(-6, 6, y.shape))).sum()
            loss = term if loss is None else loss + term
        src = tape if backend == "tape" else ran(tape, loss, backend)
        if backend == "tape":
            tape.backward(loss)
        got.append([np.array(src.value(y)) for y in ys] + [np.array(src.grad(v)) for v in xs + [bias]])
    tape_, native, device = got
    assert all(np.array_equal(u, v) for u, v in zip(native, device))
    sums = len(cases) * 2   # sum and mean: exact tier (logsumexp is libm tier against the tape)
    assert all(np.array_equal(u, v) for u, v in zip(tape_[:sums], native[:sums]))
    assert all(np.array_equal(u, v) for u, v in zip(tape_[-len(xs) - 1:], native[-len(xs) - 1:]))
