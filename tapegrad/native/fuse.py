"""The fusion planner (seed ``gpfuse``): maximal runs of row-local elementwise nodes, one loop each.

A node is row-local here when it is an elementwise registry op (it has C expressions) whose output
has the run's shape; its other operands may be whole leaves or broadcast rows (``[c]``, ``[1]``), read
only. Matmuls stay on BLAS and end a run (on the CPU a GEMM is the whole cost; fusing it would mean
writing one). Backward runs additionally require that every gradient the node writes has the run's
shape, so no contribution needs the cross-row reduction of a broadcast input inside the loop — except
``g`` itself flowing into a broadcast input (a bias), which is reduced straight from g after the loop.
A fused loop performs exactly the unfused loops' arithmetic, element by element, in node order. It
writes a value or gradient to memory unless ``registers`` finds that nothing outside the loop reads
it: then it lives in a local for one iteration (a GELU's dozen intermediates wrote 1.8 MB per step).

What pays on the CPU (measured, ``-O3 -march=native``, 64² to 2048×1024 float64): fusing arithmetic
(+ − × ÷, comparisons, sqrt, fabs: vector instructions) is 1.4-1.7x faster than separate loops, forward
and backward, because each vectorised pass saves a round trip through memory. A libm call (log, pow,
erf…) inside a fused loop makes it 1.4-1.8x slower: the call cannot vectorise and spills every live
value around it, where unfused the call loop runs alone and the arithmetic loops stay vectorised. So an
expression that calls libm is never fused; it runs alone between fused runs. exp and tanh are the
runtime's own (runtime_vmath.c), arithmetic that vectorises, and fuse like the rest; so do log and erf
in a float32 program (the runtime's float ones; in float64 they are the C library's).
"""
from .codegen import expr_of
from .expr import VECTOR_MATH, VECTOR_MATH32, calls, names

# functions that are vector code: single instructions (with -fno-math-errno), and the runtime's exp and
# tanh (runtime_vmath.c; float32: log and erf too), plain arithmetic the compiler widens like the rest of the loop
_VECTOR = {"sqrt", "fabs"} | set(VECTOR_MATH)
_VECTOR32 = {"sqrt", "fabs"} | set(VECTOR_MATH32)


def _ew(op, field, libm=False, vector=_VECTOR):
    if op.kind != "elementwise" or getattr(op, field) is None:
        return False
    return libm or not (calls(expr_of(op, field)) - vector)


def _bwd_ok(op, field, target, shape, libm=False, vector=_VECTOR):
    """A backward contribution fits a fused loop when it is elementwise into a same-shape gradient, or
    when it is ``g`` itself into a broadcast input: that one is reduced from g's buffer right after
    the loop (g is final by then; the loop writes only same-shape gradients, never this one)."""
    if target == shape:
        return _ew(op, field, libm, vector)
    return getattr(op, field) is not None and expr_of(op, field) == ("var", "g")


def plan(prog, fuse=True, libm=False):
    """(forward segments: lists of node ids; backward segments: lists of schedule entries).

    ``libm=True`` fuses libm calls too: only for the benchmark that keeps this policy honest."""
    nodes, shapes = prog.nodes, prog.shapes
    vector = _VECTOR32 if str(prog.dtype) == "float32" else _VECTOR
    fwd = []
    for k in prog.compute:
        op = nodes[k][0]
        if fuse and fwd and _ew(op, "c_fwd", libm, vector) and _ew(nodes[fwd[-1][-1]][0], "c_fwd", libm, vector) \
                and shapes[k] == shapes[fwd[-1][-1]]:
            fwd[-1].append(k)
        else:
            fwd.append([k])
    bwd, fusable = [], set()
    for e in prog.sched:
        k, ta, _, tb, _ = e
        op, a, b, _ = nodes[k]
        ok = op.kind == "elementwise" and all(_bwd_ok(op, f, shapes[j], shapes[k], libm, vector) for to, f, j in
                                              ((ta, "c_da", a), (tb, "c_db", b)) if to)
        if fuse and ok and bwd and bwd[-1][-1][0] in fusable and shapes[bwd[-1][-1][0]] == shapes[k]:
            bwd[-1].append(e)
        else:
            bwd.append([e])
        if ok:
            fusable.add(k)
    return fwd, bwd


