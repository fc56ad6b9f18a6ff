"""The native backend: a program's buffers in a pointer table, its generated C built and called by ctypes.

``Program.native_abi()`` (for C callers such as an XLA FFI handler) returns plain ints and lists:

``forward``, ``backward``, ``episode``, ``step``: addresses of ``void f(void *ctx)``; ``episode`` is
forward + backward + optimizer step (the step does nothing while no optimizer is attached).
``ctx``: the pointer table the functions take (see ``codegen``).
``params`` / ``inputs`` / ``grads``: ``[(address, shape)]`` of parameter values, constant slots (lazy
ones included) and parameter gradients, each in tape (registration) order; C-contiguous, 64-byte aligned.
``loss``: address of the loss value (one element). ``dtype``: "float64" or "float32".
``opt_state``: ``[(address, shape)]`` = mu_0, nu_0, mu_1, nu_1, … (Adam) or trace_0, trace_1, …
(momentum SGD) in the attached optimizer's registration order (empty for plain SGD or when nothing is
attached).
``step_scalars``: address of a double array ``[count, s0, s1, s2, norm, clipped, lr given, lr]``
(``lr given`` nonzero: the next steps use ``lr`` as the learning rate, a schedule's value). The step reads
``count``, adds one, and computes Adam's bias corrections from it in C (``1 − b**count`` with the C
library's ``pow``, as ``Adam.step_scalars`` does on the host), so a caller only ever owns the counter:
write ``count`` there to restore a checkpoint, read it back after steps.

For callers that run the functions on their own buffers (a private copy of the table whose entries
point elsewhere, e.g. at XLA's operands): ``table_len`` (entries in ``ctx``), ``sizes`` (address of an
int64 array parallel to the table: the byte size of each buffer entry, 0 elsewhere), and the table
indices ``param_index`` / ``input_index`` / ``data_index`` (the data slots: int64 or bool) / ``grad_index`` (-1 for a parameter backward does not
reach: its gradient is zeros) / ``loss_index``. Entry ``[2]`` is the step scalars, ``[3]``/``[4]`` the
optimizer configuration and parameter table (read only: their ``[w, g, gt, mu, nu]`` rows are table
indices). The table changes only when an optimizer is attached.
"""
import ctypes
import math
import os

import numpy as np

from .._arena import ALIGN, aligned_empty
from ..blas import blas_core, blas_pointers, blas_threads_local, lapack_pointers
from ..errors import TapeError
from . import build, codegen, fuse, kernels

# Products of at most this many multiply-adds run in the generated C's own kernel (tg_mm_small in
# runtime.c), larger ones in BLAS. Measured on a 2-core Xeon (AVX-512) against OpenBLAS 0.3.31's Haswell
# kernels, the ones it runs on AMD Zen and AVX2 Intel CPUs (experiments/bench/bench_gemm.py): the C kernel is
# 1.1-1.8x faster up to 32x32x32 and on narrow products (n = 4, 10) up to 64x10x128, at parity near
# 64x128x64 and 0.6-0.8x beyond. OpenBLAS's SkylakeX-family kernels have their own small-matrix path
# (~90 GFLOP/s at 32x32x16 on one core, 1.7x ours): there BLAS takes every product.
SMALL_GEMM = 1 << 17
_BLAS_SMALL_PATH = ("skylakex", "cooperlake", "sapphirerapids")


def small_gemm_limit(dtype):
    """The ``SMALL_GEMM`` threshold for the BLAS ``blas_pointers(dtype)`` found, 0 for an OpenBLAS core
    with its own small-matrix kernels (``TAPEGRAD_SMALL_GEMM`` overrides it, for measurements)."""
    env = os.environ.get("TAPEGRAD_SMALL_GEMM")
    if env is not None:
        return int(env)
    core = blas_core(dtype)
    return 0 if core.lower() in _BLAS_SMALL_PATH else SMALL_GEMM


