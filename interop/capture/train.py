"""Drop-ins for ``jax.value_and_grad`` and a jitted optax training step, running captured programs.

``value_and_grad(fn)`` stands where ``jax.value_and_grad(fn)`` stands (inside a jitted step, over a
closure, with ``has_aux``) and ``train_step(fn, params, *batch, optimizer=)`` gives a ``TrainStep``, one
jitted function for forward, backward and the optimizer's update. Both capture ``fn`` once per input
signature (``interop.capture.signatures``), so a new batch shape captures again as ``jax.jit`` traces again.
"""
import functools
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar, Union

import numpy as np

import tapegrad as tg

from .._jax import jax, jnp
from . import optax_native
from .capture import CaptureError, Captured
from ..oracle.replay import lowp_bound
from ..xla.program import program_call, program_episode
from .signatures import Signatures

State = TypeVar("State")


def _host_backend(who, backend):
    if backend == "cupy":
        raise CaptureError(f"{who}: backend='cupy' is not a backend of this call: its custom call runs on the CPU "
                           f"(backend='native' or 'numpy'). For the GPU, interop.capture_jax(fn, ..., "
                           f"backend='cupy') gives the CuPy Program of the same function")
    if backend not in ("native", "numpy"):
        raise CaptureError(f"{who}: backend must be 'native' or 'numpy', got {backend!r}")


def _grads_like(cap, grads, argnums):
    """Gradients shaped as ``jax.grad``'s for ``argnums``: one pytree per differentiated argument (an empty
    leaf's gradient is empty, as jax.grad's)."""
    full = [jnp.zeros(a.shape, a.dtype) if not np.prod(a.shape) else None for a in cap._avals]
    for i, g in zip(cap.diff, grads):
        full[i] = g
    args = jax.tree.unflatten(cap.tree, full)
    return args[argnums] if isinstance(argnums, int) else tuple(args[a] for a in argnums)


def _call_of(cap):
    """``program_call`` of a capture's program, made once per capture (and again once an optimizer is
    attached: the program's hash, which the call names, changes with it)."""
    made = cap.__dict__.get("_call")
    if made is None or made[0] != cap.program.hash64:
        made = cap._call = (cap.program.hash64, program_call(cap.program, data=True))
    return made[1]


class ValueAndGrad:
    """``jax.value_and_grad(fn, argnums, has_aux)`` run as captured programs: see ``value_and_grad``.

    Attributes:
        captured: the ``Captured`` of the latest signature traced (None before the first).
        captures: how many signatures were captured so far.
    """

    def __init__(self, fn: Callable[..., Any], argnums: Union[int, Sequence[int]], has_aux: bool, backend: str,
                 sigs: Optional[Signatures] = None):
        self._sigs = sigs if sigs is not None else Signatures(fn, argnums, has_aux, backend)
        self.argnums, self.has_aux = argnums, has_aux
        functools.update_wrapper(self, fn, updated=())

    @property
    def captured(self) -> Optional[Captured]:
        """The ``Captured`` of the latest signature traced (None before the first)."""
        return self._sigs.last

    @property
    def captures(self) -> int:
        """How many signatures were captured so far (one per new shape, dtype or setting)."""
        return self._sigs.captures

    def __call__(self, *args: Any) -> Any:
        """The value and gradients of ``fn(*args)``, as ``jax.value_and_grad`` returns them.

        Args:
            *args: ``fn``'s arguments; a new signature (shapes, dtypes, pytree structure) is captured
                on first use, as ``jax.jit`` traces. Inside ``jax.jit`` they may be tracers.

        Returns:
            ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``; ``grads`` has the form
            of the ``argnums`` arguments (a tuple when ``argnums`` is a sequence).

        Raises:
            CaptureError: ``fn`` holds a step the capture cannot follow; the message names the
                equation and why.
        """
        cap, full = self._sigs.lookup(args)
        params, inputs, data, aux = cap.operands(*full)
        call, dt = _call_of(cap), cap.program.dtype
        # a parameter of a lower dtype than the program's is cast up, and its gradient down, as JAX casts
        value, grads = jax.value_and_grad(lambda ps: call(*(p.astype(dt) for p in ps), *inputs, *data))(list(params))
        grads = _grads_like(cap, grads, self.argnums)
        if self.has_aux:
            return (value, jax.tree.unflatten(cap.aux_tree, aux)), grads
        return value, grads


