/* exp, tanh, log and erf that vectorise: the C library's are calls a loop cannot widen (16384 tanh took 275
 * us against NumPy's 21 us), so the generated elementwise code calls these instead. Plain IEEE arithmetic
 * and bit moves only, no table and no branch, so GCC and clang turn a loop of them into vector code,
 * and (compiled with -ffp-contract=off) every machine computes the same bits. Each precision has its
 * own: a float32 program evaluates in float, so a vector holds twice the lanes of a double one (16 on
 * AVX-512, 8 on AVX2) and the polynomials are half as long. Accuracy over sweeps of a million arguments
 * against the C library's long double functions (tests/test_native_vmath.py): float64 exp within 1 ulp
 * and tanh within 2.5 ulp; float32 exp within 1 ulp, tanh within 2.5, log within 1 and erf within 2
 * (NumPy's own float32 exp, tanh and log measured 2.3, 1.4 and 3.2 ulp on an AVX-512 CPU). Both sides
 * stay inside the "libm" tier's 8 ulp of each other. float64 log and erf stay the C library's.
 *
 * exp(x) = 2^k · e^r with k = round(x / ln 2) and r = x − k·ln 2 in two parts (Cody and Waite: ln2_hi's
 * trailing zeros make k·ln2_hi exact over the whole range of k), |r| <= ln(2)/2, e^r − 1 by its Taylor
 * series (to r^13 in double, r^7 in float: the tails are below 2^-60 and 2^-27 of the result). 2^k is
 * built from k's bits in two halves, so results that are subnormal or overflow round once, as the true
 * value would. tanh, log and erf are written below in the same terms. */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)   /* the device's copy (tapegrad/gpu/device_runtime.py) */
#define TG_VFN static __device__ __forceinline__ __attribute__((unused))
TG_VFN long long tg_vm_bits(double d) { return __double_as_longlong(d); }
TG_VFN double tg_vm_from_bits(long long i) { return __longlong_as_double(i); }
TG_VFN int tg_vm_bitsf(float f) { return __float_as_int(f); }
TG_VFN float tg_vm_from_bitsf(int i) { return __int_as_float(i); }
#else
#include <math.h>
#include <string.h>
#define TG_VFN static inline __attribute__((unused))
TG_VFN long long tg_vm_bits(double d)
{
    long long i;
    memcpy(&i, &d, sizeof i);
    return i;
}

TG_VFN double tg_vm_from_bits(long long i)
{
    double d;
    memcpy(&d, &i, sizeof d);
    return d;
}

TG_VFN int tg_vm_bitsf(float f)
{
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}

