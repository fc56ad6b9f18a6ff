"""Differential fuzzing over the whole registry: random small graphs recorded on the tape, replayed by NumPy
and by the native backend, fused and unfused.

Each example records a few independent random subgraphs (a handful to ~12 nodes each, arrays of at most
``CAP`` elements) on one tape, sums them into one loss and runs backward; then it captures the tape three
times (NumPy; native unfused; native fused: two C builds per example) and compares every node's value and
gradient:

- NumPy replay == tape, bit for bit (same rules, same order);
- native fused == native unfused, bit for bit (fusion changes loops, never arithmetic);
- native vs tape, per node: ``==`` where the node's value was computed by exact/order-tier ops only from
  leaves (and, for a gradient, where every contribution reaching it is such an op's rule reading such
  values); a libm/blas node whose inputs are exact: within its tier (``test_native.within``); anything
  downstream of a libm/blas node: within ``RTOL`` relative (see ``near``).

Every registry op with inputs is built by the generator of its *shape rule* (``GENERATORS``), so a new op
with a known rule is fuzzed with no change here; an op with a new rule fails
``test_every_registry_op_is_generated_or_listed`` until it gets a generator or an entry in
``NOT_GENERATED`` with the reason. What the graphs hold: broadcasting on every input (an input's shape is
the output's with leading axes dropped and others set to 1: an (8, 8) mask against (4, 8, 8) operands,
masks of shape (1, n), (n, 1), ()); integer indices with repeats, negative ones (every index op allows
them) and, for the dynamic slices, starts out of range (they clamp); ``where(mask, x, -inf)`` into
softmax, logsoftmax, logsumexp and max, every row keeping an unmasked entry; reductions over random axis
sets (None, (), middle axes, axes of length 1), keepdims both ways; ties: values on a coarse grid
(multiples of 0.5, zero included) for max/min/maximum/sort/cummax/max_pool and relu/abs at 0.

How the nodes are drawn (``Graph.subgraph``): 35% any op (mostly elementwise: chains that fuse), 35% a
shape rule first and then one of its ops, 30% an op selecting by a bool mask; inputs are recent earlier
values where the op reads any real (``ANY_REAL``), else fresh leaves of its registry domain; a trailing
axis is often a multiple of a vector's width (``TRAILING``). Checked against the codegen before d85cdea
(GCC 12, AVX2): about one example in six hits the where miscompile, so a run of ``EXAMPLES`` finds it with
probability ~0.85, and the derandomized CI examples do.

Marked ``matrix``: CI runs these under several compilers × targets × BLAS kernels. A failure prints the
falsifying ``rnd=Random(n), seed=m`` (``Graph(random.Random(n), m)`` rebuilds it) and, under the "ci"
profile of conftest.py, the ``@reproduce_failure`` blob; the assertion message lists the failing nodes
and the whole recorded graph.
"""
import inspect
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tapegrad as tg
from tapegrad import ops as O

from test_native import within

CAP = 512          # elements per generated array, at most
BOUND = 8.0        # a value feeds later nodes only when finite and within ±BOUND (no overflow downstream)
RTOL = 1e-9        # the bound downstream of libm/blas nodes, relative to max(1, max|tape|) (see ``near``)
EXACT = ("exact", "order")
SIDES = (1, 1, 2, 3, 4, 5, 8)
# The trailing axis: half the time a multiple of 4 doubles (an AVX2 vector; 8: an AVX-512 one), so the
# vectorised main loops run, not only their scalar remainders (the miscompiled selects were vector code).
TRAILING = (1, 2, 3, 5, 7, 4, 8, 8, 12, 16)
RANKS = (0, 1, 2, 2, 3, 3, 4)
NOVERIFY = {"verify": False} if "verify" in inspect.signature(tg.capture).parameters else {}

# Samplers whose inputs may be any real value, so a generator may feed them an earlier node's value
# instead of a fresh leaf (the others — positive, near0, spd, ... — describe a domain the op needs).
ANY_REAL = {O.real, O.spread, O.between, O.away0, O.special.wide, O.route.few}
# Ops that read a −inf entry of a row that also holds a finite one as a finite result and gradient (an
# attention mask): the generator sometimes feeds them where(mask, x, −inf).
MINUS_INF = ("softmax", "logsoftmax", "logsumexp", "max")
# Ops the generators cannot build yet, with the reason (none at present).
NOT_GENERATED: dict = {}


