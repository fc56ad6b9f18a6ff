"""Benchmark (not a test): CPU instructions per op of the 100-op chain of ``bench_eager.py``, counted
with valgrind's callgrind, so the figure does not move with the machine's load.

Each system runs twice under callgrind, once with the chain and once without (the difference removes
start-up and imports); the result is instructions per op (forward + backward). Instructions are not
time (the interpreter, NumPy's ufunc machinery and PyTorch's dispatcher run at different instructions
per cycle), but they are exact and repeatable where timings on a shared machine drift. PyTorch is
counted where it is installed (it is not a dependency). Needs valgrind.

    .venv/bin/python experiments/bench/bench_instructions.py [--reps 100]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = {"tape": "tapegrad eager tape", "lean": "tapegrad eager tape, sources=False",
           "numpy": "hand-written NumPy (no AD)", "torch": "PyTorch eager, 1 thread"}
CHILD = """
import sys
sys.path.insert(0, {here!r})
import bench_eager as B
run = {{"tape": B.chain_tape, "lean": lambda: B.chain_tape(sources=False), "numpy": B.chain_numpy,
       "torch": B.chain_torch}}[{system!r}]()
for _ in range(20):   # first episodes: caches and recorded sweeps settle
    run()
for _ in range({n}):
    run()
"""


def instructions(system, n):
    code = CHILD.format(here=HERE, system=system, n=n)
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
                          code], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100, help="chains per counted run (100 ops each)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: needs valgrind")
    systems = [s for s in SYSTEMS if s != "torch"]
    try:
        import torch  # noqa: F401
        systems.append("torch")
    except ImportError:
        pass
    per_op = {}
    for s in systems:
        per_op[s] = (instructions(s, args.reps) - instructions(s, 0)) / (args.reps * 100)
        print(f"  {SYSTEMS[s]}: {per_op[s]:,.0f}", flush=True)
    print("\n| 100-op elementwise chain + backward, shape (4,) | instructions per op | vs PyTorch |")
    print("|---|---:|---:|")
    for s in systems:
        vs = f"{per_op[s] / per_op['torch']:.2f}×" if "torch" in per_op else "—"
        print(f"| {SYSTEMS[s]} | {per_op[s]:,.0f} | {vs} |")


if __name__ == "__main__":
    main()
