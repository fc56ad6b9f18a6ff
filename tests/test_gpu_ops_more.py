"""Device forms of the conv family (conv, max_pool, sum_pool) and the linear-algebra family (cholesky,
triangular_solve, solve, logdet, logabsdet, det_sign), run as host C++ by the grid emulation against the
native CPU program: pooling equal bit for bit (values and gradients, every registry case, and ties, NaN,
signed zeros and all-padding windows, overlapping or not); conv and linear algebra within the "blas"
bound (the native program calls BLAS GEMMs and LAPACK, the device forms are serial dots and textbook
serial factorisations, one thread per element or per matrix), det_sign exactly; a matrix that is not
positive definite or is singular gives NaN values as natively; the generated source compiles with nvcc
(warnings as errors) in both dtypes."""
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.gpu.host import emulate
from tapegrad.gpu.source import CudaProgram, device_form

from test_gpu import NVCC
from test_gpu_ops import every_case, programs, ran  # noqa: F401  (the per-op fixture: one op per program)

CONV_FAMILY = ["conv", "max_pool", "sum_pool"]
LINALG_FAMILY = ["cholesky", "triangular_solve", "solve", "logdet", "logabsdet", "det_sign"]
EPS = np.finfo(np.float64).eps


def within_blas(got, want, k=16):
    """The native suite's "blas" tier bound per element: k·spacing + k·eps·max|want|."""
    tol = k * np.spacing(np.maximum(np.abs(got), np.abs(want))) + k * EPS * np.max(np.abs(want), initial=0.0)
    return bool(np.all(np.abs(got - want) <= tol))


def test_every_family_op_has_a_device_form():
    assert all(device_form(O.OPS[name]) for name in CONV_FAMILY + LINALG_FAMILY)


def exact(u, v):
    return np.array_equal(u, v, equal_nan=True)


@pytest.mark.matrix
@pytest.mark.parametrize("name", CONV_FAMILY + LINALG_FAMILY)
@pytest.mark.parametrize("fuse", [True, False])
def test_emulated_kernels_match_native(programs, name, fuse):
    """conv and linear algebra within the "blas" bound (measured: at most 2 ulp of max|native|), the sign
    of a determinant and pooling exactly."""
    built = programs(name)
    (native, want), (dev, got) = built["native"], built[fuse]
    same = within_blas if O.OPS[name].tier == "blas" and name != "det_sign" else exact
    checked = 0
    for (op_name, case, xs, y), (_, _, xd, yd) in zip(want, got):
        if op_name != name:
            continue
        assert same(np.asarray(dev.value(yd)), np.asarray(native.value(y))), (name, case, "value")
        for v, vd in zip(xs, xd):
            assert same(np.asarray(dev.grad(vd)), np.asarray(native.grad(v))), (name, case, "grad")
        checked += 1
    assert checked == len(O.OPS[name].cases)


def test_float32_programs_match_native():
    """The same claims in float32 (lgamma and digamma too: == native), the bound scaled to float32's eps."""
    eps32 = float(np.finfo(np.float32).eps)
    names = CONV_FAMILY + LINALG_FAMILY + ["lgamma", "digamma"]
    native, want = every_case("native", "float32", names=names)
    dev, got = every_case("numpy", "float32", names=names)
    emulate(dev)
    for p in (native, dev):
        p.forward()
        p.backward()
    for (name, case, xs, y), (_, _, xd, yd) in zip(want, got):
        for u, v in [(dev.value(yd), native.value(y))] + [(dev.grad(b), native.grad(a)) for a, b in zip(xs, xd)]:
            u, v = np.asarray(u), np.asarray(v)
            assert u.dtype == v.dtype == np.float32
            if O.OPS[name].tier == "blas" and name != "det_sign":
                tol = 16 * np.spacing(np.maximum(np.abs(u), np.abs(v))) + 16 * eps32 * np.max(np.abs(v))
                assert np.all(np.abs(u - v) <= tol), (name, case)
            else:
                assert exact(u, v), (name, case)


