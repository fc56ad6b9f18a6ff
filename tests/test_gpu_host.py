"""The grid emulation's own parts (tapegrad/gpu/host.py): building host C++ (the compiler it finds, its
cache, its errors), the pointer table and control buffer it hands out, and a launch's phases, blocks and
threads."""
import ctypes
import os
import shutil

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.gpu import host
from tapegrad.gpu.host import HostRunner, compile_host, emulate

from test_gpu import episode_program

GXX, CXX = shutil.which("g++"), shutil.which("c++")


def test_the_compiler_is_cxx_else_g_plus_plus_else_c_plus_plus(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPEGRAD_CACHE", str(tmp_path))
    src = 'extern "C" int tg_answer(void) { return 42; }\n'
    monkeypatch.delenv("CXX", raising=False)
    for only in ("g++", "c++"):
        monkeypatch.setattr(host.shutil, "which", lambda n, only=only: {"g++": GXX, "c++": CXX}[n] if n == only else None)
        assert compile_host(src).tg_answer() == 42
    monkeypatch.setattr(host.shutil, "which", lambda n: None)
    with pytest.raises(tg.BuildError, match=r"^gpu host emulation: no C\+\+ compiler \(g\+\+ or c\+\+\) on PATH$"):
        compile_host(src)
    monkeypatch.setenv("CXX", GXX)   # $CXX first, no search
    assert compile_host(src).tg_answer() == 42


def test_builds_are_cached_by_compiler_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPEGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", GXX)
    a = compile_host('extern "C" int tg_one(void) { return 1; }\n')
    again = compile_host('extern "C" int tg_one(void) { return 1; }\n')
    b = compile_host('extern "C" int tg_one(void) { return 2; }\n')
    monkeypatch.setenv("CXX", CXX)
    c = compile_host('extern "C" int tg_one(void) { return 1; }\n')
    names = [os.path.basename(lib._name) for lib in (a, again, b, c)]
    assert names[0] == names[1] and len({names[0], names[2], names[3]}) == 3
    assert all(n.startswith("tgcuda_host_") and n.endswith(".so") and len(n) == len("tgcuda_host_.so") + 24 for n in names)
    assert sorted(os.listdir(tmp_path)) == sorted(set(names))   # no temporaries left behind
    assert (a.tg_one(), b.tg_one(), c.tg_one()) == (1, 2, 1)
    os.utime(a._name, (0, 0))
    compile_host('extern "C" int tg_one(void) { return 1; }\n')
    assert os.stat(os.path.join(tmp_path, names[0])).st_mtime == 0   # a cached library is not rebuilt


def test_a_compiler_error_is_a_build_error_with_the_end_of_its_output(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPEGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", GXX)
    with pytest.raises(tg.BuildError) as e:
        compile_host("int tg_bad = ;\n")
    head = f"gpu host emulation: {GXX} failed:\n"
    assert str(e.value).startswith(head) and "error" in str(e.value)[len(head):len(head) + 200]
    with pytest.raises(tg.BuildError) as e:
        compile_host("".join(f"int tg_bad{j} = ;\n" for j in range(200)))   # over 4000 characters of errors
    assert str(e.value).startswith(head) and len(str(e.value)) == len(head) + 4000
    assert "tg_bad199" in str(e.value) and "tg_bad0 " not in str(e.value)   # the end is kept
    assert os.listdir(tmp_path) == []   # no library, no temporary


def test_warnings_are_errors():
    """-Wall -Wextra -Werror, as the native backend's tests build: an unused variable fails the build."""
    with pytest.raises(tg.BuildError, match="unused"):
        compile_host('extern "C" int tg_w(void) { int tg_unused = 1; return 0; }\n')


def test_a_launch_runs_every_phase_then_every_block_and_thread():
    """tg_launch's loop order: phase, then grid y, grid x, thread; the globals set for each."""
    prog, *_ = episode_program("sgd", "mse", True)
    cp = emulate(prog).runner.cp
    src, names = host.host_source(cp)
    assert names == [k.split("void ", 1)[1].split("(", 1)[0] for k in cp.kernels] and len(names) > 3
    assert src.startswith(host.PRELUDE) and cp.src in src
    assert "static const tg_kernel_t tg_table[] = {" + ", ".join(names) + "};" in src
    probe = src.replace(cp.src, cp.src + "\n".join([
        "static long long tg_trace[64][5]; static int tg_n;",
        'extern "C" __global__ void tg_probe(const long long *vt, const double *ctl)',
        "{ (void)vt; (void)ctl; long long *t = tg_trace[tg_n++];",
        "  t[0] = tg_phase; t[1] = blockIdx.y; t[2] = blockIdx.x; t[3] = threadIdx.x;",
        "  t[4] = gridDim.x * 1000 + gridDim.y * 100 + blockDim.x * 10 + blockIdx.z + threadIdx.y + threadIdx.z; }",
        'extern "C" const long long *tg_probe_trace(void) { return &tg_trace[0][0]; }', ""]))
    probe = probe.replace("tg_table[] = {" + ", ".join(names), "tg_table[] = {" + ", ".join(names + ["tg_probe"]))
    lib = compile_host(probe)
    lib.tg_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_void_p]
    lib.tg_probe_trace.restype = ctypes.POINTER(ctypes.c_longlong)
    lib.tg_launch(len(names), 3, 2, 2, 2, None, None)   # grid (3, 2), 2 threads, 2 phases
    got = np.ctypeslib.as_array(lib.tg_probe_trace(), (64, 5))[:24].tolist()
    want = [[p, y, x, t, 3 * 1000 + 2 * 100 + 2 * 10] for p in range(2) for y in range(2) for x in range(3)
            for t in range(2)]
    assert got == want


def test_handles_and_the_control_buffer():
    prog, params, x, y, data = episode_program("adam", "mse", True)
    r = emulate(prog).runner
    assert isinstance(r, HostRunner)
    h = r.handles()
    assert h == {"table": r.vt.ctypes.data, "table_len": len(r.cp.buffers), "ctl": r.ctl.ctypes.data, "device": 0,
                 "vt": h["vt"]}
    assert h["vt"].tolist() == [r.array(k).ctypes.data for k in r.cp.buffers] and h["vt"] is not r.vt
    assert h["vt"].dtype == np.int64 and r.ctl.shape == (8,) and r.ctl.dtype == np.float64
    r.write_ctl((1.5, 2.5, 3.5))
    r.write_ctl((-4.0,))
    assert r.ctl.tolist() == [-4.0] + [0.0] * 7   # this step's scalars, zeros after them
    params_after = [np.array(prog.value(p)) for p in params]
    assert all(np.shares_memory(r.array(("v", p.id)), prog.val[p.id]) for p in params)   # the program's own buffers
    assert params_after and r.array(("S", 999)).shape == (r.cp.scratch_size,)


def test_emulate_replaces_the_runner_and_keeps_the_optimizer():
    prog, params, x, y, data = episode_program("adam", "mse", True, fuse=False)
    assert emulate(prog) is prog and isinstance(prog.runner, HostRunner)
    assert not prog.runner.fuse_kernels and not prog.runner.cp.fuse   # the program's own fuse
    assert emulate(prog, True).runner.cp.fuse
    assert prog.plan()["kernels_step"] > 0
    nothing = episode_program("adam", "mse", True)[0]
    nothing.opt = None
    assert emulate(nothing).plan()["kernels_step"] == 0
