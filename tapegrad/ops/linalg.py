"""Linear algebra by LAPACK: cholesky, triangular_solve, solve, logdet.

Registry entries of this family (see ``tapegrad.ops.registry`` for what an entry holds). Every factorisation and
triangular product is one call of a LAPACK/BLAS routine through the function table that a native
program receives at ``ctx[5]`` (``tapegrad.blas.lapack_pointers``): the tape calls the very
addresses, with the very arguments, that the generated C passes (``runtime_linalg.c`` mirrors ``Lapack``
below call for call), so a native replay reproduces the tape bit for bit. Everything else these ops do
(symmetrising, masking a triangle, halving a diagonal, transposing copies) is IEEE-exact.

Row-major matrices meet column-major LAPACK by reading each buffer as its transpose, never by copying:
a row-major lower-triangular ``L`` is the column-major upper ``Lᵀ``, so ``potrf('U')`` on the buffer of
a symmetric matrix leaves the row-major lower factor; a row-major ``op(A)·X = B`` is the column-major
``Xᵀ·op(Aᵀ) = Bᵀ`` (side and triangle flip, the transpose flag stays). The general solves copy: ``gesv``
factors its matrix in place and has no right-side form, so the matrix (or its transpose) and the
right-hand sides go through column-major scratch, O(n² + n·k) against the O(n³) factorisation.

``gesv`` rather than ``getrf`` + ``getrs``, and no ``potri``: OpenBLAS runs ``getrs`` and ``potri`` on
all its threads at any size, and on two busy cores a 16×16 ``potri`` took 2.6 ms to 79 ms instead of
21 µs single-threaded; ``gesv``, ``getrf`` and ``potrf`` stay on one thread for small matrices.

Matrices are the last two axes; leading axes are a batch (equal for both operands, no broadcasting),
looped over in order.
"""
import ctypes
import math

import numpy as np

from ..blas import LAPACK_ROUTINES, lapack_pointers
from .registry import Bad, op, real

# ── the LAPACK table, called from Python ─────────────────────────────────────

_TABLES = {}
_TRI = {}   # (n, k) -> the boolean mask of entries strictly above diagonal k (np.tri's complement)


def lapack(dtype):
    """The ``Lapack`` caller for ``dtype`` (built once; the table itself is ``blas.lapack_pointers``)."""
    la = _TABLES.get(dtype)
    if la is None:
        la = _TABLES[dtype] = Lapack(np.dtype(dtype).name)
    return la


