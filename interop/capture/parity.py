"""Optimizer parity: tapegrad's optimizers against the matching optax chains, step by step.

``optax_chain(opt)`` builds the optax transformation that performs the same arithmetic as a
tapegrad ``Adam(eps_mode="optax")`` or ``SGD`` (L2 → global-norm clip → Adam → scale by −lr), and
``compare_with_optax`` runs both on the *same* gradient sequence (a function of each side's own
current parameters, evaluated by NumPy on both sides) and reports the first step where the
parameters stop being bit-identical.

Known differences (measured by tests/test_oracle_optim.py):
- the bias corrections ``1 − βᵗ``: tapegrad evaluates ``β ** t`` with the C library's ``pow`` on the
  host; optax evaluates ``β ** count`` inside XLA (an integer power). Where the two round ``βᵗ``
  differently by one ulp the updates differ in the last bits;
- global-norm clipping: tapegrad sums Σg² per parameter with a BLAS dot and adds the per-parameter
  sums in registration order; optax's ``optax.tree.norm`` reduces each leaf with XLA's reduction
  order, so the norm (and everything scaled by it) can differ by an ulp from the first clipped step.
"""
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
from numpy.typing import ArrayLike

import tapegrad as tg

from .._jax import jax


def optax_chain(opt: tg.optim.Optimizer) -> Any:
    """The optax ``GradientTransformation`` matching a tapegrad optimizer's configuration.

    The chain is ``add_decayed_weights`` (L2) → ``clip_by_global_norm`` → ``scale_by_adam`` (Adam
    only) → ``scale(-lr)``, over a list of parameters in the optimizer's registration order.
    Per-parameter L2 must take at most one nonzero value (optax's ``add_decayed_weights`` has one
    coefficient); parameters with ``l2 == 0`` are masked out. SGD's ``momentum`` and Adam's
    ``weight_decay`` are not read: the chain of an optimizer using them is not its twin.

    Args:
        opt: A tapegrad ``Adam(eps_mode="optax")`` or ``SGD``; the L2 coefficients of the
            parameters registered with it are read.

    Returns:
        An ``optax.GradientTransformation`` (an ``optax.chain``).

    Raises:
        ValueError: If ``opt`` is an Adam whose ``eps_mode`` is not "optax", clips with a
            ``clip_mode`` other than "optax", or has more than one nonzero L2 coefficient.

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> chain = interop.optax_chain(tg.SGD(0.5))
        >>> updates, _ = chain.update([np.ones(2)], chain.init([np.zeros(2)]))
        >>> updates[0].tolist()
        [-0.5, -0.5]
    """
    import optax
    if isinstance(opt, tg.Adam) and opt.eps_mode != "optax":
        raise ValueError("optax_chain: only Adam(eps_mode='optax') has an optax equivalent (optax adds ε to √v̂)")
    if opt.clip is not None and opt.clip_mode != "optax":
        raise ValueError(f"optax_chain: clip_mode {opt.clip_mode!r} rounds differently from optax; use 'optax'")
    parts = []
    l2 = sorted({x for x in opt.l2 if x})
    if len(l2) > 1:
        raise ValueError(f"optax_chain: one nonzero L2 coefficient at most, got {l2}")
    if l2:
        mask = [x != 0.0 for x in opt.l2]
        parts.append(optax.add_decayed_weights(l2[0], mask=lambda params: type(params)(mask)))
    if opt.clip is not None:
        parts.append(optax.clip_by_global_norm(opt.clip))
    if isinstance(opt, tg.Adam):
        parts.append(optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps))
    parts.append(optax.scale(-opt.lr))
    return optax.chain(*parts)


