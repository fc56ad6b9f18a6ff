"""The fusion planner (seed ``gpfuse``): maximal runs of row-local elementwise nodes, one loop each.

A node is row-local here when it is an elementwise registry op (it has C expressions) whose output
has the run's shape; its other operands may be whole leaves or broadcast rows (``[c]``, ``[1]``), read
only. Matmuls stay on BLAS and end a run (on the CPU a GEMM is the whole cost; fusing it would mean
writing one). Backward runs additionally require that every gradient the node writes has the run's
shape, so no contribution needs the cross-row reduction of a broadcast input inside the loop — except
``g`` itself flowing into a broadcast input (a bias), which is reduced straight from g after the loop.
Every node still writes its own value and gradient buffers, in node order, so a fused loop performs
exactly the unfused loops' arithmetic, element by element.

What pays on the CPU (measured, ``-O3 -march=native``, 64² to 2048×1024 float64): fusing arithmetic
(+ − × ÷, comparisons, sqrt, fabs: vector instructions) is 1.4-1.7x faster than separate loops, forward
and backward, because each vectorised pass saves a round trip through memory. A libm call (log, pow,
erf…) inside a fused loop makes it 1.4-1.8x slower: the call cannot vectorise and spills every live
value around it, where unfused the call loop runs alone and the arithmetic loops stay vectorised. So an
expression that calls libm is never fused; it runs alone between fused runs. exp and tanh are the
runtime's own (runtime_vmath.c), arithmetic that vectorises, and fuse like the rest.
"""
from .codegen import expr_of
from .expr import VECTOR_MATH, calls

# functions that are vector code: single instructions (with -fno-math-errno), and the runtime's exp and
# tanh (runtime_vmath.c), plain arithmetic the compiler widens like the rest of the loop
_VECTOR = {"sqrt", "fabs"} | set(VECTOR_MATH)


def _ew(op, field, libm=False):
    if op.kind != "elementwise" or getattr(op, field) is None:
        return False
    return libm or not (calls(expr_of(op, field)) - _VECTOR)


def _bwd_ok(op, field, target, shape, libm=False):
    """A backward contribution fits a fused loop when it is elementwise into a same-shape gradient, or
    when it is ``g`` itself into a broadcast input: that one is reduced from g's buffer right after
    the loop (g is final by then; the loop writes only same-shape gradients, never this one)."""
    if target == shape:
        return _ew(op, field, libm)
    return getattr(op, field) is not None and expr_of(op, field) == ("var", "g")


def plan(prog, fuse=True, libm=False):
    """(forward segments: lists of node ids; backward segments: lists of schedule entries).

    ``libm=True`` fuses libm calls too: only for the benchmark that keeps this policy honest."""
    nodes, shapes = prog.nodes, prog.shapes
    fwd = []
    for k in prog.compute:
        op = nodes[k][0]
        if fuse and fwd and _ew(op, "c_fwd", libm) and _ew(nodes[fwd[-1][-1]][0], "c_fwd", libm) \
                and shapes[k] == shapes[fwd[-1][-1]]:
            fwd[-1].append(k)
        else:
            fwd.append([k])
    bwd, fusable = [], set()
    for e in prog.sched:
        k, ta, _, tb, _ = e
        op, a, b, _ = nodes[k]
        ok = op.kind == "elementwise" and all(_bwd_ok(op, f, shapes[j], shapes[k], libm) for to, f, j in
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