class Lapack:
    """Row-major calls of the routines at ``ctx[5]``: potrf getrf gesv trsm trmm gemm.

    Each method takes row-major arrays (C-contiguous, last two axes the matrix) and passes LAPACK the
    column-major view of the same memory, as ``runtime_linalg.c``'s ``tg_la_*`` do.
    """

    def __init__(self, dtype):
        table, bits, self.where = lapack_pointers(dtype)
        self.int = np.dtype(np.int64 if bits == 64 else np.int32)
        self.dtype = np.dtype(dtype)
        P, C = ctypes.c_void_p, ctypes.c_char_p
        protos = {"potrf": (C, P, P, P, P), "getrf": (P, P, P, P, P, P), "gesv": (P, P, P, P, P, P, P, P),
                  "trsm": (C, C, C, C, P, P, P, P, P, P, P),
                  "trmm": (C, C, C, C, P, P, P, P, P, P, P), "gemm": (C, C, P, P, P, P, P, P, P, P, P, P, P)}
        self.f = {r: ctypes.CFUNCTYPE(None, *protos[r])(int(addr)) for r, addr in zip(LAPACK_ROUTINES, table)}

    def ints(self, *xs):
        v = np.array(xs + (0,), self.int)   # the last slot is LAPACK's info
        base, size = v.ctypes.data, self.int.itemsize
        return v, [base + k * size for k in range(len(v))]

    def scalars(self, *xs):
        v = np.array(xs, self.dtype)
        base, size = v.ctypes.data, self.dtype.itemsize
        return v, [base + k * size for k in range(len(v))]

    def potrf(self, w):
        """Cholesky of the symmetric matrix whose row-major lower triangle is in ``w`` (n×n), in place:
        the lower factor L (A = L·Lᵀ). Returns LAPACK's info (k > 0: the order-k minor is not positive
        definite)."""
        n = w.shape[-1]
        keep, (pn, pinfo) = self.ints(n)
        self.f["potrf"](b"U", pn, w.ctypes.data, pn, pinfo)
        return int(keep[-1])

    def getrf(self, w, ipiv):
        """LU with partial pivoting of the column-major view of ``w`` (that is, of Aᵀ), in place."""
        n = w.shape[-1]
        keep, (pn, pinfo) = self.ints(n)
        self.f["getrf"](pn, pn, w.ctypes.data, pn, ipiv.ctypes.data, pinfo)
        return int(keep[-1])

    def gesv(self, w, ipiv, bt):
        """Solve M·X = B in place, M the column-major view of ``w`` (n×n, row-major ``w`` holds Mᵀ, and is
        overwritten with M's LU factors), B column-major in ``bt`` (k×n row-major), overwritten with X.
        Returns LAPACK's info (k > 0: U[k-1, k-1] is exactly zero)."""
        n, k = w.shape[-1], bt.shape[0]
        keep, (pn, pk, pinfo) = self.ints(n, k)
        self.f["gesv"](pn, pk, w.ctypes.data, pn, ipiv.ctypes.data, bt.ctypes.data, pn, pinfo)
        return int(keep[-1])

    def trsm(self, left, lower, trans, unit, a, b):
        """Row-major op(A)·X = B (left) or X·op(A) = B (right), A triangular, in place on ``b`` (m×n)."""
        self._blas3("trsm", left, lower, trans, unit, a, b)

    def trmm(self, left, lower, trans, unit, a, b):
        """Row-major B ← op(A)·B (left) or B·op(A) (right), A triangular, in place on ``b`` (m×n)."""
        self._blas3("trmm", left, lower, trans, unit, a, b)

    def _blas3(self, name, left, lower, trans, unit, a, b):
        m, n = b.shape
        keep, (pcm, pcn, plda, _) = self.ints(n, m, a.shape[-1])   # column-major: bᵀ is n×m
        one, (pone,) = self.scalars(1.0)
        self.f[name](b"R" if left else b"L", b"U" if lower else b"L", b"T" if trans else b"N",
                     b"U" if unit else b"N", pcm, pcn, pone, a.ctypes.data, plda, b.ctypes.data, pcm)

    def gemm(self, ta, tb, alpha, a, b, c):
        """Row-major C ← alpha·op(A)·op(B) (C is m×n, the inner dimension k)."""
        m, n = c.shape
        k = a.shape[0] if ta else a.shape[1]
        keep, (pm, pn, pk, plda, pldb, _) = self.ints(m, n, k, a.shape[1], b.shape[1])
        s, (palpha, pzero) = self.scalars(alpha, 0.0)
        self.f["gemm"](b"T" if tb else b"N", b"T" if ta else b"N", pn, pm, pk, palpha, b.ctypes.data, pldb,
                       a.ctypes.data, plda, pzero, c.ctypes.data, pn)


def above(n, k=0):
    """Boolean (n, n) mask of the entries above diagonal k (k = 0: strictly upper; -1: the diagonal too)."""
    if (n, k) not in _TRI:
        m = ~np.tri(n, n, k, dtype=bool)
        m.flags.writeable = False
        _TRI[(n, k)] = m
    return _TRI[(n, k)]


def batches(x):
    """The matrices of a (…, m, n) array, in order, as (m, n) views."""
    return x.reshape((-1,) + x.shape[-2:])


