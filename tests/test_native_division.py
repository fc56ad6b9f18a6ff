"""The native runtime's division by a per-step constant (``tg_qdiv``, Adam's bias corrections): the
bits of IEEE division for every input, quotients next to a rounding midpoint and every value the fast
path must hand to the divider (zeros, subnormals, infinities, NaN, huge) included."""
import ctypes
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build, codegen

DRIVER = r'''
void tg_test_div(real *a, long n, real c)   /* as Adam's step: tg_qdiv where c and the run allow it */
{
    real y = R(1.0) / c;
    for (long s = 0; s < n; s += TG_QRUN) {
        long e = n - s < TG_QRUN ? n : s + TG_QRUN;
        int fast = tg_qdiv_by(c) && tg_qdiv_ok(a + s, e - s);
        for (long i = s; i < e; i++)
            a[i] = fast ? tg_qdiv(a[i], c, y) : a[i] / c;
    }
}
int tg_test_fma(void)
{
#ifdef __FMA__
    return 1;
#else
    return 0;
#endif
}
'''

pytestmark = pytest.mark.matrix   # re-run by CI under every compiler x target x BLAS kernel


def target_has_fma():
    """Whether the compiler defines __FMA__ for the build's -march (native: this CPU; x86-64-v2: no)."""
    r = subprocess.run([build.find_compiler(), f"-march={build.march()}", "-dM", "-E", "-"], input="",
                       capture_output=True, text=True, check=True)
    return "#define __FMA__ 1" in r.stdout


@pytest.fixture(scope="module", params=["float64", "float32"])
def divide(request):
    dtype = np.dtype(request.param)
    lib = ctypes.CDLL(build.build(codegen.prologue(dtype) + codegen.runtime_source() + DRIVER,
                                  name="test_div"))
    real = ctypes.c_double if dtype == np.float64 else ctypes.c_float
    lib.tg_test_div.argtypes = [ctypes.c_void_p, ctypes.c_long, real]
    assert lib.tg_test_fma() == target_has_fma(), "the runtime's FMA path does not follow the compiler's target"

    def run(a, c):
        out = np.array(a, dtype)
        lib.tg_test_div(out.ctypes.data, out.size, c)
        return out
    return dtype, run


@pytest.fixture(autouse=True)
def _quiet_overflow():
    with np.errstate(over="ignore"):   # the reference divisions overflow where quotients are huge, as they should
        yield


def same_bits(got, want):
    """Bit for bit, except that any NaN equals any NaN (the divider picks the payload)."""
    bits = np.uint64 if got.dtype == np.float64 else np.uint32
    nan = np.isnan(got) & np.isnan(want)
    return np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got.view(bits)[~nan],
                                                                           want.view(bits)[~nan])


def bias_corrections(dtype):
    """1 - b^t for Adam's usual and unusual betas over 3,000 steps, as the step computes them."""
    cs = {dtype.type(1.0 - b ** t) for b in (0.9, 0.99, 0.999, 0.9999, 0.5) for t in range(1, 3001)}
    return sorted(c for c in cs if c > 0)


def dividends(dtype, rng, n, exponents=None):
    """Random significands over the fast path's whole exponent range (or ``exponents``), both signs."""
    lo, hi = exponents or ((-60, 60) if dtype == np.float32 else (-900, 900))
    sig = rng.uniform(1.0, 2.0, n)
    return (sig * np.exp2(rng.integers(lo, hi, n)) * rng.choice([-1.0, 1.0], n)).astype(dtype)


def near_midpoints(dtype, c, rng, n, exponents=None):
    """Dividends a = RN(c·m), m halfway between two neighbouring floats (exact in x86's long double): a/c
    lies within about an ulp of the midpoint, where a quotient short of its last correction rounds the
    wrong way."""
    x = dividends(dtype, rng, n, exponents)
    x = x[x != 0]
    mid = x.astype(np.longdouble) + np.spacing(x).astype(np.longdouble) / 2
    return (mid * np.longdouble(c)).astype(dtype)


