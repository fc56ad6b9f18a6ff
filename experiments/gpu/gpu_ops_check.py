"""The index and scan families' CUDA kernels (and slice, concat, max, min, prod) on the device: part of ``gpu_check.py``.

One program holds every registry case of take, take_along_axis, index_add, index_set, dynamic_slice,
dynamic_update_slice, cumsum, cumprod, cummax, sort, slice, concat, max, min, prod, softmax, logsoftmax,
logsumexp, lgamma and digamma (``tests/test_gpu_ops.py``'s ``every_case``,
ordered mode). Its CUDA source gets a ``main`` that loads every buffer, runs the forward and backward
launch lists once and writes every buffer back; nvcc builds it for the device (``--dry``: g++ under the
grid-emulation prelude, run on the host). Claim: every value and gradient == the native CPU program (the
libm-tier ones, on the device, within rtol 1e-12 — lgamma, whose CUDA and glibc forms agree only
absolutely near its zeros at 1 and 2, within its registry bound ``ulps`` — and == in the emulation).
"""
import pathlib
import subprocess
import sys
import time

import numpy as np

from tapegrad import ops as O
from tapegrad.gpu.host import PRELUDE
from tapegrad.gpu.source import CudaProgram

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBM_RTOL = 1e-12   # libm-tier ops on the device: CUDA's exp/log/tan are within 1-2 ulp of glibc's
EPS = np.finfo(np.float64).eps
sys.path.insert(0, str(ROOT / "tests"))
from test_gpu_ops import FAMILY, every_case  # noqa: E402
from test_gpu_ops_more import CONV_FAMILY, LINALG_FAMILY, within_blas  # noqa: E402


def host_buffer(prog, cp, key):
    kind, k = key
    if kind == "v":
        return prog.val[k]
    if kind == "g":
        return prog.grad_buf(k)
    return np.zeros(cp.scratch_size, prog.dtype)


def driver(cp, nbytes):
    launches = "\n".join(f"    LAUNCH({L.name}, {L.grid[0]}, {L.grid[1]}, {L.block}, {L.phases});"
                         for L in cp.forward + cp.backward)
    return f"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static const long NB = {len(nbytes)}, BYTES[] = {{{", ".join(map(str, nbytes))}}};
