"""The CUDA source generator (tapegrad/gpu/source.py) on what the MLP episodes of tests/test_gpu.py do not
build: layout ops, sums over some axes and over long rows, operands that broadcast in every way, static
and three-input elementwise nodes with a bool mask, every elementwise op, gradients that collect several
contributions (and first ones that must keep a -0.0), softmax_xent over any axis with trained targets,
matmul gradients that accumulate, the fusion rules, optimizer steps over wide and untouched parameters,
the custom call's table slots, the launch plan, which ops have a device form and the capture-time errors.

Each graph runs twice (forward and backward) in the host emulation of its CUDA program, fused and per
node, and must equal the native CPU program bit for bit (``==`` and the signs of zeros), except where a
tier allows otherwise (BLAS calls, clipping's norm, softmax_xent's total: the bound is stated there).
"""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.gpu import source as gpu_source
from tapegrad.gpu.host import emulate
from tapegrad.gpu.source import CudaProgram

from test_gpu import NVCC

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
            assert (np.signbit(g) == np.signbit(w)).all(), (fuse, j, "the sign of a zero")


def weighted(tape, rng, ys):
    """Σ_j Σ y_j · r_j with fixed random weights r_j, every third one −0.0: a scalar loss that reads every
    output element, and gradients with negative zeros (which a first contribution must keep: adding it to
    a zeroed buffer would make them +0.0)."""
    loss = None
    for y in ys:
        r = rng.standard_normal(y.shape)
        r.reshape(-1)[::3] = -0.0
        term = (y * tape.const(r)).sum()
        loss = term if loss is None else loss + term
    return loss


# ── layout ops and sums over some axes ──────────────────────────────────────

def layout(tape, rng):
    """transpose, reshape, broadcast_to and sums/means over some axes: leaves read several times (their
    gradients collect contributions after the first) and leaves read once, by a reshape or a transpose
    (whose contribution is the first)."""
    x = tape.param(rng.standard_normal((2, 3, 4)))
    w = tape.param(rng.standard_normal((3, 1)))
    z = tape.param(rng.standard_normal((2, 3)))
    q = tape.param(rng.standard_normal((3, 4)))
    ys = [x.transpose((2, 0, 1)), x.transpose((1, 2, 0)) * 2.0, x.reshape(4, 6), x.reshape(6, 4) + 1.0,
          tg.broadcast_to(w, (2, 3, 5)), tg.broadcast_to(w, (3, 2)) * 3.0,
          x.sum(axis=1), x.sum(axis=(0, 2), keepdims=True), x.mean(axis=0), x.sum(), x.mean(axis=(1, 2)),
          x.sum(axis=2), z.reshape(3, 2), q.T]
    return [x, w, z, q], ys, weighted(tape, rng, ys)


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


# ── elementwise operands ────────────────────────────────────────────────────

def operands(tape, rng):
    """Elementwise nodes whose operands broadcast in every way (a (2,) row, a scalar, a (3, 4) block
    under (2, 3, 4), a column times a row, a column over 2 columns), node 0 as the second operand of a
    fused row, static operands (x + s, x · s, xˢ), a constant first operand, and a leaf whose gradient
    collects a summed-back contribution after a same-shape one."""
    w0 = tape.param(rng.standard_normal((4, 5)))    # node 0
    x = tape.param(rng.standard_normal((4, 5)))
    r = tape.param(rng.standard_normal(2))
    sc = tape.param(np.array(1.25))
    m = tape.param(rng.standard_normal((3, 4)))
    cube = tape.param(rng.standard_normal((2, 3, 4)))
    col = tape.param(rng.standard_normal((3, 1)))
    row = tape.param(rng.standard_normal((1, 4)))
    y = tape.param(rng.standard_normal((3, 2)))
    ys = [(x * w0).relu() * 1.5, y * r, y * sc, cube + m, cube * m, col * row, col + row, col * y,
          tape.const(rng.standard_normal((3, 2))) * y, (x + 2.5) ** 3.0, x / -0.75]
    ys.append(row * row)   # row's first contribution (recorded last); col + row's summed one comes after it
    return [w0, x, r, sc, m, cube, col, row, y], ys, weighted(tape, rng, ys)


@pytest.mark.parametrize("ordered", [True, False])
def test_broadcast_and_static_operands_equal_native(ordered):
    assert_equal_native(operands, ordered)


