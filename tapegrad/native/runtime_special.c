/* tapegrad native runtime: kernels of the special family (included after runtime.c).
 *
 * The C library has no digamma or trigamma, so they are here (evaluated in double for either `real`).
 * Method, for both: reflection to x > 0, the recurrence up to y = x + n >= 12, then the asymptotic series
 * in 1/y with the Bernoulli numbers B2..B14, whose remainder (the B16 term) is below 1e-18 relative there.
 * The recurrence terms are added smallest first, after the series. Around ψ's root, where that recurrence
 * would cancel, ψ is its Taylor series instead. Measured against SciPy's psi and zeta(2, x) for x > 0 (the
 * tests assert it): ψ within 4 ulp, ψ' within 8 ulp (measured 6). Poles follow SciPy:
 * ψ(±0) = ∓∞, ψ = NaN at the negative integers; ψ' = +∞ at 0 and the negative integers.
 */

#define TG_PI 3.141592653589793

/* ψ near its positive root x0 = 1.46163214496836234126…, |x − x0| < 0.6: the Taylor series
 * ψ(x) = Σ_{k>=1} (−1)^(k+1) ζ(k+1, x0) (x − x0)^k, whose coefficients (mpmath, 60 digits) shrink by 1/x0, so
 * 46 terms leave a remainder below 1e-17 relative; x0 is held as hi + lo so x − x0 is exact to 1e-32. */
TG_FN double tg_digamma_root(double x)
{
    static const double c[46] = {
        0.9676722454476212, -0.4427631689835921, 0.258499760955651, -0.16394270544240652,
        0.10782405069126237, -0.07219956125645471, 0.04880428816414311, -0.03316112647484736,
        0.022597648232218104, -0.01542476590494896, 0.010538791616612175, -0.007204534386356869,
        0.004926781395729853, -0.003369801655439328, 0.002305126326734928, -0.0015769367714301972,
        0.0010788252019162967, -0.0007380709389960052, 0.000504953265834602, -0.0003454680251063077,
        0.00023635601564027053, -0.00016170622091974803, 0.0001106337276874741, -7.569179582195066e-05,
        5.178575795222081e-05, -3.5430070947659604e-05, 2.424006611860132e-05, -1.6584242271854135e-05,
        1.134638458466385e-05, -7.762817668462094e-06, 5.3110609208898636e-06, -3.6336507898010456e-06,
        2.486022733129538e-06, -1.7008538854332607e-06, 1.1636675363548843e-06, -7.96142543124197e-07,
        5.446941930669446e-07, -3.7266161283438227e-07, 2.549626552021554e-07, -1.7443695117727745e-07,
        1.1934394829830244e-07, -8.165115189488409e-08, 5.586299683532171e-08, -3.821960061917494e-08,
        2.6148576951961865e-08, -1.788998486491149e-08};
    const double d = (x - 1.4616321449683622) - 9.549995429965697e-17;
    double p = c[45];
    for (int k = 44; k >= 0; k--)
        p = c[k] + d * p;
    return d * p;
}

/* ψ(x) = d log Γ(x)/dx. x < 0: ψ(x) = ψ(1 − x) − π/tan(πx). 0.86 <= x < 2.06: the root series; below, one
 * step up (ψ(x) = ψ(x + 1) − 1/x); 2.06 <= x < 7: m steps down into it (ψ(x) = ψ(x − m) + Σ_{j=1..m}
 * 1/(x − j)), so no step cancels much. From 7: ψ(x) = ψ(x + n) − Σ_{k<n} 1/(x + k) with y = x + n >= 12
 * and the asymptotic series ψ(y) ≈ ln y − 1/(2y) − Σ_{k=1..7} B_2k / (2k·y^2k). */
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
    if (x < 0.86)
        return (real)(r + (tg_digamma_root(x + 1.0) - 1.0 / x));
    if (x < 7.0) {
        int m = 0;
        while (x - m >= 2.06)
            m++;
        double s = tg_digamma_root(x - m);   /* x − m is exact: an integer off a double of larger exponent */
        for (int j = m; j >= 1; j--)
            s += 1.0 / (x - j);
        return (real)(r + s);
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
