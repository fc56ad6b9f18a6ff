"""Run the emit oracle's scalar programs on an NVIDIA GPU and compare every value and gradient with the tape.

tests/test_emit.py proves ``c_grad(..., dialect="cuda")`` only as host C++ under a prelude. This script
proves it on the device. For every program of that oracle (imported from it: ``PROGRAMS``, one per op and
operand pattern plus six composites), it

1. emits the program twice — the cuda dialect (every + − × ÷ an ``__d*_rn`` intrinsic) and the plain C
   body marked ``__device__`` — and wraps each in a ``__global__`` kernel, one thread per input;
2. builds one CUDA C++ executable per dialect with nvcc's DEFAULT flags (``--fmad=true``: nvcc may fuse a
   plain ``a * b + c`` into one FMA, but never the intrinsics), plus PTX, in which no exact-tier kernel of
   the cuda dialect may hold an ``fma``;
3. runs both on N random inputs per program and compares with the tape recorded on the host:

   - a program of the registry's "exact" tier must give the tape's bits in the cuda dialect (``==``; only
     the sign of a zero may differ, as in the host oracle);
   - a "libm" program calls the device's exp/log/tanh/pow (and the special functions' log1p, expm1, erf,
     erfc, sin, cos, tan, atan2, asinh). One probe kernel per function evaluates it on
     every argument the emitted code passes it; where every call returns NumPy's bits the emitted code
     must again be bit-exact, elsewhere the ulp distance is reported and ``device_close`` is asserted;
   - the C body shows what contraction does: the count of inputs whose result differs from the tape.

6. (``experiments/gpu/gpu_ops_check.py``) runs the index and scan families' kernels and slice's, concat's,
   max/min/prod's (every registry case of take, take_along_axis, index_add, index_set, the dynamic slices,
   cumsum, cumprod, cummax, sort, slice, concat, max, min, prod, softmax, logsoftmax, logsumexp, lgamma,
   digamma) forward and backward on the device: every value and gradient == the native CPU program (the
   libm-tier ones within rtol 1e-12, lgamma within its registry ``ulps`` bound: the device's exp/log/lgamma).
   The same for conv, max_pool and sum_pool: pooling == native, conv (a serial dot per element against the
   native program's BLAS GEMMs) within the "blas" bound, 16 ulp of max|native|; and for the linear-algebra
   family (cholesky, triangular_solve, solve, logdet, logabsdet, det_sign: serial per matrix against the
   native program's LAPACK calls), within the same bound.

5. (``experiments/gpu/gpu_handler_check.py``) runs the GPU custom call's C handler ``tg_gpu_episode`` on the
   device with a driver executable in XLA's place (its own buffers, stream and call frames): the episodes it
   runs == the ordered CPU tape, the pointer table is restored, µs per call beside the bare graph replay. It
   needs jax's ``c_api.h`` (an installed jax, or ``--ffi-include DIR``) and gcc; without them it says so.

4. (``experiments/gpu/gpu_programs.py``) builds the generated CUDA program of an MLP training episode (Adam,
   mse; sizes tiny…large) into an executable per variant and checks: ordered GPU program == the ordered CPU
   tape, fused == per-node, the cuBLAS-GEMM program within rtol 1e-10 of the native CPU backend; it reports
   launches per episode and µs per episode launched kernel by kernel, fused, and replayed as one CUDA graph,
   beside ``jax.jit(value_and_grad + optax.adam)`` when a GPU jax is installed.

Launch mechanism: nvcc builds a plain executable (CUDA runtime, ``<<<>>>``), fed and read through binary
files, so no Python GPU package is needed — only nvcc and the driver, both on the lent H200 machine.
The same source compiles as host C++ (``__CUDACC__`` undefined) with a loop in place of the launch; that
host build is how ``--dry`` exercises everything but the GPU.

Run it on the GPU machine (the lent H200: the device tool's ``run`` with this command and ``timeout_s`` 300;
under a minute once the machine is up, mostly the host tape at N=4096 and nvcc)::

    PYTHONUNBUFFERED=1 python3 experiments/gpu_check.py --out $OUT

(``python3`` there has numpy and pytest, all this needs; nothing to install.) It prints a markdown table and
writes six files under ``--out``: ``report.md``, ``results.json``, the two ``kernels_*.cu`` sources and their
``.ptx``. Exit status: 0 when every claim held, 1 when one failed, 2 when no run was possible (no nvcc, no
GPU).

Here, without a GPU::

    .venv/bin/python experiments/gpu_check.py --dry

emits, generates the kernels, compiles them to PTX with nvcc when nvcc is on PATH (otherwise says so),
runs the host build of the same source, and prints that no GPU was used.
"""
import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_emit as T  # noqa: E402  (the oracle's programs, sampler, tape recorder and libm call table)
sys.path.insert(0, str(ROOT / "experiments" / "gpu"))
import gpu_programs as GP  # noqa: E402  (the captured MLP program's CUDA source on the device)
import gpu_handler_check as GH  # noqa: E402  (the GPU custom call's C handler on the device, XLA played by a driver)
import gpu_ops_check as GO  # noqa: E402  (the index and scan families' kernels on the device)

