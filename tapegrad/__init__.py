"""tapegrad: a define-by-run reverse-mode autodiff tape over NumPy, with captured replays.

``from tapegrad import *`` brings everything public except ``abs``, ``max``, ``min`` and ``sum``, which
would shadow Python's builtins: call them as ``tg.sum(x)`` or ``x.sum()``.

Examples:
    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape()
    >>> x = tape.param(np.array([3.0]))
    >>> tape.backward((x * x).sum()); tape.grad(x)
    True
    array([6.])
"""
from ._version import __version__ as __version__

from . import emit, ops
from .capture import Program, capture
from .checkpoint import load, save
from .errors import (ArgumentError, BuildError, CheckpointError, ConfigError, DomainError, DTypeError,
                     ForeignVarError, LazyValueError, NonFiniteError, ShapeError, TapeError, VerificationError)
from .functional import (add, bmm, broadcast_to, concat, div, exp, log, log_softmax, matmul, maximum, mean, mse,
                         mul, neg, power, relu, reshape, sigmoid, softmax, softmax_cross_entropy, sqrt, square,
                         stop_gradient, sub, tanh, transpose)
from .functional import finite_or_zero
from . import numpy_dispatch  # noqa: F401,E402  (NumPy's functions on Vars: it fills tape.NUMPY)
# special functions
from .functional import (asinh, atan2, cos, digamma, erf, erfc, expm1, lgamma, log1p, log_sigmoid, sin, softplus,
                         tan)
# scans and reductions
from .functional import cummax, cumprod, cumsum, logsumexp, prod, sort, std, var
# selection and indexing
from .functional import (dynamic_slice, dynamic_update_slice, flip, index_add, index_set, split, stack,
                         take, take_along_axis, where)
# float masks and gradient routing
from .functional import equal, greater, greater_equal, less, less_equal, not_equal, with_grad
# convolution and pooling
from .functional import avg_pool, conv, max_pool, sum_pool
# linear algebra
from .functional import cholesky, logdet, slogdet, solve, triangular_solve
# builtins' names: public as tg.sum, left out of __all__ so that `import *` keeps Python's (the `as` form
# marks them re-exported for type checkers)
from .functional import abs as abs, max as max, min as min, sum as sum
from .gradcheck import gradcheck
from . import environment
from .environment import CCoreWarning, info, interop_check
from .optim import SGD, Adam
from .tape import NonFinite, Tape, Var

__all__ = [
    "Tape", "Var", "NonFinite", "Program", "capture", "load", "save", "SGD", "Adam", "gradcheck",
    "info", "interop_check", "CCoreWarning", "emit", "environment", "ops",
    "ArgumentError", "BuildError", "CheckpointError", "ConfigError", "DomainError", "DTypeError",
    "ForeignVarError", "LazyValueError", "NonFiniteError", "ShapeError", "TapeError", "VerificationError",
    "add", "sub", "mul", "div", "neg", "power", "maximum", "matmul", "bmm", "mse", "softmax_cross_entropy",
    "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "square", "stop_gradient", "finite_or_zero",
    "mean", "softmax", "log_softmax", "transpose", "reshape", "broadcast_to", "concat",
    "asinh", "atan2", "cos", "digamma", "erf", "erfc", "expm1", "lgamma", "log1p", "log_sigmoid", "sin",
    "softplus", "tan",
    "cummax", "cumprod", "cumsum", "logsumexp", "prod", "sort", "std", "var",
    "dynamic_slice", "dynamic_update_slice", "flip", "index_add", "index_set", "split", "stack", "take",
    "take_along_axis", "where",
    "equal", "greater", "greater_equal", "less", "less_equal", "not_equal", "with_grad",
    "avg_pool", "conv", "max_pool", "sum_pool",
    "cholesky", "logdet", "slogdet", "solve", "triangular_solve",
]

environment.warn_if_no_c_core()   # once per process: the tape runs slower without its C core
