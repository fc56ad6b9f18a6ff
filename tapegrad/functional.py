"""The ops as functions and as Var methods/operators; scalars and arrays are lifted onto the tape."""
from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import numpy as np
from numpy.typing import ArrayLike

from . import ops as O
from .ops import Bad, check_axes
from .tape import Operand, Tape, Var

Axis = Union[None, int, Sequence[int]]
from .errors import ShapeError, at


def _tape(*xs):
    for x in xs:
        if isinstance(x, Var):
            return x.tape
    raise TypeError(f"expected at least one Var among {[type(x).__name__ for x in xs]}")


def _var(x: Any, tape: Tape) -> Var:
    """A Var for ``x``: Vars pass through, arrays become constants on ``tape``."""
    if isinstance(x, Var):
        return x
    return tape.const(np.asarray(x, dtype=tape.dtype) if not isinstance(x, np.ndarray) else x)


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


def add(a: Operand, b: Operand) -> Var:
    """a + b, broadcasting (a Python scalar on either side becomes ``adds``)."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.add, a, b)
    return _binary(O.add, _adds, a, b)


def sub(a: Operand, b: Operand) -> Var:
    """a − b, broadcasting."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.sub, a, b)
    return _binary(O.sub, _subs, a, b)


def mul(a: Operand, b: Operand) -> Var:
    """a · b, broadcasting (a scalar on either side becomes ``muls``)."""
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.mul, a, b)
    return _binary(O.mul, _muls, a, b)


def div(a: Operand, b: Operand) -> Var:
    """a / b, broadcasting (a scalar divisor becomes ``divs``, a scalar dividend ``rdivs``)."""
    return _binary(O.div, _divs, a, b)


def maximum(a: Operand, b: Operand) -> Var:
    """Elementwise max, broadcasting; ties share the gradient equally."""
    return _binary(O.maximum, None, a, b)


def _unary(op) -> Callable[[Var], Var]:
    def f(a: Var) -> Var:
        return a.tape.apply(op, a)
    f.__name__ = op.name
    f.__doc__ = op.doc or f"elementwise {op.name}"
    return f


neg, relu, sigmoid, tanh, exp, log, sqrt, abs, square = (
    _unary(getattr(O, n)) for n in ("neg", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "abs", "square"))


def power(a: Var, p: float) -> Var:
    """a ** p for a constant p (``square`` when p == 2)."""
    if not _scalar(p):
        raise TypeError(f"{at('pow', len(a.tape))}: the exponent must be a constant number, got {type(p).__name__}")
    return a.tape.apply(O.square if p == 2 else O.pow, a, None, None if p == 2 else float(p))


def _axes(opname, a, axis, keepdims):
    try:
        return (check_axes(a.shape, axis), bool(keepdims))
    except Bad as e:
        raise ShapeError(f"{at(opname, len(a.tape))}: {e}") from None


def _reduce(op) -> Callable[..., Var]:
    def f(a: Var, axis: Axis = None, keepdims: bool = False) -> Var:
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


def matmul(a: Operand, b: Operand) -> Var:
    """(m, k) @ (k, n) through BLAS."""
    return _binary(O.matmul, None, a, b)


def bmm(a: Operand, b: Operand) -> Var:
    """Batched (B, m, k) @ (B, k, n)."""
    return _binary(O.bmm, None, a, b)


def transpose(a: Var, axes: Optional[Sequence[int]] = None) -> Var:
    """Permute axes (default: reverse them), as ``numpy.transpose``."""
    if a.id < 0:
        return a
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(int(k) % builtins.max(a.ndim, 1) for k in axes)
    return a.tape.apply(O.transpose, a, None, axes)


def reshape(a: Var, *shape: Any) -> Var:
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


def broadcast_to(a: Var, shape: Sequence[int]) -> Var:
    """Broadcast to ``shape`` (the gradient sums back over the stretched axes)."""
    return a.tape.apply(O.broadcast_to, a, None, tuple(int(n) for n in shape))


def _axis_op(op) -> Callable[..., Var]:
    def f(a: Var, axis: int = -1) -> Var:
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


def concat(xs: Iterable[Var], axis: int = 0) -> Var:
    """Join Vars along ``axis`` (a chain of binary ``concat`` nodes)."""
    xs = list(xs)
    out = xs[0]
    for x in xs[1:]:
        if out.id < 0:
            return out
        nd = builtins.max(out.ndim, 1)
        out = out.tape.apply(O.concat, out, x, int(axis) % nd if -nd <= axis < nd else axis)
    return out


def getitem(a: Var, key: Any) -> Var:
    """Basic slicing with step 1 (``v[1:3, :2]``); the result keeps every axis."""
    if a.id < 0:
        return a
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > a.ndim or any(not isinstance(k, slice) or k.step not in (None, 1) for k in key):
        return a.tape._fail(ShapeError(f"{at('slice', len(a.tape))}: expected at most {a.ndim} slices with step 1, "
                                       f"got {key!r}; reshape to drop axes"))
    key = key + (slice(None),) * (a.ndim - len(key))
    return a.tape.apply(O.slice, a, None, tuple(k.indices(n)[:2] for k, n in zip(key, a.shape)))


def mse(y: Operand, t: Operand) -> Var:
    """Mean squared error mean((y − t)²), a composite of registry ops."""
    return mean(square(sub(y, t)))


def softmax_cross_entropy(logits: Operand, targets: Union[Operand, ArrayLike], axis: int = -1) -> Var:
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
# (functions and Var methods of this family go here)


# ── convolution and pooling (ops_conv) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)


# ── linear algebra (ops_linalg) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)