EPS = np.finfo(np.float64).eps
THREADS = 128
PROBES = {"exp": ("exp(v[0])", 1), "log": ("log(v[0])", 1), "tanh": ("tanh(v[0])", 1),
          "pow": ("pow(v[0], v[1])", 2), "atan2": ("atan2(v[0], v[1])", 2),
          **{f: (f"{f}(v[0])", 1) for f in ("log1p", "expm1", "erf", "erfc", "sin", "cos", "tan", "asinh")}}


def device_close(d, c, t, scale):
    """The bound where a device libm call and NumPy's differ: within 6 ulp, or 12·eps·scale absolutely.

    CUDA's double exp, log and tanh are within 1 ulp of the true result and pow within 2 (CUDA C++
    Programming Guide, table of double-precision functions' maximum ulp error); NumPy's are within about
    1. So one call differs from NumPy's by at most 3 ulp, where glibc's differs by at most 2. The host
    oracle's argument (tests/test_emit.py, ``libm_close``: 4 ulp or 8·eps·scale from 2 ulp per call)
    then scales by 3/2. Takes the ulp distances ``d`` between arrays ``c`` and ``t``."""
    with np.errstate(invalid="ignore"):
        return (d <= 6) | (np.abs(c - t) <= 12 * EPS * scale)


# ── entries: the oracle's programs, then the libm probes ────────────────────

class Entry:
    """One kernel: its emitted function, its parameter/data widths and its inputs."""

    def __init__(self, name, np_, nv, libm):
        self.name, self.np, self.nv, self.libm = name, np_, nv, libm
        self.ng = max(np_, 1)
        self.P = self.V = self.want = self.scale = None
        self.calls = []                      # per input: [(probe, row in that probe's inputs), ...]


def record_inputs(n, seed):
    """Sample n inputs per program, record each on a fresh tape; collect the libm calls to probe."""
    rng = np.random.default_rng(seed)
    entries, probe_args = [], {f: [] for f in PROBES}
    for name, prog in T.PROGRAMS.items():
        P0, V0 = prog.sample(np.random.default_rng(0))
        e = Entry(name, len(P0), len(V0), T.has_libm(prog))
        e.P, e.V = np.zeros((n, e.np)), np.zeros((n, e.nv))
        e.want, e.scale = np.zeros((n, 1 + e.np)), np.ones(n)
        for i in range(n):
            P, V = prog.sample(rng)
            tape, pv, _, loss = T.record(prog, P, V)
            e.P[i] = [np.asarray(x).reshape(-1)[0] for x in P]
            e.V[i] = [np.asarray(x).reshape(-1)[0] for x in V]
            e.want[i] = T.expected(tape, pv, loss)
            e.scale[i] = max([1.0] + [abs(float(x)) for x in e.V[i]])
            if e.libm:
                e.calls.append(libm_calls(tape, loss, probe_args))
        entries.append(e)
    probes = []
    for f, (expr, nv) in PROBES.items():
        p = Entry("probe_" + f, 0, nv, True)
        p.V = np.array(probe_args[f], dtype=np.float64).reshape(-1, nv)
        p.P = np.zeros((len(p.V), 0))
        with np.errstate(all="ignore"):
            fn = np.power if f == "pow" else T.TAPE_FN.get(f, getattr(np, f, None))
            p.want = fn(*(p.V[:, j] for j in range(nv)))[:, None]
        probes.append(p)
    return entries, probes


