"""Scans and reductions beyond sum/mean/max: cumulative sums, products and maxima, sort, min, prod, logsumexp.

Registry entries of this family (see ``tapegrad.ops`` for what an entry holds)."""
