"""tapegrad beside its peers: one MLP training step (forward + backward + Adam, float64) in every system.

Systems: tapegrad's eager tape, NumPy replay, native program and ``program_episode`` inside
``jax.jit``; ``jax.jit(value_and_grad + optax.adam)``; PyTorch eager with its Adam, unfused and fused
(where torch is installed); HIPS autograd with Adam written in NumPy (where autograd is installed); and
the same step written by hand in NumPy with no AD (the floor). Same model, same data, same optimizer;
interleaved repeats, medians. Writes experiments/out/bench_peers.png (one panel per size),
bench_peers.md, and the measurements as bench_peers.json.

    python experiments/bench/bench_peers.py          # tiny, small, medium, large (several minutes)
    python experiments/bench/bench_peers.py --quick  # tiny and small, few repeats
    python experiments/bench/bench_peers.py --plot-only  # redraw the plot from experiments/out/bench_peers.json
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
from bench_capture import SIZES, jax_step, program_step  # noqa: E402
from bench_eager import numpy_step, side_by_side, tape_step  # noqa: E402
from mlp import blas_kernel, data, init  # noqa: E402
from plots import add_plot_only, dump, duration, load, pyplot  # noqa: E402
from progress import bar, cpu_model, parser, save  # noqa: E402

LR = 1e-3


def episode_in_jit(batch, sizes):
    """A native program's training episode as one XLA custom call inside jax.jit (state donated)."""
    import interop
    from interop import jax, jnp
    _, prog = program_step(batch, sizes, "native")
    with jax.enable_x64(True):
        x, y = (jnp.asarray(a) for a in data(batch, sizes))
        step = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
        state = [interop.episode_state(prog, flat=True)]

    def run():
        with jax.enable_x64(True):
            loss, state[0] = step(state[0], (x, y))
            loss.block_until_ready()
    return run


def torch_step(batch, sizes, fused):
    import torch
    torch.set_num_threads(2)
    x, y = (torch.tensor(a) for a in data(batch, sizes))
    ps = [torch.tensor(p, requires_grad=True) for p in init(sizes)]
    opt = torch.optim.Adam(ps, lr=LR, fused=fused)

    def run():
        h = x
        for k in range(0, len(ps), 2):
            h = h @ ps[k] + ps[k + 1]
            if k + 2 < len(ps):
                h = torch.relu(h)
        loss = -(y * torch.log_softmax(h, dim=1)).sum(dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return run


def autograd_step(batch, sizes):
    import autograd
    import autograd.numpy as anp
    x, y = data(batch, sizes)
    ps = init(sizes)
    mu, nu = [np.zeros_like(p) for p in ps], [np.zeros_like(p) for p in ps]
    count = [0]

    def loss(ps):
        h = x
        for k in range(0, len(ps), 2):
            h = anp.dot(h, ps[k]) + ps[k + 1]
            if k + 2 < len(ps):
                h = anp.maximum(h, 0.0)
        z = h - anp.max(h, axis=1, keepdims=True)
        return -anp.mean(anp.sum(y * (z - anp.log(anp.sum(anp.exp(z), axis=1, keepdims=True))), axis=1))
    grad = autograd.grad(loss)

    def run():
        gs = grad(ps)
        count[0] += 1
        c1, c2 = 1 - 0.9 ** count[0], 1 - 0.999 ** count[0]
        for p, g, m, v in zip(ps, gs, mu, nu):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= LR * (m / c1) / (np.sqrt(v / c2) + 1e-8)
    return run


def systems(batch, sizes):
    fns = {"tapegrad eager": tape_step(batch, sizes),
           "tapegrad NumPy replay": program_step(batch, sizes, "numpy")[0],
           "tapegrad native": program_step(batch, sizes, "native")[0],
           "tapegrad program_episode in jax.jit": episode_in_jit(batch, sizes),
           "jax.jit + optax": jax_step(batch, sizes)}
    missing = []
    try:
        fns["PyTorch eager"] = torch_step(batch, sizes, fused=False)
        fns["PyTorch eager, fused Adam"] = torch_step(batch, sizes, fused=True)
    except ImportError:
        missing.append("PyTorch")
    try:
        fns["HIPS autograd"] = autograd_step(batch, sizes)
    except ImportError:
        missing.append("HIPS autograd")
    fns["NumPy by hand (no AD)"] = numpy_step(batch, sizes)
    return fns, missing


def run(names, quick=False, quiet=False):
    rows, missing = {}, []
    for i, name in enumerate(names):
        batch, sizes = SIZES[name]
        reps, inner = {"tiny": (11, 50), "small": (11, 20), "medium": (7, 2), "large": (3, 1)}[name]
        if quick:
            reps, inner = 2, 2
        fns, missing = systems(batch, sizes)
        rows[name] = side_by_side(fns, reps, inner)
        if not quiet:
            bar(i + 1, len(names), name)
    return rows, missing


def markdown(rows, missing):
    cols = list(next(iter(rows.values())))
    lines = [f"CPU: {cpu_model()}; BLAS: {blas_kernel()}; µs per training step (median of interleaved repeats); "
             f"(×) = speed relative to jax.jit + optax", "",
             "| system | " + " | ".join(f"{n} ({SIZES[n][0]}; {'-'.join(map(str, SIZES[n][1]))})" for n in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for c in cols:
        cells = [f"{t[c]:,.0f} ({t['jax.jit + optax'] / t[c]:.2f}×)" for t in rows.values()]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if missing:
        lines += ["", f"Not installed here, so not measured: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def plot(rows, path):
    """One panel per size, systems as bars on a linear axis (length is time), each labelled with its time."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    plt = pyplot()
    ncol = min(len(rows), 2)
    nrow = -(-len(rows) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 0.36 * len(next(iter(rows.values()))) * nrow + 1.4),
                             squeeze=False)
    for ax, (name, t) in zip(axes.flat, rows.items()):
        names = list(t)
        colors = [COLORS[group(n)] for n in names]
        ax.barh(range(len(t)), [t[n] for n in names], color=colors)
        ax.set_yticks(range(len(t)), names if ax in axes[:, 0] else [], fontsize=9)
        ax.invert_yaxis()
        for k, n in enumerate(names):
            ax.text(t[n], k, " " + duration(t[n]), va="center", fontsize=8)
        ax.set_xlim(0, 1.25 * max(t.values()))          # room for the longest bar's label
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_major_formatter(FuncFormatter(duration))
        ax.tick_params(axis="x", labelsize=8)
        batch, sizes = SIZES[name]
        ax.set_title(f"{name}: MLP {'-'.join(map(str, sizes))}, batch {batch}", fontsize=10)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    fig.legend([Patch(color=c) for c in COLORS.values()], list(COLORS), loc="lower center", ncol=len(COLORS),
               fontsize=9, frameon=False)
    fig.suptitle("time per training step (forward + backward + Adam, float64)\nshorter is faster", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLORS = {"tapegrad": "C0", "jax.jit + optax": "C1", "others": "C7"}


def group(system):
    return "tapegrad" if system.startswith("tapegrad") else "jax.jit + optax" if system.startswith("jax") else "others"


def main(argv=None):
    ap = parser(__doc__)
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        rows = load(args.out, "bench_peers")["rows"]
        return plot(rows, os.path.join(args.out, "bench_peers.png"))
    names = ("tiny", "small") if args.quick else tuple(SIZES)
    rows, missing = run(names, args.quick)
    text = markdown(rows, missing)
    dump(args.out, "bench_peers", {"rows": rows, "missing": missing})
    save(args.out, "bench_peers", text, lambda path: plot(rows, path))


if __name__ == "__main__":
    main()