def libm_calls(tape, loss, probe_args):
    """The emitted code's libm calls on this tape (the oracle's LIBM_CALLS), queued for the probes."""
    out = []
    for node in tape.nodes[:loss.id + 1]:
        if node.op.tier != "libm":
            continue
        a = float(tape._val[node.a].reshape(-1)[0])
        if node.op.name in T.LIBM_CALLS2:
            todo = T.LIBM_CALLS2[node.op.name](a, float(tape._val[node.b].reshape(-1)[0]), node.s)
        else:
            todo = T.LIBM_CALLS[node.op.name](a, node.s)
        for f, *args in todo:
            out.append((f, len(probe_args[f])))
            probe_args[f].append(args)
    return out


# ── source: emitted functions, kernels, a driver that runs on the device or, as host C++, on the CPU ──

HOST_PRELUDE = T.PRELUDE + """\
#define __global__
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim = {1};
"""

RUNTIME = r"""
#ifdef __CUDACC__
static void check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "gpu_check: %s failed: %s\n", what, cudaGetErrorString(e));
        exit(3);
    }
}
static double *dev_put(const double *h, size_t n)
{
    double *d = NULL;
    check(cudaMalloc((void **)&d, n * sizeof(double) + sizeof(double)), "cudaMalloc");
    check(cudaMemcpy(d, h, n * sizeof(double), cudaMemcpyHostToDevice), "cudaMemcpy to the device");
    return d;
}
static void dev_get(double *h, const double *d, size_t n)
{
    check(cudaDeviceSynchronize(), "the kernel");
    check(cudaMemcpy(h, d, n * sizeof(double), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
}
static void dev_free(double *d) { check(cudaFree(d), "cudaFree"); }
static const char *where(void)
{
    static cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    return prop.name;
}
#define LAUNCH(kern, n, P, V, L, G) \
    do { kern<<<((n) + THREADS - 1) / THREADS, THREADS>>>(n, P, V, L, G); check(cudaGetLastError(), #kern); } while (0)
#else
static double *dev_put(const double *h, size_t n)
{
    double *d = (double *)malloc(n * sizeof(double) + sizeof(double));
    memcpy(d, h, n * sizeof(double));
    return d;
}
static void dev_get(double *h, const double *d, size_t n) { memcpy(h, d, n * sizeof(double)); }
static void dev_free(double *d) { free(d); }
static const char *where(void) { return "the host CPU (emulation: no GPU)"; }
#define LAUNCH(kern, n, P, V, L, G) \
    for (blockIdx.x = 0; blockIdx.x < (unsigned)(n); blockIdx.x++) kern(n, P, V, L, G)
#endif
"""