def test_division_by_a_bias_correction_gives_the_divisions_bits(divide):
    dtype, run = divide
    rng = np.random.default_rng(0)
    cs = bias_corrections(dtype)
    for c in cs[:: max(1, len(cs) // 400)] + [dtype.type(1.0)]:
        a = np.concatenate([dividends(dtype, rng, 2000), near_midpoints(dtype, c, rng, 2000)])
        assert same_bits(run(a, c), a / c), f"c = {c!r}"


def test_quotients_next_to_a_midpoint_round_like_the_division(divide):
    """Divisors of every binade the fast path takes, each with the dividends whose quotients are hardest
    to round: all-ones significands on both sides and products of c with midpoints."""
    dtype, run = divide
    rng = np.random.default_rng(1)
    fi = np.finfo(dtype)
    lowest = -30 if dtype == np.float32 else -60
    ones = dtype.type(2.0) - fi.eps   # the significand 1.11…1
    for e in range(lowest, 1):
        for c in (np.exp2(dtype.type(e)), ones * np.exp2(dtype.type(e - 1)),
                  dtype.type(rng.uniform(1, 2)) * np.exp2(dtype.type(e - 1))):
            if not c <= 1:
                continue
            a = np.concatenate([near_midpoints(dtype, c, rng, 500), ones * np.exp2(np.arange(-40, 40, dtype=dtype)),
                                -dividends(dtype, rng, 100)])
            assert same_bits(run(a, c), a / c), f"c = {c!r}"


def test_values_the_fast_path_cannot_take_divide(divide):
    """Zeros of either sign, subnormals, the smallest normal, infinities, NaN and the largest finite values,
    alone and in a run of ordinary values (which then divides too), and divisors outside (0, 1]."""
    dtype, run = divide
    fi = np.finfo(dtype)
    odd = np.array([0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal, fi.smallest_normal,
                    fi.smallest_normal * 3, np.inf, -np.inf, np.nan, fi.max, -fi.max, fi.max / 4], dtype)
    rng = np.random.default_rng(2)
    ordinary = dividends(dtype, rng, 700)
    for c in (dtype.type(0.1), dtype.type(1e-3), dtype.type(1.0)):
        assert same_bits(run(odd, c), odd / c)
        for at in (0, 255, 256, 699):   # first and last of a run, the first of the next, the very last
            a = ordinary.copy()
            a[at: at + len(odd)] = odd[: len(a) - at]
            assert same_bits(run(a, c), a / c), f"odd values at {at}, c = {c!r}"
        zeros = np.where(rng.random(700) < 0.3, dtype.type(0.0), ordinary) * rng.choice([-1, 1], 700).astype(dtype)
        assert same_bits(run(zeros, c), zeros / c)   # zeros of either sign stay on the fast path
    # bands of exponents where residuals stop being exact or quotients overflow, one band per call (a run
    # holds no value of another band)
    lo, hi = (-148, -61) if dtype == np.float32 else (-1073, -901)
    top = (61, 127) if dtype == np.float32 else (901, 1023)
    for c in (dtype.type(0.1), dtype.type(1e-3), dtype.type(0.271)):
        for band in [(e, min(e + 6, hi)) for e in range(lo, hi, 6)] + [(e, min(e + 6, top[1])) for e in range(*top, 6)]:
            a = np.concatenate([dividends(dtype, rng, 256, band), near_midpoints(dtype, c, rng, 1024, band)])
            assert same_bits(run(a, c), a / c), f"dividends in [2^{band[0]}, 2^{band[1]}), c = {c!r}"
    # divisors outside [2^-60, 1] (float32: [2^-30, 1]): quotients that overflow or fall below the normal range
    big, small = (1.7 * 2.0 ** 100, 2.0 ** -80) if dtype == np.float32 else (1.7 * 2.0 ** 1000, 2.0 ** -200)
    for c in (dtype.type(small), dtype.type(big), dtype.type(1.5), dtype.type(3.0), dtype.type(-0.5)):
        assert same_bits(run(ordinary, c), ordinary / c), f"c = {c!r}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_adam_steps_of_a_native_program_equal_the_tapes_at_extreme_gradients(dtype):
    """Adam in optax's form, native against the eager tape (NumPy's divisions), bit for bit over 6 steps,
    with runs of 256 parameters whose gradients make m or v leave the fast path's range (v underflows to a
    subnormal or 0, or overflows to inf while m stays finite), runs of zero gradients, and ordinary runs;
    and a second program at an unusual beta whose bias correction starts near 1e-5."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(3)
    tiny, huge = (1e-25, 1e25) if dt == np.float32 else (1e-160, 1e160)
    runs = [rng.standard_normal(256), rng.standard_normal(256) * tiny, np.where(rng.random(256) < 0.5, 0.0,
            rng.standard_normal(256)), rng.standard_normal(256) * huge, rng.standard_normal(100)]
    grads = np.concatenate(runs).astype(dt)
    w0 = rng.standard_normal(grads.size).astype(dt)
    for b2 in (0.999, 0.99999):
        for k, (got, want) in enumerate(zip(adam_steps("native", w0, grads, b2), adam_steps("tape", w0, grads, b2))):
            assert same_bits(got, want), f"b2 = {b2}, step {k + 1}: {np.flatnonzero(got != want)[:8]}"


def adam_steps(backend, w0, grads, b2, steps=6):
    """w after each of ``steps`` Adam steps on Σ w·grads (whose gradient is ``grads``): eager, or a
    native program."""
    tape = tg.Tape(dtype=w0.dtype)
    w = tape.param(w0.copy())
    opt = tg.Adam(1e-3, b2=b2)
    opt.add(tape, w)
    start = tape.mark()

    def loss():
        return (w * tape.const(grads)).sum()
    prog = None
    if backend == "native":
        prog = tg.capture(tape, loss(), backend="native", dtype=w0.dtype)
        prog.attach(opt)
    out = []
    for _ in range(steps):
        if prog is not None:
            prog.episode()
            out.append(prog.value(w).copy())
        else:
            tape.backward(loss())
            opt.step()
            out.append(tape.value(w).copy())
            tape.reset_to(start)
    return out
