"""The NumPy replay backend: a captured program run by the registry's own NumPy rules, allocation-free.

The same ``fwd``/``da``/``db`` functions the tape calls run here on preallocated buffers, in the tape's
order, so values, gradients and parameters are bit-identical (``==``) to the eager tape. Scratch comes
from ``Scratch``: the first episode records what each node step asks for; ``pack`` then carves every
step's requests from one shared slab (steps never overlap in time, as on the tape's rewinding arena)
and later episodes get the very same cached view objects back — no array is allocated after the first
episode.
"""
import math

import numpy as np

from ._arena import aligned_empty
from .errors import DomainError, at
from .ops import Bad
from .optim import adam_update, clip_scale, clips, coefficients, l2_grad, sgd_update, sq_norm
from .tape import unbroadcast


class Scratch:
    """A recording scratch provider with the Arena's ``take``/``take_mask`` interface.

    ``begin(key)`` starts one node step; the i-th request of a step returns the i-th cached view.
    """

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.cache = {}
        self.cur = None
        self.i = 0
        self.packed = False

    def begin(self, key):
        cur = self.cache.get(key)
        if cur is None:
            cur = self.cache[key] = []
        self.cur = cur
        self.i = 0

    def take(self, shape):
        return self._get(shape, self.dtype)

    def take_mask(self, shape):
        return self._get(shape, np.dtype(np.bool_))

    def _get(self, shape, dtype):
        i, cur = self.i, self.cur
        self.i = i + 1
        if i < len(cur):
            v = cur[i]
            if v.shape == shape and v.dtype == dtype:
                return v
        v = aligned_empty(shape, dtype)   # first episode (or a changed request): a fresh buffer
        del cur[i:]
        cur.append(v)
        self.packed = False
        return v

    def pack(self):
        """Re-carve every step's buffers from one slab sized for the largest step (64-byte aligned)."""
        if self.packed:
            return
        need = 0
        for views in self.cache.values():
            need = max(need, sum(_padded(v.nbytes) for v in views))
        slab = aligned_empty((need,), np.uint8)
        for key, views in self.cache.items():
            off = 0
            for j, v in enumerate(views):
                n = v.nbytes
                views[j] = slab[off:off + n].view(v.dtype).reshape(v.shape)
                off += _padded(n)
        self.slab = slab
        self.packed = True

    def nbytes(self):
        return self.slab.nbytes if self.packed else 0


def _padded(n):
    return n + (-n % 64)


