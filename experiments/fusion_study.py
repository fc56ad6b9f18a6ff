"""What kernel fusion buys: MLPs of growing depth and width, and a transformer block, captured as
native programs unfused and fused, beside jax.jit(value_and_grad + optax.adam).

For each model: tape nodes per episode, kernels per episode unfused → fused (forward + backward), and
µs per training episode (forward + backward + Adam) for each system, interleaved repeats, medians.
Writes experiments/out/fusion_study.png and fusion_study.md.

    python experiments/fusion_study.py           # a few minutes on 2 cores
    python experiments/fusion_study.py --quick   # two small models, few repeats (the test suite)
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_capture import jax_step, program_step  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from mlp import blas_kernel  # noqa: E402
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
        # both programs ran the same episodes: fused must equal unfused bit for bit
        same = np.array_equal(progs[False].loss(), progs[True].loss()) and all(
            np.array_equal(a, b) for a, b in zip(progs[False].val, progs[True].val))
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


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    for k, (col, off) in enumerate((("native unfused", -0.27), ("native fused", 0.0), ("jax.jit", 0.27))):
        ax.bar(x + off, [r[3][col] for r in rows], width=0.27, label=col)
    ax.set_yscale("log")
    ax.set_xticks(x, [n.replace(" (batch", "\n(batch") for n, *_ in rows], rotation=90, fontsize=6)
    ax.set_ylabel("µs per episode (log)")
    ax.set_title("fused vs unfused native programs vs jax.jit")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    import transformer as T
    if args.quick:
        rows = run(QUICK_MLPS, T.QUICK, 2, 5)
    else:
        rows = run(MLPS, dict(T.FULL, steps=1), 7, 20)
    text = markdown(rows)
    save(args.out, "fusion_study", text, lambda path: plot(rows, path))
    return rows


if __name__ == "__main__":
    main()
