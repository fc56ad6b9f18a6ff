"""interop.train_step against jax.jit(value_and_grad + optax update) on the SAME flax models.

train_step runs optax.adam natively: forward, backward and the update are one custom call of the
captured program, on optax's own state. Its other form (native_update=False: the forward and backward
as one custom call, optax's update in XLA) is timed beside it. Side by side in one process (median of
interleaved repeats), per call and inside a jitted lax.scan over 100 steps (100 different batches),
and ``step.scan`` (the same 100 steps as one custom call; its largest relative difference from the
lax.scan's state is printed); float64. The losses of
jit and the native step over 100 steps are compared (max relative difference). ``--quick``: fewer
repeats.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager import side_by_side  # noqa: E402
from mlp import blas_kernel, cpu_model  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import flax.linen as nn  # noqa: E402

import interop  # noqa: E402

F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}


class MLP(nn.Module):
    widths: tuple

    @nn.compact
    def __call__(self, x):
        for w in self.widths[:-1]:
            x = jnp.tanh(nn.Dense(w, **F64)(x))
        return nn.Dense(self.widths[-1], **F64)(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Conv(8, (3, 3), **F64)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10, **F64)(x.reshape(x.shape[0], -1))


class Encoder(nn.Module):
    d: int = 32

    @nn.compact
    def __call__(self, x):
        T = x.shape[1]
        h = nn.LayerNorm(**F64)(x)
        a = nn.MultiHeadDotProductAttention(num_heads=4, **F64)(h, h, mask=nn.make_causal_mask(jnp.ones((1, T))))
        x = x + a
        h = nn.LayerNorm(**F64)(x)
        x = x + nn.Dense(self.d, **F64)(jax.nn.gelu(nn.Dense(4 * self.d, **F64)(h)))
        return nn.Dense(10, **F64)(x.mean(axis=1))


def models(rng):
    yield "flax MLP tiny (32; 16-32-32-4)", MLP((32, 32, 4)), rng.standard_normal((32, 16)), 4
    yield "flax MLP small (64; 64-128-128-10)", MLP((128, 128, 10)), rng.standard_normal((64, 64)), 10
    yield "flax CNN (8 × 1×12×12, conv 8, pool, dense 10)", CNN(), rng.standard_normal((8, 12, 12, 1)), 10
    yield "flax encoder block (d 32, T 16, batch 8, 4 heads)", Encoder(), rng.standard_normal((8, 16, 32)), 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps, inner = (3, 20) if args.quick else (11, 100)
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model()}; BLAS: {blas_kernel()}; jax {jax.__version__}\n")
    print("| model | jit µs/step | train_step µs/step | speed-up | (update in XLA) | scan of 100: jit ms | "
          "train_step ms | speed-up | (update in XLA) | step.scan ms | speed-up | max rel loss diff (100 steps) | "
          "step.scan vs lax.scan |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, model, x, classes in models(rng):
        x = jnp.asarray(x)
        y = jnp.asarray(rng.integers(0, classes, x.shape[0]))
        params = model.init(jax.random.key(0), x)["params"]
        opt = optax.adam(1e-3)

        def loss(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

        def ref_step(state, x, y):
            p, s = state
            val, g = jax.value_and_grad(loss)(p, x, y)
            u, s = opt.update(g, s, p)
            return val, (optax.apply_updates(p, u), s)
        ref = jax.jit(ref_step, donate_argnums=0)
        ours, s0 = interop.train_step(loss, params, x, y, optimizer=opt)
        assert ours.native_update, ours.why
        xla, s1 = interop.train_step(loss, params, x, y, optimizer=opt, native_update=False)
        states = {"jit": (jax.tree.map(jnp.array, params), opt.init(params)), "ours": s0, "xla": s1}
        steps = {"jit": ref, "ours": ours, "xla": xla}

        def runner(step, key):
            def run():
                v, states[key] = step(states[key], x, y)
                v.block_until_ready()
            return run
        losses = {}
        for key, step in (("jit", ref), ("ours", ours)):
            st = (jax.tree.map(jnp.array, params), opt.init(params))
            out = []
            for _ in range(100):
                v, st = step(st, x, y)
                out.append(float(v))
            losses[key] = np.array(out)
        diff = float(np.max(np.abs(losses["jit"] - losses["ours"]) / np.abs(losses["jit"])))
        t = side_by_side({k: runner(step, k) for k, step in steps.items()}, reps, inner)

        # 100 steps on 100 different batches (x permuted, labels drawn), as a training loop sees them
        xs = jnp.stack([x[rng.permutation(x.shape[0])] for _ in range(100)])
        ys = jnp.asarray(rng.integers(0, classes, (100, x.shape[0])))

        def scanned(step_fn):
            @jax.jit
            def run100(state):
                return jax.lax.scan(lambda s, b: step_fn(s, *b)[::-1], state, (xs, ys))
            return run100
        scans = {"jit": scanned(ref_step), "ours": scanned(ours), "xla": scanned(xla),
                 "scan": lambda s: ours.scan(s, xs, ys)}
        sstate = {k: (jax.tree.map(jnp.array, params), opt.init(params)) for k in scans}
        a = jax.tree.leaves(scans["ours"]((jax.tree.map(jnp.array, params), opt.init(params))))
        b = jax.tree.leaves(scans["scan"]((jax.tree.map(jnp.array, params), opt.init(params))))
        gap = max(float(jnp.max(jnp.abs(u - v))) / max(1.0, float(jnp.max(jnp.abs(u)))) for u, v in zip(a, b))
        assert gap <= 1e-9, f"step.scan differs from lax.scan of the step by {gap:.1e}"   # (100 Adam steps)

        def srunner(key):
            def run():
                sstate[key], v = scans[key](sstate[key])
                v.block_until_ready()
            return run
        ts = side_by_side({k: srunner(k) for k in scans}, reps, max(1, inner // 20))
        print(f"| {name} | {t['jit']:.1f} | {t['ours']:.1f} | {t['jit'] / t['ours']:.2f}× | "
              f"{t['jit'] / t['xla']:.2f}× | {ts['jit'] / 1e3:.2f} | {ts['ours'] / 1e3:.2f} | "
              f"{ts['jit'] / ts['ours']:.2f}× | {ts['jit'] / ts['xla']:.2f}× | {ts['scan'] / 1e3:.2f} | "
              f"{ts['jit'] / ts['scan']:.2f}× | {diff:.1e} | {gap:.1e} |")


if __name__ == "__main__":
    main()
