"""The GPU backend without a GPU: every generated kernel compiles with nvcc (warnings as errors), and the
same CUDA source run as host C++ (the grid emulation) reproduces the CPU backends — bit for bit in
ordered mode, within the tiers otherwise."""
import shutil
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.gpu.host import emulate
from tapegrad.gpu import source as gpu_source
from tapegrad.gpu.source import CudaProgram, device_form

from capture_util import batches, make_opt, mlp, mlp_init, register

SIZES = (6, 9, 7, 3)
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if shutil.os.access("/usr/local/cuda/bin/nvcc", 1)
                                else None)


def episode_program(opt_kind, loss, ordered, backend="numpy", fuse=True, dtype="float64", sizes=SIZES):
    data = batches(sizes, 5, 3)
    tape = tg.Tape(ordered=ordered)
    params = [tape.param(a) for a in mlp_init(sizes)]
    opt = make_opt(opt_kind) if isinstance(opt_kind, str) else opt_kind()   # a name, or an optimizer factory
    register(opt, tape, params)
    tape.mark()
    x, y, out = mlp(tape, params, *data[0], "relu", loss)
    prog = tg.capture(tape, out, backend=backend, fuse=fuse, dtype=dtype)
    prog.attach(opt)
    return prog, params, x, y, data


def train(prog, params, x, y, data):
    losses = [prog.episode({x: xb, y: yb}) for xb, yb in data]
    return losses, [np.array(prog.value(p)) for p in params]


@pytest.mark.parametrize("opt_kind", ["sgd", "adam", "adam_hat_clip_torch"])
@pytest.mark.parametrize("fuse", [True, False])
def test_ordered_mlp_emulated_cuda_equals_native_and_tape(opt_kind, fuse):
    if opt_kind.endswith("clip_torch"):
        opt_kind = "adam"   # clipping: within the blas bound of the CPU backends' dot (tested below)
    ref = train(*episode_program(opt_kind, "mse", True, "native"))
    prog, params, x, y, data = episode_program(opt_kind, "mse", True, fuse=fuse)
    got = train(emulate(prog), params, x, y, data)
    assert got[0] == ref[0]
    assert all((a == b).all() for a, b in zip(got[1], ref[1]))


def test_fused_equals_per_node_and_fuses():
    runs = []
    for fuse in (True, False):
        prog, params, x, y, data = episode_program("adam", "mse", True, fuse=fuse)
        emulate(prog)
        runs.append((train(prog, params, x, y, data), prog.plan()))
    (a, plan_f), (b, plan_n) = runs
    assert a[0] == b[0] and all((u == v).all() for u, v in zip(a[1], b[1]))
    assert plan_f["kernels_forward"] < plan_n["kernels_forward"]
    # the seed's megakernel episode: fused forward, seed, row-space + param-space backward, one optimizer launch
    assert plan_f["launches_per_episode"] <= 6 < plan_n["launches_per_episode"]


@pytest.mark.parametrize("loss", ["mse", "xent"])
def test_default_mode_within_tiers_of_native(loss):
    ref = train(*episode_program("adam", loss, False, "native"))
    prog, params, x, y, data = episode_program("adam", loss, False)
    got = train(emulate(prog), params, x, y, data)
    assert np.allclose(got[0], ref[0], rtol=1e-12, atol=0)
    assert all(np.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in zip(got[1], ref[1]))


def test_float32_program_within_float32_bounds():
    ref = train(*episode_program("adam", "mse", True, "native", dtype="float32"))
    prog, params, x, y, data = episode_program("adam", "mse", True, dtype="float32")
    got = train(emulate(prog), params, x, y, data)
    assert got[0] == ref[0] and all((a == b).all() for a, b in zip(got[1], ref[1]))


def test_every_registry_op_has_a_device_form():
    assert [n for n, o in tg.ops.OPS.items() if o.arity and not device_form(o)] == []


def test_op_without_device_form_is_a_capture_time_error(monkeypatch):
    """Every registry op has a device form now; the check stays, shown on cholesky with its kernel removed."""
    monkeypatch.delitem(gpu_source._FORWARD, "cholesky")
    tape = tg.Tape()
    w = tape.param(np.ones((2, 3)))
    loss = tape.apply(tg.ops.OPS["cholesky"], w.T @ w + tape.const(np.eye(3)), None, None).sum()
    prog = tg.capture(tape, loss)
    with pytest.raises(tg.TapeError, match=r"cholesky \(node \d+\): the GPU backend has no device kernel"):
        CudaProgram(prog)


