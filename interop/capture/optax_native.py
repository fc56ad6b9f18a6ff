"""Reads an optax optimizer into the native optimizer step it equals, or says why it has none.

An optax optimizer is a chain of transforms whose settings live in closures. The reader walks them
(``chain``, ``with_extra_args_support``, ``masked``) down to the transforms it knows and matches one of

    [clip_by_global_norm] + scale_by_adam + [add_decayed_weights, masked or not] + learning rate
    [clip_by_global_norm] + [trace]                                               + learning rate

where the learning rate is ``scale(−lr)`` or ``scale_by_schedule`` (an optax schedule, evaluated by
JAX every step): ``optax.adam``, ``optax.adamw`` and ``optax.sgd`` with or without momentum and
Nesterov, a schedule as their learning rate, clipping chained before them. ``train_step`` checks what
was read against optax's own update before it uses it (``_check`` there), so a misread closure is
caught, never trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .._jax import jax


@dataclass
class NativeOptim:
    """What an optax optimizer computes, in the native optimizer's terms."""
    kind: str                        # "Adam" or "SGD"
    lr: float = 0.0                  # a constant learning rate (unused with a schedule)
    schedule: Optional[Callable] = None   # count -> optax's step size (−lr) for that step
    clip: Optional[float] = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    mask: Any = None                 # None: decay every parameter; else a pytree of bools or a callable
    momentum: float = 0.0
    nesterov: bool = False

    def make(self, tg):
        """The tapegrad optimizer (parameters not yet added)."""
        lr = 0.0 if self.schedule is not None else self.lr
        if self.kind == "Adam":
            return tg.Adam(lr, self.b1, self.b2, self.eps, clip=self.clip, weight_decay=self.weight_decay)
        return tg.SGD(lr, self.momentum, self.nesterov, clip=self.clip)

    def program_key(self, params):
        """What the program runs of this optimizer: its settings (the learning rate unless a schedule,
        evaluated by JAX, feeds it) and which parameters decay. Steps with equal keys share a capture."""
        lr = None if self.schedule is not None else self.lr
        return (self.kind, lr, self.clip, self.b1, self.b2, self.eps, self.weight_decay, self.momentum,
                self.nesterov, tuple(self.decays(params)))

    def decays(self, params):
        """Per parameter leaf (in ``params``' leaf order): whether the weight decay applies."""
        leaves = jax.tree.leaves(params)
        if self.mask is None:
            return [True] * len(leaves)
        mask = self.mask(params) if callable(self.mask) else self.mask
        if jax.tree.structure(mask) != jax.tree.structure(params):
            raise Unreadable(f"add_decayed_weights' mask has the structure {jax.tree.structure(mask)}, not the "
                             f"parameters' {jax.tree.structure(params)}")
        out = []
        for m in jax.tree.leaves(mask):
            try:
                out.append(bool(np.asarray(m)))
            except (TypeError, jax.errors.ConcretizationTypeError):
                raise Unreadable(f"add_decayed_weights' mask holds {type(m).__name__}, not a bool per "
                                 f"parameter") from None
        return out


class Unreadable(Exception):
    """The optimizer has no native form; the message says which transform or setting."""


def _cells(fn):
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:   # an empty cell
            pass
    return out


def _atoms(update, mask=None):
    """The optimizer's transforms in order: [(name, settings)] with the containers flattened."""
    code = getattr(update, "__code__", None)
    if code is None:
        raise Unreadable(f"{type(update).__name__} is not an optax update function")
    name, cells = update.__qualname__.split(".<locals>")[0], _cells(update)
    if name == "chain":
        return [a for fn in cells["update_fns"] for a in _atoms(fn)]
    if name == "with_extra_args_support":
        return _atoms(cells["tx"].update)
    if name == "masked":
        inner = _atoms(cells["inner"].update)
        if [n for n, _ in inner] != ["add_decayed_weights"]:
            raise Unreadable(f"optax.masked around {[n for n, _ in inner]} (only add_decayed_weights is native)")
        return [("add_decayed_weights", {**inner[0][1], "mask": cells["mask"]})]
    if name == "identity":
        return []
    known = {"scale_by_adam": ("b1", "b2", "eps", "eps_root", "mu_dtype", "nesterov"),
             "trace": ("decay", "nesterov", "accumulator_dtype"), "scale": ("step_size",),
             "scale_by_schedule": ("step_size_fn",), "clip_by_global_norm": ("max_norm",),
             "add_decayed_weights": ("weight_decay",)}
    if name not in known or any(k not in cells for k in known[name]):
        raise Unreadable(f"optax's {name} has no native form")
    return [(name, {k: cells[k] for k in known[name]})]


def _number(what, x):
    if isinstance(x, (int, float, np.floating, np.integer)) and np.isfinite(x):
        return float(x)
    raise Unreadable(f"{what} is {type(x).__name__} {x!r}, not a number")


def read(optimizer) -> NativeOptim:
    """The native form of ``optimizer`` (raises ``Unreadable`` saying why there is none)."""
    atoms = _atoms(getattr(optimizer, "update", None))
    names = [n for n, _ in atoms]
    clip = None
    if names[:1] == ["clip_by_global_norm"]:
        clip = _number("clip_by_global_norm's max_norm", atoms[0][1]["max_norm"])
        atoms, names = atoms[1:], names[1:]
    if not names or names[-1] not in ("scale", "scale_by_schedule"):
        raise Unreadable(f"the chain {names} does not end in a learning rate (scale or scale_by_schedule)")
    lr_name, lr_cfg = atoms[-1]
    body, names = atoms[:-1], names[:-1]
    if lr_name == "scale":
        spec = dict(lr=-_number("the learning rate", lr_cfg["step_size"]))
        if spec["lr"] < 0:
            raise Unreadable(f"the step size {lr_cfg['step_size']!r} ascends (a negative learning rate)")
    else:
        spec = dict(schedule=lr_cfg["step_size_fn"])
    if names[:1] == ["scale_by_adam"] and names[1:] in ([], ["add_decayed_weights"]):
        a = body[0][1]
        if a["eps_root"] != 0.0 or a["mu_dtype"] is not None or a["nesterov"]:
            raise Unreadable(f"scale_by_adam with eps_root={a['eps_root']}, mu_dtype={a['mu_dtype']}, "
                             f"nesterov={a['nesterov']} (native: eps_root=0, mu_dtype=None, nesterov=False)")
        out = NativeOptim("Adam", clip=clip, b1=_number("b1", a["b1"]), b2=_number("b2", a["b2"]),
                          eps=_number("eps", a["eps"]), **spec)
        if len(body) == 2:
            out.weight_decay = _number("add_decayed_weights' weight_decay", body[1][1]["weight_decay"])
            out.mask = body[1][1].get("mask")
        return out
    if names in ([], ["trace"]):
        out = NativeOptim("SGD", clip=clip, **spec)
        if names:
            t = body[0][1]
            if t["accumulator_dtype"] is not None:
                raise Unreadable(f"trace with accumulator_dtype={t['accumulator_dtype']} (native: None)")
            out.momentum, out.nesterov = _number("trace's decay", t["decay"]), bool(t["nesterov"])
            if not out.momentum:   # optax still keeps the trace (= g) in its state; the native SGD has none
                raise Unreadable("trace with decay 0 (use optax.sgd without momentum)")
        return out
    raise Unreadable(f"the chain {names + [lr_name]} is not adam, adamw or sgd (optionally after "
                     f"clip_by_global_norm)")
