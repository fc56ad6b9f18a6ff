"""A character-level transformer trained three ways from the same start on the same batches.

The eager tape (with its Adam), the same episode captured as a native program (Adam inside, one call
per step), and plain JAX with optax (jit of value_and_grad + adam) — plus the NumPy replay of the
captured program, which must equal the tape bit for bit: per step the losses, the largest relative
gradient difference between each pair, and µs per step. The text is the docstrings of a few
standard-library modules. Writes experiments/out/transformer_{loss,grad}.png and transformer.md.

    python experiments/studies/transformer.py            # 200 steps (a minute or two on 2 cores)
    python experiments/studies/transformer.py --quick    # a few steps on a smaller model (the test suite)
"""
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
import tapegrad as tg  # noqa: E402
from mlp import blas_kernel  # noqa: E402
from progress import bar, cpu_model, parser, save  # noqa: E402

FULL = dict(T=16, d=32, heads=2, hidden=64, batch=8, steps=200, lr=3e-3)
QUICK = dict(T=8, d=16, heads=2, hidden=32, batch=4, steps=5, lr=3e-3)
NAMES = ("E", "pos", "ln1_g", "ln1_b", "Wq", "Wk", "Wv", "Wo", "ln2_g", "ln2_b", "W1", "b1", "W2", "b2",
         "lnf_g", "lnf_b")


def corpus():
    """Characters of a few standard-library docstrings: (ids, vocabulary)."""
    import collections
    import functools
    import json
    import string
    import textwrap
    text = "\n".join(m.__doc__ for m in (json, textwrap, string, collections, functools))
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    return np.array([lookup[c] for c in text]), vocab


def batches(ids, cfg, seed=1):
    """``steps`` minibatches of windows: tokens (B, T) and next-token targets (B·T, 1)."""
    rng = np.random.default_rng(seed)
    B, T = cfg["batch"], cfg["T"]
    out = []
    for _ in range(cfg["steps"]):
        at = rng.integers(0, len(ids) - T - 1, B)
        x = np.stack([ids[i:i + T] for i in at])
        y = np.stack([ids[i + 1:i + T + 1] for i in at]).reshape(B * T, 1)
        out.append((x, y))
    return out


def init(vocab, cfg, seed=0):
    """Parameters in ``NAMES`` order: scaled normal weights, unit gains, zero biases."""
    rng = np.random.default_rng(seed)
    d, h, T = cfg["d"], cfg["hidden"], cfg["T"]
    w = lambda *s: rng.standard_normal(s) / np.sqrt(s[0])   # noqa: E731
    return [rng.standard_normal((vocab, d)) * 0.1, rng.standard_normal((T, d)) * 0.1,
            np.ones(d), np.zeros(d), w(d, d), w(d, d), w(d, d), w(d, d), np.ones(d), np.zeros(d),
            w(d, h), np.zeros(h), w(h, d), np.zeros(d), np.ones(d), np.zeros(d)]


# ── the model on the tape ────────────────────────────────────────────────────

def layer_norm(h, g, b):
    m = h.mean(axis=-1, keepdims=True)
    c = h - m
    v = (c * c).mean(axis=-1, keepdims=True)
    return c / (v + 1e-5).sqrt() * g + b


def attention(h, Wq, Wk, Wv, Wo, cfg, causal):
    B, T, H, d = cfg["batch"], cfg["T"], cfg["heads"], cfg["d"]
    dh = d // H

    def heads(x):   # (B·T, d) -> (B·H, T, dh)
        return x.reshape(B, T, H, dh).transpose((0, 2, 1, 3)).reshape(B * H, T, dh)
    q, k, v = heads(h @ Wq), heads(h @ Wk), heads(h @ Wv)
    scores = tg.bmm(q, k.transpose((0, 2, 1))) / np.sqrt(dh)
    att = tg.where(causal, scores, -np.inf).softmax(axis=2)
    o = tg.bmm(att, v).reshape(B, H, T, dh).transpose((0, 2, 1, 3)).reshape(B * T, d)
    return o @ Wo


def tape_loss(tape, P, x, y, cfg, onehot=False):
    """Mean next-character cross-entropy; ``x`` (B, T) and ``y`` (B·T, 1) are integer data Vars, or with
    ``onehot`` float one-hot rows (B·T, V) — the form a program called from jax.jit takes (its
    custom call passes float inputs only)."""
    E, pos, g1, b1n, Wq, Wk, Wv, Wo, g2, b2n, W1, b1, W2, b2, gf, bf = P
    B, T, d = cfg["batch"], cfg["T"], cfg["d"]
    causal = np.tril(np.ones((T, T), bool))
    tokens = (x @ E).reshape(B, T, d) if onehot else tg.take(E, x)     # a one-hot product picks rows exactly
    h = (tokens + pos).reshape(B * T, d)
    h = h + attention(layer_norm(h, g1, b1n), Wq, Wk, Wv, Wo, cfg, causal)
    h = h + (layer_norm(h, g2, b2n) @ W1 + b1).relu() @ W2 + b2
    logits = layer_norm(h, gf, bf) @ E.T                          # tied output embedding
    if onehot:
        return tg.softmax_cross_entropy(logits, y)
    return -tg.take_along_axis(logits.log_softmax(axis=1), y, axis=1).mean()


