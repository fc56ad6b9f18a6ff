"""The coefficients of the native runtime's float32 erf (tapegrad/native/runtime_vmath.c, tg_erf_f).

Below |x| = 0.875, erf(x) = x + x·P(x²) with P ≈ erf(x)/x − 1; above, erf(x) = 1 − e^(−x²)·Q(1/x) with
Q ≈ erfc(x)·e^(x²), up to |x| = 4 (erf rounds to 1 in float from 3.92 on). Each polynomial is fitted by
least squares on 4000 Chebyshev nodes, weighted to the relative error of erf(x)/x and of Q, against SciPy's double-precision erf
and erfc; the coefficients are rounded to float32. Prints them as C literals and the largest error of the
float evaluation (every step rounded to float32, as the C computes it) in ulps of the exact value.

    python experiments/studies/fit_erf32.py
"""
import numpy as np
from scipy.special import erf, erfc

F = np.float32
SPLIT, TOP = 0.875, 4.0


def fit(f, lo, hi, deg, var, scale):
    """f ≈ Σ c_i var(t)^i on [lo, hi], the residuals weighted by 1/scale(t) (the size of what they err in)"""
    t = np.cos(np.pi * (np.arange(4000) + 0.5) / 4000) * (hi - lo) / 2 + (hi + lo) / 2
    w = 1.0 / scale(t)
    c, *_ = np.linalg.lstsq(np.vander(var(t), deg + 1, increasing=True) * w[:, None], f(t) * w, rcond=None)
    return [F(x) for x in c]


def horner(c, z):
    p = np.full_like(z, c[-1])
    for a in reversed(c[:-1]):
        p = p * z + a
    return p


def exp32(x):
    """The runtime's float exp, step for step (tg_exp_f)."""
    xc = np.minimum(np.maximum(x, F(-104)), F(89))
    shift = F(12582912.0)
    t = xc * F(1.4426950408889634) + shift
    kd = t - shift
    k = t.view(np.int32) - shift.view(np.int32)
    r = (xc - kd * F(0.693145751953125)) - kd * F(1.428606765330187e-06)
    p = F(1) / F(5040)
    for c in (720, 120, 24, 6):
        p = p * r + F(1) / F(c)
    p = (p * r + F(0.5)) * r
    em1 = p * r + r
    k1 = k >> 1
    pow2 = lambda j: ((j.astype(np.int64) + 127) << 23).astype(np.uint32).view(np.float32)  # noqa: E731
    return ((em1 + F(1)) * pow2(k1)) * pow2(k - k1)


def lit(v):
    s = np.format_float_positional(v, unique=True, trim="-") if abs(v) >= 1e-4 else \
        np.format_float_scientific(v, unique=True, trim="-")
    assert F(float(s)) == v
    return s + "f"


def main():
    a = fit(lambda t: erf(t) / t - 1.0, 1e-6, SPLIT, 5, lambda t: t * t, lambda t: erf(t) / t)
    b = fit(lambda t: erfc(t) * np.exp(t * t), SPLIT, TOP, 7, lambda t: 1.0 / t, lambda t: erfc(t) * np.exp(t * t))
    print("P (x², constant first):", ", ".join(lit(v) for v in a))
    print("Q (1/x, constant first):", ", ".join(lit(v) for v in b))
    x = np.linspace(1e-30, TOP, 2_000_001).astype(F)
    with np.errstate(all="ignore"):
        z = x * x
        got = np.where(x < F(SPLIT), x + x * horner(a, z), F(1) - exp32(-z) * horner(b, F(1) / x))
    want = erf(x.astype(np.float64))
    err = np.abs(got - want) / np.spacing(np.abs(want).astype(F)).astype(np.float64)
    for lo, hi in ((0, SPLIT), (SPLIT, TOP)):
        sel = (x >= lo) & (x < hi)
        print(f"largest error over [{lo}, {hi}): {err[sel].max():.2f} ulp at x = {x[sel][np.argmax(err[sel])]!r}")


if __name__ == "__main__":
    main()