def masked(tape, rng):
    """where with a bool mask that is node 0 (a data input read as bytes), both branches trained."""
    mask = tape.const(rng.standard_normal((3, 4)) > 0)
    a = tape.param(rng.standard_normal((3, 4)))
    b = tape.param(rng.standard_normal((1, 4)))
    ys = [tg.where(mask, a, b), tg.where(mask, a * 2.0, 0.5)]
    return [a, b], ys, weighted(tape, rng, ys)


@pytest.mark.parametrize("ordered", [True, False])
def test_where_with_a_bool_mask_equals_native(ordered):
    assert_equal_native(masked, ordered)


# ── softmax_xent ────────────────────────────────────────────────────────────

def xents(tape, rng):
    """Three softmax_xent nodes: over the last axis, over a middle and over the first axis of a 3-D
    array (lines strided by an inner extent), the first two with trained targets (db)."""
    a = tape.param(rng.standard_normal((4, 5)))
    t = tape.param(rng.dirichlet(np.ones(5), 4))
    a3 = tape.param(rng.standard_normal((3, 4, 2)))
    t3 = tape.param(rng.dirichlet(np.ones(4), (3, 2)).transpose(0, 2, 1).copy())
    ys = [tg.softmax_cross_entropy(a, t), tg.softmax_cross_entropy(a3, t3, axis=1),
          tg.softmax_cross_entropy(a3, tape.const(rng.dirichlet(np.ones(3), (4, 2)).transpose(2, 0, 1).copy()),
                                   axis=0)]
    return [a, t, a3, t3], ys, ys[0] * 1.5 + ys[1] * 0.5 + ys[2]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("ordered", [True, False])
def test_softmax_xent_over_any_axis_with_trained_targets_equals_native(ordered, dtype):
    """Gradients bit for bit; the loss values within the "order" tier (the device adds the n = 24 terms
    −t·logsoftmax in one serial total, the native program line by line): with targets ≥ 0 every term
    is ≥ 0, so |device − native| ≤ n·eps·value."""
    want = run(xents, "native", ordered, dtype=dtype)
    eps = np.finfo(dtype).eps
    for fuse in (True, False):
        got = run(xents, "gpu", ordered, fuse, dtype)
        for g, w in zip(got[:3], want[:3]):
            assert abs(float(g) - float(w)) <= 24 * eps * abs(float(w))
        assert all(np.array_equal(g, w) for g, w in zip(got[3:], want[3:]))


# ── matmul gradients that collect several contributions ────────────────────

def matmuls(tape, rng):
    """x read by two matmuls, w by two more: the second contribution to each gradient adds to the first."""
    x = tape.param(rng.standard_normal((4, 3)))
    w = tape.param(rng.standard_normal((3, 5)))
    v = tape.param(rng.standard_normal((3, 2)))
    z = tape.param(rng.standard_normal((6, 3)))
    ys = [x @ w, x @ v, z @ w, (x @ w).relu() @ tape.const(rng.standard_normal((5, 2)))]
    return [x, w, v, z], ys, weighted(tape, rng, ys)


def test_ordered_matmul_gradients_that_accumulate_equal_native():
    assert_equal_native(matmuls, True)


def test_default_mode_matmul_gradients_that_accumulate_within_the_blas_bound():
    """Default mode: cuBLAS call sites (NumPy's matmul in the emulation) against the native program's
    BLAS: each element within the "blas" tier's 16·spacing + 16·eps·max|native|."""
    want = run(matmuls, "native", False)
    for fuse in (True, False):
        got = run(matmuls, "gpu", False, fuse)
        for g, w in zip(got, want):
            tol = 16 * np.spacing(np.abs(w)) + 16 * EPS * np.max(np.abs(w))
            assert g.shape == w.shape and np.all(np.abs(g - w) <= tol)


# ── fusion ──────────────────────────────────────────────────────────────────

def rows(tape, rng):
    """A row-local run h → t → u whose member t is a (rows, 1) column, then v with other rows."""
    x = tape.param(rng.standard_normal((4, 5)))
    c = tape.param(rng.standard_normal((4, 1)))
    p = tape.param(rng.standard_normal((6, 5)))
    h = x * 2.0
    t = c * 3.0
    u = h * t
    v = p * 0.5
    ys = [u, v]
    return [x, c, p], ys, u.sum() + v.sum()


def test_a_row_local_run_with_a_column_member_is_one_kernel_and_other_rows_start_another():
    """Forward: h, t, u fused into one kernel (t, a (4, 1) column, is read at its row by u); v (6 rows)
    cannot join a 4-row grid; then the two sums and their add: 5 launches, values equal to native."""
    assert_equal_native(rows)
    tape = tg.Tape(ordered=True)
    _, _, loss = rows(tape, np.random.default_rng(7))
    prog = tg.capture(tape, loss)
    assert [len(CudaProgram(prog, fuse).forward) for fuse in (True, False)] == [5, 7]


