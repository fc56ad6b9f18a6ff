"""The main job: train an MLP classifier on handwritten digits with the tape, then replay it.

Run with ``make demo``. The eager run trains on scikit-learn's bundled 8×8 digits (no download) with
softmax cross-entropy, Adam and minibatches through ``mark``/``reset_to``; the sections after it
(captured programs, JAX) train the same model from the same initial parameters on the same batches.
"""
import importlib
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tapegrad as tg  # noqa: E402
from mlp import init, predict, tape_loss  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
SIZES = (64, 64, 10)
BATCH, EPOCHS, LR = 64, 12, 3e-3


def load_digits(seed=0):
    from sklearn.datasets import load_digits as digits
    X, y = digits(return_X_y=True)
    X = X / 16.0
    order = np.random.default_rng(seed).permutation(len(X))
    X, y = X[order], y[order]
    cut = int(0.8 * len(X))
    return X[:cut], y[:cut], X[cut:], y[cut:]


def make_batches(X, y, batch, epochs, seed=1):
    onehot = np.eye(10)[y]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for lo in range(0, len(X) - batch + 1, batch):
            idx = order[lo:lo + batch]
            out.append((X[idx], onehot[idx]))
    return out


def progress(k, n, loss, width=30):
    """A one-line progress bar (redrawn in place on a terminal, a few lines in a log)."""
    tty = sys.stdout.isatty()
    if not tty and (k + 1) % max(n // 4, 1) and k + 1 != n:
        return
    done = width * (k + 1) // n
    end = "\n" if k + 1 == n or not tty else ""
    start = "\r" if tty else ""
    sys.stdout.write(f"{start}  [{'#' * done}{'.' * (width - done)}] {k + 1}/{n} steps  loss {loss:.4f}{end}")
    sys.stdout.flush()


def fresh(ctx):
    """A new tape holding the initial parameters, registered with a new optimizer; then a mark."""
    tape = tg.Tape()
    params = [tape.param(p) for p in ctx.init]
    opt = ctx.make_opt()
    for p in params:
        opt.add(tape, p, l2=0.0)
    return tape, params, opt, tape.mark()


def capture_episode(ctx, backend, fuse=True):
    """Record one episode on a fresh tape (same init), capture it, attach a fresh optimizer."""
    tape, params, opt, _ = ctx.fresh()
    xb, yb = ctx.batches[0]
    x, y = tape.const(xb), tape.const(yb)            # the episode's input slots
    prog = tg.capture(tape, ctx.model(tape, params, x, y), backend=backend, fuse=fuse)
    prog.attach(opt)
    return prog, params, x, y


def train_eager(ctx):
    tape, params, opt, start = ctx.fresh()
    losses = []
    t0 = time.perf_counter()
    for k, (xb, yb) in enumerate(ctx.batches):
        loss = ctx.model(tape, params, xb, yb)
        tape.backward(loss)
        opt.step()
        losses.append(float(tape.value(loss)))
        tape.reset_to(start)
        if k % 20 == 0 or k + 1 == len(ctx.batches):
            progress(k, len(ctx.batches), losses[-1])
    us = (time.perf_counter() - t0) / len(ctx.batches) * 1e6
    return losses, us, [np.array(tape.value(p)) for p in params]


def plot(losses, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("softmax cross-entropy")
    ax.set_yscale("log")
    ax.set_title("tapegrad: MLP 64-64-10 on digits, Adam")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    os.makedirs(OUT, exist_ok=True)
    Xtr, ytr, Xte, yte = load_digits()
    ctx = SimpleNamespace(sizes=SIZES, lr=LR, init=init(SIZES), model=tape_loss,
                          batches=make_batches(Xtr, ytr, BATCH, EPOCHS),
                          make_opt=lambda: tg.Adam(LR), fresh=lambda: fresh(ctx),
                          capture=lambda backend, fuse=True: capture_episode(ctx, backend, fuse),
                          accuracy=lambda ps: float((predict(ps, Xte) == yte).mean()),
                          Xte=Xte, yte=yte)
    print(f"tapegrad demo: MLP {'-'.join(map(str, SIZES))} on {len(Xtr)} digits "
          f"({len(ctx.batches)} steps of batch {BATCH}, Adam lr {LR})")
    print("eager tape:")
    ctx.eager_losses, ctx.eager_us, ctx.eager_params = train_eager(ctx)
    acc = ctx.accuracy(ctx.eager_params)
    path = os.path.join(OUT, "loss_curve.png")
    plot(ctx.eager_losses, path)
    print(f"  test accuracy {acc:.1%}   {ctx.eager_us:.0f} µs per step   loss curve: {os.path.relpath(path)}")
    for name in ("demo_capture", "demo_jax"):
        if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")):
            importlib.import_module(name).section(ctx)


if __name__ == "__main__":
    main()
