"""The native runtime's exp, tanh and (float32) log and erf (runtime_vmath.c): the documented algorithm to the bit
in each precision, its accuracy against the C library's long double functions and its distance from
NumPy's, and that every compiler of the matrix turns a loop of them into vector code."""
import os
import re
import subprocess
import warnings

import numpy as np
import pytest
import scipy.special as sc

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


# float32: every literal and every step rounded to float, as the C computes it
F = np.float32
SHIFT32, LOG2E32 = F(12582912.0), F(1.4426950408889634)
LN2_HI32, LN2_LO32 = F(0.693145751953125), F(1.428606765330187e-06)


def em1_32(r):
    p = F(1) / F(5040)
    for c in (720, 120, 24, 6):
        p = p * r + F(1) / F(c)
    p = p * r + F(0.5)
    p = p * r
    return p * r + r


def reduce32(x):
    t = x * LOG2E32 + SHIFT32
    kd = t - SHIFT32
    k = t.view(np.int32) - SHIFT32.view(np.int32)
    return (x - kd * LN2_HI32) - kd * LN2_LO32, k


def pow2_32(k):
    return ((k.astype(np.int64) + 127) << 23).astype(np.uint32).view(np.float32)


def exp_mirror32(x):
    xc = np.where(x < F(-104), F(-104), x)
    xc = np.where(xc > F(89), F(89), xc)
    r, k = reduce32(xc)
    k1 = k >> 1
    return ((em1_32(r) + F(1)) * pow2_32(k1)) * pow2_32(k - k1)


def tanh_mirror32(x):
    ax = np.minimum(np.abs(x), F(10))   # NaN put back at the end
    r, k = reduce32(F(-2) * ax)
    pk, q = pow2_32(k), em1_32(r)
    m, e = pk * q + (pk - F(1)), pk * (q + F(1))
    small = ax < F(0.55)
    t = np.where(small, -m, F(1) - e) / np.where(small, F(2) + m, F(1) + e)
    return np.where(np.isnan(x), x, np.copysign(t, x))


def log_mirror32(x):
    xa = np.abs(x)
    sub = xa < np.finfo(np.float32).smallest_normal
    xs = xa * np.where(sub, F(8388608), F(1))
    e = (xs.view(np.int32) - F(np.sqrt(0.5)).view(np.int32)) >> 23
    m = (xs.view(np.int32) - e * (1 << 23)).view(np.float32)
    ef = (e - np.where(sub, 23, 0)).astype(np.float32)
    f = m - F(1)
    s = f / (F(2) + f)
    z = s * s
    R = z * (F(2) / F(3) + z * (F(2) / F(5) + z * (F(2) / F(7) + z * (F(2) / F(9)))))
    h = F(0.5) * f * f
    y = ef * LN2_HI32 - ((h - (s * (h + R) + ef * LN2_LO32)) - f)
    special = np.where(x == 0, F(-np.inf), np.where(x == F(np.inf), x, F(np.nan)))
    return np.where((x > 0) & (x < F(np.inf)), y, special)


ERF_P = [F(c) for c in (0.12837917, -0.3761257, 0.11282608, -0.026796306, 0.005038738, -0.0006235156)]
ERF_Q = [F(c) for c in (0.00034773274, 0.55775636, 0.050995, -0.5061267, 0.5765551, -0.3553478, 0.12146362,
                        -0.018059714)]


def erf_mirror32(x):
    ax = np.minimum(np.abs(x), F(4))   # NaN put back at the end

    def horner(c, z):
        p = np.full_like(z, c[-1])
        for a in reversed(c[:-1]):
            p = p * z + a
        return p
    z = ax * ax
    r = np.where(ax < F(0.875), ax + ax * horner(ERF_P, z), F(1) - exp_mirror32(-z) * horner(ERF_Q, F(1) / ax))
    return np.where(np.isnan(x), x, np.copysign(r, x))