def value_and_grad(fn: Callable[..., Any], *example_args: Any, argnums: Union[int, Sequence[int]] = 0,
                   has_aux: bool = False, backend: str = "native") -> ValueAndGrad:
    """A drop-in for ``jax.value_and_grad(fn, argnums, has_aux)``: forward and backward of ``fn`` as one
    custom call of its captured program, with the gradients ``jax.grad`` computes.

    Use it where ``jax.value_and_grad`` is used: inside a jitted step over a ``loss_fn`` that closes
    over the batch (closed-over traced values become operands), or jitted from outside. The first call
    with a new signature (shapes, dtypes, pytree structure, the function's jaxpr and closed-over
    values) captures ``fn`` — at trace time under ``jax.jit``, from abstract values — and later calls
    reuse it, as ``jax.jit`` reuses a trace: a last partial batch or an eval batch size captures once
    more. Custom derivative rules (``custom_jvp``, ``custom_vjp``) are followed as ``jax.grad`` follows
    them. ``vmap``-able, and usable per shard under ``shard_map`` (the gradients of replicated
    parameters come out summed over the shards, as ``jax.grad``'s do).

    Args:
        fn: returns a float scalar (with ``has_aux``: ``(scalar, aux)``).
        *example_args: optional; when given, ``fn`` is captured at them now rather than at the first call.
        argnums: the differentiated positional arguments (their float leaves), as in ``jax.grad``.
        has_aux: ``fn`` returns ``(value, aux)``; the call returns ``((value, aux), grads)``.
        backend: "native" (generated C, the default) or "numpy".

    Returns:
        A ``ValueAndGrad``: ``vg(*args) -> (value, grads)``, with ``vg.captured`` the latest capture.

    Raises:
        CaptureError: (at the call that captures) a part of ``fn`` the program cannot compute as JAX does,
            named by its equation: a step computing in bfloat16 or float16, a ``custom_vjp`` whose bwd is
            not linear in the cotangent, a primitive with no capture rule.

    >>> import jax, jax.numpy as jnp, interop
    >>> loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)
    >>> vg = interop.value_and_grad(loss, backend="numpy")
    >>> v, g = jax.jit(vg)(jnp.zeros(3), jnp.eye(3), jnp.ones(3))
    >>> float(v), [round(float(a), 6) for a in g]
    (1.0, [-0.666667, -0.666667, -0.666667])
    """
    _host_backend("value_and_grad", backend)
    vg = ValueAndGrad(fn, argnums, has_aux, backend)
    if example_args:
        vg._sigs.lookup(example_args)
    return vg


# ── the training step ────────────────────────────────────────────────────────

class TrainStep(Generic[State]):
    """A jitted training step: ``step(state, *batch) -> (loss, state)`` (``((loss, aux), state)`` with
    ``has_aux``), the state donated. Made by ``train_step``.

    Attributes:
        native_update: True when the optimizer's update runs inside the program's custom call, False when
            it runs in XLA after the gradients.
        why: why the update is not native (None when it is).
    """

    def __init__(self, run: Callable[..., Any], scan: Callable[..., Any], sigs: Signatures,
                 native_update: bool, why: Optional[str]):
        self._run, self._scan, self._sigs = run, scan, sigs
        self.native_update, self.why = native_update, why

    @property
    def captured(self) -> Optional[Captured]:
        """The ``Captured`` of the latest signature traced (a jitted step traces once per signature)."""
        return self._sigs.last

    def __call__(self, state: State, *batch: Any) -> tuple[Any, State]:
        """One training step.

        Args:
            state: ``(params, opt_state)``, donated: do not reuse it after the call.
            *batch: The batch arguments of ``fn``; a new shape (a partial last batch) is captured
                once, as ``jax.jit`` re-traces.

        Returns:
            ``(loss, state)``, or ``((loss, aux), state)`` with ``has_aux``.
        """
        return self._run(state, *batch)

    def scan(self, state: State, *batches: Any) -> tuple[State, Any]:
        """K steps, with the results of ``jax.lax.scan(step, state, batches)``.

        With a native update the K steps run as one custom call, which saves XLA's per-step dispatch.

        Args:
            state: ``(params, opt_state)``, donated.
            *batches: Every batch leaf stacked on a leading axis of K steps (K may be 0).

        Returns:
            ``(state, losses)``: losses of shape (K,), or ``(losses, auxes)`` with ``has_aux``.

        Raises:
            CaptureError: The batch leaves do not share a leading axis of K steps (the message lists
                their shapes).
        """
        return self._scan(state, *batches)


