"""Optimizers over tape parameters: SGD and Adam, per-parameter L2, global-norm clipping.

An optimizer is a small transform with explicit state (``count``, ``mu``, ``nu``). Each step:

1. ``g = grad + l2 · w`` for every parameter backward touched since the last reset (untouched
   parameters are skipped entirely, PyTorch's rule, and keep their moments);
2. with ``clip=maxn``: one global L2 norm over those ``g`` in registration order, then a rescale in
   the rounding of ``clip_mode`` — "optax": ``(g / norm) · maxn`` when ``norm >= maxn``; "seed":
   ``g · (maxn / norm)`` when ``norm > maxn``; "torch": ``g · (maxn / (norm + 1e-6))`` when that
   factor is below 1;
3. the update. The arithmetic of one parameter lives in ``sgd_update`` / ``adam_update`` and the
   per-step host scalars in ``step_scalars(count)``, so a captured program replays the very same
   expressions and can never freeze a bias correction into its graph.
"""
import math

import numpy as np

from .errors import TapeError

CLIP_MODES = ("optax", "seed", "torch")


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
    if mode == "optax":
        return norm >= maxn
    if mode == "seed":
        return norm > maxn
    return maxn / (norm + 1e-6) < 1.0


def sgd_update(w, g, lr, t):
    """w ← w − lr·g."""
    np.multiply(lr, g, out=t)
    np.subtract(w, t, out=w)


