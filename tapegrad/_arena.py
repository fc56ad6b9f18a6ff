"""64-byte aligned buffers: one-off allocations and a rewindable bump arena."""
import math

import numpy as np

ALIGN = 64


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous array whose data pointer is a multiple of 64 bytes."""
    dtype = np.dtype(dtype)
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = -raw.__array_interface__["data"][0] % ALIGN
    return raw[off:off + nbytes].view(dtype)[:math.prod(shape)].reshape(shape)


def aligned_copy(array, dtype):
    out = aligned_empty(np.shape(array), dtype)
    np.copyto(out, array, casting="unsafe")
    return out


class Arena:
    """Bump allocator over aligned slabs.

    ``take`` carves the next buffer; ``rewind(pos)`` hands back everything carved after ``pos``
    while keeping the slabs, so a training loop stops allocating after its first episode.
    """

    def __init__(self, dtype, first=1 << 14):
        self.dtype = np.dtype(dtype)
        self.step = ALIGN // self.dtype.itemsize
        self.slabs = [aligned_empty((first,), self.dtype)]
        self.si = 0
        self.off = 0

    @property
    def pos(self):
        return (self.si, self.off)

    def rewind(self, pos=(0, 0)):
        self.si, self.off = pos

    def take(self, shape, n=None):
        if n is None:
            n = math.prod(shape)
        off = self.off
        end = off + n + (-n % self.step)
        slab = self.slabs[self.si]
        if end > slab.shape[0]:
            return self._next_slab(shape, n)
        self.off = end
        return slab[off:off + n].reshape(shape)

    def take_mask(self, shape):
        """A bool buffer (for ``where=`` masks), carved like any other."""
        n = math.prod(shape)
        words = -(-n // self.dtype.itemsize)
        return self.take((words,)).view(np.bool_)[:n].reshape(shape)

    def _next_slab(self, shape, n):
        self.si += 1
        self.off = 0
        if self.si == len(self.slabs):
            self.slabs.append(aligned_empty((max(2 * self.slabs[-1].shape[0], n + self.step),), self.dtype))
        elif self.slabs[self.si].shape[0] < n:
            self.slabs[self.si] = aligned_empty((max(2 * self.slabs[self.si].shape[0], n + self.step),), self.dtype)
        return self.take(shape, n)

    def nbytes(self):
        return sum(s.nbytes for s in self.slabs)