# ── values ───────────────────────────────────────────────────────────────────

def kinked(op):
    """An op whose derivative jumps (ties, a kink at 0): the registry gives it a domain sampler that keeps
    finite differences off the kink (``ops.MARGIN``). Its inputs here are exact values only: a libm
    difference of an ulp upstream could break or make a tie and move a whole gradient."""
    return any(d in O.MARGIN for d in op.domain)


def values(sampler, rng, shape):
    """Fresh leaf values: for ops reading any real, often a coarse grid (exact ties and zeros)."""
    if sampler in ANY_REAL and rng.random() < 0.5:
        return rng.integers(-4, 5, shape) * 0.5
    if sampler is O.real:
        return rng.standard_normal(shape)
    return sampler(rng, shape)


def bounded(val):
    return val.size <= CAP and bool(np.all(np.isfinite(val))) and (val.size == 0 or np.max(np.abs(val)) <= BOUND)


# ── the graph under construction ─────────────────────────────────────────────

class Graph:
    """A tape being filled with random nodes. Structural choices come from ``rnd`` (a ``random.Random``
    that hypothesis seeds: an example replays from its seed, under ``derandomize`` too; hypothesis' own
    shrinking Random was tried and drew such skewed values that 10 examples missed the where miscompile),
    values from a NumPy generator seeded by ``seed``."""

    def __init__(self, rnd, seed):
        self.rnd, self.rng = rnd, np.random.default_rng(seed)
        self.tape = tg.Tape()
        self.vars = {}       # node id -> Var
        self.exact = {}      # node id -> value computed by exact/order-tier ops only
        self.pool = []       # float Vars later nodes may read (see ``bounded``)
        self.used = set()    # node ids some node reads
        self.lines = []      # the graph, one line per node, for failure messages

    # choices
    def int(self, lo, hi):
        return self.rnd.randint(lo, hi)

    def pick(self, seq):
        return seq[self.rnd.randrange(len(seq))]

    def coin(self, p=0.5):
        return self.rnd.random() < p

    def shape(self, lo=0, hi=4, cap=CAP):
        nd = self.pick([n for n in RANKS if lo <= n <= hi] or [lo])
        dims = [self.pick(SIDES) for _ in range(nd - 1)] + [self.pick(TRAILING)] * (nd > 0)
        while math.prod(dims) > cap:
            k = int(np.argmax(dims))
            dims[k] = max(1, dims[k] // 2)
        return tuple(dims)

    def part(self, out, drop=0.4):
        """A shape that broadcasts to ``out``: leading axes dropped (with probability ``drop``; most often
        one, as a bias or a mask over the trailing axes is), others set to 1, at random."""
        keep = out[self.pick((1, 1, self.int(1, len(out)))):] if out and self.coin(drop) else out
        return tuple(1 if self.coin(0.25) else n for n in keep)

    def grow(self, shape, lead=0.3):
        """A shape ``shape`` broadcasts to: a leading axis added (with probability ``lead``), axes of length
        1 widened, at random."""
        out = [n if n != 1 or not self.coin(0.3) else self.pick((2, 3, 4, 8)) for n in shape]
        if len(out) < 4 and self.coin(lead):
            out.insert(0, self.pick((2, 3, 4)))
        return tuple(out) if math.prod(out) <= CAP else tuple(shape)

    # nodes
    def note(self, v, text):
        self.vars[v.id] = v
        self.lines.append(f"  n{v.id} = {text} -> {v.shape}")
        return v

    def leaf(self, sampler, shape, param=None):
        x = values(sampler, self.rng, shape)
        param = self.coin(0.8) if param is None else param
        v = self.tape.param(x) if param else self.tape.const(x)
        self.exact[v.id] = True
        if bounded(self.tape.value(v)):
            self.pool.append(v)
        return self.note(v, f"{'param' if param else 'const'} {sampler.__name__}")

    def data(self, array, what):
        v = self.tape.const(array)
        self.exact[v.id] = True
        a = np.asarray(array)
        return self.note(v, f"{what} {a.tolist()!r}" if a.size <= 12 else f"{what} {a.dtype} {a.shape}")

    def input(self, op, k, shape=None, ok=None):
        """Input ``k`` of ``op``: a recent earlier value when the op reads any real there (exact values only
        for a kinked op), else a fresh leaf of its domain (of ``shape``, or a random one that ``ok`` takes)."""
        sampler = op.domain[k]
        if sampler in ANY_REAL and self.coin(0.75):
            fit = [v for v in self.pool if (shape is None or v.shape == shape) and (ok is None or ok(v.shape))
                   and (self.exact[v.id] or not kinked(op))]
            if fit:
                return fit[-1 - self.int(0, min(2, len(fit) - 1))]
        if shape is None:
            shape = self.shape()
            while ok is not None and not ok(shape):
                shape = self.shape()
        return self.leaf(sampler, shape)

    def apply(self, op, a, b=None, s=None, c=None):
        y = self.tape.apply(op, a, b, s, c)
        ins = [v for v in (a, b, c) if v is not None]
        self.exact[y.id] = op.tier in EXACT and all(self.exact[v.id] for v in ins)
        self.used |= {v.id for v in ins}
        if bounded(self.tape.value(y)):
            self.pool.append(y)
        return self.note(y, f"{op.name}({', '.join(f'n{v.id}' for v in ins)}{'' if s is None else f', s={s!r}'})")

    def masked(self, x, axes):
        """where(mask, x, −inf) with a broadcasting mask that leaves every group along ``axes`` (None: all
        axes) an unmasked entry."""
        full = x.shape
        m = self.rng.random(self.part(full, drop=0.5)) < self.pick((0.2, 0.5, 0.8))
        m = m.reshape((1,) * (len(full) - m.ndim) + m.shape)
        axes = tuple(range(len(full))) if axes is None else tuple(axes)
        while True:
            have = np.broadcast_to(m, full).any(axis=axes, keepdims=True) if axes else np.broadcast_to(m, full)
            lack = np.argwhere(~have)
            if not len(lack):
                break
            at = [int(self.rng.integers(full[d])) if d in axes else int(lack[0][d]) for d in range(len(full))]
            m[tuple(p if m.shape[d] > 1 else 0 for d, p in enumerate(at))] = True
        lead = next((d for d, n in enumerate(m.shape) if n != 1), m.ndim)
        m = m.reshape(m.shape[self.int(0, lead):])   # fewer axes than x: an (8, 8) mask on (4, 8, 8)
        ninf = self.data(np.array(-np.inf), "const")
        mask = self.data(m, "mask")
        return self.apply(O.OPS["where"], x, ninf, None, mask)

    def subgraph(self, n):
        """n random nodes: 35% any op (mostly elementwise: chains that fuse), 35% a shape rule first, then one
        of its ops (each family as likely), 30% an op selecting by a bool mask (``where``: the select GCC
        11/12 miscompiled when an operand broadcast over an outer axis, in ~5% of such nodes)."""
        for _ in range(n):
            u = self.rnd.random()
            op = self.pick(GENERATED if u < 0.35 else FAMILIES[self.pick(list(FAMILIES))] if u < 0.7 else SELECTS)
            GENERATORS[op.shape](self, op)

    def close(self):
        """The loss: Σ (y · w) over every node no other node reads (and a few that are read), non-finite
        entries (a masked row's −inf) masked out first."""
        terms = []
        nodes = self.tape.nodes
        for i, v in list(self.vars.items()):
            nd = nodes[i]
            if not nd.op.arity or (i in self.used and not self.coin(0.15)):
                continue
            val = self.tape.value(v)
            if not np.all(np.isfinite(val)):
                zero = self.data(np.array(0.0), "const")
                v = self.apply(O.OPS["where"], v, zero, None, self.data(np.isfinite(val), "mask"))
            w = self.tape.const(self.rng.standard_normal(v.shape))
            self.exact[w.id] = True
            self.note(w, "const weights")
            terms.append(self.apply(O.sum, self.apply(O.mul, v, w), None, (None, False)))
        loss = terms[0]
        for t in terms[1:]:
            loss = self.apply(O.add, loss, t)
        assert self.tape.backward(loss)
        return loss


# ── generators, one per shape rule ───────────────────────────────────────────

def static_of(op):
    """A static operand from the op's own cases (the scalar of adds, muls, pow, …)."""
    return sorted({case[2] for case in op.cases}, key=repr)


def gen_unary(g, op):
    assert op.kind == "elementwise", op
    g.apply(op, g.input(op, 0), None, g.pick(static_of(op)))


def gen_binary(g, op):
    k = g.int(0, 1)
    first = g.input(op, k)
    other = g.input(op, 1 - k, shape=g.part(g.grow(first.shape)))
    a, b = (first, other) if k == 0 else (other, first)
    g.apply(op, a, b, g.pick(static_of(op)))


def gen_where(g, op):
    k = g.int(0, 1)
    first = g.input(op, k)
    out = g.grow(first.shape, lead=0.5)
    other = g.input(op, 1 - k, shape=g.part(out))
    a, b = (first, other) if k == 0 else (other, first)
    m = g.rng.random(g.part(out, drop=0.6)) < g.pick((0.2, 0.4, 0.5, 0.6, 0.8) if g.coin(0.9) else (0.0, 1.0))
    g.apply(op, a, b, None, g.data(m, "mask"))


def gen_select(g, op):
    """select by a float mask the graph computes (a comparison of a value there) or draws (0/1 leaves)."""
    k = g.int(0, 1)
    first = g.input(op, k)
    out = g.grow(first.shape, lead=0.5)
    other = g.input(op, 1 - k, shape=g.part(out))
    a, b = (first, other) if k == 0 else (other, first)
    mshape = g.part(out, drop=0.6)
    if g.coin(0.7):
        x = g.input(O.route.greater, 0, shape=mshape)
        m = g.apply(g.pick((O.route.greater, O.route.greater_equal, O.route.not_equal)), x,
                    g.leaf(O.route.few, (), param=False))
    else:
        m = g.input(op, 2, shape=mshape)
    g.apply(op, a, b, None, m)


def gen_with_grad(g, op):
    a = g.input(op, 0)
    g.apply(op, a, g.input(op, 1, shape=a.shape))


def gen_reduce(g, op):
    x = g.input(op, 0)
    nd = len(x.shape)
    axes = None if g.coin(0.2) else tuple(k for k in range(nd) if g.coin(0.5))
    if op.name in MINUS_INF and nd and g.coin(0.3):
        x = g.masked(x, axes)
    g.apply(op, x, None, (axes, g.coin()))


def gen_axis(g, op):
    x = g.input(op, 0, ok=lambda s: len(s) >= 1)
    axis = g.int(0, len(x.shape) - 1)
    if op.name in MINUS_INF and g.coin(0.4):
        x = g.masked(x, (axis,))
    g.apply(op, x, None, axis)


def gen_scan(g, op):
    x = g.input(op, 0, ok=lambda s: len(s) >= 1)
    g.apply(op, x, None, (g.int(0, len(x.shape) - 1), g.coin()))


def gen_sort(g, op):
    x = g.input(op, 0, ok=lambda s: len(s) >= 1)
    g.apply(op, x, None, g.int(0, len(x.shape) - 1))


def gen_xent(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    g.apply(op, a, g.input(op, 1, shape=a.shape), g.int(0, len(a.shape) - 1))


def gen_matmul(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) == 2)
    g.apply(op, a, g.input(op, 1, shape=(a.shape[1], g.pick(SIDES))))


def gen_bmm(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) == 3 and math.prod(s) <= 64)
    g.apply(op, a, g.input(op, 1, shape=(a.shape[0], a.shape[2], g.pick((1, 2, 3, 4)))))