def train_step(fn: Callable[..., Any], params: Any, *example_batch: Any, optimizer: Any, backend: str = "native",
               native_update: Optional[bool] = None, has_aux: bool = False,
               axis_name: Optional[str] = None) -> tuple[TrainStep, Any]:
    """``(step, state)`` for training ``fn(params, *batch) -> loss`` with an optax optimizer.

    ``step(state, *batch) -> (loss, state)`` is jitted with the state donated; ``state = (params,
    opt_state)`` and ``opt_state`` is exactly ``optimizer.init(params)``'s (structure, dtypes, values), so
    training can switch to plain optax (or back) at any step. ``state`` holds copies of ``params`` (the
    step donates its state; the caller's arrays stay valid). A batch of a new shape (the last partial
    batch of an epoch) captures once more, as ``jax.jit`` traces once more.

    Where the optimizer has a native form — ``optax.adam``, ``optax.adamw`` (with a mask),
    ``optax.sgd`` (momentum, Nesterov), each with a constant or an optax schedule as the learning rate
    and ``clip_by_global_norm`` chained before — the whole step (forward, backward, the update) is one
    custom call of the captured program with the optimizer attached, the state updated in place; the
    schedule is evaluated by JAX each step. Anything else runs forward and backward as one custom call
    and ``optimizer.update`` in XLA. Before the native step is used, the program's gradients are checked
    against ``jax.grad`` and three native steps against optax's own update from the same state.

    Args:
        fn: ``fn(params, *batch)`` returns the loss (with ``has_aux``: ``(loss, aux)``).
        params: the initial parameters (a pytree of float32 or float64 arrays).
        *example_batch: a batch as the step will take it (arrays; integer labels and masks included).
        optimizer: an ``optax.GradientTransformation``.
        backend: "native" (the default) or "numpy".
        native_update: None (native where the optimizer has a native form), True (raise ``CaptureError``
            where it has none), False (always XLA).
        has_aux: ``fn`` returns ``(loss, aux)`` and the step ``((loss, aux), state)``: flax's ``(loss,
            logits)``, or BatchNorm's updated ``batch_stats`` (pass them in the batch, return them in aux).
        axis_name: under ``shard_map`` over a data axis of this name: the loss and gradients are averaged
            over it with ``jax.lax.pmean`` before the update (which then runs in XLA), as a data-parallel
            step written with ``jax.grad`` does.

    Returns:
        ``(step, state)``: a ``TrainStep`` and ``(params, optimizer.init(params))``.

    Raises:
        CaptureError: ``optimizer`` is not an optax optimizer; ``native_update=True`` without a native form;
            a part of ``fn`` that cannot be captured (named by its equation); a program whose gradients
            differ from ``jax.grad``'s beyond rounding (a bug to report).

    >>> import jax, jax.numpy as jnp, optax, interop
    >>> loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)
    >>> x, y = jnp.eye(3), jnp.ones(3)
    >>> step, state = interop.train_step(loss, jnp.zeros(3), x, y, optimizer=optax.sgd(0.1), backend="numpy")
    >>> value, state = step(state, x, y)
    >>> float(value), step.native_update
    (1.0, True)
    """
    _host_backend("train_step", backend)
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise CaptureError(f"train_step: optimizer must be an optax GradientTransformation (with init and "
                           f"update), got {type(optimizer).__name__} {optimizer!r}; e.g. optimizer=optax.adam(1e-3)")
    step, why, spec, attached = None, "native_update=False", None, None
    if axis_name is not None:
        why = f"data parallel over {axis_name!r}: the update follows the gradients' mean over the shards, in XLA"
        if native_update:
            raise CaptureError(f"train_step: native_update=True with axis_name={axis_name!r}: {why}")
    elif native_update is not False:
        try:
            read = optax_native.read(optimizer)
            spec, attached = read, read.program_key(params)
        except optax_native.Unreadable as e:
            why = str(e)
    # the captures carry the native optimizer's program: shared only with steps that attach the same one
    sigs = Signatures(fn, 0, has_aux, backend, who="train_step", attached=attached)
    sigs.lookup((params, *example_batch))   # the example's capture: errors surface here
    if spec is not None:
        try:
            dt = sigs.last.program.dtype
            low = sorted({str(x.dtype) for x in jax.tree.leaves(params) if np.dtype(x.dtype) != dt})
            if low:
                raise optax_native.Unreadable(f"the parameters hold {', '.join(low)} leaves where the program "
                                              f"computes in {dt} (what fn computes from them is {dt})")
            step = _native_step(fn, sigs, params, example_batch, optimizer, spec, has_aux)
            why = None
        except optax_native.Unreadable as e:
            why = str(e)
    if step is None and native_update and axis_name is None:
        raise CaptureError(f"train_step: native_update=True, but the optimizer has no native step: {why}")
    if step is None:
        step = _xla_step(sigs, optimizer, has_aux, axis_name)
    init = jax.tree.map(jnp.array, params)   # copies: the first step donates them, the caller's stay alive
    return TrainStep(*step, sigs, why is None, why), (init, optimizer.init(init))