def int_scratch(ws, n, la):
    """n LAPACK integers carved from the scratch provider (whose buffers are floats)."""
    words = -(-n * la.int.itemsize // la.dtype.itemsize)
    return ws.take((words,)).view(la.int)[:n]


def not_pd(info, q, nbatch):
    where = f"matrix {q} of the batch" if nbatch > 1 else "the matrix"
    return Bad(f"{where} is not positive definite: its leading minor of order {info} is not "
               f"(LAPACK potrf info {info}); expected a symmetric positive definite matrix")


def singular(info, q, nbatch):
    where = f"matrix {q} of the batch" if nbatch > 1 else "the matrix"
    return Bad(f"{where} is singular: U[{info - 1}, {info - 1}] of its LU factorisation is exactly zero "
               f"(LAPACK gesv info {info})")


def sym_lower(a, w):
    """w = the lower triangle of (a + aᵀ)·½, zeros above: the symmetric matrix LAPACK reads."""
    n = a.shape[-1]
    np.add(a, a.T, out=w)
    np.multiply(w, 0.5, out=w)
    np.copyto(w, 0.0, where=above(n))


# ── shape rules ──────────────────────────────────────────────────────────────

def square(a, what="a"):
    if len(a) < 2 or a[-1] != a[-2] or a[-1] == 0:
        raise Bad(f"expected {what} to be a non-empty square matrix (…, n, n), got shape {a}")


def cholesky_shape(a, b, s):
    square(a)
    return a


def logdet_shape(a, b, s):
    square(a)
    return a[:-2]


def trisolve_shape(a, b, s):
    left, lower, trans, unit = s
    square(a)
    k = a[-1]
    if len(b) != len(a) or b[:-2] != a[:-2] or (b[-2] if left else b[-1]) != k:
        want = f"(…, {k}, n)" if left else f"(…, m, {k})"
        raise Bad(f"expected b of shape {want} with a's batch dims {a[:-2]} ({'left' if left else 'right'} side, "
                  f"a is {a}), got {b}")
    return b


def solve_shape(a, b, s):
    square(a)
    n = a[-1]
    if len(b) != len(a) or b[:-2] != a[:-2] or b[-2] != n:
        raise Bad(f"expected b of shape (…, {n}, k) with a's batch dims {a[:-2]} (a is {a}), got {b}")
    return b


# ── cholesky ─────────────────────────────────────────────────────────────────

def cholesky_fwd(a, b, s, out, ws):
    la = lapack(a.dtype)
    A, L = batches(a), batches(out)
    for q in range(len(A)):
        sym_lower(A[q], L[q])
        info = la.potrf(L[q])
        if info:
            raise not_pd(info, q, len(A))


def cholesky_da(g, out, a, b, s, ws):
    # Murray 2016, "Differentiation of the Cholesky decomposition" (arXiv:1602.07527), its reverse-mode result:
    # Σ̄ = L⁻ᵀ Φ(Lᵀ L̄) L⁻¹, Φ = the lower triangle with the diagonal halved; the input is symmetrised
    # first, A ↦ (A + Aᵀ)/2, so Ā = (Σ̄ + Σ̄ᵀ)/2. L̄ is tril(g): the zeros above L are constants.
    la = lapack(a.dtype)
    n = a.shape[-1]
    t, c = ws.take(a.shape), ws.take(a.shape)
    L, G, M, C = batches(out), batches(g), batches(t), batches(c)
    for q in range(len(L)):
        np.copyto(M[q], G[q])
        np.copyto(M[q], 0.0, where=above(n))
        la.trmm(True, True, True, False, L[q], M[q])        # Lᵀ L̄
        np.copyto(M[q], 0.0, where=above(n))
        d = M[q].reshape(-1)[::n + 1]
        np.multiply(d, 0.5, out=d)                          # Φ(Lᵀ L̄)
        la.trsm(True, True, True, False, L[q], M[q])        # L⁻ᵀ Φ
        la.trsm(False, True, False, False, L[q], M[q])      # L⁻ᵀ Φ L⁻¹
        np.add(M[q], M[q].T, out=C[q])
        np.multiply(C[q], 0.5, out=C[q])
    return c


# ── triangular_solve ─────────────────────────────────────────────────────────

def trisolve_fwd(a, b, s, out, ws):
    left, lower, trans, unit = s
    la = lapack(a.dtype)
    np.copyto(out, b)
    A, X = batches(a), batches(out)
    for q in range(len(A)):
        la.trsm(left, lower, trans, unit, A[q], X[q])


def trisolve_db(g, out, a, b, s, ws):
    # Giles 2008, "An extended collection of matrix derivative results for forward and reverse mode
    # algorithmic differentiation" (Oxford NA report 08/01), the matrix inverse product:
    # X = op(A)⁻¹B ⇒ B̄ = op(A)⁻ᵀ X̄ (on the right side:
    # X = B op(A)⁻¹ ⇒ B̄ = X̄ op(A)⁻ᵀ): the same solve with the transpose flag flipped.
    left, lower, trans, unit = s
    la = lapack(a.dtype)
    t = ws.take(b.shape)
    np.copyto(t, g)
    A, T = batches(a), batches(t)
    for q in range(len(A)):
        la.trsm(left, lower, not trans, unit, A[q], T[q])
    return t


def trisolve_da(g, out, a, b, s, ws):
    # Giles 2008, inverse product: op(A)‾ = −B̄ Xᵀ (left) or −Xᵀ B̄ (right), B̄ as in trisolve_db; transposed back
    # when op(A) = Aᵀ, then restricted to the triangle the solve reads (strictly, with a unit diagonal).
    left, lower, trans, unit = s
    la = lapack(a.dtype)
    n = a.shape[-1]
    bbar = trisolve_db(g, out, a, b, s, ws)
    c = ws.take(a.shape)
    A, X, B, C = batches(a), batches(out), batches(bbar), batches(c)
    for q in range(len(A)):
        if left:
            la.gemm(False, True, -1.0, *((X[q], B[q]) if trans else (B[q], X[q])), C[q])
        else:
            la.gemm(True, False, -1.0, *((B[q], X[q]) if trans else (X[q], B[q])), C[q])
        mask = above(n, -1 if unit else 0)
        np.copyto(C[q], 0.0, where=mask if lower else mask.T)
    return c


# ── solve ────────────────────────────────────────────────────────────────────

def lu_scratch(la, n, ws):
    return ws.take((n, n)), int_scratch(ws, n, la)


def solve_fwd(a, b, s, out, ws):
    la = lapack(a.dtype)
    A, B, X = batches(a), batches(b), batches(out)
    bt = ws.take((B.shape[2], B.shape[1]))
    w, ipiv = lu_scratch(la, a.shape[-1], ws)
    for q in range(len(A)):
        np.copyto(w, A[q].T)            # column-major A
        np.copyto(bt, B[q].T)           # column-major B
        info = la.gesv(w, ipiv, bt)
        if info:
            raise singular(info, q, len(A))
        np.copyto(X[q], bt.T)


def solve_bbar(g, a, ws):
    """B̄ = A⁻ᵀ ḡ, returned transposed (k×n per matrix of the batch)."""
    la = lapack(a.dtype)
    A, G = batches(a), batches(g)
    yt = ws.take((len(A), G.shape[2], G.shape[1]))
    w, ipiv = lu_scratch(la, a.shape[-1], ws)
    for q in range(len(A)):
        np.copyto(w, A[q])              # column-major Aᵀ
        np.copyto(yt[q], G[q].T)
        la.gesv(w, ipiv, yt[q])         # Aᵀ Y = G
    return yt


def solve_db(g, out, a, b, s, ws):
    # Giles 2008, inverse product: X = A⁻¹B ⇒ B̄ = A⁻ᵀ X̄
    yt = solve_bbar(g, a, ws)
    t = ws.take(b.shape)
    np.copyto(batches(t), yt.transpose(0, 2, 1))
    return t


def solve_da(g, out, a, b, s, ws):
    # Giles 2008, inverse product: Ā = −B̄ Xᵀ
    la = lapack(a.dtype)
    yt = solve_bbar(g, a, ws)
    c = ws.take(a.shape)
    X, C = batches(out), batches(c)
    for q in range(len(C)):
        la.gemm(True, True, -1.0, yt[q], X[q], C[q])
    return c


def inverse(la, m, w, ipiv, c):
    """Row-major c = m⁻ᵀ for a row-major m: gesv solves m·X = I on the column-major views (w = mᵀ
    row-major is m column-major; X = m⁻¹ column-major is m⁻ᵀ row-major)."""
    np.copyto(w, m.T)
    np.copyto(c, 0.0)
    np.copyto(c.reshape(-1)[::m.shape[0] + 1], 1.0)
    la.gesv(w, ipiv, c)


# ── logdet ───────────────────────────────────────────────────────────────────

def logdet_fwd(a, b, s, out, ws):
    # 2 Σ log Lᵢᵢ, summed in order in double precision with the C library's log (math.log), as the
    # native kernel does, so a replay reproduces it exactly; then rounded once to the tape's dtype.
    la = lapack(a.dtype)
    n = a.shape[-1]
    A, o = batches(a), out.reshape(-1)
    w = ws.take((n, n))
    for q in range(len(A)):
        sym_lower(A[q], w)
        info = la.potrf(w)
        if info:
            raise not_pd(info, q, len(A))
        acc = 0.0
        for d in w.diagonal().tolist():
            acc = acc + math.log(d)
        o[q] = 2.0 * acc


def logdet_da(g, out, a, b, s, ws):
    # Giles 2008, determinant: d log det A = tr(A⁻¹ dA) ⇒ Ā = ḡ A⁻ᵀ; with A = (a + aᵀ)/2 symmetric, the inverse
    # (gesv on the identity) is symmetrised exactly, so the gradient is symmetric like cholesky's.
    la = lapack(a.dtype)
    n = a.shape[-1]
    A, G = batches(a), g.reshape(-1)
    c = ws.take(a.shape)
    C = batches(c)
    w, ipiv = lu_scratch(la, n, ws)
    m = ws.take((n, n))
    for q in range(len(A)):
        np.add(A[q], A[q].T, out=m)
        np.multiply(m, 0.5, out=m)
        inverse(la, m, w, ipiv, C[q])
        np.add(C[q], C[q].T, out=m)
        np.multiply(m, 0.5, out=m)
        np.multiply(m, G[q], out=C[q])
    return c


# ── slogdet of a general matrix: logabsdet and det_sign ─────────────────────

def log_abs(d):
    """log|d| with the C library's log (log 0 = −inf, as C's log and NumPy's slogdet give)."""
    return -math.inf if d == 0.0 else math.log(abs(d))


def lu_diagonals(a, ws):
    """For each matrix of the batch ``a``: (diagonal of its LU factors, pivots), factored by getrf one at
    a time in one reused buffer."""
    la = lapack(a.dtype)
    n = a.shape[-1]
    w, ipiv = lu_scratch(la, n, ws)
    for A in batches(a):
        np.copyto(w, A)
        la.getrf(w, ipiv)
        yield w.reshape(-1)[::n + 1].tolist(), ipiv.tolist()


def logabsdet_fwd(a, b, s, out, ws):
    # Σ log|Uᵢᵢ| of the LU factors, in order in double with the C library's log (as logdet_fwd); an
    # exactly singular matrix gives −inf, as numpy.linalg.slogdet.
    o = out.reshape(-1)
    for q, (diag, _) in enumerate(lu_diagonals(a, ws)):
        acc = 0.0
        for d in diag:
            acc = acc + log_abs(d)
        o[q] = acc


def logabsdet_da(g, out, a, b, s, ws):
    # Giles 2008, determinant: d log|det A| = tr(A⁻¹ dA) ⇒ Ā = ḡ A⁻ᵀ (gesv on the identity)
    la = lapack(a.dtype)
    n = a.shape[-1]
    A, G = batches(a), g.reshape(-1)
    c = ws.take(a.shape)
    C = batches(c)
    w, ipiv = lu_scratch(la, n, ws)
    for q in range(len(A)):
        inverse(la, A[q], w, ipiv, C[q])
        np.multiply(C[q], G[q], out=C[q])
    return c


def det_sign_fwd(a, b, s, out, ws):
    # Π sign(Uᵢᵢ) · (−1)^(row interchanges) of the LU factors (det Aᵀ = det A); 0 when singular
    o = out.reshape(-1)
    for q, (diag, piv) in enumerate(lu_diagonals(a, ws)):
        sign = 1.0
        for i, (d, p) in enumerate(zip(diag, piv)):
            sign = sign * (1.0 if d > 0.0 else -1.0 if d < 0.0 else 0.0) * (1.0 if p == i + 1 else -1.0)
        o[q] = sign


def zero_da(g, out, a, b, s, ws):
    """A piecewise-constant op: no gradient (exact zeros)."""
    c = ws.take(a.shape)
    c.fill(0.0)
    return c


# ── test domains ─────────────────────────────────────────────────────────────

def spd(rng, shape):
    """Symmetric positive definite, eigenvalues within about [1, 5]: X·Xᵀ/n + I, symmetrised exactly."""
    n = shape[-1]
    x = rng.standard_normal(shape)
    s = x @ np.swapaxes(x, -1, -2) / n + np.eye(n)
    return (s + np.swapaxes(s, -1, -2)) * 0.5


def triangular(rng, shape):
    """Both triangles well conditioned: diagonal ±[1, 2], off-diagonal entries within ±1/n."""
    n = shape[-1]
    m = rng.uniform(-1.0, 1.0, shape) / n
    d = rng.choice([-1.0, 1.0], shape[:-1]) * rng.uniform(1.0, 2.0, shape[:-1])
    idx = np.arange(n)
    m[..., idx, idx] = d
    return m


def general(rng, shape):
    """Nonsymmetric and pivoting: a random signed permutation with |entries| in [1, 2] plus noise of
    norm about 0.6 (condition number below about 7)."""
    n = shape[-1]
    out = 0.3 * rng.standard_normal(shape) / math.sqrt(n)
    for m in out.reshape((-1, n, n)):
        m[np.arange(n), rng.permutation(n)] += rng.choice([-1.0, 1.0], n) * rng.uniform(1.0, 2.0, n)
    return out


# ── the entries ──────────────────────────────────────────────────────────────

def _tri_ref(jnp, a, b, s):
    # independent of trsm: a general LU solve of the masked matrix (jnp.linalg.solve)
    left, lower, trans, unit = s
    n = a.shape[-1]
    t = jnp.tril(a) if lower else jnp.triu(a)
    if unit:
        t = t * (1.0 - jnp.eye(n)) + jnp.eye(n)
    if trans:
        t = jnp.swapaxes(t, -1, -2)
    if left:
        return jnp.linalg.solve(t, b)
    return jnp.swapaxes(jnp.linalg.solve(jnp.swapaxes(t, -1, -2), jnp.swapaxes(b, -1, -2)), -1, -2)


TRI_FLAGS = tuple((bool(l), bool(lo), bool(t), bool(u)) for l in (1, 0) for lo in (1, 0) for t in (0, 1)
                  for u in (0, 1))

cholesky = op("cholesky", 1, cholesky_shape, fwd=cholesky_fwd, da=cholesky_da,
              ref=lambda jnp, a, b, s: jnp.linalg.cholesky(a),
              tier="blas", kind="linalg", domain=(spd,),
              cases=(((3, 3), None, None), ((1, 1), None, None), ((5, 5), None, None), ((2, 4, 4), None, None)),
              doc="lower Cholesky factor L of (a + aᵀ)/2 = L·Lᵀ (LAPACK potrf); batched over leading axes")
triangular_solve = op("triangular_solve", 2, trisolve_shape, fwd=trisolve_fwd, da=trisolve_da, db=trisolve_db,
                      ref=_tri_ref, tier="blas", kind="linalg", domain=(triangular, real),
                      cases=tuple(((3, 3), (3, 2) if f[0] else (2, 3), f) for f in TRI_FLAGS)
                      + (((2, 4, 4), (2, 4, 3), (True, True, False, False)),
                         ((2, 3, 3), (2, 1, 3), (False, False, True, False))),
                      doc="x with op(a)·x = b (left) or x·op(a) = b; s = (left_side, lower, transpose_a, "
                          "unit_diagonal) as in jax.lax.linalg (BLAS trsm)")
solve = op("solve", 2, solve_shape, fwd=solve_fwd, da=solve_da, db=solve_db,
           ref=lambda jnp, a, b, s: jnp.linalg.solve(a, b),
           tier="blas", kind="linalg", domain=(general, real),
           cases=(((3, 3), (3, 2), None), ((4, 4), (4, 1), None), ((1, 1), (1, 3), None),
                  ((2, 3, 3), (2, 3, 2), None)),
           doc="x with a·x = b, LU with partial pivoting (LAPACK gesv)")
logdet = op("logdet", 1, logdet_shape, fwd=logdet_fwd, da=logdet_da,
            ref=lambda jnp, a, b, s: jnp.linalg.slogdet(0.5 * (a + jnp.swapaxes(a, -1, -2)))[1],
            tier="blas", kind="linalg", domain=(spd,),
            cases=(((3, 3), None, None), ((1, 1), None, None), ((6, 6), None, None), ((2, 4, 4), None, None)),
            doc="log det of a symmetric positive definite (a + aᵀ)/2: 2·Σ log diag L (LAPACK potrf)")
logabsdet = op("logabsdet", 1, logdet_shape, fwd=logabsdet_fwd, da=logabsdet_da,
               ref=lambda jnp, a, b, s: jnp.linalg.slogdet(a)[1],
               tier="blas", kind="linalg", domain=(general,),
               cases=(((3, 3), None, None), ((1, 1), None, None), ((5, 5), None, None), ((2, 4, 4), None, None)),
               doc="log abs(det a) of a general square matrix: Σ log abs(Uᵢᵢ) of its LU factors (LAPACK "
                   "getrf); −inf when singular")
det_sign = op("det_sign", 1, logdet_shape, fwd=det_sign_fwd, da=zero_da,
              ref=lambda jnp, a, b, s: jnp.linalg.slogdet(a)[0],
              tier="blas", kind="linalg", domain=(general,),
              cases=(((3, 3), None, None), ((1, 1), None, None), ((5, 5), None, None), ((2, 4, 4), None, None)),
              doc="the sign of det a (±1, 0 when singular) from its LU factors (LAPACK getrf); no gradient")
