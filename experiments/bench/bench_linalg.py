"""Linear algebra: why the ops call NumPy's LAPACK, and what a GP likelihood episode costs.

1. Two OpenBLAS thread pools: NumPy's GEMM alternating with Cholesky from NumPy's own OpenBLAS (what
   tapegrad calls) or from SciPy's (``scipy.linalg.cython_lapack``), µs per pair, vs either alone.
2. A Gaussian-process negative log marginal likelihood (n points, the rational kernel of
   tests/test_ops_linalg.py; ½ log det K as Σ log Lᵢᵢ in every system) with its gradient: eager tape,
   NumPy replay, native program, and ``jax.jit(value_and_grad)``, µs per episode, side by side in one
   run. ``OPENBLAS_NUM_THREADS=1`` measures the arithmetic rather than the thread pools (on a busy
   2-core machine threaded OpenBLAS calls above its size thresholds stall for milliseconds).
"""
import ctypes
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import tapegrad as tg  # noqa: E402
from tapegrad.blas import _capsule, lapack_pointers  # noqa: E402


def per_call(f, budget=0.6, samples=7):
    """µs per call: the median over ``samples`` timed batches (the machines are shared and noisy)."""
    f()
    t0 = time.perf_counter()
    f()
    reps = max(1, int(budget / samples / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return float(np.median(times))


def pools(sizes=(8, 64, 200, 400)):
    from scipy.linalg import cython_lapack
    numpy_table, bits, where = lapack_pointers(np.float64)
    P, C = ctypes.c_void_p, ctypes.c_char_p
    proto = ctypes.CFUNCTYPE(None, C, P, P, P, P)
    impls = [("NumPy's OpenBLAS", proto(int(numpy_table[0])), np.int64 if bits == 64 else np.int32),
             ("SciPy's OpenBLAS", proto(_capsule(cython_lapack.__pyx_capi__["dpotrf"])), np.int32)]
    print(f"dpotrf from {where} vs scipy.linalg.cython_lapack; GEMM: np.matmul (µs per call, median of 7 batches)\n")
    print("| n | LAPACK | matmul | potrf | alternating | alternating / (matmul + potrf) |")
    print("|---:|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n in sizes:
        a = rng.standard_normal((n, n))
        s = a @ a.T + n * np.eye(n)
        w = s.copy()
        for name, potrf, it in impls:
            ints = np.array([n, 0], it)

            def chol():
                np.copyto(w, s)
                potrf(b"U", ints.ctypes.data, w.ctypes.data, ints.ctypes.data, ints.ctypes.data + ints.itemsize)

            def mm():
                np.matmul(a, a)

            def both():
                mm()
                chol()
            tm, tc, tb = per_call(mm), per_call(chol), per_call(both)
            print(f"| {n} | {name} | {tm:.1f} | {tc:.1f} | {tb:.1f} | {tb / (tm + tc):.2f} |")


def gp(n):
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(-3.0, 3.0, (n, 1)), axis=0)
    y = np.sin(2.0 * x) + 0.1 * rng.standard_normal((n, 1))
    theta = [np.array(0.9), np.array(1.1), np.array(0.3)]
    eye = np.eye(n)

    def record(tape):
        th = [tape.param(t) for t in theta]
        ell, var, noise = (t * t for t in th)
        xv, yv = tape.const(x), tape.const(y)
        d = xv - xv.T
        K = var * (1.0 / (1.0 + (d * d) / ell)) + noise * tape.const(eye)
        L = tg.cholesky(K)
        alpha = tg.triangular_solve(L, yv)
        half_logdet = (L * tape.const(eye)).sum(axis=1).log().sum()     # Σ log Lᵢᵢ, as the JAX model
        return 0.5 * (alpha * alpha).sum() + half_logdet + 0.5 * n * math.log(2.0 * math.pi)

    def eager():
        tape = tg.Tape(sources=False)
        tape.backward(record(tape))

    tape = tg.Tape()
    loss = record(tape)
    tape.backward(loss)
    res = {"eager tape": per_call(eager)}
    for backend in ("numpy", "native"):
        prog = tg.capture(tape, loss, backend=backend)
        res[f"{backend} replay" if backend == "numpy" else "native"] = per_call(prog.episode)
    try:
        import interop
        jax, jnp = interop.jax, interop.jnp
        import jax.scipy.linalg as jsl

        def nll(th):
            ell, var, noise = (t * t for t in th)
            d = x - x.T
            K = var * (1.0 / (1.0 + d * d / ell)) + noise * jnp.eye(n)
            L = jnp.linalg.cholesky(K)
            alpha = jsl.solve_triangular(L, y, lower=True)
            return 0.5 * jnp.sum(alpha * alpha) + jnp.sum(jnp.log(jnp.diag(L))) + 0.5 * n * jnp.log(2.0 * jnp.pi)
        f = jax.jit(jax.value_and_grad(nll))
        th = [jnp.asarray(t) for t in theta]
        res["jax.jit(value_and_grad)"] = per_call(lambda: jax.block_until_ready(f(th)))
    except ImportError:
        pass
    return res


def main():
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}\n")
    pools()
    print("\nGP negative log marginal likelihood + gradient, µs per episode\n")
    sizes = (16, 64, 256)
    rows = {n: gp(n) for n in sizes}
    names = list(rows[sizes[0]])
    print("| system | " + " | ".join(f"n = {n}" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{rows[n][name]:,.1f}" for n in sizes) + " |")


if __name__ == "__main__":
    main()
