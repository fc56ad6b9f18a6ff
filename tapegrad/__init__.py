"""tapegrad: a define-by-run reverse-mode autodiff tape over NumPy, with captured replays.

>>> import numpy as np, tapegrad as tg
>>> tape = tg.Tape()
>>> x = tape.param(np.array([3.0]))
>>> tape.backward((x * x).sum()); tape.grad(x)
True
array([6.])
"""
from . import emit, ops
from .capture import Program, capture
from .checkpoint import load, save
from .errors import (ArgumentError, BuildError, CheckpointError, ConfigError, DomainError, DTypeError,
                     ForeignVarError, LazyValueError, NonFiniteError, ShapeError, TapeError, VerificationError)
from .functional import (abs, add, bmm, broadcast_to, concat, div, exp, log, log_softmax, matmul, max,
                         maximum, mean, mse, mul, neg, power, relu, reshape, sigmoid, softmax,
                         softmax_cross_entropy, sqrt, square, stop_gradient, sub, sum, tanh, transpose)
from .functional import finite_or_zero
# special functions
from .functional import (asinh, atan2, cos, digamma, erf, erfc, expm1, lgamma, log1p, log_sigmoid, sin, softplus,
                         tan)
# scans and reductions
from .functional import cummax, cumprod, cumsum, logsumexp, min, prod, sort, std, var
# selection and indexing
from .functional import (dynamic_slice, dynamic_update_slice, flip, index_add, index_set, split, stack,
                         take, take_along_axis, where)
# convolution and pooling
from .functional import avg_pool, conv, max_pool, sum_pool
# linear algebra
from .functional import cholesky, logdet, slogdet, solve, triangular_solve
from .gradcheck import gradcheck
from .optim import SGD, Adam
from .tape import NonFinite, Tape, Var

__version__ = "0.1.0"
