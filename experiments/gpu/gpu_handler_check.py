"""The GPU custom call's C handler (``interop/xla/tg_gpu.c``) on a real device, without XLA: part of ``gpu_check.py``.

An nvcc-built executable plays XLA's part: it builds the tiny ordered fused MLP program (its CUDA source,
its buffers, its episode captured as a CUDA graph with the runtime API), allocates separate "XLA" buffers
for the custom call's operands, and calls ``tg_gpu_episode`` (built by gcc from the handler source, as
``interop`` builds it) through a call frame shaped like XLA's (``tests/gpu_fake/fake_frame.c``) on its
own stream. So the handler resolves the real driver with ``cuGetProcAddress``, reads the count, uploads
the step scalars, points the table at the "XLA" buffers with ``settab``, replays the graph and points
the table back. Claims: the losses and parameters after the episodes == the ordered CPU tape, the
table is restored, and µs per call beside the bare graph replay. Needs jax's ``xla/ffi/api/c_api.h``
(from an installed jax, or ``--ffi-include``) and gcc; ``--dry`` builds everything without running it.
"""
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

import tapegrad as tg
from tapegrad.gpu.source import CudaProgram
from tapegrad.native import build as native_build

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "gpu"))
import gpu_programs as GP  # noqa: E402  (the MLP, its CPU reference and the program driver's helpers)


def ffi_header(include=None):
    """Path of xla/ffi/api/c_api.h: under ``include``, else from the installed jax; None if neither."""
    if include is None:
        try:
            import jax.ffi
            include = jax.ffi.include_dir()
        except Exception:
            return None
    path = pathlib.Path(include) / "xla" / "ffi" / "api" / "c_api.h"
    return path if path.is_file() else None


def build_libraries(work, header):
    """handler.so (c_api.h + ffi_compat.h + step_scalars.c + tg_xla.c + tg_gpu.c, the native build's flags, -Werror) and
    frame.so (the XLA-shaped call frame); returns their paths."""
    parts = [header, ROOT / "interop" / "xla" / "ffi_compat.h", ROOT / "tapegrad" / "native" / "step_scalars.c",
             ROOT / "interop" / "xla" / "tg_xla.c", ROOT / "interop" / "xla" / "tg_gpu.c"]
    (work / "handler.c").write_text("\n".join(p.read_text() for p in parts))
    frame = [header, ROOT / "interop" / "xla" / "ffi_compat.h", ROOT / "tests" / "gpu_fake" / "fake_frame.c"]
    (work / "frame.c").write_text("\n".join(p.read_text() for p in frame))
    cc = native_build.find_compiler()
    jobs = [[cc, *native_build.FLAGS, "-Werror", str(work / "handler.c"), "-o", str(work / "handler.so"), "-lm",
             "-ldl", "-lpthread"],
            [cc, "-O1", "-fPIC", "-shared", "-std=c11", "-Wall", "-Wextra", "-Werror", str(work / "frame.c"), "-o",
             str(work / "frame.so")]]
    for cmd in jobs:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n{r.stderr[-3000:]}")
    return work / "handler.so", work / "frame.so"


