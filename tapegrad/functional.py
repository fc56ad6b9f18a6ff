"""The ops as functions and as Var methods/operators; scalars and arrays are lifted onto the tape."""
import builtins
import math
import numbers

import numpy as np

from . import ops as O
from .ops import Bad, check_axes
from .tape import Var
from .errors import ShapeError, at


def _tape(*xs):
    for x in xs:
        if isinstance(x, Var):
            return x.tape
    raise TypeError(f"expected at least one Var among {[type(x).__name__ for x in xs]}")


def _var(x, tape):
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


def conv(x, w, stride=1, padding="VALID", lhs_dilation=1, rhs_dilation=1, groups=1, layout="NCHW"):
    """N-D convolution (1-D, 2-D, 3-D, ...): ``jax.lax.conv_general_dilated`` on the tape.

    Layout "NCHW": ``x`` is (N, C, *spatial) and the kernel ``w`` is (O, C/groups, *k) (OIHW);
    layout "NHWC": ``x`` is (N, *spatial, C) and ``w`` is (*k, C/groups, O) (HWIO). The output has the
    input's layout. ("NCW"/"NCDHW" and "NWC"/"NDHWC" name the same two layouts in 1-D/3-D.)
    The arguments map one to one onto ``lax.conv_general_dilated(lhs=x, rhs=w, window_strides=stride,
    padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
    dimension_numbers=(layout, "OIHW" or "HWIO", layout), feature_group_count=groups)``; an int stands
    for the same value in every spatial dim. ``padding`` is "VALID", "SAME", "SAME_LOWER" (resolved to
    (lo, hi) pairs over the rhs-dilated kernel exactly as ``lax.padtype_to_pads`` does; like lax, not
    with lhs_dilation > 1) or one (lo, hi) pair of non-negative ints per spatial dim.

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
        return x if isinstance(x, Var) and x.id < 0 else w
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
        O.ops_conv.geometry(tuple(xs), tuple(ws_), s)   # before lifting arrays: a failure leaves the tape as it was
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


def _pool(op):
    def f(x, window, strides=None, padding="VALID", layout=None):
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

    ``window`` (and ``strides``, ``padding`` pairs) give one entry per axis of ``x``, as in
    ``reduce_window``; with ``layout`` ("NCHW" or "NHWC") they give one per spatial axis and the batch
    and channel windows are 1 (flax's ``max_pool`` is ``layout="NHWC"``). ``strides`` defaults to the
    window (non-overlapping windows); ``padding`` is "VALID", "SAME", "SAME_LOWER" (resolved as
    ``lax.padtype_to_pads``) or (lo, hi) pairs; padding holds −inf. The gradient of each window goes to
    its FIRST maximum, scanning the window in row-major order (what ``jax.grad`` of ``reduce_window``
    max does, through ``select_and_scatter_add``); NaN windows send none.

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

    Arguments as ``max_pool``; padding holds 0. The window positions are added in row-major order.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> tape.value(tg.sum_pool(tape.const(np.arange(6.0).reshape(1, 6, 1)), 3, layout="NHWC")).ravel()
    array([ 3., 12.])
    """


def avg_pool(x, window, strides=None, padding="VALID", layout=None):
    """Average pooling: ``sum_pool`` divided by the window size (a composite of ``sum_pool`` and ``divs``).

    Padding counts as zeros in the average (``count_include_pad=True``, flax's ``avg_pool`` default);
    stax's ``AvgPool`` instead divides by the number of real elements, which differs only where a
    window overlaps the padding.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> tape.value(tg.avg_pool(tape.const(np.arange(6.0).reshape(1, 6, 1)), 3, layout="NHWC")).ravel()
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


# ── linear algebra (ops_linalg) ─────────────────────────────────────────────
# (functions and Var methods of this family go here)
