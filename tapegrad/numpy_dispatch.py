"""NumPy's functions and ufuncs on Vars (``__array_function__``, ``__array_ufunc__``): tapegrad's op, or a
TypeError naming the function.

Without these, NumPy treats a Var as an opaque scalar object: ``np.dot(x, x)`` returned ``<Var mul>``
(NumPy's scalar rule), ``np.argmax(x)`` 0 and ``np.cumsum(x)`` an object array wrapping the Var. Now a
function tapegrad has an op for records that op (``np.sum(x, axis=0)`` is ``tg.sum(x, axis=0)``), with
NumPy's argument names, defaults and ``axis=None`` flattening; every other function, argument or ufunc
method raises ``ArgumentError`` (a ``TypeError``) naming it and saying what to use instead.

>>> import numpy as np, tapegrad as tg
>>> tape = tg.Tape()
>>> x = tape.param(np.arange(4.0))
>>> float(tape.value(np.dot(x, x))), tape.value(np.cumsum(x))
(14.0, array([0., 1., 3., 6.]))
>>> try:
...     np.argmax(x)
... except tg.ArgumentError as e:
...     print(e)
numpy.argmax: not an op on Vars (got <Var node 0: param (4,)>); compute it on the value,
numpy.argmax(tape.value(v)) (no gradient flows through it), or build it from tapegrad's ops
"""
import inspect

import numpy as np

from . import functional as F
from .errors import ArgumentError, at
from .tape import NUMPY, Var

# Arguments NumPy passes that change nothing for a float Var: accepted with these values only
# (``kind``, ``stable``, ``copy``, ``subok``: any value).
_TRIVIAL = {"out": (None,), "dtype": (None,), "casting": ("same_kind",), "order": ("C", None),
            "mode": ("raise",), "kind": None, "stable": None, "copy": None, "subok": None}


def _flat(x):
    return x.reshape(-1)


def _along(f, default):
    """``f(a, *rest, axis)`` with NumPy's axis default; ``axis=None`` flattens the input first."""
    def g(a, *rest, axis=default):
        return f(_flat(a), *rest, axis=0) if axis is None else f(a, *rest, axis=axis)
    return g


def _listed(f):
    """``f(vars, axis)`` on a sequence of operands, arrays lifted to constants on the first Var's tape; on an
    error the lifted constants go too (the tape is left as it was)."""
    def g(arrays, axis=0):
        xs = list(arrays)
        tape = F._tape(*xs)
        with tape._lifted():
            return f([F._var(x, tape) for x in xs], axis)
    return g


def _matmul(a, b):
    """NumPy's matmul on 1-D and 2-D operands (a vector is a row on the left, a column on the right)."""
    tape = F._tape(a, b)
    sa, sb = np.shape(a), np.shape(b)
    if not (1 <= len(sa) <= 2 and 1 <= len(sb) <= 2):
        raise ArgumentError(f"{at('matmul', len(tape))}: numpy.matmul / numpy.dot on Vars take 1-D and 2-D "
                            f"operands, got shapes {sa} and {sb}; for batches use tapegrad.bmm")
    with tape._lifted():
        a, b = F._var(a, tape, "matmul", "a"), F._var(b, tape, "matmul", "b")
        y = F.matmul(a.reshape(1, -1) if a.ndim == 1 else a, b.reshape(-1, 1) if b.ndim == 1 else b)
        out = sa[:-1] + sb[1:]
        return y if y.shape == out else y.reshape(out)


def _where(condition, x=None, y=None):
    if x is None or y is None:
        raise ArgumentError("numpy.where: only the three-argument form where(condition, x, y) is an op on Vars; "
                            "the one-argument form (indices) has no gradient: use numpy.nonzero(tape.value(v))")
    return F.where(condition, x, y)


def _power(x1, x2):
    if not isinstance(x1, Var):
        raise ArgumentError(f"{at('pow', len(x2.tape))}: numpy.power with a Var exponent is not an op; the "
                            f"exponent must be a constant number (v ** p)")
    return F.power(x1, x2)


def _reduce(f):
    return lambda a, axis=None, keepdims=False, dtype=None, out=None: f(a, axis, keepdims, dtype, out)


def _moment(f):
    return lambda a, axis=None, ddof=0, keepdims=False: f(a, axis, ddof, keepdims)


# NumPy function -> the same computation on Vars, taking NumPy's parameter names as keywords.
FUNCTIONS = {
    np.sum: _reduce(F.sum), np.mean: _reduce(F.mean), np.max: _reduce(F.max), np.amax: _reduce(F.max),
    np.min: _reduce(F.min), np.amin: _reduce(F.min), np.prod: _reduce(F.prod),
    np.std: _moment(F.std), np.var: _moment(F.var),
    np.cumsum: _along(F.cumsum, None), np.cumprod: _along(F.cumprod, None),
    np.sort: _along(F.sort, -1), np.take: lambda a, indices, axis=None: _along(F.take, None)(a, indices, axis=axis),
    np.take_along_axis: lambda arr, indices, axis=-1: _along(F.take_along_axis, -1)(arr, indices, axis=axis),
    np.transpose: lambda a, axes=None: F.transpose(a, axes),
    np.reshape: lambda a, shape=None, newshape=None: F.reshape(a, newshape if shape is None else shape),
    np.ravel: lambda a: _flat(a),
    np.broadcast_to: lambda array, shape: F.broadcast_to(array, shape),
    np.flip: lambda m, axis=None: F.flip(m, axis),
    np.concatenate: _listed(lambda xs, axis: F.concat([_flat(x) for x in xs], 0) if axis is None else F.concat(xs, axis)),
    np.stack: _listed(F.stack),
    np.split: lambda ary, indices_or_sections, axis=0: F.split(ary, indices_or_sections, axis),
    np.where: _where,
    np.dot: _matmul,
    np.shape: lambda a: a.shape, np.ndim: lambda a: a.ndim, np.size: lambda a, axis=None: (
        a.size if axis is None else a.shape[axis]),
}