def driver(cp, prog, episodes, reps):
    """``main``: program buffers and the "XLA" operands from argv[1], results to argv[2], the handler and
    frame libraries from argv[3] and argv[4]."""
    sizes = [prog.val[k].size if kind == "v" else (prog.grad_buf(k).size if kind == "g" else
             (cp.scratch_size if kind == "S" else prog.opt.mu[k].size)) for kind, k in cp.buffers]
    slots, loss_slot = cp.operand_slots()
    sig_params = [prog.val[k].size for k in prog.params]
    state = [prog.val[k].size for k in prog.opt.ids for _ in (0, 1)]
    inputs = [prog.val[k].size for k in prog.consts]
    ops = sig_params + state + [1] + inputs
    nw = len(sig_params) + len(state)
    c = prog.opt.conf
    real = "float" if cp.f32 else "double"
    arr = lambda xs: ", ".join(map(str, xs))   # noqa: E731
    return f"""
#include <chrono>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define CHECK(x) do {{ cudaError_t e_ = (x); if (e_ != cudaSuccess) {{ fprintf(stderr, "%s: %s\\n", #x, cudaGetErrorString(e_)); exit(3); }} }} while (0)
typedef int (*frame_call_t)(void *, int64_t, void **, const int64_t *, int64_t, void **, const int64_t *, int, int64_t,
                            const char **, const int *, void **, const int64_t *, void *, int, char *, int64_t);
static const long NB = {len(sizes)}, SIZE[] = {{{arr(sizes)}}};
static const int NOPS = {len(ops)}, NW = {nw}, EPISODES = {episodes}, REPS = {reps};
static const int64_t OPSIZE[] = {{{arr(ops)}}};
static int64_t SLOTS[] = {{{arr(slots)}}};
static cudaStream_t st;
static long long *vt_d;
static double *ctl_d;
static {real} *buf[{len(sizes)}];
static void *dalloc(size_t n) {{ void *p; CHECK(cudaMalloc(&p, n)); CHECK(cudaMemset(p, 0, n)); return p; }}
static void up(void *d, const void *h, size_t n) {{ CHECK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, st)); CHECK(cudaStreamSynchronize(st)); }}
static void down(void *h, const void *d, size_t n) {{ CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, st)); CHECK(cudaStreamSynchronize(st)); }}
#define LAUNCH(fn, gx, gy, bx, ph) fn<<<dim3(gx, gy), bx, 0, st>>>(vt_d, ctl_d)
static void episode(void)
{{
{chr(10).join(f"    LAUNCH({L.name}, {L.grid[0]}, {L.grid[1]}, {L.block}, {L.phases});" for L in cp.forward + cp.backward + cp.step)}
}}
static void *sym(void *lib, const char *name) {{ void *p = dlsym(lib, name); if (!p) {{ fprintf(stderr, "no %s\\n", name); exit(4); }} return p; }}
static void readn(FILE *f, void *h, size_t n) {{ if (fread(h, 1, n, f) != n) {{ fprintf(stderr, "short input\\n"); exit(2); }} }}
int main(int argc, char **argv)
{{
    if (argc < 5) {{ fprintf(stderr, "usage: %s in out handler.so frame.so\\n", argv[0]); return 2; }}
    void *hl = dlopen(argv[3], RTLD_NOW), *fl = dlopen(argv[4], RTLD_NOW);
    if (!hl || !fl) {{ fprintf(stderr, "dlopen: %s\\n", dlerror()); return 4; }}
    void *handler = sym(hl, "tg_gpu_episode");
    frame_call_t frame_call = (frame_call_t)sym(fl, "frame_call");
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    FILE *f = fopen(argv[1], "rb");
    if (!f) {{ perror(argv[1]); return 2; }}
    long long vt[{len(sizes)}];
    size_t most = 1;
    for (long b = 0; b < NB; b++) most = SIZE[b] > (long)most ? SIZE[b] : most;
    {real} *host = ({real} *)malloc(most * sizeof({real}));
    for (long b = 0; b < NB; b++) {{
        buf[b] = ({real} *)dalloc(SIZE[b] * sizeof({real}));
        readn(f, host, SIZE[b] * sizeof({real}));
        up(buf[b], host, SIZE[b] * sizeof({real}));
        vt[b] = (long long)(size_t)buf[b];
    }}
    vt_d = (long long *)dalloc(sizeof vt);
    ctl_d = (double *)dalloc(8 * sizeof(double));
    up(vt_d, vt, sizeof vt);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    episode();
    CHECK(cudaStreamEndCapture(st, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    cudaFunction_t settab;
    CHECK(cudaGetFuncBySymbol(&settab, (const void *){cp.settab}));
    /* XLA's side: its own buffers for the operands (written ones aliased to their results) and the loss */
    void *args[NOPS], *rets[NW + 2];
    for (int k = 0; k < NOPS; k++) args[k] = dalloc(OPSIZE[k] * sizeof({real}));
    for (int k = 0; k <= NW; k++) {{ readn(f, host, OPSIZE[k] * sizeof({real})); up(args[k], host, OPSIZE[k] * sizeof({real})); }}
    rets[0] = dalloc(sizeof({real}));
    for (int k = 0; k <= NW; k++) rets[1 + k] = args[k];
    int64_t RETSIZE[NW + 2];
    RETSIZE[0] = 1;
    for (int k = 0; k <= NW; k++) RETSIZE[1 + k] = OPSIZE[k];
    int64_t home[NOPS];
    for (int k = 0; k < NOPS; k++) home[k] = SLOTS[k] >= 0 ? vt[SLOTS[k]] : 0;
    int64_t graph = (int64_t)(intptr_t)ge, fn = (int64_t)(intptr_t)settab, table = (int64_t)(intptr_t)vt_d,
            table_len = NB, ctl = (int64_t)(intptr_t)ctl_d, loss_slot = {loss_slot}, loss_home = vt[{loss_slot}],
            device = 0, opt = {2 if prog.opt.kind == "Adam" else 1}, hat = {int(prog.opt.kind == "Adam" and c.eps_mode == "hat")};
    double lr = {float(c.lr)!r}, b1 = {float(getattr(c, "b1", 0.0))!r}, b2 = {float(getattr(c, "b2", 0.0))!r};
    const char *names[] = {{"graph", "settab", "table", "table_len", "ctl", "loss_slot", "loss_home", "device", "opt",
                           "hat", "lr", "b1", "b2", "slots", "home"}};
    int kinds[] = {{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2}};
    void *values[] = {{&graph, &fn, &table, &table_len, &ctl, &loss_slot, &loss_home, &device, &opt, &hat, &lr, &b1, &b2,
                       SLOTS, home}};
    int64_t asz[] = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, NOPS, NOPS}};
    char msg[4096];
    FILE *o = fopen(argv[2], "wb");
    {real} loss;
    for (int e = 0; e < EPISODES; e++) {{
        for (int k = NW + 1; k < NOPS; k++) {{ readn(f, host, OPSIZE[k] * sizeof({real})); up(args[k], host, OPSIZE[k] * sizeof({real})); }}
        if (frame_call(handler, NOPS, args, OPSIZE, NW + 2, rets, RETSIZE, {11 if cp.f32 else 12}, 15, names, kinds,
                       values, asz, (void *)st, 0, msg, sizeof msg)) {{ fprintf(stderr, "handler: %s\\n", msg); return 5; }}
        down(&loss, rets[0], sizeof loss);
        fwrite(&loss, sizeof loss, 1, o);
    }}
    for (int k = 0; k <= NW; k++) {{ down(host, args[k], OPSIZE[k] * sizeof({real})); fwrite(host, sizeof({real}), OPSIZE[k], o); }}
    fclose(o);
    long long back[{len(sizes)}];
    down(back, vt_d, sizeof back);
    printf("restored %d\\n", memcmp(back, vt, sizeof vt) == 0);
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < REPS; r++)
        if (frame_call(handler, NOPS, args, OPSIZE, NW + 2, rets, RETSIZE, {11 if cp.f32 else 12}, 15, names, kinds,
                       values, asz, (void *)st, 0, msg, sizeof msg)) {{ fprintf(stderr, "handler: %s\\n", msg); return 5; }}
    CHECK(cudaStreamSynchronize(st));
    double per_call = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / REPS;
    double c8[8] = {{0}};
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < REPS; r++) {{ CHECK(cudaMemcpyAsync(ctl_d, c8, sizeof c8, cudaMemcpyHostToDevice, st)); CHECK(cudaGraphLaunch(ge, st)); }}
    CHECK(cudaStreamSynchronize(st));
    double replay = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / REPS;
    printf("us %.3f %.3f\\n", per_call, replay);
    return 0;
}}
"""


