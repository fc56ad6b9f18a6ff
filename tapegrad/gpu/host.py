"""The CUDA source of a program compiled as host C++ and run on the program's NumPy buffers (no GPU).

A prelude defines what the source needs from CUDA: ``blockIdx``/``threadIdx``/``blockDim`` as globals,
``__d*_rn``/``__f*_rn`` as the plain IEEE operations (compiled with ``-ffp-contract=off``, so they are
single roundings as on the device), ``TG_PHASE(n)`` true only in phase ``n`` and ``TG_BARRIER()`` empty.
A launch runs, for each phase in turn, every block and every thread of the grid (loops): each barrier
is a phase boundary, so the emulation keeps the device's ordering guarantees and nothing more.
cuBLAS call sites (``gemm`` launches, default mode only) run NumPy's ``matmul`` on the same buffers.

>>> import numpy as np, tapegrad as tg
>>> from tapegrad.gpu.host import emulate
>>> t = tg.Tape(ordered=True)
>>> w = t.param(np.array([[1.0], [2.0]])); x = t.const(np.array([[3.0, 4.0]]))
>>> prog = tg.capture(t, ((x @ w) * (x @ w)).mean())
>>> emulate(prog).episode(), prog.grad(w).ravel().tolist()
(121.0, [66.0, 88.0])
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from ..errors import BuildError
from ..native import build, elf
from .runner import CTL, LaunchRunner

PRELUDE = r"""/* tapegrad.gpu.host: CUDA source compiled as host C++ (a grid emulation) */
#define TG_HOST 1
#include <math.h>
struct tg_dim3 { unsigned x, y, z; };
static tg_dim3 blockIdx, threadIdx, blockDim, gridDim __attribute__((unused));
static int tg_phase;
#define TG_PHASE(n) (tg_phase == (n))
#define TG_BARRIER() ((void)0)
#define __global__
#define __device__
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
"""
FLAGS = ("-x", "c++", "-std=c++14", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
         "-Wall", "-Wextra", "-Werror", "-Wno-unused-function")


def host_source(cp):
    """Prelude + the CUDA source + a launcher: ``tg_launch(kernel, gx, gy, block, phases, vt, ctl)``."""
    names = [s.split("void ", 1)[1].split("(", 1)[0] for s in cp.kernels]
    return "\n".join([PRELUDE, cp.src,
                      "typedef void (*tg_kernel_t)(const long long *, const double *);",
                      "static const tg_kernel_t tg_table[] = {" + ", ".join(names or ["0"]) + "};",
                      'extern "C" void tg_launch(int kern, unsigned gx, unsigned gy, unsigned bx, int phases, '
                      "const long long *vt, const double *ctl)",
                      "{",
                      "    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;",
                      "    blockDim.x = bx; blockDim.y = 1; blockDim.z = 1;",
                      "    for (int p = 0; p < phases; p++) {",
                      "        tg_phase = p;",
                      "        for (unsigned y = 0; y < gy; y++)",
                      "            for (unsigned x = 0; x < gx; x++)",
                      "                for (unsigned t = 0; t < bx; t++) {",
                      "                    blockIdx.x = x; blockIdx.y = y; blockIdx.z = 0;",
                      "                    threadIdx.x = t; threadIdx.y = 0; threadIdx.z = 0;",
                      "                    tg_table[kern](vt, ctl);",
                      "                }",
                      "    }",
                      "}", ""]), names


def compile_host(src):
    """Build ``src`` (host C++) into a shared library in the tapegrad cache; returns the loaded library.

    As ``tapegrad.native.build`` serves its libraries: the source carries an identity, and a cached file is
    loaded only after its bytes show it is a whole library of this user's exporting that identity
    (anything else is rebuilt); the compiler is bounded by ``$TAPEGRAD_CC_TIMEOUT``."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("gpu host emulation: no C++ compiler (g++ or c++) on PATH")
    key = hashlib.sha256((cxx + "\n" + " ".join(FLAGS) + "\n" + src).encode()).hexdigest()[:24]
    d = build.cache_dir()
    lib = os.path.join(d, f"tgcuda_host_{key}.so")
    want = f"tapegrad {os.path.basename(lib)[:-3]}; host emulation of CUDA source"
    if not _served(lib, want):
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            path = os.path.join(tmp, "prog.cu")
            with open(path, "w") as f:
                f.write(src + build.stamp(want))
            out = os.path.join(tmp, "prog.so")
            timeout = build._env_number(build.TIMEOUT_ENV, 300.0)
            try:
                code, _, err = build.run_compiler([cxx, *FLAGS, path, "-o", out, "-lm"], timeout)
            except OSError as e:
                raise BuildError(f"gpu host emulation: {cxx} cannot run: {e}") from None
            except subprocess.TimeoutExpired:
                raise BuildError(f"gpu host emulation: {cxx} did not finish within {timeout:g} s "
                                 f"(${build.TIMEOUT_ENV}); it was killed with its children") from None
            if code != 0:
                raise BuildError(f"gpu host emulation: {cxx} failed:\n{err[-4000:]}")
            os.chmod(out, 0o700)
            os.replace(out, lib)
    return build.load(lib)


def _served(lib, want):
    try:
        return build._image_identity(build.read_library(lib)) == want
    except (OSError, build.Untrusted, elf.NotLibrary):
        return False


class HostRunner(LaunchRunner):
    """Runs a program's CUDA launch lists as host code on the program's own buffers."""

    def build(self):
        cp = self.cp
        src, names = host_source(cp)
        self.lib = compile_host(src)
        self.lib.tg_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_void_p]
        self.kid = {n: j for j, n in enumerate(names)}
        self.scratch = {}
        self.arrays = {}
        for key in cp.buffers:
            self.arrays[key] = self.array(key)
        self.vt = np.array([a.ctypes.data for a in (self.arrays[k] for k in cp.buffers)] or [0], np.int64)
        self.ctl = np.zeros(CTL)

    def array(self, key):
        p = self.p
        kind, k = key
        if kind == "v":
            return p.val[k].reshape(-1)
        if kind == "g":
            return p.grad_buf(k).reshape(-1)
        if kind in "MN":
            return (p.opt.mu if kind == "M" else p.opt.nu)[k].reshape(-1)
        return self.scratch.setdefault(key, np.zeros(self.cp.scratch_size, p.dtype))   # one per key, as on the device

    def handles(self):
        """The pointer table (address, length, entries), control buffer and device, as
        ``CupyRunner.handles`` gives them: a test that drives the GPU custom call's handler on the host
        (a stand-in driver whose graph launch runs this runner's launch lists) adds ``graph``/``settab``."""
        return {"table": self.vt.ctypes.data, "table_len": len(self.cp.buffers), "ctl": self.ctl.ctypes.data,
                "device": 0, "vt": self.vt.copy()}

    def write_ctl(self, sc):
        self.ctl[:] = 0.0
        self.ctl[:len(sc)] = sc

    def launch(self, L):
        if L.kind == "gemm":
            a, b, c = self.gemm_operands(L, self.arrays.__getitem__)
            np.matmul(a, b, out=c)
            return
        self.lib.tg_launch(self.kid[L.name], L.grid[0], L.grid[1], L.block, L.phases, self.vt.ctypes.data,
                           self.ctl.ctypes.data)


def emulate(prog, fuse=None):
    """Replace ``prog``'s runner by the host emulation of its CUDA program (for tests and ``--dry`` runs).

    ``fuse``: fused row-local segments (default: the program's own ``fuse``). Returns the program.
    """
    prog.runner = HostRunner(prog, fuse)
    if prog.opt is not None:
        prog.runner.attached()
    return prog
