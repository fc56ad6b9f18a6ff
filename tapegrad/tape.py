"""The tape: a single-owner arena of nodes, values and gradients, and its reverse sweep."""
from __future__ import annotations

import functools
import importlib
import math
import operator
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Optional, Union

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import ops as O
from ._arena import Arena, ParamStore, aligned_copy, aligned_empty, readonly
from .schedule import ADD, ADOPT, COPY, INTO, NEW, SUMMED, Schedule
from .errors import (ArgumentError, ConfigError, DomainError, DTypeError, ForeignVarError, LazyValueError,
                     NonFiniteError, ShapeError, TapeError, at)

if TYPE_CHECKING:   # the argument types of the op methods Var declares below
    from .functional import Axis, Data, Index, Ints

_PKG = os.path.dirname(os.path.abspath(__file__))


class _Memo(dict):
    """A memo table that forgets everything when full: keys may hold scalar operands (a learning-rate
    schedule, a temperature) or shapes that change every step, and must not grow without bound."""
    LIMIT = 4096

    def __setitem__(self, key, value):
        if len(self) >= self.LIMIT:
            self.clear()
        dict.__setitem__(self, key, value)


_UNBROADCAST = _Memo()  # (contribution shape, input shape) -> (axes to sum, reduced shape)
_ONES = _Memo()    # (shape, dtype) -> the backward seed of a scalar loss
_SHAPES = _Memo()  # (op, a_shape, b_shape, s) -> (out shape, size, kept shapes or None): rules run once per call
_DTYPES = (np.dtype(np.float64), np.dtype(np.float32))
_INT = np.dtype(np.int64)   # integer data is held as int64, bool data as bool
_DATA_NAMES = {"b": "bool data", "i": "integer data", "u": "integer data"}


Operand = Union["Var", float, np.ndarray]   # what an op takes: a Var, a Python scalar, an array (a const)


class Node(NamedTuple):
    """One tape entry: the op, input ids (-1 = none), the static operand, and bookkeeping."""
    op: O.Op
    a: int
    b: int
    s: object
    req: bool      # a parameter is upstream: backward must reach it
    epoch: int     # the reset generation that created it (stale Vars are caught with it)
    src: object    # (code, bytecode offset) of the user frame that created it
    lazy: bool     # it depends on a lazy or dropped constant: the tape holds no value
    shape: tuple   # known even when the tape holds no value
    pos: object    # allocator position before its value: value arena (ops), param store (params)
    c: int = -1    # a third input (always data: a mask, indices), -1 = none


_node = functools.partial(tuple.__new__, Node)  # C-speed Node construction on the hot path
_OP = operator.itemgetter(0)   # a node's op, read at C speed over a list of nodes
_DATA = O.data


class NonFinite(NamedTuple):
    """Where a non-finite number first appears (``Tape.first_nonfinite`` returns one).

    Attributes:
        node: The node's id.
        op: The node's op name.
        kind: "value" or "grad".
        input_shapes: The shapes of the node's inputs.
        where: "file.py:line" of the user code that created the node ("?" with ``sources=False``).
        name: The parameter's name (``tape.param(..., name=)``), or None.
    """
    node: int
    op: str
    kind: str           # "value" or "grad"
    input_shapes: tuple
    where: str          # "file.py:line"
    name: Optional[str] = None   # the parameter's name (tape.param(..., name=)), if it has one

    def __str__(self):
        who = self.op if self.name is None else f"{self.op} {self.name!r}"
        return (f"{who} (node {self.node}): first non-finite {self.kind}, inputs {self.input_shapes}, "
                f"created at {self.where}")


# How NumPy's functions and ufuncs apply to a Var ("function", "ufunc"): registered from above by
# tapegrad/numpy_dispatch.py, as op families register into the op registry, so the tape imports no module
# that imports it.
NUMPY: dict = {}