static long long *vt_d;
static double *ctl_d;
#ifdef __CUDACC__
#define CHECK(x) do {{ cudaError_t e_ = (x); if (e_ != cudaSuccess) {{ fprintf(stderr, "%s: %s\\n", #x, cudaGetErrorString(e_)); exit(3); }} }} while (0)
static void *dalloc(size_t n) {{ void *p; CHECK(cudaMalloc(&p, n)); return p; }}
static void up(void *d, const void *h, size_t n) {{ CHECK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice)); }}
static void down(void *h, const void *d, size_t n) {{ CHECK(cudaDeviceSynchronize()); CHECK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost)); }}
#define LAUNCH(fn, gx, gy, bx, ph) do {{ fn<<<dim3(gx, gy), bx>>>(vt_d, ctl_d); CHECK(cudaGetLastError()); }} while (0)
static const char *where(void) {{ static cudaDeviceProp p; CHECK(cudaGetDeviceProperties(&p, 0)); return p.name; }}
#else
static void *dalloc(size_t n) {{ return calloc(1, n); }}
static void up(void *d, const void *h, size_t n) {{ memcpy(d, h, n); }}
static void down(void *h, const void *d, size_t n) {{ memcpy(h, d, n); }}
static void host_launch(void (*fn)(const long long *, const double *), unsigned gx, unsigned gy, unsigned bx, int ph)
{{
    gridDim.x = gx; gridDim.y = gy; blockDim.x = bx;
    for (int p = 0; p < ph; p++) {{
        tg_phase = p;
        for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) for (unsigned t = 0; t < bx; t++) {{
            blockIdx.x = x; blockIdx.y = y; threadIdx.x = t; fn(vt_d, ctl_d);
        }}
    }}
}}
#define LAUNCH(fn, gx, gy, bx, ph) host_launch(fn, gx, gy, bx, ph)
static const char *where(void) {{ return "host-emulation"; }}
#endif
int main(int argc, char **argv)
{{
    if (argc < 3) {{ fprintf(stderr, "usage: %s in out\\n", argv[0]); return 2; }}
    FILE *f = fopen(argv[1], "rb"), *o = fopen(argv[2], "wb");
    if (!f || !o) {{ perror("open"); return 2; }}
    void *buf[{len(nbytes)}];
    long long vt[{len(nbytes)}];
    for (long b = 0; b < NB; b++) {{
        void *h = malloc(BYTES[b]);
        if (fread(h, 1, BYTES[b], f) != (size_t)BYTES[b]) {{ fprintf(stderr, "short input\\n"); return 2; }}
        buf[b] = dalloc(BYTES[b]);
        up(buf[b], h, BYTES[b]);
        vt[b] = (long long)(size_t)buf[b];
        free(h);
    }}
    vt_d = (long long *)dalloc(sizeof vt);
    ctl_d = (double *)dalloc(8 * sizeof(double));
    up(vt_d, vt, sizeof vt);
{launches}
    for (long b = 0; b < NB; b++) {{
        void *h = malloc(BYTES[b]);
        down(h, buf[b], BYTES[b]);
        fwrite(h, 1, BYTES[b], o);
        free(h);
    }}
    fclose(o);
    printf("device %s\\n", where());
    return 0;
}}
"""


TITLE = "index and scan families', slice, concat, max/min/prod, softmax, lgamma/digamma kernels"
GROUPS = {"family": (FAMILY, TITLE), "conv": (CONV_FAMILY, "conv, max_pool, sum_pool kernels"),
          "linalg": (LINALG_FAMILY, "linear-algebra kernels (serial per matrix)")}


def run(work, nvcc, dry, arch="sm_90", group="family"):
    """(markdown lines, failures): one group's program (``GROUPS``) on the device (or the host emulation
    with ``dry``). Tier "blas" ops (conv, a serial dot per element against the native BLAS GEMMs; linear
    algebra, serial factorisations and substitutions per matrix against LAPACK) are held to the native
    suite's "blas" bound, 16 ulp of max|native|, in both."""
    names, title = GROUPS[group]
    work = pathlib.Path(work)
    work.mkdir(parents=True, exist_ok=True)
    head = ["", f"## {title} (every registry case, ordered) vs the native CPU program", ""]
    t = time.time()
    native, want = every_case("native", names=names)
    native.forward()
    native.backward()
    prog, items = every_case("numpy", names=names)
    cp = CudaProgram(prog, True)
    arrays = [np.ascontiguousarray(host_buffer(prog, cp, key)).reshape(-1) for key in cp.buffers]
    arrays = [a if key[0] != "S" else np.zeros(cp.scratch_size, prog.dtype) for a, key in zip(arrays, cp.buffers)]
    nbytes = [max(a.nbytes, 8) for a in arrays]
    src = work / "family.cu"
    src.write_text((PRELUDE if dry else "") + cp.src + driver(cp, nbytes))
    with open(work / "family.in", "wb") as f:
        for a, n in zip(arrays, nbytes):
            f.write(a.tobytes() + b"\0" * (n - a.nbytes))
    exe = work / "family"
    if dry:
        cmd = ["g++", "-x", "c++", "-std=c++14", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
               "-Wno-unused-function", "-Wno-unused-parameter", str(src), "-o", str(exe), "-lm"]
    elif nvcc is None:
        return head + ["- skipped: nvcc is not available"], []
    else:
        cmd = [nvcc, f"-arch={arch}", "-O3", "--fmad=false", "-std=c++14", str(src), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        return head + [f"- build failed: {r.stderr[-1500:]}"], [f"{group} build"]
    r = subprocess.run([str(exe), str(work / "family.in"), str(work / "family.out")], capture_output=True, text=True)
    if r.returncode:
        return head + [f"- run failed (rc {r.returncode}): {r.stderr[-1500:]}"], [f"{group} run"]
    raw, pos, out = (work / "family.out").read_bytes(), 0, {}
    for key, a, n in zip(cp.buffers, arrays, nbytes):
        out[key] = np.frombuffer(raw[pos:pos + a.nbytes], a.dtype)
        pos += n
    rows = ["| op | cases | values == native (blas tier: within its bound) | gradients == native (same) | "
            "blas tier, libm tier on the device: max rel. diff |",
            "|---|---|---|---|---|"]
    failures = []
    for name in names:
        blas = O.OPS[name].tier == "blas"
        libm = (O.OPS[name].tier == "libm" and not dry) or blas   # the device's exp/log: within LIBM_RTOL, not ==
        cases = vals = grads = ngrads = 0
        worst = 0.0

        def same(got, ref):
            nonlocal worst
            if not libm:
                return np.array_equal(got, ref, equal_nan=True)
            if blas:   # normwise: max|got − ref| / max|ref|
                worst = max(worst, float(np.max(np.abs(got - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1e-300)))
                return within_blas(got, ref)
            worst = max(worst, float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-300), initial=0.0)))
            if O.OPS[name].ulps is not None:   # k ulp, or k·eps·max(floor, max|ref|) absolutely
                k, floor = O.OPS[name].ulps
                tol = k * np.spacing(np.maximum(np.abs(got), np.abs(ref))) + k * EPS * max(floor, np.max(np.abs(ref)))
                return bool(np.all(np.abs(got - ref) <= tol))
            return np.allclose(got, ref, rtol=LIBM_RTOL, atol=0)

        for (op_name, _, xs, y), (_, _, xd, yd) in zip(want, items):
            if op_name != name:
                continue
            cases += 1
            vals += same(out[("v", yd.id)], np.asarray(native.value(y)).reshape(-1))
            for v, vd in zip(xs, xd):
                ngrads += 1
                grads += same(out.get(("g", vd.id), np.zeros(np.asarray(native.grad(v)).size)),
                              np.asarray(native.grad(v)).reshape(-1))
        if vals != cases or grads != ngrads:
            failures.append(f"{name} on the device")
        rows.append(f"| {name} | {cases} | {vals}/{cases} | {grads}/{ngrads} | {f'{worst:.1e}' if libm else '–'} |")
    where = r.stdout.strip().partition("device ")[2]
    return head + rows + ["", f"- ran on {where} ({time.time() - t:.1f}s)"], failures
