"""The MLP every demo and benchmark trains: ReLU hidden layers, mean softmax cross-entropy, Adam.

One definition per system (tape, NumPy by hand lives in bench_eager, jax.numpy), so the systems the
benchmarks compare are the same model.
"""
import numpy as np

import tapegrad as tg


def init(sizes, seed=0):
    """[W1, b1, W2, b2, …]: uniform in ±√(6/fan_in), zero biases."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params += [rng.uniform(-1.0, 1.0, (fan_in, fan_out)) * np.sqrt(6.0 / fan_in), np.zeros(fan_out)]
    return params


def data(batch, sizes, seed=1):
    """A random minibatch and one-hot labels."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, sizes[0])), np.eye(sizes[-1])[rng.integers(0, sizes[-1], batch)]


def batches(cfg, seed=1):
    """``cfg["steps"]`` minibatches of ``cfg["batch"]`` rows for an MLP of ``cfg["sizes"]``, one-hot labels."""
    rng = np.random.default_rng(seed)
    n, c = cfg["sizes"][0], cfg["sizes"][-1]
    return [(rng.standard_normal((cfg["batch"], n)), np.eye(c)[rng.integers(0, c, cfg["batch"])])
            for _ in range(cfg["steps"])]


def logits(h, params):
    """The MLP on a tape: ``h`` a Var (or anything with ``@``, ``+``, ``.relu()``)."""
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = h.relu()
    return h


def tape_loss(tape, params, x, y):
    """One episode on ``tape``; ``x``/``y`` are arrays (copied in as constants) or const Vars."""
    x = x if isinstance(x, tg.Var) else tape.const(x)
    return tg.softmax_cross_entropy(logits(x, params), y)


def jax_loss(params, x, y):
    """The same loss in jax.numpy (imports jax through interop, on first use)."""
    from interop import jax, jnp
    h = x
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = jax.nn.relu(h)
    return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(h, axis=-1), axis=-1))


def predict(param_arrays, X):
    """Class predictions in plain NumPy (for test accuracy)."""
    h = X
    for k in range(0, len(param_arrays), 2):
        h = h @ param_arrays[k] + param_arrays[k + 1]
        if k + 2 < len(param_arrays):
            h = np.maximum(h, 0.0)
    return h.argmax(axis=1)


def blas_kernel():
    """Which OpenBLAS kernel NumPy runs (e.g. "SkylakeX"), for benchmark headers.

    This machine sets ``OPENBLAS_CORETYPE=Haswell`` for the sake of older OpenBLAS builds, which costs
    a current NumPy its AVX-512 GEMM (115 vs 148 GFLOP/s at 2048²); ``make bench`` unsets it (and
    ``OPENBLAS_L2_SIZE``) for the benchmarks only, tests and CI keep the machine's setting.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown"
    return ", ".join(f"{i['internal_api']} {i.get('architecture', '?')} ×{i['num_threads']}"
                     for i in threadpool_info() if i["user_api"] == "blas") or "none"


def cpu_model():
    """The CPU's model name and core count (from /proc/cpuinfo on Linux), for benchmark headers."""
    import os
    import platform
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        isa = [x for x in ("avx512f", "avx2") if f" {x} " in text]
        flags = f", {isa[0].upper().replace('F', '')}" if isa else ", no AVX2"
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores{flags})"