SPECIAL32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 1.17549435e-38, 1e-20,
                      -1e-20, 0.173, 0.55, -0.55, 0.54999995, 9.0, 9.99, 10.0, 10.1, -25.0, 88.72, 88.73, 89.0,
                      89.1, -87.3, -103.2, -103.3, -103.98, -104.0, -104.1, -1000.0, 3.4e38, -3.4e38], np.float32)


def sweep32(lo, hi, n=30_000):
    x = np.concatenate([RNG.uniform(lo, hi, n), RNG.uniform(-1.0, 1.0, n), -np.logspace(-45, 38.5, n),
                        np.logspace(-45, 38.5, n)]).astype(np.float32)
    return np.concatenate([x[~((x < lo) | (x > hi))], SPECIAL32])


@pytest.mark.parametrize("op, mirror, lo, hi, dtype", [("exp", exp_mirror, -1100.0, 720.0, "float64"),
                                                       ("tanh", tanh_mirror, -40.0, 40.0, "float64"),
                                                       ("exp", exp_mirror32, -200.0, 100.0, "float32"),
                                                       ("tanh", tanh_mirror32, -20.0, 20.0, "float32"),
                                                       ("log", log_mirror32, -10.0, 3.4e38, "float32"),
                                                       ("erf", erf_mirror32, -6.0, 6.0, "float32")])
def test_the_runtime_computes_its_documented_algorithm_bit_for_bit(op, mirror, lo, hi, dtype):
    """Compiled with -ffp-contract=off and vectorised or not, every step is one IEEE operation, so the
    C and this NumPy transcription agree exactly, NaNs, zeros' signs, overflow and subnormals included."""
    x = sweep(lo, hi) if dtype == "float64" else sweep32(lo, hi)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want = mirror(x)
    got = native(op, x, dtype)
    assert got.dtype == want.dtype == np.dtype(dtype)
    assert np.array_equal(got, want, equal_nan=True)
    nan = np.isnan(want)
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def ulps(got, ref):
    """|got − ref| in units of the spacing of got's dtype at ref (ref in long double)."""
    spacing = np.spacing(np.abs(ref).astype(got.dtype)).astype(np.longdouble)
    return np.abs(got.astype(np.longdouble) - ref) / spacing


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="long double is not wider than double here")
@pytest.mark.parametrize("op, lo, hi, dtype, bound", [("exp", -750.0, 712.0, "float64", 1.0),
                                                      ("tanh", -25.0, 25.0, "float64", 2.5),
                                                      ("exp", -110.0, 95.0, "float32", 1.0),
                                                      ("tanh", -25.0, 25.0, "float32", 2.5),
                                                      ("log", 0.0, 3.4e38, "float32", 1.0),
                                                      ("erf", -6.0, 6.0, "float32", 2.0)])
def test_accuracy_against_long_double(op, lo, hi, dtype, bound):
    """float64: exp within 1 ulp, tanh within 2.5 (NumPy's own are within about 1.2); float32, evaluated in
    float: exp within 1 ulp, tanh within 2.5, log within 1, erf within 2 (the sweeps measured 0.97, 2.2,
    0.80 and 1.75; erf's reference is SciPy's in double, far closer than an ulp of float)."""
    x = (sweep(lo, hi) if dtype == "float64" else sweep32(lo, hi)).astype(dtype)
    with np.errstate(all="ignore"):
        ref = sc.erf(x.astype(np.float64)) if op == "erf" else getattr(np, op)(x.astype(np.longdouble))
        got = native(op, x, dtype)
        exact = ref.astype(dtype)
    assert got.dtype == np.dtype(dtype)
    regular = np.isfinite(exact) & (exact != 0) & (np.abs(exact) >= np.finfo(dtype).smallest_normal)
    err = ulps(got[regular], ref[regular])
    assert err.max() <= bound, (dtype, float(err.max()), x[regular][np.argmax(err)])
    # overflow, underflow to zero, subnormals, NaN, ±0: the correctly rounded value's class and sign
    rest = ~regular
    assert np.array_equal(np.isnan(got[rest]), np.isnan(exact[rest]))
    with np.errstate(invalid="ignore"):   # inf − inf where both overflow
        tiny = np.abs(got[rest] - exact[rest]) <= np.finfo(dtype).smallest_subnormal
    assert (tiny | np.isnan(exact[rest]) | (got[rest] == exact[rest])).all()
    nan = np.isnan(exact[rest])
    assert np.array_equal(np.signbit(got[rest][~nan]), np.signbit(exact[rest][~nan]))