def reshape_views(p):
    """Reshapes as views: a reshape node's value is its input's buffer, and so is its gradient where the
    reshape is the only node that contributes to the input's gradient (that contribution is then a copy
    of the whole buffer, so sharing it changes no addition). Not of a parameter, which the optimizer step
    changes in place after the backward. Rebinds ``p.val``/``p.grads`` of those nodes to views of their
    roots and returns ``{("v"|"g", node): root}`` (roots never are views themselves)."""
    contributors = {}
    for k, ta, _, tb, _ in p.sched:
        a, b = p.nodes[k][1:3]
        for to, j in ((ta, a), (tb, b)):
            if to:
                contributors[j] = contributors.get(j, 0) + 1
    root, params = {}, set(p.params)
    for k in p.compute:
        op, a = p.nodes[k][:2]
        if op.name != "reshape" or p.val[a].dtype.kind != "f" or a in params:
            continue
        root["v", k] = root.get(("v", a), a)
        p.val[k] = p.val[root["v", k]].reshape(p.shapes[k])
        if p.grads[k] is not None and p.grads[a] is not None and contributors.get(a) == 1:
            root["g", k] = root.get(("g", a), a)
            p.grads[k] = p.grads[root["g", k]].reshape(p.shapes[k])
    return root


def layout(p, views=None):
    """The buffer table of a program: values, then gradients, then three scratch buffers; returns
    (buffers, {("v"|"g"|"S", k): index}). A view (``reshape_views``) shares its root's entry."""
    bufs, index = [], {}
    views = views or {}

    def add(key, arr):
        if key in views:
            index[key] = index[(key[0], views[key])]
            return
        index[key] = len(bufs)
        bufs.append(arr)
    for k in range(len(p.nodes)):
        add(("v", k), p.val[k])
    for k in range(len(p.nodes)):
        if p.grads[k] is not None:
            add(("g", k), p.grads[k])
    # scratch holds gradient contributions (shapes of reached nodes) and the temporaries of reductions
    # and softmax-like kernels (their inputs' shapes) -- not, e.g., a frozen weight that only feeds a GEMM
    need = set(p.reached) | set(p.compute)
    need |= {x for k in p.compute if p.nodes[k][0].kind not in ("matmul", "elementwise", "layout")
             for x in p.nodes[k][1:3] if x >= 0}
    big = max([math.prod(p.shapes[k]) for k in need] + [1])
    for k in p.compute:
        extra = kernels.SCRATCH.get(p.nodes[k][0].name)
        if extra is not None:
            big = max(big, extra(p, k))
    for j in range(3):
        add(("S", j), aligned_empty((big,), p.dtype))
    return bufs, index


def _addr(a):
    return a.__array_interface__["data"][0]


