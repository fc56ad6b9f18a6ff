"""A captured program as one CUDA source: a kernel per node (or per fused row-local segment) and launch lists.

Every kernel has one signature, ``(const long long *vt, const double *ctl)``: ``vt`` is the pointer
table (buffer ``j``'s device address at ``vt[j]``; see ``CudaProgram.buffers``), ``ctl`` the small
control buffer of per-step host scalars (Adam's bias corrections), uploaded before each step, so a
captured CUDA graph of the whole episode never changes. Arithmetic is the registry's C expressions in
the CUDA dialect (``__dadd_rn``…: nvcc cannot contract them into FMAs); products and sums run serially
per output element in one thread:

- ordered mode (``tapegrad.ordered``): matmul is a serial dot over k, sums serial in index order —
  the same order as the ordered tape, so results are equal bit for bit;
- default mode: matmul is a cuBLAS call site (a ``gemm`` launch the runner executes with the device's
  BLAS: tier "blas"); a sum (and a gradient summed back over broadcast axes, in either mode) is in
  NumPy's order — each contiguous trailing block of summed axes pairwise, the blocks row by row — so
  it equals NumPy's and the native program's bit for bit.

Kernel bodies are phases separated by barriers. On the device ``TG_PHASE(n)`` is true and
``TG_BARRIER()`` is ``__syncthreads()``; the host emulation (``tapegrad.gpu.host``) runs phase ``n`` of
every block and thread before phase ``n + 1``. No thread reads another thread's writes of the same phase,
so running threads one after another within a phase is a faithful emulation.

Fused segments (the seed's ``gpfuse``): a maximal run of row-local forward nodes (elementwise nodes whose
operands are read at the same row, and ordered matmuls ``act[B,k] · W[k,n]`` with ``W`` computed before
the run) is ONE kernel: block = row, threads stride the columns, one phase per node, each node writing
its own buffer with the per-node kernel's expression — so fused == per-node bit for bit. Backward runs
of same-shape elementwise nodes (``tapegrad.native.fuse.plan``) fuse the same way.
"""
import math
import re
from typing import NamedTuple

from .. import ops as O
from .. import ordered
from . import device_runtime, rowspace
from . import source_conv, source_index, source_layout, source_linalg, source_reduce, source_scan
from ..errors import TapeError, at
from ..native.codegen import expr_of
from ..native.expr import RUNTIME_FUNCS, calls, dialect
from ..native.kernels import axis3, bstrides, keep, strides

THREADS = 256
SETTAB = 64   # table entries one settab launch can redirect
CLIP = 1000   # scratch buffers S1000 (per-parameter Σ g²) and S1001 (clipped?, scale) of gradient clipping


class Launch(NamedTuple):
    """One step of a launch list: a kernel (``name``, grid ``(x, y)``, block, phases) or a cuBLAS gemm
    (``gemm`` = (trans_a, trans_b, m, n, k, a, b, c) with buffer keys, row-major)."""
    kind: str
    name: str = ""
    grid: tuple = (1, 1)
    block: int = 1
    phases: int = 1
    gemm: tuple = ()


def device_form(op):
    """Whether the GPU backend has a kernel for ``op`` (else capture raises naming it)."""
    if op.kind == "elementwise":
        fields = ["c_fwd"] + [f for f, kind in zip(("c_da", "c_db"), op.inputs) if kind == "f"]
        exprs = [expr_of(op, f) for f in fields]
        return None not in exprs and not any(calls(e) & (RUNTIME_FUNCS - device_runtime.DEVICE_FUNCS) for e in exprs)
    return op.name in _FORWARD


