"""How far the native C forms of the special functions are from the tape (NumPy/SciPy), in ulp.

Each special-family op is recorded on 100,000 inputs from its test domain and from a wider range, captured
natively, and its value and gradient compared element by element with the tape's. Prints a Markdown
table: the largest ulp distance and the largest |Δ| / (eps · max(1, |tape|)) (which stays small where
a result cancels to near zero, e.g. digamma near its root 1.4616…).

    PYTHONPATH=$PWD python experiments/studies/special_ulps.py
"""
import numpy as np

import tapegrad as tg
from tapegrad import ops as O

EPS = np.finfo(np.float64).eps
SPECIAL = ("log1p", "expm1", "erf", "erfc", "lgamma", "digamma", "sin", "cos", "tan", "atan2", "asinh", "softplus",
           "log_sigmoid")
WIDE = {"log1p": (-0.999, 1e3), "lgamma": (1e-3, 1e3), "digamma": (1e-3, 1e3), "tan": (-1.5, 1.5),
        "softplus": (-800.0, 800.0), "log_sigmoid": (-800.0, 800.0)}


def ulps(x, y):
    i, j = (np.asarray(v, np.float64).view(np.int64) for v in (x, y))
    i, j = (np.where(k < 0, -(k & 0x7FFFFFFFFFFFFFFF), k) for k in (i, j))
    return np.where(x == y, 0, np.abs(i - j))


def measure(op, a, b):
    tape = tg.Tape()
    va = tape.param(a)
    vb = tape.param(b) if b is not None else None
    y = tape.apply(op, va, vb, None)
    loss = (y * tape.const(np.ones(y.shape))).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    rows = []
    for got, want in ((prog.value(y), tape.value(y)), (prog.grad(va), tape.grad(va))):
        ok = np.isfinite(want)
        u = ulps(got[ok], want[ok])
        rel = np.abs(got[ok] - want[ok]) / np.maximum(1.0, np.abs(want[ok])) / EPS
        rows.append((int(u.max()), float(rel.max())))
    return rows


def main():
    rng = np.random.default_rng(0)
    n = 100_000
    print("| op | range | value: max ulp | value: max abs/eps·max(1,|x|) | grad: max ulp | grad: max abs/eps |")
    print("|---|---|---:|---:|---:|---:|")
    for name in SPECIAL:
        op = O.OPS[name]
        for r in (None, WIDE.get(op.name, (-30.0, 30.0))):
            if r is None:
                a = op.domain[0](rng, (n,))
                b = op.domain[1](rng, (n,)) if op.arity == 2 else None
            else:
                a = rng.uniform(*r, n)
                b = rng.uniform(*r, n) if op.arity == 2 else None
            (vu, vr), (gu, gr) = measure(op, a, b)
            rng_txt = "test domain" if r is None else f"uniform({r[0]:g}, {r[1]:g})"
            print(f"| `{op.name}` | {rng_txt} | {vu} | {vr:.1f} | {gu} | {gr:.1f} |")


if __name__ == "__main__":
    main()
