"""The native runtime's exp and tanh (runtime_vmath.c): the documented algorithm to the bit, and its
accuracy against the C library's long double functions."""
import warnings

import numpy as np
import pytest

import tapegrad as tg

pytestmark = pytest.mark.matrix   # every compiler and target of .ci/run's matrix computes these bits

RNG = np.random.default_rng(5)
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324, 1e-310, 1e-20, -1e-20, 0.173, 0.55,
                    -0.55, 0.5499999999999999, 19.9, 20.0, 20.1, -25.0, 709.78, 709.79, 709.8, 710.0, -708.4,
                    -745.1, -745.2, -746.0, -1000.0])


def sweep(lo, hi, n=30_000):
    x = np.concatenate([RNG.uniform(lo, hi, n), RNG.uniform(-1.0, 1.0, n), -np.logspace(-300, 2.85, n),
                        np.logspace(-300, 2.85, n), SPECIAL])
    return x[~((x < lo) | (x > hi))]   # NaN stays


def native(op, x, dtype="float64"):
    with np.errstate(all="ignore"):   # the tape's own eager values overflow where exp does
        tape = tg.Tape(dtype=dtype)
        v = tape.param(np.asarray(x, dtype))
        y = getattr(tg, op)(v)
        prog = tg.capture(tape, y.sum(), backend="native", dtype=dtype, verify=False)
        prog.forward()
    return np.array(prog.value(y))


# ── the algorithm, operation for operation in NumPy (IEEE arithmetic: the same bits anywhere) ──────

def em1(r):
    p = np.full_like(r, 1.0 / 6227020800.0)
    for c in (479001600.0, 39916800.0, 3628800.0, 362880.0, 40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0):
        p = p * r + 1.0 / c
    p = p * r + 0.5
    p = p * r
    return p * r + r


def reduce(x):
    shift = np.float64(6755399441055744.0)
    t = x * 1.4426950408889634 + shift
    kd = t - shift
    k = t.view(np.int64) - shift.view(np.int64)
    return (x - kd * 0.6931471803691238) - kd * 1.9082149292705877e-10, k


def pow2(k):
    return ((k + 1023) << 52).view(np.float64)


def exp_mirror(x):
    xc = np.where(x < -746.0, -746.0, np.where(x > 709.8, 709.8, x))
    r, k = reduce(xc)
    k1 = k >> 1
    return ((em1(r) + 1.0) * pow2(k1)) * pow2(k - k1)


def tanh_mirror(x):
    ax = np.abs(x)
    ax = np.where(ax > 20.0, 20.0, ax)
    r, k = reduce(-2.0 * ax)
    pk, q = pow2(k), em1(r)
    m, e = pk * q + (pk - 1.0), pk * (q + 1.0)
    t = np.where(ax < 0.55, -m / (2.0 + m), 1.0 - (e + e) / (1.0 + e))
    return np.copysign(t, x)


@pytest.mark.parametrize("op, mirror, lo, hi", [("exp", exp_mirror, -1100.0, 720.0),
                                                ("tanh", tanh_mirror, -40.0, 40.0)])
def test_the_runtime_computes_its_documented_algorithm_bit_for_bit(op, mirror, lo, hi):
    """Compiled with -ffp-contract=off and vectorised or not, every step is one IEEE operation, so the
    C and this NumPy transcription agree exactly, NaNs, zeros' signs, overflow and subnormals included."""
    x = sweep(lo, hi)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want = mirror(x)
    got = native(op, x)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def ulps(got, ref):
    """|got − ref| in units of the spacing of got's dtype at ref (ref in long double)."""
    spacing = np.spacing(np.abs(ref).astype(got.dtype)).astype(np.longdouble)
    return np.abs(got.astype(np.longdouble) - ref) / spacing


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="long double is not wider than double here")
@pytest.mark.parametrize("op, lo, hi, bound64", [("exp", -750.0, 712.0, 1.0), ("tanh", -25.0, 25.0, 2.5)])
def test_accuracy_against_long_double(op, lo, hi, bound64):
    """float64: exp within 1 ulp, tanh within 2.5 (NumPy's own are within about 1.2); float32 (computed in
    double, rounded once): within half an ulp and a hair for the double rounding."""
    x = sweep(lo, hi)
    for dtype, bound in (("float64", bound64), ("float32", 0.5 + 1e-6)):
        xx = x.astype(dtype)
        with np.errstate(all="ignore"):
            ref = getattr(np, op)(xx.astype(np.longdouble))
            got = native(op, xx, dtype)
            exact = ref.astype(dtype)
        assert got.dtype == np.dtype(dtype)
        regular = np.isfinite(exact) & (exact != 0) & (np.abs(exact) >= np.finfo(dtype).smallest_normal)
        err = ulps(got[regular], ref[regular])
        assert err.max() <= bound, (dtype, float(err.max()), xx[regular][np.argmax(err)])
        # overflow, underflow to zero, subnormals, NaN, ±0: the correctly rounded value's class and sign
        rest = ~regular
        assert np.array_equal(np.isnan(got[rest]), np.isnan(exact[rest]))
        with np.errstate(invalid="ignore"):   # inf − inf where both overflow
            tiny = np.abs(got[rest] - exact[rest]) <= np.finfo(dtype).smallest_subnormal
        assert (tiny | np.isnan(exact[rest]) | (got[rest] == exact[rest])).all()
        assert np.array_equal(np.signbit(got[rest]), np.signbit(exact[rest]))
