"""The captured-program half of ``gpu_check.py``: an MLP training episode's generated CUDA program on the device.

For each MLP size and variant (ordered fused, ordered per-node, default-order fused with cuBLAS), the
program's CUDA source (``tapegrad.gpu.source``) gets a small ``main`` and is built by nvcc into a plain
executable (CUDA runtime, ``<<<>>>`` launches, cuBLAS for the default mode's call sites), so the check
needs no Python GPU package. The executable reads the initial buffers, each episode's minibatch and
``ctl`` scalars from a file, runs the episodes, writes the losses and final parameters, then times
episodes launched kernel by kernel and (no cuBLAS inside) replayed as one CUDA graph. With ``--dry``
the same source is built as host C++ under the grid emulation prelude (``tapegrad.gpu.host``).

Claims checked (each one a row of the report):
- ordered GPU program == the ordered CPU tape (losses and parameters after the episodes, ``==``);
- fused == per-node (``==``), and launches per episode fused vs per-node;
- default order (cuBLAS GEMMs) within rtol 1e-10 of the native CPU backend.
"""
import pathlib
import subprocess
import time

import numpy as np

import tapegrad as tg
from tapegrad.gpu.host import PRELUDE
from tapegrad.gpu.source import CudaProgram

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10)), "medium": (256, (784, 512, 512, 10)),
         "large": (1024, (1024, 2048, 2048, 1024))}


def forward(tape, params, xb, yb):
    x, y = tape.const(xb), tape.const(yb)
    h = x
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = h.relu()
    return x, y, tg.mse(h, y)


