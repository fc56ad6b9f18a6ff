"""The fused backward (seed ``gpfuse``): a run of row-local backward steps as a row-space and a param-space kernel.

Row space: contributions that stay in the consumer's row — elementwise into a same-shape gradient,
matmul's ``da = g·bᵀ`` (row s of da needs row s of g), the spread of a full sum/mean. One kernel,
block = row s, threads stride the columns, one phase per schedule entry (a barrier between).
Param space: contributions that sum over rows — matmul's ``db = aᵀ·g`` and a bias's column sums.
One kernel after the row-space kernel, one phase per job, each target element in one thread.

Order safety: no gradient may collect contributions from both spaces inside one run (the split
runs every row-space contribution first, which would reorder them), and no gradient read by a
row-space step may be a param-space target. Each element is computed by the same expression, serial
order and intrinsics as the per-node kernels, so the fused backward is bit-identical to them.
"""
from .. import ordered


def _full_reduce(op, s):
    return op.name in ("sum", "mean", "sum_ordered", "mean_ordered") and s[0] is None


def jobs(g, entry):
    """(rows, [(space, kind, target, side, first)]) of one schedule entry, or None when it is not row-local."""
    p = g.p
    k, ta, fa, tb, fb = entry
    op, a, b, s = p.nodes[k]
    osh = p.shapes[k]
    out = []
    sides = [(side, j, first) for side, to, j, first in (("a", ta, a, fa), ("b", tb, b, fb)) if to]
    if op.kind == "elementwise" and len(osh) == 2 and p.third[k] < 0 and op.c_fwd is not None:
        for side, j, first in sides:
            js = p.shapes[j]
            if js == osh:
                out.append(("row", "ew", j, side, first))
            elif js in ((osh[1],), (1, osh[1])) and osh[0] > 1:
                out.append(("param", "colsum", j, side, first))
            else:
                return None
        return osh[0], out
    if op is ordered.matmul:
        for side, j, first in sides:
            out.append(("row", "mm_da", j, side, first) if side == "a" else ("param", "mm_db", j, side, first))
        return osh[0], out
    if _full_reduce(op, s) and len(p.shapes[a]) == 2:
        return p.shapes[a][0], [("row", "spread", j, side, first) for side, j, first in sides]
    return None


def segments(g):
    """Greedy maximal runs of the schedule that fuse safely (see the module docstring); singletons stay
    per-node. Returns a list of (entries, jobs per entry) pairs; ``jobs`` is None for a per-node entry."""
    out, cur = [], None
    for entry in g.p.sched:
        jb = jobs(g, entry) if g.fuse else None
        if jb is not None and cur is not None and jb[0] == cur["rows"] and _safe(cur, entry[0], jb[1]):
            _add(cur, entry, jb[1])
            continue
        if cur is not None:
            out.append(cur)
            cur = None
        if jb is not None:
            cur = {"rows": jb[0], "entries": [], "jobs": [], "row": set(), "param": set(), "nodes": set()}
            _add(cur, entry, jb[1])
        else:
            out.append({"entries": [entry], "jobs": None})
    if cur is not None:
        out.append(cur)
    return [s if s["jobs"] is None or len(s["entries"]) > 1 else {"entries": s["entries"], "jobs": None}
            for s in out]


def _safe(cur, k, jb):
    if k in cur["param"]:
        return False
    for space, _, j, _, _ in jb:
        if space == "row" and j in cur["param"]:
            return False
        if space == "param" and (j in cur["row"] or j in cur["nodes"]):
            return False
    return True


def _add(cur, entry, jb):
    cur["entries"].append(entry)
    cur["jobs"].append(jb)
    cur["nodes"].add(entry[0])
    for space, _, j, _, _ in jb:
        cur[space].add(j)


def launches(g, seg):
    """The row-space kernel and (when there are param-space jobs) the param-space kernel of one run."""
    p = g.p
    rows = seg["rows"]
    lo, hi = seg["entries"][0][0], seg["entries"][-1][0]
    row_phases, param_phases, widest = [], [], 1
    for entry, jb in zip(seg["entries"], seg["jobs"]):
        k = entry[0]
        op, a, b, s = p.nodes[k]
        lines = []
        for space, kind, j, side, first in jb:
            if space == "row":
                lines += _row_job(g, kind, k, op, a, b, s, j, side, first)
            else:
                n = g.n(j)
                widest = max(widest, n)
                param_phases.append(["const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;",
                                     f"if (i < {n}L) {{"] + ["    " + ln for ln in
                                                             _param_job(g, kind, k, op, a, b, s, j, side, first)] + ["}"])
        if lines:
            row_phases.append(lines)
    out = []
    if row_phases:
        out.append(g.kernel(f"br{lo}_{hi}", row_phases, rows, head=["const long s = blockIdx.x;"]))
    if param_phases:
        out.append(g.kernel(f"bp{lo}_{hi}", param_phases, max(1, -(-widest // 256))))
    return out


def _cols_loop(cols, body):
    return [f"for (long c = threadIdx.x; c < {cols}L; c += blockDim.x) {{", f"    const long i = s * {cols}L + c;"] + \
        ["    " + ln for ln in body] + ["}"]


def _row_job(g, kind, k, op, a, b, s, j, side, first):
    p = g.p
    if kind == "ew":
        e = g.ew_contribution(k, side)
        stmts = [g.put(f"g{j}[i]", e, first)]
        return _cols_loop(p.shapes[k][1], g.idx(p.shapes[k], stmts) + stmts)
    if kind == "mm_da":
        m, kk = p.shapes[a]
        n = p.shapes[b][1]
        return _cols_loop(kk, g.dot_lines(f"g{a}", f"g{k}", f"v{b}", "s", "c", n, (n, 1), (1, n), first))
    cols = p.shapes[a][1]
    return _cols_loop(cols, [g.put(f"g{a}[i]", g.spread_element(k), first)])


def _param_job(g, kind, k, op, a, b, s, j, side, first):
    p = g.p
    if kind == "mm_db":
        m, kk = p.shapes[a]
        n = p.shapes[b][1]
        return [f"const long r = i / {n}L, c = i % {n}L;"] + \
            g.dot_lines(f"g{b}", f"v{a}", f"g{k}", "r", "c", m, (1, kk), (n, 1), first)
    rows, cols = p.shapes[k]
    e = g.ew_contribution(k, side)
    inner = [f"const long i = r * {cols}L + o;"]
    body = g.idx(p.shapes[k], [e]) + [f"acc = {g.add('acc', e)};"]
    return ["const long o = i;", f"real acc = {g.d.lit(0.0)};",
            f"for (long r = 0; r < {rows}L; r++) {{"] + ["    " + ln for ln in inner + body] + ["}",
                                                                                          g.put(f"g{j}[o]", "acc", first)]
