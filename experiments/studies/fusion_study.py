"""What kernel fusion buys: MLPs of growing depth and width, and a transformer block, captured as
native programs unfused and fused, beside jax.jit(value_and_grad + optax.adam).

For each model: tape nodes per episode, kernels per episode unfused → fused (forward + backward), and
µs per training episode (forward + backward + Adam) for each system, interleaved repeats, medians.
Writes experiments/out/fusion_study.png, fusion_study.md, and the measurements as fusion_study.json.

    python experiments/studies/fusion_study.py           # a few minutes on 2 cores
    python experiments/studies/fusion_study.py --quick   # two small models, few repeats (the test suite)
    python experiments/studies/fusion_study.py --plot-only   # redraw from experiments/out/fusion_study.json
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# experiments/ (mlp, plots, progress) and the benchmarks whose steps it times the same way (bench_capture, bench_eager)
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "bench")]
from bench_capture import jax_step, program_step  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from mlp import blas_kernel  # noqa: E402
from plots import add_plot_only, dump, duration, load, pyplot  # noqa: E402
from progress import bar, cpu_model, parser, save  # noqa: E402

MLPS = [(64, (64,) + (w,) * depth + (10,)) for depth in (1, 2, 4, 8) for w in (32, 128, 512)]
QUICK_MLPS = [(32, (16, 32, 4)), (32, (16, 32, 32, 32, 4))]


def kernels(plan):
    return plan["kernels_forward_unfused"] + plan["kernels_backward_unfused"], \
        plan["kernels_forward"] + plan["kernels_backward"]


def transformer_systems(cfg):
    """The transformer of transformer.py: native unfused, native fused, jax.jit + optax."""
    import transformer as T
    ids, vocab = T.corpus()
    data = T.batches(ids, cfg)
    params = T.init(len(vocab), cfg)
    progs = {}
    for fuse in (False, True):
        _, progs[fuse] = T.program_trainer(params, cfg, data[0], "native", fuse=fuse)
    jx = T.jax_trainer(params, cfg, fetch=False)
    x, y = data[0]     # the programs hold this batch in their data slots since capture
    fns = {"native unfused": lambda: progs[False].episode(), "native fused": lambda: progs[True].episode(),
           "jax.jit": lambda: jx(x, y)}
    return fns, progs


def run(mlps, transformer_cfg, reps, inner, quiet=False):
    rows = []
    jobs = [("mlp", m) for m in mlps] + ([("transformer", transformer_cfg)] if transformer_cfg else [])
    for i, (kind, spec) in enumerate(jobs):
        if kind == "mlp":
            batch, sizes = spec
            fns, progs = {}, {}
            fns["native unfused"], progs[False] = program_step(batch, sizes, "native", fuse=False)
            fns["native fused"], progs[True] = program_step(batch, sizes, "native", fuse=True)
            fns["jax.jit"] = jax_step(batch, sizes)
            name = f"MLP {'-'.join(map(str, sizes))} (batch {batch})"
        else:
            fns, progs = transformer_systems(spec)
            name = f"transformer block (d {spec['d']}, T {spec['T']}, batch {spec['batch']})"
        t = side_by_side(fns, reps, inner)
        # both programs ran the same episodes: fused must equal unfused bit for bit, in every value the
        # fused one stores (what a fused loop keeps in a local has no buffer)
        held = progs[True].runner.registers
        same = np.array_equal(progs[False].loss(), progs[True].loss()) and all(
            np.array_equal(a, b) for k, (a, b) in enumerate(zip(progs[False].val, progs[True].val))
            if ("v", k) not in held)
        rows.append((name, len(progs[True].nodes), kernels(progs[True].plan()), t, same))
        if not quiet:
            bar(i + 1, len(jobs), name)
    return rows


def markdown(rows):
    lines = [f"CPU: {cpu_model()}; BLAS: {blas_kernel()}; float64, µs per training episode (median of "
             f"interleaved repeats)", "",
             "| model | nodes | kernels unfused → fused | native unfused | native fused | fused speed-up | jax.jit "
             "| fused == unfused |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for name, nodes, (ku, kf), t, same in rows:
        lines.append(f"| {name} | {nodes} | {ku} → {kf} | {t['native unfused']:,.0f} | {t['native fused']:,.0f} | "
                     f"{t['native unfused'] / t['native fused']:.2f}× | {t['jax.jit']:,.0f} | "
                     f"{'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def short(name):
    """A model's name for an axis: repeated widths folded (``MLP 64-512×4-10``), the shared batch dropped."""
    if not name.startswith("MLP "):
        return name.replace("transformer block (", "transformer block\n(")
    widths = name[4:].split(" (")[0].split("-")
    runs = []
    for w in widths:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return "MLP " + "-".join(w if n == 1 else f"{w}×{n}" for w, n in runs)


def plot(rows, path):
    """Left, kernels per episode unfused and fused; right, µs per episode of each system (log: the models
    span three decades). One row per model, names horizontal."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    plt = pyplot()
    names = [short(r[0]) for r in rows]
    y = np.arange(len(rows))
    fig, (kax, tax) = plt.subplots(1, 2, figsize=(11, 0.42 * len(rows) + 1.8), sharey=True,
                                   gridspec_kw={"width_ratios": (1, 1.6)})
    for col, off, ku in (("native unfused", -0.2, 0), ("native fused", 0.2, 1)):
        counts = [r[2][ku] for r in rows]
        kax.barh(y + off, counts, height=0.4, color=COLORS[col], label=col)
        for k, c in enumerate(counts):
            kax.text(c, k + off, f" {c}", va="center", fontsize=7)
    kax.set_xlabel("kernels per episode (forward + backward)")
    kax.set_xlim(0, 1.15 * max(r[2][0] for r in rows))
    for col, off in (("native unfused", -0.27), ("native fused", 0.0), ("jax.jit", 0.27)):
        tax.barh(y + off, [r[3][col] for r in rows], height=0.27, color=COLORS[col], label=col)
    tax.set_xscale("log")
    tax.xaxis.set_major_locator(LogLocator(subs=(1, 3)))
    tax.xaxis.set_major_formatter(FuncFormatter(duration))
    tax.xaxis.set_minor_formatter(NullFormatter())
    tax.grid(True, axis="x", alpha=0.3)
    tax.set_xlabel("time per training episode (log scale), shorter is faster")
    kax.set_yticks(y, names, fontsize=9)
    kax.invert_yaxis()
    batches = sorted({r[0].split("(batch ")[1].rstrip(")") for r in rows if r[0].startswith("MLP ")})
    differ = [n for n, r in zip(names, rows) if not r[4]]
    fig.suptitle("kernel fusion in native programs, beside jax.jit" + (f"; MLPs at batch {', '.join(batches)}"
                 if batches else "") + "\nfused == unfused bit for bit: " +
                 (f"NOT in {', '.join(differ)}" if differ else "yes, in every model"), fontsize=11)
    fig.legend(*tax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLORS = {"native unfused": "C0", "native fused": "C2", "jax.jit": "C1"}


def main(argv=None):
    ap = parser(__doc__)
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        return plot(load(args.out, "fusion_study")["rows"], os.path.join(args.out, "fusion_study.png"))
    import transformer as T
    if args.quick:
        rows = run(QUICK_MLPS, T.QUICK, 2, 5)
    else:
        rows = run(MLPS, dict(T.FULL, steps=1), 7, 20)
    text = markdown(rows)
    dump(args.out, "fusion_study", {"rows": rows})
    save(args.out, "fusion_study", text, lambda path: plot(rows, path))
    return rows


if __name__ == "__main__":
    main()
