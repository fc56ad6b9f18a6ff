"""Optimizers over tape parameters: SGD (with momentum) and Adam (with decoupled weight decay), per-parameter
L2, global-norm clipping.

An optimizer is a small transform with explicit state (``count``, ``mu``, ``nu``). Each step:

1. ``g = grad + l2 · w`` for every parameter backward touched since the last reset (untouched
   parameters are skipped entirely, PyTorch's rule, and keep their moments);
2. with ``clip=maxn``: one global L2 norm over those ``g`` in registration order, then a rescale in
   the rounding of ``clip_mode`` — "optax": ``(g / norm) · maxn`` unless ``norm < maxn`` (as optax's
   ``clip_by_global_norm``: a NaN norm makes every ``g`` NaN, an infinite one makes finite elements 0 and
   infinite ones NaN); "seed": ``g · (maxn / norm)`` when ``norm > maxn`` (a NaN norm clips nothing);
   "torch": ``g · (maxn / (norm + 1e-6))`` unless that factor is 1 or more (as PyTorch's
   ``clip_grad_norm_``, whose clamped factor keeps a NaN);
3. the update (SGD's momentum trace and AdamW's decoupled decay in optax's order). The arithmetic of
   one parameter lives in ``sgd_update`` / ``adam_update`` and the per-step host scalars in
   ``step_scalars(count)``, so a captured program replays the very same expressions and can never
   freeze a bias correction into its graph.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Optional

import numpy as np

from ._interrupts import signals_held
from .errors import ConfigError, ForeignVarError, TapeError

if TYPE_CHECKING:
    from .tape import Tape, Var

ClipMode = Literal["optax", "seed", "torch"]

CLIP_MODES = ("optax", "seed", "torch")
HOLD_FROM = 1 << 14   # updates of this many elements or more hold signals back; smaller ones undo (see step)


def l2_grad(g, w, l2, out):
    """out ← g + l2·w (optax's ``add_decayed_weights`` order)."""
    np.multiply(l2, w, out=out)
    np.add(g, out, out=out)
    return out


def sq_norm(g):
    """Σ g² of one gradient (one BLAS dot; the clip norm sums these in registration order)."""
    flat = g.reshape(-1)
    return float(np.dot(flat, flat))


def clip_scale(g, norm, maxn, mode, out):
    """Rescale ``g`` into ``out`` for the global norm ``norm`` (the caller checked that it clips)."""
    if mode == "optax":
        np.divide(g, norm, out=out)
        np.multiply(out, maxn, out=out)
    elif mode == "seed":
        np.multiply(g, maxn / norm, out=out)
    else:
        np.multiply(g, maxn / (norm + 1e-6), out=out)
    return out


def clips(norm, maxn, mode):
    """Whether ``clip_scale`` runs: written as each source writes it, so that a NaN norm goes where it goes
    there (optax selects ``g`` only when ``norm < maxn``; PyTorch multiplies by a factor clamped to 1)."""
    if mode == "optax":
        return not norm < maxn
    if mode == "seed":
        return norm > maxn
    return not maxn / (norm + 1e-6) >= 1.0


def sgd_update(w, g, lr, t, trace=None, momentum=0.0, nesterov=False, u=None):
    """w ← w − lr·d with d = g, or with momentum (optax's ``trace``): trace ← g + m·trace and
    d = trace, or d = g + m·trace (Nesterov); ``u``: scratch of w's shape for Nesterov's d."""
    d = g
    if trace is not None:
        np.multiply(momentum, trace, out=t)
        np.add(g, t, out=trace)
        d = trace
        if nesterov:
            np.multiply(momentum, trace, out=t)
            np.add(g, t, out=u)
            d = u
    np.multiply(lr, d, out=t)
    np.subtract(w, t, out=w)


def adam_update(w, g, mu, nu, b1, b2, eps, sc, mode, t, u, wd=None):
    """One Adam update of ``w``, ``mu``, ``nu`` in place (``t``, ``u``: scratch of w's shape).

    "optax" (Algorithm 1 of Kingma & Ba, as optax computes it; PyTorch's formula is the same):
        mu ← (1−b1)·g + b1·mu;  nu ← (1−b2)·g² + b2·nu
        w  ← w + (−lr)·[(mu / (1−b1ᵗ)) / (√(nu / (1−b2ᵗ)) + eps) + wd·w]
    (``wd``: AdamW's decoupled weight decay, a scalar or one coefficient per element; None: none)
    "hat" (the seed's ε-hat form, as sklearn and TF1):
        mu ← b1·mu + (1−b1)·g;  nu ← b2·nu + (1−b2)·g²
        w  ← w − lr_t·(mu / (√nu + eps)),  lr_t = lr·√(1−b2ᵗ)/(1−b1ᵗ)
    """
    if mode == "optax":
        neg_lr, bc1, bc2 = sc
        np.multiply(1.0 - b1, g, out=t)
        np.multiply(b1, mu, out=mu)
        np.add(t, mu, out=mu)
        np.multiply(g, g, out=t)
        np.multiply(1.0 - b2, t, out=t)
        np.multiply(b2, nu, out=nu)
        np.add(t, nu, out=nu)
        np.divide(nu, bc2, out=t)
        np.sqrt(t, out=t)
        np.add(t, eps, out=t)
        np.divide(mu, bc1, out=u)
        np.divide(u, t, out=u)
        if wd is not None:
            np.multiply(wd, w, out=t)
            np.add(u, t, out=u)
        np.multiply(neg_lr, u, out=u)
        np.add(w, u, out=w)
    else:
        (lr_t,) = sc
        np.multiply(b1, mu, out=mu)
        np.multiply(1.0 - b1, g, out=t)
        np.add(mu, t, out=mu)
        np.multiply(b2, nu, out=nu)
        np.multiply(g, g, out=t)
        np.multiply(1.0 - b2, t, out=t)
        np.add(nu, t, out=nu)
        np.sqrt(nu, out=t)
        np.add(t, eps, out=t)
        np.divide(mu, t, out=t)
        np.multiply(lr_t, t, out=t)
        np.subtract(w, t, out=w)


class Unit:
    """One update call's views: a whole run of parameters, or one parameter of it."""

    def __init__(self, run, sl, members, l2, wd):
        self.w, self.g = run.w[sl], run.g[sl]
        self.state = [m[sl] for m in run.state]
        self.t, self.u, self.buf = (t[sl] for t in run.tmp)   # update scratch, and the adjusted g
        self.l2, self.wd = l2, wd
        self.members = members   # (registration index, slice of this unit) per parameter


def coefficients(n, dtype, spans, cs):
    """Per-parameter coefficients (l2, weight decay) spread over a run of ``n`` elements; None if all 0."""
    if not any(cs):
        return None
    out = np.zeros(n, dtype)
    for sp, c in zip(spans, cs):
        out[sp] = c
    return out


class Run:
    """Registered parameters that sit side by side in the tape's parameter store.

    The whole run updates with one call per ufunc on flat views (padding between parameters stays
    zero through every update, so it is bit-identical to updating each one); when some member was not
    touched, its touched neighbours update one by one through views of the same memory.
    """

    def __init__(self, store, si, lo, hi, members, offsets, sizes, l2s, wds, moments):
        self.members, self.offsets, self.sizes = members, offsets, sizes
        self.w, self.g = store.span(si, lo, hi)
        self.state = [np.zeros(hi - lo, store.dtype) for _ in range(moments)]
        self.tmp = [np.empty(hi - lo, store.dtype) for _ in range(3)]
        spans = [slice(off, off + n) for off, n in zip(offsets, sizes)]
        l2, wd = (coefficients(hi - lo, store.dtype, spans, cs) for cs in (l2s, wds))
        self.whole = Unit(self, slice(None), list(zip(members, spans)), l2, wd)
        self.singles = [Unit(self, sp, [(k, slice(None))], c or None, d or None)
                        for k, sp, c, d in zip(members, spans, l2s, wds)]

    def piece(self, a, j):
        return a[self.offsets[j]:self.offsets[j] + self.sizes[j]]


class Optimizer:
    """Shared registration, clipping and state handling; subclasses (``SGD``, ``Adam``) define the update."""
    kind: Optional[str] = None
    moments = 0
    tape: Optional[Tape]
    params: list[Var]
    l2: list[float]
    wd: list[float]
    weight_decay = 0.0
    _runs: list[Run]
    _where: list[Any]

    def __init__(self, lr: float, *, clip: Optional[float] = None, clip_mode: ClipMode = "optax") -> None:
        if clip_mode not in CLIP_MODES:
            raise ConfigError(f"{self.kind}: clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
        self.lr = _number(self.kind, "lr (the learning rate)", lr, 0.0, math.inf)
        if clip is not None:
            clip = _number(self.kind, "clip (the max global norm)", clip, 0.0, math.inf, lo_open=True)
        self.clip = clip
        self.clip_mode = clip_mode
        self.count = 0
        self.tape = None
        self.params = []
        self.l2 = []
        self.wd = []
        self._runs = []
        self._where = []   # per parameter: (run, index in run)
        self._ids = set()  # the registered parameters' node ids
        self._stale = False   # parameters were added since the runs were laid out (done on first use)
        self._drops = -1   # the tape's parameter-drop count when the parameters were last checked

    def add(self, tape: Tape, var: Var, l2: float = 0.0, wd: Optional[float] = None) -> Var:
        """Register one tape parameter with its own L2 coefficient and (Adam) weight decay.

        Args:
            tape: The tape of the parameter; one optimizer serves one tape.
            var: A parameter (``tape.param``), registered once.
            l2: The L2 coefficient: ``g + l2·w`` is the gradient the update sees (typically 0 for
                biases).
            wd: Adam's decoupled weight decay for this parameter; None: the optimizer's
                ``weight_decay``; 0 masks it out (optax's mask).

        Returns:
            ``var``.

        Raises:
            TapeError: If the optimizer serves another tape, ``var`` is not a parameter, or it is
                already registered.
            ConfigError: If ``l2`` or ``wd`` is negative or not finite, or ``wd`` is given to SGD.
            ForeignVarError: If ``var`` (or a parameter registered before) was dropped by ``reset_to``.
        """
        if self.tape is not None and tape is not self.tape:
            raise TapeError(f"{self.kind}.add: this optimizer already serves another tape")
        i = tape._index(var, f"{self.kind}.add", "var")
        l2 = _number(f"{self.kind}.add (node {i})", "l2", l2, 0.0, math.inf)
        wd = self.weight_decay if wd is None else _number(f"{self.kind}.add (node {i})", "wd", wd, 0.0, math.inf)
        if wd and self.kind != "Adam":
            raise ConfigError(f"{self.kind}.add (node {i}): wd (decoupled weight decay) is Adam's; use l2 here")
        self._checked(f"{self.kind}.add")
        if tape._nodes[i].op.name != "param":
            raise TapeError(f"{self.kind}.add (node {i}): expected a param, got a {tape._nodes[i].op.name} node")
        if i in self._ids:
            raise TapeError(f"{self.kind}.add (node {i}): parameter already registered")
        self.tape = tape
        self.params.append(var)
        self.l2.append(float(l2))
        self.wd.append(float(wd))
        self._ids.add(i)
        self._stale = True   # laid out once, when the state is first used: registering n is O(n), not O(n²)
        return var

    def _checked(self, who):
        """``check_params`` when ``reset_to`` dropped parameters since the last check (else nothing can have
        been dropped): a per-call check would make n registrations or steps O(n²)."""
        if self.tape is not None and self._drops != self.tape._params.drops:
            self.check_params(who)
            self._drops = self.tape._params.drops

    def check_params(self, who: str) -> None:
        """Check that ``reset_to`` dropped none of the registered parameters.

        A dropped parameter's slot may now hold another one: the optimizer would update the wrong
        memory.

        Args:
            who: The caller's name, for the message.

        Raises:
            ForeignVarError: If a registered parameter was dropped by ``reset_to``.
        """
        nodes = self.tape._nodes if self.tape is not None else ()
        for k, v in enumerate(self.params):
            if v.id >= len(nodes) or nodes[v.id].epoch != v.epoch:
                raise ForeignVarError(f"{who}: parameter {k} (node {v.id}) was dropped by reset_to; register "
                                      f"parameters before tape.mark() (or build a new optimizer after the reset)")

    def _layout(self):
        tape = self.tape
        homes = sorted((tape._nodes[v.id].pos, k) for k, v in enumerate(self.params))
        groups = []
        for (si, lo), k in homes:
            n = math.prod(tape._nodes[self.params[k].id].shape)
            if groups and groups[-1][0] == si and groups[-1][2] == lo:
                groups[-1][2] = lo + n + (-n % tape._params.step)
                groups[-1][3].append((k, lo, n))
            else:
                groups.append([si, lo, lo + n + (-n % tape._params.step), [(k, lo, n)]])
        self._runs, self._where = [], [None] * len(self.params)
        for si, lo, hi, members in groups:
            run = Run(tape._params, si, lo, hi, [k for k, _, _ in members], [o - lo for _, o, _ in members],
                      [n for _, _, n in members], [self.l2[k] for k, _, _ in members],
                      [self.wd[k] for k, _, _ in members], self.moments)
            self._runs.append(run)
            for j, (k, _, _) in enumerate(members):
                self._where[k] = (run, j)

    def _fresh(self):
        """Lay the runs out again after ``add``, every registered parameter's moments carried over."""
        if not self._stale:
            return
        runs, where = self._runs, self._where
        self._layout()
        for k, (run, j) in enumerate(where):
            new, nj = self._where[k]
            for have, fresh in zip(run.state, new.state):
                np.copyto(new.piece(fresh, nj), run.piece(have, j))
        self._stale = False

    def _state(self, key):
        self._fresh()
        slot = ("mu", "nu").index(key)
        out = []
        for k, v in enumerate(self.params):
            run, j = self._where[k]
            out.append(run.piece(run.state[slot], j).reshape(self.tape._nodes[v.id].shape))
        return out

    def _units(self):
        """What to update this step: whole runs where every member was touched, else single params."""
        touched, params = self.tape._touched, self.params
        units = []
        for run in self._runs:
            hit = [touched(params[k].id) for k in run.members]
            units += [run.whole] if all(hit) else [u for u, h in zip(run.singles, hit) if h]
        return units

    def step(self) -> None:
        """One update from the gradients on the tape; parameters change in place on the tape.

        Parameters backward did not touch since the last reset are skipped and keep their state.
        ``count`` advances by one. An interrupt never leaves the update half done: a large update
        holds signals back until it finishes, a small one is undone before the exception propagates.

        Raises:
            ForeignVarError: If a registered parameter was dropped by ``reset_to``.
        """
        if self.tape is None:
            return
        self._checked(f"{self.kind}.step")
        self._fresh()
        # An interrupt mid-update (Ctrl-C, or any signal handler that raises) would leave some parameters
        # stepped and others not. Holding every Python-level handler back costs a few handler swaps (about
        # 6 us); below HOLD_FROM elements copying the state first and putting it back on any exception
        # is cheaper.
        units = self._units()
        if sum(u.w.size for u in units) >= HOLD_FROM:
            signals_held(self._step, units)
        else:
            self._undoable_step(units)

    def _undoable_step(self, units):
        count, before = self.count, [(u.w.copy(), [a.copy() for a in u.state]) for u in units]
        try:
            self._step(units)
        except BaseException:   # the step had not finished: put back all it had changed
            for u, (w, state) in zip(units, before):
                np.copyto(u.w, w)
                for have, old in zip(u.state, state):
                    np.copyto(have, old)
            self.count = count
            raise

    def _step(self, units):
        sc = self.step_scalars(self.count + 1)
        work = []
        for unit in units:
            g = unit.g
            if unit.l2 is not None:
                g = l2_grad(g, unit.w, unit.l2, unit.buf)
            elif self.clip is not None:  # clipping rescales g: work on a copy, never on the tape's gradient
                np.copyto(unit.buf, g)
                g = unit.buf
            work.append((unit, g))
        if self.clip is not None and work:
            sq = sorted((k, sq_norm(g[sl])) for unit, g in work for k, sl in unit.members)
            norm = math.sqrt(sum_in_order(v for _, v in sq))
            if clips(norm, self.clip, self.clip_mode):
                for _, g in work:
                    clip_scale(g, norm, self.clip, self.clip_mode, g)
        for unit, g in work:
            self._update(unit.w, g, unit.state, sc, (unit.t, unit.u), unit.wd)
        self.count += 1

    def config(self) -> dict[str, Any]:
        """The configuration, what a checkpoint records and a program copies.

        Returns:
            ``kind``, ``lr``, ``clip``, ``clip_mode`` and the per-parameter ``l2`` and ``wd`` lists,
            plus each optimizer's own settings.
        """
        return {"kind": self.kind, "lr": self.lr, "clip": self.clip, "clip_mode": self.clip_mode,
                "l2": list(self.l2), "wd": list(self.wd)}

    def state_dict(self) -> dict[str, Any]:
        """The explicit state: ``count`` and the per-parameter moment arrays.

        Returns:
            ``{"count": int}`` plus, per moment (Adam's ``mu`` and ``nu``, momentum SGD's trace as
            ``mu``), a list of copies in registration order.
        """
        state: dict[str, Any] = {"count": self.count}
        for key in ("mu", "nu")[:self.moments]:
            state[key] = [a.copy() for a in self._state(key)] if self.params else []
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output; checks everything before changing anything.

        Args:
            state: ``{"count": int, "mu": [...], "nu": [...]}`` with one array per registered
                parameter for each moment this optimizer keeps.

        Raises:
            TapeError: If ``count`` is not a non-negative int, or an array list is missing, of the
                wrong length, or holds an array of the wrong shape.
        """
        count = state.get("count")
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise TapeError(f"{self.kind}.load_state_dict: count must be a non-negative int, got {count!r}")
        for key in ("mu", "nu")[:self.moments]:
            arrays = state.get(key)
            if arrays is None or len(arrays) != len(self.params):
                raise TapeError(f"{self.kind}.load_state_dict: expected {len(self.params)} '{key}' arrays, got "
                                f"{None if arrays is None else len(arrays)}")
            for k, (have, new) in enumerate(zip(self._state(key), arrays)):
                if np.shape(new) != have.shape:
                    raise TapeError(f"{self.kind}.load_state_dict: {key}[{k}] must have shape {have.shape}, "
                                    f"got {np.shape(new)}")
        self.count = int(count)
        for key in ("mu", "nu")[:self.moments]:
            for have, new in zip(self._state(key), state[key]):
                np.copyto(have, new)

    def step_scalars(self, count: int) -> tuple[float, ...]:
        """The host scalars of step ``count`` (1-based), recomputed every step, never captured.

        Args:
            count: The step number, from 1.

        Returns:
            The scalars the update reads: none for SGD.
        """
        return ()

    def _update(self, w, g, state, sc, tmp, wd=None):
        raise NotImplementedError(f"{type(self).__name__}: an optimizer defines its update")


def _number(who, name, x, lo, hi, lo_open=False, hi_open=False):
    """``x`` as a float inside [lo, hi] (open ends where asked); ConfigError naming ``name`` otherwise."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{who}: {name} must be a real number, got {type(x).__name__} {x!r}") from None
    if not (lo < v if lo_open else lo <= v) or not (v < hi if hi_open else v <= hi) or math.isnan(v):
        want = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{who}: {name} must be a finite number in {want}, got {x!r}")
    if math.isinf(v):
        raise ConfigError(f"{who}: {name} must be finite, got {x!r}")
    return v


def sum_in_order(xs):
    total = 0.0
    for x in xs:
        total += x
    return total


class SGD(Optimizer):
    """Stochastic gradient descent: ``w ← w − lr·(grad + l2·w)``.

    With ``momentum`` m it is optax's ``sgd``: ``trace ← g + m·trace`` and ``w ← w − lr·trace``
    (``nesterov``: ``w ← w − lr·(g + m·trace)``). Register parameters with ``add``, then ``step``
    after each ``backward``.

    Args:
        lr: The learning rate, finite and >= 0.
        momentum: The trace's decay m in [0, 1]; 0: plain SGD, no state.
        nesterov: Nesterov's form of momentum (needs ``momentum > 0``).
        clip: The largest global L2 norm of the gradients of one step; None: no clipping.
        clip_mode: How a clipped gradient is rescaled: "optax" (``(g / norm)·clip``, as
            ``optax.clip_by_global_norm``), "seed" (``g·(clip / norm)``) or "torch"
            (``g·(clip / (norm + 1e-6))``, as PyTorch's ``clip_grad_norm_``).

    Raises:
        ConfigError: If a setting is out of its range, or ``nesterov`` has no momentum.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape(); w = tape.param(np.array([1.0, -2.0]))
        >>> opt = tg.SGD(0.5); _ = opt.add(tape, w)
        >>> _ = tape.backward((w * w).sum()); opt.step(); tape.value(w)
        array([0., 0.])
    """
    kind = "SGD"

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, *, clip: Optional[float] = None,
                 clip_mode: ClipMode = "optax") -> None:
        super().__init__(lr, clip=clip, clip_mode=clip_mode)
        self.momentum = _number("SGD", "momentum", momentum, 0.0, 1.0)
        if nesterov and not self.momentum:
            raise ConfigError("SGD: nesterov=True needs a momentum > 0")
        self.nesterov = bool(nesterov)
        self.moments = 1 if self.momentum else 0   # the trace, kept as "mu"

    def _update(self, w, g, state, sc, tmp, wd=None):   # wd: always None (add refuses it for SGD)
        trace = state[0] if self.moments else None
        sgd_update(w, g, self.lr, tmp[0], trace, self.momentum, self.nesterov, tmp[1])

    def config(self) -> dict[str, Any]:
        """The configuration, what a checkpoint records and a program copies.

        Returns:
            The shared entries (see ``Adam.config``), ``momentum`` and ``nesterov``.
        """
        return {**super().config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adam(Optimizer):
    """Adam with both published epsilon forms, and AdamW's decoupled weight decay.

    ``count`` advances once per ``step``, shared by all parameters (as optax); moments of skipped
    parameters stay put. Register parameters with ``add``, then ``step`` after each ``backward``.

    Args:
        lr: The learning rate, finite and >= 0.
        b1: The first moment's decay, in [0, 1).
        b2: The second moment's decay, in [0, 1).
        eps: The denominator's epsilon, > 0.
        eps_mode: "optax" (what JAX users expect: optax and PyTorch, ε added to √v̂) or "hat" (the
            ε-hat form at the end of Kingma & Ba's section 2, as sklearn and TF1:
            ``lr_t = lr·√(1−b2ᵗ)/(1−b1ᵗ)``).
        clip: The largest global L2 norm of the gradients of one step; None: no clipping.
        clip_mode: How a clipped gradient is rescaled: "optax", "seed" or "torch" (see ``SGD``).
        weight_decay: AdamW's decoupled decay (eps_mode "optax" only): ``wd·w`` is added to the Adam
            direction before the learning rate scales it, as ``optax.adamw``;
            ``add(..., wd=0.0)`` exempts a parameter (optax's mask).

    Raises:
        ConfigError: If a setting is out of its range, or ``weight_decay`` is given with
            ``eps_mode="hat"``.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape(); w = tape.param(np.array([1.0]))
        >>> opt = tg.Adam(0.1); _ = opt.add(tape, w)
        >>> _ = tape.backward((w * w).sum()); opt.step(); float(tape.value(w)[0])
        0.9000000005
    """
    kind = "Adam"
    moments = 2

    def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                 eps_mode: Literal["optax", "hat"] = "optax", clip: Optional[float] = None,
                 clip_mode: ClipMode = "optax", weight_decay: float = 0.0) -> None:
        if eps_mode not in ("optax", "hat"):
            raise ConfigError(f"Adam: eps_mode must be 'optax' or 'hat', got {eps_mode!r}")
        super().__init__(lr, clip=clip, clip_mode=clip_mode)
        # b1, b2 = 1 divide by 1 − bᵗ = 0 (every parameter becomes NaN); eps = 0 divides 0/0 at g = 0.
        self.b1 = _number("Adam", "b1", b1, 0.0, 1.0, hi_open=True)
        self.b2 = _number("Adam", "b2", b2, 0.0, 1.0, hi_open=True)
        self.eps = _number("Adam", "eps", eps, 0.0, math.inf, lo_open=True)
        self.eps_mode = eps_mode
        self.weight_decay = _number("Adam", "weight_decay", weight_decay, 0.0, math.inf)
        if self.weight_decay and eps_mode != "optax":
            raise ConfigError("Adam: weight_decay (AdamW's decoupled decay) needs eps_mode='optax'")

    @property
    def mu(self) -> list[np.ndarray]:
        """The first moments, one live view per parameter in registration order."""
        return self._state("mu")

    @property
    def nu(self) -> list[np.ndarray]:
        """The second moments, one live view per parameter in registration order."""
        return self._state("nu")

    def step_scalars(self, count: int) -> tuple[float, ...]:
        """The host scalars of step ``count`` (1-based), recomputed every step, never captured.

        Args:
            count: The step number, from 1.

        Returns:
            ``(−lr, 1 − b1ᶜᵒᵘⁿᵗ, 1 − b2ᶜᵒᵘⁿᵗ)`` for eps_mode "optax"; ``(lr_t,)`` for "hat".
        """
        bc1 = 1.0 - self.b1 ** count
        bc2 = 1.0 - self.b2 ** count
        if self.eps_mode == "optax":
            return (-self.lr, bc1, bc2)
        return (self.lr * math.sqrt(bc2) / bc1,)

    def _update(self, w, g, state, sc, tmp, wd=None):
        adam_update(w, g, state[0], state[1], self.b1, self.b2, self.eps, sc, self.eps_mode, tmp[0], tmp[1], wd)

    def config(self) -> dict[str, Any]:
        """The configuration, what a checkpoint records and a program copies.

        Returns:
            ``kind``, ``lr``, ``clip``, ``clip_mode``, the per-parameter ``l2`` and ``wd`` lists,
            ``b1``, ``b2``, ``eps`` and ``eps_mode``.
        """
        return {**super().config(), "b1": self.b1, "b2": self.b2, "eps": self.eps, "eps_mode": self.eps_mode}