def report(prog, fwd, bwd):
    """What ``Program.plan()`` shows: segments and kernel counts before/after fusion."""
    return {
        "backend": "native",
        "fused": any(len(s) > 1 for s in fwd + bwd),
        "forward_segments": [(s[0], s[-1], len(s)) for s in fwd],
        "backward_segments": [(s[0][0], s[-1][0], len(s)) for s in bwd],
        "kernels_forward_unfused": len(prog.compute),
        "kernels_forward": len(fwd),
        "kernels_backward_unfused": len(prog.sched),
        "kernels_backward": len(bwd),
    }


_EXACT = ("exact", "order")
_NAME = {"out": 0, "a": 1, "b": 2, "c": 3}


def _backward_reads(prog):
    """(the nodes whose values some backward kernel reads, the entries whose rules read their own g):
    an elementwise rule reads the names it uses, any other node every operand and its output."""
    nodes, third = prog.nodes, prog.third
    read, reads_g = set(), set()
    for k, ta, _, tb, _ in prog.sched:
        op, a, b, _ = nodes[k]
        who = (k, a, b, third[k])
        if op.kind != "elementwise":
            read.update(j for j in who if j >= 0)
            continue
        for to, field in ((ta, "c_da"), (tb, "c_db")):
            if to and getattr(op, field) is not None:
                used = names(expr_of(op, field))
                read.update(who[_NAME[n]] for n in used if n in _NAME)
                if "g" in used:
                    reads_g.add(k)
    return read, reads_g


def registers(prog, fwd, bwd, views=None):
    """The values ("v", k) and gradients ("g", j) a fused loop keeps in a local instead of its buffer.

    A value qualifies when its node is exact-tier and every reader is in its own loop (not another
    kernel, not the backward, not the loss); a gradient when every contribution to it and its own
    rule run in one backward loop, all exact-tier, and no reduction after the loop reads its buffer.
    Exact-tier only, so first-run verification (``tapegrad.verify``), which recomputes what has no
    buffer from NumPy's rules, reproduces the local's bits and still checks every stored consumer at
    ``==``. Not a reshape view's buffer, nor one a view shares."""
    nodes, shapes, third = prog.nodes, prog.shapes, prog.third
    views = views or {}
    shared = set(views) | {(kind, r) for (kind, _), r in views.items()}
    out = set()
    in_seg = {k: i for i, seg in enumerate(fwd) if len(seg) > 1 for k in seg}
    backward, reads_g = _backward_reads(prog)
    outside, inside = set(), set()
    for m in prog.compute:
        for j in (nodes[m][1], nodes[m][2], third[m]):
            if j >= 0:
                (inside if in_seg.get(j, -1) == in_seg.get(m, -2) else outside).add(j)
    for k in in_seg:
        op = nodes[k][0]
        if (op.tier in _EXACT and op.keep is None and k in inside and k not in outside and k not in backward
                and k != prog.loss_id and ("v", k) not in shared):
            out.add(("v", k))
    seg_of = {e[0]: i for i, seg in enumerate(bwd) if len(seg) > 1 for e in seg}
    writers = {}        # j -> [(segment of the contributing entry, its op)]
    reduced = set()     # entries whose g a reduction after their loop reads (a bias receiving g itself)
    for k, ta, _, tb, _ in prog.sched:
        op, a, b, _ = nodes[k]
        for to, j, field in ((ta, a, "c_da"), (tb, b, "c_db")):
            if to:
                writers.setdefault(j, []).append((seg_of.get(k, -1), op))
                if k in seg_of and expr_of(op, field) == ("var", "g") and shapes[j] != shapes[k]:
                    reduced.add(k)
    for j, i in seg_of.items():
        w = writers.get(j, [])
        if (nodes[j][0].arity and j in reads_g and j not in reduced and ("g", j) not in shared and w
                and all(s == i and op.tier in _EXACT and op.keep is None for s, op in w)):
            out.add(("g", j))
    return out