CLIPPING = {"sgd_clip_seed": lambda: tg.SGD(0.1, clip=0.05, clip_mode="seed"),
            "adam_clip_optax": lambda: tg.Adam(1e-2, clip=0.05),
            "adam_hat_clip_torch": lambda: tg.Adam(1e-2, eps_mode="hat", clip=0.05, clip_mode="torch")}
UNCLIPPED = {"sgd_clip_seed": lambda: tg.SGD(0.1), "adam_clip_optax": lambda: tg.Adam(1e-2),
             "adam_hat_clip_torch": lambda: tg.Adam(1e-2, eps_mode="hat")}


@pytest.mark.parametrize("opt_kind", list(CLIPPING))
@pytest.mark.parametrize("fuse", [True, False])
def test_clipping_on_the_device_within_the_blas_bound_of_native(opt_kind, fuse):
    """The norm is a serial Σ g² on the device, one BLAS dot per parameter on the CPU: the same decisions
    and scales up to the dot's rounding."""
    ref = train(*episode_program(CLIPPING[opt_kind], "mse", True, "native"))
    prog, params, x, y, data = episode_program(CLIPPING[opt_kind], "mse", True, fuse=fuse)
    got, clipped = train_clipped(emulate(prog), params, x, y, data)
    assert np.allclose(got[0], ref[0], rtol=1e-13, atol=0)
    for a, b in zip(got[1], ref[1]):
        assert np.all(np.abs(a - b) <= 16 * np.spacing(np.abs(b)) + 16 * np.finfo(float).eps * np.abs(b).max())
    assert all(clipped)   # the norms here are above the limit at every step
    plain, params2, x2, y2, _ = episode_program(UNCLIPPED[opt_kind], "mse", True, fuse=fuse)
    unclipped = train(emulate(plain), params2, x2, y2, data)
    assert not all((a == b).all() for a, b in zip(got[1], unclipped[1]))   # clipping changed the run


def train_clipped(prog, params, x, y, data):
    """train(), and whether the device clipped at each step (the flag the update reads)."""
    losses, clipped = [], []
    for xb, yb in data:
        losses.append(prog.episode({x: xb, y: yb}))
        clipped.append(bool(prog.runner.array(("S", gpu_source.CLIP + 1))[0]))
    return (losses, [np.array(prog.value(p)) for p in params]), clipped


def test_a_limit_above_every_norm_leaves_the_device_run_unclipped():
    """The same updates as without clipping, bit for bit (the scale is never applied)."""
    ref = train(*episode_program("adam", "mse", True, "native"))
    prog, params, x, y, data = episode_program(lambda: tg.Adam(1e-2, clip=1e9), "mse", True)
    got, clipped = train_clipped(emulate(prog), params, x, y, data)
    assert got[0] == ref[0] and all((a == b).all() for a, b in zip(got[1], ref[1]))
    assert not any(clipped)


@pytest.mark.compilers
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("ordered,dtype", [(True, "float64"), (False, "float64"), (True, "float32")])
def test_every_kernel_compiles_with_nvcc(tmp_path, ordered, dtype):
    prog, *_ = episode_program(CLIPPING["adam_clip_optax"] if ordered else "adam", "xent" if not ordered else "mse",
                               ordered, dtype=dtype)   # ordered: with the clipping kernels
    srcs = []
    for fuse in (True, False):
        cp = CudaProgram(prog, fuse)
        path = tmp_path / f"prog_{int(fuse)}.cu"
        path.write_text(cp.src)
        srcs.append(path)
    for path in srcs:
        r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--fmad=false", "-Werror", "all-warnings",
                            str(path), "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert path.with_suffix(".cubin").stat().st_size > 0


def _tiny():
    tape = tg.Tape()
    w = tape.param(np.ones((2, 2)))
    return tape, (w * w).sum()


def test_cupy_backend_without_cupy_says_so(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)   # import cupy raises ImportError
    tape, loss = _tiny()
    with pytest.raises(tg.BuildError, match=r"capture\(backend='cupy'\): CuPy is not installed .*tapegrad\[gpu\]"):
        tg.capture(tape, loss, backend="cupy")
    assert len(tape) == 3 and float(tape.value(loss)) == 4.0   # the tape is untouched


def test_cupy_backend_without_a_device_says_no_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present: the no-GPU path cannot be exercised here")
    except Exception:
        pass
    tape, loss = _tiny()
    with pytest.raises(tg.BuildError, match=r"capture\(backend='cupy'\): no GPU is available"):
        tg.capture(tape, loss, backend="cupy")


def test_import_tapegrad_does_not_import_cupy():
    code = "import sys, tapegrad, tapegrad.gpu.source, tapegrad.gpu.runner; print('cupy' in sys.modules)"
    r = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(tg.__file__).parent.parent)})
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