# ── the custom call's table slots, kernel launches ──────────────────────────

@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_operand_slots_point_at_each_operands_memory(kind):
    """interop.xla.gpu_call's operands (params, Adam's moments per attached parameter, the step count,
    inputs) map to table entries holding that operand's address; -1 where no kernel reads it (a param
    the loss does not reach, its moments, an unused input, the count); the loss's entry holds its value."""
    rng = np.random.default_rng(4)
    tape = tg.Tape(ordered=True)
    w = tape.param(rng.standard_normal((3, 2)))
    idle = tape.param(rng.standard_normal(2))
    b = tape.param(rng.standard_normal(2))
    x = tape.const(rng.standard_normal((4, 3)))
    tape.const(rng.standard_normal(5))   # an input nothing reads
    loss = ((x @ w + b) ** 2.0).mean()
    prog = tg.capture(tape, loss)
    opt = getattr(tg, kind)(1e-2)
    for p in (w, idle, b):
        opt.add(tape, p)
    prog.attach(opt)
    emulate(prog)
    runner = prog.runner
    slots, loss_slot = runner.cp.operand_slots()

    def address(slot):
        return -1 if slot == -1 else int(runner.vt[slot])

    want = [prog.val[k].ctypes.data if k != idle.id else -1 for k in prog.params]
    if kind == "Adam":
        for j, k in enumerate(prog.opt.ids):
            want += [prog.opt.mu[j].ctypes.data, prog.opt.nu[j].ctypes.data] if k != idle.id else [-1, -1]
    want.append(-1)
    want += [prog.val[k].ctypes.data if k == x.id else -1 for k in prog.consts]
    assert [address(s) for s in slots] == want
    assert address(loss_slot) == prog.val[prog.loss_id].ctypes.data
    assert len(prog.params) == 3 and len(prog.consts) == 2


def test_the_plan_counts_every_launch_and_each_names_one_kernel_of_the_source():
    """plan()'s launches per episode are the launches an episode makes; every launch is a kernel defined
    once in the source or a cuBLAS call site (default mode)."""
    from test_gpu import episode_program
    for ordered in (True, False):
        prog, *_ = episode_program("adam", "xent", ordered)
        emulate(prog)
        made = []
        launch = prog.runner.launch
        prog.runner.launch = lambda L: (made.append(L), launch(L))
        prog.episode()
        assert prog.plan()["launches_per_episode"] == len(made)
        cp = prog.runner.cp
        assert {L.kind for L in made} == ({"kernel"} if ordered else {"kernel", "gemm"})
        for L in made:
            assert L.kind == "gemm" or cp.src.count(f" void {L.name}(") == 1


# ── every elementwise op, the optimizer step ────────────────────────────────

def test_every_elementwise_op_equals_native():
    """Every case of every elementwise registry op in one ordered program (values and gradients, through
    the per-node and fused kernels): the same C expressions and the host's libm, so the same bits."""
    from test_gpu_ops import every_case
    names = [n for n, o in O.OPS.items() if o.kind == "elementwise"]
    native, want = every_case("native", names=names)
    native.forward()
    native.backward()
    for fuse in (True, False):
        dev, got = every_case("numpy", names=names)
        emulate(dev, fuse)
        dev.forward()
        dev.backward()
        for (name, case, xs, y), (_, _, xd, yd) in zip(want, got):
            assert np.array_equal(dev.value(yd), native.value(y), equal_nan=True), (name, case, fuse)
            for v, vd in zip(xs, xd):
                assert np.array_equal(dev.grad(vd), native.grad(v), equal_nan=True), (name, case, fuse)


def trained(opt, tape, rng):
    """A program with a parameter of 320 elements (more than one block of 256 threads) and an L2 term,
    then one the loss does not reach (no gradient, no update; its memory follows the wide one's without
    padding, so a step writing one element too many would move it), ``opt`` attached."""
    big = tape.param(rng.standard_normal((16, 20)))
    idle = tape.param(rng.standard_normal(3))
    w = tape.param(rng.standard_normal((20, 2)))
    x = tape.const(rng.standard_normal((4, 16)))
    loss = ((x @ big @ w).tanh() ** 2.0).mean()
    for k, p in enumerate((big, idle, w)):
        opt.add(tape, p, l2=0.01 if k == 0 else 0.0)
    return [big, idle, w], loss