def mlp(sizes, rows, ordered, episodes, seed=0, clip=None):
    """(tape, mark, params, x, y, loss, optimizer, data) of an MLP with mse and Adam (global-norm clipping at
    ``clip``), one episode recorded."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape(ordered=ordered)
    params = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        params += [tape.param(rng.standard_normal((i, o)) / np.sqrt(i)), tape.param(rng.standard_normal(o) * 0.1)]
    opt = tg.Adam(1e-3, clip=clip)
    for p in params:
        opt.add(tape, p)
    data = [(rng.standard_normal((rows, sizes[0])), rng.standard_normal((rows, sizes[-1]))) for _ in range(episodes)]
    mark = tape.mark()
    x, y, loss = forward(tape, params, *data[0])
    return tape, mark, params, x, y, loss, opt, data


def cpu_reference(sizes, rows, ordered, episodes, backend, clip=None):
    """Losses and final parameters of the eager tape ("tape") or a CPU program ("native")."""
    tape, mark, params, x, y, loss, opt, data = mlp(sizes, rows, ordered, episodes, clip=clip)
    if backend == "tape":
        losses = []
        for k, (xb, yb) in enumerate(data):
            if k:
                tape.reset_to(mark)
                x, y, loss = forward(tape, params, xb, yb)
            losses.append(float(tape.value(loss)))
            tape.backward(loss)
            opt.step()
        return np.array(losses), [tape.value(p).copy() for p in params]
    prog = tg.capture(tape, loss, backend=backend)
    prog.attach(opt)
    losses = [prog.episode({x: xb, y: yb}) for xb, yb in data]
    return np.array(losses), [np.array(prog.value(p)) for p in params]


def driver(cp, prog, slots, episodes, reps):
    """``main`` for the program: buffers from ``argv[1]``, results to ``argv[2]``, timings on stdout."""
    sizes = [prog.val[k].size if kind == "v" else
             (prog.grad_buf(k).size if kind == "g" else
              (cp.scratch_size if kind == "S" else prog.opt.mu[k].size)) for kind, k in cp.buffers]
    slot_idx = [cp.index[("v", k)] for k in slots]
    params = [cp.index[("v", k)] for k in prog.opt.ids]
    has_gemm = any(L.kind == "gemm" for L in cp.forward + cp.backward)

    def call(L):
        if L.kind == "gemm":
            ta, tb, m, n, k, A, B, C = L.gemm
            return f"    GEMM({ta}, {tb}, {m}, {n}, {k}, {cp.index[A]}, {cp.index[B]}, {cp.index[C]});"
        return f"    LAUNCH({L.name}, {L.grid[0]}, {L.grid[1]}, {L.block}, {L.phases});"

    body = "\n".join(call(L) for L in cp.forward + cp.backward + cp.step)
    return f"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <chrono>
static const long NB = {len(sizes)};
static const long SIZE[] = {{{", ".join(map(str, sizes))}}};
static const long SLOTS[] = {{{", ".join(map(str, slot_idx))}}};
static const long PARAMS[] = {{{", ".join(map(str, params))}}};
static const int EPISODES = {episodes}, REPS = {reps}, NSLOT = {len(slot_idx)}, NPARAM = {len(params)};
static const long LOSS = {cp.index[("v", prog.loss_id)]};
#ifdef __CUDACC__
static cudaStream_t st;
static long long *vt_d;
static double *ctl_d;
#define CHECK(x) do {{ cudaError_t e_ = (x); if (e_ != cudaSuccess) {{ fprintf(stderr, "%s: %s\\n", #x, cudaGetErrorString(e_)); exit(3); }} }} while (0)
static void *dalloc(size_t n) {{ void *p; CHECK(cudaMalloc(&p, n)); return p; }}
static void up(void *d, const void *h, size_t n) {{ CHECK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, st)); }}
static void down(void *h, const void *d, size_t n) {{ CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, st)); CHECK(cudaStreamSynchronize(st)); }}
static void sync() {{ CHECK(cudaStreamSynchronize(st)); }}
#define LAUNCH(fn, gx, gy, bx, ph) fn<<<dim3(gx, gy), bx, 0, st>>>(vt_d, ctl_d)
{"#include <cublas_v2.h>" if has_gemm else ""}
{"static cublasHandle_t blas;" if has_gemm else "/* no cuBLAS call sites */"}
{"static void gemm(int ta, int tb, int m, int n, int k, const real *A, const real *B, real *C)" if has_gemm else "#if 0"}
{{
    const real one = 1, zero = 0;   /* row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ */
    {"cublasSgemm" if cp.f32 else "cublasDgemm"}(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                &one, B, tb ? k : n, A, ta ? m : k, &zero, C, n);
}}
{"" if has_gemm else "#endif"}
#else
static long long *vt_d;
static double *ctl_d;
static void *dalloc(size_t n) {{ return calloc(1, n); }}
static void up(void *d, const void *h, size_t n) {{ memcpy(d, h, n); }}
static void down(void *h, const void *d, size_t n) {{ memcpy(h, d, n); }}
static void sync() {{}}
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
static void __attribute__((unused)) gemm(int ta, int tb, int m, int n, int k, const real *A, const real *B, real *C)
{{
    for (int i = 0; i < m; i++) for (int j = 0; j < n; j++) {{
        real acc = 0;
        for (int q = 0; q < k; q++) acc += A[ta ? q * m + i : i * k + q] * B[tb ? j * k + q : q * n + j];
        C[i * n + j] = acc;
    }}
}}
#endif
static real *buf[{len(sizes)}];
#define GEMM(ta, tb, m, n, k, a, b, c) gemm(ta, tb, m, n, k, buf[a], buf[b], buf[c])
static void episode(void)
{{
{body}
}}
int main(int argc, char **argv)
{{
    if (argc < 3) {{ fprintf(stderr, "usage: %s inputs.bin outputs.bin\\n", argv[0]); return 2; }}
#ifdef __CUDACC__
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
{"    cublasCreate(&blas);" if has_gemm else ""}
{"    cublasSetStream(blas, st);" if has_gemm else ""}
#endif
    FILE *f = fopen(argv[1], "rb");
    if (!f) {{ perror(argv[1]); return 2; }}
    long long vt[{len(sizes)}];
    real *host = NULL;
    size_t most = 0;
    for (long b = 0; b < NB; b++) most = SIZE[b] > (long)most ? SIZE[b] : most;
    host = (real *)malloc(most * sizeof(real));
    for (long b = 0; b < NB; b++) {{
        buf[b] = (real *)dalloc(SIZE[b] * sizeof(real));
        if (fread(host, sizeof(real), SIZE[b], f) != (size_t)SIZE[b]) {{ fprintf(stderr, "short input\\n"); return 2; }}
        up(buf[b], host, SIZE[b] * sizeof(real));
        vt[b] = (long long)(size_t)buf[b];
    }}
    vt_d = (long long *)dalloc(sizeof vt);
    ctl_d = (double *)dalloc(8 * sizeof(double));
    up(vt_d, vt, sizeof vt);
    FILE *o = fopen(argv[2], "wb");
    double ctl[8];
    real loss;
    for (int e = 0; e < EPISODES; e++) {{
        for (int s = 0; s < NSLOT; s++) {{
            if (fread(host, sizeof(real), SIZE[SLOTS[s]], f) != (size_t)SIZE[SLOTS[s]]) return 2;
            up(buf[SLOTS[s]], host, SIZE[SLOTS[s]] * sizeof(real));
        }}
        if (fread(ctl, sizeof(double), 8, f) != 8) return 2;
        up(ctl_d, ctl, sizeof ctl);
        episode();
        down(&loss, buf[LOSS], sizeof(real));
        fwrite(&loss, sizeof(real), 1, o);
    }}
    for (int q = 0; q < NPARAM; q++) {{
        down(host, buf[PARAMS[q]], SIZE[PARAMS[q]] * sizeof(real));
        fwrite(host, sizeof(real), SIZE[PARAMS[q]], o);
    }}
    fclose(o);
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < REPS; r++) {{ up(ctl_d, ctl, sizeof ctl); episode(); }}
    sync();
    double launched = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / REPS;
    double graphed = -1;
#ifdef __CUDACC__
    if (!{int(has_gemm)}) {{
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
        episode();
        CHECK(cudaStreamEndCapture(st, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        CHECK(cudaGraphLaunch(ge, st));
        sync();
        t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < REPS; r++) {{ up(ctl_d, ctl, sizeof ctl); CHECK(cudaGraphLaunch(ge, st)); }}
        sync();
        graphed = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / REPS;
    }}
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s\\n", prop.name);
#else
    printf("device host-emulation\\n");
#endif
    printf("us_per_episode %.3f %.3f\\n", launched, graphed);
    return 0;
}}
"""


