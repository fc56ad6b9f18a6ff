"""What registering n tensors with ``tg.Adam`` costs (``Optimizer.add``), and the first and a later step.

``add`` records a parameter and lays the moments out when the state is first used (the first ``step``,
``state_dict``, ``mu``/``nu``), so n registrations cost O(n). Before, every ``add`` copied every moment
out, laid every run out again and copied each moment back through a fresh list of all the views: O(n²)
per registration, O(n³) in all (300 tensors took 7-19 s). The "before" column runs that scheme again,
through the optimizer's own pieces, for the sizes where it finishes; both end in the same state, bit for
bit (checked). Side by side in one process, median of ``--repeats``. ``--quick``: small sizes.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from mlp import cpu_model  # noqa: E402

SIZES = (100, 300, 1_000, 3_000, 10_000)
QUICK = (30, 100)
BEFORE_UP_TO = 300     # the cubic scheme: 1,000 tensors would take minutes


def tensors(n):
    tape = tg.Tape()
    return tape, [tape.param(np.full(4, k + 1.0)) for k in range(n)]


def add_before(opt, tape, w):
    """``Optimizer.add`` as it was: the whole state copied out, every run laid out again, each moment
    copied back through ``_state`` (which builds every parameter's view: n views per moment)."""
    old = opt.state_dict()
    opt.add(tape, w)
    opt._fresh()
    for key in ("mu", "nu"):
        for k, a in enumerate(old[key]):
            np.copyto(opt._state(key)[k], a)


def run(n, before):
    """{"add": s, "first step": s, "step": s} for n tensors, and the final state (for the comparison)."""
    tape, ws = tensors(n)
    opt = tg.Adam(0.1)
    t0 = time.perf_counter()
    for k, w in enumerate(ws):
        if before:
            add_before(opt, tape, w)
            if k == 1:   # a step after the second registration, so the copies carry nonzero moments
                tape.backward((ws[0] * ws[1]).sum())
                opt.step()
        else:
            opt.add(tape, w)
            if k == 1:
                tape.backward((ws[0] * ws[1]).sum())
                opt.step()
    t1 = time.perf_counter()
    loss = (ws[0] * ws[-1]).sum()
    tape.backward(loss)
    opt.step()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    final = [tape.value(w).copy() for w in ws] + [a.copy() for key in ("mu", "nu") for a in opt._state(key)]
    return {"add": t1 - t0, "first step": t2 - t1, "step": t3 - t2}, final


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else SIZES
    print(f"CPU: {cpu_model()}; tensors of 4 elements; median of {args.repeats}\n")
    print("| tensors | add, all (ms) | per add (µs) | before: add, all (ms) | before / now | first step (ms) | "
          "later step (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n in sizes:
        now, before, same = [], [], True
        for _ in range(args.repeats):
            t, final = run(n, False)
            now.append(t)
            if n <= BEFORE_UP_TO:
                tb, final_before = run(n, True)
                before.append(tb)
                same = same and all(np.array_equal(a, b) for a, b in zip(final, final_before))
        med = {k: statistics.median(t[k] for t in now) for k in now[0]}
        old = statistics.median(t["add"] for t in before) if before else None
        rows.append((n, med, old, same))
        was = "—" if old is None else f"{old * 1e3:,.0f}"
        ratio = "—" if old is None else f"{old / med['add']:,.0f}x"
        print(f"| {n:,} | {med['add'] * 1e3:.2f} | {med['add'] / n * 1e6:.2f} | {was} | {ratio} | "
              f"{med['first step'] * 1e3:.2f} | {med['step'] * 1e3:.2f} |", flush=True)
    print("\nthe same final state (parameters, mu, nu) both ways: "
          + ("yes" if all(r[3] for r in rows) else "NO"))
    return rows


if __name__ == "__main__":
    main()
