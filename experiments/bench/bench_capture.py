"""Captured programs vs the eager tape vs jax.jit: µs per MLP training episode (forward + backward + Adam).

Every system runs in this one process, interleaved repeat by repeat (median), because the machine is
shared and absolute times drift: the ratios to jax.jit are the result. ``--quick`` for a smoke run
(tiny and small only, few repeats).
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from bench_eager import numpy_step, side_by_side, tape_step  # noqa: E402
from mlp import blas_kernel, cpu_model, data, init, jax_loss, tape_loss  # noqa: E402

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10)),
         "medium": (256, (784, 512, 512, 10)), "large": (1024, (1024, 2048, 2048, 1024))}
LR = 1e-3


def program_step(batch, sizes, backend, fuse=True):
    """One Program.episode per call: inputs copied in, forward + backward + Adam in one backend call."""
    x_np, y_np = data(batch, sizes)
    tape = tg.Tape()
    params = [tape.param(p) for p in init(sizes)]
    opt = tg.Adam(LR)
    for p in params:
        opt.add(tape, p)
    tape.mark()
    x, y = tape.const(x_np), tape.const(y_np)
    prog = tg.capture(tape, tape_loss(tape, params, x, y), backend=backend, fuse=fuse)
    prog.attach(opt)
    feed = {x: x_np, y: y_np}
    return lambda: prog.episode(feed), prog


def jax_step(batch, sizes):
    import jax
    import jax.numpy as jnp
    import optax
    jax.config.update("jax_enable_x64", True)
    x, y = (jnp.asarray(a) for a in data(batch, sizes))
    params = [jnp.asarray(p) for p in init(sizes)]
    tx = optax.adam(LR)
    state = [params, tx.init(params)]

    @jax.jit
    def step(ps, st, x, y):
        val, g = jax.value_and_grad(jax_loss)(ps, x, y)
        upd, st = tx.update(g, st, ps)
        return optax.apply_updates(ps, upd), st, val

    def run():
        ps, st, val = step(state[0], state[1], x, y)
        val.block_until_ready()
        state[0], state[1] = ps, st
    return run


def flops(batch, sizes):
    """GEMM flops of one episode: forward, dW per layer, dX for every layer but the first."""
    mm = [2 * batch * i * o for i, o in zip(sizes[:-1], sizes[1:])]
    return sum(mm) * 3 - mm[0]


def products_step(batch, sizes):
    """The episode's products alone, in NumPy (the BLAS every system here calls), into kept buffers:
    forward X·W per layer, then per layer from the last dW = Hᵀ·G and, but for the first, G·Wᵀ. No
    episode can reach more GFLOP/s than these."""
    rng = np.random.default_rng(0)
    hs = [rng.standard_normal((batch, n)) for n in sizes]
    ws = [rng.standard_normal((i, o)) for i, o in zip(sizes[:-1], sizes[1:])]
    dws = [np.empty_like(w) for w in ws]

    def step():
        for k, w in enumerate(ws):
            np.matmul(hs[k], w, out=hs[k + 1])
        for k in reversed(range(len(ws))):
            np.matmul(hs[k].T, hs[k + 1], out=dws[k])
            if k:
                np.matmul(hs[k + 1], ws[k].T, out=hs[k])
    return step


def matmul_peak(n=2048, reps=5):
    a = np.random.default_rng(0).standard_normal((n, n))
    a @ a
    best = min(_time(lambda: a @ a) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def _time(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def chain_program(shape, libm, fuse):
    """An elementwise chain (12 nodes + mean): arithmetic only, or with tanh/sigmoid/exp in it."""
    rng = np.random.default_rng(1)
    tape = tg.Tape()
    a, c = tape.param(rng.standard_normal(shape)), tape.param(rng.uniform(0.5, 2.0, shape))
    b = tape.param(rng.standard_normal(shape[1:]))
    if libm:
        t = (a * c + b).tanh()
        u = (t * c - a).sigmoid() / c
        v = (u * t).exp() + (c - t) * 2.0
    else:
        t = (a * c + b).relu()
        u = (t * c - a) / c
        v = (u * t) + (c - t) * 2.0
    prog = tg.capture(tape, (v * v).mean(), backend="native", fuse=fuse)
    r = prog.runner
    return lambda: (r.fns["forward"](r.ctx), r.fns["backward"](r.ctx))


def fusion_table(reps, inner):
    """Why the planner fuses arithmetic but never a libm call: the same chains three ways."""
    print()
    print("Fusion on the CPU: µs per forward + backward of a 12-node elementwise chain (+ mean), float64")
    print()
    print("| chain | shape | unfused | fused (policy: no libm in a run) | fused including libm calls |")
    print("|---|---|---:|---:|---:|")
    for libm in (False, True):
        for shape in ((64, 64), (512, 512), (2048, 1024)):
            fns = {f: chain_program(shape, libm, f) for f in (False, True, "libm")}
            t = side_by_side(fns, reps, max(1, inner * 4096 // (shape[0] * shape[1])))
            name = "with tanh, sigmoid, exp" if libm else "arithmetic + relu"
            print(f"| {name} | {shape[0]}×{shape[1]} | {t[False]:,.0f} | {t[True]:,.0f} ({t[False] / t[True]:.2f}×) | "
                  f"{t['libm']:,.0f} ({t[False] / t['libm']:.2f}×) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    names = ("tiny", "small") if args.quick else tuple(SIZES)
    print(f"CPU: {cpu_model()}, BLAS: {blas_kernel()}\n")
    rows = []
    for name in names:
        batch, sizes = SIZES[name]
        reps, inner = {"tiny": (15, 200), "small": (15, 50), "medium": (9, 3), "large": (5, 1)}[name]
        if args.quick:
            reps, inner = 3, max(inner // 10, 1)
        fns = {"eager tape": tape_step(batch, sizes),
               "numpy replay": program_step(batch, sizes, "numpy")[0],
               "native unfused": program_step(batch, sizes, "native", fuse=False)[0]}
        fused, prog = program_step(batch, sizes, "native", fuse=True)
        fns["native fused"] = fused
        fns["jax.jit"] = jax_step(batch, sizes)
        fns["NumPy floor"] = numpy_step(batch, sizes)
        fns["products alone"] = products_step(batch, sizes)
        t = side_by_side(fns, reps, inner)
        rows.append((name, batch, sizes, t, prog.plan()))
        print(f"  {name}: " + ", ".join(f"{k} {v:,.0f} µs" for k, v in t.items()), flush=True)
    peak = None if args.quick else matmul_peak()
    cols = ["eager tape", "numpy replay", "native unfused", "native fused", "jax.jit", "NumPy floor"]
    print()
    print("µs per training episode (forward + backward + Adam, float64), median of interleaved repeats; "
          "(×) = speed-up over jax.jit")
    print()
    print("| size | " + " | ".join(cols) + " | fused kernels (fwd/bwd) |")
    print("|---|" + "---:|" * len(cols) + "---|")
    for name, batch, sizes, t, plan in rows:
        jx = t["jax.jit"]
        cells = [f"{t[c]:,.0f} ({jx / t[c]:.2f}×)" if c != "jax.jit" else f"{jx:,.0f}" for c in cols]
        kern = (f"{plan['kernels_forward_unfused']}→{plan['kernels_forward']} / "
                f"{plan['kernels_backward_unfused']}→{plan['kernels_backward']}")
        print(f"| {name} ({batch}; {'-'.join(map(str, sizes))}) | " + " | ".join(cells) + f" | {kern} |")
    if peak:
        print()
        print(f"GFLOP/s (GEMM flops / episode time); NumPy 2048² matmul peak here: {peak:.1f} GFLOP/s; "
              f"products alone: the episode's GEMMs and nothing else, in NumPy")
        print()
        gcols = cols + ["products alone"]
        print("| size | " + " | ".join(gcols) + " |")
        print("|---|" + "---:|" * len(gcols))
        for name, batch, sizes, t, _ in rows:
            if name in ("medium", "large"):
                f = flops(batch, sizes)
                print(f"| {name} | " + " | ".join(f"{f / t[c] / 1e3:.1f} ({f / t[c] / 1e3 / peak:.0%})"
                                                  for c in gcols) + " |")
    fusion_table(3 if args.quick else 7, 20)
    update_table(names, args.quick)


def update_table(names, quick):
    """The optimizer step alone (Adam), on one thread and split over the cores by the native runner's
    own threads (forced here at every size, so both sides of its SPLIT_UPDATES threshold show)."""
    from tapegrad.native.runner import SPLIT_UPDATES, update_parts
    print()
    print(f"Adam step alone in a native program, µs per call: one thread, and split into {update_parts()} "
          f"ranges on threads the program starts (the runner splits from {SPLIT_UPDATES:,} parameters)")
    print()
    print("| size | parameters | one thread | split | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        batch, sizes = SIZES[name]
        prog = program_step(batch, sizes, "native")[1]
        r = prog.runner
        split = r.lib.tg_threads_team(update_parts(), 1)
        n = sum(a * b + b for a, b in zip(sizes, sizes[1:]))

        def with_team(team):
            def step():
                if r.table[6] != team:
                    r.team = team
                    r._fill_table()
                r.step()
            return step
        reps, inner = (3, 5) if quick else {"tiny": (9, 200), "small": (9, 50), "medium": (9, 10), "large": (5, 2)}[name]
        t = side_by_side({"one": with_team(0), "split": with_team(split)}, reps, inner)
        r.lib.tg_threads_team(update_parts(), SPLIT_UPDATES)
        print(f"| {name} | {n:,} | {t['one']:,.1f} | {t['split']:,.1f} | {t['one'] / t['split']:.2f}× |")


if __name__ == "__main__":
    main()