@pytest.mark.parametrize("make", [lambda: tg.SGD(0.1), lambda: tg.Adam(1e-2), lambda: tg.Adam(1e-2, eps_mode="hat"),
                                  lambda: tg.Adam(1e-2, clip=1e-3), lambda: tg.SGD(0.1, clip=1e-3, clip_mode="seed")],
                         ids=["sgd", "adam", "adam_hat", "adam_clip", "sgd_clip"])
def test_optimizer_steps_over_wide_and_untouched_parameters_equal_native(make):
    """Three episodes: the parameters (the idle one unchanged) and losses equal the native program's bit
    for bit; with clipping within the "blas" bound (the device's norm is a serial Σ g², the CPU's a dot)."""
    runs = []
    for backend, fuse in (("native", True), ("gpu", True), ("gpu", False)):
        tape = tg.Tape(ordered=True)
        opt = make()
        params, loss = trained(opt, tape, np.random.default_rng(9))
        prog = tg.capture(tape, loss, backend="native" if backend == "native" else "numpy", fuse=fuse)
        prog.attach(opt)
        if backend == "gpu":
            emulate(prog, fuse)
        losses = [prog.episode() for _ in range(3)]
        runs.append((losses, [np.array(prog.value(p)) for p in params]))
    (want, wp), start = runs[0], trained(tg.SGD(0.1), tg.Tape(), np.random.default_rng(9))[0]
    assert (wp[1] == start[1].value).all() and not (wp[0] == start[0].value).all()
    for got, gp in runs[1:]:
        if make().clip is None:
            assert got == want and all((a == b).all() for a, b in zip(gp, wp))
        else:
            assert np.allclose(got, want, rtol=1e-13, atol=0)
            assert all(np.all(np.abs(a - b) <= 16 * np.spacing(np.abs(b)) + 16 * EPS * np.abs(b).max())
                       for a, b in zip(gp, wp))


# ── what the device cannot run, said at capture ─────────────────────────────

def test_device_form_needs_every_expression_and_only_device_helpers(monkeypatch):
    import dataclasses
    assert gpu_source.device_form(O.OPS["where"]) and gpu_source.device_form(O.OPS["digamma"])
    for field in ("c_fwd", "c_da", "c_db"):
        assert not gpu_source.device_form(dataclasses.replace(O.OPS["where"], name=f"where_no_{field}", **{field: None}))
    assert gpu_source.device_form(O.OPS["take"])   # other kinds: a kernel registered under the op's name
    assert not gpu_source.device_form(dataclasses.replace(O.OPS["take"], name="take_renamed"))
    monkeypatch.setattr(gpu_source.device_runtime, "DEVICE_FUNCS", frozenset({"tg_digamma"}))
    assert not gpu_source.device_form(O.OPS["digamma"])   # its derivative calls tg_trigamma
    assert gpu_source.device_form(O.OPS["lgamma"])


def test_a_missing_kernel_is_named_at_capture(monkeypatch):
    tape = tg.Tape()
    w = tape.param(np.ones((2, 3)))
    t = w.T
    loss = (t * t).sum()
    prog = tg.capture(tape, loss)
    monkeypatch.delitem(gpu_source._BACKWARD, "transpose")
    with pytest.raises(tg.TapeError, match=rf"^transpose \(node {t.id}\): the GPU backend has no backward kernel "
                                           r"for this op$"):
        CudaProgram(prog)
    monkeypatch.delitem(gpu_source._FORWARD, "transpose")
    with pytest.raises(tg.TapeError, match=rf"^transpose \(node {t.id}\): the GPU backend has no device kernel for "
                                           r"this op; use backend='native' or 'numpy'$"):
        CudaProgram(prog)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_the_source_defines_infinity_and_nan_where_no_math_h_does(tmp_path):
    """NVRTC (CuPy's compiler) includes no math.h; the source then defines INFINITY and NAN itself. nvcc
    with math.h's definitions removed must still build kernels that use them (max_pool's padding,
    cholesky's value for a failed factorisation)."""
    from test_gpu_ops import every_case
    import subprocess
    prog, _ = every_case("numpy", names=["max_pool", "cholesky", "solve"])   # solve: the LU helpers are used
    src = CudaProgram(prog).src
    assert "INFINITY" in src.split("#ifndef NAN")[1] and "NAN;" in src
    path = tmp_path / "no_math_h.cu"
    path.write_text("#include <math.h>\n#undef INFINITY\n#undef NAN\n" + src)
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--fmad=false", "-Werror", "all-warnings", str(path),
                        "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