def adam_update(w, g, mu, nu, b1, b2, eps, sc, mode, t, u):
    """One Adam update of ``w``, ``mu``, ``nu`` in place (``t``, ``u``: scratch of w's shape).

    "optax" (Algorithm 1 of Kingma & Ba, as optax computes it; PyTorch's formula is the same):
        mu ← (1−b1)·g + b1·mu;  nu ← (1−b2)·g² + b2·nu
        w  ← w + (−lr)·[(mu / (1−b1ᵗ)) / (√(nu / (1−b2ᵗ)) + eps)]
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


class Optimizer:
    """Shared registration, clipping and state handling; subclasses define ``_update``."""
    kind = None

    def __init__(self, lr, *, clip=None, clip_mode="optax"):
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"{self.kind}: clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
        if clip is not None and not clip > 0:
            raise ValueError(f"{self.kind}: clip (the max global norm) must be > 0, got {clip!r}")
        self.lr = float(lr)
        self.clip = None if clip is None else float(clip)
        self.clip_mode = clip_mode
        self.count = 0
        self.tape = None
        self.params = []
        self.l2 = []

    def add(self, tape, var, l2=0.0):
        """Register one tape parameter with its own L2 coefficient (typically 0 for biases)."""
        if self.tape is not None and tape is not self.tape:
            raise TapeError(f"{self.kind}.add: this optimizer already serves another tape")
        i = tape._index(var, f"{self.kind}.add", "var")
        if tape._nodes[i].op.name != "param":
            raise TapeError(f"{self.kind}.add (node {i}): expected a param, got a {tape._nodes[i].op.name} node")
        if any(p.id == i for p in self.params):
            raise TapeError(f"{self.kind}.add (node {i}): parameter already registered")
        self.tape = tape
        self.params.append(var)
        self.l2.append(float(l2))
        self._added(tape._val[i])
        return var

    def _added(self, w):
        pass

    def grads(self):
        """(index, w, g) for every touched parameter, with L2 applied and clipping done (new arrays)."""
        tape = self.tape
        out = []
        for k, v in enumerate(self.params):
            i = v.id
            if not tape._touched(i):
                continue
            w, g = tape._val[i], tape._grad[i]
            g = l2_grad(g, w, self.l2[k], np.empty_like(g)) if self.l2[k] else g.copy()
            out.append((k, w, g))
        if self.clip is not None and out:
            norm = math.sqrt(sum_in_order(sq_norm(g) for _, _, g in out))
            if clips(norm, self.clip, self.clip_mode):
                for _, _, g in out:
                    clip_scale(g, norm, self.clip, self.clip_mode, g)
        return out

    def step(self):
        """One update from the gradients on the tape; parameters change in place on the tape."""
        if self.tape is None:
            return
        self.count += 1
        sc = self.step_scalars(self.count)
        for k, w, g in self.grads():
            self._update(k, w, g, sc)

    def config(self):
        return {"kind": self.kind, "lr": self.lr, "clip": self.clip, "clip_mode": self.clip_mode,
                "l2": list(self.l2)}

    def state_dict(self):
        """The explicit state: ``count`` and the per-parameter moment arrays (copies)."""
        return {"count": self.count}

    def load_state_dict(self, state):
        """Restore ``state_dict()`` output; validates everything before changing anything."""
        count = state.get("count")
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise TapeError(f"{self.kind}.load_state_dict: count must be a non-negative int, got {count!r}")
        self.count = int(count)

    def step_scalars(self, count):
        return ()


def sum_in_order(xs):
    total = 0.0
    for x in xs:
        total += x
    return total


class SGD(Optimizer):
    """Stochastic gradient descent: ``w ← w − lr·(grad + l2·w)``.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape(); w = tape.param(np.array([1.0, -2.0]))
    >>> opt = tg.SGD(0.5); _ = opt.add(tape, w)
    >>> _ = tape.backward((w * w).sum()); opt.step(); tape.value(w)
    array([0., 0.])
    """
    kind = "SGD"

    def _update(self, k, w, g, sc):
        sgd_update(w, g, self.lr, np.empty_like(w))


class Adam(Optimizer):
    """Adam with both published epsilon forms.

    ``eps_mode="optax"`` (default, what JAX users expect: optax/PyTorch, ε added to √v̂) or ``"hat"``
    (the seed's ε-hat form with ``lr_t = lr·√(1−b2ᵗ)/(1−b1ᵗ)``). ``count`` advances once per
    ``step``, shared by all parameters (as optax); moments of skipped parameters stay put.

    >>> import numpy as np, tapegrad as tg
    >>> tape = tg.Tape(); w = tape.param(np.array([1.0]))
    >>> opt = tg.Adam(0.1); _ = opt.add(tape, w)
    >>> _ = tape.backward((w * w).sum()); opt.step(); float(tape.value(w)[0])
    0.9000000005
    """
    kind = "Adam"

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, *, eps_mode="optax", clip=None, clip_mode="optax"):
        if eps_mode not in ("optax", "hat"):
            raise ValueError(f"Adam: eps_mode must be 'optax' or 'hat', got {eps_mode!r}")
        super().__init__(lr, clip=clip, clip_mode=clip_mode)
        self.b1, self.b2, self.eps, self.eps_mode = float(b1), float(b2), float(eps), eps_mode
        self.mu, self.nu = [], []

    def _added(self, w):
        self.mu.append(np.zeros_like(w))
        self.nu.append(np.zeros_like(w))

    def step_scalars(self, count):
        """The host scalars of step ``count`` (1-based), recomputed every step, never captured."""
        bc1 = 1.0 - self.b1 ** count
        bc2 = 1.0 - self.b2 ** count
        if self.eps_mode == "optax":
            return (-self.lr, bc1, bc2)
        return (self.lr * math.sqrt(bc2) / bc1,)

    def _update(self, k, w, g, sc):
        adam_update(w, g, self.mu[k], self.nu[k], self.b1, self.b2, self.eps, sc, self.eps_mode,
                    np.empty_like(w), np.empty_like(w))

    def config(self):
        return {**super().config(), "b1": self.b1, "b2": self.b2, "eps": self.eps, "eps_mode": self.eps_mode}

    def state_dict(self):
        return {"count": self.count, "mu": [m.copy() for m in self.mu], "nu": [n.copy() for n in self.nu]}

    def load_state_dict(self, state):
        for key in ("mu", "nu"):
            arrays = state.get(key)
            if arrays is None or len(arrays) != len(self.params):
                raise TapeError(f"Adam.load_state_dict: expected {len(self.params)} '{key}' arrays, got "
                                f"{None if arrays is None else len(arrays)}")
            for k, (have, new) in enumerate(zip(getattr(self, key), arrays)):
                if np.shape(new) != have.shape:
                    raise TapeError(f"Adam.load_state_dict: {key}[{k}] must have shape {have.shape}, got "
                                    f"{np.shape(new)}")
        super().load_state_dict(state)
        for key in ("mu", "nu"):
            for have, new in zip(getattr(self, key), state[key]):
                np.copyto(have, new)