def write_inputs(path, cp, prog, slots, data, opt, real):
    """Initial buffers in table order, then per episode each slot's minibatch and the ctl scalars."""
    with open(path, "wb") as f:
        for kind, k in cp.buffers:
            a = (prog.val[k] if kind == "v" else prog.grad_buf(k) if kind == "g" else
                 np.zeros(cp.scratch_size) if kind == "S" else (prog.opt.mu if kind == "M" else prog.opt.nu)[k])
            np.ascontiguousarray(a, real).tofile(f)
        count = opt.count
        for batch in data:
            for arr in batch:
                np.ascontiguousarray(arr, real).tofile(f)
            count += 1
            ctl = np.zeros(8)
            sc = prog.opt.conf.step_scalars(count)
            ctl[:len(sc)] = sc
            ctl.tofile(f)


def build_and_run(name, sizes, rows, ordered, fuse, episodes, reps, work, nvcc, dry, arch, clip=None):
    tape, _, params, x, y, loss, opt, data = mlp(sizes, rows, ordered, episodes, clip=clip)
    prog = tg.capture(tape, loss)
    prog.attach(opt)
    cp = CudaProgram(prog, fuse)
    real = np.float32 if cp.f32 else np.float64
    src = work / f"{name}.cu"
    src.write_text((PRELUDE if dry else "") + cp.src + driver(cp, prog, [x.id, y.id], episodes, reps))
    write_inputs(work / f"{name}.in", cp, prog, [x.id, y.id], data, opt, real)
    exe = work / name
    if dry:
        cmd = ["g++", "-x", "c++", "-std=c++14", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
               "-Wno-unused-function", "-Wno-unused-parameter", str(src), "-o", str(exe), "-lm"]
    else:
        cmd = [nvcc, f"-arch={arch}", "-O3", "--fmad=false", "-std=c++14", str(src), "-o", str(exe), "-lcublas"]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"build of {name} failed:\n{r.stderr[-3000:]}")
    tb = time.time() - t
    r = subprocess.run([str(exe), str(work / f"{name}.in"), str(work / f"{name}.out")], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{name} failed (rc {r.returncode}): {r.stderr[-2000:]}")
    raw = np.fromfile(work / f"{name}.out", real)
    losses, pos, out = raw[:episodes], episodes, []
    for p in params:
        n = prog.val[p.id].size
        out.append(raw[pos:pos + n].reshape(prog.shapes[p.id]))
        pos += n
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    launched, graphed = map(float, lines["us_per_episode"].split())
    return dict(losses=losses, params=out, launches=cp.launches(), device=lines["device"], build_s=tb,
                us_launched=launched, us_graph=graphed if graphed >= 0 else None)


def jax_time(sizes, rows, reps):
    """µs per jax.jit(value_and_grad + optax.adam) step on jax's default device, or None without a GPU jax."""
    try:
        import jax
        import jax.numpy as jnp
        import optax
        if jax.default_backend() != "gpu":
            return None
    except Exception:
        return None
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    ps = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        ps += [jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i)), jnp.asarray(rng.standard_normal(o) * 0.1)]
    xb, yb = jnp.asarray(rng.standard_normal((rows, sizes[0]))), jnp.asarray(rng.standard_normal((rows, sizes[-1])))

    def loss(ps):
        h = xb
        for k in range(0, len(ps), 2):
            h = h @ ps[k] + ps[k + 1]
            if k + 2 < len(ps):
                h = jax.nn.relu(h)
        return jnp.mean((h - yb) ** 2)

    opt = optax.adam(1e-3)

    @jax.jit
    def step(ps, st):
        v, g = jax.value_and_grad(loss)(ps)
        u, st = opt.update(g, st, ps)
        return optax.apply_updates(ps, u), st, v

    st = opt.init(ps)
    ps, st, v = step(ps, st)
    v.block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        ps, st, v = step(ps, st)
    v.block_until_ready()
    return (time.perf_counter() - t) / reps * 1e6


