"""Soak: long runs of every loop a user repeats, with resident memory and open file descriptors measured.

    python experiments/studies/soak.py            # the full soak (10,000 steps per loop; a few minutes on 2 cores)
    python experiments/studies/soak.py --quick    # 1/20 of the steps (what tests/test_faults_soak.py runs)

Each loop runs a warm-up tenth first (at least 10 steps) (buffers, caches and JIT compilations reach their steady state),
then the rest; growth is RSS at the end minus RSS after the warm-up. Prints a Markdown table and exits
non-zero if any loop grows by more than ``--limit-mb`` or leaks a file descriptor.
"""
import argparse
import os
import platform
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import tapegrad as tg  # noqa: E402


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def fds():
    return len(os.listdir("/proc/self/fd"))


def mlp(rng, sizes=(32, 64, 64, 10), batch=32):
    tape = tg.Tape()
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        params += [tape.param(rng.standard_normal((a, b)) / np.sqrt(a)), tape.param(np.zeros(b))]
    opt = tg.Adam(1e-3)
    for p in params:
        opt.add(tape, p)
    return tape, params, opt, sizes, batch


def forward(tape, params, x, y):
    h = tape.const(x) if not isinstance(x, tg.Var) else x
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = h.relu()
    return tg.softmax_cross_entropy(h, y)


def data(rng, sizes, batch):
    x = rng.standard_normal((batch, sizes[0]))
    y = np.eye(sizes[-1])[rng.integers(0, sizes[-1], batch)]
    return x, y


# ── the loops: each is (setup) -> step(i) ──────────────────────────────────────

def eager_steps(rng):
    tape, params, opt, sizes, batch = mlp(rng)
    m = tape.mark()
    x, y = data(rng, sizes, batch)

    def step(i):
        tape.backward(forward(tape, params, x, y))
        opt.step()
        tape.reset_to(m)
    return step


def changing_scalar(rng):
    tape, params, opt, sizes, batch = mlp(rng)
    m = tape.mark()
    x, y = data(rng, sizes, batch)

    def step(i):
        temperature = 1.0 + 1e-4 * i            # a new static operand every step
        tape.backward(forward(tape, params, x, y) * temperature)
        opt.step()
        tape.reset_to(m)
    return step


def accumulating_backward(rng):
    tape, params, opt, sizes, batch = mlp(rng, sizes=(64, 128, 128, 10), batch=32)
    x, y = data(rng, sizes, batch)
    loss = forward(tape, params, x, y)

    def step(i):
        tape.backward(loss)                      # gradient accumulation: no reset between calls
    return step


def program_episodes(backend):
    def setup(rng):
        tape, params, opt, sizes, batch = mlp(rng)
        x, y = data(rng, sizes, batch)
        xc, yc = tape.const(x), tape.const(y)
        prog = tg.capture(tape, forward(tape, params, xc, yc), backend=backend)
        prog.attach(opt)

        def step(i):
            prog.episode({xc: x, yc: y})
        return step
    return setup


def jitted_episodes(rng):
    import interop
    interop.jax.config.update("jax_enable_x64", True)   # a script: the float64 program needs JAX's 64-bit mode
    tape, params, opt, sizes, batch = mlp(rng)
    x, y = data(rng, sizes, batch)
    xc, yc = tape.const(x), tape.const(y)
    prog = tg.capture(tape, forward(tape, params, xc, yc), backend="native")
    prog.attach(opt)
    step_fn = interop.jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
    state = list(interop.episode_state(prog))   # [params by name, optax-shaped optimizer state]
    inputs = interop.program_inputs(prog)

    def step(i):
        loss, state[0], state[1] = step_fn(state[0], state[1], inputs)
        if i % 100 == 0:
            float(loss)
    return step


def checkpoints(rng):
    tape, params, opt, sizes, batch = mlp(rng)
    folder = tempfile.mkdtemp(prefix="tapegrad-soak-")
    path = os.path.join(folder, "ck.safetensors")

    def step(i):
        tg.save(path, tape, opt)
        tg.load(path, tape, opt)
    return step


def threads_own_tapes(rng):
    """Four threads, each with its own tape and optimizer; results must equal a sequential run bit for bit."""
    seeds = [1, 2, 3, 4]

    def train(seed, steps):
        r = np.random.default_rng(seed)
        tape, params, opt, sizes, batch = mlp(r)
        m = tape.mark()
        x, y = data(r, sizes, batch)
        for _ in range(steps):
            tape.backward(forward(tape, params, x, y))
            opt.step()
            tape.reset_to(m)
        return [np.array(tape.value(p)) for p in params]

    def step(i):
        out = {}
        ts = [threading.Thread(target=lambda s=s: out.__setitem__(s, train(s, 5))) for s in seeds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if i % 50 == 0:
            for s in seeds:
                seq = train(s, 5)
                assert all(np.array_equal(a, b) for a, b in zip(out[s], seq)), "threads differ from sequential"
    return step


LOOPS = [
    ("eager mark/reset steps (MLP + Adam)", eager_steps, 10_000),
    ("a scalar operand that changes every step", changing_scalar, 10_000),
    ("accumulating backwards, no reset (64-128-128-10)", accumulating_backward, 2_000),
    ("NumPy-replay program episodes", program_episodes("numpy"), 10_000),
    ("native program episodes", program_episodes("native"), 10_000),
    ("jitted program_episode steps (XLA FFI)", jitted_episodes, 10_000),
    ("checkpoint save + load cycles", checkpoints, 1_000),
    ("4 threads x 5 steps, own tapes (== sequential)", threads_own_tapes, 200),
]


def run(name, setup, steps):
    rng = np.random.default_rng(0)
    step = setup(rng)
    warm = max(steps // 10, min(steps // 2, 10))
    for i in range(warm):
        step(i)
    r0, f0, t0 = rss_mb(), fds(), time.perf_counter()
    for i in range(warm, steps):
        step(i)
    return {"loop": name, "steps": steps, "rss0": r0, "rss1": rss_mb(), "fd0": f0, "fd1": fds(),
            "s": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1/20 of the steps")
    ap.add_argument("--limit-mb", type=float, default=None, help="max RSS growth per loop (default 8, quick 4)")
    ap.add_argument("--only", default=None, help="run the loops whose name contains this text")
    ap.add_argument("--no-jax", action="store_true", help="skip the jitted loop")
    args = ap.parse_args(argv)
    limit = args.limit_mb if args.limit_mb is not None else (4.0 if args.quick else 8.0)
    print(f"tapegrad soak ({'quick' if args.quick else 'full'}): {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, NumPy {np.__version__}, {os.cpu_count()} CPUs")
    print()
    print("| loop | steps | RSS after warm-up (MB) | RSS at end (MB) | growth (MB) | open fds (start → end) | s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bad = []
    for name, setup, steps in LOOPS:
        if args.only and args.only not in name:
            continue
        if args.no_jax and "jitted" in name:
            continue
        steps = max(steps // 20, 20) if args.quick else steps
        r = run(name, setup, steps)
        growth = r["rss1"] - r["rss0"]
        print(f"| {name} | {steps:,} | {r['rss0']:.1f} | {r['rss1']:.1f} | {growth:+.1f} | {r['fd0']} → {r['fd1']} "
              f"| {r['s']:.1f} |", flush=True)
        if growth > limit or r["fd1"] != r["fd0"]:
            bad.append(name)
    print()
    print(f"flat (growth ≤ {limit:g} MB, no fd leaked): {'all loops' if not bad else 'NOT ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