def _xla_step(sigs, optimizer, has_aux, axis_name):
    import optax
    vg = ValueAndGrad(sigs.fn, 0, has_aux, sigs.backend, sigs)

    def step(state, *batch):
        p, opt_state = state
        out, grads = vg(p, *batch)
        if axis_name is not None:
            out, grads = jax.lax.pmean((out, grads), axis_name)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return out, (optax.apply_updates(p, updates), opt_state)

    def scan(state, *batches):
        _steps_of(batches)
        return jax.lax.scan(lambda s, b: step(s, *b)[::-1], state, batches)

    return jax.jit(step, donate_argnums=0), jax.jit(scan, donate_argnums=0)


def _episode_of(cap, spec, params):
    """The capture's program with the native optimizer attached, as a positional episode (once per capture)."""
    episode = cap.__dict__.get("_episode")
    if episode is None:
        opt = spec.make(tg)
        decays = spec.decays(params)
        for var, decay in zip(cap.param_vars, [decays[k] for k in cap.diff]):
            opt.add(cap.tape, var, wd=None if decay else 0.0)
        cap.program.attach(opt)
        episode = cap._episode = program_episode(cap.program, data=True, lr=spec.schedule is not None).positional
    return episode


def _native_step(fn, sigs, params, example_batch, optimizer, spec, has_aux):
    """The whole step as the captured program's episode, on optax's state."""
    import optax
    counted = (optax.ScaleByAdamState, optax.TraceState, optax.ScaleByScheduleState)
    is_node = lambda x: isinstance(x, counted)   # noqa: E731

    def run(state, batch, steps):
        p, opt_state = state
        first = batch if steps is None else jax.tree.map(lambda b: b[0], batch)
        cap, full = sigs.lookup((p, *first))
        dt = cap.program.dtype
        episode = _episode_of(cap, spec, p)
        leaves, ptree = jax.tree.flatten(p)
        nodes = [x for x in jax.tree.leaves(opt_state, is_leaf=is_node) if is_node(x)]
        adam = next((x for x in nodes if isinstance(x, optax.ScaleByAdamState)), None)
        trace = next((x for x in nodes if isinstance(x, optax.TraceState)), None)
        sched = next((x for x in nodes if isinstance(x, optax.ScaleByScheduleState)), None)
        kept = cap.diff   # the parameters of the program (an empty leaf is none): their moments
        moments = ([a for k in kept for a in (jax.tree.leaves(adam.mu)[k], jax.tree.leaves(adam.nu)[k])] if adam
                   else [jax.tree.leaves(trace.trace)[k] for k in kept] if trace is not None and spec.momentum
                   else [])
        count = adam.count if adam is not None else jnp.zeros((), jnp.int32)
        if steps is None:
            lr = None if sched is None else -jnp.asarray(spec.schedule(sched.count), dt)
            ops, inputs, data, aux = cap.operands(*full)
        else:   # one block per step: the schedule at each step's count, each batch's inputs and data
            lr = None if sched is None else -jnp.asarray(jax.vmap(spec.schedule)(
                sched.count + jnp.arange(steps, dtype=sched.count.dtype)), dt)
            ops = cap.params(*full)
            inputs, data, aux = jax.vmap(lambda *b: cap.operands(p, *b, ())[1:4])(*batch)
        loss, new_p, new_m, _ = episode(ops, [jnp.asarray(m, dt) for m in moments], count, inputs, data, lr,
                                        steps=steps)
        new_p = list(new_p)

        def placed(tree, new):
            out = jax.tree.leaves(tree)
            for k, m in zip(kept, new):
                out[k] = m
            return jax.tree.unflatten(jax.tree.structure(tree), out)

        def renew(x):
            if isinstance(x, optax.ScaleByAdamState):
                return x._replace(count=_advance(x.count, steps), mu=placed(x.mu, new_m[0::2]),
                                  nu=placed(x.nu, new_m[1::2]))
            if isinstance(x, optax.TraceState):
                return x._replace(trace=placed(x.trace, list(new_m)))
            if isinstance(x, optax.ScaleByScheduleState):
                return x._replace(count=_advance(x.count, steps))
            return x
        for i, k in enumerate(cap.diff):
            leaves[k] = new_p[i]
        out = (loss, jax.tree.unflatten(cap.aux_tree, aux)) if has_aux else loss
        return out, (jax.tree.unflatten(ptree, leaves), jax.tree.map(renew, opt_state, is_leaf=is_node))

    def scan(state, *batches):
        """``jax.lax.scan(step, state, batches)`` as one custom call: ``(state, losses)``."""
        steps = _steps_of(batches)
        if steps == 0:   # as lax.scan: the state unchanged, empty losses (and auxes)
            return state, _empty_outputs(sigs, state, batches)
        out, state = run(state, batches, steps)
        return state, out

    step = jax.jit(lambda state, *batch: run(state, batch, None), donate_argnums=0)
    scan_fn = jax.jit(scan, donate_argnums=0)
    # once per capture and schedule: a step made again of the same capture (the process's shared captures)
    # was checked when it was first made
    checked = sigs.last.__dict__.setdefault("_checked", [])
    if not any(s is spec.schedule for s in checked):
        _check(step, sigs, fn, params, example_batch, optimizer, has_aux)
        checked.append(spec.schedule)
    return step, scan_fn