def run(work, nvcc, dry, arch="sm_90", sizes=None, episodes=3):
    """Every claim for every size: (markdown lines, failures)."""
    work = pathlib.Path(work)
    names = sizes or (["tiny"] if dry else list(SIZES))
    rows_md = ["| MLP | ordered GPU == tape | fused == per-node | cuBLAS mode vs native (max rel) | launches fused / "
               "per-node | µs/episode per-node | fused | fused graph | jax.jit |", "|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for name in names:
        rows, sz = SIZES[name]
        reps = 2 if dry else max(20, min(2000, int(2e8 / (rows * sum(a * b for a, b in zip(sz, sz[1:]))))))
        want = cpu_reference(sz, rows, True, episodes, "tape")
        fused = build_and_run(f"{name}_of", sz, rows, True, True, episodes, reps, work, nvcc, dry, arch)
        pernode = build_and_run(f"{name}_on", sz, rows, True, False, episodes, reps, work, nvcc, dry, arch)
        try:
            blas = build_and_run(f"{name}_df", sz, rows, False, True, episodes, reps, work, nvcc, dry, arch)
        except RuntimeError as e:
            if "cublas" not in str(e).lower():
                raise
            blas = None
            print("gpu_programs: cuBLAS is not available to nvcc here; the default-order variant is skipped")
        native = cpu_reference(sz, rows, False, episodes, "native")
        eq_tape = (fused["losses"] == want[0]).all() and all((a == b).all() for a, b in zip(fused["params"], want[1]))
        eq_fuse = (fused["losses"] == pernode["losses"]).all() and \
            all((a == b).all() for a, b in zip(fused["params"], pernode["params"]))
        rel = 0.0 if blas is None else max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-300))) for a, b in
                                           zip([blas["losses"]] + blas["params"], [native[0]] + native[1]))
        jx = None if dry else jax_time(sz, rows, reps)
        for ok, what in ((eq_tape, "ordered GPU != tape"), (eq_fuse, "fused != per-node"), (rel < 1e-10, "cuBLAS mode bound")):
            if not ok:
                failures.append(f"{name}: {what}")
        fmt = lambda v: "–" if v is None else f"{v:,.1f}"   # noqa: E731
        rows_md.append(f"| {name} | {'==' if eq_tape else '**FAIL**'} | {'==' if eq_fuse else '**FAIL**'} | {'–' if blas is None else f'{rel:.1e}'} | "
                       f"{fused['launches']} / {pernode['launches']} | {fmt(pernode['us_launched'])} | "
                       f"{fmt(fused['us_launched'])} | {fmt(fused['us_graph'])} | {fmt(jx)} |")
        print(rows_md[-1], flush=True)
    # gradient clipping on the device: Σ g² serial per parameter there, a BLAS dot on the CPU (blas bound)
    rows, sz = SIZES[names[0]]
    clipped = build_and_run(f"{names[0]}_oc", sz, rows, True, True, episodes, 2, work, nvcc, dry, arch, clip=0.05)
    ref = cpu_reference(sz, rows, True, episodes, "native", clip=0.05)
    rel = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-300))) for a, b in
              zip([clipped["losses"]] + clipped["params"], [ref[0]] + ref[1]))
    if not rel < 1e-10:
        failures.append(f"{names[0]}: clipping on the device outside the blas bound")
    rows_md += ["", f"- {names[0]} MLP with Adam, global-norm clipping at 0.05: GPU vs native program, max rel "
                    f"{rel:.1e} ({'within' if rel < 1e-10 else '**OUTSIDE**'} the blas bound)"]
    return rows_md + ["", f"- device: {fused['device']}; µs are wall time per episode (minibatch + ctl upload and "
                          f"launches), {'host emulation: meaningless as speed' if dry else 'median of one run'}."], failures
