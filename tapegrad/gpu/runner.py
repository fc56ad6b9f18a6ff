"""Runners of a program's CUDA launch lists: the shared episode logic, and the CuPy (device) runner.

A runner holds one array per pointer-table entry (``CudaProgram.buffers``) and the control buffer
``ctl`` (per-step host scalars: Adam's ``(−lr, 1−b1ᵗ, 1−b2ᵗ)`` or ``(lr_t,)``, computed on the host by
the optimizer's own ``step_scalars``, as every backend does). ``LaunchRunner`` walks the launch lists;
a subclass says how memory lives and how one launch runs. CuPy is imported only by ``CupyRunner``.
"""
import numpy as np

from ..errors import BuildError, TapeError
from .source import CudaProgram

CTL = 8   # doubles in the control buffer


class LaunchRunner:
    """Program runner over ``CudaProgram`` launch lists; subclasses implement memory and ``launch``."""

    def __init__(self, prog, fuse=None):
        self.p = prog
        self.fuse_kernels = prog.fuse if fuse is None else fuse
        self.generate()

    def generate(self):
        self.cp = CudaProgram(self.p, self.fuse_kernels)
        self.build()

    # ── the Program runner interface ─────────────────────────────────────────

    def forward(self):
        self.run(self.cp.forward)

    def backward(self):
        self.run(self.cp.backward)

    def step(self):
        o = self.p.opt
        o.count += 1
        self.write_ctl(o.conf.step_scalars(o.count))
        self.run(self.cp.step)

    def episode(self):
        self.forward()
        self.backward()
        if self.p.opt is not None:
            self.step()

    def attached(self):
        self.keep_params()
        self.generate()   # the optimizer's configuration is part of the source (and of the kernel names)

    def keep_params(self):
        """Before the buffers are made again from the host's arrays: nothing to keep where they are the host's."""

    def pull_count(self):
        pass

    def push_count(self):
        pass

    def plan(self):
        cp = self.cp
        return {"backend": self.p.backend, "fused": cp.fuse, "ordered": self.p.ordered,
                "kernels_forward": len(cp.forward), "kernels_backward": len(cp.backward),
                "kernels_step": len(cp.step), "launches_per_episode": cp.launches(),
                "gemm_calls": sum(L.kind == "gemm" for L in cp.forward + cp.backward)}

    def run(self, launches):
        for L in launches:
            self.launch(L)

    def gemm_operands(self, L, arr):
        """(a, b, c) 2-D views for a gemm launch (``arr(key)`` gives a flat array per buffer key)."""
        ta, tb, m, n, k, A, B, C = L.gemm
        a = arr(A)[:m * k].reshape((k, m) if ta else (m, k))
        b = arr(B)[:k * n].reshape((n, k) if tb else (k, n))
        return (a.T if ta else a), (b.T if tb else b), arr(C)[:m * n].reshape(m, n)


def _cupy():
    """CuPy and a usable device, or a clear error saying which is missing."""
    try:
        import cupy
    except ImportError as e:
        raise BuildError(f"capture(backend='cupy'): CuPy is not installed ({e}); install the GPU extra "
                           f"(pip install 'tapegrad[gpu]', which brings cupy-cuda12x) on a machine with an "
                           f"NVIDIA GPU, or use backend='native'") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # CUDARuntimeError without a driver or device
        raise BuildError(f"capture(backend='cupy'): no GPU is available: CuPy cannot reach a CUDA device "
                           f"({type(e).__name__}: {e}); use backend='native'") from None
    if n < 1:
        raise BuildError("capture(backend='cupy'): no GPU is available (CUDA reports 0 devices); use "
                           "backend='native'")
    return cupy


