"""Native C for ordered mode (``tapegrad.ordered``): serial index-order dots and sums as plain loops.

Compiled with ``-ffp-contract=off`` (no FMA) and without reassociation, each loop is the NumPy rule's
order exactly: ``acc = 0``, then ``acc = acc + x`` element by element.
"""
import math

from ... import ops as O
from .core import spread_da
from .registry import BACKWARD, FORWARD, red_mask, strides


def dot(dst, A, B, m, n, kk, sa, sb):
    """dst[i, j] = Σ_q A[i, q]·B[q, j] serially in q; ``sa``/``sb``: element strides (row, col) of A and B.

    The loops run i, q, j: every element still adds its products in increasing q from 0 (the order is
    per element), while the innermost loop over j vectorises."""
    return [f"for (long i = 0; i < {m}L; i++) {{",
            f"    real *restrict row = {dst} + i * {n}L;",
            f"    for (long j = 0; j < {n}L; j++) row[j] = {R0};",
            f"    for (long q = 0; q < {kk}L; q++) {{",
            f"        const real x = {A}[i * {sa[0]}L + q * {sa[1]}L];",
            f"        for (long j = 0; j < {n}L; j++) row[j] = row[j] + x * {B}[q * {sb[0]}L + j * {sb[1]}L];",
            "    } }"]


R0 = "R(0.0)"


def matmul_fwd(n):
    m, kk = n.ash
    nn = n.bsh[1]
    return dot(n.V, n.A, n.B, m, nn, kk, (kk, 1), (nn, 1))


def matmul_d(n):
    m, kk = n.ash
    nn = n.bsh[1]
    if n.side == "a":   # g @ bᵀ: serial over j
        return dot(n.dst, n.G, n.B, m, kk, nn, (nn, 1), (1, nn)), False
    return dot(n.dst, n.A, n.G, kk, nn, m, (1, kk), (nn, 1)), False   # aᵀ @ g: serial over i


def serial_reduce(x, out, shape, axes):
    """out[o] = Σ x over the reduced axes in row-major order of the reduced index (``acc = 0`` first)."""
    red = red_mask(shape, axes)
    st = strides(shape)
    kept = [(m, s) for m, s, r in zip(shape, st, red) if not r]
    rd = [(m, s) for m, s, r in zip(shape, st, red) if r]
    nout, nred = math.prod(m for m, _ in kept), math.prod(m for m, _ in rd)

    def offset(var, dims):
        terms, div = [], 1
        for m, s in reversed(dims):
            terms.append(f"(({var} / {div}L) % {m}L) * {s}L")
            div *= m
        return " + ".join(terms) or "0L"

    return [f"for (long o = 0; o < {nout}L; o++) {{",
            f"    const long base = {offset('o', kept)};",
            f"    real acc = {R0};",
            f"    for (long r = 0; r < {nred}L; r++) acc = acc + {x}[base + {offset('r', rd)}];",
            f"    {out}[o] = acc; }}"]


def reduce_fwd(n):
    lines = serial_reduce(n.A, n.V, n.ash, n.s[0])
    if n.name == "mean_ordered":
        cnt = O.count(n.ash, n.s)
        lines.append(f"for (long i = 0; i < {math.prod(n.osh)}L; i++) {n.V}[i] = {n.V}[i] / {n.d.lit(float(cnt))};")
    return lines


def reduce_da(n):
    return spread_da(n._replace(name=n.name.replace("_ordered", "")))


FORWARD.update({"matmul_ordered": matmul_fwd, "sum_ordered": reduce_fwd, "mean_ordered": reduce_fwd})
BACKWARD.update({"matmul_ordered": matmul_d, "sum_ordered": reduce_da, "mean_ordered": reduce_da})