class Var:
    """A handle to one node of a tape; supports Python operators and the op methods.

    Vars are made by the tape (``param``, ``const``) and by ops, never by hand. ``x + y``, ``x @ w``,
    ``x[i]``, ``x.T`` and ``x.relu()`` are ``tg.add``, ``tg.matmul``, indexing, ``tg.transpose`` and
    ``tg.relu``: each method below is the function of the same name with ``x`` as its first argument.
    A Var has no truth value (``if x:`` raises ``TypeError``).

    Args:
        tape: The tape holding the node.
        i: The node's id (-1: a poisoned Var).
        epoch: The tape's reset generation when the node was made: a Var that ``reset_to``
            dropped is caught with it.

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> tape = tg.Tape()
        >>> x = tape.param(np.array([1.0, 2.0]))
        >>> y = (x * x).sum()
        >>> tape.backward(y)
        True
        >>> tape.grad(x)
        array([2., 4.])
    """
    __slots__ = ("tape", "id", "epoch")
    __array_priority__ = 1000  # ndarray ⊕ Var defers to Var

    def __init__(self, tape: Tape, i: int, epoch: int) -> None:
        self.tape = tape
        self.id = i
        self.epoch = epoch

    def __repr__(self):
        if self.id < 0:
            return "<Var poisoned>"
        nodes = self.tape._nodes
        if self.id >= len(nodes) or nodes[self.id].epoch != self.epoch:
            return f"<Var node {self.id}: dropped by reset_to>"
        return f"<Var node {self.id}: {nodes[self.id].op.name} {self.shape}>"

    @property
    def shape(self) -> tuple[int, ...]:
        """The node's shape (known even for a node whose value is lazy)."""
        return self.tape._nodes[self.tape._index(self, "shape", "self")].shape

    @property
    def ndim(self) -> int:
        """The number of axes, ``len(shape)``."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def value(self) -> np.ndarray:
        """``tape.value(self)``: a read-only view of the node's value."""
        return self.tape.value(self)

    @property
    def grad(self) -> np.ndarray:
        """``tape.grad(self)``: a read-only view of d loss/d self."""
        return self.tape.grad(self)

    if TYPE_CHECKING:   # installed at import by tapegrad.functional; declared here for type checkers
        def __add__(self, other: Operand) -> Var: ...
        def __radd__(self, other: Operand) -> Var: ...
        def __sub__(self, other: Operand) -> Var: ...
        def __rsub__(self, other: Operand) -> Var: ...
        def __mul__(self, other: Operand) -> Var: ...
        def __rmul__(self, other: Operand) -> Var: ...
        def __truediv__(self, other: Operand) -> Var: ...
        def __rtruediv__(self, other: Operand) -> Var: ...
        def __matmul__(self, other: Operand) -> Var: ...
        def __rmatmul__(self, other: Operand) -> Var: ...
        def __neg__(self) -> Var: ...
        def __abs__(self) -> Var: ...
        def __pow__(self, p: float) -> Var: ...
        def __getitem__(self, key: Index) -> Var: ...
        @property
        def T(self) -> Var: ...
        # the op methods: each is the function of tapegrad.functional with this name (tests/test_typing.py)
        def relu(self) -> Var: ...
        def sigmoid(self) -> Var: ...
        def tanh(self) -> Var: ...
        def exp(self) -> Var: ...
        def log(self) -> Var: ...
        def sqrt(self) -> Var: ...
        def abs(self) -> Var: ...
        def square(self) -> Var: ...
        def log1p(self) -> Var: ...
        def expm1(self) -> Var: ...
        def erf(self) -> Var: ...
        def erfc(self) -> Var: ...
        def lgamma(self) -> Var: ...
        def digamma(self) -> Var: ...
        def sin(self) -> Var: ...
        def cos(self) -> Var: ...
        def tan(self) -> Var: ...
        def asinh(self) -> Var: ...
        def softplus(self) -> Var: ...
        def log_sigmoid(self) -> Var: ...
        def sum(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def mean(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def max(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def min(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def prod(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def logsumexp(self, axis: Axis = None, keepdims: bool = False) -> Var: ...
        def var(self, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> Var: ...
        def std(self, axis: Axis = None, ddof: int = 0, keepdims: bool = False) -> Var: ...
        def softmax(self, axis: int = -1) -> Var: ...
        def log_softmax(self, axis: int = -1) -> Var: ...
        def cumsum(self, axis: int, reverse: bool = False) -> Var: ...
        def cumprod(self, axis: int, reverse: bool = False) -> Var: ...
        def cummax(self, axis: int, reverse: bool = False) -> Var: ...
        def sort(self, axis: int = -1) -> Var: ...
        def transpose(self, axes: Axis = None) -> Var: ...
        def reshape(self, *shape: Ints) -> Var: ...
        def broadcast_to(self, shape: Sequence[int]) -> Var: ...
        def take(self, indices: Data, axis: int = 0) -> Var: ...
        def flip(self, axis: Axis = None) -> Var: ...
        def cholesky(self) -> Var: ...
        def logdet(self) -> Var: ...

    def __bool__(self):
        raise TypeError("a Var has no truth value; compare values with tape.value(v)")

    # NumPy's functions and ufuncs on a Var: tapegrad's op, or an error naming them (NUMPY, which
    # tapegrad/numpy_dispatch.py fills when the package loads)
    def __array_function__(self, func, types, args, kwargs):
        return NUMPY["function"](func, types, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return NUMPY["ufunc"](ufunc, method, inputs, kwargs)

    __hash__ = object.__hash__


class Tape:
    """A define-by-run tape over NumPy.

    Every op computes its value eagerly and appends one node; ``backward`` walks the nodes once in
    reverse (inputs always have smaller ids, so reverse order is topological order).

    What every op may raise, besides the errors its own docstring lists: ``ForeignVarError`` for a
    Var of another tape or one ``reset_to`` dropped, ``ArgumentError`` for a non-Var where a Var is
    expected, ``NonFiniteError`` under ``check_finite``. A failing op leaves the tape as it was. On a
    tape made with ``on_error="poison"`` none of these is raised: the op returns a poisoned Var instead.

    Args:
        dtype: The element type of values and gradients: float64 or float32.
        on_error: "raise" raises a ``TapeError`` and leaves the tape as it was; "poison" keeps ops
            returning (poisoned Vars), sets ``ok`` to False, keeps the first error in ``error``, and
            makes ``backward`` return False.
        check_finite: Raise ``NonFiniteError`` at the first op whose value is not finite (the node is
            not appended), and after a ``backward`` that produced a non-finite gradient.
        sources: Record the file and line that created each node (reported by ``first_nonfinite``
            and ``check_finite``). Finding the caller's frame costs about 0.15 µs per op (0.45 on the
            Python paths); ``sources=False`` saves it and reports the place as "?".
        ordered: Record matmul, sum and mean in ordered mode (``tapegrad.ordered``): serial
            index-order sums without FMA, so every backend reproduces the tape bit for bit (slower:
            no BLAS).

    Raises:
        DTypeError: If ``dtype`` is not float64 or float32.
        ConfigError: If ``on_error`` is not "raise" or "poison".

    Examples:
        >>> import tapegrad as tg, numpy as np
        >>> tape = tg.Tape()
        >>> w = tape.param(np.ones((3, 2)))
        >>> start = tape.mark()
        >>> x = tape.const(np.arange(6.0).reshape(2, 3))
        >>> loss = (x @ w).relu().mean()
        >>> tape.backward(loss), float(tape.grad(w)[0, 0])
        (True, 0.75)
        >>> tape.reset_to(start); len(tape)
        1
    """

    _floor: Optional[int]

    def __init__(self, dtype: DTypeLike = np.float64, *, on_error: Literal["raise", "poison"] = "raise",
                 check_finite: bool = False, sources: bool = True, ordered: bool = False) -> None:
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise DTypeError(f"Tape: dtype must be float64 or float32, got {dtype}")
        if on_error not in ("raise", "poison"):
            raise ConfigError(f"Tape: on_error must be 'raise' or 'poison', got {on_error!r}")
        self.dtype = dtype
        self.poison = on_error == "poison"
        self.check_finite = check_finite
        self.sources = sources
        # ordered mode (tapegrad.ordered): matmul and sums record their serial, index-ordered variants
        self.ordered = bool(ordered)
        self._ordered = None
        if ordered:
            from .ordered import ORDERED
            self._ordered = ORDERED
        self.ok = True
        self.error: Optional[TapeError] = None
        self._nodes = []      # Node per id
        self._val = []        # value array per id (None: lazy or dropped)
        self._grad = []       # gradient buffer per id, None until first touched
        self._gpass = []      # the backward pass that last wrote the gradient
        self._epoch = 0
        self._pass = 0        # backward passes so far
        self._since = 1       # first pass since the last reset: leaf grads older than it read as zero
        self._vals = Arena(dtype)     # op values, rewound by reset_to
        self._grads = Arena(dtype)    # gradients and backward scratch of one episode
        self._tmp = Arena(dtype)      # forward scratch, rewound after every op
        self._params = ParamStore(dtype)
        self._arena_grads = []
        self._dropped = False  # drop_consts ran: backward checks that the values it reads exist
        self._floor = None    # the last mark: constants after it live in the value arena
        self._names = {}      # parameter name -> its Var (entries of dropped nodes are stale, see names())
        self._sched: Optional[Schedule] = None   # the last episode's recorded sweep (tapegrad.schedule)
        self._last_top: Optional[int] = None      # the loss id of the last first-pass backward
        self._summed: Optional[np.ndarray] = None  # the broadcast sum _accumulate made last
        self._kept = {}       # node id -> the buffers its forward kept for its backward (Op.keep)
        self._undo: Optional[dict] = None   # during an accumulating backward: leaf id -> its gradient before the pass

    # ── leaves ───────────────────────────────────────────────────────────────

    def param(self, array: ArrayLike, name: Optional[str] = None) -> Var:
        """Register a trainable parameter; the array is copied into tape-owned aligned memory.

        Args:
            array: The initial value: a float32 or float64 array (integers and nested lists are
                converted to the tape's dtype).
            name: How captured programs, episode states, checkpoints and reports refer to the
                parameter, e.g. ``program.value("W1")``; unique among the tape's live parameters.
                ``param_<k>`` is reserved for unnamed ones.

        Returns:
            The parameter's Var.

        Raises:
            ArgumentError: If ``name`` is empty, padded with spaces, reserved or taken.
            DTypeError: If ``array`` holds no real floats (complex, strings).
            ShapeError: If ``array`` is a ragged nested list.
            TypeError: If ``array`` is a Var.

        Examples:
            >>> import numpy as np, tapegrad as tg
            >>> tape = tg.Tape()
            >>> w = tape.param(np.zeros((2, 3)), name="W1")
            >>> w, tape.name_of(w)
            (<Var node 0: param (2, 3)>, 'W1')
        """
        if name is not None:
            bad = self._bad_name(name)
            if bad:
                return self._fail(ArgumentError(f"{at('param', len(self))}: {bad}"))
        var = self._leaf(O.param, array, "param")
        if name is not None and var.id >= 0:
            self._names[name] = var
        return var

    def const(self, array: ArrayLike) -> Var:
        """Register a constant (no gradient flows into it); copied in like ``param``.

        A constant registered after ``mark`` lives in the episode's memory, which ``reset_to`` takes
        back (a minibatch).

        Args:
            array: A float array, or an integer or bool array, which becomes a data leaf (indices
                for ``take``, a mask for ``where``): held as int64 or bool, never cast to float and
                never differentiated.

        Returns:
            The constant's Var.

        Raises:
            DTypeError: If ``array`` holds no real numbers, or unsigned integers past int64.
            ShapeError: If ``array`` is a ragged nested list.
            TypeError: If ``array`` is a Var.

        Examples:
            >>> import tapegrad as tg, numpy as np
            >>> tape = tg.Tape()
            >>> i, m = tape.const(np.array([2, 0])), tape.const(np.array([True]))
            >>> i.value.dtype, m.value.dtype
            (dtype('int64'), dtype('bool'))
        """
        return self._leaf(O.const, array, "const")

    def const_lazy(self, shape: Sequence[int], dtype: Optional[DTypeLike] = None) -> Var:
        """A constant declared by shape whose values come later, through a captured program.

        The tape records ops on it (shapes only) but cannot evaluate them: use it on graphs that
        will be captured (``tapegrad.capture``) so frozen weights never sit in host memory twice.
        Give the values with ``program.set_input(var, array)``.

        Args:
            shape: The constant's shape.
            dtype: float32 or float64; None: the tape's dtype.

        Returns:
            The lazy constant's Var (``tape.value`` of it, or of anything computed from it, raises
            ``LazyValueError``).

        Raises:
            DTypeError: If ``dtype`` is not float32 or float64.
            ShapeError: If a dimension is negative.

        Examples:
            >>> import numpy as np, tapegrad as tg
            >>> tape = tg.Tape()
            >>> frozen = tape.const_lazy((4, 2))
            >>> w = tape.param(np.ones((2, 1)))
            >>> program = tg.capture(tape, (frozen @ w).sum())
            >>> program.set_input(frozen, np.ones((4, 2))); float(program.forward())
            8.0
        """
        dtype = np.dtype(dtype or self.dtype)
        if dtype not in _DTYPES:
            raise DTypeError(f"{at('const_lazy', len(self))}: dtype must be float32 or float64, got {dtype}")
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ShapeError(f"{at('const_lazy', len(self))}: shape must have non-negative dims, got {shape}")
        return self._append(O.const, -1, -1, "lazy", None, shape, False, True, None, None)

    def _leaf(self, op, array, name):
        if isinstance(array, Var):
            raise TypeError(f"{at(name, len(self))}: expected an array, got a Var (use it directly)")
        if not isinstance(array, np.ndarray):
            try:
                raw = np.asarray(array)   # complex, str, None: no float() here; the dtype check names them
            except ValueError as e:       # a ragged nested list: NumPy's own message names no op
                return self._fail(ShapeError(f"{at(name, len(self))}: expected an array or a rectangular nested "
                                             f"list of numbers, got a {type(array).__name__} NumPy cannot make one "
                                             f"array of ({e}); pad the rows to one length, or register the pieces "
                                             f"separately"))
            array = raw.astype(self.dtype) if raw.dtype.kind in "fbiu" and not isinstance(array, np.generic) else raw
        if op is O.const and array.dtype.kind in "biu":
            return self._data(array)
        if array.dtype.kind != "f" or array.dtype not in _DTYPES:
            err = DTypeError(f"{at(name, len(self))}: expected float32 or float64 data, got {array.dtype}; "
                             f"convert with .astype(np.float64)")
            return self._fail(err)
        if op is O.param:
            pos, (value, grad) = self._params.add(array.shape)
            np.copyto(value, array, casting="unsafe")
            var = self._append(op, -1, -1, None, value, value.shape, True, False, pos, grad)
            return var
        if self._floor is None:
            value, pos = aligned_copy(array, self.dtype), None
        else:  # a per-episode constant (a minibatch): its memory comes back at reset_to
            pos = self._vals.pos
            value = self._vals.take(array.shape)
            np.copyto(value, array, casting="unsafe")
        return self._append(op, -1, -1, None, value, value.shape, False, False, pos, None)

    def _data(self, array):
        dtype = np.dtype(np.bool_) if array.dtype.kind == "b" else _INT
        if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(_INT).max:
            return self._fail(DTypeError(f"{at('const', len(self))}: integer data must fit int64, got {array.dtype} "
                                         f"values up to {array.max()}"))
        return self._append(O.data, -1, -1, None, aligned_copy(array, dtype), array.shape, False, False, None, None)

    # ── the op path ──────────────────────────────────────────────────────────

    def _apply_py(self, op, a, b=None, s=None, c=None):
        """Append one registry op applied to Vars ``a`` (and ``b``, ``c``) with static operand ``s``."""
        if self._ordered is not None:
            op = self._ordered.get(op, op)
        if op.data or c is not None:
            return self._apply_data(op, a, b, s, c)
        nodes = self._nodes
        try:
            na = nodes[a.id]
            if a.tape is not self or na[5] != a.epoch:
                raise LookupError
            if b is None:
                nb = None
                key = (op, na[8], None, s)
            else:
                nb = nodes[b.id]
                if b.tape is not self or nb[5] != b.epoch:
                    raise LookupError
                key = (op, na[8], nb[8], s)
        except (AttributeError, IndexError, LookupError):
            try:
                self._index(a, op.name, "a")
                self._index(b, op.name, "b")
            except TapeError as e:
                return self._fail(e)
        if na[0] is _DATA or (nb is not None and nb[0] is _DATA):
            return self._apply_data(op, a, b, s, c)
        memo = _SHAPES.get(key)
        if memo is None:
            try:
                shape = op.shape(key[1], key[2], s)
            except O.Bad as e:
                return self._fail(ShapeError(f"{at(op.name, len(nodes))}: {e}"))
            memo = _SHAPES[key] = (shape, math.prod(shape), op.keep and op.keep(key[1], s))
        shape = memo[0]
        ia = a.id
        if nb is None:
            ib, req, lazy = -1, na[4], na[7]
        else:
            ib, req, lazy = b.id, na[4] or nb[4], na[7] or nb[7]
        if lazy:
            return self._append(op, ia, ib, s, None, shape, req, True, None, None)
        arena = self._vals
        pos = (arena.si, arena.off)
        out = arena.take(shape, memo[1])
        vals = self._val
        tmp = self._tmp
        kept = memo[2]   # the shapes of the buffers the forward keeps for the backward (Op.keep)
        vb = None if ib < 0 else vals[ib]
        try:
            if kept is None:
                op.fwd(vals[ia], vb, s, out, tmp)
            else:
                kept = tuple(map(arena.take, kept))
                op.fwd(vals[ia], vb, s, out, tmp, kept)
        except O.Bad as e:   # a value the op cannot take (a matrix that is not positive definite)
            arena.rewind(pos)
            tmp.rewind()
            return self._fail(DomainError(f"{at(op.name, len(nodes))}: {e}"))
        if tmp.si or tmp.off:
            tmp.rewind()
        if self.check_finite and not np.isfinite(out).all():
            arena.rewind(pos)
            ins = tuple(n.shape for n in (na, nb) if n is not None)
            return self._fail(NonFiniteError(str(NonFinite(len(nodes), op.name, "value", ins, _where(_user_frame())))))
        i, epoch = len(nodes), self._epoch  # _append, inlined on the hot path
        nodes.append(_node((op, ia, ib, s, req, epoch, _user_frame() if self.sources else None, False, shape, pos,
                            -1)))
        vals.append(out)
        self._grad.append(None)
        self._gpass.append(0)
        if kept is not None:
            self._kept[i] = kept
        return Var(self, i, epoch)

    apply = _apply_py   # (tapegrad/_ctape.c replaces it with its C path where it is built)
    _fast: Any = None   # that module, which also replays a recorded sweep (Schedule.replay)

    def _apply_data(self, op, a, b, s, c):
        """The op path for ops with data inputs (and any op given one): every input's kind is checked
        against the registry entry, data values by its ``check``; then as ``apply``."""
        vars_ = (a, b, c)[:op.arity]
        if len(vars_) != op.arity or any(v is None for v in vars_) or (c is not None and op.arity < 3):
            return self._fail(ArgumentError(f"{at(op.name, len(self))}: expected {op.arity} inputs"))
        ids = []
        for v, kind, arg in zip(vars_, op.inputs, "abc"):
            try:
                i = self._index(v, op.name, arg)
            except TapeError as e:
                return self._fail(e)
            n = self._nodes[i]
            have = "a float Var" if n.op is not O.data else _DATA_NAMES[self._val[i].dtype.kind]
            want = "a float Var" if kind in "fn" else O.DATA_KINDS[kind] + " data"
            if have != want:
                hint = {"f": "data leaves are not differentiable; make a float constant with "
                             "tape.const(x.astype(float))",
                        "b": "make a mask with tape.const(np.asarray(m, bool))",
                        "i": "make indices with tape.const(np.asarray(i, int))"}[kind.replace("n", "f")]
                return self._fail(ArgumentError(f"{at(op.name, len(self))}: argument {arg} (node {i}) must be "
                                                f"{want}, got {have}; {hint}"))
            ids.append(i)
        nodes = [self._nodes[i] for i in ids]
        shapes = [n.shape for n in nodes] + [None] * (3 - len(nodes))
        try:
            shape = op.shape(shapes[0], shapes[1], s, shapes[2]) if op.arity == 3 else op.shape(shapes[0], shapes[1], s)
        except O.Bad as e:
            return self._fail(ShapeError(f"{at(op.name, len(self))}: {e}"))
        ia, ib, ic = (ids + [-1, -1])[:3]
        req = any(n.req for n, kind in zip(nodes, op.inputs) if kind == "f")
        if any(n.lazy for n in nodes):
            return self._append(op, ia, ib, s, None, shape, req, True, None, None, ic)
        vals = [self._val[i] for i in ids] + [None] * (3 - len(ids))
        if op.check is not None:
            try:
                op.check(*vals[:2], s, *vals[2:op.arity])
            except O.Bad as e:
                return self._fail(ShapeError(f"{at(op.name, len(self))}: {e}"))
        arena = self._vals
        pos = arena.pos
        out = arena.take(shape)
        op.fwd(vals[0], vals[1], s, out, self._tmp, *vals[2:op.arity])
        if self._tmp.si or self._tmp.off:
            self._tmp.rewind()
        if self.check_finite and not np.isfinite(out).all():
            arena.rewind(pos)
            ins = tuple(n.shape for n in nodes)
            return self._fail(NonFiniteError(str(NonFinite(len(self), op.name, "value", ins, _where(_user_frame())))))
        return self._append(op, ia, ib, s, out, shape, req, False, pos, None, ic)

    def _append(self, op, ia, ib, s, value, shape, req, lazy, pos, grad, ic=-1):
        i = len(self._nodes)
        src = _user_frame() if self.sources else None
        self._nodes.append(_node((op, ia, ib, s, req, self._epoch, src, lazy, shape, pos, ic)))
        self._val.append(value)
        self._grad.append(grad)
        self._gpass.append(0)
        return Var(self, i, self._epoch)

    def _index(self, v, opname, arg):
        """The node id of Var ``v``, or an error naming the op and the argument."""
        try:
            if v.tape is self and self._nodes[v.id].epoch == v.epoch:
                return v.id
        except (AttributeError, IndexError):
            pass
        here = at(opname, len(self._nodes))
        if type(v) is not Var:
            raise ArgumentError(f"{here}: argument {arg} must be a Var, got {type(v).__name__}")
        if v.id < 0:
            raise ForeignVarError(f"{here}: argument {arg} is a poisoned Var (see tape.error)")
        if v.tape is not self:
            raise ForeignVarError(f"{here}: argument {arg} (node {v.id}) belongs to another tape; record the "
                                  f"whole computation on one tape")
        raise ForeignVarError(f"{here}: argument {arg} (node {v.id}) was dropped by reset_to; Vars created "
                              f"after a mark are invalid once the tape is reset to it")

    def _lifted(self):
        """A context for functions that lift arrays to constants (or compose ops) before the op that may
        fail: on an error every node appended inside goes too, so the tape is left exactly as it was."""
        return _Rollback(self)

    def _fail(self, err):
        if not self.poison:
            raise err
        if self.ok:
            self.ok = False
            self.error = err
        return Var(self, -1, -1)

    # ── reading values and gradients ─────────────────────────────────────────

    def value(self, v: Var) -> np.ndarray:
        """A read-only view of a node's value (invalid after a reset past the node).

        Args:
            v: A Var of this tape.

        Returns:
            The value, read-only, without a copy.

        Raises:
            ForeignVarError: If ``v`` belongs to another tape or was dropped by ``reset_to``.
            LazyValueError: If ``v`` depends on a lazy or dropped constant.
        """
        i = self._index(v, "value", "v")
        val = self._val[i]
        if val is None:
            raise LazyValueError(self._no_value(i, "value"))
        return readonly(val)

    def grad(self, v: Var) -> np.ndarray:
        """A read-only view of the accumulated gradient d loss/d v.

        Args:
            v: A float Var of this tape.

        Returns:
            The gradient, of ``v``'s shape, read-only; zeros if backward never reached ``v``.

        Raises:
            ArgumentError: If ``v`` is a data node (integer indices or a bool mask).
            ForeignVarError: If ``v`` belongs to another tape or was dropped by ``reset_to``.
        """
        i = self._index(v, "grad", "v")
        if self._nodes[i].op is O.data:
            raise ArgumentError(f"grad (node {i}): a data node ({self._val[i].dtype} indices or mask) has no "
                                f"gradient")
        g = self._grad[i]
        if g is None:
            g = self._grad[i] = aligned_empty(self._nodes[i].shape, self.dtype)
            g.fill(0.0)
        elif not self._touched(i):
            g.fill(0.0)
        return readonly(g)

    def touched(self, v: Var) -> bool:
        """Whether backward has written d loss/d v since the last reset.

        An optimizer's ``step`` skips untouched parameters.

        Args:
            v: A Var of this tape.

        Returns:
            True once a backward pass reached ``v``.

        Raises:
            ForeignVarError: If ``v`` belongs to another tape or was dropped by ``reset_to``.
        """
        return self._touched(self._index(v, "touched", "v"))

    def _touched(self, i):
        p = self._gpass[i]
        return p >= self._since if self._nodes[i].op.arity == 0 else p == self._pass and p > 0

    def _no_value(self, i, what):
        k = next(k for k in _ancestors(self._nodes, i) if self._nodes[k].op.arity == 0 and self._val[k] is None)
        kind = "lazy" if self._nodes[k].s == "lazy" else "dropped (drop_consts)"
        return (f"{at(self._nodes[i].op.name, i)}: has no {what} on the tape: it depends on the {kind} constant "
                f"node {k}; run it through a captured program (tapegrad.capture) instead")

    def __len__(self) -> int:
        return len(self._nodes)

    # ── parameter names ──────────────────────────────────────────────────────

    def names(self) -> dict[str, Var]:
        """The named parameters still on the tape, in registration order.

        Returns:
            ``{name: Var}``.

        Examples:
            >>> import numpy as np, tapegrad as tg
            >>> tape = tg.Tape(); w = tape.param(np.ones(2), name="W1")
            >>> tape.names()
            {'W1': <Var node 0: param (2,)>}
        """
        live = {n: v for n, v in self._names.items() if self._live(v)}
        return dict(sorted(live.items(), key=lambda item: item[1].id))

    def name_of(self, v: Var) -> Optional[str]:
        """The name ``v`` was registered with (``param(..., name=)``).

        Args:
            v: A Var of this tape.

        Returns:
            The name, or None for an unnamed parameter or any other node.

        Raises:
            ForeignVarError: If ``v`` belongs to another tape or was dropped by ``reset_to``.
        """
        i = self._index(v, "name_of", "v")
        return next((n for n, w in self._names.items() if w.id == i and self._live(w)), None)

    def _live(self, v):
        return v.id < len(self._nodes) and self._nodes[v.id].epoch == v.epoch

    def _bad_name(self, name):
        if not isinstance(name, str) or not name or name != name.strip():
            return f"name must be a non-empty string without surrounding spaces, got {name!r}"
        if name.startswith("param_") and name[6:].isdigit():
            return f"name {name!r} is reserved: unnamed parameters are called param_<k> (k = registration index)"
        old = self._names.get(name)
        if old is not None and self._live(old):
            return f"name {name!r} is already taken by node {old.id}; parameter names are unique per tape"
        return None

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The node table, a tuple of ``Node`` in tape order (a copy: editing it changes nothing)."""
        return tuple(self._nodes)

    # ── episodes ─────────────────────────────────────────────────────────────

    def mark(self) -> int:
        """A watermark for ``reset_to``: the current length of the tape.

        Constants registered after the last mark live in the episode's memory (see ``const``).

        Returns:
            The number of nodes on the tape.
        """
        self._floor = len(self._nodes)
        return self._floor

    def reset_to(self, mark: int) -> None:
        """Drop every node with id >= mark and zero the surviving gradients, keeping all capacity.

        The minibatch loop: register parameters, ``m = tape.mark()``, then per batch build the graph,
        ``backward``, step the optimizer, ``tape.reset_to(m)``. Values and gradients of dropped nodes go
        back to the arena and are reused by the next episode; Vars of dropped nodes become invalid.

        Args:
            mark: A tape length, usually what ``mark()`` returned.

        Raises:
            TapeError: If ``mark`` is not an int in ``[0, len(tape)]``.
        """
        if type(mark) is not int and not isinstance(mark, np.integer) or not 0 <= mark <= len(self._nodes):
            raise TapeError(f"reset_to: mark must be an int in [0, {len(self._nodes)}], got {mark!r}")
        dropped = self._nodes[mark:]
        for n in dropped:   # the first dropped node holding value-arena memory (usually the first)
            if n.pos is not None and n.op is not O.param:
                self._vals.rewind(n.pos)
                break
        if O.param in map(_OP, dropped):
            self._params.rewind(next(n.pos for n in dropped if n.op is O.param))
        for lst in (self._nodes, self._val, self._grad, self._gpass):
            del lst[mark:]
        if self._kept and max(self._kept) >= mark:
            self._kept = {i: kept for i, kept in self._kept.items() if i < mark}
        # Surviving gradients carved from the episode arena move to their own buffers, once.
        if self._arena_grads and min(self._arena_grads) < mark:
            for i in self._arena_grads:
                if i < mark:
                    self._grad[i] = aligned_empty(self._nodes[i].shape, self.dtype)
        self._arena_grads = []
        self._grads.rewind()
        self._epoch += 1
        self._since = self._pass + 1

    def drop_consts(self) -> int:
        """Free the host values of every constant, once a captured program holds its own copies.

        Constants registered before the first ``mark`` own their memory and free it; per-episode
        constants live in the episode arena, whose memory is reused rather than freed. The tape can
        no longer evaluate ops that read a dropped constant (``LazyValueError``); parameters stay.

        Returns:
            The number of bytes freed.
        """
        freed = 0
        self._dropped = True
        for i, n in enumerate(self._nodes):
            if n.op is O.const and self._val[i] is not None:
                freed += self._val[i].nbytes if n.pos is None else 0
                self._val[i] = None
                self._nodes[i] = n._replace(lazy=True)
        return freed

    # ── the reverse sweep ────────────────────────────────────────────────────

    def backward(self, loss: Var, seed: Optional[ArrayLike] = None) -> bool:
        """Accumulate d loss/d x into every node's gradient by one reverse walk of the tape.

        Gradients of leaves accumulate across calls until ``reset_to`` (as in PyTorch); intermediate
        gradients hold the latest pass. Broadcast inputs receive the contribution summed over the
        broadcast axes by one ``numpy.add.reduce`` call (leading axes of a row-major contribution:
        row by row, in order). A pass that raises part-way leaves the gradients as they were.

        Args:
            loss: The Var to differentiate: one element, unless ``seed`` is given.
            seed: The cotangent, an array of ``loss``'s shape; None: ones.

        Returns:
            True; False (and nothing done) on a poisoned tape, or when it fails on an
            ``on_error="poison"`` tape.

        Raises:
            ShapeError: If ``loss`` has more than one element and no ``seed``, or ``seed`` has another
                shape.
            DTypeError: If ``seed`` holds no real numbers.
            LazyValueError: If ``loss`` depends on a lazy or dropped constant.
            NonFiniteError: If the tape has ``check_finite=True`` and a gradient is not finite.
        """
        if not self.ok:
            return False
        try:
            i = self._index(loss, "backward", "loss")
        except TapeError as e:
            self._fail(e)
            return False
        shape = self._nodes[i].shape
        if seed is None:
            if math.prod(shape) != 1:
                self._fail(ShapeError(f"{at('backward', i)}: expected a scalar loss (one element), got shape "
                                      f"{shape}; reduce it (e.g. .sum()) or pass seed="))
                return False
            seed = _ONES.get((shape, self.dtype))
            if seed is None:
                seed = _ONES[(shape, self.dtype)] = np.ones(shape, self.dtype)
        else:
            seed = np.asarray(seed)
            if seed.dtype.kind not in "fiu":
                self._fail(DTypeError(f"{at('backward', i)}: seed must hold real numbers, got {seed.dtype}"))
                return False
            if seed.shape != shape:
                self._fail(ShapeError(f"{at('backward', i)}: seed must have the loss's shape {shape}, got "
                                      f"{seed.shape}"))
                return False
        if self._nodes[i].lazy or (self._dropped and any(self._val[k] is None for k in _ancestors(self._nodes, i))):
            self._fail(LazyValueError(self._no_value(i, "gradient")))
            return False
        self._recycle_scratch()
        # What the pass changes, kept so that an exception anywhere in it (a KeyboardInterrupt, an op's rule
        # failing) undoes it (_abandon): the arena position, the scratch-gradient count, the recorded sweep,
        # and where leaves already hold gradients from earlier passes (accumulation), their pass numbers
        # (their buffers are copied on their first in-place add, in _accumulate).
        undo = (self._pass, self._grads.pos, len(self._arena_grads), self._sched, self._last_top,
                self._gpass.copy() if self._pass >= self._since else None)
        self._undo = None if undo[5] is None else {}
        try:
            self._pass += 1
            self._accumulate(i, seed)
            if self._pass != self._since or self._dropped:   # a second pass since the reset, or values dropped
                self._sweep(i)
            else:   # the first pass of an episode: replay the last one's sweep when the graph is the same
                pos, sched = self._grads.pos, self._sched
                if sched is not None and sched.fits(self, i, pos):
                    sched.replay(self)
                else:
                    self._sched = Schedule(self, i, pos) if self._last_top == i else None
                    self._sweep(i, self._sched)
                self._last_top = i
            bad = self.first_nonfinite() if self.check_finite else None
        except BaseException:
            self._abandon(*undo)
            raise
        self._undo = None
        if bad is not None:
            self._fail(NonFiniteError(str(bad)))
            return False
        return True

    def _abandon(self, p, pos, n, sched, top, old):
        """Undo a backward pass that raised part-way, back to the state before the call: leaf gradients
        and ``touched`` as they were (an interrupted first pass leaves every leaf untouched), scratch
        gradients made by the pass dropped, the arena rewound, the recorded sweep and the pass count
        restored. Intermediate gradients the pass overwrote read as untouched (zeros), as after a reset."""
        grads, gpass, nodes = self._grad, self._gpass, self._nodes
        for j in self._arena_grads[n:]:   # (they held no buffer before: _accumulate lists only those)
            grads[j] = None
        del self._arena_grads[n:]
        for j, buf in (self._undo or {}).items():
            np.copyto(grads[j], buf)
        self._undo = None
        for k, q in enumerate(gpass):
            if q > p:
                gpass[k] = old[k] if old is not None and not nodes[k][0].arity else 0
        self._pass = p
        self._grads.rewind(pos)
        self._sched, self._last_top = sched, top

    def _recycle_scratch(self):
        """Before a second backward without ``reset_to``: move the gradients that live in the scratch arena
        to their own buffers (values kept) and rewind it, so repeated backwards (gradient accumulation,
        Jacobian rows) reuse the same scratch instead of growing it every call."""
        if self._pass < self._since:
            return
        for j in self._arena_grads:
            self._grad[j] = aligned_copy(self._grad[j], self.dtype)
        self._arena_grads = []
        self._grads.rewind()

    def _sweep(self, top, rec=None):
        """Visit every node a gradient reached, from ``top`` down; with ``rec`` (a Schedule), record
        every rule call and accumulation for the next episode to replay."""
        nodes, vals, grads, gpass, ws = self._nodes, self._val, self._grad, self._gpass, self._grads
        p = self._pass
        acc = self._accumulate
        for k in range(top, -1, -1):
            if gpass[k] != p:
                continue
            node = nodes[k]
            op = node[0]
            if not op.arity:
                continue
            a, b, s = node[1], node[2], node[3]
            g, out, va = grads[k], vals[k], vals[a]
            vb = None if b < 0 else vals[b]
            if rec is not None:
                self._record(rec, k, op, a, op.da, g, out, va, vb, s)
                if b >= 0:
                    self._record(rec, k, op, b, op.db, g, out, va, vb, s)
                continue
            if op.arity == 3 or op.keep is not None:   # a third input (data) or kept buffers: passed last
                vc = vals[node[10]] if op.arity == 3 else self._kept[k]
                if nodes[a][4]:
                    acc(a, op.da(g, out, va, vb, s, ws, vc), not op.aliases)
                if b >= 0 and nodes[b][4]:
                    acc(b, op.db(g, out, va, vb, s, ws, vc), not op.aliases)
                continue
            if nodes[a][4]:
                acc(a, op.da(g, out, va, vb, s, ws), not op.aliases)
            if b >= 0 and nodes[b][4]:
                acc(b, op.db(g, out, va, vb, s, ws), not op.aliases)
        if rec is not None:
            rec.close(ws.pos)

    def _record(self, rec, k, op, j, rule, g, out, va, vb, s):
        """One contribution of the sweep, made as ``_sweep`` makes it and written down in ``rec``."""
        node = self._nodes[j]
        if not node[4]:
            return
        ws = self._grads
        if self._gpass[j] != self._pass:
            rec.empty.append((j, self._grad[j] is None))
        pos, f = ws.pos, getattr(rule, "into", None)
        if op.arity == 3:
            c = rule(g, out, va, vb, s, ws, self._val[self._nodes[k][10]])
        elif op.keep is not None:
            c = rule(g, out, va, vb, s, ws, self._kept[k])
        else:
            c = rule(g, out, va, vb, s, ws)
        code = self._accumulate(j, c, not op.aliases)
        buf = None
        if code == INTO or code & SUMMED:
            axes, reduced = _UNBROADCAST[(c.shape, node[8])]
            buf = (axes, reduced) if code == INTO else (self._summed.reshape(reduced), axes, self._summed)
        elif code == NEW:
            buf = self._grad[j]
        rec.add(self, k, j, rule, f, c, pos, code, buf)

    def _accumulate(self, j, c, fresh=False):
        """Add contribution ``c`` into node j's gradient (summing over broadcast axes first).

        The first contribution of a pass is copied, or adopted outright when it is a fresh scratch
        buffer of an op node (no copy); later ones are added in place, in reverse node order.
        """
        node = self._nodes[j]
        shape = node[8]
        buf = self._grad[j]
        gpass = self._gpass
        first = gpass[j] < (self._pass if node[0].arity else self._since)
        gpass[j] = self._pass
        summed = 0
        if c.shape != shape:
            if first and buf is not None:
                unbroadcast(c, shape, self._grads, out=buf)
                return INTO
            c, fresh = unbroadcast(c, shape, self._grads), True
            self._summed, summed = c, SUMMED
        if buf is None:
            self._arena_grads.append(j)   # listed first: an interrupted pass drops whatever is listed
            if fresh:
                self._grad[j] = c
                code = ADOPT
            else:
                buf = self._grad[j] = self._grads.take(shape)
                np.copyto(buf, c)
                code = NEW
        elif first:
            np.copyto(buf, c)
            code = COPY
        else:
            if self._undo is not None and not node[0].arity and j not in self._undo:
                self._undo[j] = buf.copy()   # a leaf's earlier passes, restored if this pass fails (_abandon)
            np.add(buf, c, out=buf)
            code = ADD
        return code | summed

    # ── anomaly detection ────────────────────────────────────────────────────

    def first_nonfinite(self) -> Optional[NonFinite]:
        """The first node, in forward order, whose value (then: gradient) holds inf or nan.

        Returns:
            Where it is, or None when every value and gradient is finite.

        Examples:
            >>> import numpy as np, tapegrad as tg
            >>> tape = tg.Tape()
            >>> x = tape.param(np.array([1.0, 2.0]))
            >>> y = x * np.inf
            >>> bad = tape.first_nonfinite(); bad.op, bad.node, bad.kind
            ('muls', 1, 'value')
        """
        for kind, bufs in (("value", self._val), ("grad", self._grad)):
            for i, buf in enumerate(bufs):
                if buf is None or (kind == "grad" and not self._touched(i)) or self._nodes[i].op is O.data:
                    continue
                if not np.isfinite(buf).all():
                    n = self._nodes[i]
                    ins = tuple(self._nodes[k].shape for k in (n.a, n.b) if k >= 0)
                    name = next((k for k, v in self._names.items() if v.id == i and self._live(v)), None)
                    return NonFinite(i, n.op.name, kind, ins, _where(n.src), name)
        return None


class _Rollback:
    def __init__(self, tape):
        self.tape = tape

    def __enter__(self):
        self.n, self.pos = len(self.tape._nodes), self.tape._vals.pos
        return self

    def __exit__(self, kind, err, tb):
        t = self.tape
        if kind is not None and issubclass(kind, TapeError) and len(t._nodes) > self.n:
            assert all(nd.op is not O.param for nd in t._nodes[self.n:])   # nodes no caller has seen
            t._vals.rewind(self.pos)
            for lst in (t._nodes, t._val, t._grad, t._gpass):
                del lst[self.n:]
        return False


def unbroadcast(c, shape, ws, out=None):
    """Sum an out-shaped contribution down to ``shape`` over the axes broadcasting added or stretched.

    One ``numpy.add.reduce`` call over all those axes: for the usual bias (leading axes of a
    row-major contribution) that is plain row-by-row accumulation in increasing row order.
    """
    plan = _UNBROADCAST.get((c.shape, shape))
    if plan is None:
        lead = c.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + k for k, n in enumerate(shape) if n == 1 and c.shape[lead + k] != 1)
        plan = _UNBROADCAST[(c.shape, shape)] = (axes, tuple(n for k, n in enumerate(c.shape) if k not in axes))
    r = ws.take(shape) if out is None else out
    np.add.reduce(c, axis=plan[0], out=r.reshape(plan[1]))
    return r


def _ancestors(nodes, i):
    """Ids reachable from node i through inputs, in increasing order (an explicit stack, no recursion)."""
    seen, stack = set(), [i]
    while stack:
        k = stack.pop()
        if k < 0 or k in seen:
            continue
        seen.add(k)
        stack += (nodes[k].a, nodes[k].b, nodes[k].c)
    return sorted(seen)


_OURS = {}   # id(code) -> (code, whether it is tapegrad's own); keyed by id, as a code object hashes its contents


def _user_frame():
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        seen = _OURS.get(id(code))
        if seen is None or seen[0] is not code:   # (holding the code keeps its id from being reused)
            seen = _OURS[id(code)] = (code, code.co_filename.startswith(_PKG))
        if not seen[1]:
            return (code, f.f_lasti)   # the line is looked up only when reported (_where)
        f = f.f_back
    return None


def _where(src):
    """"file:line" of a node's source (code, bytecode offset), or "?"."""
    if src is None:
        return "?"
    code, offset = src
    line = next((n for start, end, n in code.co_lines() if start <= offset < end), None)
    return f"{os.path.basename(code.co_filename)}:{line if line is not None else '?'}"


def _install_c_core():
    """Use the C hot paths (tapegrad/_ctape.c) where they were built, unless TAPEGRAD_PURE is set."""
    # (not mutated: mutation runs use a scratch tree without the built core; tests/test_ctape.py checks it)
    if os.environ.get("TAPEGRAD_PURE"):  # pragma: no mutate
        return
    try:
        _ctape = importlib.import_module(f"{__package__}._ctape")   # the C extension (no module of the graph)
    except ImportError:   # built without a C compiler or Python's headers: the Python paths serve
        return
    Tape.apply = _ctape.install(Tape, Var, Node, _DATA, _SHAPES, _PKG, O.Bad)  # pragma: no mutate
    Tape._fast = _ctape  # pragma: no mutate


_install_c_core()