def test_conv_is_not_bit_equal_by_accident():
    """The bound is needed: somewhere the serial dot and the BLAS GEMM round differently (else the
    claim would be ==), and a wrong tap (one kernel position off) is far outside it."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((4, 3, 3, 3))
    s = ("NCHW", (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), 1)
    got = {}
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        vx, vw = tape.param(x), tape.param(w)
        y = tape.apply(O.OPS["conv"], vx, vw, s)
        prog = ran(tape, (y * y).sum(), backend)
        got[backend] = [np.array(prog.value(y)), np.array(prog.grad(vx)), np.array(prog.grad(vw))]
    assert all(within_blas(e, n) for e, n in zip(got["numpy"], got["native"]))
    assert any(not np.array_equal(e, n) for e, n in zip(got["numpy"], got["native"]))
    shifted = np.roll(got["native"][0], 1, axis=-1)
    assert not within_blas(got["numpy"][0], shifted)


@pytest.mark.matrix
@pytest.mark.parametrize("win,stride", [((1, 3, 3), (1, 1, 1)), ((1, 2, 2), (1, 2, 2))], ids=["overlap", "tiles"])
@pytest.mark.filterwarnings("ignore:invalid value")
def test_pool_ties_nans_signed_zeros_and_padding_equal_native(win, stride):
    """max_pool's gradient to the first maximum of each window (ties, −inf windows whose first maximum is
    padding, NaN windows that give no gradient), sum_pool's adds from +0 (−0 inputs): == native."""
    a = np.array([[[1.0, 3.0, 3.0, -0.0, 2.0], [3.0, 0.0, -0.0, -np.inf, 3.0], [-np.inf, -np.inf, np.nan, 1.0, 1.0],
                   [-np.inf, -np.inf, 0.0, -0.0, 3.0]]])
    s = (win, stride, ((0, 0), (1, 1), (1, 0)))
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        x = tape.param(a)
        ys = [tape.apply(O.OPS[name], x, None, s) for name in ("max_pool", "sum_pool")]
        loss = None
        for j, y in enumerate(ys):
            term = (y * tape.const(np.arange(y.size).reshape(y.shape) - 2.5 * j)).sum()
            loss = term if loss is None else loss + term
        prog = ran(tape, loss, backend)
        got.append([np.array(prog.value(y)) for y in ys] + [np.array(prog.grad(x))])
    for u, v in zip(*got):
        assert np.array_equal(u, v, equal_nan=True) and (np.signbit(u) == np.signbit(v)).all(), (u, v)
    assert np.isneginf(got[0][0]).any() and np.isnan(got[0][0]).any()   # the cases are really there


def test_failed_factorisations_give_nan_values_as_native():
    """Fed a matrix that is not positive definite (cholesky, logdet) or exactly singular (solve), the whole
    node's value is NaN on both backends (the other matrix of the batch included); logabsdet of the
    singular matrix is −inf, of the other finite."""
    bad = np.array([[[2.0, 0.0], [0.0, 1.0]], [[1.0, 2.0], [2.0, 1.0]]])
    sing = np.array([[[1.0, 2.0], [2.0, 4.0]], [[2.0, 1.0], [0.0, 1.0]]])
    got = []
    for backend in ("native", "numpy"):
        tape = tg.Tape(ordered=True)
        x, z = tape.const(np.stack([np.eye(2)] * 2)), tape.const(np.stack([np.eye(2)] * 2))
        ys = [tape.apply(O.OPS["cholesky"], x, None, None), tape.apply(O.OPS["logdet"], x, None, None),
              tape.apply(O.OPS["solve"], z, tape.param(np.ones((2, 2, 1))), None),
              tape.apply(O.OPS["logabsdet"], z, None, None)]
        prog = tg.capture(tape, ys[0].sum() + ys[1].sum() + ys[2].sum() + ys[3].sum(), backend=backend)
        if backend == "numpy":
            emulate(prog)
        prog.set_input(x, bad)
        prog.set_input(z, sing)
        prog.forward()
        got.append([np.array(prog.value(y)) for y in ys])
    for u, v in zip(*got):
        assert exact(u, v)
    assert all(np.isnan(u).all() for u in got[1][:3]) and got[1][3][0] == -np.inf and np.isfinite(got[1][3][1])