@pytest.mark.parametrize("op, lo, hi", [("exp", -104.0, 89.0), ("tanh", -12.0, 12.0), ("log", 0.0, 3.4e38),
                                        ("erf", -6.0, 6.0)])
def test_float32_functions_are_within_the_libm_tier_of_numpys(op, lo, hi):
    """What first-run verification compares: the program's float32 values against the registry's NumPy
    forward in float32 (NumPy's SIMD functions, SciPy's erf) within the libm tier's 8 ulp."""
    x = sweep32(lo, hi)
    x = x[np.isfinite(x) & (x >= lo) & (x <= hi)]
    with np.errstate(all="ignore"):
        want = sc.erf(x) if op == "erf" else getattr(np, op)(x)
        got = native(op, x, "float32")
    ok = np.isfinite(want) & np.isfinite(got)
    assert np.array_equal(ok, np.isfinite(want)) and np.array_equal(got[~ok], want[~ok])
    err = np.abs(got[ok].astype(np.float64) - want[ok]) / np.spacing(np.maximum(np.abs(got[ok]), np.abs(want[ok])))
    assert err.max() <= 8, (op, float(err.max()), x[ok][np.argmax(err)])


# ── vector code: the same loops every compiler and target of the matrix must widen ────────────────

def _remarks(kernel, dtype):
    """(lines of ``kernel``'s loops, the lines the compiler reports vectorised) for the runtime compiled
    as a program is, with the compiler's vectorisation report."""
    from tapegrad.native import build, codegen
    src = codegen.prologue(dtype) + "\n" + codegen.runtime_source() + "\n" + kernel
    cc = build.find_compiler()
    clang = "clang" in build.compiler_identity(cc, *build.cc_args())
    report = ["-Rpass=loop-vectorize"] if clang else ["-fopt-info-vec-optimized"]
    flags = [f for f in build.flags() if f not in ("-shared", "-Werror")] + list(build.quirks(cc, *build.cc_args()))
    path = os.path.join(build.cache_dir(), f"vmath-check-{os.getpid()}.c")
    with open(path, "w") as f:
        f.write(src)
    try:
        r = subprocess.run([cc, *build.cc_args(), *flags, *report, "-c", path, "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(path)
    assert r.returncode == 0, r.stderr[-2000:]
    first = src.count("\n", 0, src.index(kernel)) + 1
    loops = {first + i for i, line in enumerate(kernel.splitlines()) if "for (" in line}
    name = re.escape(os.path.basename(path))
    done = {int(m) for m in re.findall(name + r":(\d+):\d+: (?:optimized: loop vectorized|remark: vectorized loop)",
                                           r.stderr)}
    return loops, done


@pytest.mark.parametrize("dtype, fns", [("float32", ("tg_exp", "tg_tanh", "tg_log", "tg_erf")),
                                        ("float64", ("tg_exp", "tg_tanh"))])
def test_every_compiler_and_target_vectorises_the_runtime_functions(dtype, fns):
    """A loop over each function is vector code under this compiler and -march (GCC 11 and 12 once left
    exp scalar on AVX2 targets, and every float32 exp and tanh on any: a clamp's constant folded into
    the code after it made branches they would not if-convert; runtime_vmath.c's tg_vm_sel)."""
    kernel = "\n".join(f"void k_{f}(real *restrict a, real *restrict o) {{ for (long i = 0; i < 4096; i++) "
                       f"o[i] = {f}(a[i]); }}" for f in fns)
    loops, done = _remarks(kernel, dtype)
    assert len(loops) == len(fns) and loops <= done, (sorted(loops), sorted(done))