def gen_transpose(g, op):
    x = g.input(op, 0)
    perm = list(range(len(x.shape)))
    g.rnd.shuffle(perm)
    g.apply(op, x, None, tuple(perm))


def gen_reshape(g, op):
    x = g.input(op, 0)
    n, f, primes = math.prod(x.shape), 2, []
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    g.rnd.shuffle(primes)
    dims = [1] * g.int(1, 3)
    for p in primes:
        dims[g.int(0, len(dims) - 1)] *= p
    g.apply(op, x, None, tuple(dims if g.coin(0.7) else [d for d in dims if d > 1]))


def gen_broadcast_to(g, op):
    x = g.input(op, 0)
    g.apply(op, x, None, g.grow(x.shape))


def gen_slice(g, op):
    x = g.input(op, 0, ok=lambda s: len(s) >= 1)
    s = []
    for n in x.shape:
        st = g.pick((1, 1, 2, 3, -1, -2))
        lo = g.int(0, n - 1)
        s.append((lo, g.int(lo + 1, n), st) if st > 0 else (lo, g.int(-1, lo - 1), st))
    g.apply(op, x, None, tuple(s))


def gen_concat(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    axis = g.int(0, len(a.shape) - 1)
    shape = a.shape[:axis] + (g.pick((1, 2, 3)),) + a.shape[axis + 1:]
    b = g.input(op, 1, shape=shape)
    g.apply(op, *((a, b) if g.coin() else (b, a)), axis)


def indices(g, n, shape):
    """Indices in [−n, n) drawn from a few values: repeats, and the same element as j and j − n."""
    pool = g.rng.integers(-n, n, g.int(1, 3))
    return g.rng.choice(pool, shape)


def gen_take(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    axis = g.int(0, len(a.shape) - 1)
    rest = math.prod(a.shape) // a.shape[axis]
    idx = indices(g, a.shape[axis], g.shape(0, 2, cap=max(1, CAP // rest)))
    g.apply(op, a, g.data(idx, "indices"), axis)


def gen_along(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    axis = g.int(0, len(a.shape) - 1)
    shape = a.shape[:axis] + (g.pick((1, 2, 3, 5)),) + a.shape[axis + 1:]
    g.apply(op, a, g.data(indices(g, a.shape[axis], shape), "indices"), axis)


def gen_scatter(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    axis = g.int(0, len(a.shape) - 1)
    rest = math.prod(a.shape) // a.shape[axis]
    idx = indices(g, a.shape[axis], g.shape(0, 2, cap=max(1, CAP // rest)))
    b = g.input(op, 1, shape=a.shape[:axis] + idx.shape + a.shape[axis + 1:])
    g.apply(op, a, b, axis, g.data(idx, "indices"))


def starts(g, shape):
    return np.array([g.int(-n - 2, n + 2) for n in shape])


def gen_dslice(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    sizes = tuple(g.int(1, n) for n in a.shape)
    g.apply(op, a, g.data(starts(g, a.shape), "starts"), sizes)


def gen_dus(g, op):
    a = g.input(op, 0, ok=lambda s: len(s) >= 1)
    b = g.input(op, 1, shape=tuple(g.int(1, n) for n in a.shape))
    g.apply(op, a, b, None, g.data(starts(g, a.shape), "starts"))


def gen_conv(g, op):
    nsp, groups = g.int(1, 2), g.int(1, 2)
    cg, og = g.int(1, 2), g.int(1, 2)
    ks = [g.int(1, 3) for _ in range(nsp)]
    sp = [g.int(1, 5) for _ in range(nsp)]
    st_ = tuple(g.int(1, 2) for _ in range(nsp))
    ld = tuple(g.int(1, 2) for _ in range(nsp))
    rd = tuple(g.int(1, 2) for _ in range(nsp))
    pads = [[g.int(0, 2), g.int(0, 2)] for _ in range(nsp)]
    for d in range(nsp):   # widen the padding until the dilated kernel fits
        while (sp[d] - 1) * ld[d] + 1 + sum(pads[d]) < (ks[d] - 1) * rd[d] + 1:
            pads[d][1] += 1
    last = g.coin()
    c, o = groups * cg, groups * og
    xs = (2,) + tuple(sp) + (c,) if last else (2, c) + tuple(sp)
    ws = tuple(ks) + (cg, o) if last else (o, cg) + tuple(ks)
    s = ("NHWC" if last else "NCHW", st_, tuple(map(tuple, pads)), ld, rd, groups)
    g.apply(op, g.input(op, 0, shape=xs), g.input(op, 1, shape=ws), s)


def gen_pool(g, op):
    x = g.input(op, 0, ok=lambda s: 1 <= len(s) and math.prod(s) <= 128)
    pads = tuple((g.int(0, 1), g.int(0, 1)) for _ in x.shape)
    win = tuple(g.int(1, min(3, n + lo + hi)) for n, (lo, hi) in zip(x.shape, pads))
    g.apply(op, x, None, (win, tuple(g.int(1, 2) for _ in x.shape), pads))


def square(g, op, k=0):
    n = g.int(1, 5)
    return g.input(op, k, shape=(() if g.coin(0.6) else (g.int(1, 3),)) + (n, n))


def gen_matrix(g, op):
    g.apply(op, square(g, op))


def gen_trisolve(g, op):
    a = square(g, op)
    left, lower, trans, unit = (g.coin() for _ in range(4))
    k = a.shape[-1]
    b = g.input(op, 1, shape=a.shape[:-2] + ((k, g.int(1, 4)) if left else (g.int(1, 4), k)))
    g.apply(op, a, b, (left, lower, trans, unit))


def gen_solve(g, op):
    a = square(g, op)
    g.apply(op, a, g.input(op, 1, shape=a.shape[:-1] + (g.int(1, 4),)))


GENERATORS = {
    O.same: gen_unary, O.broadcast: gen_binary, O.index.where_shape: gen_where, O.reduced: gen_reduce,
    O.axis_shape: gen_axis, O.scan.scan_shape: gen_scan, O.scan.sort_shape: gen_sort, O.xent_shape: gen_xent,
    O.matmul_shape: gen_matmul, O.bmm_shape: gen_bmm, O.transpose_shape: gen_transpose,
    O.reshape_shape: gen_reshape, O.broadcast_to_shape: gen_broadcast_to, O.slice_shape: gen_slice,
    O.concat_shape: gen_concat, O.index.take_shape: gen_take, O.index.along_shape: gen_along,
    O.index.scatter_shape: gen_scatter, O.index.dslice_shape: gen_dslice, O.index.dus_shape: gen_dus,
    O.conv.conv_shape: gen_conv, O.conv.pool_shape: gen_pool, O.linalg.cholesky_shape: gen_matrix,
    O.linalg.logdet_shape: gen_matrix, O.linalg.trisolve_shape: gen_trisolve, O.linalg.solve_shape: gen_solve,
    O.route.select_shape: gen_select, O.route.with_grad_shape: gen_with_grad,
}
GENERATED = [op for op in O.OPS.values() if op.arity and op.shape in GENERATORS and op.name not in NOT_GENERATED]
FAMILIES = {rule: [op for op in GENERATED if op.shape is rule] for rule in GENERATORS}
FAMILIES = {rule: ops for rule, ops in FAMILIES.items() if ops}
SELECTS = [op for op in GENERATED if "b" in op.inputs]


# ── the comparisons ──────────────────────────────────────────────────────────

def exactness(tape, loss):
    """Per node: (value exact, gradient exact) as the module docstring defines them."""
    nodes = tape.nodes
    vex = []
    for n in nodes:
        ins = [i for i in (n.a, n.b, n.c) if i >= 0]
        vex.append(not n.op.arity or (n.op.tier in EXACT and all(vex[i] for i in ins)))
    gex, reached = [True] * len(nodes), {loss.id}
    for k in range(len(nodes) - 1, -1, -1):
        n = nodes[k]
        if k not in reached or not n.op.arity:
            continue
        ok = gex[k] and vex[k]
        for i in (n.a, n.b):
            if i >= 0 and nodes[i].req:
                reached.add(i)
                gex[i] = gex[i] and ok
    return vex, gex


def same(got, want):
    return np.array_equal(got, want, equal_nan=True)


def split(got, want):
    """(finite entries of got, of want), or None where the non-finite entries differ."""
    got, want = np.asarray(got), np.asarray(want)
    fin = np.isfinite(want)
    if not np.array_equal(fin, np.isfinite(got)) or not np.array_equal(got[~fin], want[~fin], equal_nan=True):
        return None
    return got[fin], want[fin]


def tier_ok(op, got, want):
    parts = split(got, want)
    return parts is not None and within(op.tier, *parts, op.ulps)


def near(got, want):
    """Downstream of a libm/blas node: |got − want| <= RTOL·max(1, max|want|), non-finite entries equal.
    Inputs are O(1) (``BOUND``) and a subgraph ~12 nodes deep; a libm op is within 8 ulp (~1e-15)
    relative, and no op here amplifies that by 1e6 (kinked ops only read exact values), while a kernel
    bug is an O(1) error."""
    parts = split(got, want)
    if parts is None:
        return False
    got, want = parts
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    return bool(np.all(np.abs(got - want) <= RTOL * scale))


def describe(got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shapes {got.shape} vs {want.shape}"
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    with np.errstate(invalid="ignore"):
        worst = np.nanmax(np.abs(np.where(bad, got - want, 0.0))) if bad.any() else 0.0
    at = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else ()
    return (f"{int(bad.sum())}/{got.size} elements differ, max |Δ| {worst:.3g}; at {at}: got "
            f"{got[at] if got.ndim else got!r}, want {want[at] if want.ndim else want!r}")


def check(g, loss):
    """Every comparison of the module docstring, over every node; one AssertionError listing the first
    failures and the whole graph."""
    tape = g.tape
    progs = {"numpy": tg.capture(tape, loss)}
    for fuse in (False, True):
        progs[fuse] = tg.capture(tape, loss, backend="native", fuse=fuse, **NOVERIFY)
    for p in progs.values():
        p.forward()
        p.backward()
    vex, gex = exactness(tape, loss)
    nodes = tape.nodes
    fails = []
    for k, v in sorted(g.vars.items()):
        n = nodes[k]
        what = [("value", tape.value, vex[k])]
        if n.op is not O.data:
            what.append(("grad", tape.grad, gex[k]))
        for kind, read, exact in what:
            want = read(v)
            got = {name: getattr(p, kind)(v) for name, p in progs.items()}
            claims = [("numpy replay == tape", same(got["numpy"], want), got["numpy"], want),
                      ("fused == unfused", same(got[True], got[False]), got[True], got[False])]
            first = kind == "value" and n.op.arity and n.op.tier not in EXACT and all(
                vex[i] for i in (n.a, n.b, n.c) if i >= 0)
            if exact:
                claims.append(("native == tape", same(got[True], want), got[True], want))
            elif first:
                claims.append((f"native within the {n.op.tier} tier", tier_ok(n.op, got[True], want), got[True], want))
            else:
                claims.append((f"native within {RTOL:g} of the tape", near(got[True], want), got[True], want))
            fails += [f"n{k} {n.op.name} {kind}: {claim} fails: {describe(x, y)}"
                      for claim, ok, x, y in claims if not ok]
    assert not fails, "\n".join(fails[:12] + ["graph:"] + g.lines)


# ── the tests ────────────────────────────────────────────────────────────────

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])
EXAMPLES = 10    # two C builds each, ~3-8 s on two busy cores: the file runs in about a minute and a half


def test_every_registry_op_is_generated_or_listed():
    ops = [op for op in O.OPS.values() if op.arity]
    missing = [op.name for op in ops if op.shape not in GENERATORS and op.name not in NOT_GENERATED]
    assert not missing, f"ops with no generator (add one to GENERATORS, or to NOT_GENERATED with the reason): {missing}"
    assert set(NOT_GENERATED) <= {op.name for op in ops}, "NOT_GENERATED names an op the registry lacks"
    assert set(MINUS_INF) <= {op.name for op in GENERATED}
    assert len(GENERATED) + len(NOT_GENERATED) == len(ops)


@pytest.mark.parametrize("op", GENERATED, ids=lambda o: o.name)
@np.errstate(invalid="ignore", divide="ignore", over="ignore")
def test_each_generator_builds_its_op_and_the_numpy_replay_is_the_tape(op):
    """Cheap (no build): each generator, a few times, makes nodes the tape accepts, with the NumPy replay
    bit-identical to the tape."""
    for seed in range(4):
        g = Graph(random.Random(seed), seed)
        for _ in range(3):
            GENERATORS[op.shape](g, op)
        assert any(g.tape.nodes[i].op is op for i in g.vars)
        loss = g.close()
        prog = tg.capture(g.tape, loss)
        prog.forward()
        prog.backward()
        for i, v in g.vars.items():
            assert same(prog.value(v), g.tape.value(v)), (op.name, i, "\n".join(g.lines))
            if g.tape.nodes[i].op is not O.data:
                assert same(prog.grad(v), g.tape.grad(v)), (op.name, i, "\n".join(g.lines))


@pytest.mark.matrix
@settings(max_examples=2, **SLOW)   # the first is always the simplest draw: the second a random one
@given(rnd=st.randoms(use_true_random=True), seed=st.integers(0, 2**32 - 1))
@np.errstate(invalid="ignore", divide="ignore", over="ignore")
def test_every_op_once_in_one_random_program(rnd, seed):
    """Every generated op, once each in a random order, chained through earlier values: one program."""
    g = Graph(rnd, seed)
    order = list(GENERATED)
    rnd.shuffle(order)
    for op in order:
        GENERATORS[op.shape](g, op)
    check(g, g.close())


@pytest.mark.matrix
@settings(max_examples=EXAMPLES, **SLOW)
@given(rnd=st.randoms(use_true_random=True), seed=st.integers(0, 2**32 - 1))
@np.errstate(invalid="ignore", divide="ignore", over="ignore")
def test_random_graphs_native_fused_unfused_numpy_and_tape_agree(rnd, seed):
    g = Graph(rnd, seed)
    for _ in range(rnd.randint(2, 6)):
        g.subgraph(rnd.randint(1, 10))
    check(g, g.close())
