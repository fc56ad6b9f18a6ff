"""Per-example logistic regression recorded once on a scalar tape, emitted as C, run over a dataset.

The loss of one row (30 features of sklearn's breast-cancer data, standardised) is recorded on
one-element Vars with the row's features and label as data leaves bound to ``v[j]``; ``c_grad`` emits it
as one C function, gcc compiles it, and a small C loop sums the loss and gradient over all rows. The
same formula on the tensor tape (``X @ w + b`` over the whole batch) is the reference:

- the summed gradients agree within ``n·eps·Σ_i |∂ℓ_i/∂θ_j|`` per coordinate (the classical bound for
  summing n terms; the two sides also round the dot products in different orders, and glibc's exp/log
  may differ from NumPy's by an ulp, which stays far inside it);
- time per example: the scalar tape (one episode per row), the tensor tape (one batched episode) and
  the emitted C.

Run: ``.venv/bin/python experiments/bench/emit_logreg.py`` (a few seconds; needs a C compiler).
"""
import ctypes
import pathlib
import shutil
import subprocess
import tempfile
import time

import numpy as np
from sklearn.datasets import load_breast_cancer

import tapegrad as tg
from tapegrad.emit import c_grad

DRIVER = """
double grad_sum(const double *p, double *g, const double *rows, long n, long stride)
{
    double loss = 0.0;
    for (long i = 0; i < n; i++)
        loss += grad(p, g, rows + i * stride);
    return loss;
}
"""


def bce(z, y):
    """Binary cross-entropy from logits, stable for any z; the same code on scalars and tensors."""
    return z.relu() - z * y + (1.0 + (-z.abs()).exp()).log()


def scalar_episode(w0, b0, row=None):
    """The per-example loss on a fresh scalar tape (placeholder data when row is None)."""
    d = len(w0)
    row = np.zeros(d + 1) if row is None else row
    tape = tg.Tape()
    w = [tape.param(np.array(w0[j])) for j in range(d)]
    b = tape.param(np.array(b0))
    x = [tape.const(np.array(row[j])) for j in range(d + 1)]
    z = w[0] * x[0]
    for j in range(1, d):
        z = z + w[j] * x[j]
    loss = bce(z + b, x[d])
    return tape, w + [b], x, loss


def tensor_episode(X, y, w0, b0):
    tape = tg.Tape()
    w, b = tape.param(w0.reshape(-1, 1)), tape.param(np.array([b0]))
    loss = bce(tape.const(X) @ w + b, tape.const(y.reshape(-1, 1))).sum()
    tape.backward(loss)
    return float(tape.value(loss)), np.r_[tape.grad(w).ravel(), tape.grad(b)]


def best(f, repeat):
    """The fastest of ``repeat`` runs, in seconds (the machine is shared: the minimum is the signal)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    X, y = load_breast_cancer(return_X_y=True)
    y = y.astype(np.float64)
    X = (X - X.mean(0)) / X.std(0)
    n, d = X.shape
    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal(d) * 0.3, 0.1
    rows = np.ascontiguousarray(np.c_[X, y])

    tape, params, x, loss = scalar_episode(w0, b0)
    src = c_grad(tape, loss, params, {v: f"v[{j}]" for j, v in enumerate(x)}, with_data=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("emit_logreg: no C compiler on PATH")
    tmp = pathlib.Path(tempfile.mkdtemp())
    (tmp / "logreg.c").write_text(src + DRIVER)
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    "-o", str(tmp / "logreg.so"), str(tmp / "logreg.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(tmp / "logreg.so"))
    dp = ctypes.POINTER(ctypes.c_double)
    lib.grad.restype = lib.grad_sum.restype = ctypes.c_double
    lib.grad.argtypes = [dp, dp, dp]
    lib.grad_sum.argtypes = [dp, dp, dp, ctypes.c_long, ctypes.c_long]
    p = np.r_[w0, b0]
    ptr = lambda a: a.ctypes.data_as(dp)  # noqa: E731

    g_c = np.zeros(d + 1)
    loss_c = lib.grad_sum(ptr(p), ptr(g_c), ptr(rows), n, d + 1)
    loss_t, g_t = tensor_episode(X, y, w0, b0)

    # Σ_i |∂ℓ_i/∂θ_j|, from the emitted function one row at a time: the scale of the summation bound.
    scale, gi = np.zeros(d + 1), np.zeros(d + 1)
    for i in range(n):
        gi[:] = 0.0
        lib.grad(ptr(p), ptr(gi), ptr(rows[i]))
        scale += np.abs(gi)
    eps = np.finfo(np.float64).eps
    err = np.abs(g_c - g_t) / (scale * eps)
    print(f"breast cancer: n = {n} rows, d = {d} features; per-example tape of {len(tape)} nodes, "
          f"emitted C {len(src.splitlines())} lines")
    print(f"loss sum: emitted C {loss_c!r}, tensor tape {loss_t!r} (|diff| = {abs(loss_c - loss_t):.1e})")
    print(f"gradient: max_j |g_C − g_tape| / (eps · Σ_i |∂ℓ_i/∂θ_j|) = {err.max():.2f}  (bound n = {n})")
    assert err.max() <= n, "summed gradients outside the stated bound"

    k = 40  # scalar-tape episodes timed (each one row)
    t_scalar = best(lambda: _scalar_rows(w0, b0, rows, k), 3) / k
    t_tensor = best(lambda: tensor_episode(X, y, w0, b0), 20) / n
    g = np.zeros(d + 1)
    t_c = best(lambda: lib.grad_sum(ptr(p), ptr(g), ptr(rows), n, d + 1), 200) / n
    row_ptrs = [ptr(r) for r in rows]
    t_ffi = best(lambda: [lib.grad(ptr(p), ptr(g), r) for r in row_ptrs], 5) / n
    print()
    print(f"| {'per example, forward + gradient':<42} | {'µs':>9} | {'× emitted C':>11} |")
    print(f"|{'-' * 44}|{'-' * 11}|{'-' * 13}|")
    for label, t in (("scalar tape (one episode per row)", t_scalar),
                     ("tensor tape (one batched episode)", t_tensor),
                     ("emitted C, one ctypes call per row", t_ffi),
                     ("emitted C (gcc -O2), loop in C", t_c)):
        print(f"| {label:<42} | {t * 1e6:>9.3f} | {t / t_c:>11.1f} |")


def _scalar_rows(w0, b0, rows, k):
    for i in range(k):
        tape, _, _, loss = scalar_episode(w0, b0, rows[i])
        tape.backward(loss)


if __name__ == "__main__":
    main()
