"""The ops as functions and as Var methods/operators; scalars and arrays are lifted onto the tape."""
import builtins
import math
import numbers

import numpy as np

from . import ops as O
from . import ops_index as OX
from .ops import Bad, check_axes
from .tape import Var
from .errors import ShapeError, at


def _tape(*xs):
    for x in xs:
        if isinstance(x, Var):
            return x.tape
    raise TypeError(f"expected at least one Var among {[type(x).__name__ for x in xs]}")


def _var(x, tape):
    """A Var for a float operand ``x``: Vars pass through, arrays become constants on ``tape`` (integer
    and bool arrays are converted to the tape's dtype here, as NumPy promotes them in arithmetic)."""
    if isinstance(x, Var):
        return x
    if not isinstance(x, np.ndarray) or x.dtype.kind in "biu":
        x = np.asarray(x, dtype=tape.dtype)
    return tape.const(x)


def _data(x, tape):
    """A Var for a data operand (indices, a mask): Vars pass through, arrays become data constants."""
    return x if isinstance(x, Var) else tape.const(np.asarray(x))


def _scalar(x):
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) and np.ndim(x) == 0


def _binary(op, scalar_rule, a, b):
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(op, a, b)
    if scalar_rule is not None and isinstance(a, Var) and _scalar(b):
        return scalar_rule(a, float(b), False)
    if scalar_rule is not None and isinstance(b, Var) and _scalar(a):
        return scalar_rule(b, float(a), True)
    tape = _tape(a, b)
    return tape.apply(op, _var(a, tape), _var(b, tape))


def _adds(v, s, flip):
    return v.tape.apply(O.adds, v, None, s)


def _subs(v, s, flip):
    if flip:  # s − v = (−v) + s, rounded identically
        return v.tape.apply(O.adds, v.tape.apply(O.neg, v), None, s)
    return v.tape.apply(O.adds, v, None, -s)


def _muls(v, s, flip):
    return v.tape.apply(O.muls, v, None, s)


def _divs(v, s, flip):
    return v.tape.apply(O.rdivs if flip else O.divs, v, None, s)


def add(a, b):
    """a + b, broadcasting (a Python scalar on either side becomes ``adds``)."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.add, a, b)
    return _binary(O.add, _adds, a, b)


def sub(a, b):
    """a − b, broadcasting."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.sub, a, b)
    return _binary(O.sub, _subs, a, b)


