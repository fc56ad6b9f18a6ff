"""Linear algebra by LAPACK: cholesky, triangular_solve, solve, logdet.

Registry entries of this family (see ``tapegrad.ops`` for what an entry holds)."""
