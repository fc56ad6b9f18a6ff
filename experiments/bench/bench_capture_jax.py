"""interop.train_step against jax.jit(value_and_grad + optax update) on the SAME flax/equinox models.

float32 by default (JAX's 64-bit mode off, flax's default dtype: what JAX users train in); ``--dtype
float64`` is the second table. train_step runs optax.adam natively: forward, backward and the update are
one custom call of the captured program, on optax's own state. Four forms, each against its jax.jit
counterpart, side by side in one process (median of interleaved repeats):

- per call: ``step(state, x, y)`` against ``jax.jit(step)``, both donating their state;
- in a jitted ``lax.scan`` over S steps with a new batch each step (the same scan body around both);
- ``step.scan`` (the same S steps as one custom call) against jit's ``lax.scan``;
- ``jax.jit(interop.value_and_grad(loss))`` against ``jax.jit(jax.value_and_grad(loss))`` (no update).

One thread on each side: XLA without its multi-threaded Eigen and with a one-thread intra-op pool,
OpenBLAS (the BLAS tapegrad's products call) at one thread. ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE``
(set on some machines for old BLAS builds) are unset by re-executing this script without them, as
``make bench`` does. Also printed per model: how long capture took (``train_step`` built, its three-step
check included; ``--cold``: in an empty build cache) against XLA's lower + compile of the reference step,
the same ``train_step`` made again in the process (it takes the shared capture), the lines of generated
C, and memory: XLA's buffers (``memory_analysis``: arguments + temporaries + outputs − aliased) against
the program's own buffers (values, gradients, scratch, optimizer state; the intermediates assigned by
liveness, each byte counted once).

``--quick``: a few models, fewer repeats. ``--sweep``: the encoders and decoders at every
L 1/2/4 × d 64/128 × T 32/128 × B 8/32. ``--only REGEX``: models whose name matches.
"""
import os
import sys

_UNSET = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(v in os.environ for v in _UNSET):   # before NumPy loads OpenBLAS: benchmarks run its own kernel choice
    os.execve(sys.executable, [sys.executable] + sys.argv, {k: v for k, v in os.environ.items() if k not in _UNSET})
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # its group's modules, then experiments/: mlp, plots, progress
from bench_eager import timeit  # noqa: E402
from mlp import blas_kernel, cpu_model  # noqa: E402

DT = {}   # {"param_dtype": ..., "dtype": ...} for flax modules, set by main() from --dtype


