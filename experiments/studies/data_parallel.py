"""Data-parallel training on JAX's distributed runtime, each shard's step a captured tapegrad program.

Every process runs the same script; JAX's distributed runtime (``jax.distributed.initialize``, CPU
collectives over gloo) joins them into one mesh of all their devices. Per step, inside one jitted
``shard_map``: each device runs the captured native program as an XLA custom call
(``interop.program_call``: forward + backward on its shard of the batch), XLA all-reduces the
gradients (the gradient of a replicated parameter is summed over the mesh by ``shard_map``'s
transpose), and optax's Adam updates the replicated parameters identically on every device.

The same training on one process and the full batch (the eager tape with its optax-form Adam) is the
reference: the parameters agree to a stated bound, not bit for bit, because the full-batch mean sums
the rows in one order and the mesh sums per-shard means in another (and XLA fuses the Adam update into
fused multiply-adds). Throughput by processes × devices is measured honestly on whatever machine runs it
(on 2 cores more processes only add communication).

    python experiments/studies/data_parallel.py           # 1, 2 processes × 1, 2 devices each; table + plot
    python experiments/studies/data_parallel.py --quick   # 2 processes × 2 devices, a few steps (the test suite)
    python experiments/studies/data_parallel.py --plot-only   # redraw from experiments/out/data_parallel.json

On several hosts, run on each (same script, same data seed; host 0's address as coordinator):

    python experiments/studies/data_parallel.py --worker RANK --processes N --devices D --coordinator HOST0:PORT
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
from mlp import batches  # noqa: E402
from plots import add_plot_only, dump, load, pyplot  # noqa: E402
from progress import bar, cpu_model, parser, save  # noqa: E402

FULL = dict(batch=64, sizes=(64, 128, 128, 10), steps=40, lr=1e-3)
QUICK = dict(batch=16, sizes=(8, 16, 4), steps=3, lr=1e-3)
BOUND = 1e-12   # max relative parameter difference from the single-process full-batch run


def reference(cfg):
    """One process, the full batch: the eager tape and its optax-form Adam."""
    import tapegrad as tg
    from mlp import init, tape_loss
    tape = tg.Tape()
    P = [tape.param(p) for p in init(cfg["sizes"])]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    start = tape.mark()
    for x, y in batches(cfg):
        tape.backward(tape_loss(tape, P, x, y))
        opt.step()
        tape.reset_to(start)
    return [np.array(tape.value(p)) for p in P]


def worker(rank, nproc, ndev, coordinator, cfg, out):
    """One process of the mesh: joins it, trains, and (rank 0) writes parameters and timings to ``out``."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
    import jax
    jax.config.update("jax_enable_x64", True)            # a script: float64 throughout, said here
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if nproc > 1:
        jax.distributed.initialize(coordinator, num_processes=nproc, process_id=rank)
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as Spec

    import interop
    import tapegrad as tg
    from mlp import init, tape_loss
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shards = jax.device_count()
    if cfg["batch"] % shards:
        raise SystemExit(f"batch {cfg['batch']} does not split over {shards} devices")
    b = cfg["batch"] // shards
    tape = tg.Tape()                                     # one shard's episode, captured once
    P = [tape.param(p) for p in init(cfg["sizes"])]
    x, y = tape.const(np.zeros((b, cfg["sizes"][0]))), tape.const(np.zeros((b, cfg["sizes"][-1])))
    loss_fn = interop.program_call(tg.capture(tape, tape_loss(tape, P, x, y), backend="native"))
    tx = optax.adam(cfg["lr"])

    def shard_step(ps, st, xs, ys):
        loss, g = jax.value_and_grad(lambda ps: loss_fn(*ps, xs, ys))(ps)
        g = [gk / shards for gk in g]           # summed over the mesh already: the mean of the shard means
        u, st = tx.update(g, st, ps)
        return jax.lax.psum(loss, "data") / shards, optax.apply_updates(ps, u), st

    rep, row = NamedSharding(mesh, Spec()), NamedSharding(mesh, Spec("data"))
    step = jax.jit(jax.shard_map(shard_step, mesh=mesh, in_specs=(Spec(), Spec(), Spec("data"), Spec("data")),
                                 out_specs=(Spec(), Spec(), Spec())), donate_argnums=(0, 1))
    ps = [jax.make_array_from_process_local_data(rep, p) for p in init(cfg["sizes"])]
    st = jax.jit(tx.init, out_shardings=rep)(ps)
    local = slice(rank * ndev * b, (rank + 1) * ndev * b)    # this process's rows of every batch
    times = []
    for xb, yb in batches(cfg):
        xs = jax.make_array_from_process_local_data(row, xb[local])
        ys = jax.make_array_from_process_local_data(row, yb[local])
        t0 = time.perf_counter()
        loss, ps, st = step(ps, st, xs, ys)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        np.savez(out, *[np.asarray(p.addressable_data(0)) for p in ps], times=np.array(times))
    if nproc > 1:
        jax.distributed.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, ndev, cfg, timeout=300):
    """Run the mesh as ``nproc`` local processes: (parameters, step times) from rank 0."""
    coordinator = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.npz")
        cmd = lambda r: [sys.executable, os.path.abspath(__file__), "--worker", str(r), "--processes", str(nproc),  # noqa: E731
                         "--devices", str(ndev), "--coordinator", coordinator, "--config", json.dumps(cfg),
                         "--result", out]
        procs = [subprocess.Popen(cmd(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(nproc)]
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
        for p, e in zip(procs, errs):
            if p.returncode:
                raise RuntimeError(f"worker exited with {p.returncode}:\n{e[-3000:]}")
        got = np.load(out)
        return [got[f"arr_{k}"] for k in range(len(got.files) - 1)], got["times"]


def compare(params, ref):
    return max(float(np.abs(p - r).max() / max(np.abs(r).max(), 1e-300)) for p, r in zip(params, ref))


def run(configs, cfg, quiet=False):
    ref = reference(cfg)
    rows = []
    for i, (nproc, ndev) in enumerate(configs):
        params, times = launch(nproc, ndev, cfg)
        steady = times[1:] if len(times) > 1 else times
        rows.append((nproc, ndev, compare(params, ref), cfg["batch"] / float(np.median(steady)),
                     [float(t) for t in steady]))
        if not quiet:
            bar(i + 1, len(configs), f"{nproc} × {ndev}")
    return rows


def markdown(rows, cfg):
    from mlp import blas_kernel
    lines = [f"MLP {'-'.join(map(str, cfg['sizes']))}, global batch {cfg['batch']}, {cfg['steps']} Adam steps, "
             f"float64; CPU: {cpu_model()} ({os.cpu_count()} cores); BLAS: {blas_kernel()}", "",
             "| processes × devices | shards | max rel. parameter difference from one process, full batch "
             f"(bound {BOUND:g}) | examples / s (median step) |", "|---|---:|---:|---:|"]
    for nproc, ndev, diff, rate, _ in rows:
        lines.append(f"| {nproc} × {ndev} | {nproc * ndev} | {diff:.1e} | {rate:,.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, cfg):
    """Left, every timed step of each mesh (dots) and its median (line): where the time per step goes as
    processes and devices are added; right, how far each mesh's parameters end from one process's, beside
    the bound."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    plt = pyplot()
    fig, (tax, dax) = plt.subplots(1, 2, figsize=(10, 0.55 * len(rows) + 2.4), sharey=True,
                                   gridspec_kw={"width_ratios": (1.6, 1)})
    y = np.arange(len(rows))
    names = [f"{p} process{'es' if p > 1 else ''} × {d} device{'s' if d > 1 else ''}\n({p * d} shard"
             f"{'s' if p * d > 1 else ''})" for p, d, *_ in rows]
    rng = np.random.default_rng(0)
    for k, (*_, times) in enumerate(rows):
        ms = np.array(times) * 1e3
        med = float(np.median(ms))
        tax.plot(ms, k + rng.uniform(-0.15, 0.15, len(ms)), "o", ms=3, color="C0", alpha=0.7)
        tax.vlines(med, k - 0.3, k + 0.3, color="k", lw=2)
        tax.text(ms.min(), k - 0.34, f"median {med:.3g} ms = {cfg['batch'] / med * 1e3:,.0f} examples/s",
                 fontsize=8)
    span = max(max(r[4]) for r in rows) / min(min(r[4]) for r in rows)
    if span > 10:                                        # a log axis only where the times span a decade
        tax.set_xscale("log")
        tax.xaxis.set_minor_formatter(NullFormatter())
    tax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} ms"))
    tax.set_xlabel(f"time per training step{' (log scale)' if span > 10 else ''}: every step after the first; "
                   "black: median")
    tax.set_yticks(y, names, fontsize=9)
    tax.set_ylim(len(rows) - 0.5, -0.6)
    tax.grid(True, axis="x", which="both", alpha=0.3)
    diffs = [r[2] for r in rows]
    dax.plot(diffs, y, "o", color="C2")
    for k, d in enumerate(diffs):
        dax.text(d, k - 0.15, f"{d:.1e}", ha="center", va="bottom", fontsize=8)
    dax.axvline(BOUND, color="C3", ls="--")
    dax.text(BOUND, len(rows) - 0.55, f" bound {BOUND:g}", color="C3", fontsize=8, va="bottom")
    dax.set_xscale("log")
    dax.set_xlim(1e-17, BOUND * 100)
    dax.grid(True, axis="x", alpha=0.3)
    dax.set_xlabel("max rel. parameter difference from\none process on the full batch (log scale)")
    fig.suptitle(f"data-parallel training of MLP {'-'.join(map(str, cfg['sizes']))}, global batch {cfg['batch']}, "
                 f"{cfg['steps']} Adam steps on {os.cpu_count()} cores", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--worker", type=int, help="run one process of the mesh (its rank)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2, help="host devices per process")
    ap.add_argument("--coordinator", default="127.0.0.1:12355")
    ap.add_argument("--config", help="the training configuration as JSON (default: the full one)")
    ap.add_argument("--result", default="data_parallel_rank0.npz")
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        r = load(args.out, "data_parallel")
        return plot(r["rows"], os.path.join(args.out, "data_parallel.png"), r["cfg"])
    cfg = json.loads(args.config) if args.config else (QUICK if args.quick else FULL)
    if args.config:
        cfg["sizes"] = tuple(cfg["sizes"])
    if args.worker is not None:
        return worker(args.worker, args.processes, args.devices, args.coordinator, cfg, args.result)
    configs = [(2, 2)] if args.quick else [(1, 1), (1, 2), (2, 1), (2, 2)]
    rows = run(configs, cfg)
    text = markdown(rows, cfg)
    dump(args.out, "data_parallel", {"cfg": cfg, "rows": rows})
    save(args.out, "data_parallel", text, lambda path: plot(rows, path, cfg))
    return rows


if __name__ == "__main__":
    main()