@dataclass
class ParityReport:
    """What ``compare_with_optax`` found: the first step where the parameters differ, and by how much.

    Attributes:
        steps: How many steps both sides ran.
        first_diff: The 1-based step after which the parameters first differ (None: identical
            throughout).
        max_abs: The largest ``|tapegrad − optax|`` over the parameters after the last step.
        max_rel: ``max_abs`` over the largest ``|optax|`` parameter entry.
    """
    steps: int
    first_diff: Optional[int]
    max_abs: float            # max |tapegrad − optax| over parameters after the last step
    max_rel: float

    @property
    def identical(self) -> bool:
        """Whether the parameters were bit-identical after every step."""
        return self.first_diff is None


def compare_with_optax(opt: tg.optim.Optimizer, init: Sequence[ArrayLike],
                       grad_fn: Callable[[int, list[np.ndarray]], Sequence[ArrayLike]], steps: int = 100,
                       jit: bool = True) -> ParityReport:
    """Run ``opt`` on a tape and its ``optax_chain`` side by side, and compare their parameters.

    Both sides take the same gradient sequence: ``grad_fn`` evaluated by NumPy on each side's own
    current parameters. On the tape, a gradient ``G`` is injected exactly through the loss ``Σ w·G``
    (d/dw = G bit for bit). Run it with JAX's 64-bit mode on (``jax.enable_x64(True)``): with it off,
    optax's side computes in float32.

    Args:
        opt: A fresh tapegrad optimizer (no parameters registered), as ``optax_chain`` takes it; a
            list ``opt.l2`` set beforehand gives each parameter's L2 coefficient (the parameters are
            registered here).
        init: The initial parameter arrays.
        grad_fn: ``grad_fn(step, params)`` returns the gradients (NumPy arrays, one per parameter)
            at ``params``, each side's own current parameters; ``step`` counts from 0.
        steps: How many steps to run.
        jit: Whether optax's step runs inside ``jax.jit``; False runs it op by op (no XLA fusion,
            hence no FMA contraction).

    Returns:
        A ``ParityReport``.

    Raises:
        ValueError: If ``opt`` has no optax twin (see ``optax_chain``).

    Examples:
        >>> import numpy as np, jax, tapegrad as tg, interop
        >>> grad_fn = lambda step, params: [np.tanh(params[0])]
        >>> with jax.enable_x64(True):
        ...     r = interop.compare_with_optax(tg.Adam(0.01), [np.ones(3)], grad_fn,
        ...                                    steps=20, jit=False)
        >>> r.identical, r.max_abs
        (True, 0.0)
    """
    import optax
    chain = optax_chain(opt)
    tape = tg.Tape()
    ws = [tape.param(np.asarray(a, np.float64)) for a in init]
    l2 = list(opt.l2) + [0.0] * (len(ws) - len(opt.l2))
    opt.l2 = []
    for w, c in zip(ws, l2):
        opt.add(tape, w, l2=c)
    mark = tape.mark()

    def step(params, state, grads):
        updates, state = chain.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if jit:
        step = jax.jit(step)

    params = [jax.numpy.asarray(np.asarray(a, np.float64)) for a in init]
    state = chain.init(params)
    first = None
    for k in range(steps):
        gt = grad_fn(k, [np.asarray(tape.value(w)) for w in ws])
        loss: Any = None   # the sum of the terms, built term by term
        for w, g in zip(ws, gt):
            term = (w * tape.const(g)).sum()
            loss = term if loss is None else loss + term
        tape.backward(loss)
        opt.step()
        tape.reset_to(mark)
        gj = grad_fn(k, [np.asarray(p) for p in params])
        params, state = step(params, state, [jax.numpy.asarray(g) for g in gj])
        if first is None and any(not np.array_equal(tape.value(w), np.asarray(p)) for w, p in zip(ws, params)):
            first = k + 1
    diffs = [np.abs(np.asarray(tape.value(w)) - np.asarray(p)).max() for w, p in zip(ws, params)]
    scale = max(np.abs(np.asarray(p)).max() for p in params)
    return ParityReport(steps, first, float(max(diffs)), float(max(diffs) / scale))
