"""Benchmark (not a test): tapegrad programs inside jax.jit, against plain JAX.

1. Per-call overhead inside ``jax.jit`` of one loss + gradient evaluation of an MLP (tiny: batch 32,
   16-32-32-4; small: batch 64, 64-128-128-10): the captured native program as an XLA FFI custom call
   (``program_call``), the same program through ``jax.pure_callback`` (copies), through the zero-copy
   ``buffer_callback`` (``program_call(native=False)``), and the same loss written in jax.numpy.
2. A full training step (forward + backward + Adam) per jitted call, tiny to large: ``program_episode``
   (one custom call, donated in-place state) vs ``jax.jit(value_and_grad + optax.adam)`` (and, at
   tiny/small, a pure_callback-based step).
3. The same step as the body of one jitted ``lax.scan`` over many steps, where JAX users put a training
   loop (no per-step dispatch): ``program_episode`` vs plain JAX + optax in the same scan.

All systems run in this one process, interleaved repeat by repeat (median): the ratios are the
result. ``--quick`` for a smoke run, ``--sizes tiny,medium`` for a subset, ``--blas-threads 1`` to pin
BLAS (threadpoolctl). Run: ``.venv/bin/python experiments/bench/bench_interop.py``.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import interop  # noqa: E402
import tapegrad as tg  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from interop import jax, jnp  # noqa: E402
from interop.xla import program as P  # noqa: E402
from interop.xla.callback import copying_call  # noqa: E402
from mlp import blas_kernel, cpu_model, init, jax_loss, tape_loss  # noqa: E402

jax.config.update("jax_enable_x64", True)   # the programs compute in float64

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10)),
         "medium": (256, (784, 512, 512, 10)), "large": (1024, (1024, 2048, 2048, 1024))}


def setup(name, backend="native"):
    batch, sizes = SIZES[name]
    rng = np.random.default_rng(0)
    ps = init(sizes)
    xb = rng.standard_normal((batch, sizes[0]))
    yb = np.eye(sizes[-1])[rng.integers(0, sizes[-1], batch)]
    tape = tg.Tape()
    params = [tape.param(p) for p in ps]
    opt = tg.Adam(1e-3)
    for p in params:
        opt.add(tape, p)
    prog = tg.capture(tape, tape_loss(tape, params, xb, yb), backend=backend)
    prog.attach(opt)
    return prog, ps, xb, yb


def pure_callback_call(prog):
    """program_call's contract through jax.pure_callback (for the comparison only)."""
    sig = P._Sig(prog)

    @jax.custom_vjp
    def f(*xs):
        return copying_call(P._host_value(prog, False), [jax.ShapeDtypeStruct((), sig.dtype)], *xs)[0]

    def fwd(*xs):
        specs = [jax.ShapeDtypeStruct((), sig.dtype)] + [jax.ShapeDtypeStruct(s, sig.dtype) for s in sig.params]
        loss, *g = copying_call(P._host_value(prog, True), specs, *xs)
        return loss, tuple(g)

    f.defvjp(fwd, lambda g, ct: tuple(ct * x for x in g) + (None, None))
    return f


def pure_callback_episode(prog):
    """program_episode(flat=True)'s contract through jax.pure_callback."""
    sig = P._Sig(prog)
    total = sum(P._flat_sizes(prog))

    def step(state, inputs):
        specs = [jax.ShapeDtypeStruct((), sig.dtype), jax.ShapeDtypeStruct((total,), sig.dtype)]
        return tuple(copying_call(P._host_episode(prog, flat=True), specs, state, *inputs))
    return step


def calls(name):
    prog, ps, xb, yb = setup(name)
    args = [jnp.asarray(p) for p in ps] + [jnp.asarray(xb), jnp.asarray(yb)]
    n = len(ps)
    argnums = tuple(range(n))
    fns = {
        "FFI program call": interop.program_call(prog),
        "pure_callback": pure_callback_call(prog),
        "zero-copy buffer_callback": interop.program_call(prog, native=False),
        "plain JAX (jnp)": lambda *xs: jax_loss(list(xs[:n]), xs[n], xs[n + 1]),
    }
    runs = {}
    for lab, f in fns.items():
        g = jax.jit(jax.value_and_grad(f, argnums))
        runs[lab] = lambda g=g: jax.block_until_ready(g(*args))
    inner = 100 if name == "tiny" else 20
    # the systems that run the program outside the FFI handler (OpenBLAS with its own threads) go in a
    # second group: the threads they leave spinning would slow whichever system is timed next
    first = side_by_side({k: runs[k] for k in ("FFI program call", "plain JAX (jnp)")}, 11, inner)
    rest = side_by_side({k: runs[k] for k in ("pure_callback", "zero-copy buffer_callback")}
                        | {"floor": lambda: (prog.runner.forward(), prog.runner.backward())}, 11, inner)
    out = {k: (first | rest)[k] for k in fns}
    return out, rest["floor"]


