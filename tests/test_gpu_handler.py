"""The GPU custom call's C handler (interop/xla/tg_gpu.c) without a GPU.

It compiles with warnings as errors; its pure parts (the step scalars, the settab plan) equal the CPU
backends' values with ``==``; without a driver it fails with a clear error, through XLA's own call frames
too; and driven by a stand-in driver (tests/gpu_fake/fake_cuda.c: host memory, settab applied as the
kernel would, the graph launch running the program's CUDA launch lists in the host emulation) with
call frames built like XLA's (tests/gpu_fake/fake_frame.c), a jitted-style sequence of episodes equals
the native CPU program bit for bit in ordered mode.
"""
import ctypes
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from interop import jax
from interop.xla import program as P
from interop.xla.gpu_call import _handles, _optimizer
from tapegrad.gpu.host import emulate
from tapegrad.gpu.source import SETTAB, CudaProgram
from tapegrad.native import build

from capture_util import batches, make_opt, mlp, mlp_init, register

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (5, 7, 3)


def _cc(args, out):
    cc = build.find_compiler()
    r = subprocess.run([cc, *args, "-o", str(out)], capture_output=True, text=True)
    if r.returncode:
        raise tg.BuildError(f"{cc} failed on {out.name}:\n{r.stderr[-3000:]}")
    return str(out)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The handler library (c_api.h + step_scalars.c + tg_xla.c + tg_gpu.c, built with the native build's
    flags and -Werror), the stand-in driver and the frame harness; each test loads its own copy of the
    handler, so the driver it opens (once per process and library) is the one the test chose."""
    d = tmp_path_factory.mktemp("gpu_handler")
    src = d / "handler.c"
    src.write_text(P._source())
    flags = [f for f in build.FLAGS] + ["-Werror"]
    lib = _cc([*flags, str(src), "-lm", "-ldl", "-lpthread"], d / "handler.so")
    fake = _cc(["-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
                os.path.join(HERE, "gpu_fake", "fake_cuda.c")], d / "libfakecuda.so")
    header = P.ffi_header()
    with open(os.path.join(HERE, "gpu_fake", "fake_frame.c")) as f:
        (d / "frame.c").write_text(header + "\n" + f.read())
    frame = _cc(["-O1", "-fPIC", "-shared", "-std=c11", "-Wall", "-Wextra", "-Werror", str(d / "frame.c")],
                d / "frame.so")
    return {"dir": d, "lib": lib, "fake": fake, "frame": ctypes.CDLL(frame), "copies": 0}


def fresh(built):
    """A private copy of the handler library (its own driver state)."""
    built["copies"] += 1
    path = built["dir"] / f"handler_{built['copies']}.so"
    shutil.copy(built["lib"], path)
    lib = ctypes.CDLL(str(path))
    lib.tg_gpu_driver.argtypes, lib.tg_gpu_driver.restype = [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int
    lib.tg_gpu_ctl.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                               ctypes.c_double, ctypes.c_void_p]
    lib.tg_gpu_plan.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 4
    lib.tg_gpu_plan.restype = ctypes.c_int64
    lib.tg_gpu_settab_capacity.restype = ctypes.c_int64
    return lib


def stand_in(built):
    fake = ctypes.CDLL(built["fake"])
    fake.fake_log.restype = ctypes.c_char_p
    fake.fake_setup.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return fake


def driver_message(lib):
    buf = ctypes.create_string_buffer(2048)
    return lib.tg_gpu_driver(buf, 2048), buf.value.decode()


# ── pure parts ───────────────────────────────────────────────────────────────

@pytest.mark.parametrize("conf", [dict(lr=1e-3), dict(lr=0.05, b1=0.8, b2=0.99, eps_mode="hat"),
                                  dict(lr=3e-4, b1=0.95, b2=0.9999)])
def test_step_scalars_equal_the_optimizers_own(built, conf):
    lib = fresh(built)
    opt = tg.Adam(**conf)
    ctl = np.full(9, 7.0)   # the handler writes TG_CTL = 8 doubles; the ninth is a sentinel
    for count in (1, 2, 3, 10, 999, 12345):
        lib.tg_gpu_ctl(2, int(opt.eps_mode == "hat"), opt.lr, opt.b1, opt.b2, float(count), ctl.ctypes.data)
        want = opt.step_scalars(count)
        assert tuple(ctl[:len(want)]) == want and (ctl[len(want):8] == 0).all() and ctl[8] == 7.0
    lib.tg_gpu_ctl(1, 0, 0.1, 0.0, 0.0, 5.0, ctl.ctypes.data)   # SGD: no scalars
    assert (ctl[:8] == 0).all()


def test_settab_plan_points_written_slots_at_results_and_reads_at_operands(built):
    lib = fresh(built)
    assert lib.tg_gpu_settab_capacity() == SETTAB
    slot = np.array([4, -1, 9, -1, 2, 7], np.int64)   # 3 written (params, state), count (-1), 2 inputs
    args = np.array([1000, 1100, 1200, 1300, 1400, 1500], np.uint64)
    rets = np.array([2000, 2100, 2200, 2300, 2400], np.uint64)   # loss, 3 written, count
    idx, ptr = np.zeros(7, np.int64), np.zeros(7, np.int64)
    n = lib.tg_gpu_plan(6, 3, slot.ctypes.data, 11, args.ctypes.data, rets.ctypes.data, idx.ctypes.data,
                        ptr.ctypes.data)
    assert n == 5
    assert idx[:n].tolist() == [4, 9, 2, 7, 11]
    assert ptr[:n].tolist() == [2100, 2300, 1400, 1500, 2000]


# ── without a driver ─────────────────────────────────────────────────────────

def test_without_libcuda_the_error_says_no_driver(built, monkeypatch):
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", str(built["dir"] / "no" / "libcuda.so.1"))
    rc, msg = driver_message(fresh(built))
    assert rc == -1 and msg.startswith("no CUDA driver: cannot load ") and "no/libcuda.so.1" in msg
    assert "needs an NVIDIA GPU and its driver" in msg


def test_a_library_without_cuGetProcAddress_is_named(built, monkeypatch):
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", str(built["lib"]))   # loads, but is no driver
    rc, msg = driver_message(fresh(built))
    assert rc == -1 and "has no cuGetProcAddress" in msg and "handler.so" in msg


def test_a_driver_without_devices_says_no_gpu(built, monkeypatch):
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", built["fake"])
    lib, fake = fresh(built), stand_in(built)
    fake.fake_setup(ctypes.c_void_p(0x5EED), 100, None)   # cuInit: CUDA_ERROR_NO_DEVICE
    rc, msg = driver_message(lib)
    assert rc == -1 and msg.startswith("no GPU is available: cuInit failed with CUDA_ERROR_NO_DEVICE (100: no "
                                       "CUDA-capable device is detected)")
    log = fake.fake_log().decode()   # every entry point at the CUDA 12.0 ABI, legacy-stream flavour
    assert "proc cuMemcpyHtoDAsync 12000 1;" in log and "proc cuGraphLaunch 12000 1;" in log


def test_xla_call_frames_reach_the_handler_errors(built):
    """Registered for the CPU platform under a test name: XLA's real call frames, the handler's messages."""
    lib, names = P.native_library()
    name = names["gpu_episode"] + "_cputest"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.tg_gpu_episode), platform="cpu")
    prog = mlp_program("adam", backend="native")
    attrs = dict(_handles(prog, dict(graph=1, settab=2, table=3, ctl=4), CudaProgram(prog, fuse=True)), **_optimizer(prog))
    xs, specs = operands(prog)
    call = jax.ffi.ffi_call(name, specs, vmap_method="sequential")
    with pytest.raises(jax.errors.JaxRuntimeError, match="tg_gpu_episode: missing i64 attribute 'graph'"):
        call(*xs, **{k: v for k, v in attrs.items() if k != "graph"})
    with pytest.raises(jax.errors.JaxRuntimeError, match="tg_gpu_episode: missing f64 attribute 'lr'"):
        call(*xs, **dict(attrs, lr=np.int64(1)))
    bad = attrs["slots"].copy()
    bad[0] = 999
    with pytest.raises(jax.errors.JaxRuntimeError, match="operand 0 names table entry 999; the table has"):
        call(*xs, **dict(attrs, slots=bad))
    with pytest.raises(jax.errors.JaxRuntimeError, match="'slots' and 'home' have"):
        call(*xs[:-1], **attrs)
    if driver_message(lib)[0] == 0:
        pytest.skip("a CUDA driver is present: the no-driver path cannot be exercised here")
    with pytest.raises(jax.errors.JaxRuntimeError, match="tg_gpu_episode: no CUDA driver"):   # attributes pass, then the driver
        call(*xs, **attrs)


# ── the whole call on a stand-in driver ─────────────────────────────────────

def mlp_program(opt_kind, backend="numpy"):
    data = batches(SIZES, 4, 3)
    tape = tg.Tape(ordered=True)
    params = [tape.param(a) for a in mlp_init(SIZES)]
    opt = tg.Adam(1e-2, eps_mode="hat") if opt_kind == "adam_hat" else make_opt(opt_kind)
    register(opt, tape, params)
    tape.mark()
    x, y, out = mlp(tape, params, *data[0], "relu", "mse")
    prog = tg.capture(tape, out, backend=backend)
    prog.attach(opt)
    prog.test_data = (params, x, y, data)
    return prog


def operands(prog, batch=0):
    """(params..., state..., count, inputs...) as JAX arrays of the program's start, and the result specs."""
    params, x, y, data = prog.test_data
    sig = P._Sig(prog)
    xs = [np.array(prog.value(p)) for p in params] + [np.zeros(s) for s in sig.state] + [np.zeros(())]
    xs += [np.asarray(data[batch][0]), np.asarray(data[batch][1])]
    specs = [jax.ShapeDtypeStruct((), np.float64)] + [jax.ShapeDtypeStruct(s, np.float64)
                                                      for s in sig.params + sig.state]
    specs.append(jax.ShapeDtypeStruct((), np.float64))
    with jax.enable_x64(True):
        return [jax.numpy.asarray(a) for a in xs], specs