def flax_models():
    import jax
    import jax.numpy as jnp
    import flax.linen as nn

    class MLP(nn.Module):
        widths: tuple

        @nn.compact
        def __call__(self, x):
            for w in self.widths[:-1]:
                x = jnp.tanh(nn.Dense(w, **DT)(x))
            return nn.Dense(self.widths[-1], **DT)(x)

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.nn.relu(nn.Conv(16, (3, 3), **DT)(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = jax.nn.relu(nn.Conv(32, (3, 3), **DT)(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10, **DT)(x.reshape(x.shape[0], -1))

    class Block(nn.Module):
        d: int
        causal: bool

        @nn.compact
        def __call__(self, x):
            T = x.shape[1]
            mask = nn.make_causal_mask(jnp.ones((1, T))) if self.causal else None
            h = nn.LayerNorm(**DT)(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, **DT)(h, h, mask=mask)
            h = nn.LayerNorm(**DT)(x)
            return x + nn.Dense(self.d, **DT)(jax.nn.gelu(nn.Dense(4 * self.d, **DT)(h)))

    class Encoder(nn.Module):
        layers: int
        d: int

        @nn.compact
        def __call__(self, x):
            for _ in range(self.layers):
                x = Block(self.d, False)(x)
            return nn.Dense(10, **DT)(nn.LayerNorm(**DT)(x).mean(axis=1))

    class Decoder(nn.Module):
        """A language model: token and position embeddings, causal blocks, logits over the vocabulary."""
        layers: int
        d: int
        vocab: int = 128

        @nn.compact
        def __call__(self, tokens):
            T = tokens.shape[1]
            x = nn.Embed(self.vocab, self.d, **DT)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (T, self.d), DT["param_dtype"])
            for _ in range(self.layers):
                x = Block(self.d, True)(x)
            return nn.Dense(self.vocab, **DT)(nn.LayerNorm(**DT)(x))

    return MLP, CNN, Encoder, Decoder


def lstm_model(hidden, features, classes):
    """An equinox LSTMCell run over the sequence by lax.scan (vmapped over the batch), a linear head."""
    import jax
    import jax.numpy as jnp
    import equinox as eqx
    key = jax.random.key(1)
    k1, k2 = jax.random.split(key)
    dt = DT["param_dtype"]
    cell = eqx.nn.LSTMCell(features, hidden, key=k1, dtype=dt)
    head = eqx.nn.Linear(hidden, classes, key=k2, dtype=dt)
    params, static = eqx.partition((cell, head), eqx.is_array)

    def apply(p, x):           # x: (B, T, F)
        cell_, head_ = eqx.combine(p, static)

        def one(seq):
            h0 = (jnp.zeros(hidden, dt), jnp.zeros(hidden, dt))
            (h, _), _ = jax.lax.scan(lambda hc, xt: (cell_(xt, hc), None), h0, seq)
            return head_(h)
        return jax.vmap(one)(x)
    return params, apply


def models(rng, quick, sweep):
    """(name, params, apply(params, x), x, y of shape (B,) or (B, T), classes)."""
    import jax
    MLP, CNN, Encoder, Decoder = flax_models()

    def flax(name, module, x, classes, y_shape=None):
        params = module.init(jax.random.key(0), x)["params"]
        y = rng.integers(0, classes, y_shape or x.shape[:1])
        return name, params, lambda p, x_: module.apply({"params": p}, x_), x, y, classes

    f = rng.standard_normal
    yield flax("MLP 16-32-32-4 b32", MLP((32, 32, 4)), f((32, 16)), 4)
    yield flax("MLP 64-128-128-10 b64", MLP((128, 128, 10)), f((64, 64)), 10)
    if not quick:
        yield flax("MLP 784-512-512-10 b128", MLP((512, 512, 10)), f((128, 784)), 10)
    yield flax("CNN 28x28 conv16/32 b32", CNN(), f((32, 28, 28, 1)), 10)
    grid = [(L, d, T, B) for L in (1, 2, 4) for d in (64, 128) for T in (32, 128) for B in (8, 32)] if sweep else \
        [(2, 64, 32, 8)] if quick else [(1, 64, 32, 8), (2, 64, 32, 8), (4, 128, 32, 8), (2, 64, 128, 32)]
    for L, d, T, B in grid:
        yield flax(f"encoder L{L} d{d} T{T} B{B}", Encoder(L, d), f((B, T, d)), 10)
    for L, d, T, B in grid:
        yield flax(f"decoder L{L} d{d} T{T} B{B}", Decoder(L, d), rng.integers(0, 128, (B, T)), 128, (B, T))
    B, T, F, H = 32, 32, 16, 64
    params, apply = lstm_model(H, F, 10)
    yield f"eqx LSTM h{H} T{T} B{B} (lax.scan)", params, apply, f((B, T, F)), rng.integers(0, 10, B), 10


def side_by_side(fns, reps, inner):
    """Interleave the systems repeat by repeat: {name: [µs per call of each repeat]}."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            time.sleep(0.01)
            times[k] += timeit(fn, 1, inner)
    return times


def ratio(times, base, other):
    """median of base / median of other, and the spread of the per-repeat ratios (10th-90th percentile)."""
    r = np.array(times[base]) / np.array(times[other])
    return float(np.median(times[base]) / np.median(times[other])), float(np.percentile(r, 10)), \
        float(np.percentile(r, 90))


def fmt(r):
    return f"{r[0]:.2f}× ({r[1]:.2f}–{r[2]:.2f})"


def xla_bytes(compiled):
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def bench_one(name, params, apply, x, y, reps, dt, target_s):
    import jax
    import jax.numpy as jnp
    import optax
    import interop

    x, y = jnp.asarray(x if x.dtype.kind in "iu" else x.astype(dt)), jnp.asarray(y)
    opt = optax.adam(1e-3)

    def loss(p, x_, y_):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x_), y_).mean()

    def ref_step(state, x_, y_):
        p, s = state
        val, g = jax.value_and_grad(loss)(p, x_, y_)
        u, s = opt.update(g, s, p)
        return val, (optax.apply_updates(p, u), s)

    fresh = lambda: (jax.tree.map(jnp.array, params), opt.init(params))  # noqa: E731
    t0 = time.perf_counter()
    ref = jax.jit(ref_step, donate_argnums=0)
    compiled = ref.lower(fresh(), x, y).compile()
    t_xla = time.perf_counter() - t0
    jit_bytes = xla_bytes(compiled)
    t0 = time.perf_counter()
    ours, _ = interop.train_step(loss, params, x, y, optimizer=opt)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()   # the same step made again in this process: the shared capture
    again, _ = interop.train_step(loss, params, x, y, optimizer=opt)
    t_again = time.perf_counter() - t0
    assert again.captured is ours.captured
    if not ours.native_update:    # measured anyway (the forward and backward native, optax's update in XLA)
        print(f"<!-- {name}: train_step runs optax's update in XLA: {ours.why} -->", flush=True)
    runner = ours.captured.program.runner
    lines = runner.source.count("\n")
    our_bytes = runner.nbytes()   # its intermediates by liveness (train_step captures with memory="reuse")
    t0 = time.perf_counter()
    vg_ours = jax.jit(interop.value_and_grad(loss, params, x, y))
    t_vg = time.perf_counter() - t0
    vg_ref = jax.jit(jax.value_and_grad(loss))

    # per call
    states = {"jit": fresh(), "ours": fresh()}
    steps = {"jit": compiled, "ours": ours}

    def runner_of(key):
        def run():
            v, states[key] = steps[key](states[key], x, y)
            v.block_until_ready()
        return run
    for k in steps:       # warm up (the first native call verifies the program)
        runner_of(k)()
    one = min(timeit(runner_of("jit"), 1, 1)[0], timeit(runner_of("ours"), 1, 1)[0])
    inner = max(1, int(target_s * 1e6 / max(one, 1.0)))
    t_call = side_by_side({k: runner_of(k) for k in steps}, reps, inner)

    # jax.jit(interop.value_and_grad) against jax.jit(jax.value_and_grad)
    p0 = fresh()[0]
    vgs = {"jit": lambda: jax.block_until_ready(vg_ref(p0, x, y)),
           "ours": lambda: jax.block_until_ready(vg_ours(p0, x, y))}
    for f in vgs.values():
        f()
    t_vg_run = side_by_side(vgs, reps, inner)

    # S steps on S different batches (x permuted, labels drawn), as a training loop sees them
    S = int(np.clip(target_s * 2e6 / max(one, 1.0), 5, 100))
    rng = np.random.default_rng(1)
    xs = jnp.stack([x[rng.permutation(x.shape[0])] for _ in range(S)])
    ys = jnp.asarray(rng.integers(0, int(y.max()) + 1, (S,) + y.shape))

    def scanned(step_fn):
        @jax.jit
        def run(state):
            return jax.lax.scan(lambda s, b: step_fn(s, *b)[::-1], state, (xs, ys))
        return run
    scans = {"jit": scanned(ref_step), "ours": scanned(ours), "scan": lambda s: ours.scan(s, xs, ys)}
    sstate = {k: fresh() for k in scans}
    a = jax.tree.leaves(scans["ours"](fresh()))
    b = jax.tree.leaves(scans["scan"](fresh()))
    gap = max(float(jnp.max(jnp.abs(u - v))) / max(1.0, float(jnp.max(jnp.abs(u)))) for u, v in zip(a, b))
    # the same program either way; float32 Adam steps amplify last-bit differences of the two call paths
    assert gap <= (1e-9 if dt == "float64" else 1e-2), f"step.scan differs from lax.scan of the step by {gap:.1e}"
    # the loss curves over the S steps: jit's and ours (float rounding apart, the same training)
    lj = np.asarray(scans["jit"](fresh())[1], np.float64)
    lo = np.asarray(scans["ours"](fresh())[1], np.float64)
    diff = float(np.max(np.abs(lj - lo) / np.abs(lj)))

    def srunner(key):
        def run():
            sstate[key], v = scans[key](sstate[key])
            v.block_until_ready()
        return run
    for k in scans:
        srunner(k)()
    t_scan = side_by_side({k: srunner(k) for k in scans}, reps, max(1, inner // S))
    return {
        "name": name, "jit_us": float(np.median(t_call["jit"])), "ours_us": float(np.median(t_call["ours"])),
        "call": ratio(t_call, "jit", "ours"), "lax_scan": ratio(t_scan, "jit", "ours"),
        "step_scan": ratio(t_scan, "jit", "scan"), "vg": ratio(t_vg_run, "jit", "ours"), "S": S,
        "t_xla": t_xla, "t_ours": t_ours, "t_again": t_again, "t_vg": t_vg, "lines": lines,
        "jit_mb": jit_bytes / 2**20, "ours_mb": our_bytes / 2**20, "diff": diff, "gap": gap,
        "native": ours.native_update}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--quick", action="store_true", help="a few models, fewer repeats")
    ap.add_argument("--sweep", action="store_true", help="encoders and decoders at every L/d/T/B")
    ap.add_argument("--only", default=None, help="models whose name matches this regular expression")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--cold", action="store_true", help="capture into an empty build cache")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 11)
    target = 0.05 if args.quick else 0.15
    if args.cold:
        os.environ["TAPEGRAD_CACHE"] = tempfile.mkdtemp(prefix="tg-bench-cache-")
    import jax
    import jax.numpy as jnp
    from threadpoolctl import threadpool_limits
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    DT.update(param_dtype=getattr(jnp, args.dtype), dtype=getattr(jnp, args.dtype))
    threadpool_limits(1, user_api="blas")
    import flax
    from tapegrad.native import build
    cc = build.compiler_identity(build.find_compiler(), *build.cc_args()).splitlines()[1]
    print(f"CPU: {cpu_model()}; BLAS: {blas_kernel()}; XLA: one thread (Eigen single-threaded, intra-op pool of "
          f"1); jax {jax.__version__}, flax {flax.__version__}; {args.dtype}; C compiler: {cc}; "
          f"{'cold' if args.cold else 'warm'} build cache; load average at start "
          f"{os.getloadavg()[0]:.1f}\n")
    print("Speed-up of tapegrad over jax.jit (> 1: tapegrad faster), median of the per-repeat ratio "
          "(10th–90th percentile)\n")
    print("| model | jit µs/step | train_step µs/step | per call | in lax.scan (S steps) | step.scan | "
          "jit(interop.value_and_grad) | max rel loss diff | step.scan vs lax.scan |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    rows = []
    for name, params, apply, x, y, _ in models(rng, args.quick, args.sweep):
        if args.only and not re.search(args.only, name):
            continue
        r = bench_one(name, params, apply, x, y, reps, args.dtype, target)
        rows.append(r)
        print(f"| {name}{'' if r['native'] else ' (update in XLA)'} | {r['jit_us']:.1f} | {r['ours_us']:.1f} | {fmt(r['call'])} | {fmt(r['lax_scan'])} "
              f"(S={r['S']}) | {fmt(r['step_scan'])} | {fmt(r['vg'])} | {r['diff']:.1e} | {r['gap']:.1e} |",
              flush=True)
    print("\nCapture cost and memory\n")
    print("| model | XLA lower + compile s | train_step s (3-step check included) | train_step again s | "
          "jit(interop.value_and_grad) s | C lines | jit MB | program MB | memory ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['t_xla']:.1f} | {r['t_ours']:.1f} | {r['t_again']:.2f} | {r['t_vg']:.1f} | "
              f"{r['lines']:,} | {r['jit_mb']:.1f} | {r['ours_mb']:.1f} | {r['ours_mb'] / r['jit_mb']:.1f}× |")
    print(f"\npeak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