def write_inputs(path, cp, prog, data, real):
    """The program's buffers in table order, the written operands' and count's start, each episode's inputs."""
    with open(path, "wb") as f:
        for kind, k in cp.buffers:
            a = (prog.val[k] if kind == "v" else prog.grad_buf(k) if kind == "g" else
                 np.zeros(cp.scratch_size) if kind == "S" else (prog.opt.mu if kind == "M" else prog.opt.nu)[k])
            np.ascontiguousarray(a, real).tofile(f)
        for k in prog.params:
            np.ascontiguousarray(prog.val[k], real).tofile(f)
        for k in prog.opt.ids:
            np.zeros(2 * prog.val[k].size, real).tofile(f)
        np.zeros(1, real).tofile(f)
        for batch in data:
            for arr in batch:
                np.ascontiguousarray(arr, real).tofile(f)


def run(work, nvcc, dry, arch="sm_90", ffi_include=None, episodes=3):
    """(markdown lines, failures) of the handler check on the tiny ordered fused MLP."""
    work = pathlib.Path(work)
    work.mkdir(parents=True, exist_ok=True)
    header = ffi_header(ffi_include)
    head = ["", "## the GPU custom call's handler (tg_gpu_episode) on the device, XLA played by a driver", ""]
    if header is None:
        return head + ["- skipped: needs jax's xla/ffi/api/c_api.h (an installed jax, or --ffi-include DIR)"], []
    try:
        native_build.find_compiler()
    except tg.BuildError:
        nvcc = None
    if nvcc is None:
        return head + ["- skipped: needs nvcc and a C compiler"], []
    t = time.time()
    handler, frame = build_libraries(work, header)
    rows, sz = GP.SIZES["tiny"]
    tape, _, params, x, y, loss, opt, data = GP.mlp(sz, rows, True, episodes)
    prog = tg.capture(tape, loss)
    prog.attach(opt)
    assert [x.id, y.id] == list(prog.consts), "the inputs are the program's consts in order"
    cp = CudaProgram(prog, True)
    real = np.float32 if cp.f32 else np.float64
    reps = 2 if dry else 500
    src = work / "handler_tiny.cu"
    src.write_text(cp.src + driver(cp, prog, episodes, reps))
    write_inputs(work / "handler_tiny.in", cp, prog, data, real)
    exe = work / "handler_tiny"
    r = subprocess.run([nvcc, f"-arch={arch}", "-O3", "--fmad=false", "-std=c++14", "-Werror", "all-warnings", str(src),
                        "-o", str(exe), "-ldl"], capture_output=True, text=True)
    if r.returncode:
        return head + [f"- the driver did not build: {r.stderr[-1500:]}"], ["handler driver build"]
    if dry:
        return head + [f"- built handler.so and frame.so (gcc -Werror) and the nvcc driver of the tiny ordered fused "
                       f"program ({time.time() - t:.1f}s); not run: no GPU (dry run)"], []
    env = dict(os.environ)
    r = subprocess.run([str(exe), str(work / "handler_tiny.in"), str(work / "handler_tiny.out"), str(handler),
                        str(frame)], capture_output=True, text=True, env=env)
    if r.returncode:
        return head + [f"- the driver failed (rc {r.returncode}): {r.stderr[-1500:]}"], ["handler run"]
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    raw = np.fromfile(work / "handler_tiny.out", real)
    losses, pos, got = raw[:episodes], episodes, []
    for k in prog.params:
        n = prog.val[k].size
        got.append(raw[pos:pos + n].reshape(prog.shapes[k]))
        pos += n
    want_losses, want_params = GP.cpu_reference(sz, rows, True, episodes, "tape")
    by_id = {p.id: w for p, w in zip(params, want_params)}
    eq = (losses == want_losses).all() and all((g == by_id[k]).all() for g, k in zip(got, prog.params))
    count = raw[pos + sum(2 * prog.val[k].size for k in prog.opt.ids)]
    restored = lines.get("restored") == "1"
    per_call, replay = map(float, lines["us"].split())
    failures = [w for ok, w in ((eq, "handler episodes != tape"), (restored, "table not restored"),
                                (count == episodes, "count not advanced")) if not ok]
    return head + ["| episodes through tg_gpu_episode == ordered tape | table restored | count | µs per call | "
                   "µs bare graph replay |", "|---|---|---|---|---|",
                   f"| {'==' if eq else '**FAIL**'} | {'yes' if restored else '**NO**'} | {count:g} | {per_call:,.1f} | "
                   f"{replay:,.1f} |", "",
                   f"- per call: the count read (a copy and a stream synchronisation), ctl and count uploads, two "
                   f"settab launches and the graph; {time.time() - t:.1f}s in all"], failures
