"""Capture: one recorded episode frozen into a static ``Program`` that a backend replays.

>>> import numpy as np, tapegrad as tg
>>> tape = tg.Tape()
>>> w = tape.param(np.array([[1.0], [2.0]]))
>>> x = tape.const(np.array([[1.0, 1.0]]))
>>> loss = ((x @ w) * (x @ w)).mean()
>>> prog = tg.capture(tape, loss)
>>> float(prog.forward())
9.0
>>> prog.backward(); prog.grad(w).ravel().tolist()
[6.0, 6.0]
>>> prog.set_input(x, np.array([[2.0, 0.0]])); float(prog.forward())
4.0

The optimizer runs inside the program; ``episode`` is inputs + forward + backward + step in one call:

>>> opt = tg.SGD(0.1); _ = opt.add(tape, w)
>>> prog.attach(opt)
>>> prog.episode({x: np.array([[1.0, 1.0]])})
9.0
>>> np.round(prog.value(w).ravel(), 12).tolist(), prog.optimizer_state()["count"]
([0.4, 1.4], 1)
"""
from __future__ import annotations

import copy
import functools
import hashlib
import math
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import ops as O
from ._arena import aligned_copy, aligned_empty, readonly, slab_views
from .errors import ConfigError, DTypeError, ForeignVarError, LazyValueError, ShapeError, TapeError, at
from .tape import Tape, Var

if TYPE_CHECKING:
    from .optim import Optimizer

Slot = Union[Var, str]   # a Var of the captured episode, or a parameter's name

BACKENDS = ("numpy", "native", "cupy")
_FLOATS = (np.dtype(np.float64), np.dtype(np.float32))   # what set_input converts to the program's dtype


def capture(tape: Tape, loss: Var, backend: Literal["numpy", "native", "cupy"] = "numpy",
            dtype: DTypeLike = "float64", fuse: Union[bool, Literal["libm"]] = True,
            ordered: Optional[bool] = None, verify: bool = True,
            memory: Literal["keep", "reuse"] = "keep") -> Program:
    """Freeze the tape's episode ``[0, len(tape))`` with ``loss`` as the backward seed into a Program.

    Exactness: the NumPy replay is bit-identical to the eager tape (same rules, same order). The native
    replay is bit-identical for the registry's "exact" and "order" ops (its reductions follow NumPy's
    order) and within a few ulp for "libm" and "blas" ops (see ``tests/test_native.py``).

    Args:
        tape: The tape holding the episode.
        loss: A one-element Var of ``tape``: the backward seed.
        backend: "numpy" (the reference replay, bit-identical to the tape), "native" (generated C
            compiled by the system compiler) or "cupy" (the program's CUDA source on an NVIDIA GPU,
            ``tapegrad.gpu``; needs CuPy and a device).
        dtype: The program's element type: "float32" runs in float32 while the tape stays float64
            (tested bound: MLP losses and parameters after 5 Adam steps within 1e-5 relative of the
            float64 tape).
        fuse: (native) Fuse runs of row-local elementwise nodes into one loop (bit-identical to
            unfused); "libm" fuses the libm-tier ops too.
        ordered: Run matmul and sums in ordered mode (``tapegrad.ordered``: serial index-order sums,
            no FMA), so every backend reproduces an ordered tape bit for bit; None: the tape's mode.
        verify: (native, cupy) Check the compiled program against the NumPy reference on its first
            run (``tapegrad.verify``): here when every input has a value, else on the first
            forward, backward or episode; and the first optimizer step after each ``attach``. Each
            node's value and gradient is recomputed by the NumPy rules from the program's own inputs
            and compared within the op's tier. Ignored for "numpy", the reference itself.
        memory: (native) "keep": a value and a gradient buffer per node, each readable after a run.
            "reuse": once the first run is verified, the buffers of intermediate nodes are assigned by
            liveness (a value or gradient shares its bytes with others no segment uses while it is
            alive), as XLA assigns buffers; parameters, inputs, the loss and parameter gradients keep
            their own. ``value``/``grad`` of an intermediate node then raise, and each ``backward``
            needs its ``forward`` (``episode`` runs both). Ignored for "numpy" and "cupy".

    Returns:
        The program, with its own copies of parameters and constants.

    Raises:
        ConfigError: If ``backend`` is unknown.
        DTypeError: If ``dtype`` is not float32 or float64.
        ShapeError: If ``loss`` has more than one element.
        ForeignVarError: If ``loss`` is not a live Var of ``tape``.
        BuildError: If the native program cannot be compiled or loaded.
        VerificationError: If the first run differs from the NumPy reference beyond an op's tier
            (no program is returned; a failed step is undone).

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> w = tape.param(np.array([[1.0], [2.0]]))
        >>> x = tape.const(np.array([[1.0, 1.0]]))
        >>> program = tg.capture(tape, ((x @ w) * (x @ w)).mean())
        >>> float(program.forward()), program.backend
        (9.0, 'numpy')
    """
    if backend not in BACKENDS:
        raise ConfigError(f"capture: backend must be one of {BACKENDS}, got {backend!r}")
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
        raise DTypeError(f"capture: dtype must be float64 or float32, got {dt}")
    if memory not in ("keep", "reuse"):
        raise ConfigError(f"capture: memory must be 'keep' or 'reuse', got {memory!r}")
    ordered = getattr(tape, "ordered", False) if ordered is None else bool(ordered)
    prog = Program(tape, loss, backend, dt, fuse if fuse == "libm" else bool(fuse), ordered)
    prog.memory = memory if backend == "native" else "keep"
    if verify and backend != "numpy":
        prog._arm_verification()
    elif prog.memory == "reuse":
        prog.runner.compact()
    return prog


