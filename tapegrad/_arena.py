"""64-byte aligned buffers: one-off allocations and a rewindable bump arena."""
import math

import numpy as np

ALIGN = 64


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous array whose data pointer is a multiple of 64 bytes."""
    dtype = np.dtype(dtype)
    nbytes = max(math.prod(shape), 1) * dtype.itemsize   # an empty array still views one element's bytes
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = -raw.__array_interface__["data"][0] % ALIGN
    return raw[off:off + nbytes].view(dtype)[:math.prod(shape)].reshape(shape)


def readonly(a):
    """A read-only view of ``a`` (what the tape and programs hand out: borrowed, never written)."""
    view = a.view()
    view.flags.writeable = False
    return view


def aligned_copy(array, dtype):
    out = aligned_empty(np.shape(array), dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def slab_views(shapes, dtype):
    """One zeroed aligned slab holding arrays of ``shapes`` side by side, each starting on a 64-byte
    boundary (the padding between them stays zero): (flat slab, [views], [(offset, size)])."""
    dtype = np.dtype(dtype)
    step = ALIGN // dtype.itemsize
    spans, off = [], 0
    for shape in shapes:
        n = math.prod(shape)
        spans.append((off, n))
        off += n + (-n % step)
    flat = aligned_empty((max(off, 1),), dtype)
    flat.fill(0)
    return flat[:off], [flat[o:o + n].reshape(shape) for (o, n), shape in zip(spans, shapes)], spans


class Arena:
    """Bump allocator over aligned slabs.

    ``take`` carves the next buffer; ``rewind(pos)`` hands back everything carved after ``pos``
    while keeping the slabs, so a training loop stops allocating after its first episode.
    """

    def __init__(self, dtype, first=1 << 14):
        self.dtype = np.dtype(dtype)
        self.mask = ALIGN // self.dtype.itemsize - 1
        self.slabs = [aligned_empty((first,), self.dtype)]
        self.views = {}   # (slab, offset, shape) -> (view, end): a repeated episode reuses its views
        self.rewind((0, 0))

    @property
    def pos(self):
        return (self.si, self.off)

    def rewind(self, pos=(0, 0)):
        self.si, self.off = pos
        self.slab = self.slabs[self.si]
        self.cap = self.slab.shape[0]

    def take(self, shape, n=None):
        hit = self.views.get((self.si, self.off, shape))
        if hit is not None:
            self.off = hit[1]
            return hit[0]
        if n is None:
            n = math.prod(shape)
        off = self.off
        end = off + ((n + self.mask) & ~self.mask)
        if end > self.cap:
            return self._next_slab(shape, n)
        if len(self.views) >= 1 << 14:   # shapes that never repeat must not grow the cache forever
            self.views.clear()
        view = self.views[(self.si, off, shape)] = (self.slab[off:off + n].reshape(shape), end)
        self.off = end
        return view[0]

    def take_mask(self, shape):
        """A bool buffer (for ``where=`` masks), carved like any other."""
        n = math.prod(shape)
        words = -(-n // self.dtype.itemsize)
        return self.take((words,)).view(np.bool_)[:n].reshape(shape)

    def _next_slab(self, shape, n):
        si = self.si + 1
        size = max(2 * self.slabs[-1].shape[0], n + self.mask + 1)
        if si == len(self.slabs):
            self.slabs.append(aligned_empty((size,), self.dtype))
        elif self.slabs[si].shape[0] < n:
            self.slabs[si] = aligned_empty((size,), self.dtype)
            self.views = {k: v for k, v in self.views.items() if k[0] != si}   # views of the old slab
        self.rewind((si, 0))
        return self.take(shape, n)

    def nbytes(self):
        return sum(s.nbytes for s in self.slabs)


class ParamStore:
    """Parameters side by side in aligned slabs, with their gradients at the same offsets.

    Consecutive parameters are contiguous (each padded to 64 bytes, padding kept at zero), so an
    optimizer can update a whole run of them with a handful of ufunc calls instead of a handful per
    parameter.
    """

    def __init__(self, dtype, first=1 << 12):
        self.dtype = np.dtype(dtype)
        self.step = ALIGN // self.dtype.itemsize
        self.vals, self.grads = [], []
        self._first = first
        self.si, self.off = -1, 0
        self.drops = 0

    @property
    def pos(self):
        return (self.si, self.off)

    def rewind(self, pos):
        self.drops += 1      # parameters were dropped: holders of parameter slots re-check theirs
        self.si, self.off = pos
        for v, g in zip(self.vals[max(self.si, 0):], self.grads[max(self.si, 0):]):
            lo = self.off if v is self.vals[self.si] else 0
            v[lo:] = 0.0
            g[lo:] = 0.0

    def add(self, shape):
        """Room for one parameter: (slab, lo), its value view and its gradient view."""
        n = math.prod(shape)
        padded = n + (-n % self.step)
        if self.si < 0 or self.off + padded > self.vals[self.si].shape[0]:
            self.si += 1
            self.off = 0
            if self.si == len(self.vals) or self.vals[self.si].shape[0] < padded:
                last = self.vals[-1].shape[0] if self.vals else self._first
                cap = max(2 * last, padded)
                fresh = [aligned_empty((cap,), self.dtype) for _ in range(2)]
                for a in fresh:
                    a.fill(0.0)
                self.vals[self.si:self.si + 1], self.grads[self.si:self.si + 1] = [fresh[0]], [fresh[1]]
        lo = self.off
        self.off += padded
        return (self.si, lo), self.span(self.si, lo, lo + n, shape)

    def span(self, si, lo, hi, shape=None):
        shape = (hi - lo,) if shape is None else shape
        return self.vals[si][lo:hi].reshape(shape), self.grads[si][lo:hi].reshape(shape)
