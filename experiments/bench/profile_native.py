"""Where a native program's episode spends its cycles: statement by statement of the generated C.

Captures one of ``bench_capture_jax.py``'s models (``interop.capture_jax`` of its loss, ``tg.Adam``
attached), prints the program's C again with a cycle counter (``rdtsc``) around every statement of
``tg_forward`` and ``tg_backward`` and around the optimizer step, builds it with the backend's compiler and
flags, runs episodes on the program's own buffers and prints the statements by cycles per episode with
the ops each one runs. ``--dump FILE`` writes the uninstrumented C (to read its assembly:
``gcc -O3 -march=native -ffp-contract=off -fno-math-errno -S``).

    python experiments/bench/profile_native.py "MLP 64" --dtype float32 --top 15
"""
import argparse
import ctypes
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def segments(em):
    """[(label, lines)] of the forward then the backward, one entry per statement the emitter prints."""
    p = em.p
    out = []
    for seg in em.segf:
        ew = len(seg) > 1 or p.nodes[seg[0]][0].kind == "elementwise"
        lines = em.ew_forward(seg) if ew else em.node_forward(seg[0])
        label = "fwd " + " ".join(f"{p.nodes[k][0].name}{list(p.shapes[k])}" if i == 0 else p.nodes[k][0].name
                                  for i, k in enumerate(seg))
        out.append(("forward", label, lines))
    for seg in em.segb:
        ew = len(seg) > 1 or p.nodes[seg[0][0]][0].kind == "elementwise"
        lines = em.ew_backward(seg) if ew else em.node_backward(seg[0])
        label = "bwd " + " ".join(f"{p.nodes[e[0]][0].name}{list(p.shapes[e[0]])}" if i == 0 else p.nodes[e[0]][0].name
                                  for i, e in enumerate(seg))
        out.append(("backward", label, lines))
    return out


def instrumented(runner):
    """(C source with a counter per statement, [labels]) for the program of ``runner``."""
    from tapegrad.native import codegen
    p = runner.p
    em = codegen.Emitter(p, runner.index, runner.fwd_segs, runner.bwd_segs, runner.blas[2],
                         small_mm=codegen_small(p), views=runner.views, registers=runner.registers)
    segs = segments(em)
    labels = [lab for _, lab, _ in segs] + ["optimizer step"]
    loss_n = int(np.prod(p.shapes[p.loss_id]))
    bodies = {"forward": [], "backward": [f"for (long i = 0; i < {loss_n}L; i++) g{p.loss_id}[i] = {em.d.lit(1.0)};"]}
    for i, (where, _, lines) in enumerate(segs):
        if lines:
            bodies[where] += ["{ unsigned long long tg_t0 = __rdtsc();"] + lines + \
                [f"tg_prof[{i}] += __rdtsc() - tg_t0; }}"]
    out = [codegen.prologue(p.dtype, runner.blas[2], codegen_small(p)), "#include <x86intrin.h>"]
    rank = max([len(sh) for sh in p.shapes] + [0])
    if rank > 8:
        out.append(f"#define TG_MAXD {rank}")
    out += [codegen.runtime_source(), f"unsigned long long tg_prof[{len(labels)}];"] + em.helpers
    out += em.function("tg_forward", bodies["forward"]) + em.function("tg_backward", bodies["backward"])
    out += ["void tg_episode(void *ctx)", "{", "    tg_forward(ctx);", "    tg_backward(ctx);",
            "    { unsigned long long tg_t0 = __rdtsc();", "    tg_opt_step((void **)ctx);",
            f"    tg_prof[{len(labels) - 1}] += __rdtsc() - tg_t0; }}", "}", ""]
    return "\n".join(out), labels


def codegen_small(p):
    from tapegrad.native.runner import small_gemm_limit
    return small_gemm_limit(p.dtype)


def program_of(name, dtype):
    import jax
    import jax.numpy as jnp
    import optax
    import bench_capture_jax as bench
    import interop
    import tapegrad as tg
    jax.config.update("jax_enable_x64", dtype == "float64")
    bench.DT.update(param_dtype=getattr(jnp, dtype), dtype=getattr(jnp, dtype))
    rng = np.random.default_rng(0)
    for mname, params, apply, x, y, _ in bench.models(rng, False, True):
        if re.search(name, mname):
            break
    else:
        raise SystemExit(f"no model matches {name!r}")
    x = jnp.asarray(x if x.dtype.kind in "iu" else x.astype(dtype))

    def loss(p, x_, y_):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x_), y_).mean()
    cap = interop.capture_jax(loss, params, x, jnp.asarray(y))
    opt = tg.Adam(1e-3)
    for var in cap.param_vars:
        opt.add(cap.tape, var)
    cap.program.attach(opt)
    cap.program.episode()
    return mname, cap.program


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a regular expression matching a model name of bench_capture_jax.py")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--dump", default=None, help="write the program's C to this file")
    args = ap.parse_args()
    from tapegrad.native import build
    mname, prog = program_of(args.model, args.dtype)
    runner = prog.runner
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(runner.source)
    src, labels = instrumented(runner)
    lib = build.load(build.build(src, name="tgprof"))
    prof = (ctypes.c_ulonglong * len(labels)).in_dll(lib, "tg_prof")
    run = lib.tg_episode
    run.argtypes = [ctypes.c_void_p]
    for _ in range(5):
        run(runner.ctx)
    # the fastest of ten batches, statement by statement: other processes on a shared machine inflate
    # some batches, rarely all ten
    batches = []
    for _ in range(10):
        for i in range(len(labels)):
            prof[i] = 0
        for _ in range(max(1, args.episodes // 10)):
            run(runner.ctx)
        batches.append(np.array(prof[:], np.float64) / max(1, args.episodes // 10))
    cyc = np.min(batches, axis=0)
    total = cyc.sum()
    print(f"{mname}, {args.dtype}: {total:,.0f} cycles per episode (rdtsc; each statement's fastest of 10 "
          f"batches of {max(1, args.episodes // 10)}), {len(labels) - 1} statements\n")
    print("| cycles | % | statement |")
    print("|---:|---:|---|")
    for i in np.argsort(-cyc)[:args.top]:
        print(f"| {cyc[i]:,.0f} | {100 * cyc[i] / total:.1f} | {labels[i][:150]} |")
    kinds = {}
    for lab, c in zip(labels, cyc):
        key = lab.split("[")[0].split()[-1] if lab.startswith(("fwd", "bwd")) else lab
        key = (lab[:3] + " " + key) if lab.startswith(("fwd", "bwd")) else key
        kinds[key] = kinds.get(key, 0.0) + c
    print("\n| by first op of the statement | cycles | % |")
    print("|---|---:|---:|")
    for k, c in sorted(kinds.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {k} | {c:,.0f} | {100 * c / total:.1f} |")


if __name__ == "__main__":
    main()
