"""What verification on first run costs (``capture(..., verify=True)``, tapegrad/verify.py), per MLP size.

Side by side in one process, interleaved repeat by repeat (median): a native capture with and without
verification (the library comes from the build cache: warmed first, so no compile is timed), the check
alone (the program's forward + backward and the node-by-node comparison), the checked first step
(snapshot, the program's episode, NumPy's update, comparison) and, as the unit, one NumPy-replay
episode and one native episode. ``--quick``: few repeats.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from tapegrad import verify  # noqa: E402
from tapegrad.blas import blas_core  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from mlp import cpu_model, data, init, tape_loss  # noqa: E402

SIZES = {"tiny": (32, (16, 32, 32, 4)), "small": (64, (64, 128, 128, 10))}


def episode_tape(batch, sizes):
    """(tape, loss, Adam over the parameters, feed) for one MLP episode."""
    x_np, y_np = data(batch, sizes)
    tape = tg.Tape()
    params = [tape.param(p) for p in init(sizes)]
    opt = tg.Adam(1e-3)
    for p in params:
        opt.add(tape, p)
    tape.mark()
    x, y = tape.const(x_np), tape.const(y_np)
    return tape, tape_loss(tape, params, x, y), opt, {x: x_np, y: y_np}


def systems(batch, sizes):
    """name -> a call to time."""
    tape, loss, opt, feed = episode_tape(batch, sizes)
    tg.capture(tape, loss, backend="native", verify=False)   # the build, once: later captures hit the cache
    ref = tg.capture(tape, loss, backend="numpy")
    ref.attach(opt)
    prog = tg.capture(tape, loss, backend="native", verify=False)
    prog.attach(opt)
    return {
        "capture": lambda: tg.capture(tape, loss, backend="native", verify=False),
        "capture + verify": lambda: tg.capture(tape, loss, backend="native"),
        "check alone": lambda: verify.check_run(prog),
        "checked step": lambda: verify.checked_step(prog, prog.runner.episode),
        "NumPy episode": lambda: ref.episode(feed),
        "native episode": lambda: prog.episode(feed),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, BLAS core: {blas_core('float64') or 'unknown'}\n")
    rows = []
    for name, (batch, sizes) in SIZES.items():
        reps, inner = (3, 3) if args.quick else (15, {"tiny": 40, "small": 10}[name])
        t = side_by_side(systems(batch, sizes), reps, inner)
        rows.append((name, batch, sizes, t))
    print("µs, median of interleaved repeats; (×) = in NumPy-replay episodes (forward + backward + Adam)")
    print()
    print("| size | capture | capture + verify | verification's cost | check alone | checked first step "
          "(over a native episode) | NumPy episode | native episode |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, batch, sizes, t in rows:
        unit = t["NumPy episode"]
        extra = t["capture + verify"] - t["capture"]
        step = t["checked step"] - t["native episode"]
        print(f"| {name} ({batch}; {'-'.join(map(str, sizes))}) | {t['capture']:,.0f} | "
              f"{t['capture + verify']:,.0f} ({t['capture + verify'] / t['capture']:.2f}× capture) | "
              f"{extra:,.0f} ({extra / unit:.1f}×) | {t['check alone']:,.0f} ({t['check alone'] / unit:.1f}×) | "
              f"{step:,.0f} ({step / unit:.1f}×) | {unit:,.0f} | {t['native episode']:,.0f} |")


if __name__ == "__main__":
    main()
