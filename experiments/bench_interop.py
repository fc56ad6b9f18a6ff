"""Benchmark (not a test): tapegrad programs inside jax.jit, against plain JAX.

1. Per-call overhead inside ``jax.jit`` of one loss + gradient evaluation of an MLP (tiny: batch 32,
   16-32-32-4; small: batch 64, 64-128-128-10): the captured native program as an XLA FFI custom call
   (``program_call``), the same program through ``jax.pure_callback`` (copies), through the zero-copy
   ``buffer_callback`` (``program_call(native=False)``), and the same loss written in jax.numpy.
2. A full training step (forward + backward + Adam): ``program_episode`` inside jit (one custom call,
   donated in-place state) vs ``jax.jit(value_and_grad + optax.adam)`` vs a pure_callback-based step.

All measured back to back in one run; µs per call, median of repeated timed blocks. BLAS runs on one
thread (threadpoolctl): on this shared 2-core machine OpenBLAS's two spinning threads contend with
XLA's thread pool and other processes, and multi-threaded runs of the small size varied 100-fold.
Run: ``.venv/bin/python experiments/bench_interop.py``.
"""
import time

import numpy as np

import interop
import tapegrad as tg
from interop import jax, jnp
from interop import program as P
from interop.callback import copying_call
from mlp import blas_kernel, init, jax_loss, tape_loss

jax.config.update("jax_enable_x64", True)   # the programs compute in float64

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10))}


def timeit(fn, reps=7, min_time=0.15):
    fn()
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 > min_time / reps:
            break
        n *= 2
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ts)) * 1e6


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
    out = {}
    for label, f in fns.items():
        g = jax.jit(jax.value_and_grad(f, argnums))
        out[label] = timeit(lambda: jax.block_until_ready(g(*args)))
    native_only = timeit(lambda: (prog.runner.forward(), prog.runner.backward()))
    return out, native_only


def steps(name):
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

    pc = jax.jit(pure_callback_episode(prog))
    sp = [interop.episode_state(prog, flat=True)]

    def run_pc():
        loss, sp[0] = pc(sp[0], (x, y))
        loss.block_until_ready()

    return {"program_episode in jit (FFI, flat state)": timeit(run_epf),
            "program_episode in jit (FFI, named state, one operand per array)": timeit(run_ep),
            "program_episode in jit (FFI, positional tuples, one operand per array)": timeit(run_eppos),
            "jax.jit(value_and_grad + optax.adam)": timeit(run_j),
            "pure_callback episode in jit": timeit(run_pc),
            "native episode, no JAX (floor)": timeit(lambda: prog.runner.episode())}


def main():
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1, "blas")
    except ImportError:
        pass
    if P.native_library() is None:
        raise SystemExit("bench_interop: needs a C compiler for the FFI handler")
    print(f"jax {jax.__version__}, float64, 2-core CPU, BLAS: {blas_kernel()}; µs per call (median)\n")
    res = {n: calls(n) for n in SIZES}
    print("| loss + grad inside jax.jit | " + " | ".join(f"{n} ({SIZES[n][0]}; {'-'.join(map(str, SIZES[n][1]))})" for n in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for label in res["tiny"][0]:
        print(f"| {label} | " + " | ".join(f"{res[n][0][label]:.0f}" for n in SIZES) + " |")
    print("| native forward+backward, no JAX (floor) | " + " | ".join(f"{res[n][1]:.0f}" for n in SIZES) + " |")
    st = {n: steps(n) for n in SIZES}
    print("\n| training step (fwd + bwd + Adam) | " + " | ".join(SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for label in st["tiny"]:
        print(f"| {label} | " + " | ".join(f"{st[n][label]:.0f}" for n in SIZES) + " |")
    for n in SIZES:
        e = st[n]
        print(f"\n{n}: program_episode is {e['jax.jit(value_and_grad + optax.adam)'] / e['program_episode in jit (FFI, flat state)']:.1f}× "
              f"faster than jax.jit(value_and_grad + optax.adam) and "
              f"{e['pure_callback episode in jit'] / e['program_episode in jit (FFI, flat state)']:.1f}× faster than the "
              f"pure_callback step")


if __name__ == "__main__":
    main()
