"""``CupyRunner`` (backend="cupy") without a GPU: a stand-in ``cupy`` (tests/fake_cupy.py) runs the kernels
the runner launches as host C++ under the grid emulation, on "device" arrays that are NumPy memory, and
logs every call. The runner's own logic is real: device buffers, the pointer table, uploads of changed
inputs and of the step scalars, one CUDA graph per ordered episode (captured on the first), cuBLAS call
sites in default mode, downloads for sync_params/optimizer_state and the handles the custom call reads.
Ordered episodes equal the native program bit for bit. What only a real GPU checks (NVRTC, the device's
memory and streams) runs in tests/test_gpu_jax.py and experiments/gpu_check.py on a CUDA machine."""
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.gpu import runner as gpu_runner

import fake_cupy
from test_gpu import episode_program, train


@pytest.fixture
def cupy(monkeypatch):
    mod = fake_cupy.make()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


def same(a, b):
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_ordered_episodes_are_one_graph_launch_each_and_equal_native(cupy, opt_kind):
    ref = train(*episode_program(opt_kind, "mse", True, "native"))
    prog, params, x, y, data = episode_program(opt_kind, "mse", True, "cupy")
    r = prog.runner
    assert type(r) is gpu_runner.CupyRunner and r.module.options == ("--fmad=false", "-std=c++14")
    assert r.stream.non_blocking and r.ctl.shape == (gpu_runner.CTL,) and r.ctl.dtype == np.float64
    cupy.log.clear()
    got = train(prog, params, x, y, data)
    assert got[0] == ref[0] and same(got[1], ref[1])
    assert all(type(v) is float for v in got[0])
    per = prog.plan()["launches_per_episode"]
    log, s = cupy.log, r.stream
    assert log.count(("graph_launch", s)) == len(data) and log.count(("capture", per)) == 1
    assert [e for e in log if e[0] == "kernel"] == [("kernel", L.name, s) for L in r.cp.forward + r.cp.backward +
                                                    r.cp.step] * len(data)
    assert not any(e[0] == "matmul" for e in log)
    # every copy and launch on the runner's own stream; before each replay the step scalars (8 doubles) and
    # the two changed inputs go up, after it the loss comes down and the stream is synchronised
    assert all(e[-1] is s for e in log if e[0] in ("set", "get", "graph_launch", "sync")) and r.graph.uploaded is s
    starts = [j for j, e in enumerate(log) if e[0] == "graph_launch"]
    nbytes = (data[0][0].nbytes, data[0][1].nbytes)
    assert log[:4] == [("set", 64, s), ("set", nbytes[0], s), ("set", nbytes[1], s), ("capture", per)]
    for j in starts[1:]:
        assert log[j - 5:j] == [("sync", s), ("get", s), ("set", 64, s), ("set", nbytes[0], s), ("set", nbytes[1], s)]
    assert log[-2:] == [("sync", s), ("get", s)]
    sc = list(prog.opt.conf.step_scalars(len(data)))   # the last step's scalars, zeros after them
    assert r.ctl.get().tolist() == sc + [0.0] * (gpu_runner.CTL - len(sc))
    plan = prog.plan()
    assert plan == {"backend": "cupy", "fused": True, "ordered": True, "kernels_forward": len(r.cp.forward),
                    "kernels_backward": len(r.cp.backward), "kernels_step": len(r.cp.step),
                    "launches_per_episode": per, "gemm_calls": 0}
    assert plan["kernels_step"] > 0 and plan["kernels_backward"] > 0


def test_default_mode_runs_the_launch_lists_with_cublas_call_sites(cupy):
    ref = train(*episode_program("adam", "xent", False, "native"))
    prog, params, x, y, data = episode_program("adam", "xent", False, "cupy")
    cupy.log.clear()
    got = train(prog, params, x, y, data)
    assert np.allclose(got[0], ref[0], rtol=1e-12, atol=0)
    assert all(np.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in zip(got[1], ref[1]))
    plan = prog.plan()
    assert prog.runner.graph is None and not any(e[0] == "capture" for e in cupy.log)
    assert cupy.log.count(("matmul", prog.runner.stream)) == plan["gemm_calls"] * len(data) > 0
    assert all(e[-1] is prog.runner.stream for e in cupy.log if e[0] in ("set", "get", "kernel", "sync"))
    assert plan["backend"] == "cupy" and plan["fused"] and not plan["ordered"]
    with pytest.raises(tg.TapeError, match=r"^the GPU episode graph needs ordered mode \(capture\(\.\.\., "
                                           r"ordered=True\)\): CuPy cannot capture the default mode's cuBLAS calls "
                                           r"into a CUDA graph$"):
        prog.runner.handles()