def step_fns(name):
    """One training step per jitted call: the episode custom call (flat and separate state) vs plain JAX."""
    import optax
    prog, ps, xb, yb = setup(name)
    x, y = jnp.asarray(xb), jnp.asarray(yb)
    ep = jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
    st = [interop.episode_state(prog)]

    def run_ep():
        loss, *s = ep(*st[0], (x, y))
        st[0] = s
        loss.block_until_ready()

    eppos = jax.jit(interop.program_episode(prog).positional, donate_argnums=(0, 1, 2))
    sp0 = interop.episode_state(prog)
    stp = [(tuple(sp0[0][n] for n in prog.param_names), tuple(a for pair in zip(sp0[1].mu.values(), sp0[1].nu.values())
                                                           for a in pair), sp0[1].count.astype(prog.dtype))]

    def run_eppos():
        loss, *s = eppos(*stp[0], (x, y))
        stp[0] = s
        loss.block_until_ready()

    epf = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
    stf = [interop.episode_state(prog, flat=True)]

    def run_epf():
        loss, stf[0] = epf(stf[0], (x, y))
        loss.block_until_ready()

    tx = optax.adam(1e-3)

    @jax.jit
    def jstep(params, opt_state, xb, yb):
        loss, g = jax.value_and_grad(jax_loss)(params, xb, yb)
        u, opt_state = tx.update(g, opt_state, params)
        return loss, optax.apply_updates(params, u), opt_state

    jp = [[jnp.asarray(p) for p in ps]]
    jo = [tx.init(jp[0])]

    def run_j():
        loss, jp[0], jo[0] = jstep(jp[0], jo[0], x, y)
        loss.block_until_ready()

    fns = {"program_episode in jit (FFI, flat state)": run_epf,
           "program_episode in jit (FFI, named state, one operand per array)": run_ep,
           "program_episode in jit (FFI, positional tuples, one operand per array)": run_eppos,
           "jax.jit(value_and_grad + optax.adam)": run_j}
    if name in ("tiny", "small"):
        pc = jax.jit(pure_callback_episode(prog))
        sp = [interop.episode_state(prog, flat=True)]

        def run_pc():
            loss, sp[0] = pc(sp[0], (x, y))
            loss.block_until_ready()
        fns["pure_callback episode in jit"] = run_pc
    fns["native episode, no JAX (floor)"] = prog.runner.episode
    return fns


def scan_fns(name, steps):
    """``steps`` training steps inside one jitted ``lax.scan`` (no per-step dispatch): the episode
    custom call as the scan body vs the same loop in plain JAX + optax. Each call runs the scan once."""
    import optax
    prog, ps, xb, yb = setup(name)
    x, y = jnp.asarray(xb), jnp.asarray(yb)
    ep = interop.program_episode(prog, flat=True)

    def ep_loop(s, x, y):
        return jax.lax.scan(lambda s, _: ep(s, (x, y))[::-1], s, None, length=steps)

    ep_run = jax.jit(ep_loop, donate_argnums=0)
    st = [interop.episode_state(prog, flat=True)]

    def run_ep():
        st[0], losses = ep_run(st[0], x, y)
        losses.block_until_ready()

    def updates_split_from(n):   # reloads the handler's entry when the other row ran last
        def run():
            if loaded[0] != n:
                P.SPLIT_UPDATES, loaded[0] = n, n
                P.load(prog)
            run_ep()
        return run
    loaded = [P.SPLIT_UPDATES]
    split = P.SPLIT_UPDATES
    tx = optax.adam(1e-3)

    def body(carry, _):
        params, opt_state = carry
        loss, g = jax.value_and_grad(jax_loss)(params, x, y)
        u, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, u), opt_state), loss

    j_run = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps), donate_argnums=0)
    jc = [([jnp.asarray(p) for p in ps], None)]
    jc[0] = (jc[0][0], tx.init(jc[0][0]))

    def run_j():
        jc[0], losses = j_run(jc[0])
        losses.block_until_ready()
    fns = {"program_episode in lax.scan": updates_split_from(split), "plain JAX + optax in lax.scan": run_j}
    if sum(p.size for p in ps) >= split:
        fns["program_episode in lax.scan, Adam on one thread"] = updates_split_from(0)
    return fns


