"""Eager tape vs hand-written NumPy (no AD, the floor): µs per MLP training step and per-op overhead
(the per-op chain also in PyTorch eager, where torch is installed: it is not a dependency).

One run measures every system side by side (interleaved repeats, median), because this machine is
shared and absolute times drift; the ratios are the result. ``--quick`` for a smoke run.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from mlp import blas_kernel, data, init, tape_loss  # noqa: E402

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10))}


def tape_step(batch, sizes, sources=True):
    x_np, y_np = data(batch, sizes)
    tape = tg.Tape(sources=sources)
    params = [tape.param(p) for p in init(sizes)]
    opt = tg.Adam(1e-3)
    for p in params:
        opt.add(tape, p)
    start = tape.mark()

    def step():
        tape.backward(tape_loss(tape, params, x_np, tape.const(y_np)))
        opt.step()
        tape.reset_to(start)
    return step


def numpy_step(batch, sizes):
    """The same step by hand: forward, backward, Adam (optax form), no tape, no AD."""
    x, y = data(batch, sizes)
    ps = init(sizes)
    mu = [np.zeros_like(p) for p in ps]
    nu = [np.zeros_like(p) for p in ps]
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    count = [0]

    def step():
        hs = [x]
        h = x
        for k in range(0, len(ps), 2):
            h = h @ ps[k] + ps[k + 1]
            if k + 2 < len(ps):
                h = np.maximum(h, 0.0)
            hs.append(h)
        z = h - h.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        g = (np.exp(logp) - y) / len(x)
        grads = [None] * len(ps)
        for k in range(len(ps) - 2, -1, -2):
            grads[k] = hs[k // 2].T @ g
            grads[k + 1] = g.sum(axis=0)
            if k:
                g = (g @ ps[k].T) * (hs[k // 2] > 0)
        count[0] += 1
        bc1, bc2 = 1 - b1 ** count[0], 1 - b2 ** count[0]
        for p, gr, m, v in zip(ps, grads, mu, nu):
            m *= b1
            m += (1 - b1) * gr
            v *= b2
            v += (1 - b2) * gr * gr
            p -= lr * (m / bc1) / (np.sqrt(v / bc2) + eps)
    return step


def chain_tape(n=100, sources=True):
    tape = tg.Tape(sources=sources)
    x = tape.param(np.linspace(0.1, 0.4, 4))
    start = tape.mark()

    def run():
        y = x
        for _ in range(n // 2):
            y = (y * x).tanh()
        tape.backward(y.sum())
        tape.reset_to(start)
    return run


def chain_numpy(n=100):
    """The same chain by hand, forward and backward (the per-op floor)."""
    x = np.linspace(0.1, 0.4, 4)

    def run():
        ys, y = [], x
        for _ in range(n // 2):
            m = y * x
            y = np.tanh(m)
            ys.append((m, y))
        g, gx = np.ones(4), np.zeros(4)
        prev = [x] + [y for _, y in ys[:-1]]
        for (m, y), yin in zip(reversed(ys), reversed(prev)):
            g = g * (1 - y * y)
            gx += g * yin
            g = g * x
        gx += g
    return run


def chain_torch(n=100):
    """The same chain in PyTorch eager (autograd), one thread; None where torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    x = torch.linspace(0.1, 0.4, 4, dtype=torch.float64, requires_grad=True)

    def run():
        y = x
        for _ in range(n // 2):
            y = torch.tanh(y * x)
        y.sum().backward()
        x.grad = None
    return run


def timeit(fn, reps, inner):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner * 1e6)
    return out


def side_by_side(fns, reps, inner):
    """Interleave the systems repeat by repeat; the median of each.

    A short pause before each block lets the previous system's worker threads (XLA's pool,
    OpenBLAS's) stop spinning, so no system is timed against another's leftover busy-waiting.
    """
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            time.sleep(0.02)
            times[k] += timeit(f, 1, inner)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps, inner = (3, 20) if args.quick else (15, 100)
    print(f"BLAS: {blas_kernel()}\n")
    print("| size | tape step µs | tape, sources=False | NumPy floor µs | tape / floor | sources=False / floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (batch, sizes) in SIZES.items():
        t = side_by_side({"tape": tape_step(batch, sizes), "lean": tape_step(batch, sizes, sources=False),
                          "numpy": numpy_step(batch, sizes)}, reps, inner)
        print(f"| {name} ({batch}; {'-'.join(map(str, sizes))}) | {t['tape']:.0f} | {t['lean']:.0f} | "
              f"{t['numpy']:.0f} | {t['tape'] / t['numpy']:.2f}× | {t['lean'] / t['numpy']:.2f}× |")
    chains = {"tape": chain_tape(), "lean": chain_tape(sources=False), "numpy": chain_numpy()}
    torch_chain = chain_torch()
    if torch_chain is not None:
        chains["torch"] = torch_chain
    t = side_by_side(chains, reps, inner // 4 or 1)
    print()
    print("| 100-op elementwise chain + backward, shape (4,) | µs per op | vs PyTorch |")
    print("|---|---:|---:|")
    for key, label in (("tape", "tapegrad eager tape"), ("lean", "tapegrad eager tape, sources=False"),
                       ("numpy", "hand-written NumPy (no AD)"), ("torch", "PyTorch eager, 1 thread")):
        if key in t:
            vs = f"{t[key] / t['torch']:.2f}×" if "torch" in t else "—"
            print(f"| {label} | {t[key] / 100:.2f} | {vs} |")


if __name__ == "__main__":
    main()