def mul(a, b):
    """a · b, broadcasting (a scalar on either side becomes ``muls``)."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.mul, a, b)
    return _binary(O.mul, _muls, a, b)


def div(a, b):
    """a / b, broadcasting (a scalar divisor becomes ``divs``, a scalar dividend ``rdivs``)."""
    return _binary(O.div, _divs, a, b)


def maximum(a, b):
    """Elementwise max, broadcasting; ties share the gradient equally."""
    return _binary(O.maximum, None, a, b)


def _unary(op):
    def f(a):
        return a.tape.apply(op, a)
    f.__name__ = op.name
    f.__doc__ = op.doc or f"elementwise {op.name}"
    return f


neg, relu, sigmoid, tanh, exp, log, sqrt, abs, square = (
    _unary(getattr(O, n)) for n in ("neg", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "abs", "square"))


def power(a, p):
    """a ** p for a constant p (``square`` when p == 2)."""
    if not _scalar(p):
        raise TypeError(f"{at('pow', len(a.tape))}: the exponent must be a constant number, got {type(p).__name__}")
    return a.tape.apply(O.square if p == 2 else O.pow, a, None, None if p == 2 else float(p))


def _axes(opname, a, axis, keepdims):
    try:
        return (check_axes(a.shape, axis), bool(keepdims))
    except Bad as e:
        raise ShapeError(f"{at(opname, len(a.tape))}: {e}") from None


def _reduce(op):
    def f(a, axis=None, keepdims=False):
        if a.id < 0:
            return a
        try:
            s = _axes(op.name, a, axis, keepdims)
        except ShapeError as e:
            return a.tape._fail(e)
        return a.tape.apply(op, a, None, s)
    f.__name__ = op.name
    f.__doc__ = f"{op.doc}. ``axis``: int, tuple or None (all); ``keepdims`` as in NumPy."
    return f


sum, mean, max = (_reduce(getattr(O, n)) for n in ("sum", "mean", "max"))


def matmul(a, b):
    """(m, k) @ (k, n) through BLAS."""
    return _binary(O.matmul, None, a, b)


def bmm(a, b):
    """Batched (B, m, k) @ (B, k, n)."""
    return _binary(O.bmm, None, a, b)


def transpose(a, axes=None):
    """Permute axes (default: reverse them), as ``numpy.transpose``."""
    if a.id < 0:
        return a
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(int(k) % builtins.max(a.ndim, 1) for k in axes)
    return a.tape.apply(O.transpose, a, None, axes)


def reshape(a, *shape):
    """A copy with a new shape (one -1 is inferred, as in NumPy)."""
    if a.id < 0:
        return a
    shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
    shape = tuple(int(n) for n in shape)
    if shape.count(-1) == 1:
        rest = math.prod([n for n in shape if n != -1])
        if rest and a.size % rest == 0:
            shape = tuple(a.size // rest if n == -1 else n for n in shape)
    return a.tape.apply(O.reshape, a, None, shape)


def broadcast_to(a, shape):
    """Broadcast to ``shape`` (the gradient sums back over the stretched axes)."""
    return a.tape.apply(O.broadcast_to, a, None, tuple(int(n) for n in shape))


def _axis_op(op):
    def f(a, axis=-1):
        if a.id < 0:
            return a
        if not isinstance(axis, (int, np.integer)) or not -a.ndim <= axis < a.ndim:
            return a.tape._fail(ShapeError(f"{at(op.name, len(a.tape))}: axis {axis!r} is out of range for an "
                                           f"input of shape {a.shape}"))
        return a.tape.apply(op, a, None, int(axis) % a.ndim)
    f.__name__ = op.name
    f.__doc__ = op.doc
    return f


softmax, log_softmax = _axis_op(O.softmax), _axis_op(O.logsoftmax)


def concat(xs, axis=0):
    """Join Vars along ``axis`` (a chain of binary ``concat`` nodes)."""
    xs = list(xs)
    out = xs[0]
    for x in xs[1:]:
        if out.id < 0:
            return out
        nd = builtins.max(out.ndim, 1)
        out = out.tape.apply(O.concat, out, x, int(axis) % nd if -nd <= axis < nd else axis)
    return out


def getitem(a, key):
    """NumPy basic indexing (ints, slices with any step, ``None``, ``...``) plus one integer array
    (or integer data Var) index, as ``x[idx]`` for an embedding lookup: ``take`` along that axis.

    >>> import tapegrad as tg, numpy as np
    >>> x = tg.Tape().param(np.arange(12.0).reshape(4, 3))
    >>> x[::-2, 1].value.tolist(), x[np.array([2, 0]), 1:].value.tolist()
    ([10.0, 4.0], [[7.0, 8.0], [1.0, 2.0]])
    """
    if a.id < 0:
        return a
    key = key if isinstance(key, tuple) else (key,)
    here = at("getitem", len(a.tape))
    dots = [i for i, k in enumerate(key) if k is Ellipsis]
    if len(dots) > 1:
        return a.tape._fail(ShapeError(f"{here}: at most one ... in an index, got {key!r}"))
    used = builtins.sum(k is not None and k is not Ellipsis for k in key)
    if dots:
        i = dots[0]
        key = key[:i] + (slice(None),) * (a.ndim - used) + key[i + 1:]
    if used > a.ndim:
        return a.tape._fail(ShapeError(f"{here}: too many indices for shape {a.shape}: {key!r}"))
    key = key + (slice(None),) * (a.ndim - used)
    ranges, drop, new, adv, out_axis = [], [], [], None, 0
    for k in key:
        if k is None:
            new.append(out_axis)
            out_axis += 1
            continue
        d = len(ranges)
        n = a.shape[d]
        if isinstance(k, slice):
            ranges.append(k.indices(n))
        elif _scalar_index(k):
            j = int(k)
            if not -n <= j < n:
                return a.tape._fail(ShapeError(f"{here}: index {j} is out of range for axis {d} of length {n}"))
            ranges.append((j % n, j % n + 1, 1))
            drop.append(d)
            continue
        elif adv is None and (isinstance(k, (Var, list)) or (isinstance(k, np.ndarray) and k.dtype.kind in "iu")):
            adv = (d, out_axis, k)
            ranges.append((0, n, 1))
        else:
            what = "a bool mask (the result's shape would depend on the data: use tg.where)" if \
                np.asarray(k).dtype.kind == "b" else f"{type(k).__name__} {k!r}" if adv is None else \
                "a second array index (use take / take_along_axis)"
            return a.tape._fail(ShapeError(f"{here}: unsupported index {what}"))
        out_axis += 1
    out = a
    if any(r != (0, n, 1) for r, n in zip(ranges, a.shape)):
        out = a.tape.apply(O.slice, a, None, tuple(ranges))
    shape = list(out.shape) if out.id >= 0 else []
    if adv is not None:
        d, _, idx = adv
        if drop and (builtins.min(drop) < d < builtins.max(drop) or (drop[0] < d and drop[-1] > d)):
            return a.tape._fail(ShapeError(f"{here}: integers on both sides of an array index (NumPy would move "
                                           f"the result's axes): use tg.take explicitly"))
        idx = _data(idx, a.tape)
        out = take(out, idx, d)
        if out.id < 0:
            return out
        shape = list(out.shape)
        k = idx.ndim
        drop = [q if q < d else q + k - 1 for q in drop]
    if drop or new:
        keep = [n for q, n in enumerate(shape) if q not in drop]
        for p in new:
            keep.insert(p, 1)
        out = reshape(out, tuple(keep))
    return out


def _scalar_index(k):
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def mse(y, t):
    """Mean squared error mean((y − t)²), a composite of registry ops."""
    return mean(square(sub(y, t)))


def softmax_cross_entropy(logits, targets, axis=-1):
    """Mean over rows of −Σ targets · log_softmax(logits) along ``axis`` (one fused node).

    ``targets`` (one-hot or any distribution per row) may be a Var or an array.
    """
    tape = _tape(logits, targets)
    logits, targets = _var(logits, tape), _var(targets, tape)
    if logits.id < 0 or targets.id < 0:
        return logits if logits.id < 0 else targets
    nd = builtins.max(logits.ndim, 1)
    if not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        return tape._fail(ShapeError(f"{at('softmax_xent', len(tape))}: axis {axis!r} is out of range for "
                                     f"logits of shape {logits.shape}"))
    return tape.apply(O.softmax_xent, logits, targets, int(axis) % nd)


def _install():
    V = Var
    V.__add__ = add
    V.__radd__ = lambda a, b: add(b, a)
    V.__sub__ = sub
    V.__rsub__ = lambda a, b: sub(b, a)
    V.__mul__ = mul
    V.__rmul__ = lambda a, b: mul(b, a)
    V.__truediv__ = div
    V.__rtruediv__ = lambda a, b: div(b, a)
    V.__matmul__ = matmul
    V.__rmatmul__ = lambda a, b: matmul(b, a)
    V.__neg__ = neg
    V.__pow__ = power
    V.__getitem__ = getitem
    for f in (relu, sigmoid, tanh, exp, log, sqrt, abs, square, sum, mean, max, transpose, reshape,
              broadcast_to, softmax, log_softmax):
        setattr(V, f.__name__ if f.__name__ != "logsoftmax" else "log_softmax", f)
    V.__abs__ = abs
    V.T = property(transpose)


_install()


# ── special functions (ops_special) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)


# ── scans and reductions (ops_scan) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)


# ── selection and indexing (ops_index) ─────────────────────────────────────────────

def where(mask, a, b):
    """``a`` where the bool ``mask`` holds, else ``b``, broadcasting all three (``jnp.where``).

    The branch not taken receives exact zeros in backward, so its values (a ``-inf`` mask fill) never
    leak into the result or the gradient — a masked softmax:

    >>> import tapegrad as tg, numpy as np
    >>> tape = tg.Tape()
    >>> x = tape.param(np.array([0.0, np.log(3.0), 5.0]))
    >>> p = tg.where(np.array([True, True, False]), x, -np.inf).softmax()
    >>> p.value.tolist()
    [0.25, 0.75, 0.0]
    >>> tape.backward(p[1]), tape.grad(x).tolist()
    (True, [-0.1875, 0.1875, 0.0])

    As in JAX, a branch that is NaN where it is not taken still poisons the gradient through its own
    rule (``0 · ∞``): guard the input too (``where(m, sqrt(where(m, x, 1)), 0)``).
    """
    tape = _tape(a, b, mask)
    m = _data(mask, tape)
    with np.errstate(invalid="ignore"):
        return tape.apply(OX.where, _var(a, tape), _var(b, tape), None, m)


def take(a, indices, axis=0):
    """``a`` gathered at integer ``indices`` along ``axis`` (``np.take``; an embedding lookup).

    Indices are a data Var or an integer array; out-of-range indices raise (see ``tapegrad.ops_index``).
    The gradient is a scatter-add in increasing index position, the same on every backend.
    """
    if a.id < 0:
        return a
    return a.tape.apply(OX.take, a, _data(indices, a.tape), _norm_axis(axis, a.ndim))


def take_along_axis(a, indices, axis):
    """``np.take_along_axis``: ``indices`` shaped like ``a`` except along ``axis``.

    >>> import tapegrad as tg, numpy as np
    >>> logp = tg.Tape().param(np.log([[0.5, 0.5], [0.25, 0.75]]))
    >>> labels = np.array([[1], [0]])
    >>> bool(-tg.take_along_axis(logp, labels, axis=1).mean().value == -np.log([0.5, 0.25]).mean())
    True
    """
    if a.id < 0:
        return a
    return a.tape.apply(OX.take_along_axis, a, _data(indices, a.tape), _norm_axis(axis, a.ndim))


def _scatter(op, a, indices, values, axis):
    if a.id < 0:
        return a
    tape = a.tape
    idx = _data(indices, tape)
    ax = _norm_axis(axis, a.ndim)
    v = _var(values, tape)
    if 0 <= ax < a.ndim and idx.id >= 0 and v.id >= 0:
        want = a.shape[:ax] + idx.shape + a.shape[ax + 1:]
        try:
            if v.shape != want and np.broadcast_shapes(v.shape, want) == want:
                v = broadcast_to(v, want)   # values broadcast as in x.at[i].add(v); else the shape rule says why
        except ValueError:
            pass
    return tape.apply(op, a, v, ax, idx)


def index_add(a, indices, values, axis=0):
    """``a.at[indices].add(values)`` along ``axis``: repeated indices accumulate, in index order.

    >>> import tapegrad as tg, numpy as np
    >>> x = tg.Tape().param(np.zeros(3))
    >>> tg.index_add(x, [0, 2, 0], 1.0).value.tolist()
    [2.0, 0.0, 1.0]
    """
    return _scatter(OX.index_add, a, indices, values, axis)


def index_set(a, indices, values, axis=0):
    """``a.at[indices].set(values)`` along ``axis``; with repeated indices the last occurrence wins."""
    return _scatter(OX.index_set, a, indices, values, axis)


def dynamic_slice(a, starts, sizes):
    """``lax.dynamic_slice``: a window of ``sizes`` at data-dependent ``starts`` (clamped to fit)."""
    if a.id < 0:
        return a
    return a.tape.apply(OX.dynamic_slice, a, _data(starts, a.tape), tuple(int(n) for n in sizes))


def dynamic_update_slice(a, update, starts):
    """``lax.dynamic_update_slice``: ``a`` with ``update`` written at ``starts`` (clamped to fit)."""
    if a.id < 0:
        return a
    tape = a.tape
    return tape.apply(OX.dynamic_update_slice, a, _var(update, tape), None, _data(starts, tape))


def flip(a, axis=None):
    """Reverse the order of elements along ``axis`` (an int, a tuple, or None for every axis): JAX's
    ``rev``, as a slice with step −1."""
    if a.id < 0:
        return a
    try:
        axes = check_axes(a.shape, axis) or ()
    except Bad as e:
        return a.tape._fail(ShapeError(f"{at('flip', len(a.tape))}: {e}"))
    axes = range(a.ndim) if axis is None else axes
    if not a.ndim:
        return a
    return a.tape.apply(O.slice, a, None, tuple((n - 1, -1, -1) if d in axes else (0, n, 1)
                                                 for d, n in enumerate(a.shape)))


def stack(xs, axis=0):
    """Join Vars of one shape along a new ``axis`` (reshape each, then ``concat``)."""
    xs = list(xs)
    if not xs:
        raise ShapeError("stack: expected at least one Var, got an empty sequence")
    nd = xs[0].ndim + 1
    if not -nd <= axis < nd:
        return xs[0].tape._fail(ShapeError(f"{at('stack', len(xs[0].tape))}: axis {axis} is out of range for "
                                           f"{nd - 1}-D inputs"))
    ax = axis % nd
    return concat([reshape(x, x.shape[:ax] + (1,) + x.shape[ax:]) for x in xs], axis=ax)


def split(a, indices_or_sections, axis=0):
    """``np.split``: a list of slices of ``a`` along ``axis`` (equal sections, or at the given indices)."""
    if a.id < 0:
        return [a]
    ax = _norm_axis(axis, a.ndim)
    if not 0 <= ax < a.ndim:
        return [a.tape._fail(ShapeError(f"{at('split', len(a.tape))}: axis {axis} is out of range for shape "
                                        f"{a.shape}"))]
    n = a.shape[ax]
    if _scalar_index(indices_or_sections):
        k = int(indices_or_sections)
        if k <= 0 or n % k:
            return [a.tape._fail(ShapeError(f"{at('split', len(a.tape))}: {n} elements along axis {ax} do not split "
                                            f"into {k} equal sections"))]
        cuts = [n // k * q for q in range(1, k)]
    else:
        cuts = [int(c) for c in indices_or_sections]
    bounds = list(zip([0] + cuts, cuts + [n]))
    full = [(0, m, 1) for m in a.shape]
    return [a.tape.apply(O.slice, a, None, tuple(full[:ax] + [(lo, hi, 1)] + full[ax + 1:])) for lo, hi in bounds]


def _norm_axis(axis, nd):
    if isinstance(axis, (int, np.integer)) and -nd <= axis < nd:
        return int(axis) % nd
    return axis


Var.take = take
Var.flip = flip


# ── convolution and pooling (ops_conv) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)


# ── linear algebra (ops_linalg) ─────────────────────────────────────────────

def cholesky(a):
    """The lower Cholesky factor L of a symmetric positive definite matrix: L·Lᵀ = (a + aᵀ)/2.

    ``a`` is (…, n, n); leading axes are a batch. The input is symmetrised first, as
    ``jax.numpy.linalg.cholesky`` does, so the gradient is symmetric and matches ``jax.grad``'s. LAPACK
    ``potrf``; a matrix that is not positive definite raises ``tapegrad.DomainError`` (tape unchanged).

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> a = tape.param(np.array([[4.0, 2.0], [2.0, 5.0]]))
    >>> tape.value(tg.cholesky(a))
    array([[2., 0.],
           [1., 2.]])
    """
    tape = _tape(a)
    return tape.apply(O.OPS["cholesky"], _var(a, tape))


def triangular_solve(a, b, left_side=True, lower=True, transpose_a=False, unit_diagonal=False):
    """x with op(a)·x = b (``left_side``) or x·op(a) = b, a triangular; op(a) = aᵀ when ``transpose_a``.

    The flags are ``jax.lax.linalg.triangular_solve``'s, with the same meaning; the defaults differ
    (here the left-side lower solve, as ``scipy.linalg.solve_triangular(lower=True)``). Only the
    ``lower`` (else upper) triangle of ``a`` is read, and not its diagonal when ``unit_diagonal``; the
    gradient of ``a`` is zero elsewhere. ``a`` is (…, k, k), ``b`` (…, k, n) on the left or (…, m, k)
    on the right, with equal batch axes. BLAS ``trsm``; a zero on the diagonal gives inf/NaN, as in
    BLAS and JAX.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> a = tape.param(np.array([[2.0, 0.0], [1.0, 4.0]]))
    >>> tape.value(tg.triangular_solve(a, np.array([[2.0], [9.0]])))
    array([[1.],
           [2.]])
    >>> tape.value(tg.triangular_solve(a, np.array([[4.0, 8.0]]), left_side=False))
    array([[1., 2.]])
    """
    tape = _tape(a, b)
    s = (bool(left_side), bool(lower), bool(transpose_a), bool(unit_diagonal))
    return tape.apply(O.OPS["triangular_solve"], _var(a, tape), _var(b, tape), s)


def solve(a, b):
    """x with a·x = b for a square ``a`` (…, n, n): LU with partial pivoting (LAPACK ``gesv``).

    ``b`` is (…, n, k) with a's batch axes, or a vector (n,) when ``a`` is one matrix (NumPy 2's rule).
    An exactly singular ``a`` raises ``tapegrad.DomainError`` (tape unchanged).

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> a = tape.param(np.array([[1.0, 2.0], [3.0, 4.0]]))
    >>> x = tg.solve(a, np.array([5.0, 6.0]))
    >>> tape.value(x)
    array([-4. ,  4.5])
    >>> tape.backward(x.sum()); tape.grad(a)           # −a⁻ᵀ·1·xᵀ
    True
    array([[-2.  ,  2.25],
           [ 2.  , -2.25]])
    """
    tape = _tape(a, b)
    a, b = _var(a, tape), _var(b, tape)
    if a.id < 0 or b.id < 0:
        return a if a.id < 0 else b
    if b.ndim == 1 and a.ndim == 2:
        x = tape.apply(O.OPS["solve"], a, reshape(b, b.shape[0], 1))
        return x if x.id < 0 else reshape(x, b.shape[0])
    return tape.apply(O.OPS["solve"], a, b)


def logdet(a):
    """log det of a symmetric positive definite matrix, 2·Σ log diag L with L = cholesky(a).

    ``a`` is (…, n, n) (read as (a + aᵀ)/2, like ``cholesky``); the result has the batch shape. The
    gradient is g·a⁻¹ (LAPACK ``gesv`` on the identity). A matrix that is not positive definite raises
    ``tapegrad.DomainError``; ``slogdet`` takes general matrices (LU).

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> m = np.array([[2.0, 1.0], [1.0, 2.0]])
    >>> a = tape.param(m)
    >>> d = tg.logdet(a)
    >>> float(tape.value(d)), float(np.log(3.0))
    (1.0986122886681096, 1.0986122886681098)
    >>> tape.backward(d); np.allclose(tape.grad(a), np.linalg.inv(m), rtol=1e-15)
    True
    True
    """
    tape = _tape(a)
    return tape.apply(O.OPS["logdet"], _var(a, tape))


def slogdet(a):
    """(sign, log|det a|) of a general square matrix, as ``numpy.linalg.slogdet``: two Vars.

    Both come from the LU factors (LAPACK ``getrf``): the sign is Π sign(Uᵢᵢ) times −1 per row
    interchange (it has no gradient), the log Σ log|Uᵢᵢ|, whose gradient is g·a⁻ᵀ. An exactly singular
    matrix gives sign 0 and log −inf (and no finite gradient), as NumPy. For a symmetric positive
    definite matrix ``logdet`` (Cholesky, half the work) is the faster way to the same number.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> a = tape.param(np.array([[0.0, 2.0], [4.0, 1.0]]))
    >>> sign, ld = tg.slogdet(a)
    >>> float(tape.value(sign)), float(tape.value(ld)) == float(np.log(8.0))
    (-1.0, True)
    >>> tape.backward(ld); tape.grad(a)          # a⁻ᵀ
    True
    array([[-0.125,  0.5  ],
           [ 0.25 ,  0.   ]])
    """
    tape = _tape(a)
    a = _var(a, tape)
    return tape.apply(O.OPS["det_sign"], a), tape.apply(O.OPS["logabsdet"], a)


for _f in (cholesky, logdet):
    setattr(Var, _f.__name__, _f)
