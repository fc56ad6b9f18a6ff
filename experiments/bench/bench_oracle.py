"""Time and error of ``interop.check_grads`` on the oracle corpus, next to ``jax.grad`` and to
``jax.test_util.check_grads`` (finite differences) on the same functions.

For every corpus entry (tests/test_oracle_corpus.py), measured back to back in one run:
  oracle cold   check_grads after ``jax.clear_caches()`` and with the oracle's caches empty (trace,
                compile of JAX's side, replay, backward), s
  oracle warm   median of 5 further calls, ms
  jax.grad      ``jax.jit(jax.grad(f, argnums))``: cold (compile + run) s, warm ms
  FD check      ``jax.test_util.check_grads(g, args, order=1, modes=["rev"], atol=rtol=1e-3)``: cold s, and
                whether it passes
  errors        the oracle's gradient error against jax.grad (``GradReport.error``: normwise per leaf, or
                over the whole gradient for a leaf at rounding level), and the relative error
                of the central difference (JAX's default eps 1e-4) along a random direction against
                ⟨jax.grad, v⟩ — the resolution a finite-difference check has.
Run: ``.venv/bin/python experiments/bench/bench_oracle.py`` (prints a Markdown table; a few minutes).
"""
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(HERE, "..", "..", "tests")]   # mlp, the corpus

import interop  # noqa: E402
from interop import jax, jnp  # noqa: E402
from interop.oracle import check as O  # noqa: E402
from interop.oracle.replay import Plan  # noqa: E402
import jax.test_util  # noqa: E402

import test_oracle_corpus as corpus  # noqa: E402
from mlp import cpu_model  # noqa: E402


def cold():
    jax.clear_caches()
    O._PREP.clear()
    O._VJP.clear()
    Plan._CACHE.clear()


def split(args, argnums):
    n = len(args)
    which = tuple(range(n)) if argnums is None else ((argnums,) if isinstance(argnums, int) else tuple(argnums))
    which = [a for a in which if any(np.dtype(getattr(x, "dtype", np.float64)).kind == "f"
                                     for x in jax.tree.leaves(args[a]))]
    return which


def closed(f, args, which):
    def g(*d):
        full = list(args)
        for a, v in zip(which, d):
            full[a] = v
        return f(*full)
    return g


def fd_error(g, dargs, grads, rng, eps=1e-4):
    v = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))) if jnp.issubdtype(x.dtype, jnp.floating)
                     else jnp.zeros_like(x), dargs)
    plus = jax.tree.map(lambda x, d: x + eps * d if jnp.issubdtype(x.dtype, jnp.floating) else x, dargs, v)
    minus = jax.tree.map(lambda x, d: x - eps * d if jnp.issubdtype(x.dtype, jnp.floating) else x, dargs, v)
    fd = (float(g(*plus)) - float(g(*minus))) / (2 * eps)
    exact = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(v))
                if jnp.issubdtype(a.dtype, jnp.floating))
    return abs(fd - exact) / max(abs(exact), 1e-300)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main():
    rows, skipped = [], []
    rng = np.random.default_rng(0)
    interop.check_grads(lambda x: jnp.sum(jnp.tanh(x)), jnp.ones(2))   # JAX's own start-up, not a function's
    for name, f, makers, kw, verdict, lowp in corpus.CORPUS:
        with jax.enable_x64(True):
            args = [m() for m in makers]
            argnums = kw.get("argnums")
            which = split(args, argnums)
            g = closed(f, args, which)
            dargs = [args[a] for a in which]
            cold()
            try:
                t_cold, rep = timed(lambda: interop.check_grads(f, *args, **kw))
            except interop.UnsupportedPrimitiveError as e:
                skipped.append((name, str(e).split(":")[1].split("on a tape")[0].strip()))
                continue
            warm = [timed(lambda: interop.check_grads(f, *args, **kw))[0] for _ in range(5)]
            cold()
            jg = jax.jit(jax.grad(g, argnums=tuple(range(len(which)))))
            t_jcold, grads = timed(lambda: jax.block_until_ready(jg(*dargs)))
            jwarm = [timed(lambda: jax.block_until_ready(jg(*dargs)))[0] for _ in range(5)]
            cold()
            t0 = time.perf_counter()
            try:
                jax.test_util.check_grads(lambda *d: g(*jax.tree.map(jnp.asarray, d)), tuple(dargs), order=1,
                                          modes=["rev"], atol=1e-3, rtol=1e-3)   # it perturbs in NumPy
                fd_verdict = "passes"
            except AssertionError:
                fd_verdict = "fails"
            t_fd = time.perf_counter() - t0
            err_fd = fd_error(g, dargs, grads, rng)
        rows.append((name, t_cold, statistics.median(warm) * 1e3, t_jcold, statistics.median(jwarm) * 1e3, t_fd,
                     rep.error, rep.verdict + (" (f32)" if rep.precision else ""), err_fd, fd_verdict))
        print(f"{name}: {t_cold:.2f}s", file=sys.stderr)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; jax {jax.__version__}; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print("| function | oracle cold s | oracle warm ms | jax.jit(grad) cold s | jax.grad warm ms | FD check_grads s "
          "| oracle error | verdict | FD rel error | FD check |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.1e} | {r[7]} | "
              f"{r[8]:.1e} | {r[9]} |")
    col = list(zip(*[r[1:7] for r in rows])) if rows else []
    if rows:
        print(f"| **median** | {statistics.median(col[0]):.2f} | {statistics.median(col[1]):.1f} | "
              f"{statistics.median(col[2]):.2f} | {statistics.median(col[3]):.2f} | {statistics.median(col[4]):.2f} | "
              f"{statistics.median([r[6] for r in rows if r[7] == 'agree']):.1e} | | "
              f"{statistics.median([r[8] for r in rows]):.1e} | |")
        print(f"| **max** | {max(col[0]):.2f} | {max(col[1]):.1f} | {max(col[2]):.2f} | {max(col[3]):.2f} | "
              f"{max(col[4]):.2f} | {max(r[6] for r in rows if r[7] == 'agree'):.1e} | | "
              f"{max(r[8] for r in rows):.1e} | |")
    for name, why in skipped:
        print(f"\nskipped {name}: {why}")


if __name__ == "__main__":
    main()