def header():
    return (f"jax {jax.__version__}, float64, CPU: {cpu_model()}, BLAS: {blas_kernel()}; µs (median of "
            f"interleaved repeats)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny and small only, few repeats")
    ap.add_argument("--sizes", default=None, help="comma-separated subset of " + ",".join(SIZES))
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="limit BLAS to this many threads (threadpoolctl); default: the process's setting")
    args = ap.parse_args()
    if args.blas_threads:
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.blas_threads, "blas")
    if P.native_library() is None:
        raise SystemExit("bench_interop: needs a C compiler for the FFI handler")
    names = args.sizes.split(",") if args.sizes else ["tiny", "small"] if args.quick else list(SIZES)
    print(header() + "\n")
    small = [n for n in names if n in ("tiny", "small")]
    if small:
        res = {n: calls(n) for n in small}
        print("| loss + grad inside jax.jit, µs per call | " + " | ".join(label(n) for n in small) + " |")
        print("|---|" + "---:|" * len(small))
        for lab in res[small[0]][0]:
            print(f"| {lab} | " + " | ".join(f"{res[n][0][lab]:,.0f}" for n in small) + " |")
        print("| native forward+backward, no JAX (floor) | " + " | ".join(f"{res[n][1]:,.0f}" for n in small) + " |")
    st, sc = {}, {}
    for n in names:
        reps, inner, steps = ((3, 20, 50) if args.quick else (11, 100, 200)) if n == "tiny" else \
            ((3, 5, 20) if args.quick else (11, 20, 100)) if n == "small" else (7, 3, 10) if n == "medium" else (3, 1, 2)
        fns = step_fns(n)
        outside = ("pure_callback episode in jit", "native episode, no JAX (floor)")   # see calls()
        st[n] = side_by_side({k: f for k, f in fns.items() if k not in outside}, reps, inner)
        st[n] |= side_by_side({k: f for k, f in fns.items() if k in outside}, reps, inner)
        split = P.SPLIT_UPDATES
        sc[n] = {k: v / steps for k, v in side_by_side(scan_fns(n, steps), reps, max(1, inner // steps)).items()}
        P.SPLIT_UPDATES = split
        print(f"  {n}: " + ", ".join(f"{k} {v:,.1f}" for k, v in {**st[n], **sc[n]}.items()), flush=True)
    jx = "jax.jit(value_and_grad + optax.adam)"
    print("\n| training step (fwd + bwd + Adam), µs per jitted call | " + " | ".join(label(n) for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for lab in st[names[0]]:
        print(f"| {lab} | " + " | ".join(
            f"{st[n][lab]:,.0f}" + ("" if lab == jx or lab not in st[n] else f" ({st[n][jx] / st[n][lab]:.2f}×)")
            if lab in st[n] else "—" for n in names) + " |")
    pj = "plain JAX + optax in lax.scan"
    print("\n| training step inside one jitted lax.scan, µs per step | " + " | ".join(label(n) for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for lab in dict.fromkeys(k for n in names for k in sc[n]):
        print(f"| {lab} | " + " | ".join(
            "—" if lab not in sc[n] else f"{sc[n][lab]:,.1f}" + ("" if lab == pj else f" ({sc[n][pj] / sc[n][lab]:.2f}×)")
            for n in names) + " |")
    print(f"\n(Adam is split over XLA's thread pool from {P.SPLIT_UPDATES:,} parameters: the one-thread row "
          "reloads the handler's entry without the split)")
    print("\n(×) = speed-up over plain JAX measured in the same run")
    small = [n for n in names if n in ("tiny", "small")]
    if small:
        print("\n| native episode by part, µs per call (one ctypes call each) | " +
              " | ".join(label(n) for n in small) + " |")
        print("|---|" + "---:|" * len(small))
        parts = {n: episode_parts(n, args.quick) for n in small}
        for lab in parts[small[0]]:
            print(f"| {lab} | " + " | ".join(f"{parts[n][lab]:,.1f}" for n in small) + " |")


def episode_parts(name, quick=False):
    """Where a native episode's time goes: forward + backward, and the optimizer step alone (Adam in
    optax's form: three divisions and a square root per parameter), beside the whole episode."""
    prog = setup(name)[0]
    r = prog.runner
    reps, inner = (3, 10) if quick else (11, 200) if name == "tiny" else (11, 20)
    out = side_by_side({"forward + backward": lambda: (r.forward(), r.backward()),
                        "optimizer step (Adam)": r.step, "whole episode": r.episode}, reps, inner)
    out["for comparison: optax's Adam alone inside lax.scan, per step"] = optax_adam_in_scan(name, quick)
    return out


def optax_adam_in_scan(name, quick=False):
    """µs per step of optax.adam's update alone (the same parameter shapes, a fixed gradient) as the body
    of one jitted lax.scan: what plain JAX's scan spends on the optimizer."""
    import optax
    ps = [jnp.asarray(p) for p in setup(name)[1]]
    grads = [p * 1e-3 + 1e-4 for p in ps]
    tx, steps = optax.adam(1e-3), 200 if name == "tiny" else 50

    def body(c, _):
        u, s = tx.update(grads, c[1], c[0])
        return (optax.apply_updates(c[0], u), s), None

    run = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps)[0])
    c = (ps, tx.init(ps))
    jax.block_until_ready(run(c))
    t = side_by_side({"adam": lambda: jax.block_until_ready(run(c))}, 3 if quick else 11, 1)
    return t["adam"] / steps


def label(n):
    return f"{n} ({SIZES[n][0]}; {'-'.join(map(str, SIZES[n][1]))})"


if __name__ == "__main__":
    main()
