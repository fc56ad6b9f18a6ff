"""A stand-in ``cupy`` for ``tapegrad.gpu.runner.CupyRunner`` on a machine without a GPU.

"Device" arrays are NumPy arrays (``.data.ptr`` their address, ``.set``/``.get`` copies); ``RawModule``
compiles the CUDA source it is given as host C++ under the grid emulation's prelude
(``tapegrad.gpu.host``), and a kernel call runs every phase of every block and thread there, reading the
pointer table and control buffer it is passed, as the device would; a stream records the launches made
between ``begin_capture`` and ``end_capture`` into a graph that ``launch`` replays. Every call the runner
makes is logged (``log``) with the stream it ran on (the one named, else the current one, else None for
the legacy default stream), so tests can check what ran where: ``("kernel", name, stream)``,
``("matmul", stream)``, ``("set", nbytes, stream)``, ``("get", stream)``, ``("graph_launch", stream)``,
``("capture", n_launches)``, ``("sync", stream)``.
"""
import ctypes
import re
import types

import numpy as np

from tapegrad.gpu import host


class Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(np.ndarray):
    """A "device" array: NumPy memory with CuPy's ``data.ptr``, ``set`` and ``get``."""

    log = None
    state = None

    @property
    def data(self):
        return Ptr(self.ctypes.data)

    def set(self, arr, stream=None):
        arr = np.asarray(arr)
        assert arr.size == self.size and arr.dtype == self.dtype, (arr.shape, arr.dtype, self.shape, self.dtype)
        self.log.append(("set", arr.nbytes, stream if stream is not None else self.state["stream"]))
        np.copyto(np.asarray(self).reshape(-1), arr.reshape(-1))

    def get(self, stream=None):
        self.log.append(("get", stream if stream is not None else self.state["stream"]))
        return np.array(self)

    def __getitem__(self, i):
        r = super().__getitem__(i)
        return r if isinstance(r, np.ndarray) else np.asarray(r).view(ndarray)   # CuPy: 0-d arrays


def _device(a):
    return np.array(a, copy=True).view(ndarray)


class Graph:
    def __init__(self, log, work):
        self.log, self.work, self.graphExec = log, work, 0x6a11
        self.uploaded = False

    def upload(self, stream):
        self.uploaded = stream

    def launch(self, stream):
        self.log.append(("graph_launch", stream))
        for run in self.work:
            run()


def make(devices=1):
    """A fresh ``cupy`` module object with ``devices`` CUDA devices (its ``log`` records the calls)."""
    log = []
    ndarray.log = log
    state = {"stream": None}
    ndarray.state = state

    class Stream:
        def __init__(self, non_blocking=False):
            self.non_blocking, self.capturing = non_blocking, None

        def __enter__(self):
            self.prev, state["stream"] = state["stream"], self
            return self

        def __exit__(self, *exc):
            state["stream"] = self.prev
            return False

        def synchronize(self):
            log.append(("sync", self))

        def begin_capture(self):
            self.capturing = []

        def end_capture(self):
            work, self.capturing = self.capturing, None
            log.append(("capture", len(work)))
            return Graph(log, work)

    def submit(run):
        s = state["stream"]
        if s is not None and s.capturing is not None:
            s.capturing.append(run)
        else:
            run()

    class Function:
        def __init__(self, lib, kid, name, phases):
            self.lib, self.kid, self.name, self.phases = lib, kid, name, phases
            self.ptr = 0x1000 + kid

        def __call__(self, grid, block, args):
            vt, ctl = args

            on = state["stream"]

            def run():
                log.append(("kernel", self.name, on))
                self.lib.tg_launch(self.kid, grid[0], grid[1], block[0], self.phases, vt.data.ptr, ctl.data.ptr)
            submit(run)

    class RawModule:
        def __init__(self, code, options=()):
            self.options = options
            heads = list(re.finditer(r'extern "C" __global__ void (\w+)\(const long long \*__restrict__ vt, const double',
                                     code))
            self.names = [m.group(1) for m in heads]
            self.phases = {}
            for m in heads:
                body = code[m.end():code.index("\n}\n", m.end())]
                self.phases[m.group(1)] = 1 + max(int(j) for j in re.findall(r"TG_PHASE\((\d+)\)", body))
            src, names = host.host_source(types.SimpleNamespace(src=code, kernels=[f"void {n}(" for n in self.names]))
            self.lib = host.compile_host(src)
            self.lib.tg_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p]
            self.other = {m.group(1) for m in re.finditer(r"__global__ void (\w+)\(", code)}

        def get_function(self, name):
            if name in self.phases:
                return Function(self.lib, self.names.index(name), name, self.phases[name])
            assert name in self.other, name
            return types.SimpleNamespace(ptr=0x5e77ab)   # settab: only its address is used

    def matmul(a, b, out):
        on = state["stream"]

        def run():
            log.append(("matmul", on))
            np.matmul(np.asarray(a), np.asarray(b), out=np.asarray(out))
        submit(run)

    def get_device_count():
        if isinstance(devices, Exception):
            raise devices
        return devices

    cuda = types.SimpleNamespace(Stream=Stream, Device=lambda: types.SimpleNamespace(id=0),
                                 runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    return types.SimpleNamespace(
        log=log, cuda=cuda, RawModule=RawModule, matmul=matmul, ndarray=ndarray,
        asarray=_device, zeros=lambda shape, dtype=np.float64: np.zeros(shape, dtype).view(ndarray),
        asnumpy=lambda a: np.array(a))
