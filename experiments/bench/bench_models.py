"""Models beyond the MLP: µs per training episode (forward + backward + Adam, float64) for the eager
tape, the NumPy replay, the native program and jax.jit(value_and_grad + optax.adam), side by side.

Every system runs in this one process, interleaved repeat by repeat (median), as in bench_capture.py.
BLAS runs on one thread (threadpoolctl; ``--blas-threads`` to change it), as in bench_interop.py: these
GEMMs are small (k = 9 or 72, n = 8 or 16), and on the shared 2-core machine OpenBLAS's spinning second
thread made every tapegrad system 6-14x slower under load (docs/benchmarks.md); XLA has its own pool.
A model is one entry of ``MODELS``: ``init`` (parameters), ``data`` (one batch), ``tape_loss`` and
``jax_loss`` (the same model twice). ``--quick`` for a smoke run.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from bench_eager import side_by_side  # noqa: E402
from mlp import blas_kernel  # noqa: E402
from progress import cpu_model  # noqa: E402

LR = 1e-3


# ── a small CNN: 1×28×28 → conv 3×3 (8) → relu → max pool 2 → conv 3×3 (16) → relu → max pool 2 → dense 10 ──

def cnn(layout):
    first = layout == "NCHW"

    def init(seed=0):
        rng = np.random.default_rng(seed)
        k = (lambda o, i: (o, i, 3, 3)) if first else (lambda o, i: (3, 3, i, o))
        b = (lambda o: (1, o, 1, 1)) if first else (lambda o: (1, 1, 1, o))
        return [rng.standard_normal(k(8, 1)) / 3.0, np.zeros(b(8)),
                rng.standard_normal(k(16, 8)) / np.sqrt(72.0), np.zeros(b(16)),
                rng.standard_normal((400, 10)) / 20.0, np.zeros(10)]

    def data(batch=32, seed=1):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((batch, 1, 28, 28) if first else (batch, 28, 28, 1))
        return x, np.eye(10)[rng.integers(0, 10, batch)]

    def tape_loss(tape, P, x, y):
        w1, b1, w2, b2, w3, b3 = P
        h = tg.max_pool((tg.conv(x, w1, layout=layout) + b1).relu(), 2, layout=layout)     # 13×13×8
        h = tg.max_pool((tg.conv(h, w2, layout=layout) + b2).relu(), 2, layout=layout)     # 5×5×16
        return tg.softmax_cross_entropy(h.reshape(h.shape[0], 400) @ w3 + b3, y)

    def jax_loss(P, x, y):
        import jax
        import jax.numpy as jnp
        from jax import lax
        w1, b1, w2, b2, w3, b3 = P
        dn = ("NCHW", "OIHW", "NCHW") if first else ("NHWC", "HWIO", "NHWC")
        win = (1, 1, 2, 2) if first else (1, 2, 2, 1)

        def block(h, w, b):
            h = jax.nn.relu(lax.conv_general_dilated(h, w, (1, 1), "VALID", dimension_numbers=dn) + b)
            return lax.reduce_window(h, -jnp.inf, lax.max, win, win, "VALID")
        h = block(block(x, w1, b1), w2, b2)
        logits = h.reshape(h.shape[0], 400) @ w3 + b3
        return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=1))

    return dict(init=init, data=data, tape_loss=tape_loss, jax_loss=jax_loss,
                label=f"CNN {layout} (32×1×28×28; conv 8, conv 16, dense 10)")


# ── an embedding-bag + MLP text classifier: 64 bags of 20 token ids (vocab 5000) → mean embedding (64) ──
#    → dense 128 → relu → dense 10, cross-entropy on integer labels ─────────────────────────────────────

def embedding_mlp(vocab=5000, d=64, hidden=128, classes=10, bag=20):
    def init(seed=0):
        rng = np.random.default_rng(seed)
        return [rng.standard_normal((vocab, d)) * 0.1, rng.standard_normal((d, hidden)) / np.sqrt(d),
                np.zeros(hidden), rng.standard_normal((hidden, classes)) / np.sqrt(hidden), np.zeros(classes)]

    def data(batch=64, seed=1):
        rng = np.random.default_rng(seed)
        return rng.integers(0, vocab, (batch, bag)), rng.integers(0, classes, (batch, 1))

    def tape_loss(tape, P, ids, labels):
        E, W1, b1, W2, b2 = P
        h = (tg.take(E, ids).mean(axis=1) @ W1 + b1).relu()
        logp = (h @ W2 + b2).log_softmax(axis=1)
        return -tg.take_along_axis(logp, labels, axis=1).mean()

    def jax_loss(P, ids, labels):
        import jax
        import jax.numpy as jnp
        E, W1, b1, W2, b2 = P
        h = jax.nn.relu(E[ids].mean(axis=1) @ W1 + b1)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ W2 + b2), labels, axis=1))

    return dict(init=init, data=data, tape_loss=tape_loss, jax_loss=jax_loss,
                label=f"embedding bag + MLP (64 bags of {bag} ids, vocab {vocab}, {d}-{hidden}-{classes})")


MODELS = {"cnn-nchw": cnn("NCHW"), "cnn-nhwc": cnn("NHWC"), "embedding-mlp": embedding_mlp()}


# ── the systems ──────────────────────────────────────────────────────────────

def _tape_and_opt(m):
    tape = tg.Tape()
    P = [tape.param(p) for p in m["init"]()]
    opt = tg.Adam(LR)
    for p in P:
        opt.add(tape, p)
    return tape, P, opt


def eager_step(m):
    tape, P, opt = _tape_and_opt(m)
    x_np, y_np = m["data"]()
    start = tape.mark()

    def step():
        tape.backward(m["tape_loss"](tape, P, tape.const(x_np), tape.const(y_np)))
        opt.step()
        tape.reset_to(start)
    return step


def program_step(m, backend):
    tape, P, opt = _tape_and_opt(m)
    x_np, y_np = m["data"]()
    tape.mark()
    x, y = tape.const(x_np), tape.const(y_np)
    prog = tg.capture(tape, m["tape_loss"](tape, P, x, y), backend=backend)
    prog.attach(opt)
    feed = {x: x_np, y: y_np}
    return lambda: prog.episode(feed)


def jax_step(m):
    import jax
    import jax.numpy as jnp
    import optax
    jax.config.update("jax_enable_x64", True)
    x, y = (jnp.asarray(a) for a in m["data"]())
    params = [jnp.asarray(p) for p in m["init"]()]
    tx = optax.adam(LR)
    state = [params, tx.init(params)]

    @jax.jit
    def step(ps, st, x, y):
        val, g = jax.value_and_grad(m["jax_loss"])(ps, x, y)
        upd, st = tx.update(g, st, ps)
        return optax.apply_updates(ps, upd), st, val

    def run():
        ps, st, val = step(state[0], state[1], x, y)
        val.block_until_ready()
        state[0], state[1] = ps, st
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--blas-threads", type=int, default=1)
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(args.blas_threads, "blas")
    reps, inner = (3, 2) if args.quick else (11, 10)
    cols = ["eager tape", "numpy replay", "native", "jax.jit"]
    rows = []
    for name in args.models.split(","):
        m = MODELS[name]
        fns = {"eager tape": eager_step(m), "numpy replay": program_step(m, "numpy"),
               "native": program_step(m, "native"), "jax.jit": jax_step(m)}
        for f in fns.values():   # compile / first-episode allocations outside the timing
            f()
        t = side_by_side(fns, reps, inner)
        rows.append((m["label"], t))
        print(f"  {name}: " + ", ".join(f"{k} {v:,.0f} µs" for k, v in t.items()), flush=True)
    print()
    print(f"{cpu_model()}, {os.cpu_count()} cores; BLAS: {blas_kernel()}; jax {_jax_version()}")
    print()
    print("µs per training episode (forward + backward + Adam, float64), median of interleaved repeats; "
          "(×) = speed-up over jax.jit")
    print()
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, t in rows:
        jx = t["jax.jit"]
        cells = [f"{t[c]:,.0f} ({jx / t[c]:.2f}×)" if c != "jax.jit" else f"{jx:,.0f}" for c in cols]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _jax_version():
    import jax
    return jax.__version__


if __name__ == "__main__":
    main()
