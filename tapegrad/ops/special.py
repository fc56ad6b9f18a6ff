"""Special functions: log1p, expm1, erf, erfc, lgamma, digamma, trigonometric and hyperbolic functions, softplus.

Registry entries of this family (see ``tapegrad.ops.registry`` for what an entry holds). Forwards are NumPy's
ufuncs, or SciPy's (``scipy.special``) where NumPy has none; the C forms call the C library's function of
the same name (digamma and trigamma, which the C library lacks, are ``tg_digamma``/``tg_trigamma`` in the
native runtime: a Taylor series around ψ's root, a recurrence, the asymptotic series). All are tier "libm": NumPy's
SIMD libm, SciPy's Cephes and the C library each round their own way.
"""
import numpy as np
import scipy.special as sc

from .core import BIN, UN, broadcast, into, same
from .registry import away0, op, positive, real

# 2/√π, the constant of d erf/dx = 2/√π · e^(−x²)
TWO_OVER_SQRTPI = 1.1283791670955126
# The native tests' bound for functions whose C and NumPy/SciPy forms agree only absolutely where a result
# cancels to near zero (lgamma at 1 and 2, expm1's gradient out + 1 as a → −∞, erfc beyond 26.5 where SciPy
# flushes to 0 and glibc does not): 8 ulp or 8·eps·max(1, |result|). Measured on 50,000 inputs each from the
# test domain and a wide range: at most 1.9·eps·max(1, |result|).
NEAR_ZERO = (8, 1.0)


def gauss(t, a):
    """t = 2/√π · e^(−a²), the derivative of erf (shared by erf and erfc)."""
    np.multiply(a, a, out=t)
    np.negative(t, out=t)
    np.exp(t, out=t)
    return np.multiply(TWO_OVER_SQRTPI, t, out=t)


