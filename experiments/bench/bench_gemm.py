"""Benchmark (not a test): the generated C's small-product kernel against BLAS, one product at a time.

The products of the MLP benchmarks (forward ``A @ B``, backward ``G @ Bᵀ`` and ``Aᵀ @ G``) through
``tg_mm_small`` (runtime.c) and through the BLAS gemm a native program calls, on one thread, µs per
product (best of interleaved repeats) and whether the two give the same bits. This is how
``tapegrad.native.runner.SMALL_GEMM`` was chosen; run it under another ``OPENBLAS_CORETYPE`` (e.g.
``Haswell``, the kernels OpenBLAS runs on AMD Zen and AVX2 Intel CPUs) to see that kernel family.
Run: ``.venv/bin/python experiments/bench/bench_gemm.py``.
"""
import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
from mlp import blas_kernel, cpu_model  # noqa: E402
from tapegrad.native import build, codegen, runner  # noqa: E402

# (m, n, k) of the tiny/small/medium MLP products, plus a few squares
SHAPES = [(32, 32, 16), (32, 32, 32), (32, 4, 32), (64, 128, 64), (64, 128, 128), (64, 10, 128), (64, 64, 64),
          (128, 128, 128), (256, 10, 512), (256, 512, 512)]

DRIVER = r'''
#include <time.h>
double tg_time(void *gemm, int small, int ta, int tb, int m, int n, int k, const real *A, const real *B, real *C,
               long reps)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long r = 0; r < reps; r++) {
        if (small)
            tg_mm_small(ta, tb, m, n, k, A, B, C);
        else
            tg_mm_rows((tg_gemm_t)gemm, ta, tb, 0, m, m, n, k, A, B, C);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / reps / 1e3;
}
'''


def library(dtype):
    gemm, _, bits, _ = runner.blas_pointers(dtype)
    src = ("#define _POSIX_C_SOURCE 199309L\n" + codegen.prologue(dtype, bits) + codegen.runtime_source() + DRIVER)
    lib = ctypes.CDLL(build.build(src, name="bench_gemm"))
    f = lib.tg_time
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 3 + [ctypes.c_long]
    return f, gemm


def main():
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1, "blas")
    except ImportError:
        pass
    dtype = os.environ.get("DTYPE", "float64")
    f, gemm = library(dtype)
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model()}, BLAS: {blas_kernel()}, {dtype}; µs per product, one thread (best of 7 "
          f"interleaved repeats); runner.SMALL_GEMM = {runner.SMALL_GEMM}, here {runner.small_gemm_limit(dtype)}\n")
    print("| m×n×k | form | C kernel µs | BLAS µs | BLAS / C | same bits |")
    print("|---|---|---:|---:|---:|---|")
    for m, n, k in SHAPES:
        for ta, tb, form in ((0, 0, "A@B"), (0, 1, "A@Bᵀ"), (1, 0, "Aᵀ@B")):
            A = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
            B = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
            C, D = np.empty((m, n), dtype), np.empty((m, n), dtype)
            reps = max(1, int(2e6 / (m * n * k)))
            args = (ta, tb, m, n, k, A.ctypes.data, B.ctypes.data)
            ts = {1: [], 0: []}
            for _ in range(7):
                for small in (1, 0):
                    ts[small].append(f(gemm, small, *args, (C if small else D).ctypes.data, reps))
            c, b = min(ts[1]), min(ts[0])
            print(f"| {m}×{n}×{k} | {form} | {c:,.2f} | {b:,.2f} | {b / c:.2f} | {np.array_equal(C, D)} |",
                  flush=True)


if __name__ == "__main__":
    main()
