"""Special functions: log1p, expm1, erf, erfc, lgamma, digamma, trigonometric and hyperbolic functions, softplus.

Registry entries of this family (see ``tapegrad.ops`` for what an entry holds)."""