class CupyRunner(LaunchRunner):
    """The program on an NVIDIA GPU through CuPy.

    Kernels come from NVRTC (``RawModule`` with ``--fmad=false``; the ``__d*_rn`` intrinsics already
    forbid contraction), every buffer lives on the device, all work is ordered on one non-blocking
    stream, and ``episode`` runs as one CUDA graph, captured on the first episode (ordered mode: no
    cuBLAS inside, which CuPy disables during capture) and replayed with only the changed inputs and
    the ``ctl`` scalars uploaded before each replay. ``Program.value``/``grad``/``loss`` return CuPy
    arrays; ``sync_params``/``optimizer_state`` copy back to the host."""

    def __init__(self, prog):
        self.cupy = _cupy()
        self.graph = None
        self.dirty = set()
        super().__init__(prog)

    def build(self):
        cp, p, cu = self.cp, self.p, self.cupy
        self.stream = cu.cuda.Stream(non_blocking=True)
        self.module = cu.RawModule(code=cp.src, options=("--fmad=false", "-std=c++14"))
        self.fns = {L.name: self.module.get_function(L.name)
                    for L in cp.forward + cp.backward + cp.step if L.kind == "kernel"}
        self.dev = {}
        with self.stream:
            for key in cp.buffers:
                host = self.host_array(key)
                self.dev[key] = cu.asarray(host.reshape(-1)) if host is not None else \
                    cu.zeros(cp.scratch_size, p.dtype)
            self.vt_host = np.array([self.dev[k].data.ptr for k in cp.buffers] or [0], np.int64)
            self.vt = cu.asarray(self.vt_host)
            self.ctl = cu.zeros(CTL, np.float64)
        self.device = cu.cuda.Device().id
        self.stream.synchronize()
        self.graph = None
        self.dirty = set()

    def keep_params(self):
        """Parameters the device trained since they were last uploaded, copied down before ``attach`` rebuilds
        the device buffers from the host's arrays (which would otherwise put the parameters back as they were
        before those steps). A parameter given anew on the host (``set_input``, not uploaded yet) keeps the
        host's value; the moments are the newly attached optimizer's, as ``attach`` says."""
        if not getattr(self, "dev", None):
            return
        self.stream.synchronize()
        for k in self.p.params:
            d = self.dev.get(("v", k))
            if d is not None and k not in self.dirty:
                np.copyto(self.p.val[k].reshape(-1), self.cupy.asnumpy(d))

    def host_array(self, key):
        p = self.p
        kind, k = key
        if kind == "v":
            return p.val[k]
        if kind == "g":
            return p.grad_buf(k)
        if kind in "MN":
            return (p.opt.mu if kind == "M" else p.opt.nu)[k]
        return None

    def write_ctl(self, sc):
        host = np.zeros(CTL)
        host[:len(sc)] = sc
        self.ctl.set(host, stream=self.stream)

    def launch(self, L):
        if L.kind == "gemm":   # the cuBLAS call site (default mode)
            a, b, c = self.gemm_operands(L, self.dev.__getitem__)
            self.cupy.matmul(a, b, out=c)
            return
        self.fns[L.name](L.grid, (L.block,), (self.vt, self.ctl))

    def input_changed(self, k):
        self.dirty.add(k)

    def upload_inputs(self):
        for k in sorted(self.dirty):
            if ("v", k) in self.dev:
                self.dev[("v", k)].set(np.ascontiguousarray(self.p.val[k]).reshape(-1), stream=self.stream)
        self.dirty.clear()

    def run(self, launches):
        with self.stream:
            self.upload_inputs()
            for L in launches:
                self.launch(L)

    def capture_graph(self):
        """Capture forward + backward + step as one CUDA graph (ordered mode: no cuBLAS call inside)."""
        work = self.cp.forward + self.cp.backward + self.cp.step
        if any(L.kind == "gemm" for L in work):
            raise TapeError("the GPU episode graph needs ordered mode (capture(..., ordered=True)): CuPy cannot "
                            "capture the default mode's cuBLAS calls into a CUDA graph")
        with self.stream:
            self.upload_inputs()
            self.stream.begin_capture()
            for L in work:
                self.launch(L)
            self.graph = self.stream.end_capture()
        self.graph.upload(self.stream)

    def episode(self):
        """Changed inputs and ``ctl`` up, then forward + backward + step: one CUDA graph launch."""
        o = self.p.opt
        if o is not None:
            o.count += 1
            self.write_ctl(o.conf.step_scalars(o.count))
        work = self.cp.forward + self.cp.backward + self.cp.step
        if self.graph is None and not any(L.kind == "gemm" for L in work):
            self.capture_graph()
        if self.graph is not None:
            with self.stream:
                self.upload_inputs()
            self.graph.launch(self.stream)
        else:
            self.run(work)
        self.stream.synchronize()

    def handles(self):
        """The device objects the GPU custom call names (``interop.xla.gpu_call``): the episode's graph
        (captured now if no episode ran yet), the settab kernel, the pointer table (and its entries),
        the control buffer and the device. Valid while this runner lives (re-attaching rebuilds it)."""
        if self.graph is None:
            self.capture_graph()
        return {"graph": int(self.graph.graphExec), "settab": int(self.module.get_function(self.cp.settab).ptr),
                "table": int(self.vt.data.ptr), "table_len": len(self.cp.buffers), "ctl": int(self.ctl.data.ptr),
                "device": int(self.device), "vt": self.vt_host}

    def loss_value(self):
        return float(self.dev[("v", self.p.loss_id)][0].get(stream=self.stream))

    def download(self):
        """Device parameters, values, gradients and moments into the program's host buffers."""
        self.stream.synchronize()
        for key, d in self.dev.items():
            host = self.host_array(key)
            if host is not None and host.dtype.kind == "f":
                np.copyto(host.reshape(-1), self.cupy.asnumpy(d))

    def pull_count(self):
        self.download()

    def push_count(self):
        with self.stream:
            for key, d in self.dev.items():
                if key[0] in "MN":
                    d.set(self.host_array(key).reshape(-1), stream=self.stream)
        self.stream.synchronize()

    def device_array(self, k, kind="v"):
        """Node k's device value (``kind="v"``) or gradient (``"g"``) as a CuPy array of its shape."""
        key = (kind, k)
        if key not in self.dev:
            return self.cupy.zeros(self.p.shapes[k], self.p.dtype)   # never written: zeros, as grad_buf
        return self.dev[key].reshape(self.p.shapes[k])
