"""Ordered mode: products and sums in one documented order, so every backend agrees bit for bit.

NumPy's ``matmul`` calls BLAS (blocked, FMA, the order its kernel picks) and ``np.add.reduce`` sums a
contiguous block pairwise; a C loop, a CUDA thread or cuBLAS each pick another order, so their results
differ in the last bits. In ordered mode the tape records these variants instead, and every backend
(the eager tape, the NumPy replay, native C, the CUDA program) computes

- ``matmul``: each output element a serial dot over k in index order, ``acc = 0; acc = acc + a·b``,
  one rounding per multiply and per add (no FMA);
- ``sum``/``mean``: each output element ``acc = 0; acc = acc + x`` over the reduced elements in
  row-major index order (``mean`` then divides by the count, as the default rule does).

Everything else is already IEEE-exact per element or follows one order (a broadcast input's gradient
is summed over leading axes row by row, which is NumPy's order and this one). Ordered mode costs speed
(no BLAS): see docs/benchmarks.md ("Ordered mode"). The variants are not registry entries of their own: they are the
same ops with another summation order, looked up here by ``Tape(ordered=True)`` and
``capture(..., ordered=True)``.

>>> import numpy as np, tapegrad as tg
>>> t = tg.Tape(ordered=True)
>>> w = t.param(np.array([[0.1], [0.2], [0.3]]))
>>> y = t.const(np.array([[1.0, 2.0, 3.0]])) @ w
>>> t._nodes[y.id].op.name, float(t.value(y)[0, 0]) == (0.0 + 1.0 * 0.1) + 2.0 * 0.2 + 3.0 * 0.3
('matmul_ordered', True)
"""
import numpy as np

from . import ops as O


def dot_rows(a, b, out, tmp):
    """out[i, j] = Σ_k a[i, k]·b[k, j], serially in k from 0 (a, b any strided 2-D views)."""
    out.fill(0.0)
    for k in range(a.shape[1]):
        np.multiply(a[:, k, None], b[None, k, :], out=tmp)
        np.add(out, tmp, out=out)
    return out


def matmul_fwd(a, b, s, out, ws):
    dot_rows(a, b, out, ws.take(out.shape))


def matmul_da(g, out, a, b, s, ws):
    """g @ bᵀ, serial over the output's columns j."""
    return dot_rows(g, b.T, ws.take(a.shape), ws.take(a.shape))


def matmul_db(g, out, a, b, s, ws):
    """aᵀ @ g, serial over the batch rows i."""
    return dot_rows(a.T, g, ws.take(b.shape), ws.take(b.shape))


def serial_sum(a, s, out, ws):
    """Σ over the axes of ``s`` in row-major order of the reduced index, into ``out`` (kept shape)."""
    axes = tuple(range(a.ndim)) if s[0] is None else s[0]
    kept = [k for k in range(a.ndim) if k not in axes]
    x = a.transpose(kept + list(axes)).reshape(tuple(a.shape[k] for k in kept) + (-1,))
    acc = out.reshape(tuple(a.shape[k] for k in kept))
    acc.fill(0.0)
    for r in range(x.shape[-1]):
        np.add(acc, x[..., r], out=acc)


def sum_fwd(a, b, s, out, ws):
    serial_sum(a, s, out, ws)


def mean_fwd(a, b, s, out, ws):
    serial_sum(a, s, out, ws)
    np.divide(out, O.count(a.shape, s), out=out)


def _variant(base, name, **kw):
    fields = {f: getattr(base, f) for f in ("arity", "shape", "fwd", "da", "db", "ref", "kind", "aliases",
                                             "domain", "cases", "doc", "inputs", "check", "keep")}
    fields.update(kw, tier="exact")
    fields["inputs"] = base.inputs
    return O.Op(name, **fields)


matmul = _variant(O.matmul, "matmul_ordered", fwd=matmul_fwd, da=matmul_da, db=matmul_db,
                  doc="(m, k) @ (k, n), each element a serial dot over k (ordered mode)")
sum_ = _variant(O.sum, "sum_ordered", fwd=sum_fwd, doc="Σ over axes, serially in index order (ordered mode)")
mean = _variant(O.mean, "mean_ordered", fwd=mean_fwd, doc="Σ/n over axes, Σ serial (ordered mode)")

# default op -> its ordered variant (read by Tape(ordered=True) and capture(..., ordered=True))
ORDERED = {O.matmul: matmul, O.sum: sum_, O.mean: mean}
# every ordered variant -> the default op it replaces
DEFAULT = {v: k for k, v in ORDERED.items()}


def order_of(op):
    """The op an ordered program runs for ``op`` (itself when it has no ordered variant)."""
    return ORDERED.get(op, op)