def call_frame(built, handler, args, nw, attrs, stream, device=0, rets=None):
    """One call of ``handler`` on host buffers: results are the written operands themselves (aliased),
    unless ``rets`` (loss, written..., count) is given."""
    frame = built["frame"]
    if rets is None:
        rets = [np.zeros(1)] + args[:nw] + [args[nw]]   # loss, params/state (aliases), count (alias)
    kinds, values, sizes, names, keep = [], [], [], [], []
    for k, v in sorted(attrs.items()):
        a = np.atleast_1d(np.asarray(v))
        a = a.astype(np.float64 if a.dtype.kind == "f" else np.int64)
        keep.append(a)
        names.append(k.encode())
        kinds.append(2 if np.ndim(v) else (1 if a.dtype.kind == "f" else 0))
        values.append(a.ctypes.data)
        sizes.append(a.size)
    P_ = ctypes.c_void_p
    argp = (P_ * len(args))(*[a.ctypes.data for a in args])
    retp = (P_ * len(rets))(*[a.ctypes.data for a in rets])
    msg = ctypes.create_string_buffer(4096)
    rc = frame.frame_call(
        ctypes.cast(handler, P_), ctypes.c_int64(len(args)), argp,
        np.array([a.size for a in args], np.int64).ctypes.data_as(P_), ctypes.c_int64(len(rets)), retp,
        np.array([a.size for a in rets], np.int64).ctypes.data_as(P_), ctypes.c_int(12),
        ctypes.c_int64(len(names)), (ctypes.c_char_p * len(names))(*names), (ctypes.c_int * len(names))(*kinds),
        (P_ * len(names))(*values), np.array(sizes, np.int64).ctypes.data_as(P_), P_(stream), ctypes.c_int(device),
        msg, ctypes.c_int64(4096))
    return rc, msg.value.decode(), float(rets[0].reshape(-1)[0])


