"""The same training run, repeated: which ways of running it agree bit for bit, and how far the rest drift.

One MLP (64-128-128-10, batch 64, Adam, float64) trained for N steps from one start on the same
batches: on the eager tape, as a NumPy replay, as native programs fused and unfused, with BLAS on one
thread and on two, inside jax.jit as one custom call per step, in ordered mode (every product and sum
serial in index order, no FMA: ``Tape(ordered=True)``), and — as reference points —
jax.jit(value_and_grad + optax.adam) run twice and
PyTorch eager where it is installed. Per step, each run's largest relative parameter difference from
the eager tape; at the end, which pairs are bit-identical. Writes experiments/out/reproducibility.png,
reproducibility.md, and the measurements as reproducibility.json.

    python experiments/studies/reproducibility.py          # 100 steps
    python experiments/studies/reproducibility.py --quick  # 5 steps of a small MLP (the test suite)
    python experiments/studies/reproducibility.py --plot-only  # redraw from experiments/out/reproducibility.json
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from mlp import batches, blas_kernel, init, jax_loss, tape_loss  # noqa: E402
from plots import add_plot_only, dump, load, pyplot  # noqa: E402
from progress import bar, cpu_model, parser, save  # noqa: E402

FULL = dict(batch=64, sizes=(64, 128, 128, 10), steps=100, lr=1e-3)
QUICK = dict(batch=16, sizes=(8, 16, 4), steps=5, lr=1e-3)


def blas_threads(n):
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n, "blas")


def eager_run(cfg, data, ordered=False):
    tape = tg.Tape(ordered=ordered)
    P = [tape.param(p) for p in init(cfg["sizes"])]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    start = tape.mark()
    for x, y in data:
        tape.backward(tape_loss(tape, P, x, y))
        opt.step()
        tape.reset_to(start)
        yield np.concatenate([np.ravel(tape.value(p)) for p in P])


def program_run(cfg, data, backend, fuse=True, ordered=False):
    tape = tg.Tape(ordered=ordered)
    P = [tape.param(p) for p in init(cfg["sizes"])]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    x, y = tape.const(data[0][0]), tape.const(data[0][1])
    prog = tg.capture(tape, tape_loss(tape, P, x, y), backend=backend, fuse=fuse)
    prog.attach(opt)
    for xb, yb in data:
        prog.episode({x: xb, y: yb})
        yield np.concatenate([np.ravel(prog.value(p)) for p in P])


def jit_episode_run(cfg, data):
    """The native program's episode as one custom call per step inside jax.jit (flat state, donated)."""
    import interop
    from interop import jax, jnp
    tape = tg.Tape()
    P = [tape.param(p) for p in init(cfg["sizes"])]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    x, y = tape.const(data[0][0]), tape.const(data[0][1])
    prog = tg.capture(tape, tape_loss(tape, P, x, y), backend="native")
    prog.attach(opt)
    with jax.enable_x64(True):
        step = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
        state = interop.episode_state(prog, flat=True)
        for xb, yb in data:
            _, state = step(state, (jnp.asarray(xb), jnp.asarray(yb)))
            params = interop.unflatten_state(prog, state)[0]
            yield np.concatenate([np.ravel(np.asarray(params[n])) for n in prog.param_names])


def jax_run(cfg, data):
    import optax
    from interop import jax, jnp
    tx = optax.adam(cfg["lr"])
    with jax.enable_x64(True):
        ps = [jnp.asarray(p) for p in init(cfg["sizes"])]
        st = tx.init(ps)

        @jax.jit
        def step(ps, st, x, y):
            g = jax.grad(jax_loss)(ps, x, y)
            u, st = tx.update(g, st, ps)
            return optax.apply_updates(ps, u), st
        for x, y in data:
            ps, st = step(ps, st, x, y)
            yield np.concatenate([np.ravel(np.asarray(p)) for p in ps])