class CudaProgram:
    """The CUDA source and launch lists of one ``Program`` (``prog.ordered`` picks the GEMM/sum order).

    ``buffers``: the pointer-table layout, a list of keys — ``("v", k)``/``("g", k)`` a node's value and
    gradient, ``("S", j)`` scratch, ``("M", k)``/``("N", k)`` Adam's moments of the k-th attached
    parameter. ``forward``/``backward``/``step``: launch lists. ``src``: the whole source.
    """

    def __init__(self, prog, fuse=True):
        self.p = prog
        self.fuse = bool(fuse)
        self.d = dialect(prog.dtype, "cuda")
        self.f32 = str(prog.dtype) == "float32"
        self.prefix = f"tg{prog.hash64:016x}{'f' if self.f32 else 'd'}{'F' if self.fuse else 'N'}_"
        self.buffers, self.index = [], {}
        self.kernels = []
        self.scratch_size = 1
        self.pairwise = False   # set when a kernel calls tg_pw (then its definition is emitted)
        self.sort_helper = False   # set when a kernel sorts (then tg_argsort_line is emitted)
        self.linalg = False   # set when a kernel calls the serial linear-algebra helpers (source_linalg)
        self.settab = f"{self.prefix}settab"
        for k in prog.compute:
            op = prog.nodes[k][0]
            if not device_form(op):
                raise TapeError(f"{at(op.name, k)}: the GPU backend has no device kernel for this op; "
                                f"use backend='native' or 'numpy'")
        self.forward = self._forward()
        self.backward = self._backward()
        self.step = self._step()
        self.src = self._source()

    # ── buffers and kernels ──────────────────────────────────────────────────

    def buf(self, key):
        if key not in self.index:
            self.index[key] = len(self.buffers)
            self.buffers.append(key)
        return self.index[key]

    def ctype(self, name):
        kind, k = name[0], int(name[1:])
        if kind == "v" and not self.p.nodes[k][0].arity and self.p.val[k].dtype.kind != "f":
            return "const unsigned char" if self.p.val[k].dtype.kind == "b" else "const long long"
        return "real"

    def kernel(self, tag, phases, grid, block=THREADS, head=()):
        """Add one kernel from its phases (lists of lines); returns its launch."""
        name = f"{self.prefix}{tag}"
        text = "\n".join(line for ph in phases for line in ph)
        used = sorted(set(re.findall(r"\b([vgSMN]\d+)\b", text)), key=lambda n: ("vgSMN".index(n[0]), int(n[1:])))
        decl = [f"    {self.ctype(n)} *__restrict__ {n} = ({self.ctype(n)} *)vt[{self.buf((n[0], int(n[1:])))}];"
                for n in used]
        body = [f'extern "C" __global__ void {name}(const long long *__restrict__ vt, const double *__restrict__ ctl)',
                "{"] + decl + ["    (void)vt;", "    (void)ctl;"] + ["    " + h for h in head]
        for j, ph in enumerate(phases):
            if j:
                body.append("    TG_BARRIER();")
            body += [f"    if (TG_PHASE({j})) {{"] + ["        " + line for line in ph] + ["    }"]
        self.kernels.append("\n".join(body + ["}", ""]))
        return Launch("kernel", name, grid if isinstance(grid, tuple) else (grid, 1), block, len(phases))

    def n(self, k):
        return math.prod(self.p.shapes[k])

    def gemm(self, tag, call):
        """A cuBLAS call site: ``call`` = (trans_a, trans_b, m, n, k, a, b, c), operands as buffer keys."""
        for key in call[5:]:
            self.buf(key)
        return Launch("gemm", f"{self.prefix}{tag}", gemm=call)

    def flat(self, tag, n, lines):
        """A one-phase kernel over ``n`` elements, one thread per element index ``i``."""
        return self.kernel(tag, [["const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;",
                                  f"if (i < {n}L) {{"] + ["    " + ln for ln in lines] + ["}"]],
                           max(1, -(-n // THREADS)))

    def operand(self, x, os_):
        xs = self.p.shapes[x]
        if xs == os_:
            return f"v{x}[i]"
        if math.prod(xs) == 1:
            return f"v{x}[0]"
        st = bstrides(xs, os_)
        return f"v{x}[" + " + ".join(f"i{d} * {m}L" for d, m in enumerate(st) if m) + "]"

    def idx(self, os_, stmts):
        """Per-axis indices ``i<d>`` of the flat index ``i`` that broadcast operands read."""
        text = " ".join(stmts)
        return [f"const long i{d} = (i / {st}L) % {m}L;" for d, (m, st) in enumerate(zip(os_, strides(os_)))
                if re.search(rf"\bi{d} \* ", text)]

    def add(self, x, y):
        return self.d.render(("bin", "+", ("var", "a"), ("var", "b")), {"a": x, "b": y})

    def mul(self, x, y):
        return self.d.render(("bin", "*", ("var", "a"), ("var", "b")), {"a": x, "b": y})

    def div(self, x, y):
        return self.d.render(("bin", "/", ("var", "a"), ("var", "b")), {"a": x, "b": y})

    def put(self, dst, e, first):
        """``dst = e`` for a first gradient contribution, else ``dst = dst + e`` (the tape's order)."""
        return f"{dst} = {e};" if first else f"{dst} = {self.add(dst, e)};"

    # ── forward ──────────────────────────────────────────────────────────────

    def _forward(self):
        launches = []
        for seg in self._forward_segments():
            if len(seg) > 1:
                launches.append(self._row_segment(seg))
            else:
                launches += self._node_forward(seg[0])
        return launches

    def _rowlocal(self, k, inseg, rows):
        p = self.p
        op, a, b, _ = p.nodes[k]
        sh = p.shapes[k]
        if len(sh) != 2 or (rows is not None and sh[0] != rows):
            return False
        if op.kind == "elementwise" and op.c_fwd is not None and p.third[k] < 0:
            return all(x < 0 or x not in inseg or p.shapes[x] in (sh, (sh[0], 1)) for x in (a, b))
        return op is ordered.matmul and b not in inseg

    def _forward_segments(self):
        segs = []
        for k in self.p.compute:
            cur = segs[-1] if segs else None
            rows = self.p.shapes[cur[0]][0] if cur and self.fuse and self._rowlocal(cur[0], set(), None) else None
            if rows is not None and self._rowlocal(k, set(cur), rows):
                cur.append(k)
            else:
                segs.append([k])
        return segs

    def ew_forward(self, k):
        """Lines computing elementwise node k's value at flat index ``i`` (per-node and fused kernels alike)."""
        p = self.p
        op, a, b, s = p.nodes[k]
        os_ = p.shapes[k]
        env = {"a": self.operand(a, os_), "b": self.operand(b, os_) if b >= 0 else None,
               "c": self.operand(p.third[k], os_) if p.third[k] >= 0 else None}
        stmts = [f"v{k}[i] = {self.d.render(expr_of(op, 'c_fwd'), env, s)};"]
        return self.idx(os_, stmts) + stmts

    def _row_element(self, k):
        """Lines computing node k's element at row ``s``, column ``c`` (flat index ``i``)."""
        p = self.p
        op, a, b, _ = p.nodes[k]
        if op is ordered.matmul:
            kk, nn = p.shapes[a][1], p.shapes[k][1]
            return self.dot_lines(f"v{k}", f"v{a}", f"v{b}", "s", "c", kk, (kk, 1), (nn, 1))
        return self.ew_forward(k)

    def _row_segment(self, seg):
        """Block = row s, threads stride the columns of each node in turn, a barrier between nodes."""
        p = self.p
        rows = p.shapes[seg[0]][0]
        phases = []
        for k in seg:
            cols = p.shapes[k][1]
            phases.append([f"for (long c = threadIdx.x; c < {cols}L; c += blockDim.x) {{",
                           f"    const long i = s * {cols}L + c;"] + ["    " + ln for ln in self._row_element(k)] + ["}"])
        return self.kernel(f"r{seg[0]}_{seg[-1]}", phases, rows, head=["const long s = blockIdx.x;"])

    def _node_forward(self, k):
        op, a, b, s = self.p.nodes[k]
        if op.kind == "elementwise":
            return [self.flat(f"f{k}", self.n(k), self.ew_forward(k))]
        return _FORWARD[op.name](self, k, op, a, b, s)

    def dot_lines(self, dst, A, B, r, c, kk, sa, sb, first=True):
        """dst[r, c] (+)= Σ_q A[r, q]·B[q, c] serially in q from 0 (``i`` = the flat index of dst)."""
        term = self.mul(f"{A}[{r} * {sa[0]}L + q * {sa[1]}L]", f"{B}[q * {sb[0]}L + {c} * {sb[1]}L]")
        return [f"real acc = {self.d.lit(0.0)};", f"for (long q = 0; q < {kk}L; q++) acc = {self.add('acc', term)};",
                self.put(f"{dst}[i]", "acc", first)]

    def dot(self, tag, dst, A, B, m, n, kk, sa, sb, first=True):
        """A per-node serial-dot kernel (``dot_lines``), one thread per element of dst (m, n)."""
        return self.flat(tag, m * n, [f"const long r = i / {n}L, c = i % {n}L;"]
                         + self.dot_lines(dst, A, B, "r", "c", kk, sa, sb, first))

    def reduce(self, tag, x, out, shape, axes, scale=None, first=True, numpy_order=False):
        """out[o] (+)= Σ x over ``axes``, then / ``scale``: serial, row-major over the reduced index —
        except, with ``numpy_order``, NumPy's order (the native runtime's ``tg_reduce``): the trailing
        block of reduced axes, contiguous, summed pairwise (``tg_pw``, its blocks of 8 and 128), and those
        block sums added serially in row-major order of the other reduced axes."""
        # axes of length 1 dropped, as NumPy's iterator (and tg_reduce) drop them: (4, 9, 1) over axis 1
        # is a pairwise sum of rows of 9
        red = [1 if d in axes else 0 for d in range(len(shape)) if shape[d] != 1]
        shape = [m for m in shape if m != 1]
        t = len(shape)
        while t and red[t - 1]:
            t -= 1
        inner = math.prod(shape[t:]) if numpy_order else 1
        if inner > 1:   # the same reduction over the blocks, each block one tg_pw
            self.pairwise = True
            shape, red = shape[:t], red[:t]
        st = strides(shape)
        kept = [(m, s) for m, s, r in zip(shape, st, red) if not r]
        rd = [(m, s) for m, s, r in zip(shape, st, red) if r]
        nout, nred = math.prod(m for m, _ in kept), math.prod(m for m, _ in rd)

        def offset(var, dims):
            terms, div = [], 1
            for m, s in reversed(dims):
                terms.append(f"(({var} / {div}L) % {m}L) * {s}L")
                div *= m
            return " + ".join(terms) or "0L"

        if inner > 1 and nred == 1:   # only the trailing block: one tg_pw per output element
            lines = [f"real acc = {self.add(self.d.lit(0.0), f'tg_pw({x} + i * {inner}L, {inner}L)')};"]
        else:
            e = f"tg_pw({x} + (base + {offset('r', rd)}) * {inner}L, {inner}L)" if inner > 1 else \
                f"{x}[base + {offset('r', rd)}]"
            lines = [f"const long base = {offset('i', kept)};", f"real acc = {self.d.lit(0.0)};",
                     f"for (long r = 0; r < {nred}L; r++) acc = {self.add('acc', e)};"]
        if scale is not None:
            lines.append(f"acc = {self.div('acc', self.d.lit(float(scale)))};")
        lines.append(self.put(f"{out}[i]", "acc", first))
        return self.flat(tag, nout, lines)

    def gather(self, tag, dst, src, shape, st, first=True, scale=None):
        """dst[i] (+)= src[Σ i_d·st_d] (/ scale) over ``shape``."""
        os_ = tuple(shape)
        terms = " + ".join(f"((i / {t}L) % {m}L) * {s_}L" for m, t, s_ in zip(os_, strides(os_), st) if s_) or "0L"
        e = f"{src}[{terms}]"
        if scale is not None:
            e = self.div(e, self.d.lit(float(scale)))
        return self.flat(tag, math.prod(os_), [self.put(f"{dst}[i]", e, first)])

    # ── backward ─────────────────────────────────────────────────────────────

    def _backward(self):
        p = self.p
        out = [self.flat("seed", self.n(p.loss_id), [f"g{p.loss_id}[i] = {self.d.lit(1.0)};"])]
        for run in rowspace.segments(self):
            if run["jobs"] is not None:
                out += rowspace.launches(self, run)
                continue
            seg = run["entries"]
            if p.nodes[seg[0][0]][0].kind == "elementwise":
                out += self._ew_backward(seg)
            else:
                k, ta, fa, tb, fb = seg[0]
                op = p.nodes[k][0]
                if op.name not in _BACKWARD:
                    raise TapeError(f"{at(op.name, k)}: the GPU backend has no backward kernel for this op")
                for side, to, first in (("a", ta, fa), ("b", tb, fb)):
                    if to:
                        out += _BACKWARD[op.name](self, k, side, first)
        return out

    def ew_contribution(self, k, side):
        """The C expression of elementwise node k's contribution to its input ``side`` at flat index i."""
        p = self.p
        op, a, b, s = p.nodes[k]
        os_ = p.shapes[k]
        env = {"g": f"g{k}[i]", "out": f"v{k}[i]", "a": self.operand(a, os_),
               "b": self.operand(b, os_) if b >= 0 else None,
               "c": self.operand(p.third[k], os_) if p.third[k] >= 0 else None}
        return self.d.render(expr_of(op, "c_da" if side == "a" else "c_db"), env, s)

    def spread_element(self, k):
        """A full sum/mean's gradient element: g (divided by the count for mean)."""
        op, a, _, s = self.p.nodes[k]
        e = f"g{k}[0L]"
        return self.div(e, self.d.lit(float(O.count(self.p.shapes[a], s)))) if op.name.startswith("mean") else e

    def _ew_backward(self, seg):
        p = self.p
        k0 = seg[0][0]
        os_ = p.shapes[k0]
        phases, after = [], []
        for k, ta, fa, tb, fb in seg:
            op, a, b, s = p.nodes[k]
            stmts = []
            for to, first, j, field, scr in ((ta, fa, a, "c_da", 0), (tb, fb, b, "c_db", 1)):
                if not to:
                    continue
                e = self.ew_contribution(k, field[-1])
                if p.shapes[j] == os_:
                    stmts.append(self.put(f"g{j}[i]", e, first))
                elif e == f"g{k}[i]":
                    after.append((f"g{k}", j, first, f"u{k}{field[-1]}"))
                else:
                    stmts.append(f"S{scr}[i] = {e};")
                    after.append((f"S{scr}", j, first, f"u{k}{field[-1]}"))
                    self.scratch(scr, self.n(k))
            if stmts:
                phases.append(self.idx(os_, stmts) + stmts)
        n = math.prod(os_)
        launches = []
        if phases:
            body = [["const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;", f"if (i < {n}L) {{"]
                    + ["    " + ln for ln in ph] + ["}"] for ph in phases]
            launches.append(self.kernel(f"b{k0}_{seg[-1][0]}", body, max(1, -(-n // THREADS))))
        for src, j, first, tag in after:
            launches.append(self.unbroadcast(tag, src, os_, j, first))
        return launches

    def scratch(self, j, n):
        self.scratch_size = max(self.scratch_size, n)

    def unbroadcast(self, tag, src, cshape, j, first):
        """g_j (+)= src summed over the axes broadcasting stretched (row by row: NumPy's order for a bias)."""
        shape = self.p.shapes[j]
        lead = len(cshape) - len(shape)
        axes = [d for d in range(len(cshape)) if d < lead or (shape[d - lead] == 1 and cshape[d] != 1)]
        return self.reduce(tag, src, f"g{j}", cshape, axes, first=first, numpy_order=True)

    # ── the optimizer ────────────────────────────────────────────────────────

    def _step(self):
        o = self.p.opt
        if o is None:
            return []
        todo = [(j, i) for j, i in enumerate(o.ids) if o.touched[j]]
        clip = self._clip(o, todo) if o.clip is not None and todo else []
        if not self.fuse:
            return clip + [self.flat(f"opt{j}", self.n(i), self._update(o, j, i)) for j, i in todo]
        # fused: one launch for every parameter, blockIdx.y picks the parameter
        body = ["const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;"]
        for y, (j, i) in enumerate(todo):
            body += [f"if (blockIdx.y == {y}u && i < {self.n(i)}L) {{"] + \
                ["    " + ln for ln in self._update(o, j, i)] + ["}"]
        widest = max([self.n(i) for _, i in todo] + [1])
        return clip + [self.kernel("opt", [body], (max(1, -(-widest // THREADS)), max(1, len(todo))))] if todo else []

    def _gradient(self, o, j, i):
        """The gradient the update reads: g (+ l2·w, as ``tapegrad.optim.l2_grad``)."""
        lines = [f"real gi = g{i}[i];"]
        if o.l2[j]:
            lines.append(f"gi = {self.add('gi', self.mul(self.d.lit(float(o.l2[j])), f'v{i}[i]'))};")
        return lines

    def _clip(self, o, todo):
        """Global-norm clipping on the device: Σ gi² per parameter (serial, in index order; the CPU
        backends take one BLAS dot), the norm and the decision in double in registration order (one
        thread), into scratch ``S{CLIP}`` (per-parameter sums) and ``S{CLIP + 1}`` (clipped?, scale) that
        the update reads. Within the "blas" bound of the CPU backends, whose dot order BLAS chooses."""
        q, f = f"S{CLIP}", f"S{CLIP + 1}"
        self.scratch(CLIP, len(todo))
        self.scratch(CLIP + 1, 2)
        sums = ["const unsigned y = blockIdx.y;"]
        for y, (j, i) in enumerate(todo):
            sums += [f"if (y == {y}u) {{", f"    real acc = {self.d.lit(0.0)};", f"    for (long i = 0; i < {self.n(i)}L; i++) {{"]
            sums += ["        " + ln for ln in self._gradient(o, j, i)]
            sums += [f"        acc = {self.add('acc', self.mul('gi', 'gi'))};", "    }", f"    {q}[y] = acc;", "}"]
        maxn = float(o.clip)
        decide = {"optax": "!(norm < maxn)", "seed": "norm > maxn", "torch": "!(maxn / (norm + 1e-6) >= 1.0)"}[o.clip_mode]
        scale = {"optax": "norm", "seed": "maxn / norm", "torch": "maxn / (norm + 1e-6)"}[o.clip_mode]
        norm = ["double total = 0.0;", f"for (int y = 0; y < {len(todo)}; y++)",
                f"    total = __dadd_rn(total, (double){q}[y]);",
                "const double norm = sqrt(total);", f"const double maxn = {maxn!r};",
                f"{f}[0] = ({decide}) ? (real)1.0 : (real)0.0;", f"{f}[1] = (real)({scale});"]
        return [self.kernel("clipsq", [sums], (1, len(todo)), 1), self.kernel("clipnorm", [norm], 1, 1)]

    def _update(self, o, j, i):
        """One parameter's update, operation by operation as ``tapegrad.optim`` (gradient + l2·w first,
        then the clip scale)."""
        lit, add, mul, div = self.d.lit, self.add, self.mul, self.div
        lines = self._gradient(o, j, i)
        if o.clip is not None:
            f = f"S{CLIP + 1}"
            scaled = mul(div("gi", f"{f}[1]"), lit(float(o.clip))) if o.clip_mode == "optax" else mul("gi", f"{f}[1]")
            lines.append(f"if ({f}[0] != {lit(0.0)}) gi = {scaled};")
        if o.kind == "SGD":
            return lines + [f"v{i}[i] = {self.d.render(('bin', '-', ('var', 'a'), ('var', 'b')), {'a': f'v{i}[i]', 'b': mul(lit(float(o.lr)), 'gi')})};"]
        c = o.conf
        b1, b2, c1, c2, eps = (lit(float(x)) for x in (c.b1, c.b2, 1.0 - c.b1, 1.0 - c.b2, c.eps))
        sqrt = "sqrtf" if self.f32 else "sqrt"
        lines += [f"real m = {add(mul(c1, 'gi'), mul(b1, f'M{j}[i]'))};" if c.eps_mode == "optax"
                  else f"real m = {add(mul(b1, f'M{j}[i]'), mul(c1, 'gi'))};",
                  f"M{j}[i] = m;",
                  f"real t = {mul(c2, mul('gi', 'gi'))};",
                  f"real v = {add('t', mul(b2, f'N{j}[i]'))};" if c.eps_mode == "optax"
                  else f"real v = {add(mul(b2, f'N{j}[i]'), 't')};",
                  f"N{j}[i] = v;"]
        if c.eps_mode == "optax":
            return lines + [f"t = {add(f'{sqrt}(' + div('v', '(real)ctl[2]') + ')', eps)};",
                            f"real u = {div(div('m', '(real)ctl[1]'), 't')};",
                            f"v{i}[i] = {add(f'v{i}[i]', mul('(real)ctl[0]', 'u'))};"]
        return lines + [f"t = {add(f'{sqrt}(v)', eps)};",
                        f"v{i}[i] = {self.d.render(('bin', '-', ('var', 'a'), ('var', 'b')), {'a': f'v{i}[i]', 'b': mul('(real)ctl[0]', div('m', 't'))})};"]

    # ── the source ───────────────────────────────────────────────────────────

    def _source(self):
        real = "float" if self.f32 else "double"
        return "\n".join([
            f"/* generated by tapegrad.gpu.source: program {self.p.hash64:016x}, {self.p.dtype}, "
            f"{'ordered' if self.p.ordered else 'default order'}, {'fused' if self.fuse else 'per-node'} (do not edit) */",
            f"typedef {real} real;",
            "#ifndef TG_HOST",
            "#define TG_PHASE(n) 1",
            "#define TG_BARRIER() __syncthreads()",
            "#endif",
            "#ifndef INFINITY   /* NVRTC includes no math.h */",
            "#define INFINITY __int_as_float(0x7f800000)",
            "#endif",
            "#ifndef NAN",
            "#define NAN __int_as_float(0x7fffffff)",
            "#endif",
            ""] + (device_runtime.source() if device_runtime.needed(self.kernels) else [])
            + (source_linalg.helpers(self.f32) if self.linalg else [])
            + (self._pairwise() if self.pairwise else []) + (source_scan.argsort_source() if self.sort_helper
                                                                  else []) + self.kernels + [
            "#ifndef TG_HOST",
            "/* settab: point table entries at other buffers (an XLA custom call's operands), before a graph replay;",
            "   the addresses travel as a by-value kernel parameter, so nothing on the host outlives the launch */",
            f"struct {self.prefix}tab {{ long long idx[{SETTAB}]; long long ptr[{SETTAB}]; int n; }};",
            f'extern "C" __global__ void {self.settab}(long long *__restrict__ vt, const {self.prefix}tab tab)',
            "{",
            "    for (int j = threadIdx.x; j < tab.n; j += blockDim.x)",
            "        vt[tab.idx[j]] = tab.ptr[j];",
            "}",
            "#endif", ""])

    def _pairwise(self):
        """NumPy's pairwise summation of a contiguous block (``DOUBLE_pairwise_sum``), one thread."""
        add, z = self.add, self.d.lit(0.0)
        return ["__device__ static real tg_pw(const real *a, long n)", "{",
                "    if (n < 8) {", f"        real res = {z};",
                f"        for (long i = 0; i < n; i++) res = {add('res', 'a[i]')};", "        return res;", "    }",
                "    if (n <= 128) {", "        real r[8];", "        long i;",
                "        for (int j = 0; j < 8; j++) r[j] = a[j];",
                "        for (i = 8; i < n - (n % 8); i += 8)",
                f"            for (int j = 0; j < 8; j++) r[j] = {add('r[j]', 'a[i + j]')};",
                f"        real res = {add(add(add('r[0]', 'r[1]'), add('r[2]', 'r[3]')), add(add('r[4]', 'r[5]'), add('r[6]', 'r[7]')))};",
                f"        for (; i < n; i++) res = {add('res', 'a[i]')};", "        return res;", "    }",
                "    long n2 = n / 2;", "    n2 -= n2 % 8;",
                f"    return {add('tg_pw(a, n2)', 'tg_pw(a + n2, n - n2)')};", "}", ""]

    def operand_slots(self):
        """The table entry of each operand of the GPU episode custom call — params, Adam's moments
        (mu_j, nu_j per attached parameter), -1 for the step count, inputs; -1 where no kernel reads the
        operand — and the loss's entry (``interop.xla.gpu_call``)."""
        p, o = self.p, self.p.opt
        out = [self.index.get(("v", k), -1) for k in p.params]
        if o is not None and o.kind == "Adam":
            for j in range(len(o.ids)):
                out += [self.index.get(("M", j), -1), self.index.get(("N", j), -1)]
        out.append(-1)   # count: read by the handler, never by a kernel
        out += [self.index.get(("v", k), -1) for k in p.consts]
        return out, self.index[("v", p.loss_id)]

    def launches(self):
        """Kernel launches per episode (forward + backward + step; cuBLAS calls counted as one each)."""
        return len(self.forward) + len(self.backward) + len(self.step)


# ── non-elementwise nodes ────────────────────────────────────────────────────

def _matmul_fwd(g, k, op, a, b, s):
    m, kk = g.p.shapes[a]
    n = g.p.shapes[b][1]
    if op is ordered.matmul:
        return [g.dot(f"f{k}", f"v{k}", f"v{a}", f"v{b}", m, n, kk, (kk, 1), (n, 1))]
    return [g.gemm(f"gemm{k}", (0, 0, m, n, kk, ("v", a), ("v", b), ("v", k)))]


def _matmul_d(g, k, side, first):
    p = g.p
    op, a, b, _ = p.nodes[k]
    m, kk = p.shapes[a]
    n = p.shapes[b][1]
    j = a if side == "a" else b
    if op is ordered.matmul:
        if side == "a":   # g @ bᵀ, serial over the output columns
            return [g.dot(f"da{k}", f"g{a}", f"g{k}", f"v{b}", m, kk, n, (n, 1), (1, n), first)]
        return [g.dot(f"db{k}", f"g{b}", f"v{a}", f"g{k}", kk, n, m, (1, kk), (n, 1), first)]
    dst = ("g", j) if first else ("S", 0)
    g.scratch(0, math.prod(p.shapes[j]))
    call = (0, 1, m, kk, n, ("g", k), ("v", b), dst) if side == "a" else (1, 0, kk, n, m, ("v", a), ("g", k), dst)
    out = [g.gemm(f"gemm_d{side}{k}", call)]
    if not first:
        out.append(g.flat(f"acc{side}{k}", math.prod(p.shapes[j]), [g.put(f"g{j}[i]", "S0[i]", False)]))
    return out


def _reduce_fwd(g, k, op, a, b, s):
    sh = g.p.shapes[a]
    axes = range(len(sh)) if s[0] is None else s[0]
    scale = O.count(sh, s) if op.name.startswith("mean") else None
    return [g.reduce(f"f{k}", f"v{a}", f"v{k}", sh, tuple(axes), scale, numpy_order=op is not ordered.sum_
                     and op is not ordered.mean)]


def _spread_da(g, k, side, first):
    p = g.p
    op, a, _, s = p.nodes[k]
    sh = p.shapes[a]
    scale = O.count(sh, s) if op.name.startswith("mean") else None
    return [g.gather(f"da{k}", f"g{a}", f"g{k}", sh, bstrides(keep(sh, s), sh), first, scale)]


def _reshape_fwd(g, k, op, a, b, s):
    return [g.flat(f"f{k}", g.n(k), [f"v{k}[i] = v{a}[i];"])]


def _reshape_da(g, k, side, first):
    a = g.p.nodes[k][1]
    return [g.flat(f"da{k}", g.n(k), [g.put(f"g{a}[i]", f"g{k}[i]", first)])]


def _transpose_fwd(g, k, op, a, b, s):
    st = strides(g.p.shapes[a])
    return [g.gather(f"f{k}", f"v{k}", f"v{a}", g.p.shapes[k], [st[j] for j in s])]


def _transpose_da(g, k, side, first):
    p = g.p
    a, s = p.nodes[k][1], p.nodes[k][3]
    inv = [s.index(d) for d in range(len(s))]
    st = strides(p.shapes[k])
    return [g.gather(f"da{k}", f"g{a}", f"g{k}", p.shapes[a], [st[d] for d in inv], first)]


def _broadcast_fwd(g, k, op, a, b, s):
    p = g.p
    return [g.gather(f"f{k}", f"v{k}", f"v{a}", p.shapes[k], bstrides(p.shapes[a], p.shapes[k]))]


def _broadcast_da(g, k, side, first):
    a = g.p.nodes[k][1]
    return [g.unbroadcast(f"da{k}", f"g{k}", g.p.shapes[k], a, first)]


def _xent_line(g, a, outer, m, inner, body):
    """One thread per softmax line (o, ii): the line's max and Σ exp(a − max) serially over j, then
    ``body`` (lines using ``p``, ``mx``, ``se``) for each element of the line."""
    d = g.d
    exp, log = "tg_exp", "tg_log"   # the native runtime's (runtime_vmath.c), as the native program's
    el = f"v{a}[(o * {m}L + j) * {inner}L + ii]"
    return [f"const long o = i / {inner}L, ii = i % {inner}L;",
            f"real mx = {el.replace('j)', '0L)')};",
            f"for (long j = 1; j < {m}L; j++) {{ const real x = {el}; if (x > mx || x != x) mx = x; }}",
            f"real se = {d.lit(0.0)};",
            f"for (long j = 0; j < {m}L; j++) se = {g.add('se', f'{exp}(' + g.d.render(('bin', '-', ('var', 'a'), ('var', 'b')), {'a': el, 'b': 'mx'}) + ')')};",
            f"for (long j = 0; j < {m}L; j++) {{",
            f"    const long p = (o * {m}L + j) * {inner}L + ii;"] + ["    " + ln for ln in body(exp, log)] + ["}"]


def _xent_fwd(g, k, op, a, b, s):
    """−Σ b · logsoftmax(a) / rows: per line into S0, then one serial total (tiers "libm"/"order")."""
    sub = lambda x, y: g.d.render(("bin", "-", ("var", "a"), ("var", "b")), {"a": x, "b": y})   # noqa: E731
    outer, m, inner = axis3(g.p.shapes[a], s)
    n = outer * m * inner
    g.scratch(0, n)
    line = g.flat(f"f{k}", outer * inner, _xent_line(g, a, outer, m, inner, lambda exp, log: [
        f"S0[p] = {g.mul(f'v{b}[p]', sub(sub(f'v{a}[p]', 'mx'), f'{log}(se)'))};"]))
    total = g.flat(f"t{k}", 1, [f"real acc = {g.d.lit(0.0)};",
                                f"for (long r = 0; r < {n}L; r++) acc = {g.add('acc', 'S0[r]')};",
                                f"v{k}[0] = {g.div('acc', g.d.lit(float(-(outer * inner))))};"])
    return [line, total]


def _xent_d(g, k, side, first):
    """da = (softmax(a) · Σ_axis b − b) · (g / rows);  db = logsoftmax(a) · (−g / rows)."""
    sub = lambda x, y: g.d.render(("bin", "-", ("var", "a"), ("var", "b")), {"a": x, "b": y})   # noqa: E731
    _, a, b, s = g.p.nodes[k]
    outer, m, inner = axis3(g.p.shapes[a], s)
    rows = g.d.lit(float(outer * inner))
    if side == "b":
        body = lambda exp, log: [   # noqa: E731
            f"const real q = {g.div(f'(-g{k}[0])', rows)};",
            g.put(f"g{b}[p]", g.mul(sub(sub(f"v{a}[p]", "mx"), f"{log}(se)"), "q"), first)]
        return [g.flat(f"db{k}", outer * inner, _xent_line(g, a, outer, m, inner, body))]
    sb = [f"real sb = {g.d.lit(0.0)};",
          f"for (long j = 0; j < {m}L; j++) sb = {g.add('sb', f'v{b}[(o * {m}L + j) * {inner}L + ii]')};"]
    body = lambda exp, log: [   # noqa: E731
        f"const real q = {g.div(f'g{k}[0]', rows)};",
        f"const real t = {sub(g.mul(g.div(f'{exp}(' + sub(f'v{a}[p]', 'mx') + ')', 'se'), 'sb'), f'v{b}[p]')};",
        g.put(f"g{a}[p]", g.mul("t", "q"), first)]
    lines = _xent_line(g, a, outer, m, inner, body)
    return [g.flat(f"da{k}", outer * inner, lines[:1] + sb + lines[1:])]


_FORWARD = {"matmul": _matmul_fwd, "matmul_ordered": _matmul_fwd, "sum": _reduce_fwd, "mean": _reduce_fwd,
            "sum_ordered": _reduce_fwd, "mean_ordered": _reduce_fwd, "reshape": _reshape_fwd,
            "transpose": _transpose_fwd, "broadcast_to": _broadcast_fwd, "softmax_xent": _xent_fwd}
_BACKWARD = {"matmul": _matmul_d, "matmul_ordered": _matmul_d, "sum": _spread_da, "mean": _spread_da,
             "sum_ordered": _spread_da, "mean_ordered": _spread_da, "reshape": _reshape_da,
             "transpose": _transpose_da, "broadcast_to": _broadcast_da, "softmax_xent": _xent_d}
for _family in (source_index, source_scan, source_layout, source_reduce, source_conv, source_linalg):
    _FORWARD.update(_family.FORWARD)
    _BACKWARD.update(_family.BACKWARD)
