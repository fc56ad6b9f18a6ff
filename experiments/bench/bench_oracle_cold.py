"""Cold and warm ``interop.check_grads`` on whole optax optimizer steps with an inner ``jax.grad``.

Each case is ``tests/oracle_library_cases.py``'s ``_step(tx)``: two optimizer updates, each from a
``jax.grad`` of a quadratic loss, then the loss, differentiated with respect to the parameters (the
oracle replays the inner ``jax.grad``'s own derivative steps, then differentiates them again).

  equations   steps of f's jaxpr with calls inlined (``Plan.steps``), and how many the tape replays
  cold        one check_grads after ``jax.clear_caches()`` and with every oracle cache emptied (trace,
              compile of JAX's side, replay, backward), s
  warm        median of 5 further calls (the trace and JAX's compiled side cached), s
  before      cold, with identical loop bodies not shared (each its own plan and compile), as before
              ``oracle._shared_bodies``; cold times are the best of 2 (the machine is shared)
  new process the first check_grads in a fresh Python process, imports excluded: JAX's backend start-up
              and first compiles included (what a test suite's first oracle test pays)

``--profile NAME`` prints cProfile's top entries (cumulative) of one cold call of case NAME, and the
cold time split into the trace, JAX's compile-and-run, the replay and the rest.
Run: ``.venv/bin/python experiments/bench/bench_oracle_cold.py [--profile optax_muon_step]``; measured in one run.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(HERE, "..", "..", "tests")]   # itself, mlp, the cases

from mlp import cpu_model  # noqa: E402
import optax  # noqa: E402
import optax.contrib  # noqa: E402

import interop  # noqa: E402
from interop import jax  # noqa: E402
from interop.oracle import check as O  # noqa: E402
from interop.oracle.replay import Plan  # noqa: E402

import oracle_library_cases as lib  # noqa: E402

CASES = {
    "optax_muon_step": optax.contrib.muon(1e-2),
    "optax_inject_adam_step": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "optax_lamb_step": optax.lamb(1e-2),
    "optax_adam_step": optax.adam(1e-2),
}


def cold():
    jax.clear_caches()
    O.clear_caches()
    Plan._CACHE.clear()


def args():
    with jax.enable_x64(True):
        return lib._params(), lib.rnd(4, 3)


def measure(name, tx, shared=True):
    saved = O._shared_bodies
    if not shared:   # as before: every loop body its own plan and compile
        O._shared_bodies = lambda closed: closed
    try:
        return _measure(name, tx)
    finally:
        O._shared_bodies = saved


COMPILES = [0]


def _count_compiles():
    """Count XLA compiles (a deterministic measure next to times on a shared machine)."""
    from jax._src import compiler
    orig = compiler.backend_compile_and_load

    def counted(*a, **k):
        COMPILES[0] += 1
        return orig(*a, **k)
    compiler.backend_compile_and_load = counted


def _measure(name, tx):
    f = lib._step(tx)
    a = args()
    cold()
    t0 = time.perf_counter()
    n0 = COMPILES[0]
    r = interop.check_grads(f, *a, argnums=0)
    t_cold = time.perf_counter() - t0
    _measure.compiles = COMPILES[0] - n0
    assert r.ok, str(r)
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        interop.check_grads(f, *a, argnums=0)
        warm.append(time.perf_counter() - t0)
    steps = max(len(p.plan.steps) for p in O._PREP.values())
    return steps, r.n_eqns, t_cold, statistics.median(warm)


def fresh(name):
    """The first check_grads in a new process (imports excluded: JAX's backend start-up included), s."""
    code = (f"import sys, time; sys.argv = ['x']; sys.path.insert(0, {HERE!r}); "
            f"import bench_oracle_cold as B; f = B.lib._step(B.CASES[{name!r}]); a = B.args(); "
            f"t = time.perf_counter(); B.interop.check_grads(f, *a, argnums=0); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def profile(name):
    f = lib._step(CASES[name])
    a = args()
    interop.check_grads(lib._step(optax.sgd(0.1)), *a, argnums=0)   # JAX's own first-use costs, not the oracle's
    cold()
    pr = cProfile.Profile()
    pr.enable()
    interop.check_grads(f, *a, argnums=0)
    pr.disable()
    st = pstats.Stats(pr)
    cum = {}
    for k, v in st.stats.items():
        key = f"{k[0].rsplit('/', 1)[-1]}:{k[2]}"
        cum[key] = max(cum.get(key, 0.0), v[3])
    whole, prep, trace = cum.get("oracle.py:check_grads", 0.0), cum.get("oracle.py:_prepare", 0.0), cum.get(
        "oracle.py:trace", 0.0)
    replay, backward = cum.get("oracle.py:_replay", 0.0), cum.get("tape.py:backward", 0.0)
    parts = {"trace (make_jaxpr of f)": trace,
             "rest of _prepare (plan, needed slots, checks)": prep - trace,
             "JAX's side: compile and run": cum.get("oracle.py:_check", 0.0) - prep - replay - backward,
             "replay on the tape": replay,
             "tape backward": backward}
    print(f"\ncProfile of one cold check_grads of {name}: {whole:.2f} s (profiled: slower than unprofiled)")
    for k, v in parts.items():
        print(f"  {k:46s} {v:6.2f} s")
    st.sort_stats("cumulative").print_stats(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--only", default=None)
    o = ap.parse_args()
    if o.profile:
        profile(o.profile)
        return
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical cores), jax {jax.__version__}, optax {optax.__version__}")
    interop.check_grads(lib._step(optax.sgd(0.1)), *args(), argnums=0)   # JAX's one-time start-up, excluded
    _count_compiles()
    print("\n| case | equations (replayed) | cold s (compiles) | warm s | before: cold s (compiles) | first call in "
          "a new process s |\n|---|---|---|---|---|---|")
    for name, tx in CASES.items():
        if o.only and name != o.only:
            continue
        steps, replayed, c, w = measure(name, tx)
        n_now = _measure.compiles
        before = min(measure(name, tx, shared=False)[2] for _ in range(2))
        n_before = _measure.compiles
        c = min(c, measure(name, tx)[2])
        print(f"| {name} | {steps} ({replayed}) | {c:.2f} ({n_now}) | {w:.3f} | {before:.2f} ({n_before}) | "
              f"{fresh(name):.2f} |", flush=True)


if __name__ == "__main__":
    main()
