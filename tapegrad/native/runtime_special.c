/* tapegrad native runtime: kernels of the special family (included after runtime.c).
 *
 * The C library has no digamma or trigamma, so they are here (evaluated in double for either `real`).
 * Method, for both: reflection to x > 0, the recurrence up to y = x + n >= 12, then the asymptotic series
 * in 1/y with the Bernoulli numbers B2..B14, whose remainder (the B16 term) is below 1e-18 relative there.
 * The recurrence terms are added smallest first, after the series. Measured against SciPy (psi and
 * zeta(2, x), the tests print the bound): see the README's op section. Poles follow SciPy:
 * ψ(±0) = ∓∞, ψ = NaN at the negative integers; ψ' = +∞ at 0 and the negative integers.
 */

#define TG_PI 3.141592653589793

/* ψ(x) = d log Γ(x)/dx: ψ(x) = ψ(1 − x) − π/tan(πx) for x < 0; ψ(x) = ψ(x + n) − Σ_{k<n} 1/(x + k);
 * ψ(y) ≈ ln y − 1/(2y) − Σ_{k=1..7} B_2k / (2k·y^2k). */
TG_FN real tg_digamma(real xr)
{
    double x = xr, r = 0.0;
    if (x != x || x == INFINITY)
        return xr;
    if (x == -INFINITY)
        return (real)NAN;
    if (x == 0.0)
        return (real)(-1.0 / x);
    if (x < 0.0) {
        if (x == floor(x))
            return (real)NAN;
        r = -TG_PI / tan(TG_PI * (x - nearbyint(x)));   /* x − round(x) is exact: no argument error */
        x = 1.0 - x;
    }
    int n = 0;
    while (x + n < 12.0)
        n++;
    const double y = x + n, z = 1.0 / (y * y);
    double s = log(y) - 0.5 / y
        - z * (1.0 / 12 - z * (1.0 / 120 - z * (1.0 / 252 - z * (1.0 / 240 - z * (1.0 / 132
          - z * (691.0 / 32760 - z * (1.0 / 12)))))));
    for (int k = n - 1; k >= 0; k--)
        s -= 1.0 / (x + k);
    return (real)(s + r);
}

/* ψ'(x) = d ψ(x)/dx: ψ'(x) = π²/sin²(πx) − ψ'(1 − x) for x < 0; ψ'(x) = ψ'(x + n) + Σ_{k<n} 1/(x + k)²;
 * ψ'(y) ≈ 1/y + 1/(2y²) + Σ_{k=1..7} B_2k / y^(2k+1). */
TG_FN real tg_trigamma(real xr)
{
    double x = xr, r = 0.0, sign = 1.0;
    if (x != x || x == INFINITY)
        return x != x ? xr : (real)0.0;
    if (x == -INFINITY)
        return (real)NAN;
    if (x <= 0.0) {
        if (x == floor(x))
            return (real)INFINITY;
        const double sp = sin(TG_PI * (x - nearbyint(x)));
        r = TG_PI * TG_PI / (sp * sp);
        sign = -1.0;
        x = 1.0 - x;
    }
    int n = 0;
    while (x + n < 12.0)
        n++;
    const double y = x + n, z = 1.0 / (y * y);
    double s = 1.0 / y + 0.5 * z
        + z / y * (1.0 / 6 - z * (1.0 / 30 - z * (1.0 / 42 - z * (1.0 / 30 - z * (5.0 / 66
          - z * (691.0 / 2730 - z * (7.0 / 6)))))));
    for (int k = n - 1; k >= 0; k--)
        s += 1.0 / ((x + k) * (x + k));
    return (real)(r + sign * s);
}