MAIN = r"""
static double *read_doubles(FILE *f, size_t n)
{
    double *h = (double *)calloc(n + 1, sizeof(double));
    if (fread(h, sizeof(double), n, f) != n) {
        fprintf(stderr, "gpu_check: input file too short\n");
        exit(4);
    }
    return h;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s INPUT OUTPUT (written by experiments/gpu_check.py)\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        fprintf(stderr, "gpu_check: cannot open %s or %s\n", argv[1], argv[2]);
        return 2;
    }
    long long count[K];
    if (fread(count, sizeof(long long), K, in) != K) {
        fprintf(stderr, "gpu_check: input file too short\n");
        return 4;
    }
    for (int k = 0; k < K; k++) {
        size_t n = (size_t)count[k];
        double *P = read_doubles(in, n * NP[k]), *V = read_doubles(in, n * NV[k]);
        double *L = (double *)calloc(n + 1, sizeof(double)), *G = (double *)calloc(n * NG[k] + 1, sizeof(double));
        double *dP = dev_put(P, n * NP[k]), *dV = dev_put(V, n * NV[k]);
        double *dL = dev_put(L, n), *dG = dev_put(G, n * NG[k]);
        if (n)
            launch(k, (int)n, dP, dV, dL, dG);
        dev_get(L, dL, n);
        dev_get(G, dG, n * NG[k]);
        fwrite(L, sizeof(double), n, out);
        fwrite(G, sizeof(double), n * NG[k], out);
        dev_free(dP), dev_free(dV), dev_free(dL), dev_free(dG);
        free(P), free(V), free(L), free(G);
    }
    fclose(in);
    if (fclose(out) != 0) {
        fprintf(stderr, "gpu_check: cannot write %s\n", argv[2]);
        return 2;
    }
    printf("gpu_check: ran %d kernels on %s\n", K, where());
    return 0;
}
"""


def function_source(e, dialect):
    """The emitted function (the C body gets ``__device__``), or a probe calling one libm function."""
    if e.name.startswith("probe_"):
        return (f"__device__ double {e.name}(const double *p, double *g, const double *v)\n"
                f"{{\n    (void)p;\n    (void)g;\n    return {PROBES[e.name[6:]][0]};\n}}\n")
    prog = T.PROGRAMS[e.name]
    src = T.emit(prog, dialect)
    if dialect == "c":
        head = f"double {T.cname(prog)}("
        assert src.count(head) == 1, head
        src = src.replace(head, "__device__ " + head)
    return src


def fname(e):
    return e.name if e.name.startswith("probe_") else T.cname(T.PROGRAMS[e.name])


def source(entries, dialect):
    """One translation unit: every function, one kernel per function, a launch switch and the driver."""
    out = [f"/* experiments/gpu_check.py: {len(entries)} kernels, {dialect} dialect. Do not edit. */",
           "#include <math.h>", "#include <stdio.h>", "#include <stdlib.h>", "#include <string.h>",
           "#ifdef __CUDACC__", "#include <cuda_runtime.h>", "#else", HOST_PRELUDE.rstrip(), "#endif",
           f"#define K {len(entries)}", f"#define THREADS {THREADS}", RUNTIME]
    for key in ("np", "nv", "ng"):
        out.append(f"static const size_t {key.upper()}[K] = {{{', '.join(str(getattr(e, key)) for e in entries)}}};")
    out.append("")
    for k, e in enumerate(entries):
        f = fname(e)
        args = f"P + i * {e.np}, G + i * {e.ng}" + (f", V + i * {e.nv}" if e.nv else "")
        out += [function_source(e, dialect),
                f'extern "C" __global__ void k_{f}(int n, const double *P, const double *V, double *L, double *G)',
                "{", "    (void)P;", "    (void)V;", "    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;",
                "    if (i < (size_t)n)", f"        L[i] = {f}({args});", "}", ""]
    out += ["static void launch(int k, int n, const double *P, const double *V, double *L, double *G)", "{",
            "    switch (k) {"]
    out += [f"    case {k}: LAUNCH(k_{fname(e)}, n, P, V, L, G); break;" for k, e in enumerate(entries)]
    out += ["    }", "}"]
    return "\n".join(out) + "\n" + MAIN


def write_inputs(path, entries):
    with open(path, "wb") as f:
        np.array([len(e.P) for e in entries], np.int64).tofile(f)
        for e in entries:
            np.ascontiguousarray(e.P, np.float64).tofile(f)
            np.ascontiguousarray(e.V, np.float64).tofile(f)


def read_outputs(path, entries):
    """Per entry an (n, 1 + np) array laid out like ``want``: the loss, then each gradient."""
    raw, pos, got = np.fromfile(path, np.float64), 0, []
    for e in entries:
        n = len(e.P)
        L, G = raw[pos:pos + n], raw[pos + n:pos + n + n * e.ng].reshape(n, e.ng)
        pos += n + n * e.ng
        got.append(np.column_stack([L, G[:, :e.np]]))
    assert pos == len(raw), f"read {pos} of {len(raw)} doubles"
    return got