class _Opt:
    """An attached optimizer's configuration and state inside a program (moments are program buffers)."""

    def __init__(self, optimizer, prog):
        self.kind = optimizer.kind
        self.conf = copy.copy(optimizer)      # its step_scalars(count) computes the per-step host scalars
        self.conf.params, self.conf.tape = [], None
        self.lr, self.clip, self.clip_mode = optimizer.lr, optimizer.clip, optimizer.clip_mode
        self.l2 = list(optimizer.l2)
        self.wd = list(optimizer.wd)
        self.moments = optimizer.moments   # Adam's mu and nu; momentum SGD's trace, kept as mu
        self.ids = [v.id for v in optimizer.params]
        self.count = optimizer.count
        self.touched = [i in prog.reached_params for i in self.ids]
        # the program's whole parameter slab in registration order: moments laid out like it
        self.whole = self.ids == prog.params
        self.mslab = self.nslab = None
        self.mu, self.nu = [], []
        saved = optimizer.state_dict()
        for key in ("mu", "nu")[:self.moments]:
            if self.whole:
                slab, views, _ = slab_views([prog.shapes[i] for i in self.ids], prog.dtype)
                for have, a in zip(views, saved[key]):
                    np.copyto(have, a, casting="unsafe")
            else:
                slab, views = None, [aligned_copy(a, prog.dtype) for a in saved[key]]
            setattr(self, key, views)
            setattr(self, key[0] + "slab", slab)

    def state_arrays(self):
        """The moment arrays in the episode's operand order: mu_0, nu_0, mu_1, … (Adam), trace_0, … (SGD)."""
        return [a for arrays in zip(*[getattr(self, key) for key in ("mu", "nu")[:self.moments]]) for a in arrays]

    def config_key(self):
        c = self.conf
        extra = (c.b1, c.b2, c.eps, c.eps_mode) if self.kind == "Adam" else (c.momentum, c.nesterov)
        return (self.kind, self.lr, self.clip, self.clip_mode, tuple(self.l2), tuple(self.wd), tuple(self.ids)) + extra