def torch_run(cfg, data):
    import torch
    ps = [torch.tensor(p, requires_grad=True) for p in init(cfg["sizes"])]
    opt = torch.optim.Adam(ps, lr=cfg["lr"])
    for x, y in data:
        h = torch.tensor(x)
        for k in range(0, len(ps), 2):
            h = h @ ps[k] + ps[k + 1]
            if k + 2 < len(ps):
                h = torch.relu(h)
        loss = -(torch.tensor(y) * torch.log_softmax(h, dim=1)).sum(dim=1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield np.concatenate([p.detach().numpy().ravel() for p in ps])


def runs(cfg, data):
    """name -> a zero-argument function returning the list of flat parameters after each step."""
    def limited(threads, gen):
        def go():
            with blas_threads(threads):
                return list(gen())
        return go
    out = {
        "eager tape": limited(2, lambda: eager_run(cfg, data)),
        "eager tape, BLAS 1 thread": limited(1, lambda: eager_run(cfg, data)),
        "NumPy replay": limited(2, lambda: program_run(cfg, data, "numpy")),
        "native fused": limited(2, lambda: program_run(cfg, data, "native")),
        "native unfused": limited(2, lambda: program_run(cfg, data, "native", fuse=False)),
        "native fused, BLAS 1 thread": limited(1, lambda: program_run(cfg, data, "native")),
        "native program_episode in jax.jit": limited(1, lambda: jit_episode_run(cfg, data)),
        "ordered: eager tape": limited(2, lambda: eager_run(cfg, data, ordered=True)),
        "ordered: NumPy replay": limited(2, lambda: program_run(cfg, data, "numpy", ordered=True)),
        "ordered: native fused": limited(2, lambda: program_run(cfg, data, "native", ordered=True)),
        "jax.jit + optax": lambda: list(jax_run(cfg, data)),
        "jax.jit + optax, again": lambda: list(jax_run(cfg, data)),
    }
    try:
        import torch  # noqa: F401
        out["PyTorch eager"] = lambda: list(torch_run(cfg, data))
        out["PyTorch eager, again"] = lambda: list(torch_run(cfg, data))
    except ImportError:
        pass
    return out


def run(cfg, quiet=False):
    data = batches(cfg)
    todo = runs(cfg, data)
    traj = {}
    for i, (name, go) in enumerate(todo.items()):
        traj[name] = go()
        if not quiet:
            bar(i + 1, len(todo), name)
    ref = traj["eager tape"]
    drift = {name: [float(np.abs(p - q).max() / np.abs(q).max()) for p, q in zip(t, ref)]
             for name, t in traj.items()}
    names = list(traj)
    same = {(a, b): all(np.array_equal(p, q) for p, q in zip(traj[a], traj[b])) for a in names for b in names}
    return {"cfg": cfg, "names": names, "drift": drift, "same": same}


def markdown(r):
    cfg, names, same, drift = r["cfg"], r["names"], r["same"], r["drift"]
    lines = [f"MLP {'-'.join(map(str, cfg['sizes']))}, batch {cfg['batch']}, {cfg['steps']} Adam steps, float64. "
             f"CPU: {cpu_model()}; BLAS: {blas_kernel()}", "",
             "| run | bit-identical to the eager tape at every step | max rel. parameter difference from it at "
             "the last step | bit-identical runs |", "|---|---|---:|---|"]
    for a in names:
        twins = [b for b in names if b != a and same[(a, b)]]
        lines.append(f"| {a} | {'yes' if same[(a, 'eager tape')] else 'no'} | {drift[a][-1]:.1e} | "
                     f"{', '.join(twins) or '—'} |")
    if not any(n.startswith("PyTorch") for n in names):
        lines += ["", "PyTorch is not installed here: its rows are skipped."]
    return "\n".join(lines) + "\n"


def classes(names, same):
    """The runs grouped into classes of bit-identical trajectories, in the order of their first member."""
    groups = []
    for a in names:
        for g in groups:
            if same[(g[0], a)]:
                g.append(a)
                break
        else:
            groups.append([a])
    return groups


def plot(r, path):
    """One line per class of bit-identical runs (they would hide each other), the eager tape's class named
    in the legend (drift 0 has no place on a log axis); markers staggered so close lines stay apart."""
    import textwrap
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
    plt = pyplot()
    drift, groups = r["drift"], classes(r["names"], r["same"])
    zero = [g for g in groups if not any(drift[g[0]])]
    drawn = sorted((g for g in groups if any(drift[g[0]])), key=lambda g: -drift[g[0]][-1])
    fig, ax = plt.subplots(figsize=(7.5, 4.2 + 0.3 * (len(drawn) + len(zero))))
    steps = len(drift[r["names"][0]])
    label = lambda g, head="": textwrap.fill(head + " = ".join(g) + (f"  ({len(g)} runs, bit-identical)"
                                                                      if len(g) > 1 else ""), 90)
    every = max(steps // 8, 1)                         # each line's markers start a little later
    for k, g in enumerate(drawn):
        d = np.array(drift[g[0]])
        ax.semilogy(np.arange(1, steps + 1), np.where(d > 0, d, np.nan), lw=1.5, color=f"C{k}",
                    marker="os^vD<>ph*"[k % 10],
                    markevery=(k * every // len(drawn), every), ms=5, label=label(g))
    for g in zero:
        ax.plot([], [], " ", label=label(g, "drift 0 (no place on a log axis): "))
    ax.axhline(np.finfo(float).eps, color="k", ls=":", lw=1, label="float64 ε (2.2e-16), for scale")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("Adam step (a gap: bit-identical to the eager tape at that step)")
    ax.set_ylabel("max relative parameter difference\nfrom the eager tape")
    ax.set_title(f"one training run, {len(r['names'])} ways: how far each drifts from the eager tape", fontsize=11)
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0e}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.16), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def saved(r):
    """``run``'s result as JSON (pairs of runs as lists) and back."""
    if "same" in r and isinstance(r["same"], dict):
        return dict(r, same=[[a, b, v] for (a, b), v in r["same"].items()])
    return dict(r, same={(a, b): v for a, b, v in r["same"]})


def main(argv=None):
    ap = parser(__doc__)
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        r = saved(load(args.out, "reproducibility"))
        return plot(r, os.path.join(args.out, "reproducibility.png"))
    r = run(QUICK if args.quick else FULL)
    text = markdown(r)
    dump(args.out, "reproducibility", saved(r))
    save(args.out, "reproducibility", text, lambda path: plot(r, path))
    return r


if __name__ == "__main__":
    main()