class NumpyRunner:
    """Runs a ``Program``'s node table with NumPy (see the module docstring)."""

    def __init__(self, prog):
        self.p = prog
        self.ws = Scratch(prog.dtype)
        self.seed = np.ones(prog.shapes[prog.loss_id], prog.dtype)
        self.opt_bufs = None
        self.slab_bufs = None
        self.kept = {}   # node -> the buffers its forward keeps for its backward (Op.keep)
        for k in prog.compute:
            op, a, b, s = prog.nodes[k]
            if op.keep is not None:
                self.kept[k] = tuple(aligned_empty(shape, prog.dtype) for shape in op.keep(prog.shapes[a], s))

    def forward(self):
        p, ws = self.p, self.ws
        val = p.val
        for k in p.compute:
            op, a, b, s = p.nodes[k]
            ws.begin(k)
            vb = None if b < 0 else val[b]
            try:
                if op.arity == 3:
                    op.fwd(val[a], vb, s, val[k], ws, val[p.third[k]])
                elif op.keep is not None:
                    op.fwd(val[a], vb, s, val[k], ws, self.kept[k])
                else:
                    op.fwd(val[a], vb, s, val[k], ws)
            except Bad as e:   # a value the op cannot take (see Tape.apply)
                raise DomainError(f"{at(op.name, k)}: {e}") from None
        ws.pack()

    def backward(self):
        p, ws = self.p, self.ws
        val, grad, nodes = p.val, p.grads, p.nodes
        np.copyto(grad[p.loss_id], self.seed)
        for k, to_a, first_a, to_b, first_b in p.sched:
            op, a, b, s = nodes[k]
            ws.begin(-1 - k)
            g, out, va = grad[k], val[k], val[a]
            vb = None if b < 0 else val[b]
            extra = (val[p.third[k]],) if op.arity == 3 else (self.kept[k],) if op.keep is not None else ()
            if to_a:
                self._acc(a, op.da(g, out, va, vb, s, ws, *extra), first_a)
            if to_b:
                self._acc(b, op.db(g, out, va, vb, s, ws, *extra), first_b)
        ws.pack()

    def _acc(self, j, c, first):
        buf = self.p.grads[j]
        if c.shape != buf.shape:
            c = unbroadcast(c, buf.shape, self.ws)
        if first:
            np.copyto(buf, c)
        else:
            np.add(buf, c, out=buf)

    def step(self, norm=None):
        """One optimizer step with the optimizer module's own update functions (``Optimizer.step``).

        ``norm``: the global gradient norm to clip with instead of computing it (``tapegrad.verify``
        passes a compiled program's own norm, which it checked within the norm's bound)."""
        p = self.p
        o = p.opt
        o.count += 1
        sc = o.conf.step_scalars(o.count)
        if o.whole and all(o.touched):
            return self._step_slab(o, sc, norm)
        if self.opt_bufs is None:
            self.opt_bufs = [tuple(aligned_empty(p.shapes[i], p.dtype) for _ in range(3)) for i in o.ids]
        work = []
        for k, i in enumerate(o.ids):
            if not o.touched[k]:
                continue
            w, g = p.val[i], p.grads[i]
            gt, t, u = self.opt_bufs[k]
            if o.l2[k]:
                l2_grad(g, w, o.l2[k], gt)
            else:
                np.copyto(gt, g)
            work.append((k, w, gt, t, u))
        wd = [c or None for c in o.wd]
        if o.clip is not None and work:
            if norm is None:
                total = 0.0
                for _, _, gt, _, _ in work:
                    total += sq_norm(gt)
                norm = math.sqrt(total)
            if clips(norm, o.clip, o.clip_mode):
                for _, _, gt, _, _ in work:
                    clip_scale(gt, norm, o.clip, o.clip_mode, gt)
        c = o.conf
        if o.kind == "SGD":
            for k, w, gt, t, u in work:
                sgd_update(w, gt, o.lr, t, o.mu[k] if o.moments else None, c.momentum, c.nesterov, u)
        else:
            for k, w, gt, t, u in work:
                adam_update(w, gt, o.mu[k], o.nu[k], c.b1, c.b2, c.eps, sc, c.eps_mode, t, u, wd[k])

    def _step_slab(self, o, sc, norm=None):
        """The same update on the program's parameter slab: one call per ufunc for all parameters
        (elementwise, so bit-identical to updating each; the padding between them stays zero)."""
        p = self.p
        if self.slab_bufs is None:
            spans = [slice(off, off + n) for off, n in p.pspans]
            l2, wd = (coefficients(p.pslab.size, p.dtype, spans, cs) for cs in (o.l2, o.wd))
            self.slab_bufs = tuple(np.zeros_like(p.pslab) for _ in range(3)) + (l2, wd)
        gt, t, u, l2, wd = self.slab_bufs
        w, g = p.pslab, p.gslab
        if l2 is not None:
            l2_grad(g, w, l2, gt)
        else:
            np.copyto(gt, g)
        if o.clip is not None:
            if norm is None:
                total = 0.0
                for off, n in p.pspans:
                    total += sq_norm(gt[off:off + n])
                norm = math.sqrt(total)
            if clips(norm, o.clip, o.clip_mode):
                clip_scale(gt, norm, o.clip, o.clip_mode, gt)
        c = o.conf
        if o.kind == "SGD":
            sgd_update(w, gt, o.lr, t, o.mslab if o.moments else None, c.momentum, c.nesterov, u)
        else:
            adam_update(w, gt, o.mslab, o.nslab, c.b1, c.b2, c.eps, sc, c.eps_mode, t, u, wd)

    def episode(self):
        self.forward()
        self.backward()
        if self.p.opt is not None:
            self.step()
        self.ws.pack()

    def attached(self):
        self.opt_bufs = self.slab_bufs = None

    def pull_count(self):
        pass

    def push_count(self):
        pass

    def plan(self):
        n = len(self.p.compute)
        return {"backend": "numpy", "segments": [(k, k) for k in self.p.compute],
                "kernels_forward": n, "kernels_backward": len(self.p.sched), "scratch_bytes": self.ws.nbytes()}
