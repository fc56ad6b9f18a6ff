"""The native C of the linalg family's ops: printers registered into ``registry.FORWARD``/``BACKWARD``.

Each printer calls one ``runtime_linalg.c`` kernel that repeats the NumPy rule of ``tapegrad.ops.linalg``
call for call through the LAPACK table at ``T[5]``. Scratch: the forward may use S0..S2; a backward
printer leaves S0 alone (it may be ``n.dst``).
"""
import math

from .registry import BACKWARD, FORWARD, SCRATCH


def dims(n):
    """(batch count, rows, cols) of a's matrices."""
    return math.prod(n.ash[:-2]), n.ash[-2], n.ash[-1]


def flags(s):
    return ", ".join(str(int(f)) for f in s)


def cholesky_fwd(n):
    nb, _, k = dims(n)
    return [f"tg_cholesky(T, {n.A}, {n.V}, {nb}L, {k}L);"]


def cholesky_da(n):
    nb, _, k = dims(n)
    return [f"tg_cholesky_da(T, {n.V}, {n.G}, {n.dst}, {nb}L, {k}L);"], False


def trisolve_fwd(n):
    nb = math.prod(n.ash[:-2])
    m, c = n.bsh[-2:]
    return [f"memcpy({n.V}, {n.B}, {math.prod(n.bsh)}UL * sizeof(real));",
            f"tg_trisolve(T, {flags(n.s)}, {n.A}, {n.V}, {nb}L, {m}L, {c}L);"]


def trisolve_bbar(n, to):
    """B̄ = the same solve with the transpose flag flipped, applied to g (ops.linalg.trisolve_db)."""
    left, lower, trans, unit = n.s
    nb = math.prod(n.ash[:-2])
    m, c = n.bsh[-2:]
    return [f"memcpy({to}, {n.G}, {math.prod(n.bsh)}UL * sizeof(real));",
            f"tg_trisolve(T, {flags((left, lower, not trans, unit))}, {n.A}, {to}, {nb}L, {m}L, {c}L);"]


def trisolve_d(n):
    if n.side == "b":
        return trisolve_bbar(n, n.dst), False
    nb = math.prod(n.ash[:-2])
    m, c = n.bsh[-2:]
    return trisolve_bbar(n, "S1") + [f"tg_trisolve_da(T, {flags(n.s)}, {n.V}, S1, {n.dst}, {nb}L, {m}L, {c}L);"], False


def ipiv(nb, k, c):
    """The pivots sit in S2 after the nb·k·c values of B̄ᵀ, 64-byte aligned."""
    return f"(tg_bint *)(S2 + {-(-nb * k * c // 16) * 16}L)"


def solve_fwd(n):
    nb, _, k = dims(n)
    c = n.bsh[-1]
    return [f"tg_solve(T, {n.A}, {n.B}, {n.V}, S0, S1, (tg_bint *)S2, {nb}L, {k}L, {c}L);"]


def solve_d(n):
    nb, _, k = dims(n)
    c = n.bsh[-1]
    lines = [f"tg_solve_bbar(T, {n.A}, {n.G}, S2, S1, {ipiv(nb, k, c)}, {nb}L, {k}L, {c}L);"]
    if n.side == "b":   # dst = B̄ (B̄ᵀ transposed back)
        lines.append(f"for (long q = 0; q < {nb}L; q++) for (long i = 0; i < {k}L; i++) for (long j = 0; j < {c}L; "
                     f"j++) {n.dst}[(q * {k}L + i) * {c}L + j] = S2[(q * {c}L + j) * {k}L + i];")
    else:               # dst = −B̄ Xᵀ
        lines.append(f"for (long q = 0; q < {nb}L; q++) tg_la_gemm(T, 1, 1, {n.d.lit(-1.0)}, S2 + q * {k * c}L, "
                     f"{n.V} + q * {k * c}L, {n.dst} + q * {k * k}L, {k}L, {k}L, {c}L);")
    return lines, False


def logdet_fwd(n):
    nb, _, k = dims(n)
    return [f"tg_logdet(T, {n.A}, {n.V}, S0, {nb}L, {k}L);"]


def logdet_da(n):
    nb, _, k = dims(n)
    return [f"tg_logdet_da(T, {n.A}, {n.G}, {n.dst}, S1, S2, {ipiv(1, k, k)}, {nb}L, {k}L);"], False


def slogdet_fwd(n):
    nb, _, k = dims(n)
    return [f"tg_slogdet(T, {int(n.name == 'det_sign')}, {n.A}, {n.V}, S0, (tg_bint *)S1, {nb}L, {k}L);"]


def logabsdet_da(n):
    nb, _, k = dims(n)
    return [f"tg_logabsdet_da(T, {n.A}, {n.G}, {n.dst}, S1, (tg_bint *)S2, {nb}L, {k}L);"], False


def zero_da(n):
    return [f"tg_fill({n.dst}, {math.prod(n.ash)}L, {n.d.lit(0.0)});"], False


def solve_scratch(p, k):
    """Elements each of S0..S2 must hold: the matrix (n²), or B̄ᵀ of every matrix plus the pivots."""
    ash, bsh = p.shapes[p.nodes[k][1]], p.shapes[p.nodes[k][2]]
    nb, n, c = math.prod(ash[:-2]), ash[-1], bsh[-1]
    return max(n * n, n * c, -(-nb * n * c // 16) * 16 + 2 * n + 16)


def pivots_scratch(p, k):
    """The pivots (n LAPACK integers) fit in a scratch buffer even for 1×1 float32 matrices."""
    return 2 * p.shapes[p.nodes[k][1]][-1] + 16


def logdet_scratch(p, k):
    """S2 holds the symmetrised matrix, then the pivots."""
    n = p.shapes[p.nodes[k][1]][-1]
    return -(-n * n // 16) * 16 + 2 * n + 16


FORWARD.update({"cholesky": cholesky_fwd, "triangular_solve": trisolve_fwd, "solve": solve_fwd,
                        "logdet": logdet_fwd, "logabsdet": slogdet_fwd, "det_sign": slogdet_fwd})
BACKWARD.update({"cholesky": cholesky_da, "triangular_solve": trisolve_d, "solve": solve_d,
                         "logdet": logdet_da, "logabsdet": logabsdet_da, "det_sign": zero_da})
SCRATCH.update({"solve": solve_scratch, "logdet": logdet_scratch, "logabsdet": pivots_scratch,
                        "det_sign": pivots_scratch})