def _empty_outputs(sigs, state, batches):
    """What ``lax.scan`` of the step returns as outputs over zero steps: empty arrays of the step's types."""
    one = jax.eval_shape(lambda s, *b: sigs.fn(s[0], *b), state, *jax.tree.map(lambda b: b[0] if b.shape[0]
                                                                                else jnp.zeros(b.shape[1:], b.dtype),
                                                                                batches))
    return jax.tree.map(lambda a: jnp.zeros((0,) + tuple(a.shape), a.dtype), one)


def _advance(count, steps):
    """optax.safe_increment applied ``steps`` times (None: once)."""
    import optax
    if steps is None:
        return optax.safe_increment(count)
    top = jnp.iinfo(count.dtype).max
    return jnp.where(count <= top - steps, count + steps, top).astype(count.dtype)


def _steps_of(batches):
    """The number of steps K in stacked batches (every leaf's leading axis), or a CaptureError."""
    leaves = jax.tree.leaves(batches)
    sizes = {tuple(jnp.shape(x))[:1] for x in leaves}
    if not leaves or len(sizes) != 1 or sizes == {()}:
        raise CaptureError(f"step.scan: every batch leaf must hold one batch per step on a shared leading axis "
                           f"of K steps (as lax.scan takes them: stack K batches with jnp.stack), got shapes "
                           f"{[tuple(jnp.shape(x)) for x in leaves]}")
    return sizes.pop()[0]