TG_VFN float tg_vm_from_bitsf(int i)
{
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
#endif

/* c ? a : b as bit operations on values already computed. Written as ?: on floating-point values, a
 * select whose arm is a constant (a clamp) lets GCC fold that constant through the code after it, and
 * arithmetic that only one arm reads gets moved into that arm: the loop then has branches holding
 * operations that may trap, which GCC 11 (and GCC 12 without AVX-512's masks) will not if-convert, and
 * it stays scalar (tests/test_native_vmath.py checks every loop of these vectorises). Integer min/max
 * and these blends never become branches. */
TG_VFN double tg_vm_sel(int c, double a, double b)
{
    long long m = -(long long)c;
    return tg_vm_from_bits((tg_vm_bits(a) & m) | (tg_vm_bits(b) & ~m));
}

TG_VFN float tg_vm_self(int c, float a, float b)
{
    int m = -c;
    return tg_vm_from_bitsf((tg_vm_bitsf(a) & m) | (tg_vm_bitsf(b) & ~m));
}

/* e^r − 1 for |r| <= ln(2)/2 (a relative error of about one rounding) */
TG_VFN double tg_vm_em1(double r)
{
    double p = 1.0 / 6227020800.0;   /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r;
    return p * r + r;   /* r + r²/2 + …: the leading term added last keeps small r exact */
}

/* 0x1.8p52, 0x1.71547652b82fep0, 0x1.62e42feep-1, 0x1.a39ef35793c76p-33 (decimal: C++ before 17 has no
 * hexadecimal floats, and the GPU host emulation is C++); each literal round-trips exactly. ln2_hi has
 * 32 significant bits, so k·ln2_hi is exact for |k| < 2^21. */
#define TG_VM_SHIFT 6755399441055744.0
#define TG_VM_LOG2E 1.4426950408889634
#define TG_VM_LN2_HI 0.6931471803691238
#define TG_VM_LN2_LO 1.9082149292705877e-10

/* (k, r) with x = k·ln 2 + r, |x| < 2^30: x·log2e + 1.5·2^52 rounds k into t's last bits, read as a 32-bit
 * integer (64-bit arithmetic shifts and min/max are AVX-512 instructions: AVX2 code would stay scalar) */
TG_VFN double tg_vm_reduce(double x, int *k)
{
    double t = x * TG_VM_LOG2E + TG_VM_SHIFT;
    double kd = t - TG_VM_SHIFT;
    *k = (int)(unsigned)((unsigned long long)tg_vm_bits(t) - (unsigned long long)tg_vm_bits(TG_VM_SHIFT));
    return (x - kd * TG_VM_LN2_HI) - kd * TG_VM_LN2_LO;
}

TG_VFN double tg_vm_pow2(int k)   /* 2^k, -1022 <= k <= 1023 (a NaN's k is anything: unsigned, it wraps) */
{
    return tg_vm_from_bits((long long)((unsigned long long)(unsigned)(k + 1023) << 52));
}

/* p·2^k for -1076 <= k <= 1025 as two factors, each a normal power of two */
TG_VFN double tg_vm_scale(double p, int k)
{
    int k1 = k >> 1, k2 = k - k1;
    return (p * tg_vm_pow2(k1)) * tg_vm_pow2(k2);
}

TG_VFN double tg_exp_d(double x)
{
    /* below −746 the value rounds to 0, above 709.8 it overflows: holding x there keeps k in
     * tg_vm_scale's range (a NaN compares false and passes through) */
    double xc = tg_vm_sel(x < -746.0, -746.0, x);
    xc = tg_vm_sel(xc > 709.8, 709.8, xc);
    int k;
    double r = tg_vm_reduce(xc, &k);
    return tg_vm_scale(tg_vm_em1(r) + 1.0, k);
}

/* tanh |x| from one reduction of y = −2|x| = k·ln 2 + r: with e = e^y and m = e^y − 1 (= 2^k·(e^r − 1) +
 * (2^k − 1), exact but for a rounding per term), −m / (2 + m) below |x| = 0.55 (no cancellation at small
 * |x|) and 1 − 2e / (1 + e) above (the subtracted term is small, so its rounding hardly shows). From
 * |x| = 20 on, tanh rounds to 1. */
TG_VFN double tg_tanh_d(double x)
{
    long long ab = tg_vm_bits(x) & 0x7fffffffffffffffLL;   /* |x|, held at 20 (a NaN too: put back below) */
    ab = ab > 0x4034000000000000LL ? 0x4034000000000000LL : ab;
    double ax = tg_vm_from_bits(ab);
    int k;
    double r = tg_vm_reduce(-2.0 * ax, &k);
    double pk = tg_vm_pow2(k);   /* k in [−58, 0] */
    double q = tg_vm_em1(r);
    double m = pk * q + (pk - 1.0), e = pk * (q + 1.0);
    double t = tg_vm_sel(ax < 0.55, -m / (2.0 + m), 1.0 - (e + e) / (1.0 + e));
    return tg_vm_sel(x == x, copysign(t, x), x);
}

/* ── float32: the same algorithms in float ──────────────────────────────────────────────────── */

/* e^r − 1 for |r| <= ln(2)/2 + a little, float: Taylor to r^7 */
TG_VFN float tg_vm_em1f(float r)
{
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r;
    return p * r + r;
}

/* 1.5·2^23 rounds x/ln2 to an integer in t's last bits; ln2_hi = 0x1.62e4p-1 has 15 significant bits, so
 * k·ln2_hi is exact for |k| < 2^9 */
#define TG_VM_SHIFTF 12582912.0f
#define TG_VM_LOG2EF 1.44269502f
#define TG_VM_LN2_HIF 0.693145751953125f
#define TG_VM_LN2_LOF 1.42860677e-06f

TG_VFN float tg_vm_reducef(float x, int *k)   /* as tg_vm_reduce, |x| < 2^21 */
{
    float t = x * TG_VM_LOG2EF + TG_VM_SHIFTF;
    float kf = t - TG_VM_SHIFTF;
    *k = tg_vm_bitsf(t) - tg_vm_bitsf(TG_VM_SHIFTF);
    return (x - kf * TG_VM_LN2_HIF) - kf * TG_VM_LN2_LOF;
}

TG_VFN float tg_vm_pow2f(int k)   /* 2^k, -126 <= k <= 127 */
{
    return tg_vm_from_bitsf((int)((unsigned)(k + 127) << 23));
}

TG_VFN float tg_exp_f(float x)
{
    /* below −104 the value rounds to 0, above 89 it overflows: k stays in [−150, 129], whose halves are
     * normal powers of two (a NaN compares false and passes through) */
    float xc = tg_vm_self(x < -104.0f, -104.0f, x);
    xc = tg_vm_self(xc > 89.0f, 89.0f, xc);
    int k;
    float r = tg_vm_reducef(xc, &k);
    int k1 = k >> 1;
    return ((tg_vm_em1f(r) + 1.0f) * tg_vm_pow2f(k1)) * tg_vm_pow2f(k - k1);
}

/* tanh |x| as in double, m = e^y − 1 and e = e^y, with one division: −m / (2 + m) below |x| = 0.55,
 * (1 − e) / (1 + e) above. From |x| = 10 on, tanh rounds to 1. */
TG_VFN float tg_tanh_f(float x)
{
    int ab = tg_vm_bitsf(x) & 0x7fffffff;   /* |x|, held at 10 (0x41200000; a NaN too: put back below) */
    ab = ab > 0x41200000 ? 0x41200000 : ab;
    float ax = tg_vm_from_bitsf(ab);
    int k;
    float r = tg_vm_reducef(-2.0f * ax, &k);
    float pk = tg_vm_pow2f(k);   /* k in [−29, 0] */
    float q = tg_vm_em1f(r);
    float m = pk * q + (pk - 1.0f), e = pk * (q + 1.0f);
    int small = ax < 0.55f;
    float t = tg_vm_self(small, -m, 1.0f - e) / tg_vm_self(small, 2.0f + m, 1.0f + e);
    return tg_vm_self(x == x, copysignf(t, x), x);
}

/* log x = e·ln 2 + log(1 + f), x = 2^e·(1 + f) with 1 + f in [√½, √2) (subnormal x scaled by 2^23 first);
 * with s = f / (2 + f), log(1 + f) = 2·atanh(s) = f − (f²/2 − s·(f²/2 + R)), R = 2s²/3 + 2s⁴/5 + 2s⁶/7 +
 * 2s⁸/9 (|s| < 0.172: the next term is below 2^-30 of the result). */
TG_VFN float tg_log_f(float x)
{
    float xa = fabsf(x);   /* a negative x gives NaN below: its magnitude keeps the integer steps in range */
    int sub = xa < 1.17549435e-38f;
    float xs = xa * tg_vm_self(sub, 8388608.0f, 1.0f);
    int e = (tg_vm_bitsf(xs) - 0x3f3504f3) >> 23;   /* 0x3f3504f3: the bits of √½ rounded */
    float m = tg_vm_from_bitsf(tg_vm_bitsf(xs) - e * 8388608);
    float ef = (float)(e - (sub ? 23 : 0));
    float f = m - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s;
    float R = z * (2.0f / 3.0f + z * (2.0f / 5.0f + z * (2.0f / 7.0f + z * (2.0f / 9.0f))));
    float h = 0.5f * f * f;
    float y = ef * TG_VM_LN2_HIF - ((h - (s * (h + R) + ef * TG_VM_LN2_LOF)) - f);
    /* ±0 gives −inf, +inf and NaN are their own log, a negative x NaN */
    int xb = tg_vm_bitsf(x);
    int special = (xb & 0x7fffffff) == 0 ? (int)0xff800000 : xb >= 0x7f800000 ? xb : 0x7fc00000;
    return tg_vm_self((xb > 0) & (xb < 0x7f800000), y, tg_vm_from_bitsf(special));
}

/* erf x in float: below |x| = 0.875, x + x·P(x²) with P ≈ erf(x)/x − 1 (degree 5 in x²); above,
 * 1 − e^(−x²)·Q(1/x) with Q ≈ erfc(x)·e^(x²) (degree 7 in 1/x). Both fitted here by least squares on
 * Chebyshev nodes weighted to relative error (experiments/studies/fit_erf32.py), coefficients rounded to float.
 * |x| is held at 4 (erf rounds to 1 from 3.92 on); the rounding of x² moves e^(−x²) by x²·2^-24 of itself,
 * far below an ulp of the result there. Within 2 ulp of the exact erf (1.75 measured near the split). */
TG_VFN float tg_erf_f(float x)
{
    int ab = tg_vm_bitsf(x) & 0x7fffffff;   /* |x| held at 4 (0x40800000; a NaN too: put back below) */
    ab = ab > 0x40800000 ? 0x40800000 : ab;
    float ax = tg_vm_from_bitsf(ab);
    float z = ax * ax;
    float p = -0.0006235156f;
    p = p * z + 0.005038738f;
    p = p * z - 0.026796306f;
    p = p * z + 0.11282608f;
    p = p * z - 0.3761257f;
    p = p * z + 0.12837917f;
    float u = 1.0f / ax;
    float q = -0.018059714f;
    q = q * u + 0.12146362f;
    q = q * u - 0.3553478f;
    q = q * u + 0.5765551f;
    q = q * u - 0.5061267f;
    q = q * u + 0.050995f;
    q = q * u + 0.55775636f;
    q = q * u + 0.00034773274f;
    float r = tg_vm_self(ax < 0.875f, ax + ax * p, 1.0f - tg_exp_f(-z) * q);
    return tg_vm_self(x == x, copysignf(r, x), x);
}

/* the generated code's names, for either `real` (the test on sizeof is folded at compile time) */
TG_VFN real tg_sel(int c, real x, real y)   /* c ? x : y, both computed (expr.py prints ?: as this) */
{
    return sizeof(real) == 4 ? (real)tg_vm_self(c, (float)x, (float)y) : (real)tg_vm_sel(c, (double)x, (double)y);
}
TG_VFN real tg_exp(real x) { return sizeof(real) == 4 ? (real)tg_exp_f((float)x) : (real)tg_exp_d((double)x); }
TG_VFN real tg_tanh(real x) { return sizeof(real) == 4 ? (real)tg_tanh_f((float)x) : (real)tg_tanh_d((double)x); }
TG_VFN real tg_log(real x) { return sizeof(real) == 4 ? (real)tg_log_f((float)x) : (real)log((double)x); }
TG_VFN real tg_erf(real x) { return sizeof(real) == 4 ? (real)tg_erf_f((float)x) : (real)erf((double)x); }
#undef TG_VFN