def onehot(x, y, vocab):
    eye = np.eye(vocab)
    return eye[x.reshape(-1)], eye[y.reshape(-1)]


# ── the same model in jax.numpy ──────────────────────────────────────────────

def jax_loss(P, x, y, cfg):
    from interop import jax, jnp
    E, pos, g1, b1n, Wq, Wk, Wv, Wo, g2, b2n, W1, b1, W2, b2, gf, bf = P
    B, T, H, d = cfg["batch"], cfg["T"], cfg["heads"], cfg["d"]
    dh = d // H

    def ln(h, g, b):
        m = jnp.mean(h, axis=-1, keepdims=True)
        c = h - m
        return c / jnp.sqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5) * g + b

    def heads(z):
        return z.reshape(B, T, H, dh).transpose(0, 2, 1, 3)
    h = (E[x] + pos).reshape(B * T, d)
    a = ln(h, g1, b1n)
    q, k, v = heads(a @ Wq), heads(a @ Wk), heads(a @ Wv)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(dh)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf), axis=-1)
    h = h + jnp.einsum("bhqk,bhkd->bhqd", att, v).transpose(0, 2, 1, 3).reshape(B * T, d) @ Wo
    h = h + jax.nn.relu(ln(h, g2, b2n) @ W1 + b1) @ W2 + b2
    logp = jax.nn.log_softmax(ln(h, gf, bf) @ E.T, axis=1)
    return -jnp.mean(jnp.take_along_axis(logp, y, axis=1))


# ── three trainers with one interface: step(x, y) -> (loss, grads) ───────────

def eager_trainer(params, cfg):
    tape = tg.Tape()
    P = [tape.param(p) for p in params]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    start = tape.mark()

    def step(x, y):
        loss = tape_loss(tape, P, tape.const(x), tape.const(y), cfg)
        tape.backward(loss)
        out = float(tape.value(loss)), [np.array(tape.grad(p)) for p in P]
        opt.step()
        tape.reset_to(start)
        return out
    return step


def program_trainer(params, cfg, first, backend, fuse=True):
    tape = tg.Tape()
    P = [tape.param(p) for p in params]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    x, y = tape.const(first[0]), tape.const(first[1])
    prog = tg.capture(tape, tape_loss(tape, P, x, y, cfg), backend=backend, fuse=fuse)
    prog.attach(opt)

    def step(xb, yb):
        loss = prog.episode({x: xb, y: yb})
        return loss, [np.array(prog.grad(p)) for p in P]
    return step, prog


def jax_trainer(params, cfg, fetch=True):
    """``step(x, y)`` -> (loss, gradients as NumPy arrays); with ``fetch=False`` the loss alone (for
    timing the step without the copies out)."""
    import optax
    from interop import jax, jnp
    tx = optax.adam(cfg["lr"])
    with jax.enable_x64(True):     # float64 inside this trainer only
        state = {"p": [jnp.asarray(p) for p in params]}
        state["s"] = tx.init(state["p"])

    @jax.jit
    def update(p, s, x, y):
        loss, g = jax.value_and_grad(jax_loss)(p, x, y, cfg)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, g

    def step(x, y):
        with jax.enable_x64(True):
            state["p"], state["s"], loss, g = update(state["p"], state["s"], x, y)
            return (float(loss), [np.asarray(a) for a in g]) if fetch else float(loss)
    return step


def jit_episode_trainer(params, cfg, first, vocab):
    """The model (one-hot form) captured natively with Adam inside, run as ``program_episode``: one XLA
    custom call per step inside jax.jit, the state donated. Losses only (the episode returns no grads)."""
    import interop
    from interop import jax, jnp
    tape = tg.Tape()
    P = [tape.param(p) for p in params]
    opt = tg.Adam(cfg["lr"])
    for p in P:
        opt.add(tape, p)
    x1, y1 = onehot(*first, vocab)
    x, y = tape.const(x1), tape.const(y1)
    prog = tg.capture(tape, tape_loss(tape, P, x, y, cfg, onehot=True), backend="native")
    prog.attach(opt)
    with jax.enable_x64(True):
        episode = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
        state = [interop.episode_state(prog, flat=True)]
        inputs = list(interop.program_inputs(prog))     # the batch slots, and the −inf of the mask fill
    at = [prog.consts.index(v.id) for v in (x, y)]

    def step(xb, yb):
        with jax.enable_x64(True):
            for k, a in zip(at, onehot(xb, yb, vocab)):
                inputs[k] = jnp.asarray(a)
            loss, state[0] = episode(state[0], tuple(inputs))
            return float(loss), None
    return step