def _worst(got, want):
    """(the leaf path, max |got − want| over that leaf's scale) of the worst leaf; NaNs equal where both are."""
    worst = (None, 0.0)
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g in zip(paths, jax.tree.leaves(got)):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        same = (w == g) | (np.isnan(w) & np.isnan(g))
        scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(w), w, 0.0)), initial=0.0)))
        with np.errstate(invalid="ignore"):
            d = float(np.max(np.where(same, 0.0, np.abs(g - w)), initial=0.0)) / scale
        d = np.inf if np.isnan(d) else d
        if d > worst[1]:
            worst = (jax.tree_util.keystr(path), d)
    return worst


def _check(step, sigs, fn, params, batch, optimizer, has_aux, steps=3):
    """The program's gradients against ``jax.grad`` (a difference is a bug: CaptureError), then three native
    steps against optax's own update from the same state (a difference means the optimizer was misread: the
    update then runs in XLA)."""
    import optax
    cap, full = sigs.lookup((params, *batch))
    dt = cap.program.dtype
    tol = lowp_bound(float(np.finfo(dt).eps), 1e-12)
    grad = jax.grad(fn, has_aux=has_aux)
    want = jax.jit(grad)(params, *batch)
    ours_vg = ValueAndGrad(fn, 0, has_aux, sigs.backend, sigs)
    got = jax.jit(ours_vg)(params, *batch)[1]
    where, d = _worst(got, want[0] if has_aux else want)
    if d > tol:
        raise CaptureError(f"train_step: the captured program's gradient{where} differs from jax.grad's by {d:.3g} "
                           f"relative (bound {tol:.3g}) at the example batch; this is a tapegrad bug, please report "
                           f"it with the function (interop.check_grads(fn, params, *batch) locates the equation)")
    theirs = (jax.tree.map(jnp.array, params), optimizer.init(params))

    @jax.jit
    def reference(state):   # optax's update of the program's own gradients (rounding noise included: Adam
        p, s = state        # scales a gradient that is only noise, a bias before BatchNorm, up to the step size)
        g = ours_vg(p, *batch)[1]
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s
    # each step from optax's state, so that only the update differs: from states that differed by a rounding,
    # Adam would scale gradients that are rounding noise (a bias before BatchNorm) into differences of its size
    for k in range(steps):
        _, ours = step(jax.tree.map(jnp.array, theirs), *batch)
        theirs = reference(theirs)
        if jax.tree.structure(ours) != jax.tree.structure(theirs):
            raise optax_native.Unreadable(f"the native step's state {jax.tree.structure(ours)} is not optax's "
                                          f"{jax.tree.structure(theirs)}")
        for got_leaf, want_leaf in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            if np.asarray(got_leaf).dtype != np.asarray(want_leaf).dtype:
                raise optax_native.Unreadable(f"the native step keeps a {np.asarray(got_leaf).dtype} leaf where "
                                              f"optax keeps {np.asarray(want_leaf).dtype}")
        where, d = _worst(ours, theirs)
        if d > tol:
            raise optax_native.Unreadable(f"from the same state and gradients, step {k + 1}'s native update of "
                                          f"state{where} differs from optax's by {d:.3g} relative (bound "
                                          f"{tol:.3g}): the optimizer was misread (please report it)")