def test_forward_backward_and_step_one_at_a_time_equal_native(cupy):
    progs = {}
    for backend in ("native", "cupy"):
        prog, params, x, y, data = episode_program("adam", "mse", True, backend)
        prog.set_input(x, data[1][0])
        prog.forward()
        prog.backward()
        grads = [np.array(prog.grad(p)) for p in params]
        prog.step()
        progs[backend] = (prog, params, x, grads)
    (nat, params, x, g_nat), (dev, params_d, x_d, g_dev) = progs["native"], progs["cupy"]
    assert same(g_dev, g_nat) and same([dev.value(p) for p in params_d], [nat.value(p) for p in params])
    assert float(np.asarray(dev.loss())) == float(np.asarray(nat.loss()))
    zeros = dev.grad(x_d)   # no gradient flows into an input: zeros of its shape, as grad_buf gives
    assert type(zeros) is fake_cupy.ndarray and zeros.shape == x_d.shape and not np.asarray(zeros).any()
    assert dev.runner.graph is None and dev.opt.count == nat.opt.count == 1


def test_sync_params_and_optimizer_state_download_and_loading_uploads(cupy):
    runs = {}
    for backend in ("native", "cupy"):
        prog, params, x, y, data = episode_program("adam", "mse", True, backend)
        train(prog, params, x, y, data[:2])
        state = prog.optimizer_state()
        tape = prog._tape()
        prog.sync_params(tape)
        runs[backend] = (prog, params, x, y, data, state, [np.array(tape.value(p)) for p in params])
    nat, dev = runs["native"], runs["cupy"]
    assert same(dev[6], nat[6]) and dev[5]["count"] == nat[5]["count"] == 2
    assert same(dev[5]["mu"], nat[5]["mu"]) and same(dev[5]["nu"], nat[5]["nu"])
    # load a changed state into both (the moments halved, an earlier count): the next episodes agree
    for prog, params, x, y, data, state, _ in (nat, dev):
        prog.load_optimizer_state({"count": 1, "mu": [m / 2 for m in state["mu"]], "nu": [v / 2 for v in state["nu"]]})
    la = train(*nat[:5])
    lb = train(*dev[:5])
    assert la[0] == lb[0] and same(la[1], lb[1])


def test_handles_name_the_graph_the_table_and_the_control_buffer(cupy):
    prog, params, x, y, data = episode_program("adam", "mse", True, "cupy")
    r = prog.runner
    h = r.handles()   # no episode yet: the graph is captured now
    assert r.graph is not None and cupy.log.count(("capture", prog.plan()["launches_per_episode"])) == 1
    assert h["graph"] == 0x6a11 and h["settab"] == 0x5e77ab and h["device"] == 0
    assert h["table"] == r.vt.data.ptr and h["ctl"] == r.ctl.data.ptr and h["table_len"] == len(r.cp.buffers)
    assert h["vt"].tolist() == [r.dev[k].data.ptr for k in r.cp.buffers] == r.vt.get().tolist()
    assert all(type(h[k]) is int for k in ("graph", "settab", "table", "table_len", "ctl", "device"))
    again = r.handles()
    assert cupy.log.count(("capture", prog.plan()["launches_per_episode"])) == 1 and again["graph"] == h["graph"]
    loss = prog.episode({x: data[0][0], y: data[0][1]})   # the captured graph serves the episode
    assert cupy.log.count(("graph_launch", r.stream)) == 1 and loss == float(np.asarray(prog.loss()))


@pytest.mark.parametrize("devices,why", [
    (0, "no GPU is available (CUDA reports 0 devices); use backend='native'"),
    (RuntimeError("no driver"), "no GPU is available: CuPy cannot reach a CUDA device (RuntimeError: no driver); "
                                "use backend='native'")])
def test_no_device_is_a_clear_build_error(monkeypatch, devices, why):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make(devices))
    tape = tg.Tape()
    w = tape.param(np.ones((2, 2)))
    loss = (w * w).sum()
    with pytest.raises(tg.BuildError) as e:
        tg.capture(tape, loss, backend="cupy")
    assert str(e.value) == "capture(backend='cupy'): " + why
    assert e.value.__cause__ is None and (e.value.__suppress_context__ or e.value.__context__ is None)   # from None
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make(1))
    assert gpu_runner._cupy() is sys.modules["cupy"]


def test_float32_and_scratch_buffers_and_a_runner_of_its_own_fuse(cupy):
    """A float32 program with clipping (scratch buffers): the same bits as the host emulation of the same
    kernels; zeros of float32 for a gradient never written; sync_params skips the scratch buffers."""
    clip = lambda: tg.Adam(1e-2, clip=0.05)
    emu = episode_program(clip, "mse", True, "numpy", fuse=False, dtype="float32")
    from tapegrad.gpu.host import emulate
    want = train(emulate(emu[0]), *emu[1:])
    prog, params, x, y, data = episode_program(clip, "mse", True, "cupy", fuse=False, dtype="float32")
    r = prog.runner
    assert not r.fuse_kernels and not r.cp.fuse and prog.plan()["fused"] is False
    assert any(k[0] == "S" for k in r.dev) and all(r.dev[k].dtype == np.float32 for k in r.dev if k[0] != "S")
    got = train(prog, params, x, y, data)
    assert got[0] == want[0] and same(got[1], want[1])
    z = prog.grad(x)
    assert z.dtype == np.float32 and z.shape == x.shape and not np.asarray(z).any()
    tape = prog._tape()
    prog.sync_params(tape)
    assert same([tape.value(p) for p in params], got[1])
    assert gpu_runner.CupyRunner(prog).fuse_kernels is False   # a new runner takes the program's fuse
