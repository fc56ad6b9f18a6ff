"""Host memory of fine-tuning an adapter on large frozen weights, three ways.

A LoRA-shaped adapter y = x·W + (x·A)·B trains A and B (rank r) on top of a frozen n×n weight W that
lives in a .npy file. The same training runs as a native program built three ways:

- eager constant: W is loaded, put on the tape as a constant, captured (the tape and the program each
  hold a copy, beside the loaded array);
- eager + drop_consts: the same, then ``tape.drop_consts()`` frees the tape's copy after capture;
- lazy constant: the tape declares W by shape only (``const_lazy``); the program's buffer is filled
  straight from a memory-mapped file (``set_input``), so W sits in host memory once.

Each variant runs in a fresh process; the table gives the peak of NumPy memory that tracemalloc traces
and the process's peak RSS. The trained adapters must be bit-identical across the variants. Writes
experiments/out/finetune_memory.png and finetune_memory.md.

    python experiments/studies/finetune_memory.py          # n = 512, 1024, 2048, 4096
    python experiments/studies/finetune_memory.py --quick  # n = 256, 512 (the test suite)
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
from progress import bar, cpu_model, parser, save  # noqa: E402

VARIANTS = ("eager constant", "eager + drop_consts", "lazy constant")
RANK, BATCH, STEPS = 8, 64, 5


def train(variant, path, n):
    """One variant in this process: (peak traced bytes, the trained A and B)."""
    import resource
    import tracemalloc
    tracemalloc.start()
    import tapegrad as tg
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    if variant == "lazy constant":
        W = tape.const_lazy((n, n))
    else:
        W = tape.const(np.load(path))
    A = tape.param(rng.standard_normal((n, RANK)) * 0.01)
    B = tape.param(np.zeros((RANK, n)))
    x, t = tape.const(np.zeros((BATCH, n))), tape.const(np.zeros((BATCH, n)))
    loss = tg.mse(x @ W + (x @ A) @ B, t)
    prog = tg.capture(tape, loss, backend="native")
    if variant == "lazy constant":
        prog.set_input(W, np.load(path, mmap_mode="r"))       # streamed from the file into the program
    elif variant == "eager + drop_consts":
        tape.drop_consts()
    opt = tg.Adam(1e-2)
    opt.add(tape, A)
    opt.add(tape, B)
    prog.attach(opt)
    for _ in range(STEPS):
        xb = rng.standard_normal((BATCH, n))
        prog.episode({x: xb, t: np.tanh(xb)})
    held, peak = tracemalloc.get_traced_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak, held, rss), np.array(prog.value(A)), np.array(prog.value(B))


def measure(sizes, quiet=False):
    """{(variant, n): (peak traced, traced at the end, peak RSS) in MiB}, and whether the adapters agree
    bit for bit."""
    out, agree = {}, True
    jobs = [(v, n) for n in sizes for v in VARIANTS]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (variant, n) in enumerate(jobs):
            path = os.path.join(tmp, f"W{n}.npy")
            if not os.path.exists(path):
                np.save(path, np.random.default_rng(n).standard_normal((n, n)) / np.sqrt(n))
            res = os.path.join(tmp, "adapter.npz")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, path, str(n), res]
            mem = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            out[(variant, n)] = tuple(m / 2**20 for m in mem)
            got = np.load(res)
            if variant == VARIANTS[0]:
                first = {k: got[k].copy() for k in ("A", "B")}
            else:
                agree &= all(np.array_equal(first[k], got[k]) for k in ("A", "B"))
            if not quiet:
                bar(i + 1, len(jobs), f"{variant}, n = {n}")
    return out, agree


def markdown(res, sizes, agree):
    lines = [f"CPU: {cpu_model()}; adapter rank {RANK}, batch {BATCH}, {STEPS} Adam steps, float64; "
             f"W is n×n ({', '.join(f'{n * n * 8 / 2**20:g} MiB' for n in sizes)})", "",
             "MiB: peak traced NumPy memory / traced memory held after training / peak RSS of the process", "",
             "| n | " + " | ".join(VARIANTS) + " |", "|---:|" + "---:|" * len(VARIANTS)]
    for n in sizes:
        lines.append(f"| {n} | " + " | ".join("{:.1f} / {:.1f} / {:.0f}".format(*res[(v, n)]) for v in VARIANTS) +
                     " |")
    lines += ["", f"trained adapters bit-identical across the three: {'yes' if agree else 'NO'}"]
    return "\n".join(lines) + "\n"


def plot(res, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = np.arange(len(sizes))
    for k, v in enumerate(VARIANTS):
        ax.bar(x + (k - 1) * 0.27, [res[(v, n)][0] for n in sizes], width=0.27, label=v)
    # one copy of W across each group of bars: a line collection, whose legend entry fits the legend's box
    ax.hlines([n * n * 8 / 2**20 for n in sizes], x - 0.42, x + 0.42, colors="k", lw=1.5,
              label="one copy of W (n² float64)")
    ax.set_xticks(x, [str(n) for n in sizes])
    ax.set_xlabel("n: the frozen weight W is n × n")
    ax.set_ylabel("peak traced NumPy memory, MiB")
    ax.set_title(f"fine-tuning a rank-{RANK} adapter on a frozen n × n weight W", fontsize=11)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        variant, path, n, res = argv[1], argv[2], int(argv[3]), argv[4]
        mem, A, B = train(variant, path, n)
        np.savez(res, A=A, B=B)
        print(json.dumps(mem))
        return None
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    sizes = (256, 512) if args.quick else (512, 1024, 2048, 4096)
    res, agree = measure(sizes)
    text = markdown(res, sizes, agree)
    save(args.out, "finetune_memory", text, lambda path: plot(res, sizes, path))
    return res, agree


if __name__ == "__main__":
    main()