def half_logistic(a, out, ws, flip):
    """out = sigmoid(a) (flip=False) or sigmoid(−a) (flip=True), with e = exp(−|a|) that never overflows:
    sigmoid(a) = (a >= 0 ? 1 : e) / (1 + e); sigmoid(−a) = (a <= 0 ? 1 : e) / (1 + e)."""
    e = ws.take(a.shape)
    np.abs(a, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.add(1.0, e, out=out)
    cmp = np.less_equal if flip else np.greater_equal
    np.copyto(e, 1.0, where=cmp(a, 0.0, out=ws.take_mask(a.shape)))
    np.divide(e, out, out=out)


def log1p_exp_neg_abs(a, ws):
    """log1p(e^−|a|) into scratch: the exponent is never positive, so nothing overflows."""
    t = ws.take(a.shape)
    np.abs(a, out=t)
    np.negative(t, out=t)
    np.exp(t, out=t)
    np.log1p(t, out=t)
    return t


def softplus_fwd(a, b, s, out, ws):
    # log(1 + eᵃ) = max(a, 0) + log1p(e^−|a|)
    t = log1p_exp_neg_abs(a, ws)
    np.maximum(a, 0.0, out=out)
    np.add(out, t, out=out)


def log_sigmoid_fwd(a, b, s, out, ws):
    # log sigmoid(a) = −softplus(−a) = min(a, 0) − log1p(e^−|a|)
    t = log1p_exp_neg_abs(a, ws)
    np.minimum(a, 0.0, out=out)
    np.subtract(out, t, out=out)


def logistic_da(flip):
    def da(g, out, a, b, s, ws):
        t = ws.take(a.shape)
        half_logistic(a, t, ws, flip)
        return np.multiply(g, t, out=t)
    return da


def atan2_da(g, out, a, b, s, ws):
    # ∂ atan2(a, b)/∂a = b / (a² + b²)
    t, u = ws.take(g.shape), ws.take(g.shape)
    np.multiply(a, a, out=t)
    np.multiply(b, b, out=u)
    np.add(t, u, out=t)
    np.multiply(g, b, out=u)
    return np.divide(u, t, out=u)


def atan2_db(g, out, a, b, s, ws):
    # ∂ atan2(a, b)/∂b = −a / (a² + b²)
    t = atan2_da(g, out, b, a, s, ws)
    return np.negative(t, out=t)


def wide(rng, shape):
    """Real inputs over several scales (softplus/log_sigmoid saturate on both sides)."""
    return rng.standard_normal(shape) * 4.0


def near0(rng, shape):
    """log1p's domain: a > −1, mostly near 0 where log1p beats log(1 + a)."""
    return rng.uniform(-0.6, 2.0, shape)


def away_poles(rng, shape):
    """tan away from its poles ±π/2."""
    return rng.uniform(-1.2, 1.2, shape)


log1p = op("log1p", 1, same, doc="log(1 + a), accurate near 0 (a > −1)",
           fwd=lambda a, b, s, out, ws: np.log1p(a, out=out),
           da=into(lambda g, out, a, b, s, t: (np.add(1.0, a, out=t), np.divide(g, t, out=t))),
           ref=lambda jnp, a, b, s: jnp.log1p(a),
           c_fwd="log1p(a)", c_da="g / (1.0 + a)", tier="libm", domain=(near0,), cases=UN)
expm1 = op("expm1", 1, same, doc="eᵃ − 1, accurate near 0; gradient g·(out + 1)",
           fwd=lambda a, b, s, out, ws: np.expm1(a, out=out),
           da=into(lambda g, out, a, b, s, t: (np.add(out, 1.0, out=t), np.multiply(g, t, out=t))),
           ref=lambda jnp, a, b, s: jnp.expm1(a),
           c_fwd="expm1(a)", c_da="g * (out + 1.0)", tier="libm", ulps=NEAR_ZERO, domain=(real,), cases=UN)
erf = op("erf", 1, same, doc="the error function (scipy.special.erf); gradient 2/√π·e^(−a²)",
         fwd=lambda a, b, s, out, ws: sc.erf(a, out=out),
         da=into(lambda g, out, a, b, s, t: np.multiply(g, gauss(t, a), out=t)),
         ref=lambda jnp, a, b, s: jnp.scipy.special.erf(a),
         c_fwd="erf(a)", c_da="g * (1.1283791670955126 * exp(-(a * a)))", tier="libm",
         domain=(real,), cases=UN)
erfc = op("erfc", 1, same, doc="1 − erf(a) without cancellation for large a (scipy.special.erfc)",
          fwd=lambda a, b, s, out, ws: sc.erfc(a, out=out),
          da=into(lambda g, out, a, b, s, t: (np.multiply(g, gauss(t, a), out=t), np.negative(t, out=t))),
          ref=lambda jnp, a, b, s: jnp.scipy.special.erfc(a),
          c_fwd="erfc(a)", c_da="-(g * (1.1283791670955126 * exp(-(a * a))))", tier="libm", ulps=NEAR_ZERO,
          domain=(real,), cases=UN)
lgamma = op("lgamma", 1, same, doc="log of abs Γ(a) (scipy.special.gammaln); gradient digamma(a)",
            fwd=lambda a, b, s, out, ws: sc.gammaln(a, out=out),
            da=into(lambda g, out, a, b, s, t: (sc.psi(a, out=t), np.multiply(g, t, out=t))),
            ref=lambda jnp, a, b, s: jnp.scipy.special.gammaln(a),
            c_fwd="lgamma(a)", c_da="g * tg_digamma(a)", tier="libm", ulps=NEAR_ZERO, domain=(positive,),
            cases=UN)
digamma = op("digamma", 1, same,
             doc="ψ(a) = d log Γ(a)/da (scipy.special.psi); gradient trigamma ψ'(a) = ζ(2, a)",
             fwd=lambda a, b, s, out, ws: sc.psi(a, out=out),
             # ψ'(a) = ζ(2, a), the Hurwitz zeta function: what scipy.special.polygamma(1, a) evaluates
             da=into(lambda g, out, a, b, s, t: (sc.zeta(2.0, a, out=t), np.multiply(g, t, out=t))),
             ref=lambda jnp, a, b, s: jnp.scipy.special.digamma(a),
             c_fwd="tg_digamma(a)", c_da="g * tg_trigamma(a)", tier="libm", domain=(positive,), cases=UN)
sin = op("sin", 1, same, doc="sin a; gradient cos a",
         fwd=lambda a, b, s, out, ws: np.sin(a, out=out),
         da=into(lambda g, out, a, b, s, t: (np.cos(a, out=t), np.multiply(g, t, out=t))),
         ref=lambda jnp, a, b, s: jnp.sin(a),
         c_fwd="sin(a)", c_da="g * cos(a)", tier="libm", domain=(wide,), cases=UN)
cos = op("cos", 1, same, doc="cos a; gradient −sin a",
         fwd=lambda a, b, s, out, ws: np.cos(a, out=out),
         da=into(lambda g, out, a, b, s, t: (np.sin(a, out=t), np.multiply(g, t, out=t), np.negative(t, out=t))),
         ref=lambda jnp, a, b, s: jnp.cos(a),
         c_fwd="cos(a)", c_da="-(g * sin(a))", tier="libm", domain=(wide,), cases=UN)
tan = op("tan", 1, same, doc="tan a; gradient 1 + out²",
         fwd=lambda a, b, s, out, ws: np.tan(a, out=out),
         da=into(lambda g, out, a, b, s, t: (np.multiply(out, out, out=t), np.add(1.0, t, out=t),
                                                np.multiply(g, t, out=t))),
         ref=lambda jnp, a, b, s: jnp.tan(a),
         c_fwd="tan(a)", c_da="g * (1.0 + out * out)", tier="libm", domain=(away_poles,), cases=UN)
atan2 = op("atan2", 2, broadcast, doc="the angle of (b, a), broadcasting (numpy.arctan2(a, b))",
           fwd=lambda a, b, s, out, ws: np.arctan2(a, b, out=out),
           da=atan2_da, db=atan2_db,
           ref=lambda jnp, a, b, s: jnp.arctan2(a, b),
           c_fwd="atan2(a, b)", c_da="g * b / (a * a + b * b)", c_db="-(g * a / (b * b + a * a))",
           tier="libm", domain=(away0, real), cases=BIN)   # a off the branch cut at a = 0, b < 0
asinh = op("asinh", 1, same, doc="arsinh a; gradient 1/√(a² + 1)",
           fwd=lambda a, b, s, out, ws: np.arcsinh(a, out=out),
           da=into(lambda g, out, a, b, s, t: (np.multiply(a, a, out=t), np.add(t, 1.0, out=t),
                                                  np.sqrt(t, out=t), np.divide(g, t, out=t))),
           ref=lambda jnp, a, b, s: jnp.arcsinh(a),
           c_fwd="asinh(a)", c_da="g / sqrt(a * a + 1.0)", tier="libm", domain=(wide,), cases=UN)
softplus = op("softplus", 1, same, fwd=softplus_fwd, da=logistic_da(False),
              ref=lambda jnp, a, b, s: jnp.logaddexp(a, 0.0),
              c_fwd="(a > 0.0 ? a : (a != a ? a : 0.0)) + log1p(exp(-fabs(a)))",
              c_da="g * ((a >= 0.0 ? 1.0 : exp(-fabs(a))) / (1.0 + exp(-fabs(a))))",
              tier="libm", domain=(wide,), cases=UN,
              doc="log(1 + eᵃ) = max(a, 0) + log1p(exp(−abs a)), finite for every finite a; gradient sigmoid(a)")
log_sigmoid = op("log_sigmoid", 1, same, fwd=log_sigmoid_fwd, da=logistic_da(True),
                 ref=lambda jnp, a, b, s: -jnp.logaddexp(-a, 0.0),
                 c_fwd="(a < 0.0 ? a : (a != a ? a : 0.0)) - log1p(exp(-fabs(a)))",
                 c_da="g * ((a <= 0.0 ? 1.0 : exp(-fabs(a))) / (1.0 + exp(-fabs(a))))",
                 tier="libm", domain=(wide,), cases=UN,
                 doc="log sigmoid(a) = min(a, 0) − log1p(exp(−abs a)); gradient sigmoid(−a)")
