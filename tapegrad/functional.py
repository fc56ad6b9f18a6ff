"""The ops as functions and as Var methods/operators; scalars and arrays are lifted onto the tape."""
from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Iterable, Sequence
from types import EllipsisType
from typing import Any, Callable, Optional, Protocol, TypeGuard, Union, cast

import numpy as np
from numpy.typing import ArrayLike

from . import ops as O
from .ops import index as OX
from .ops import route as OR
from .ops import Bad, check_axes
from .tape import Operand, Tape, Var
from .errors import ArgumentError, DTypeError, ShapeError, TapeError, at

Axis = Union[None, int, Sequence[int]]           # one axis, several, or None for all
Ints = Union[int, Sequence[int]]                  # one int for every dimension, or one per dimension
Padding = Union[str, Sequence[tuple[int, int]]]   # "VALID", "SAME", "SAME_LOWER" or (lo, hi) pairs
Data = Union[Var, ArrayLike]                      # integer indices or a bool mask: a data Var or an array
_Key = Union[int, np.integer, slice, None, EllipsisType, Sequence[int], np.ndarray, Var]
Index = Union[_Key, tuple[_Key, ...]]             # what ``x[key]`` takes (see ``getitem``)


class Reduction(Protocol):
    """``sum``, ``mean``, ``max``, ``min``, ``prod``, ``logsumexp``: over ``axis`` (None: all)."""
    __name__: str

    def __call__(self, a: Var, axis: Axis = None, keepdims: bool = False) -> Var: ...


class AxisOp(Protocol):
    """``softmax``, ``log_softmax``: along one axis."""
    __name__: str

    def __call__(self, a: Var, axis: int = -1) -> Var: ...


class Scan(Protocol):
    """``cumsum``, ``cumprod``, ``cummax``: running along ``axis``, from the end with ``reverse``."""
    __name__: str

    def __call__(self, a: Var, axis: int, reverse: bool = False) -> Var: ...


class Pool(Protocol):
    """``max_pool``, ``sum_pool``: windows over ``x`` (see ``max_pool``)."""
    __name__: str

    def __call__(self, x: Var, window: Ints, strides: Optional[Ints] = None, padding: Padding = "VALID",
                 layout: Optional[str] = None) -> Var: ...


def _tape(*xs):
    for x in xs:
        if isinstance(x, Var):
            return x.tape
    raise TypeError(f"expected at least one Var among {[type(x).__name__ for x in xs]}")


def _var(x: Any, tape: Tape, opname: str = "const", arg: str = "b") -> Var:
    """A Var for a float operand ``x``: Vars pass through, arrays become constants on ``tape`` (integer
    and bool arrays are converted to the tape's dtype here, as NumPy promotes them in arithmetic)."""
    if isinstance(x, Var):
        return x
    return tape.const(_real(x, tape, opname, arg))


