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
        self.generate()   # the optimizer's configuration is part of the source (and of the kernel names)

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
    """The program on an NVIDIA GPU through CuPy: kernels from NVRTC (``RawModule``, ``--fmad=false``),
    device buffers mirroring the program's, the optimizer on the device, and ``episode`` replayed as one
    CUDA graph (captured on the first episode; inputs and ``ctl`` are uploaded before each replay)."""

    def __init__(self, prog):
        self.cupy = _cupy()
        self.graph = None
        super().__init__(prog)

    def build(self):
        cp, p, cu = self.cp, self.p, self.cupy
        self.module = cu.RawModule(code=cp.src, options=("--fmad=false", "-std=c++14"))
        self.fns = {}
        self.dev = {}
        for key in cp.buffers:
            host = self.host_array(key)
            self.dev[key] = cu.asarray(host.reshape(-1)) if host is not None else cu.zeros(cp.scratch_size, p.dtype)
        self.vt = cu.asarray(np.array([self.dev[k].data.ptr for k in cp.buffers] or [0], np.int64))
        self.ctl = cu.zeros(CTL, np.float64)
        self.graph = None

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
        self.ctl.set(host) if hasattr(self.ctl, "set") else self.ctl.__setitem__(slice(None), self.cupy.asarray(host))

    def launch(self, L):
        if L.kind == "gemm":
            a, b, c = self.gemm_operands(L, lambda key: self.dev[key])
            self.cupy.matmul(a, b, out=c)
            return
        fn = self.fns.get(L.name)
        if fn is None:
            fn = self.fns[L.name] = self.module.get_function(L.name)
        fn(L.grid, (L.block,), (self.vt, self.ctl))

    def upload_inputs(self):
        for k in self.p.consts + self.p.params + self.p.data:
            if ("v", k) in self.dev:
                self.dev[("v", k)].set(np.ascontiguousarray(self.p.val[k]).reshape(-1))

    def episode(self):
        """Inputs up, then forward + backward + step; from the second episode on one CUDA graph launch."""
        o = self.p.opt
        self.upload_inputs()
        if o is not None:
            o.count += 1
            self.write_ctl(o.conf.step_scalars(o.count))
        if self.graph is None and o is not None and not self.plan()["gemm_calls"]:
            stream = self.cupy.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                self.run(self.cp.forward + self.cp.backward + self.cp.step)
                self.graph = stream.end_capture()
            self.stream = stream
        if self.graph is not None:
            self.graph.launch(self.stream)
            self.stream.synchronize()
        else:
            self.run(self.cp.forward + self.cp.backward + self.cp.step)
        self.download()

    def download(self):
        """Device values and gradients back into the program's host buffers (what ``value``/``grad`` read)."""
        for key, d in self.dev.items():
            host = self.host_array(key)
            if host is not None and key[0] in "vgMN":
                np.copyto(host.reshape(-1), self.cupy.asnumpy(d))

    def forward(self):
        self.upload_inputs()
        super().forward()
        self.download()

    def backward(self):
        super().backward()
        self.download()

    def step(self):
        super().step()
        self.download()

    def device_array(self, key):
        """The CuPy array of a buffer key (``("v", k)``, ``("g", k)``) in the program's shape."""
        kind, k = key
        if key not in self.dev:
            raise TapeError(f"device_array: node {k} has no device {'value' if kind == 'v' else 'gradient'}")
        return self.dev[key].reshape(self.p.shapes[k])


__all__ = ["LaunchRunner", "CupyRunner"]