def max_rel(gs, hs):
    """The largest relative difference over all parameters: max |g − h| / max |h|, per parameter."""
    return max(float(np.abs(g - h).max() / max(np.abs(h).max(), 1e-300)) for g, h in zip(gs, hs))


def run(cfg, out_dir, quiet=False):
    ids, vocab = corpus()
    data = batches(ids, cfg)
    params = init(len(vocab), cfg)
    eager = eager_trainer(params, cfg)
    replay, _ = program_trainer(params, cfg, data[0], "numpy")
    native, prog = program_trainer(params, cfg, data[0], "native")
    jx = jax_trainer(params, cfg)
    jit_ep = jit_episode_trainer(params, cfg, data[0], len(vocab))
    systems = {"eager tape": eager, "NumPy replay": replay, "native program": native, "jax.jit + optax": jx,
               "program_episode in jax.jit": jit_ep}
    log = {name: {"loss": [], "grads": [], "us": []} for name in systems}
    for i, (x, y) in enumerate(data):
        for name, step in systems.items():
            t0 = time.perf_counter()
            loss, grads = step(x, y)
            log[name]["us"].append((time.perf_counter() - t0) * 1e6)
            log[name]["loss"].append(loss)
            log[name]["grads"].append(grads)
        if not quiet:
            bar(i + 1, len(data), f"loss {log['eager tape']['loss'][-1]:.4f}")
    pairs = {("eager tape", "NumPy replay"): [], ("eager tape", "native program"): [],
             ("eager tape", "jax.jit + optax"): [], ("native program", "jax.jit + optax"): []}
    for (a, b), diffs in pairs.items():
        for ga, gb in zip(log[a]["grads"], log[b]["grads"]):
            diffs.append(max_rel(ga, gb))
    result = {"cfg": cfg, "vocab": len(vocab), "nodes": len(prog.nodes), "log": log, "pairs": pairs,
              "plan": prog.plan()}
    if out_dir:
        report(result, out_dir)
    return result


def report(r, out_dir):
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    log, pairs = r["log"], r["pairs"]
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ref = np.array(log["eager tape"]["loss"])     # the others coincide with it: one line, their gap said
    gap = max(float(np.max(np.abs(np.array(d["loss"]) - ref) / np.abs(ref))) for d in log.values())
    ax.plot(ref, lw=1, label=textwrap.fill(f"all {len(log)} systems, one curve: {', '.join(log)}", 60) +
            f"\n(largest relative loss difference from the eager tape: {gap:.1e})")
    ax.set(xlabel="Adam step", ylabel="cross-entropy", title=f"character transformer: the same run {len(log)} ways")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "transformer_loss.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (a, b), diffs in pairs.items():
        if any(diffs):   # a bit-identical pair has nothing to draw on a log scale (said in the table)
            ax.semilogy([max(x, 1e-17) for x in diffs], label=f"{a} vs {b}", lw=1)
    cfg = r["cfg"]
    ax.set(xlabel="Adam step", ylabel="max relative gradient difference")
    ax.set_title(f"character transformer (width {cfg['d']}, {cfg['heads']} heads, context {cfg['T']}), float64:\n"
                 f"how far apart the three systems' gradients are", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "transformer_grad.png"), dpi=120)
    save(out_dir, "transformer", markdown(r))


def markdown(r):
    cfg, log, pairs = r["cfg"], r["log"], r["pairs"]
    lines = [f"character transformer: vocab {r['vocab']}, context {cfg['T']}, width {cfg['d']}, "
             f"{cfg['heads']} heads, MLP {cfg['hidden']}, batch {cfg['batch']}, {cfg['steps']} Adam steps "
             f"(lr {cfg['lr']}), float64; {r['nodes']} tape nodes per episode",
             f"CPU: {cpu_model()}; BLAS: {blas_kernel()}", "",
             "| system | µs per step (median) | final loss |", "|---|---:|---:|"]
    for name, d in log.items():
        lines.append(f"| {name} | {np.median(d['us'][1:] or d['us']):,.0f} | {d['loss'][-1]:.6f} |")
    ep, ref = log["program_episode in jax.jit"]["loss"], log["eager tape"]["loss"]
    lines += ["", f"program_episode in jax.jit (the one-hot form of the same model) vs the eager tape: max rel. "
              f"loss difference over the run {max(abs(a - b) / abs(b) for a, b in zip(ep, ref)):.1e}"]
    lines += ["", "| pair | max rel. gradient difference, step 1 | … at the last step | losses equal (`==`) "
              "at every step |", "|---|---:|---:|---|"]
    for (a, b), diffs in pairs.items():
        same = all(x == y for x, y in zip(log[a]["loss"], log[b]["loss"]))
        lines.append(f"| {a} vs {b} | {diffs[0]:.1e} | {diffs[-1]:.1e} | {'yes' if same else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    return run(QUICK if args.quick else FULL, args.out)


if __name__ == "__main__":
    main()