def _real(x, tape, opname, arg):
    """``x`` as a float array for a float operand; DTypeError naming the op and argument otherwise."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype.kind not in "fbiu":
        raise DTypeError(f"{at(opname, len(tape))}: argument {arg} must be a Var or real numbers, got "
                         f"{type(x).__name__} of dtype {a.dtype}")
    return a.astype(tape.dtype) if not isinstance(x, np.ndarray) or a.dtype.kind in "biu" else a


def _data(x, tape, kind="i", opname="", arg=""):
    """A Var for a data operand (``kind`` "i" indices, "b" a mask): Vars pass through (the op checks
    their kind), arrays become data constants once they are of the right kind."""
    if isinstance(x, Var):
        return x
    x = np.asarray(x)
    if x.dtype.kind not in ("b" if kind == "b" else "iu") and not (kind == "i" and x.size == 0):
        want = "a bool mask" if kind == "b" else "integer indices"
        raise ArgumentError(f"{at(opname, len(tape))}: argument {arg} must be {want} (an array or a data Var), got "
                            f"a {x.dtype} array; convert with np.asarray(x, {'bool' if kind == 'b' else 'int'})")
    return tape.const(x)


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
    with tape._lifted():
        return tape.apply(op, _var(a, tape, op.name, "a"), _var(b, tape, op.name, "b"))


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
    """a + b, broadcasting (``x + y``); a Python scalar on either side becomes one ``adds`` node.

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        DTypeError: If an array operand holds no real numbers.
        TypeError: If neither operand is a Var.
    """
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.add, a, b)
    return _binary(O.add, _adds, a, b)


def sub(a: Operand, b: Operand) -> Var:
    """a − b, broadcasting (``x - y``).

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        DTypeError: If an array operand holds no real numbers.
        TypeError: If neither operand is a Var.
    """
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.sub, a, b)
    return _binary(O.sub, _subs, a, b)


def mul(a: Operand, b: Operand) -> Var:
    """a · b, broadcasting (``x * y``); a Python scalar on either side becomes one ``muls`` node.

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        DTypeError: If an array operand holds no real numbers.
        TypeError: If neither operand is a Var.
    """
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.mul, a, b)
    return _binary(O.mul, _muls, a, b)


def div(a: Operand, b: Operand) -> Var:
    """a / b, broadcasting (``x / y``); a scalar divisor becomes ``divs``, a scalar dividend ``rdivs``.

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        DTypeError: If an array operand holds no real numbers.
        TypeError: If neither operand is a Var.
    """
    return _binary(O.div, _divs, a, b)


def maximum(a: Operand, b: Operand) -> Var:
    """Elementwise max, broadcasting; where a == b the two share the gradient equally.

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        DTypeError: If an array operand holds no real numbers.
        TypeError: If neither operand is a Var.
    """
    return _binary(O.maximum, None, a, b)


_UNARY_SECTIONS = """

    Args:
        a: The input.

    Returns:
        A Var of ``a``'s shape.
    """


def _unary(op) -> Callable[[Var], Var]:
    def f(a: Var) -> Var:
        return a.tape.apply(op, a)
    f.__name__ = op.name
    f.__doc__ = f"Elementwise: {op.doc or op.name}." + _UNARY_SECTIONS
    return f


neg, relu, sigmoid, tanh, exp, log, sqrt, abs, square, stop_gradient, finite_or_zero = (
    _unary(getattr(O, n)) for n in ("neg", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "abs", "square",
                                    "stop_gradient", "finite_or_zero"))

stop_gradient.__doc__ = """``a`` itself, as a constant of the loss: no gradient flows back through it.

    As ``jax.lax.stop_gradient``.

    Args:
        a: The input.

    Returns:
        A Var of ``a``'s value through which no gradient flows.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape(); w = tape.param(np.array([3.0]))
        >>> loss = (w * tg.stop_gradient(w)).sum()
        >>> _ = tape.backward(loss); tape.grad(w).tolist()
        [3.0]
    """


def power(a: Var, p: float) -> Var:
    """a ** p for a constant exponent (``x ** p``); p == 2 records ``square``.

    Args:
        a: The base.
        p: The exponent, a number.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        TypeError: If ``p`` is not a constant number (a Var, an array).
    """
    if not _scalar(p):
        raise TypeError(f"{at('pow', len(a.tape))}: the exponent must be a constant number, got {type(p).__name__}")
    return a.tape.apply(O.square if p == 2 else O.pow, a, None, None if p == 2 else float(p))


def _axes(opname, a, axis, keepdims):
    ok = axis is None or isinstance(axis, (int, np.integer)) or (
        isinstance(axis, (tuple, list)) and builtins.all(isinstance(k, (int, np.integer)) for k in axis))
    if not ok or isinstance(axis, bool):
        raise ShapeError(f"{at(opname, len(a.tape))}: axis must be an int, a tuple of ints or None, got "
                         f"{type(axis).__name__} {axis!r}")
    try:
        return (check_axes(a.shape, axis), bool(keepdims))
    except Bad as e:
        raise ShapeError(f"{at(opname, len(a.tape))}: {e}") from None


_REDUCE_DOCS = {
    "sum": "Sum over ``axis``.",
    "mean": "Mean over ``axis``; the gradient is exactly g/n.",
    "max": "Maximum over ``axis``; tied maxima share the gradient equally.",
    "min": "Minimum over ``axis``; tied minima share the gradient equally.",
    "prod": "Product over ``axis`` in NumPy's sequential order; the gradient, from prefix and suffix products, is "
            "exact with zeros.",
    "logsumexp": "log Σ exp over ``axis``, shifted by the max (no overflow); gradient g·exp(a − out).",
}
_REDUCE_SECTIONS = """

    Args:
        a: The input.
        axis: An axis, a tuple of axes, or None for all.
        keepdims: Keep each reduced axis with length 1, as NumPy.
        dtype: Not supported on a Var (``np.sum(var)`` passes None); anything else raises.
        out: Not supported on a Var (``np.sum(var)`` passes None); anything else raises.

    Returns:
        A Var of ``a``'s shape without the reduced axes (with ``keepdims``: of length 1).

    Raises:
        ShapeError: If an axis is out of range or repeated, or (``max``) an axis to reduce is empty.
        ArgumentError: If ``dtype`` or ``out`` is given.
    """


def _reduce(op) -> Reduction:
    def f(a: Var, axis: Axis = None, keepdims: bool = False, dtype: Any = None, out: Any = None) -> Var:
        if a.id < 0:
            return a
        try:
            if dtype is not None or out is not None:  # np.sum(var) passes both (as None)
                raise ArgumentError(f"{at(op.name, len(a.tape))}: dtype= and out= are not supported on a Var, "
                                    f"got dtype={dtype!r}, out={type(out).__name__}")
            s = _axes(op.name, a, axis, keepdims)
            axes = range(a.ndim) if s[0] is None else s[0]
            if op.name == "max" and builtins.any(a.shape[k] == 0 for k in axes):
                raise ShapeError(f"{at(op.name, len(a.tape))}: max over an empty axis of shape {a.shape} has no "
                                 f"value (no identity); reduce over non-empty axes")
        except (ShapeError, ArgumentError) as e:
            return a.tape._fail(e)
        return a.tape.apply(op, a, None, s)
    f.__name__ = op.name
    f.__doc__ = _REDUCE_DOCS[op.name] + _REDUCE_SECTIONS
    return f


sum, mean, max = (_reduce(getattr(O, n)) for n in ("sum", "mean", "max"))


def matmul(a: Operand, b: Operand) -> Var:
    """The matrix product (m, k) @ (k, n) through BLAS (``x @ w``).

    Args:
        a: An (m, k) Var or array.
        b: A (k, n) Var or array.

    Returns:
        An (m, n) Var.

    Raises:
        ShapeError: If an operand is not 2-D or the inner dimensions differ.
        TypeError: If neither operand is a Var.
    """
    if type(a) is Var and type(b) is Var:
        return a.tape.apply(O.matmul, a, b)
    return _binary(O.matmul, None, a, b)


def bmm(a: Operand, b: Operand) -> Var:
    """The batched matrix product (B, m, k) @ (B, k, n).

    Args:
        a: A (B, m, k) Var or array.
        b: A (B, k, n) Var or array.

    Returns:
        A (B, m, n) Var.

    Raises:
        ShapeError: If an operand is not 3-D, or the batch or inner dimensions differ.
        TypeError: If neither operand is a Var.
    """
    return _binary(O.bmm, None, a, b)


def transpose(a: Var, axes: Axis = None) -> Var:
    """``a`` with its axes permuted, as ``numpy.transpose`` (``x.T`` reverses them).

    Args:
        a: The input.
        axes: A permutation of ``range(a.ndim)`` (negative axes count from the end); None reverses
            the axes.

    Returns:
        A Var of the permuted shape.

    Raises:
        ShapeError: If ``axes`` is not a permutation of the input's axes.
    """
    if a.id < 0:
        return a
    if axes is not None:
        given: tuple = tuple(axes) if isinstance(axes, (tuple, list, range, np.ndarray)) else (axes,)
        if not builtins.all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and -a.ndim <= k < a.ndim
                            for k in given):
            return a.tape._fail(ShapeError(f"{at('transpose', len(a.tape))}: axes must be ints in [-{a.ndim}, "
                                           f"{a.ndim}) for an input of shape {a.shape}, got {axes!r}"))
    perm = tuple(reversed(range(a.ndim))) if axes is None else tuple(int(k) % builtins.max(a.ndim, 1) for k in given)
    return a.tape.apply(O.transpose, a, None, perm)


def reshape(a: Var, *shape: Ints) -> Var:
    """A copy of ``a`` with a new shape, as ``numpy.reshape``.

    Args:
        a: The input.
        *shape: The new shape, as ints (``reshape(x, 2, 3)``) or one sequence
            (``reshape(x, (2, 3))``); one -1 is inferred.

    Returns:
        A Var of the new shape, the elements in row-major order.

    Raises:
        ShapeError: If the sizes differ or a dimension is not an int.
    """
    if a.id < 0:
        return a
    given: tuple[Any, ...] = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) \
        else shape
    if not builtins.all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in given):
        return a.tape._fail(ShapeError(f"{at('reshape', len(a.tape))}: the new shape must be ints, got {given!r} "
                                       f"(non-integers such as 2.9 are never truncated)"))
    dims = tuple(int(n) for n in given)
    if dims.count(-1) == 1:
        rest = math.prod([n for n in dims if n != -1])
        if rest and a.size % rest == 0:
            dims = tuple(a.size // rest if n == -1 else n for n in dims)
    return a.tape.apply(O.reshape, a, None, dims)


def broadcast_to(a: Var, shape: Sequence[int]) -> Var:
    """``a`` broadcast to ``shape``; the gradient sums back over the stretched axes.

    Args:
        a: The input.
        shape: The target shape (NumPy's rules: trailing dims equal or 1).

    Returns:
        A Var of ``shape``.

    Raises:
        ShapeError: If ``a`` does not broadcast to ``shape``.
    """
    return a.tape.apply(O.broadcast_to, a, None, tuple(int(n) for n in shape))


def _axis_op(op) -> AxisOp:
    def f(a: Var, axis: int = -1) -> Var:
        if a.id < 0:
            return a
        if not isinstance(axis, (int, np.integer)) or not -a.ndim <= axis < a.ndim:
            return a.tape._fail(ShapeError(f"{at(op.name, len(a.tape))}: axis {axis!r} is out of range for an "
                                           f"input of shape {a.shape}"))
        return a.tape.apply(op, a, None, int(axis) % a.ndim)
    f.__name__ = op.name
    f.__doc__ = _AXIS_DOCS[op.name] + """

    Args:
        a: The input.
        axis: The axis to normalise along.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If ``axis`` is out of range.
    """
    return f


_AXIS_DOCS = {"softmax": "exp(a − max) / Σ exp(a − max) along ``axis``.",
              "logsoftmax": "a − max − log Σ exp(a − max) along ``axis`` (for cross-entropy)."}


softmax, log_softmax = _axis_op(O.softmax), _axis_op(O.logsoftmax)


def concat(xs: Iterable[Operand], axis: int = 0) -> Var:
    """Join Vars (and arrays) along an existing ``axis``, as ``numpy.concatenate``.

    Recorded as a chain of binary ``concat`` nodes.

    Args:
        xs: Vars and arrays, at least one of them a Var; every dimension but ``axis`` equal.
        axis: The axis to join along.

    Returns:
        A Var whose ``axis`` is the sum of the inputs' lengths along it.

    Raises:
        ArgumentError: If ``xs`` is empty or holds no Var.
        ShapeError: If the other dimensions differ or ``axis`` is out of range.
    """
    xs = list(xs)
    if not xs or not builtins.any(isinstance(x, Var) for x in xs):
        raise ArgumentError(f"concat: expected a non-empty sequence with at least one Var, got "
                            f"{[type(x).__name__ for x in xs]}")
    tape = _tape(*xs)
    with tape._lifted():   # a failing join takes the constants and joins before it along
        vs = [_var(x, tape, "concat", f"xs[{k}]") for k, x in enumerate(xs)]
        out = vs[0]
        for x in vs[1:]:
            if out.id < 0:
                return out
            nd = builtins.max(out.ndim, 1)
            out = tape.apply(O.concat, out, x, int(axis) % nd if -nd <= axis < nd else axis)
        return out


def getitem(a: Var, key: Index) -> Var:
    """``x[key]``: NumPy basic indexing plus one integer array index.

    Basic indexing takes ints, slices with any step, ``None`` and ``...``; one integer array (or
    integer data Var) index is a ``take`` along its axis, as ``x[ids]`` for an embedding lookup.

    Args:
        a: The input.
        key: The index, as NumPy takes it.

    Returns:
        A Var of the indexed shape.

    Raises:
        ShapeError: If an index is out of range, there are too many, or the key holds a bool mask
            (use ``where``), a second array, or integers on both sides of an array index.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> x = tg.Tape().param(np.arange(12.0).reshape(4, 3))
        >>> x[::-2, 1].value.tolist(), x[np.array([2, 0]), 1:].value.tolist()
        ([10.0, 4.0], [[7.0, 8.0], [1.0, 2.0]])
    """
    if a.id < 0:
        return a
    with a.tape._lifted():
        return _getitem(a, key)


def _getitem(a, key):
    key = key if isinstance(key, tuple) else (key,)
    here = at("getitem", len(a.tape))
    dots = [i for i, k in enumerate(key) if k is Ellipsis]
    if len(dots) > 1:
        return a.tape._fail(ShapeError(f"{here}: at most one ... in an index, got {key!r}"))
    used = builtins.sum(k is not None and k is not Ellipsis for k in key)
    if used > a.ndim:
        return a.tape._fail(ShapeError(f"{here}: too many indices for shape {a.shape}: {key!r}"))
    if dots:
        i = dots[0]
        key = key[:i] + (slice(None),) * (a.ndim - used) + key[i + 1:]
        used = a.ndim
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
        idx = _data(idx, a.tape, "i", "getitem", "index")
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


def _scalar_index(k: object) -> TypeGuard[Union[int, np.integer]]:
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def mse(y: Operand, t: Operand) -> Var:
    """Mean squared error mean((y − t)²), over every element (a composite of registry ops).

    Args:
        y: The predictions.
        t: The targets, broadcasting against ``y``.

    Returns:
        A 0-d Var.

    Raises:
        ShapeError: If the shapes do not broadcast.
    """
    return mean(square(sub(y, t)))


def softmax_cross_entropy(logits: Operand, targets: Union[Operand, ArrayLike], axis: int = -1) -> Var:
    """Mean over rows of −Σ targets · log_softmax(logits) along ``axis``, as one fused node.

    Args:
        logits: The unnormalised log-probabilities.
        targets: One-hot rows or any distribution per row, of the logits' shape: a Var or an array.
        axis: The class axis.

    Returns:
        A 0-d Var.

    Raises:
        ShapeError: If ``targets`` has another shape than ``logits`` or ``axis`` is out of range.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> logits = tape.param(np.zeros((2, 4)))
        >>> loss = tg.softmax_cross_entropy(logits, np.eye(4)[[0, 3]])
        >>> bool(np.isclose(loss.value, np.log(4)))
        True
    """
    tape = _tape(logits, targets)
    if isinstance(logits, Var):
        if logits.id < 0:
            return logits
        try:
            nd = len(tape._nodes[tape._index(logits, "softmax_xent", "a")].shape)
        except TapeError as e:
            return tape._fail(e)
    else:
        nd = np.ndim(logits)
    nd = builtins.max(nd, 1)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -nd <= axis < nd:
        return tape._fail(ShapeError(f"{at('softmax_xent', len(tape))}: axis {axis!r} is out of range for "
                                     f"logits of rank {nd}"))
    if type(logits) is Var and type(targets) is Var:   # nothing to lift
        return tape.apply(O.softmax_xent, logits, targets, int(axis) % nd)
    with tape._lifted():
        logits, targets = _var(logits, tape, "softmax_xent", "a"), _var(targets, tape, "softmax_xent", "b")
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
    fast = Tape._fast   # the tape's C core (tapegrad/_ctape.c), where it is built
    if fast is not None:   # operators and methods on Vars of one tape enter its apply directly
        for name, f in (("__add__", add), ("__sub__", sub), ("__mul__", mul), ("__truediv__", div),
                        ("__matmul__", matmul), ("__neg__", neg), ("__abs__", abs),
                        *((f.__name__, f) for f in (relu, sigmoid, tanh, exp, log, sqrt, abs, square))):
            op = O.OPS[f.__name__]
            setattr(V, name, fast.method(op, op.arity, f))


_install()


# ── special functions (ops.special) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)

log1p, expm1, erf, erfc, lgamma, digamma, sin, cos, tan, asinh, softplus, log_sigmoid = (
    _unary(O.OPS[n]) for n in ("log1p", "expm1", "erf", "erfc", "lgamma", "digamma", "sin", "cos", "tan", "asinh",
                               "softplus", "log_sigmoid"))


softplus.__doc__ = """Elementwise: log(1 + eᵃ), computed as max(a, 0) + log1p(e^−|a|).

    Finite for every finite a, with gradient sigmoid(a). ``log_sigmoid(a)`` is −softplus(−a), stable
    the same way.

    Args:
        a: The input.

    Returns:
        A Var of ``a``'s shape.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([-1000.0, 0.0, 1000.0]))
        >>> tape.value(tg.softplus(x)).tolist()
        [0.0, 0.6931471805599453, 1000.0]
        >>> tape.value(tg.log_sigmoid(x)).tolist()
        [-1000.0, -0.6931471805599453, 0.0]
    """
log1p.__doc__ = """Elementwise: log(1 + a), exact for tiny a where log(1 + a) would round to 0.

    ``expm1`` is eᵃ − 1, exact near 0 likewise.

    Args:
        a: The input (a > −1).

    Returns:
        A Var of ``a``'s shape.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> float(tape.value(tg.log1p(tape.param(np.array(1e-20)))))
        1e-20
    """


def atan2(a: Operand, b: Operand) -> Var:
    """The angle of the point (b, a) in (−π, π], elementwise, as ``numpy.arctan2(a, b)``.

    Args:
        a: The y coordinates: a Var, an array or a Python scalar.
        b: The x coordinates, broadcasting against ``a``.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ShapeError: If the shapes do not broadcast.
        TypeError: If neither operand is a Var.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> y = tape.param(np.array([1.0, -1.0]))
        >>> x = tape.param(np.array([0.0, 0.0]))
        >>> tape.value(tg.atan2(y, x)) / np.pi
        array([ 0.5, -0.5])
    """
    return _binary(O.OPS["atan2"], None, a, b)


_f: Callable[..., Var]   # the functions that are also Var methods, installed in the loops below
for _f in (log1p, expm1, erf, erfc, lgamma, digamma, sin, cos, tan, asinh, softplus, log_sigmoid):
    setattr(Var, _f.__name__, _f)


# ── scans and reductions (ops.scan) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)

def _axis(opname, a, axis):
    """One axis made non-negative, or the ShapeError that names it (checked here, not only by the shape
    rule, so that 1.0 or True never reaches the registry as an axis)."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)):
        return ShapeError(f"{at(opname, len(a.tape))}: axis must be an int, got {axis!r}")
    if not -a.ndim <= axis < a.ndim:
        return ShapeError(f"{at(opname, len(a.tape))}: axis {axis} is out of range for an input of shape "
                          f"{a.shape} (ndim {a.ndim})")
    return int(axis) % a.ndim


def _scan(op) -> Scan:
    def f(a: Var, axis: int, reverse: bool = False) -> Var:
        if a.id < 0:
            return a
        k = _axis(op.name, a, axis)
        if isinstance(k, ShapeError):
            return a.tape._fail(k)
        if not isinstance(reverse, (bool, np.bool_)):
            return a.tape._fail(ShapeError(f"{at(op.name, len(a.tape))}: reverse must be True or False, got "
                                           f"{reverse!r}"))
        return a.tape.apply(op, a, None, (k, bool(reverse)))
    f.__name__ = op.name
    return f


cumsum, cumprod, cummax = (_scan(O.OPS[n]) for n in ("cumsum", "cumprod", "cummax"))
cumsum.__doc__ = """Running sum along ``axis``, from the end with ``reverse=True`` (as ``lax.cumsum``).

    Args:
        a: The input.
        axis: The axis to run along.
        reverse: Run from the end of the axis.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If ``axis`` is not an int in range or ``reverse`` not a bool.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([1.0, 2.0, 3.0]))
        >>> tape.value(tg.cumsum(x, 0)), tape.value(tg.cumsum(x, 0, reverse=True))
        (array([1., 3., 6.]), array([6., 5., 3.]))
    """
cumprod.__doc__ = """Running product along ``axis``; its gradient needs no division, so zeros in ``a`` are fine.

    Args:
        a: The input.
        axis: The axis to run along.
        reverse: Run from the end of the axis.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If ``axis`` is not an int in range or ``reverse`` not a bool.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([2.0, 0.0, 3.0]))
        >>> tape.backward(tg.cumprod(x, 0).sum()); tape.grad(x)
        True
        array([1., 8., 0.])
    """
cummax.__doc__ = """Running maximum along ``axis``; inputs tied with a running max share that output's gradient.

    Args:
        a: The input.
        axis: The axis to run along.
        reverse: Run from the end of the axis.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If ``axis`` is not an int in range or ``reverse`` not a bool.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([1.0, 3.0, 2.0, 3.0]))
        >>> y = tg.cummax(x, 0); tape.value(y)
        array([1., 3., 3., 3.])
        >>> tape.backward(y.sum()); tape.grad(x)
        True
        array([1. , 2.5, 0. , 0.5])
    """


def sort(a: Var, axis: int = -1) -> Var:
    """``a`` sorted ascending along ``axis``: stable, NaN last, as ``numpy.sort``.

    The gradient of each output goes back to the input it came from, through the stable argsort: of
    tied inputs, the earlier one receives the earlier output's gradient (as ``jax.grad`` of
    ``jnp.sort``).

    Args:
        a: The input.
        axis: The axis to sort along.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If ``axis`` is not an int in range.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([3.0, 1.0, 2.0]))
        >>> y = tg.sort(x); tape.value(y)
        array([1., 2., 3.])
        >>> tape.backward((y * np.array([1.0, 10.0, 100.0])).sum()); tape.grad(x)
        True
        array([100.,   1.,  10.])
    """
    if a.id < 0:
        return a
    k = _axis("sort", a, axis)
    return a.tape._fail(k) if isinstance(k, ShapeError) else a.tape.apply(O.OPS["sort"], a, None, k)


min, prod, logsumexp = (_reduce(O.OPS[n]) for n in ("min", "prod", "logsumexp"))


def _moment(name, a, axis, ddof, keepdims):
    if a.id < 0:
        return a, None
    try:
        s = _axes(name, a, axis, keepdims)
    except ShapeError as e:
        return a.tape._fail(e), None
    n = O.count(a.shape, s)
    if not isinstance(ddof, numbers.Integral) or isinstance(ddof, bool) or not 0 <= ddof < n:
        return a.tape._fail(ShapeError(f"{at(name, len(a.tape))}: ddof must be an int in [0, {n}) for {n} "
                                       f"reduced elements of shape {a.shape}, got {ddof!r}")), None
    # jnp.var's order: mean (Σ/n, kept dims), centre, square, Σ, divide by n − ddof
    c = square(sub(a, mean(a, axis, keepdims=True)))
    return a.tape.apply(O.divs, sum(c, axis, keepdims), None, float(n - ddof)), True


def var(a: Var, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> Var:
    """Variance over ``axis``, as ``jnp.var``.

    A composite of registry ops computed in ``jnp.var``'s order — mean, centre, square, sum, divide
    by N − ddof — so it rounds as JAX's does wherever their sums add in the same order. ``ddof >= N``
    is an error (JAX returns NaN).

    Args:
        a: The input.
        axis: An axis, a tuple of axes, or None for all.
        ddof: Delta degrees of freedom: the sum of squares is divided by N − ddof.
        keepdims: Keep each reduced axis with length 1, as NumPy.

    Returns:
        A Var of ``a``'s shape without the reduced axes (with ``keepdims``: of length 1).

    Raises:
        ShapeError: If an axis is out of range or repeated, or ``ddof`` is not an int in [0, N).

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([1.0, 2.0, 3.0, 4.0]))
        >>> float(tape.value(tg.var(x))), float(tape.value(tg.var(x, ddof=1)))
        (1.25, 1.6666666666666667)
    """
    return _moment("var", a, axis, ddof, keepdims)[0]


def std(a: Var, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> Var:
    """Standard deviation over ``axis``: ``sqrt(var(a, axis, ddof, keepdims))``, as ``jnp.std``.

    Args:
        a: The input.
        axis: An axis, a tuple of axes, or None for all.
        ddof: Delta degrees of freedom: the sum of squares is divided by N − ddof.
        keepdims: Keep each reduced axis with length 1, as NumPy.

    Returns:
        A Var of ``a``'s shape without the reduced axes (with ``keepdims``: of length 1).

    Raises:
        ShapeError: If an axis is out of range or repeated, or ``ddof`` is not an int in [0, N).

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> float(tape.value(tg.std(tape.param(np.array([1.0, 3.0])))))
        1.0
    """
    v, ok = _moment("std", a, axis, ddof, keepdims)
    return sqrt(v) if ok else v


for _f in (cumsum, cumprod, cummax, sort, min, prod, logsumexp, var, std):
    setattr(Var, _f.__name__, _f)


# ── selection and indexing (ops.index) ─────────────────────────────────────────────

def where(mask: Union[Data, Var], a: Operand, b: Operand) -> Var:
    """``a`` where ``mask`` holds, else ``b``, broadcasting all three (``jnp.where``).

    The branch not taken receives exact zeros in backward, so its values (a ``-inf`` mask fill) never
    leak into the result or the gradient. As in JAX, a branch that is NaN where it is not taken
    still poisons the gradient through its own rule (``0 · ∞``): guard the input too
    (``where(m, sqrt(where(m, x, 1)), 0)``).

    Args:
        mask: A bool array or bool data Var, or a float Var computed on the tape
            (``tg.greater(x, 0)``), whose nonzero elements select ``a``: a captured program then
            computes the mask itself on every call.
        a: The values where the mask holds: a Var, an array or a Python scalar.
        b: The values elsewhere.

    Returns:
        A Var of the broadcast shape.

    Raises:
        ArgumentError: If ``mask`` is an array (or data Var) that is not bool.
        ShapeError: If the three shapes do not broadcast.

    Examples:
        A masked softmax:

        >>> import tapegrad as tg, numpy as np
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([0.0, np.log(3.0), 5.0]))
        >>> p = tg.where(np.array([True, True, False]), x, -np.inf).softmax()
        >>> p.value.tolist()
        [0.25, 0.75, 0.0]
        >>> tape.backward(p[1]), tape.grad(x).tolist()
        (True, [-0.1875, 0.1875, 0.0])
    """
    tape = _tape(a, b, mask)
    with tape._lifted():
        if isinstance(mask, Var) and _float_var(mask):
            return tape.apply(OR.select, _var(a, tape), _var(b, tape), None, mask)
        m = _data(mask, tape, "b", "where", "mask")
        return tape.apply(OX.where, _var(a, tape), _var(b, tape), None, m)


def _float_var(v: Var) -> bool:
    """Whether ``v`` is a float Var of its tape (not a data leaf; a stale Var is left to the op to refuse)."""
    nodes = v.tape._nodes
    return 0 <= v.id < len(nodes) and nodes[v.id][0] is not O.data


# ── routing: float masks and with_grad (ops.route) ───────────────────────────────

def _comparison(op, flip=False) -> Callable[[Operand, Operand], Var]:
    def f(a: Operand, b: Operand) -> Var:
        tape = _tape(a, b)
        with tape._lifted():
            x, y = _var(a, tape, op.name, "a"), _var(b, tape, op.name, "b")
            return tape.apply(op, y, x) if flip else tape.apply(op, x, y)
    return f


greater = _comparison(OR.greater)
greater_equal = _comparison(OR.greater_equal)
less = _comparison(OR.greater, flip=True)
less_equal = _comparison(OR.greater_equal, flip=True)
equal = _comparison(OR.equal)
not_equal = _comparison(OR.not_equal)
for _f, _what in ((greater, "a > b"), (greater_equal, "a ≥ b"), (less, "a < b"), (less_equal, "a ≤ b"),
                  (equal, "a == b"), (not_equal, "a ≠ b")):
    _f.__doc__ = f"""1.0 where {_what}, else 0.0, broadcasting: a float mask on the tape for ``where``.

    No gradient flows through it.

    Args:
        a: A Var, an array or a Python scalar.
        b: A Var, an array or a Python scalar.

    Returns:
        A Var of the broadcast shape holding 0.0 and 1.0.

    Raises:
        ShapeError: If the shapes do not broadcast.
        TypeError: If neither operand is a Var.
    """
for _f, _name in ((greater, "greater"), (greater_equal, "greater_equal"), (less, "less"),
                  (less_equal, "less_equal"), (equal, "equal"), (not_equal, "not_equal")):
    _f.__name__ = _f.__qualname__ = _name


def with_grad(value: Operand, path: Var) -> Var:
    """``value``'s value with ``path``'s gradient.

    The backward passes the incoming gradient to ``path`` unchanged and nothing to ``value``: a
    straight-through estimator, or a custom derivative rule recorded as a value and a linear path.

    Args:
        value: What the forward computes: a Var or an array.
        path: The Var the gradient flows to, of ``value``'s shape.

    Returns:
        A Var of ``value``'s value.

    Raises:
        ShapeError: If ``value`` and ``path`` have different shapes.

    Examples:
        Round forward, identity backward:

        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([0.4, 1.6]))
        >>> y = tg.with_grad(tape.const(np.round(x.value)), x)
        >>> y.value.tolist(), (tape.backward((y * 3.0).sum()), tape.grad(x).tolist())
        ([0.0, 2.0], (True, [3.0, 3.0]))
    """
    tape = _tape(path, value)
    with tape._lifted():
        return tape.apply(OR.with_grad, _var(value, tape, "with_grad", "value"), _var(path, tape, "with_grad", "path"))


def take(a: Var, indices: Data, axis: int = 0) -> Var:
    """``a`` gathered at integer ``indices`` along ``axis``, as ``np.take`` (an embedding lookup).

    The gradient is a scatter-add in increasing index position, the same on every backend.

    Args:
        a: The input.
        indices: An integer array or integer data Var; negative indices count from the end.
        axis: The axis to gather along.

    Returns:
        A Var of shape ``a.shape[:axis] + indices.shape + a.shape[axis + 1:]``.

    Raises:
        ArgumentError: If ``indices`` is not integer data.
        ShapeError: If an index or ``axis`` is out of range (JAX would clamp the index silently).

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> E = tg.Tape().param(np.arange(6.0).reshape(3, 2))
        >>> tg.take(E, np.array([2, 0, 2])).value.tolist()
        [[4.0, 5.0], [0.0, 1.0], [4.0, 5.0]]
    """
    if a.id < 0:
        return a
    with a.tape._lifted():
        return a.tape.apply(OX.take, a, _data(indices, a.tape, "i", "take", "indices"), _norm_axis(axis, a.ndim))


def take_along_axis(a: Var, indices: Data, axis: int) -> Var:
    """``a`` gathered along ``axis`` at ``indices`` shaped like ``a``, as ``np.take_along_axis``.

    Args:
        a: The input.
        indices: An integer array or integer data Var of ``a``'s rank, whose other axes broadcast
            against ``a``'s.
        axis: The axis to gather along.

    Returns:
        A Var of ``a``'s shape with ``axis`` of ``indices``' length.

    Raises:
        ArgumentError: If ``indices`` is not integer data.
        ShapeError: If the shapes do not fit, or an index or ``axis`` is out of range.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> logp = tg.Tape().param(np.log([[0.5, 0.5], [0.25, 0.75]]))
        >>> labels = np.array([[1], [0]])
        >>> nll = -tg.take_along_axis(logp, labels, axis=1).mean()
        >>> bool(nll.value == -np.log([0.5, 0.25]).mean())
        True
    """
    if a.id < 0:
        return a
    with a.tape._lifted():
        return a.tape.apply(OX.take_along_axis, a, _data(indices, a.tape, "i", "take_along_axis", "indices"),
                            _norm_axis(axis, a.ndim))


def _scatter(op, a, indices, values, axis):
    if a.id < 0:
        return a
    with a.tape._lifted():
        return _scatter_lifted(op, a, indices, values, axis)


def _scatter_lifted(op, a, indices, values, axis):
    tape = a.tape
    idx = _data(indices, tape, "i", op.name, "indices")
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


def index_add(a: Var, indices: Data, values: Operand, axis: int = 0) -> Var:
    """JAX's ``a.at[indices].add(values)`` along ``axis``: repeated indices accumulate, in index order.

    Args:
        a: The input.
        indices: An integer array or integer data Var; negative indices count from the end.
        values: The updates (a Var, an array or a scalar), broadcasting to
            ``a.shape[:axis] + indices.shape + a.shape[axis + 1:]``.
        axis: The axis the indices select along.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ArgumentError: If ``indices`` is not integer data.
        ShapeError: If ``values`` does not fit, or an index or ``axis`` is out of range.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> x = tg.Tape().param(np.zeros(3))
        >>> tg.index_add(x, [0, 2, 0], 1.0).value.tolist()
        [2.0, 0.0, 1.0]
    """
    return _scatter(OX.index_add, a, indices, values, axis)


def index_set(a: Var, indices: Data, values: Operand, axis: int = 0) -> Var:
    """JAX's ``a.at[indices].set(values)`` along ``axis``; of repeated indices the last one wins.

    Overwritten elements of ``a`` and the losing updates get no gradient.

    Args:
        a: The input.
        indices: An integer array or integer data Var; negative indices count from the end.
        values: The updates (a Var, an array or a scalar), broadcasting to
            ``a.shape[:axis] + indices.shape + a.shape[axis + 1:]``.
        axis: The axis the indices select along.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ArgumentError: If ``indices`` is not integer data.
        ShapeError: If ``values`` does not fit, or an index or ``axis`` is out of range.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> x = tg.Tape().param(np.zeros(3))
        >>> tg.index_set(x, [0, 2, 0], np.array([1.0, 2.0, 3.0])).value.tolist()
        [3.0, 0.0, 2.0]
    """
    return _scatter(OX.index_set, a, indices, values, axis)


def dynamic_slice(a: Var, starts: Data, sizes: Sequence[int]) -> Var:
    """A window of ``sizes`` at data-dependent ``starts``, as ``lax.dynamic_slice``.

    Negative starts count from the end; then the starts are clamped so the window fits.

    Args:
        a: The input.
        starts: One integer per axis: an integer array or integer data Var (a program's input slot).
        sizes: The window's shape, one size per axis, each at most the axis' length.

    Returns:
        A Var of shape ``sizes``.

    Raises:
        ArgumentError: If ``starts`` is not integer data.
        ShapeError: If ``starts`` or ``sizes`` do not give one entry per axis, or a size is too large.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> x = tg.Tape().param(np.arange(5.0))
        >>> tg.dynamic_slice(x, np.array([4]), (2,)).value.tolist()
        [3.0, 4.0]
    """
    if a.id < 0:
        return a
    with a.tape._lifted():
        return a.tape.apply(OX.dynamic_slice, a, _data(starts, a.tape, "i", "dynamic_slice", "starts"),
                            tuple(int(n) for n in sizes))


def dynamic_update_slice(a: Var, update: Operand, starts: Data) -> Var:
    """``a`` with ``update`` written at data-dependent ``starts``, as ``lax.dynamic_update_slice``.

    The starts are clamped so the update fits, as ``dynamic_slice``'s.

    Args:
        a: The input.
        update: A Var or array of ``a``'s rank that fits inside it.
        starts: One integer per axis: an integer array or integer data Var.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ArgumentError: If ``starts`` is not integer data.
        ShapeError: If ``update`` does not fit inside ``a`` or ``starts`` has the wrong length.
    """
    if a.id < 0:
        return a
    tape = a.tape
    with tape._lifted():
        starts = _data(starts, tape, "i", "dynamic_update_slice", "starts")
        return tape.apply(OX.dynamic_update_slice, a, _var(update, tape), None, starts)


def flip(a: Var, axis: Axis = None) -> Var:
    """``a`` with the order of its elements reversed along ``axis`` (JAX's ``rev``).

    Recorded as a slice with step −1.

    Args:
        a: The input.
        axis: An axis, a tuple of axes, or None for every axis.

    Returns:
        A Var of ``a``'s shape.

    Raises:
        ShapeError: If an axis is out of range.
    """
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


def stack(xs: Iterable[Var], axis: int = 0) -> Var:
    """Join Vars of one shape along a new ``axis``, as ``numpy.stack`` (reshape each, then ``concat``).

    Args:
        xs: Vars of one shape.
        axis: Where the new axis goes in the result.

    Returns:
        A Var with one more axis, of length ``len(xs)``.

    Raises:
        ShapeError: If ``xs`` is empty, the shapes differ, or ``axis`` is out of range.
    """
    xs = list(xs)
    if not xs:
        raise ShapeError("stack: expected at least one Var, got an empty sequence")
    nd = xs[0].ndim + 1
    if not -nd <= axis < nd:
        return xs[0].tape._fail(ShapeError(f"{at('stack', len(xs[0].tape))}: axis {axis} is out of range for "
                                           f"{nd - 1}-D inputs"))
    ax = axis % nd
    return concat([reshape(x, x.shape[:ax] + (1,) + x.shape[ax:]) for x in xs], axis=ax)


def split(a: Var, indices_or_sections: Ints, axis: int = 0) -> list[Var]:
    """Slices of ``a`` along ``axis``, as ``np.split``.

    Args:
        a: The input.
        indices_or_sections: A number of equal sections, or the indices to cut at.
        axis: The axis to split.

    Returns:
        The pieces, a list of Vars.

    Raises:
        ShapeError: If the axis does not split into equal sections or ``axis`` is out of range.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> x = tg.Tape().param(np.arange(5.0))
        >>> [v.value.tolist() for v in tg.split(x, [1, 3])]
        [[0.0], [1.0, 2.0], [3.0, 4.0]]
    """
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
        cuts = [int(c) for c in cast(Sequence[int], indices_or_sections)]
    bounds = list(zip([0] + cuts, cuts + [n]))
    full = [(0, m, 1) for m in a.shape]
    return [a.tape.apply(O.slice, a, None, tuple(full[:ax] + [(lo, hi, 1)] + full[ax + 1:])) for lo, hi in bounds]


def _norm_axis(axis, nd):
    if isinstance(axis, (int, np.integer)) and -nd <= axis < nd:
        return int(axis) % nd
    return axis


for _f in (take, flip):
    setattr(Var, _f.__name__, _f)


# ── convolution and pooling (ops.conv) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)

_CONV_LAYOUTS = {"NCHW": "NCHW", "NHWC": "NHWC", "NCW": "NCHW", "NWC": "NHWC", "NCDHW": "NCHW", "NDHWC": "NHWC"}


def _per_dim(opname, tape, name, v, n, what="spatial dimension"):
    """An int (the same in every dim) or a sequence of n ints, as a tuple."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return (int(v),) * n
    try:
        out = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        raise ShapeError(f"{at(opname, len(tape))}: {name} must be an int or {n} ints, got {v!r}") from None
    if len(out) != n:
        raise ShapeError(f"{at(opname, len(tape))}: {name} must be an int or {n} ints (one per {what}), "
                         f"got {v!r}")
    return out


def _resolve_padding(opname, tape, padding, sizes, window, strides):
    """(lo, hi) pairs; "VALID"/"SAME"/"SAME_LOWER" resolved as ``jax.lax.padtype_to_pads`` does."""
    if isinstance(padding, str):
        kind = padding.upper()
        if kind == "VALID":
            return ((0, 0),) * len(sizes)
        if kind in ("SAME", "SAME_LOWER"):
            pads = []
            for n, k, s in zip(sizes, window, strides):
                total = builtins.max(0, (-(-n // s) - 1) * s + k - n)
                small, big = total // 2, total - total // 2
                pads.append((small, big) if kind == "SAME" else (big, small))
            return tuple(pads)
        raise ShapeError(f"{at(opname, len(tape))}: padding must be 'VALID', 'SAME', 'SAME_LOWER' or (lo, hi) "
                         f"pairs, got {padding!r}")
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ShapeError(f"{at(opname, len(tape))}: padding must be 'VALID', 'SAME', 'SAME_LOWER' or one "
                         f"(lo, hi) pair per dimension, got {padding!r}") from None
    return pads


def conv(x: Operand, w: Operand, stride: Ints = 1, padding: Padding = "VALID", lhs_dilation: Ints = 1,
         rhs_dilation: Ints = 1, groups: int = 1, layout: str = "NCHW") -> Var:
    """N-D convolution (1-D, 2-D, 3-D, ...): ``jax.lax.conv_general_dilated`` on the tape.

    The arguments map one to one onto ``lax.conv_general_dilated(lhs=x, rhs=w,
    window_strides=stride, padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
    dimension_numbers=(layout, "OIHW" or "HWIO", layout), feature_group_count=groups)``; an int
    stands for the same value in every spatial dimension.

    Args:
        x: The input: ``(N, C, *spatial)`` in layout "NCHW", ``(N, *spatial, C)`` in "NHWC".
        w: The kernel: ``(O, C/groups, *k)`` (OIHW) in layout "NCHW", ``(*k, C/groups, O)``
            (HWIO) in "NHWC".
        stride: The window strides.
        padding: "VALID", "SAME", "SAME_LOWER" (resolved to (lo, hi) pairs over the rhs-dilated
            kernel exactly as ``lax.padtype_to_pads`` does; like lax, not with lhs_dilation > 1), or
            one (lo, hi) pair of non-negative ints per spatial dimension.
        lhs_dilation: The input dilation (a transposed convolution's stride).
        rhs_dilation: The kernel dilation (atrous convolution).
        groups: The feature groups (``feature_group_count``); C and O must divide by it.
        layout: "NCHW" or "NHWC"; "NCW"/"NCDHW" and "NWC"/"NDHWC" name the same two layouts in
            1-D and 3-D.

    Returns:
        A Var in the input's layout.

    Raises:
        ShapeError: If the layout, ranks, channels, strides, dilations or padding do not fit.
        TypeError: If neither ``x`` nor ``w`` is a Var.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.const(np.arange(16.0).reshape(1, 1, 4, 4))
        >>> w = tape.param(np.ones((2, 1, 3, 3)))
        >>> y = tg.conv(x, w, padding="SAME")
        >>> y.shape
        (1, 2, 4, 4)
        >>> tape.value(y)[0, 0, 0]
        array([10., 18., 24., 18.])
    """
    tape = _tape(x, w)
    if builtins.any(isinstance(v, Var) and v.id < 0 for v in (x, w)):
        return x if isinstance(x, Var) and x.id < 0 else cast(Var, w)
    xs, ws_ = (v.shape if isinstance(v, Var) else np.shape(v) for v in (x, w))
    try:
        if layout not in _CONV_LAYOUTS or (len(layout) != len(xs) and layout not in ("NCHW", "NHWC")):
            raise ShapeError(f"{at('conv', len(tape))}: layout must be 'NCHW' or 'NHWC' (or 'NCW'/'NWC', "
                             f"'NCDHW'/'NDHWC' matching the input's rank {len(xs)}), got {layout!r}")
        if len(xs) < 3:
            raise ShapeError(f"{at('conv', len(tape))}: expected an input of rank >= 3 (batch, channels, "
                             f"spatial...), got shape {xs}")
        lay, nsp = _CONV_LAYOUTS[layout], len(xs) - 2
        st = _per_dim("conv", tape, "stride", stride, nsp)
        ld = _per_dim("conv", tape, "lhs_dilation", lhs_dilation, nsp)
        rd = _per_dim("conv", tape, "rhs_dilation", rhs_dilation, nsp)
        if isinstance(padding, str) and builtins.any(d != 1 for d in ld):
            raise ShapeError(f"{at('conv', len(tape))}: string padding {padding!r} is not defined with "
                             f"lhs_dilation {ld} (as in lax); give (lo, hi) pairs")
        sizes = xs[1:-1] if lay == "NHWC" else xs[2:]
        k = (ws_[:-2] if lay == "NHWC" else ws_[2:]) if len(ws_) == len(xs) else (1,) * nsp
        pads = _resolve_padding("conv", tape, padding, sizes, [(n - 1) * r + 1 for n, r in zip(k, rd)], st)
        groups = int(groups) if isinstance(groups, (int, np.integer)) else groups
        s = (lay, st, pads, ld, rd, groups)
        O.conv.geometry(tuple(xs), tuple(ws_), s)   # before lifting arrays: a failure leaves the tape as it was
    except Bad as e:
        return tape._fail(ShapeError(f"{at('conv', len(tape))}: {e}"))
    except ShapeError as e:
        return tape._fail(e)
    return tape.apply(O.OPS["conv"], _var(x, tape), _var(w, tape), s)


def _pool_args(opname, x, window, strides, padding, layout):
    """The full-rank (window, strides, padding) of a pooling node."""
    tape = x.tape
    nd = x.ndim
    if layout is not None:
        if layout not in _CONV_LAYOUTS:
            raise ShapeError(f"{at(opname, len(tape))}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if nd < 3:
            raise ShapeError(f"{at(opname, len(tape))}: a layout needs an input of rank >= 3, got shape {x.shape}")
        last = _CONV_LAYOUTS[layout] == "NHWC"

        def full(name, v):
            sp = _per_dim(opname, tape, name, v, nd - 2)
            return (1,) + sp + (1,) if last else (1, 1) + sp
    else:
        def full(name, v):
            return _per_dim(opname, tape, name, v, nd, "axis")
    win = full("window", window)
    st = win if strides is None else full("strides", strides)
    if isinstance(padding, str) or layout is None:
        pads = _resolve_padding(opname, tape, padding, x.shape, win, st)
    else:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
        pads = ((0, 0),) + pads + ((0, 0),) if last else ((0, 0), (0, 0)) + pads
    return win, st, pads


def _pool(op) -> Pool:
    def f(x: Var, window: Ints, strides: Optional[Ints] = None, padding: Padding = "VALID",
          layout: Optional[str] = None) -> Var:
        if x.id < 0:
            return x
        try:
            s = _pool_args(op.name, x, window, strides, padding, layout)
        except ShapeError as e:
            return x.tape._fail(e)
        return x.tape.apply(op, x, None, s)
    f.__name__ = op.name
    return f


max_pool = _pool(O.OPS["max_pool"])
max_pool.__doc__ = """Max pooling: ``jax.lax.reduce_window(x, -inf, lax.max, window, strides, padding)``.

    Padding holds −inf. The gradient of each window goes to its FIRST maximum, scanning the window
    in row-major order (what ``jax.grad`` of ``reduce_window`` max does, through
    ``select_and_scatter_add``); NaN windows send none.

    Args:
        x: The input.
        window: The window: one size per axis of ``x``, as in ``reduce_window``; with ``layout``,
            one per spatial axis (the batch and channel windows are 1). An int stands for all.
        strides: The strides, given as ``window`` is; None: the window (non-overlapping windows).
        padding: "VALID", "SAME", "SAME_LOWER" (resolved as ``lax.padtype_to_pads``) or (lo, hi)
            pairs, given as ``window`` is.
        layout: "NCHW" or "NHWC" (flax's pools are "NHWC"), or None: every axis is pooled as given.

    Returns:
        A Var of the pooled shape.

    Raises:
        ShapeError: If the window, strides, padding or layout do not fit ``x``.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([[[[1.0, 3.0], [3.0, 2.0]]]]))
        >>> y = tg.max_pool(x, 2, layout="NCHW")
        >>> tape.backward(y.sum()); tape.grad(x)[0, 0]
        True
        array([[0., 1.],
               [0., 0.]])
    """

sum_pool = _pool(O.OPS["sum_pool"])
sum_pool.__doc__ = """Sum pooling: ``jax.lax.reduce_window(x, 0, lax.add, window, strides, padding)``.

    Padding holds 0. The window positions are added in row-major order.

    Args:
        x: The input.
        window: The window: one size per axis of ``x``, as in ``reduce_window``; with ``layout``,
            one per spatial axis (the batch and channel windows are 1). An int stands for all.
        strides: The strides, given as ``window`` is; None: the window (non-overlapping windows).
        padding: "VALID", "SAME", "SAME_LOWER" (resolved as ``lax.padtype_to_pads``) or (lo, hi)
            pairs, given as ``window`` is.
        layout: "NCHW" or "NHWC" (flax's pools are "NHWC"), or None: every axis is pooled as given.

    Returns:
        A Var of the pooled shape.

    Raises:
        ShapeError: If the window, strides, padding or layout do not fit ``x``.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.const(np.arange(6.0).reshape(1, 6, 1))
        >>> tape.value(tg.sum_pool(x, 3, layout="NHWC")).ravel()
        array([ 3., 12.])
    """


def avg_pool(x: Var, window: Ints, strides: Optional[Ints] = None, padding: Padding = "VALID",
             layout: Optional[str] = None) -> Var:
    """Average pooling: ``sum_pool`` divided by the window size (a composite of ``sum_pool`` and ``divs``).

    Padding counts as zeros in the average (``count_include_pad=True``, flax's ``avg_pool`` default);
    stax's ``AvgPool`` instead divides by the number of real elements, which differs only where a
    window overlaps the padding.

    Args:
        x: The input.
        window: The window: one size per axis of ``x``, as in ``reduce_window``; with ``layout``,
            one per spatial axis (the batch and channel windows are 1). An int stands for all.
        strides: The strides, given as ``window`` is; None: the window (non-overlapping windows).
        padding: "VALID", "SAME", "SAME_LOWER" (resolved as ``lax.padtype_to_pads``) or (lo, hi)
            pairs, given as ``window`` is.
        layout: "NCHW" or "NHWC" (flax's pools are "NHWC"), or None: every axis is pooled as given.

    Returns:
        A Var of the pooled shape.

    Raises:
        ShapeError: If the window, strides, padding or layout do not fit ``x``.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> x = tape.const(np.arange(6.0).reshape(1, 6, 1))
        >>> tape.value(tg.avg_pool(x, 3, layout="NHWC")).ravel()
        array([1., 4.])
    """
    if x.id < 0:
        return x
    try:
        s = _pool_args("sum_pool", x, window, strides, padding, layout)
    except ShapeError as e:
        return x.tape._fail(e)
    y = x.tape.apply(O.OPS["sum_pool"], x, None, s)
    return y if y.id < 0 else y.tape.apply(O.divs, y, None, float(math.prod(s[0])))


# ── linear algebra (ops.linalg) ─────────────────────────────────────────────

def cholesky(a: Operand) -> Var:
    """The lower Cholesky factor L of a symmetric positive definite matrix: L·Lᵀ = (a + aᵀ)/2.

    The input is symmetrised first, as ``jax.numpy.linalg.cholesky`` does, so the gradient is
    symmetric and matches ``jax.grad``'s. LAPACK ``potrf``.

    Args:
        a: A (…, n, n) Var or array; leading axes are a batch.

    Returns:
        A Var of ``a``'s shape, zero above the diagonal.

    Raises:
        DomainError: If a matrix is not positive definite (the tape is left unchanged).
        ShapeError: If ``a`` is not a non-empty square matrix (or a batch of them).

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> a = tape.param(np.array([[4.0, 2.0], [2.0, 5.0]]))
        >>> tape.value(tg.cholesky(a))
        array([[2., 0.],
               [1., 2.]])
    """
    tape = _tape(a)
    return tape.apply(O.OPS["cholesky"], _var(a, tape))


def triangular_solve(a: Operand, b: Operand, left_side: bool = True, lower: bool = True, transpose_a: bool = False,
                     unit_diagonal: bool = False) -> Var:
    """x with op(a)·x = b (``left_side``) or x·op(a) = b for a triangular ``a``; BLAS ``trsm``.

    The flags are ``jax.lax.linalg.triangular_solve``'s, with the same meaning; the defaults differ
    (here the left-side lower solve, as ``scipy.linalg.solve_triangular(lower=True)``). Only the
    triangle of ``a`` that ``lower`` names is read, and not its diagonal with ``unit_diagonal``; the
    gradient of ``a`` is zero elsewhere. A zero on the diagonal gives inf/NaN, as in BLAS and JAX.

    Args:
        a: A (…, k, k) triangular Var or array.
        b: (…, k, n) on the left side, (…, m, k) on the right, with ``a``'s batch axes.
        left_side: Solve op(a)·x = b; False: x·op(a) = b.
        lower: Read the lower triangle of ``a``; False: the upper one.
        transpose_a: op(a) = aᵀ; False: op(a) = a.
        unit_diagonal: Take the diagonal of ``a`` as ones, without reading it.

    Returns:
        A Var of ``b``'s shape.

    Raises:
        ShapeError: If the shapes do not fit.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> a = tape.param(np.array([[2.0, 0.0], [1.0, 4.0]]))
        >>> tape.value(tg.triangular_solve(a, np.array([[2.0], [9.0]])))
        array([[1.],
               [2.]])
        >>> b = np.array([[4.0, 8.0]])
        >>> tape.value(tg.triangular_solve(a, b, left_side=False))
        array([[1., 2.]])
    """
    tape = _tape(a, b)
    s = (bool(left_side), bool(lower), bool(transpose_a), bool(unit_diagonal))
    return tape.apply(O.OPS["triangular_solve"], _var(a, tape), _var(b, tape), s)


def solve(a: Operand, b: Operand) -> Var:
    """x with a·x = b for a square ``a``: LU with partial pivoting (LAPACK ``gesv``).

    Args:
        a: A (…, n, n) Var or array.
        b: (…, n, k) with ``a``'s batch axes, or a vector (n,) when ``a`` is one matrix (NumPy 2's
            rule).

    Returns:
        A Var of ``b``'s shape.

    Raises:
        DomainError: If ``a`` is exactly singular (the tape is left unchanged).
        ShapeError: If ``a`` is not square or ``b`` does not fit it.

    Examples:
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


def logdet(a: Operand) -> Var:
    """log det of a symmetric positive definite matrix: 2·Σ log diag L with L = cholesky(a).

    The gradient is g·a⁻¹ (LAPACK ``gesv`` on the identity); ``slogdet`` takes general matrices (LU).

    Args:
        a: A (…, n, n) Var or array, read as (a + aᵀ)/2 like ``cholesky``.

    Returns:
        A Var of the batch shape (0-d for one matrix).

    Raises:
        DomainError: If a matrix is not positive definite (the tape is left unchanged).
        ShapeError: If ``a`` is not a non-empty square matrix (or a batch of them).

    Examples:
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


def slogdet(a: Operand) -> tuple[Var, Var]:
    """(sign, log|det a|) of a general square matrix, as ``numpy.linalg.slogdet``.

    Both come from the LU factors (LAPACK ``getrf``): the sign is Π sign(Uᵢᵢ) times −1 per row
    interchange (it has no gradient), the log Σ log|Uᵢᵢ|, whose gradient is g·a⁻ᵀ. An exactly
    singular matrix gives sign 0 and log −inf (and no finite gradient), as NumPy. For a symmetric
    positive definite matrix ``logdet`` (Cholesky, half the work) is the faster way to the same number.

    Args:
        a: A (…, n, n) Var or array.

    Returns:
        Two Vars of the batch shape, ``(sign, logabsdet)``.

    Raises:
        ShapeError: If ``a`` is not a non-empty square matrix (or a batch of them).

    Examples:
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