@pytest.mark.compilers
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_conv_and_linalg_kernels_compile_with_nvcc(tmp_path, dtype):
    prog, _ = every_case("numpy", dtype, names=CONV_FAMILY + LINALG_FAMILY)
    path = tmp_path / "conv.cu"
    path.write_text(CudaProgram(prog).src)
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--fmad=false", "-Werror", "all-warnings", str(path),
                        "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.compilers
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_each_linalg_op_alone_compiles_with_nvcc(tmp_path):
    """A program with one linear-algebra op carries helpers it never calls (cholesky alone: no LU): they
    must not trip nvcc's unused-function warning."""
    procs = []
    for name in LINALG_FAMILY:
        prog, _ = every_case("numpy", names=[name])
        path = tmp_path / f"{name}.cu"
        path.write_text(CudaProgram(prog).src)
        procs.append((name, subprocess.Popen([NVCC, "-arch=sm_90", "-cubin", "--fmad=false", "-Werror", "all-warnings",
                                              str(path), "-o", str(path.with_suffix(".cubin"))],
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    failed = {name: p.communicate()[0][-1500:] for name, p in procs if p.wait() != 0}
    assert not failed, failed


def test_conv_with_one_side_constant_within_the_blas_bound_of_native():
    """Only the kernel's gradient (a constant input) or only the input's (a constant kernel): each side's
    kernel is generated alone, within the "blas" bound of the native program."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 2))
    s = ("NCHW", (1, 1), ((1, 0), (0, 1)), (1, 1), (1, 1), 1)
    for const in ("x", "w"):
        got = {}
        for backend in ("native", "numpy"):
            tape = tg.Tape(ordered=True)
            vx = tape.const(x) if const == "x" else tape.param(x)
            vw = tape.const(w) if const == "w" else tape.param(w)
            y = tape.apply(O.OPS["conv"], vx, vw, s)
            prog = ran(tape, (y * y).sum(), backend)
            got[backend] = np.array(prog.grad(vw if const == "x" else vx))
        assert within_blas(got["numpy"], got["native"]) and np.abs(got["native"]).max() > 1.0, const


@pytest.mark.parametrize("name,s", [("triangular_solve", (True, True, False, False)),
                                    ("triangular_solve", (False, False, True, False)), ("solve", None)])
def test_solves_with_one_side_constant_and_a_shared_right_hand_side_within_the_blas_bound(name, s):
    """Only b's gradient (a constant matrix), only the matrix's (a constant b), and b read again before the
    solve (its gradient is then not b's first contribution): within the "blas" bound of native."""
    op = O.OPS[name]
    rng = np.random.default_rng(6)
    a = op.domain[0](rng, (3, 3))
    b = rng.standard_normal((3, 2) if s is None or s[0] else (2, 3))
    for const in ("a", "b"):
        got = {}
        for backend in ("native", "numpy"):
            tape = tg.Tape(ordered=True)
            va = tape.const(a) if const == "a" else tape.param(a)
            vb = tape.const(b) if const == "b" else tape.param(b)
            y = tape.apply(op, va, vb, s)
            loss = (y * y).sum() + ((vb * vb).sum() if const == "a" else 0.0)
            prog = ran(tape, loss, backend, episodes=2)
            got[backend] = np.array(prog.grad(vb if const == "a" else va))
        assert within_blas(got["numpy"], got["native"]) and np.abs(got["native"]).max() > 0.1, const
