"""What ordered mode costs: µs per MLP training episode (forward + backward + Adam, softmax-xent) on each CPU
backend, default order (BLAS GEMMs, pairwise sums) vs ordered mode (serial index-order dots and sums).

Each pair is measured side by side, interleaved repeat by repeat (median), so the ratio is the result.
``--quick``: tiny and small only, few repeats.
"""
import argparse
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from mlp import blas_kernel, data, init, tape_loss  # noqa: E402

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10)), "medium": (256, (784, 512, 512, 10))}


def step(batch, sizes, backend, ordered):
    """One episode per call on ``backend`` ("tape" = eager record + backward + step + reset)."""
    x_np, y_np = data(batch, sizes)
    tape = tg.Tape(ordered=ordered)
    params = [tape.param(p) for p in init(sizes)]
    opt = tg.Adam(1e-3)
    for p in params:
        opt.add(tape, p)
    start = tape.mark()
    if backend == "tape":
        def run():
            tape.backward(tape_loss(tape, params, x_np, tape.const(y_np)))
            opt.step()
            tape.reset_to(start)
        return run
    x, y = tape.const(x_np), tape.const(y_np)
    prog = tg.capture(tape, tape_loss(tape, params, x, y), backend=backend)
    prog.attach(opt)
    feed = {x: x_np, y: y_np}
    return lambda: prog.episode(feed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="tape,numpy,native", help="comma-separated subset")
    args = ap.parse_args()
    sizes = ["tiny", "small"] if args.quick else list(SIZES)
    reps = 3 if args.quick else 7
    print(f"CPU: {platform.processor() or platform.machine()}, BLAS: {blas_kernel()}\n")
    print("| MLP | backend | default µs | ordered µs | ordered / default |")
    print("|---|---|---:|---:|---:|")
    for name in sizes:
        batch, sz = SIZES[name]
        inner = {"tiny": 50, "small": 20, "medium": 2}[name]
        for backend in args.backends.split(","):
            t = side_by_side({"default": step(batch, sz, backend, False), "ordered": step(batch, sz, backend, True)},
                             reps, inner)
            print(f"| {name} | {backend} | {t['default']:,.0f} | {t['ordered']:,.0f} | "
                  f"{t['ordered'] / t['default']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
