"""The ops as functions and as Var methods/operators; scalars and arrays are lifted onto the tape."""
import builtins
import math
import numbers

import numpy as np

from . import ops as O
from .ops import Bad, check_axes
from .tape import Var
from .errors import ArgumentError, DTypeError, ShapeError, TapeError, at


def _tape(*xs):
    for x in xs:
        if isinstance(x, Var):
            return x.tape
    raise TypeError(f"expected at least one Var among {[type(x).__name__ for x in xs]}")


def _var(x, tape, opname="const", arg="b"):
    """A Var for ``x``: Vars pass through, real arrays and numbers become constants on ``tape``."""
    if isinstance(x, Var):
        return x
    return tape.const(_real(x, tape, opname, arg))


def _real(x, tape, opname, arg):
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise DTypeError(f"{at(opname, len(tape))}: argument {arg} must be a Var or real numbers, got "
                         f"{type(x).__name__} of dtype {a.dtype}")
    return a if isinstance(x, np.ndarray) else a.astype(tape.dtype)


def _lift(op, tape, a, b, s=None):
    """``(a, b)`` as Vars for ``op``; arrays become constants only once the Vars are valid and the op's
    shape rule accepts the shapes, so a failing call leaves no constant behind. A poisoned Var or the
    error (raised, or poisoning the tape) comes back as ``(v, None)``."""
    try:
        xs = []
        for x, arg in ((a, "a"), (b, "b")):
            if isinstance(x, Var):
                tape._index(x, op.name, arg)
                xs.append((x, x.shape))
            else:
                arr = _real(x, tape, op.name, arg)
                xs.append((arr, arr.shape))
        try:
            op.shape(xs[0][1], xs[1][1], s)
        except Bad as e:
            raise ShapeError(f"{at(op.name, len(tape))}: {e}") from None
    except TapeError as e:
        return tape._fail(e), None
    return tuple(x if isinstance(x, Var) else tape.const(x) for x, _ in xs)


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
    a, b = _lift(op, tape, a, b)
    return a if b is None else tape.apply(op, a, b)


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
    ok = axis is None or isinstance(axis, (int, np.integer)) or (
        isinstance(axis, (tuple, list)) and builtins.all(isinstance(k, (int, np.integer)) for k in axis))
    if not ok or isinstance(axis, bool):
        raise ShapeError(f"{at(opname, len(a.tape))}: axis must be an int, a tuple of ints or None, got "
                         f"{type(axis).__name__} {axis!r}")
    try:
        return (check_axes(a.shape, axis), bool(keepdims))
    except Bad as e:
        raise ShapeError(f"{at(opname, len(a.tape))}: {e}") from None


def _reduce(op):
    def f(a, axis=None, keepdims=False, dtype=None, out=None):
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
    if axes is not None:
        try:
            axes = tuple(axes)
        except TypeError:
            axes = (axes,)
        if not builtins.all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and -a.ndim <= k < a.ndim
                            for k in axes):
            return a.tape._fail(ShapeError(f"{at('transpose', len(a.tape))}: axes must be ints in [-{a.ndim}, "
                                           f"{a.ndim}) for an input of shape {a.shape}, got {axes!r}"))
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(int(k) % builtins.max(a.ndim, 1) for k in axes)
    return a.tape.apply(O.transpose, a, None, axes)


def reshape(a, *shape):
    """A copy with a new shape (one -1 is inferred, as in NumPy)."""
    if a.id < 0:
        return a
    shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
    if not builtins.all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape):
        return a.tape._fail(ShapeError(f"{at('reshape', len(a.tape))}: the new shape must be ints, got {shape!r} "
                                       f"(non-integers such as 2.9 are never truncated)"))
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
    if not xs or not builtins.any(isinstance(x, Var) for x in xs):
        raise ArgumentError(f"concat: expected a non-empty sequence with at least one Var, got "
                            f"{[type(x).__name__ for x in xs]}")
    tape = _tape(*xs)
    try:   # every operand and every join checked before the first node is appended
        shapes = []
        for k, x in enumerate(xs):
            if isinstance(x, Var):
                tape._index(x, "concat", f"xs[{k}]")
                shapes.append(x.shape)
            else:
                xs[k] = _real(x, tape, "concat", f"xs[{k}]")
                shapes.append(xs[k].shape)
        sh = shapes[0]
        for n, x in enumerate(shapes[1:]):
            nd = builtins.max(len(sh), 1)
            try:
                sh = O.concat.shape(sh, x, int(axis) % nd if -nd <= axis < nd else axis)
            except Bad as e:
                raise ShapeError(f"{at('concat', len(tape) + n)}: {e}") from None
    except TapeError as e:
        return tape._fail(e)
    xs = [x if isinstance(x, Var) else tape.const(x) for x in xs]
    out = xs[0]
    for x in xs[1:]:
        nd = builtins.max(out.ndim, 1)
        out = out.tape.apply(O.concat, out, x, int(axis) % nd if -nd <= axis < nd else axis)
    return out


def getitem(a, key):
    """Basic slicing with step 1 (``v[1:3, :2]``); the result keeps every axis."""
    if a.id < 0:
        return a
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > a.ndim or any(not isinstance(k, slice) or k.step not in (None, 1) for k in key):
        return a.tape._fail(ShapeError(f"{at('slice', len(a.tape))}: expected at most {a.ndim} slices with step 1, "
                                       f"got {key!r}; reshape to drop axes"))
    key = key + (slice(None),) * (a.ndim - len(key))
    return a.tape.apply(O.slice, a, None, tuple(k.indices(n)[:2] for k, n in zip(key, a.shape)))


def mse(y, t):
    """Mean squared error mean((y − t)²), a composite of registry ops."""
    return mean(square(sub(y, t)))


def softmax_cross_entropy(logits, targets, axis=-1):
    """Mean over rows of −Σ targets · log_softmax(logits) along ``axis`` (one fused node).

    ``targets`` (one-hot or any distribution per row) may be a Var or an array.
    """
    tape = _tape(logits, targets)
    if isinstance(logits, Var):
        if logits.id < 0:
            return logits
        try:
            tape._index(logits, "softmax_xent", "a")
        except TapeError as e:
            return tape._fail(e)
    nd = builtins.max(logits.ndim if isinstance(logits, Var) else np.ndim(logits), 1)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -nd <= axis < nd:
        return tape._fail(ShapeError(f"{at('softmax_xent', len(tape))}: axis {axis!r} is out of range for "
                                     f"logits of rank {nd}"))
    logits, targets = _lift(O.softmax_xent, tape, logits, targets, int(axis) % nd)
    return logits if targets is None else tape.apply(O.softmax_xent, logits, targets, int(axis) % nd)


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