@pytest.mark.parametrize("opt_kind", ["adam", "sgd", "adam_hat"])
def test_episodes_through_the_handler_equal_the_native_program(built, monkeypatch, opt_kind):
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", built["fake"])
    lib, fake = fresh(built), stand_in(built)
    ref = mlp_program(opt_kind, "native")
    prog = emulate(mlp_program(opt_kind))
    runner = prog.runner
    work = runner.cp.forward + runner.cp.backward + runner.cp.step
    replays = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def graph(handle):   # the "device" replays the episode's launch lists; ctl was uploaded by the handler
        replays.append(handle)
        runner.run(work)

    stream = 0x5EED
    fake.fake_setup(stream, 0, ctypes.cast(graph, ctypes.c_void_p))
    attrs = dict(_handles(prog, dict(runner.handles(), graph=0x6A, settab=0x5E), runner.cp), **_optimizer(prog))
    home = runner.vt.copy()
    params, x, y, data = prog.test_data
    sig = P._Sig(prog)
    nw = len(sig.params) + len(sig.state)
    state = [np.array(prog.value(p)) for p in params] + [np.zeros(s) for s in sig.state] + [np.zeros(())]
    state = [np.ascontiguousarray(a, np.float64) for a in state]
    for b, (xb, yb) in enumerate(data):
        fake.fake_clear()
        args = state + [np.ascontiguousarray(xb, np.float64), np.ascontiguousarray(yb, np.float64)]
        rc, msg, loss = call_frame(built, lib.tg_gpu_episode, args, nw, attrs, stream)
        assert rc == 0, msg
        want = ref.episode({ref.test_data[1]: xb, ref.test_data[2]: yb})
        assert loss == want
        log = fake.fake_log().decode().rstrip(";").split(";")
        log = [e for e in log if not e.startswith(("proc ", "init ", "device ", "retain "))]
        nset = int((attrs["slots"] >= 0).sum()) + 1
        assert log == ["push 100", "dtoh 8", "sync", "htod 64", f"settab 5e 1,1,1 {SETTAB},1,1 0 {nset}",
                       "graph 6a", f"settab 5e 1,1,1 {SETTAB},1,1 0 {nset}", "htod 8", "pop"]
        assert (runner.vt == home).all()   # the table points at the program's own buffers again
    assert len(replays) == len(data) and state[nw].tolist() == [float(len(data))]   # the count, advanced
    for k, p in enumerate(ref.test_data[0]):
        assert (state[k] == np.asarray(ref.value(p))).all()
    if ref.opt.kind == "Adam":
        mine = state[len(sig.params):nw]
        theirs = [a for j in range(len(ref.opt.ids)) for a in (ref.opt.mu[j], ref.opt.nu[j])]
        assert all((a == b).all() for a, b in zip(mine, theirs))