def _one_at_a_time(method):
    """A program owns one set of buffers: its running and state methods take its lock, so calls from
    several threads run one after another instead of interleaving their writes."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Program:
    """A captured episode: the node table, shapes, buffers, and a backend that replays them.

    Build one with ``tapegrad.capture`` (not by hand). Inputs (constants, lazy constants,
    parameters) take fresh values with ``set_input``; ``forward``/``backward``/``step``/``episode``
    run the backend; ``value``/``grad``/``loss`` read results as read-only views (no copies) that the
    next run overwrites. A program owns one set of buffers.

    Calls from several threads run one at a time (``episode(inputs)`` sets its inputs and runs as one
    call); views read between calls (``loss``, ``value``, ``grad``) are only as current as the caller's
    own locking makes them.

    Attributes:
        backend: "numpy", "native" or "cupy".
        dtype: The program's element type.
        param_names: Every parameter's name in registration order: its tape name, else
            ``param_<k>``.
        verified: What verification on first run has checked so far (``"values"``,
            ``"gradients"``, ``"step"``; empty for ``verify=False`` and for "numpy", the reference
            itself).
    """

    def __init__(self, tape, loss, backend, dtype, fuse, ordered=False):
        self.loss_id = tape._index(loss, "capture", "loss")
        shapes = [nd.shape for nd in tape._nodes]  # known even where the tape holds no value
        if math.prod(shapes[self.loss_id]) != 1:
            raise ShapeError(f"{at('capture', self.loss_id)}: expected a scalar loss (one element), got shape "
                             f"{shapes[self.loss_id]}")
        self.backend, self.dtype, self.fuse = backend, dtype, fuse
        self.memory = "keep"   # capture(memory=) sets it
        self._lock = threading.RLock()   # see _one_at_a_time
        self._tape = weakref.ref(tape)
        n = len(tape)
        self.ordered = ordered
        if ordered:
            from .ordered import order_of
            self.nodes = [(order_of(nd.op), nd.a, nd.b, nd.s) for nd in tape._nodes]
        else:
            from .ordered import DEFAULT
            self.nodes = [(DEFAULT.get(nd.op, nd.op), nd.a, nd.b, nd.s) for nd in tape._nodes]
        self.third = [nd.c for nd in tape._nodes]   # the data input of 3-input ops (where, scatters), else -1
        self.epochs = [nd.epoch for nd in tape._nodes]
        self.shapes = shapes
        self.req = [nd.req for nd in tape._nodes]
        self.compute = [k for k in range(n) if self.nodes[k][0].arity]
        self.params = [k for k in range(n) if self.nodes[k][0] is O.param]
        self.consts = [k for k in range(n) if self.nodes[k][0] is O.const]
        named = {v.id: name for name, v in tape.names().items()}
        # every parameter's name, in registration order: its tape name, else param_<k>
        self.param_names = [named.get(i, f"param_{k}") for k, i in enumerate(self.params)]
        self._by_name = dict(zip(self.param_names, self.params))
        self.data = [k for k in range(n) if self.nodes[k][0] is O.data]
        # who reads each data slot: set_input re-runs their ``check`` on new values
        self.readers = {k: [j for j in self.compute if k in (self.nodes[j][1], self.nodes[j][2], self.third[j])]
                        for k in self.data}
        self.val = [None] * n
        self.missing = set()
        # parameters and their gradients side by side, as on the tape, so an optimizer updates them all
        # with one call per ufunc
        self.pslab, pviews, self.pspans = slab_views([self.shapes[k] for k in self.params], dtype)
        self.gslab, gviews, _ = slab_views([self.shapes[k] for k in self.params], dtype)
        for k, view in zip(self.params, pviews):
            np.copyto(view, tape._val[k], casting="unsafe")
            self.val[k] = view
        for k in range(n):
            v = tape._val[k]
            if self.val[k] is not None:
                continue
            if self.nodes[k][0] is O.data:
                self.val[k] = aligned_copy(v, v.dtype)
            elif self.nodes[k][0].arity == 0:
                if v is None:
                    self.val[k] = aligned_empty(self.shapes[k], dtype)
                    self.val[k].fill(0.0)
                    self.missing.add(k)
                else:
                    self.val[k] = aligned_copy(v, dtype)
            else:
                self.val[k] = aligned_empty(self.shapes[k], dtype)
        self._schedule()
        self.grads = [aligned_empty(self.shapes[k], dtype) if k in self.reached else None for k in range(n)]
        for k, view in zip(self.params, gviews):
            if k in self.reached:
                self.grads[k] = view
        self._zeros = {}
        self.opt = None
        # verification on first run (tapegrad.verify): what is still to check, and what has been
        self.verify = False
        self._unverified = self._unverified_step = False
        self.verified: set[str] = set()
        if backend == "numpy":
            from .replay import NumpyRunner
            self.runner = NumpyRunner(self)
        elif backend == "cupy":
            from .gpu.runner import CupyRunner
            self.runner = CupyRunner(self)
        else:
            from .native.runner import NativeRunner
            self.runner = NativeRunner(self)

    def _schedule(self):
        """The static reverse sweep: which nodes backward reaches, and which contribution comes first.

        Mirrors ``Tape._sweep``: node k is visited when a gradient reached it; its inputs with ``req``
        receive ``da``/``db`` (da first); the first contribution a buffer receives is copied, later
        ones are added.
        """
        nodes, req = self.nodes, self.req
        reached = {self.loss_id}
        seen = set()
        sched = []
        for k in range(self.loss_id, -1, -1):
            if k not in reached:
                continue
            op, a, b, s = nodes[k]
            if not op.arity:
                continue
            ta = req[a]
            tb = b >= 0 and req[b]
            fa = fb = False
            if ta:
                fa = a not in seen
                seen.add(a)
                reached.add(a)
            if tb:
                fb = b not in seen
                seen.add(b)
                reached.add(b)
            sched.append((k, ta, fa, tb, fb))
        self.reached = reached
        self.sched = sched
        self.reached_params = {k for k in self.params if k in reached}

    def _arm_verification(self):
        """Check the first run against the NumPy reference: now if every input has a value."""
        self.verify = self._unverified = True
        if not self.missing:
            self._first_run()

    def _first_run(self):
        """The backend's forward and backward, checked node by node (raises VerificationError)."""
        from .verify import check_run
        check_run(self)
        self._unverified = False
        self.verified |= {"values", "gradients"}
        if self.memory == "reuse":   # checked node by node in buffers of their own: now by liveness
            self.runner.compact()

    def _run_step(self, run):
        """``run`` (the runner's step or episode), its first time after ``attach`` checked."""
        if not self._unverified_step:
            run()
            return
        from .verify import checked_step
        checked_step(self, run)
        self._unverified_step = False
        self.verified.add("step")

    # ── slots ────────────────────────────────────────────────────────────────

    def _slot(self, var, what):
        if isinstance(var, str):
            i = self._by_name.get(var)
            if i is None:
                raise ForeignVarError(f"{what}: the program has no parameter named {var!r}; its parameters are "
                                      f"{self.param_names}")
            return i
        if type(var) is not Var:
            raise TypeError(f"{what}: expected a Var of the captured tape or a parameter name, got "
                            f"{type(var).__name__}")
        i = var.id
        if var.tape is not self._tape() or not 0 <= i < len(self.nodes) or var.epoch != self.epochs[i]:
            raise ForeignVarError(f"{at(what, i)}: this Var is not a node of the captured episode (another tape, "
                                  f"or created after the capture); pass the Vars the captured episode used")
        return i

    def _label(self, i):
        """``param 'W1' node 3`` (named parameters) or ``const node 5``: how messages name a slot."""
        op = self.nodes[i][0].name
        return f"{op} {self.param_names[self.params.index(i)]!r} node {i}" if op == "param" else f"{op} node {i}"

    @_one_at_a_time
    def set_input(self, var: Slot, array: ArrayLike) -> None:
        """Fresh values for a constant (a minibatch, a lazy constant) or a parameter; copied in.

        A failing call leaves the program unchanged.

        Args:
            var: A Var of the captured episode, or a parameter's name (``tape.param(..., name=)``).
            array: The values, of the captured shape: float32 or float64 data (converted to the
                program's dtype); for a data slot, integer indices or a bool mask, checked by the
                ops that read it (indices in range).

        Raises:
            ForeignVarError: If ``var`` is not a node of the captured episode, or no parameter has
                that name.
            TypeError: If ``var`` is neither a Var nor a name.
            TapeError: If ``var`` is a computed node, not a constant or parameter.
            DTypeError: If ``array``'s dtype does not fit the slot.
            ShapeError: If ``array``'s shape differs from the captured one, or data indices are out
                of range.
        """
        self._put(*self._input(var, array))

    def _input(self, var, array):
        """``(slot, value)`` for ``set_input`` after every check; nothing is written yet."""
        i = self._slot(var, "set_input")
        op = self.nodes[i][0]
        if op.arity:
            raise TapeError(f"{at('set_input', i)}: expected a const or param slot, got a {op.name} node (its "
                            f"value is computed by the program)")
        a = np.asarray(array)
        if op is O.data:
            return i, self._checked_data(i, a)
        if a.dtype not in _FLOATS:
            raise DTypeError(f"{at('set_input', i)}: expected float64 or float32 data for {self._label(i)} "
                             f"(program dtype {self.dtype}), got {a.dtype}; convert with .astype(np.float64)")
        if a.shape != self.shapes[i]:
            raise ShapeError(f"{at('set_input', i)}: expected shape {self.shapes[i]} for {self._label(i)}, "
                             f"got {a.shape}; a program is static: every episode has the captured shapes")
        return i, a

    def _put(self, i, value):
        self.val[i][...] = value   # casts like np.copyto(casting="unsafe"), without its dispatch
        self.missing.discard(i)
        if self.backend == "cupy":
            self.runner.input_changed(i)

    def _checked_data(self, i, a):
        have = self.val[i]
        kind = "bool" if have.dtype.kind == "b" else "integer"
        if (a.dtype.kind == "b") != (kind == "bool") or a.dtype.kind not in "biu":
            raise DTypeError(f"{at('set_input', i)}: expected {kind} data for data node {i}, got {a.dtype}")
        if a.shape != have.shape:
            raise ShapeError(f"{at('set_input', i)}: expected shape {have.shape} for data node {i}, got {a.shape}; "
                             f"a program is static: every episode has the captured shapes")
        new = a.astype(have.dtype)
        if kind == "integer" and not np.array_equal(new, a):
            raise DTypeError(f"{at('set_input', i)}: integer data for node {i} does not fit int64")
        for j in self.readers[i]:
            op, x, y, s = self.nodes[j]
            vals = [new if k == i else self.val[k] if k >= 0 else None for k in (x, y, self.third[j])]
            if op.check is not None:
                try:
                    op.check(vals[0], vals[1], s, *vals[2:op.arity])
                except O.Bad as e:
                    raise ShapeError(f"{at('set_input', i)}: data node {i} does not fit {op.name} (node {j}): {e}") \
                        from None
        return new

    def _ready(self, what):
        if self.missing:
            ids = sorted(self.missing)
            raise LazyValueError(f"{at(what, ids[0])}: lazy constant node(s) {ids} have no values yet; give "
                                 f"each one with program.set_input(var, array) before running")

    # ── running ──────────────────────────────────────────────────────────────

    @_one_at_a_time
    def forward(self) -> np.ndarray:
        """Recompute every node's value.

        Returns:
            The loss: a read-only view of one element.

        Raises:
            LazyValueError: If a lazy constant has no value yet (``set_input`` gives it).
            VerificationError: If the first run differs from the NumPy reference beyond an op's tier.
        """
        self._ready("forward")
        if self._unverified:
            self._first_run()   # forward and backward
        else:
            self.runner.forward()
        return self.loss()

    @_one_at_a_time
    def backward(self) -> None:
        """Gradients of the loss w.r.t. every node backward reaches, overwriting the last ones.

        As one tape backward per episode: gradients do not accumulate across calls.

        Raises:
            LazyValueError: If a lazy constant has no value yet.
            VerificationError: If the first run differs from the NumPy reference beyond an op's tier.
        """
        self._ready("backward")
        if self._unverified:
            self._first_run()
        else:
            self.runner.backward()

    @_one_at_a_time
    def attach(self, optimizer: Optimizer) -> None:
        """Run ``optimizer``'s update inside the program: its configuration and state are copied in.

        The tape optimizer is left untouched; read the program's state back with ``optimizer_state``
        or ``sync_params(tape, optimizer)``.

        Args:
            optimizer: An ``SGD`` or ``Adam`` whose parameters are parameters of the captured episode.

        Raises:
            TapeError: If the optimizer is of another kind, or (on "cupy") uses momentum or weight
                decay.
            ForeignVarError: If the optimizer serves another tape, or one of its parameters is not
                in the captured episode.
        """
        if optimizer.kind not in ("SGD", "Adam"):
            raise TapeError(f"attach: unsupported optimizer {type(optimizer).__name__}")
        if optimizer.tape is not None and optimizer.tape is not self._tape():
            raise ForeignVarError("attach: the optimizer serves another tape than the captured one")
        for v in optimizer.params:
            self._slot(v, "attach")
        if self.backend == "cupy" and (any(optimizer.wd) or getattr(optimizer, "momentum", 0.0)):
            raise TapeError(f"attach: the cupy backend runs plain SGD and Adam; {optimizer.kind}'s "
                            f"{'weight decay' if any(optimizer.wd) else 'momentum'} runs on 'native' and 'numpy'")
        self.opt = _Opt(optimizer, self)
        self.runner.attached()
        self._unverified_step = self.verify
        for hook in self.__dict__.get("_attach_hooks", ()):   # e.g. interop re-points its FFI table entry
            hook(self)

    @_one_at_a_time
    def step(self) -> None:
        """One optimizer update of the program's parameters from the program's gradients.

        Raises:
            TapeError: If no optimizer is attached.
            VerificationError: If the first step after ``attach`` differs from the NumPy reference
                (the step is undone).
        """
        if self.opt is None:
            raise TapeError("step: no optimizer attached; call program.attach(optimizer) first")
        self._run_step(self.runner.step)

    @_one_at_a_time
    def episode(self, inputs: Optional[Mapping[Var, ArrayLike]] = None) -> float:
        """Set ``inputs``, then forward, backward and (when attached) the optimizer step in one backend call.

        Args:
            inputs: ``{Var: array}``, as ``set_input`` takes them. Every input is checked before any
                is written: a bad one raises and leaves the program as it was.

        Returns:
            The loss as a Python float.

        Raises:
            ForeignVarError: If an input's Var is not a node of the captured episode.
            DTypeError: If an input's dtype does not fit its slot.
            ShapeError: If an input's shape differs from the captured one.
            LazyValueError: If a lazy constant still has no value.
            VerificationError: If the first run or step differs from the NumPy reference.
        """
        if inputs:
            for i, value in [self._input(var, array) for var, array in inputs.items()]:
                self._put(i, value)
        self._ready("episode")
        if self._unverified:
            self._first_run()
        if self.opt is not None and self._unverified_step:
            self._run_step(self.runner.episode)
        else:
            self.runner.episode()
        if self.backend == "cupy":
            return self.runner.loss_value()
        return self.val[self.loss_id].item()   # the loss has one element; item() gives a Python float

    # ── reading ──────────────────────────────────────────────────────────────

    def loss(self) -> np.ndarray:
        """The loss value of the last forward.

        Returns:
            A read-only view of one element (a CuPy array on "cupy").
        """
        if self.backend == "cupy":
            return self.runner.device_array(self.loss_id)
        return readonly(self.val[self.loss_id])

    def value(self, var: Slot) -> np.ndarray:
        """A read-only view of a node's value in the program.

        A value a fused native loop kept in a local is rebuilt from the stored ones by NumPy's rules
        (exact-tier ops only, so the loop's own bits).

        Args:
            var: A Var of the captured episode, or a parameter's name.

        Returns:
            The value, read-only (a CuPy array on "cupy"); the next run overwrites it.

        Raises:
            ForeignVarError: If ``var`` is not a node of the captured episode, or no parameter has
                that name.
            TypeError: If ``var`` is neither a Var nor a name.
        """
        if self.backend == "cupy":
            return self.runner.device_array(self._slot(var, "value"))
        return readonly(self._held(self._slot(var, "value"), "v"))

    def grad(self, var: Slot) -> np.ndarray:
        """A read-only view of d loss/d var.

        A gradient a fused native loop kept in a local is rebuilt as ``value`` rebuilds values.

        Args:
            var: A Var of the captured episode, or a parameter's name.

        Returns:
            The gradient, read-only (a CuPy array on "cupy"); zeros for a node backward does not
            reach.

        Raises:
            ForeignVarError: If ``var`` is not a node of the captured episode, or no parameter has
                that name.
            TypeError: If ``var`` is neither a Var nor a name.
        """
        i = self._slot(var, "grad")
        if self.backend == "cupy":
            return self.runner.device_array(i, "g")
        return readonly(self._held(i, "g"))

    def _held(self, i, kind):
        """A native program's buffer of node i, or (held only in a fused loop's local) its rebuilt bits."""
        if (kind, i) in getattr(self.runner, "freed", ()):   # compact() frees fused locals too
            raise TapeError(f"{'value' if kind == 'v' else 'grad'}: {at(self.nodes[i][0].name, i)} is an "
                            f"intermediate node of a program that reuses buffers by liveness "
                            f"(capture(..., memory='reuse')): its bytes hold a later node's by now; capture "
                            f"with memory='keep' to read intermediate values and gradients")
        if (kind, i) in getattr(self.runner, "registers", ()):
            from .verify import rebuilt
            return rebuilt(self, kind, i)
        return self.val[i] if kind == "v" else self.grad_buf(i)

    def grad_buf(self, i: int) -> np.ndarray:
        """The gradient buffer of node ``i`` (the backends write into it), writable.

        Args:
            i: A node id of the captured episode.

        Returns:
            The buffer; for a node backward does not reach, a shared buffer of zeros.
        """
        g = self.grads[i]
        if g is None:
            key = self.shapes[i]
            g = self._zeros.get(key)
            if g is None:
                g = self._zeros[key] = aligned_empty(key, self.dtype)
                g.fill(0.0)
        return g

    @_one_at_a_time
    def sync_params(self, tape: Tape, optimizer: Optional[Optimizer] = None) -> None:
        """Write the program's parameters back into the tape, and its optimizer's state into ``optimizer``.

        Every target is checked before anything is written.

        Args:
            tape: The tape the program was captured from.
            optimizer: The tape optimizer the program's attached one was copied from, or None.

        Raises:
            ForeignVarError: If ``tape`` is another tape, a captured parameter is no longer on it
                (``reset_to`` dropped it), or the optimizer serves another tape.
            TapeError: If ``optimizer`` is not the one attached (kind or parameters differ).
        """
        if tape is not self._tape():
            raise ForeignVarError("sync_params: not the tape this program was captured from")
        if self.backend == "cupy":
            self.runner.download()
        for k in self.params:   # every target checked before anything is written
            nd = tape._nodes[k] if k < len(tape) else None
            if nd is None or nd.op is not O.param or nd.epoch != self.epochs[k] or nd.shape != self.shapes[k]:
                raise ForeignVarError(f"{at('sync_params', k)}: the captured parameter node {k} {self.shapes[k]} is no "
                                      f"longer on the tape (reset_to dropped it; node {k} is now "
                                      f"{'absent' if nd is None else f'a {nd.op.name} {nd.shape}'}); sync before "
                                      f"resetting past the capture")
        if optimizer is not None:
            if optimizer.tape is not None and optimizer.tape is not tape:
                raise ForeignVarError("sync_params: the optimizer serves another tape")
            optimizer.check_params("sync_params")
            if self.opt is None or [v.id for v in optimizer.params] != self.opt.ids or optimizer.kind != self.opt.kind:
                raise TapeError(f"sync_params: the optimizer ({optimizer.kind}, parameters "
                                f"{[v.id for v in optimizer.params]}) is not the one attached to the program "
                                f"({None if self.opt is None else (self.opt.kind, self.opt.ids)})")
            state = self.optimizer_state()
            optimizer.load_state_dict(state)
        for k in self.params:
            if tape._val[k] is not None:
                np.copyto(tape._val[k], self.val[k], casting="unsafe")

    @_one_at_a_time
    def optimizer_state(self) -> dict[str, Any]:
        """The attached optimizer's state, in the form of the tape optimizer's ``state_dict``.

        Returns:
            ``{"count": int, "mu": [...], "nu": [...]}``: copies of Adam's moments, or momentum
            SGD's trace as ``mu``.

        Raises:
            TapeError: If no optimizer is attached.
        """
        if self.opt is None:
            raise TapeError("optimizer_state: no optimizer attached")
        self.runner.pull_count()
        st = {"count": self.opt.count}
        for key in ("mu", "nu")[:self.opt.moments]:
            st[key] = [m.copy() for m in getattr(self.opt, key)]
        return st

    @_one_at_a_time
    def load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """Restore ``optimizer_state()`` output (e.g. from a checkpoint); checked before anything changes.

        Args:
            state: ``{"count": int, "mu": [...], "nu": [...]}`` with one array per attached parameter.

        Raises:
            TapeError: If no optimizer is attached, ``count`` is not a non-negative int, or an array
                list is missing or of the wrong length.
            ShapeError: If an array has the wrong shape.
        """
        o = self.opt
        if o is None:
            raise TapeError("load_optimizer_state: no optimizer attached")
        count = state.get("count")
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise TapeError(f"load_optimizer_state: count must be a non-negative int, got {count!r}")
        if o.moments:
            for key in ("mu", "nu")[:o.moments]:
                arrays = state.get(key)
                if arrays is None or len(arrays) != len(o.ids):
                    raise TapeError(f"load_optimizer_state: expected {len(o.ids)} '{key}' arrays")
                for k, a in enumerate(arrays):
                    if np.shape(a) != self.shapes[o.ids[k]]:
                        raise ShapeError(f"load_optimizer_state: {key}[{k}] ({self._label(o.ids[k])}) must have shape "
                                         f"{self.shapes[o.ids[k]]}, got {np.shape(a)}")
            for key in ("mu", "nu")[:o.moments]:
                for have, new in zip(getattr(o, key), state[key]):
                    np.copyto(have, new, casting="unsafe")
        o.count = int(count)
        self.runner.push_count()

    # ── identity and reports ─────────────────────────────────────────────────

    @property
    def hash64(self) -> int:
        """A content hash of the program (graph, shapes, dtype, loss, optimizer config), stable across runs."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((str(self.dtype), self.loss_id)).encode())
        for (op, a, b, s), c, shape in zip(self.nodes, self.third, self.shapes):
            h.update(repr((op.name, a, b, s, shape) + ((c,) if c >= 0 else ())).encode())
        if self.opt is not None:
            h.update(repr(self.opt.config_key()).encode())
        return int.from_bytes(h.digest(), "little")

    def plan(self) -> Any:
        """The execution plan: segments (fused runs and single nodes) and kernel counts (native).

        Returns:
            A dict: the backend, its segments and the forward and backward kernel counts (on
            "native" before and after fusion, and whether anything fused).
        """
        return self.runner.plan()

    def native_abi(self) -> dict[str, Any]:
        """Raw pointers for a C caller; see ``tapegrad.native.runner``.

        Returns:
            A dict of the native program's entry points (``forward``, ``backward``, ``episode``,
            ``step``) and its buffers' addresses and shapes (``params``, ``inputs``, ``grads``,
            ``loss``, ``opt_state``, ...).

        Raises:
            TapeError: If the backend is not "native".
            VerificationError: If the program was never run and its first run fails verification.
        """
        if self.backend != "native":
            raise TapeError("native_abi: only a native program has one (capture with backend='native')")
        if self._unverified and not self.missing:
            self._first_run()   # a C caller's runs bypass the program's own first-run check
        return self.runner.abi()

    def __repr__(self):
        return (f"<Program {self.backend} {self.dtype} nodes={len(self.nodes)} params={len(self.params)} "
                f"consts={len(self.consts)} loss=node {self.loss_id}>")