# ── building ─────────────────────────────────────────────────────────────────

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


def nvcc_jobs(srcs, arch, work, exe):
    """nvcc with its default flags (--fmad=true): PTX beside each source, the executable in ``work`` when asked."""
    jobs = []
    for d, src in srcs.items():
        base = [NVCC, f"-arch={arch}", "-Werror", "all-warnings", str(src)]
        jobs.append((f"nvcc -ptx ({d})", base + ["-ptx", "-o", str(src.with_suffix(".ptx"))]))
        if exe:
            jobs.append((f"nvcc ({d})", base + ["-O3", "-o", str(work / f"kernels_{d}")]))
    return jobs


def host_jobs(srcs, work):
    """The same source as host C++. The cuda dialect's intrinsics become plain operations, so contraction is
    turned off for it; the C body keeps g++'s default (-ffp-contract=fast), the host's --fmad=true."""
    cxx = T.CXX or sys.exit("gpu_check: no C++ compiler for the host build")
    flags = ["-x", "c++", "-O2", "-Wall", "-Wextra", "-Werror"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return [(f"c++ ({d})", [cxx, *flags, *(["-ffp-contract=off"] if d == "cuda" else []), str(src), "-o",
                            str(work / f"kernels_{d}"), "-lm"]) for d, src in srcs.items()]


def build(jobs):
    t = time.time()
    procs = [(what, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for what, cmd in jobs]
    for what, cmd, p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"gpu_check: {what} failed ({' '.join(cmd)}):\n{err[-4000:]}{out[-2000:]}")
    return time.time() - t


def ptx_counts(ptx_path):
    """Per kernel, its ``fma.rn.f64`` instructions and its f64 add/sub/mul WITHOUT a rounding modifier (the
    PTX ISA lets ptxas fuse a mul/add pair of those). The cuda dialect's exact-tier kernels must hold no fma;
    the unrounded ops are reported (``div.rn``/``sqrt.rn`` stay single PTX instructions)."""
    counts, text = {}, ptx_path.read_text()
    if re.search(r"\.func\s.*\b(?:f|probe)_\w+\(", text):
        print(f"note: {ptx_path.name} holds emitted functions as .func bodies (not inlined); counts are approximate")
    for m in re.finditer(r"\.entry\s+k_(\w+)\(", text):
        end = min([i for i in (text.find(".entry", m.end()), text.find(".func", m.end())) if i > 0] + [len(text)])
        body = text[m.end():end]
        counts[m.group(1)] = (len(re.findall(r"\bfma\.rn\.f64\b", body)),
                              len(re.findall(r"\b(?:add|sub|mul)\.f64\b", body)))
    return counts


# ── comparing ────────────────────────────────────────────────────────────────

def ulp_array(got, want):
    """Elementwise ulp distance (0 for equal values, ±0 and two NaNs; the oracle's ``ulps``)."""
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    d = np.zeros(got.shape)
    for idx in zip(*np.nonzero(~same)):
        d[idx] = T.ulps(float(got[idx]), float(want[idx]))
    return d


def compare(entries, probes, got_cuda, got_c, ptx):
    """Per program: bit-exact inputs, libm agreement, max ulp, failures, what the C body does, PTX counts."""
    probe_ok = {p.name[6:]: ulp_array(g, p.want)[:, 0] == 0 for p, g in zip(probes, got_cuda[len(entries):])}
    rows = []
    for e, gu, gc in zip(entries, got_cuda, got_c):
        d, dc = ulp_array(gu, e.want), ulp_array(gc, e.want)
        exact = (d == 0).all(axis=1)
        agree = np.array([all(probe_ok[f][j] for f, j in calls) for calls in e.calls], bool).reshape(-1) \
            if e.libm else np.ones(len(d), bool)
        close = device_close(d, gu, e.want, e.scale[:, None]).all(axis=1)
        fma_cuda = ptx["cuda"].get(fname(e), (0, 0))[0]
        failures = int((agree & ~exact).sum() + (~agree & ~close).sum())
        if not e.libm and fma_cuda:
            failures += 1                    # an FMA in an exact-tier cuda-dialect kernel
        rows.append(dict(
            program=e.name, tier="libm" if e.libm else "exact", n=len(d), exact=int(exact.sum()),
            libm_agree=int(agree.sum()), max_ulp_value=float(d[:, 0].max(initial=0)),
            max_ulp_grad=float(d[:, 1:].max(initial=0)), failures=failures,
            err_past_6ulp=float(np.where(d > 6, np.abs(gu - e.want) / (EPS * e.scale[:, None]), 0.0).max()),
            c_differ=int((dc > 0).any(axis=1).sum()), c_max_ulp=float(dc.max(initial=0)),
            ptx_cuda=ptx["cuda"].get(fname(e)), ptx_c=ptx["c"].get(fname(e))))
    return rows, {f: (int(ok.sum()), len(ok)) for f, ok in probe_ok.items()}


def fmt(x):
    return "inf" if x == float("inf") else str(int(x))


def verdict(r):
    if r["failures"]:
        return f"**FAIL** ({r['failures']})"
    return "exact" if r["exact"] == r["n"] else "within bound"


def table(rows):
    """Markdown: one row per program. PTX columns: fma.rn.f64 count, then f64 add/sub/mul without .rn."""
    out = ["| program | tier | cuda dialect: bit-exact inputs | max ulp value / grad | past 6 ulp: max abs err / (eps·scale) | "
           "verdict | C body, --fmad=true: inputs ≠ tape | C body max ulp | PTX cuda: fma, unrounded | "
           "PTX C: fma, unrounded |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        px = [", ".join(map(str, r[k])) if r[k] else "–" for k in ("ptx_cuda", "ptx_c")]
        out.append(f"| {r['program']} | {r['tier']} | {r['exact']}/{r['n']} | {fmt(r['max_ulp_value'])} / "
                   f"{fmt(r['max_ulp_grad'])} | {r['err_past_6ulp']:.3g} | {verdict(r)} | {r['c_differ']}/{r['n']} | "
                   f"{fmt(r['c_max_ulp'])} | {px[0]} | {px[1]} |")
    return "\n".join(out)


def summary(rows, agree, where, dry, have_ptx):
    exact_tier = [r for r in rows if r["tier"] == "exact"]
    libm_tier = [r for r in rows if r["tier"] == "libm"]
    contracted = [r["program"] for r in exact_tier if r["c_differ"]]
    fused_c = [r["program"] for r in exact_tier if r["ptx_c"] and r["ptx_c"][0]]
    no_fma = [r for r in exact_tier if r["ptx_cuda"] and not r["ptx_cuda"][0]]
    loose = [f"{r['program']} {r['ptx_cuda'][1]}" for r in exact_tier if r["ptx_cuda"] and r["ptx_cuda"][1]]
    return [
        f"- cuda dialect, exact tier: {sum(r['exact'] == r['n'] for r in exact_tier)}/{len(exact_tier)} programs "
        f"bit-exact on every input; libm tier: {sum(not r['failures'] for r in libm_tier)}/{len(libm_tier)} "
        f"exact where every libm call returned NumPy's bits and within the bound elsewhere "
        f"(max {fmt(max([r['max_ulp_value'] for r in libm_tier] + [r['max_ulp_grad'] for r in libm_tier]))} ulp, "
        f"large only where cancellation leaves a result near 0: there the abs err is at most "
        f"{max([r['err_past_6ulp'] for r in libm_tier] + [0]):.3g}·eps·scale).",
        f"- libm calls on {where} returning NumPy's bits: "
        + ", ".join(f"{f} {a}/{n}" for f, (a, n) in agree.items()) + ".",
        "- bound where a libm call differs from NumPy: ≤ 6 ulp or ≤ 12·eps·max(1, |data|) (device_close).",
        (f"- PTX, exact tier: {len(no_fma)}/{len(exact_tier)} cuda-dialect kernels hold no fma.rn.f64; the C body "
         f"has one or more in {len(fused_c)}/{len(exact_tier)} ({', '.join(fused_c)}). Unrounded f64 add/sub/mul in "
         f"cuda-dialect kernels: {', '.join(loose) or 'none'} (nvcc turns __ddiv_rn(x, 2^k) into an exact "
         f"mul.f64 by 2^-k; ptxas may fuse a mul only into an add that lacks a rounding modifier, and every "
         f"add of the dialect is add.rn, which the PTX ISA says is treated conservatively)."
         if have_ptx else "- PTX: not compiled (no nvcc)."),
        f"- C body under nvcc's default --fmad=true{' (host emulation: g++ -ffp-contract=fast)' if dry else ''}, "
        f"exact tier: {len(contracted)}/{len(exact_tier)} programs differ from the tape on some input"
        + (f" ({', '.join(contracted)})." if contracted else "."),
    ]


# ── main ─────────────────────────────────────────────────────────────────────

def check(args, out, work):
    """Record, generate, build, run both dialects: the comparison rows (None when no run was possible), the
    libm probes' agreement, and timings and facts for the report."""
    t0 = time.time()
    entries, probes = record_inputs(args.n, args.seed)
    allk = entries + probes
    srcs = {d: out / f"kernels_{d}.cu" for d in ("cuda", "c")}
    for d, path in srcs.items():
        path.write_text(source(allk, d))
    inputs = work / "inputs.bin"
    write_inputs(inputs, allk)
    info = dict(t_tape=time.time() - t0, t_build=0.0, have_ptx=NVCC is not None, ran_on=None)
    print(f"gpu_check: {len(entries)} programs × {args.n} inputs recorded on the tape, {len(probes)} libm probes "
          f"({sum(len(p.V) for p in probes)} calls); sources in {out} ({info['t_tape']:.1f}s)")

    if NVCC is None and not args.dry:
        print("gpu_check: nvcc is not on PATH (nor /usr/local/cuda/bin); the GPU run needs it")
        return None, None, info
    if NVCC is None:
        print("gpu_check: nvcc is not on PATH: the PTX compile step is skipped")
    jobs = (nvcc_jobs(srcs, args.arch, work, exe=not args.dry) if NVCC else []) \
        + (host_jobs(srcs, work) if args.dry else [])
    info["t_build"] = build(jobs)
    print(f"gpu_check: built {', '.join(w for w, _ in jobs)} ({info['t_build']:.1f}s)")
    ptx = {d: ptx_counts(src.with_suffix(".ptx")) if NVCC else {} for d, src in srcs.items()}

    got = {}
    for d in srcs:
        res = subprocess.run([str(work / f"kernels_{d}"), str(inputs), str(work / f"outputs_{d}.bin")],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"gpu_check: the {d} executable failed (rc {res.returncode}), so no comparison was made: "
                  f"{res.stderr.strip()}")
            return None, None, info
        print(res.stdout.strip())
        info["ran_on"] = res.stdout.strip().partition(" on ")[2]
        got[d] = read_outputs(work / f"outputs_{d}.bin", allk)
    rows, agree = compare(entries, probes, got["cuda"], got["c"], ptx)
    return rows, agree, info


def programs(args, out):
    """The captured MLP episode's CUDA program: parity, launches and timings (``gpu_programs``)."""
    sizes = args.programs.split(",") if args.programs else None
    work = out / "programs"
    work.mkdir(exist_ok=True)
    t = time.time()
    md, failed = GP.run(work, NVCC, args.dry, args.arch, sizes)
    if args.dry and NVCC:   # the device executable must at least build here
        tape, _, params, x, y, loss, opt, data = GP.mlp(GP.SIZES["tiny"][1], 32, True, 1)
        prog = T.tg.capture(tape, loss)
        prog.attach(opt)
        cp = GP.CudaProgram(prog, True)
        src = work / "device_tiny.cu"
        src.write_text(cp.src + GP.driver(cp, prog, [x.id, y.id], 1, 1))
        r = subprocess.run([NVCC, f"-arch={args.arch}", "-O3", "--fmad=false", "-std=c++14", "-Werror",
                            "all-warnings", str(src), "-o", str(work / "device_tiny")], capture_output=True, text=True)
        md.append(f"- nvcc built the device executable of the tiny ordered fused program: "
                  f"{'yes' if r.returncode == 0 else 'NO: ' + r.stderr[-500:]}")
        if r.returncode:
            failed.append("device build")
    hmd, hfailed = GH.run(work / "handler", NVCC, args.dry, args.arch, args.ffi_include)
    omd, ofailed = GO.run(work / "family", NVCC, args.dry, args.arch)
    for group in ("conv", "linalg"):
        gmd, gfailed = GO.run(work / group, NVCC, args.dry, args.arch, group)
        omd, ofailed = omd + gmd, ofailed + gfailed
    jmd, jfailed = jax_tests(args.dry)
    return (["", f"## captured MLP programs ({time.time() - t:.1f}s)", ""] + md + hmd + omd + jmd,
            failed + hfailed + ofailed + jfailed)


def jax_tests(dry):
    """The JAX side on the GPU: tests/test_gpu_jax.py (the jitted CUDA custom call == the native program) and
    tests/test_dlpack_gpu.py (CuPy <-> JAX without copies, stream-ordered). They need CuPy and JAX's CUDA
    backend and skip without them; the report says which."""
    head = ["", "## JAX on the GPU: the custom call under jax.jit, DLPack with CuPy", ""]
    if dry:
        return head + ["- not run: no GPU (dry run); on the CPU these tests skip"], []
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_gpu_jax.py"), str(ROOT / "tests" / "test_dlpack_gpu.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    tail = [line for line in r.stdout.strip().splitlines() if line.strip()][-6:]
    return head + ["```"] + tail + ["```"], ([] if r.returncode == 0 else ["JAX/CuPy GPU tests"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="no GPU: compile to PTX (if nvcc is present) and run the "
                                                       "host build of the same source")
    ap.add_argument("--n", type=int, default=4096, help="random inputs per program (one GPU thread each)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arch", default="sm_90", help="nvcc -arch (sm_90: H100/H200)")
    ap.add_argument("--out", type=pathlib.Path, help="directory for sources, PTX and report.md")
    ap.add_argument("--programs", default=None, help="MLP sizes for the program check, comma-separated "
                                                     "(tiny,small,medium,large; default: all on a GPU, tiny with --dry)")
    ap.add_argument("--ffi-include", default=None, help="folder holding xla/ffi/api/c_api.h for the handler check "
                                                         "(default: the installed jax's)")
    args = ap.parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows, agree, info = check(args, out, pathlib.Path(tmp))
    if rows is None:
        return 2
    where = "the host CPU (dry run, emulation)" if args.dry else info["ran_on"]
    report = "\n".join([f"## tapegrad emit on {where}: {len(rows)} programs × {args.n} inputs", "", table(rows), "",
                        *summary(rows, agree, where, args.dry, info["have_ptx"]),
                        f"- timings: tape {info['t_tape']:.1f}s, build {info['t_build']:.1f}s, "
                        f"total {time.time() - t0:.1f}s.", ""])
    prog_md, prog_failed = programs(args, out)
    report += "\n".join(prog_md) + "\n"
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(report)
    failed = [r["program"] for r in rows if r["failures"]] + prog_failed
    if failed:
        print(f"gpu_check: FAILED on {where}: {', '.join(failed)}")
        return 1
    if args.dry:
        print(f"gpu_check: DRY RUN — no GPU was used. Emitted and generated {len(rows) + len(PROBES)} kernels, "
              + ("compiled them to PTX with nvcc" if info["have_ptx"] else "skipped the PTX compile (no nvcc)")
              + f", ran the same source as host C++ and compared it with the tape. Output in {out}.")
    else:
        print(f"gpu_check: every claim held on {where}. Output in {out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