def liveness(steps, sizes, kept):
    """Offsets into one arena for the table entries not in ``kept``, two sharing bytes only where no step
    touches both between their first and last use: ``({entry: byte offset}, arena bytes)``.

    ``steps``: per segment run (forward's then backward's, in order), the entries it touches. An entry
    no step touches needs no memory (offset None). Placed largest first, each at the lowest 64-byte
    aligned offset clear of every placed entry whose span overlaps its own.
    """
    first, last = {}, {}
    for t, touched in enumerate(steps):
        for i in touched:
            first.setdefault(i, t)
            last[i] = t
    free = sorted((i for i in sizes if i not in kept), key=lambda i: (-sizes[i], i))
    lo, hi, start, end = (np.zeros(len(free), np.int64) for _ in range(4))
    out, placed, top = {}, 0, 0
    for i in free:
        if i not in first:
            out[i] = None
            continue
        n = -(-max(sizes[i], 1) // ALIGN) * ALIGN
        clash = (lo[:placed] <= last[i]) & (hi[:placed] >= first[i])
        off = 0
        for a, b in sorted(zip(start[:placed][clash].tolist(), end[:placed][clash].tolist())):
            if off + n <= a:
                break
            off = max(off, b)
        lo[placed], hi[placed], start[placed], end[placed] = first[i], last[i], off, off + n
        placed += 1
        out[i], top = off, max(top, off + n)
    return out, top


# An optimizer update of at least this many parameters is split over the CPU's cores, on threads the
# program starts for the step (inside jax.jit XLA's pool does it instead). experiments/bench/bench_capture.py
# measures the split at every size: it pays at 8.4M parameters (1.8x); at 26k starting threads costs more.
SPLIT_UPDATES = 1 << 17


def update_parts():
    """How many ranges a large optimizer update is split into: the cores this process may run on."""
    return min(len(os.sched_getaffinity(0)), 8)


class NativeRunner:
    """Builds and drives the generated library of one ``Program``."""

    def __init__(self, prog):
        p = self.p = prog
        self.views = reshape_views(p)
        self.bufs, self.index = layout(p, self.views)
        self.fwd_segs, self.bwd_segs = fuse.plan(p, bool(p.fuse), p.fuse == "libm")
        self.blas = blas_pointers(p.dtype)
        self.registers = fuse.registers(p, self.fwd_segs, self.bwd_segs, self.views)
        emitter = codegen.Emitter(p, self.index, self.fwd_segs, self.bwd_segs, self.blas[2],
                                  small_mm=small_gemm_limit(p.dtype), views=self.views, registers=self.registers)
        self.source = emitter.emit()
        self.freed = set()   # ("v"|"g", node) whose buffers compact() handed to liveness
        self.untouched = set()   # table entries no segment touches, once compacted (null in the table)
        self.fresh = False   # a forward ran since the last backward (compacted backward needs one)
        self.steps = emitter.steps
        self.path = build.build(self.source, what=f"a program of {len(p.nodes):,} nodes")
        self.lib = build.load(self.path)
        self.sc = np.zeros(8, np.float64)
        self.cfg = np.zeros(16 + 2 * max(len(p.params), 1), np.float64)
        self.pinfo = np.zeros(8 * max(len(p.params), 1), np.int64)
        self.base = len(self.bufs)       # optimizer buffers go after these; the table never moves
        self.table = np.zeros(codegen.FIRST + self.base + 5 * len(p.params), np.uint64)
        self.sizes = np.zeros(len(self.table), np.int64)
        team = self.lib.tg_threads_team
        team.argtypes, team.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_void_p
        self.team = team(update_parts(), SPLIT_UPDATES) or 0
        self._fill_table()
        self.ctx = ctypes.c_void_p(_addr(self.table))
        self.fns = {}
        for name in ("forward", "backward", "step", "episode"):
            f = getattr(self.lib, "tg_" + name)
            f.argtypes, f.restype = [ctypes.c_void_p], None
            self.fns[name] = f

    def _fill_table(self):
        gemm, dot = self.blas[:2]
        t = self.table
        t[0], t[1] = gemm, dot
        t[2], t[3], t[4] = _addr(self.sc), _addr(self.cfg), _addr(self.pinfo)
        t[6] = self.team
        t[7] = blas_threads_local(self.p.dtype)
        self.sizes[:] = 0
        if any(self.p.nodes[k][0].kind == "linalg" for k in self.p.compute):
            t[5] = _addr(lapack_pointers(self.p.dtype)[0])
        for i, a in enumerate(self.bufs):
            # an entry no segment touches (compact) is null: no caller copies or reads it
            t[codegen.FIRST + i] = 0 if i in self.untouched else _addr(a)
            self.sizes[codegen.FIRST + i] = a.nbytes

    # ── running ──────────────────────────────────────────────────────────────

    def forward(self):
        self.fns["forward"](self.ctx)
        self.fresh = True

    def backward(self):
        if self.freed and not self.fresh:
            raise TapeError("backward: this program reuses buffers by liveness (capture(..., memory='reuse')): "
                            "the values backward reads live only until it has run; run forward (or episode) "
                            "before each backward")
        self.fns["backward"](self.ctx)
        self.fresh = False

    def step(self):
        self.fns["step"](self.ctx)
        self.p.opt.count = int(self.sc[0])

    def episode(self):
        self.fns["episode"](self.ctx)
        self.fresh = False
        if self.p.opt is not None:
            self.p.opt.count = int(self.sc[0])

    def pull_count(self):
        self.p.opt.count = int(self.sc[0])

    def push_count(self):
        self.sc[0] = float(self.p.opt.count)

    def attached(self):
        """Write the optimizer's configuration into cfg/pinfo (no rebuild: the step reads them at run time)."""
        p, o = self.p, self.p.opt
        if 2 * len(o.ids) > len(self.cfg) - 16:
            raise ValueError("more optimizer parameters than program parameters")
        cfg = self.cfg
        cfg[:] = 0.0
        cfg[0] = 1.0 if o.kind == "SGD" else 2.0
        cfg[1] = o.lr
        c = o.conf
        if o.kind == "Adam":
            cfg[2], cfg[3], cfg[4], cfg[5] = c.b1, c.b2, c.eps, 0.0 if c.eps_mode == "optax" else 1.0
        else:
            cfg[9], cfg[10] = c.momentum, float(c.nesterov)
        cfg[6] = -1.0 if o.clip is None else o.clip
        cfg[7] = ("optax", "seed", "torch").index(o.clip_mode)
        cfg[8] = len(o.ids)
        del self.bufs[self.base:]
        self.pinfo[:] = 0
        for k, i in enumerate(o.ids):
            cfg[16 + k] = o.l2[k]
            cfg[16 + len(o.ids) + k] = o.wd[k]
            gbuf = p.grads[i] if p.grads[i] is not None else p.grad_buf(i)
            # the step writes a transformed gradient only under clipping or L2, and the moments its kind
            # keeps; a row it never reads points at the gradient (no memory of its own)
            gt = aligned_empty(p.shapes[i], p.dtype) if o.clip is not None or o.l2[k] != 0.0 else gbuf
            mu = o.mu[k] if o.mu else gbuf
            nu = o.nu[k] if o.nu else gbuf
            row = []
            for arr in (p.val[i], gbuf, gt, mu, nu):
                j = len(self.bufs)
                self.bufs.append(arr)
                row.append(j)
            self.pinfo[8 * k:8 * k + 8] = row + [math.prod(p.shapes[i]), int(o.touched[k]), 0]
        self._fill_table()
        self.sc[0] = float(o.count)

    def compact(self):
        """Hand the buffers of intermediate nodes to ``liveness``: one arena whose bytes a value or
        gradient shares with others that no segment run uses while it is alive. Parameters, inputs,
        data, the loss, parameter gradients and scratch keep their own. The nodes whose buffers moved
        go into ``freed`` (``Program.value``/``grad`` refuse them: the next value overwrites theirs).
        """
        p = self.p
        if self.freed:
            return
        keys = {}
        for key, i in self.index.items():
            keys.setdefault(i, []).append(key)
        leaves = set(range(len(p.nodes))) - set(p.compute)
        kept = {i for i, ks in keys.items()
                for kind, k in ks if kind == "S" or (kind == "v" and (k in leaves or k == p.loss_id))
                or (kind == "g" and k in p.params)}
        sizes = {i: self.bufs[i].nbytes for i in range(self.base)}
        offsets, top = liveness(self.steps, sizes, kept)
        arena = aligned_empty((max(top, 1),), np.uint8)
        spare = aligned_empty((ALIGN,), np.uint8)
        for i, off in offsets.items():
            old = self.bufs[i]
            if off is None:   # never touched: a zero-stride stand-in of its type (no memory)
                new = np.lib.stride_tricks.as_strided(spare.view(old.dtype)[:1], old.shape, (0,) * old.ndim)
                self.untouched.add(i)
            else:
                new = arena[off:off + old.nbytes].view(old.dtype).reshape(old.shape)
            self.bufs[i] = new
            for kind, k in keys[i]:
                if kind == "v":
                    p.val[k] = new
                else:
                    p.grads[k] = new
                self.freed.add((kind, k))
        self.freed |= set(self.registers)   # rebuilt from stored bytes that may be freed: refused too
        self.arena = arena
        self._fill_table()

    def nbytes(self):
        """The bytes the program's buffers span, each byte once (an arena shared by many nodes counts
        once, a node no segment touches nothing)."""
        spans = sorted((_addr(a), _addr(a) + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) + a.itemsize)
                       for a in self.bufs if a.size)
        total, end = 0, 0
        for lo, hi in spans:
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
        return total

    # ── reports ──────────────────────────────────────────────────────────────

    def plan(self):
        return fuse.report(self.p, self.fwd_segs, self.bwd_segs)

    def abi(self):
        p = self.p
        fn = {name: ctypes.cast(f, ctypes.c_void_p).value for name, f in self.fns.items()}
        state = [(_addr(a), a.shape) for a in p.opt.state_arrays()] if p.opt is not None else []
        return {
            "forward": fn["forward"], "backward": fn["backward"], "episode": fn["episode"], "step": fn["step"],
            "ctx": _addr(self.table),
            "params": [(_addr(p.val[k]), p.shapes[k]) for k in p.params],
            "inputs": [(_addr(p.val[k]), p.shapes[k]) for k in p.consts],
            "grads": [(_addr(p.grad_buf(k)), p.shapes[k]) for k in p.params],
            "loss": _addr(p.val[p.loss_id]),
            "dtype": str(p.dtype),
            "opt_state": state,
            "step_scalars": _addr(self.sc),
            "table_len": len(self.table),
            "sizes": _addr(self.sizes),
            "param_index": [codegen.FIRST + self.index[("v", k)] for k in p.params],
            "input_index": [codegen.FIRST + self.index[("v", k)] for k in p.consts],
            "data_index": [codegen.FIRST + self.index[("v", k)] for k in p.data],
            "grad_index": [codegen.FIRST + self.index[("g", k)] if ("g", k) in self.index else -1
                           for k in p.params],
            "loss_index": codegen.FIRST + self.index[("v", p.loss_id)],
        }