def test_handler_metadata_and_wrong_device(built, monkeypatch):
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", built["fake"])
    lib, fake = fresh(built), stand_in(built)
    out = np.zeros(3, np.int64)
    assert built["frame"].frame_metadata(ctypes.cast(lib.tg_gpu_episode, ctypes.c_void_p),
                                         out.ctypes.data_as(ctypes.c_void_p)) == 0
    api = [int(re.search(rf"#define XLA_FFI_API_{part} (\d+)", P.ffi_header()).group(1)) for part in ("MAJOR", "MINOR")]
    assert api[0] == 0 and api[1] >= 3         # jaxlib 0.10.2: FFI API 0.3; 0.12: 0.5
    assert out.tolist() == [*api, 0]           # the header's version; traits 0: never in XLA's command buffers
    fake.fake_setup(1, 0, None)
    prog = emulate(mlp_program("adam"))
    attrs = dict(_handles(prog, dict(prog.runner.handles(), graph=1, settab=2), prog.runner.cp), **_optimizer(prog))
    xs, _ = operands(prog)
    args = [np.array(a) for a in xs]
    rc, msg, _ = call_frame(built, lib.tg_gpu_episode, args, len(args) - 3, attrs, 1, device=3)
    assert rc == 1 and "the program lives on CUDA device 0, this call runs on device 3" in msg
    rc, msg, _ = call_frame(built, lib.tg_gpu_episode, args, len(args) - 3, attrs, 0)
    assert rc == 1 and "XLA gives this call no CUDA stream" in msg


def test_results_that_are_not_their_operands_get_a_copy_first(built, monkeypatch):
    """Where XLA gives a written result its own buffer, the handler copies the operand into it (device to
    device) and the episode updates the result; the operands stay as they were."""
    monkeypatch.setenv("TAPEGRAD_LIBCUDA", built["fake"])
    lib, fake = fresh(built), stand_in(built)
    ref = mlp_program("adam", "native")
    prog = emulate(mlp_program("adam"))
    runner = prog.runner
    work = runner.cp.forward + runner.cp.backward + runner.cp.step

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def graph(handle):
        runner.run(work)

    fake.fake_setup(0x5EED, 0, ctypes.cast(graph, ctypes.c_void_p))
    attrs = dict(_handles(prog, dict(runner.handles(), graph=0x6A, settab=0x5E), runner.cp), **_optimizer(prog))
    params, x, y, data = prog.test_data
    sig = P._Sig(prog)
    nw = len(sig.params) + len(sig.state)
    args = [np.ascontiguousarray(prog.value(p), np.float64) for p in params] + [np.zeros(s) for s in sig.state]
    args += [np.zeros(1), np.ascontiguousarray(data[0][0]), np.ascontiguousarray(data[0][1])]
    before = [a.copy() for a in args]
    rets = [np.zeros(1)] + [np.full_like(a, np.nan) for a in args[:nw]] + [np.zeros(1)]
    rc, msg, loss = call_frame(built, lib.tg_gpu_episode, args, nw, attrs, 0x5EED, rets=rets)
    assert rc == 0, msg
    log = fake.fake_log().decode()
    assert log.count("dtod ") == nw and log.index("dtod ") < log.index("graph ")
    assert loss == ref.episode({ref.test_data[1]: data[0][0], ref.test_data[2]: data[0][1]})
    assert all((a == b).all() for a, b in zip(args, before))   # operands untouched
    assert all((r == np.asarray(ref.value(p))).all() for r, p in zip(rets[1:], ref.test_data[0]))
    assert rets[-1].tolist() == [1.0]
