"""The distance the JAX-facing tests hold two pytrees of arrays to (imported by the test files that compare with jax)."""
import numpy as np


def rel(a, b):
    """max |a − b| over the largest finite |b| (0 for no leaves); the same inf or NaN on both sides is no
    difference, a NaN or inf on one side only is an infinite one. The leaves are read as NumPy arrays (no
    XLA compile per leaf) and must match in number and shape."""
    import jax
    la, lb = [np.asarray(x) for x in jax.tree.leaves(a)], [np.asarray(y) for y in jax.tree.leaves(b)]
    assert len(la) == len(lb) and all(x.shape == y.shape for x, y in zip(la, lb)), \
        ([x.shape for x in la], [y.shape for y in lb])
    if not lb:
        return 0.0
    scale = max(float(np.max(np.abs(np.where(np.isfinite(y), y, 0.0)), initial=0.0)) for y in lb) or 1.0
    worst = 0.0
    for x, y in zip(la, lb):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):
            d = np.where(same, 0.0, np.abs(x - y))
        worst = max(worst, float(np.max(np.where(np.isnan(d), np.inf, d), initial=0.0)))
    return worst / scale