# NumPy ufunc -> the op (called with the ufunc's inputs; no keyword arguments).
UFUNCS = {
    np.add: F.add, np.subtract: F.sub, np.multiply: F.mul, np.true_divide: F.div, np.maximum: F.maximum,
    np.matmul: _matmul, np.power: _power, np.arctan2: F.atan2,
    np.negative: F.neg, np.absolute: F.abs, np.exp: F.exp, np.log: F.log, np.sqrt: F.sqrt, np.square: F.square,
    np.tanh: F.tanh, np.sin: F.sin, np.cos: F.cos, np.tan: F.tan, np.expm1: F.expm1, np.log1p: F.log1p,
    np.arcsinh: F.asinh,
}

# NumPy names whose tapegrad op is called differently.
_RENAMED = {"concatenate": "concat", "absolute": "abs", "negative": "neg", "true_divide": "div", "subtract": "sub",
            "multiply": "mul", "arctan2": "atan2", "arcsinh": "asinh", "amax": "max", "amin": "min", "dot": "matmul"}

_COMPARISONS = {"equal", "not_equal", "less", "less_equal", "greater", "greater_equal"}
_SIGNATURES = {}


def _name(func):
    return f"{getattr(func, '__module__', None) or 'numpy'}.{func.__name__}"


def _first_var(args):
    """The first Var among ``args`` (nested one level: lists of operands), or None."""
    for a in args:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, Var):
                return x
    return None


def _refuse(func, args, why, hint):
    v = _first_var(args)
    came = f" (got {v!r})" if v is not None else ""
    raise ArgumentError(f"{_name(func)}: {why}{came}; {hint}")


def _hint(func):
    name = func.__name__
    ours = _RENAMED.get(name, name)
    if callable(getattr(F, ours, None)) and not ours.startswith("_") and ours not in ("Tape", "Var"):
        return f"use tapegrad.{ours} (the op, with its own arguments)"
    return (f"compute it on the value, {_name(func)}(tape.value(v)) (no gradient flows through it), or build it "
            f"from tapegrad's ops")


def _shown(value):
    return f"a {value.dtype} array of shape {value.shape}" if isinstance(value, np.ndarray) else repr(value)


def function(func, types, args, kwargs):
    """``Var.__array_function__``: NumPy's function ``func`` applied to operands including a Var."""
    if not all(issubclass(t, (Var, np.ndarray)) for t in types):
        return NotImplemented   # another array library's type: let it answer
    impl = FUNCTIONS.get(func)
    if impl is None:
        _refuse(func, args, "not an op on Vars", _hint(func))
    sigs = _SIGNATURES.get(func)
    if sigs is None:
        sigs = _SIGNATURES[func] = (inspect.signature(func), inspect.signature(impl).parameters)
    try:
        given = sigs[0].bind(*args, **kwargs).arguments
    except TypeError as e:
        _refuse(func, args, f"arguments do not fit numpy's signature {sigs[0]} ({e})", "see numpy's documentation")
    call = {}
    for key, value in given.items():
        trivial = _TRIVIAL.get(key, ())
        if key in sigs[1]:
            call[key] = value
        elif trivial is None or any(value is t or isinstance(value, str) and value == t for t in trivial):
            continue
        else:
            _refuse(func, args, f"argument {key}={_shown(value)} is not supported on Vars", _hint(func))
    return impl(**call)


def ufunc(uf, method, inputs, kwargs):
    """``Var.__array_ufunc__``: NumPy's ufunc ``uf`` (``method``: "__call__", "reduce", …) on a Var."""
    name = uf.__name__
    impl = UFUNCS.get(uf)
    if impl is None:
        boolean = name in _COMPARISONS or name.startswith(("is", "logical_"))
        _refuse(uf, inputs, "not an op on Vars" + (" (its result is boolean: no gradient)" if boolean else ""),
                _hint(uf))
    if method != "__call__":
        _refuse(uf, inputs, f"the ufunc method {name}.{method} is not an op on Vars",
                "use tapegrad's reductions (tapegrad.sum, tapegrad.cumsum, …)")
    out = kwargs.pop("out", None)
    if out is not None and any(o is not None for o in out):
        _refuse(uf, inputs, "out= cannot write a Var's result into an array",
                "assign the result instead (y = x + v); tape.value(y) is its value")
    if kwargs:
        _refuse(uf, inputs, f"arguments {sorted(kwargs)} are not supported on Vars", _hint(uf))
    return impl(*inputs)


NUMPY.update(function=function, ufunc=ufunc)
