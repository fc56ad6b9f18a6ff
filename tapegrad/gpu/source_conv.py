"""CUDA kernels of the conv family: conv, max_pool, sum_pool — one thread per element written, no atomics.

Pooling is exact (== the native program's ``tg_pool``): each output element walks its window positions
in row-major order (sum_pool: the first position assigned, later ones added, padding 0; max_pool: the
running maximum with NumPy's NaN rule, padding −inf). The backward passes, which the native C runs as
scatters over the window positions in row-major order, run here as gathers, one thread per INPUT
element: it visits the same window positions in the same order, finds the one output (if any) whose
window reads it there, and adds that output's cotangent — the same additions into the same element in
the same order, from the same zero. max_pool's gradient goes to the first maximum of each window: a
first kernel stores, per output, the window position of its first maximum (scratch S1; −1 when none,
as with a NaN), so the gather needs no float index and no float32 size limit.

conv (tier "blas": the native program makes BLAS GEMM calls on im2col columns) is a serial dot per
element in the order of the GEMM's inner dimension: forward, per output element over (input channel,
kernel position) — channels first — or (kernel position, channel) — channels last —, padding read as
0; the input gradient, per input element, over kernel positions in row-major order (col2im's order),
each one's Σ over the group's output channels; the kernel gradient, per kernel element, over (batch,
output position). Within the "blas" bound of the native program, like bmm.
"""
import math

from ..ops.conv import geometry, pool_geometry
from ..native.kernels import strides


def _decode(var, shape, names):
    """Lines ``const long name_d = (var / stride_d) % size_d`` for a row-major index over ``shape``."""
    return [f"const long {nm} = ({var} / {st}L) % {m}L;" for nm, m, st in zip(names, shape, strides(shape))
            if nm is not None]


def _flat(terms):
    """Σ index·stride as C (``terms`` = [(index expr, stride)])."""
    return " + ".join(f"({e}) * {st}L" if st != 1 else f"({e})" for e, st in terms if st) or "0L"


# ── pooling ──────────────────────────────────────────────────────────────────

def _window_reads(sh, s, od, jd, valid, at):
    """Lines: ``at`` = the input index window position jd reads for output od, ``valid`` = it is not padding."""
    win, st, pads = s
    lines = [f"int {valid} = 1;", f"long {at} = 0;"]
    for d, (n, t, (lo, _), m) in enumerate(zip(sh, st, pads, strides(sh))):
        lines += [f"{{ const long pos = {od[d]} * {t}L + {jd[d]} - {lo}L;",
                  f"  if (pos < 0 || pos >= {n}L) {valid} = 0; else {at} += pos * {m}L; }}"]
    return lines


def pool_fwd(g, k, op, a, b, s):
    sh, win = g.p.shapes[a], s[0]
    out = pool_geometry(sh, s)
    nd = len(sh)
    od, jd = [f"od{d}" for d in range(nd)], [f"jd{d}" for d in range(nd)]
    if op.name == "sum_pool":
        pad, step = g.d.lit(0.0), f"acc = {g.add('acc', 'x')};"
    else:
        pad, step = "(-INFINITY)", "acc = acc > x ? acc : (acc != acc ? acc : x);"
    lines = _decode("i", out, od) + [f"real acc = {g.d.lit(0.0)};",
                                      f"for (long w = 0; w < {math.prod(win)}L; w++) {{"]
    body = _decode("w", win, jd) + _window_reads(sh, s, od, jd, "ok", "at") + \
        [f"const real x = ok ? v{a}[at] : {pad};", "if (w == 0) acc = x;", f"else {step}"]
    lines += ["    " + ln for ln in body] + ["}", f"v{k}[i] = acc;"]
    return [g.flat(f"f{k}", math.prod(out), lines)]


def _pool_gather(g, k, a, s, lines_at_output, first):
    """dx[i] = 0, then for each window position w (row-major) the output o that reads input i there, if
    any: ``lines_at_output`` (using ``o``, ``w``) add into ``acc``."""
    sh = g.p.shapes[a]
    win, st, pads = s
    out = pool_geometry(sh, s)
    nd = len(sh)
    xd, jd = [f"xd{d}" for d in range(nd)], [f"jd{d}" for d in range(nd)]
    lines = _decode("i", sh, xd) + [f"real acc = {g.d.lit(0.0)};", f"for (long w = 0; w < {math.prod(win)}L; w++) {{"]
    body = _decode("w", win, jd) + ["int ok = 1;", "long o = 0;"]
    for d, (t, (lo, _), m, om) in enumerate(zip(st, pads, out, strides(out))):
        body += [f"{{ const long q = {xd[d]} + {lo}L - {jd[d]};",   # the output index od with od·t + jd − lo = xd
                 f"  if (q < 0 || q % {t}L != 0 || q / {t}L >= {m}L) ok = 0; else o += (q / {t}L) * {om}L; }}"]
    body += ["if (ok) {"] + ["    " + ln for ln in lines_at_output] + ["}"]
    lines += ["    " + ln for ln in body] + ["}", g.put(f"g{a}[i]", "acc", first)]
    return g.flat(f"da{k}", math.prod(sh), lines)


def pool_da(g, k, side, first):
    """sum_pool: g of every window reading the element; max_pool: g of every window whose first maximum it is"""
    op, a, _, s = g.p.nodes[k]
    if op.name == "sum_pool":
        return [_pool_gather(g, k, a, s, [f"acc = {g.add('acc', f'g{k}[o]')};"], first)]
    sh, win = g.p.shapes[a], s[0]
    out = pool_geometry(sh, s)
    nd = len(sh)
    od, jd = [f"od{d}" for d in range(nd)], [f"jd{d}" for d in range(nd)]
    nout = math.prod(out)
    g.scratch(1, nout)
    lines = _decode("i", out, od) + [f"real arg = {g.d.lit(-1.0)};",
                                      f"for (long w = 0; w < {math.prod(win)}L && arg < {g.d.lit(0.0)}; w++) {{"]
    body = _decode("w", win, jd) + _window_reads(sh, s, od, jd, "ok", "at") + \
        [f"const real x = ok ? v{a}[at] : (-INFINITY);", f"if (x == v{k}[i]) arg = (real)w;"]
    lines += ["    " + ln for ln in body] + ["}", "S1[i] = arg;"]
    first_max = g.flat(f"m{k}", nout, lines)
    return [first_max, _pool_gather(g, k, a, s, [f"if (S1[o] == (real)w) acc = {g.add('acc', f'g{k}[o]')};"],
                                    first)]


# ── conv: serial dots in the GEMMs' inner order (tier "blas") ────────────────

class _Lay:
    """Flat offsets of x, w, y elements in either layout (``geo.last``: NHWC/HWIO, else NCHW/OIHW)."""

    def __init__(self, geo):
        self.geo = geo
        nsp = len(geo.k)
        self.xsh = (geo.n,) + geo.inp + (geo.c,) if geo.last else (geo.n, geo.c) + geo.inp
        self.wsh = geo.k + (geo.cg, geo.o) if geo.last else (geo.o, geo.cg) + geo.k
        self.ysh = (geo.n,) + geo.out + (geo.o,) if geo.last else (geo.n, geo.o) + geo.out
        self.xst, self.wst, self.yst = strides(self.xsh), strides(self.wsh), strides(self.ysh)
        self.sp = list(range(1, 1 + nsp)) if geo.last else list(range(2, 2 + nsp))   # spatial axes of x, y
        self.ch = len(self.xsh) - 1 if geo.last else 1

    def x(self, n, c, sp):
        return _flat([(n, self.xst[0]), (c, self.xst[self.ch])] + [(e, self.xst[d]) for e, d in zip(sp, self.sp)])

    def y(self, n, o, sp):
        return _flat([(n, self.yst[0]), (o, self.yst[self.ch])] + [(e, self.yst[d]) for e, d in zip(sp, self.sp)])

    def w(self, o, c, kd):
        nsp = len(self.geo.k)
        if self.geo.last:
            return _flat([(e, self.wst[d]) for d, e in enumerate(kd)] + [(c, self.wst[nsp]), (o, self.wst[nsp + 1])])
        return _flat([(o, self.wst[0]), (c, self.wst[1])] + [(e, self.wst[2 + d]) for d, e in enumerate(kd)])

    def names(self, n, ch, sp):
        """Names per axis of x or y (for ``_decode``), batch ``n``, channel ``ch``, spatial ``sp``."""
        out = [None] * len(self.xsh)
        out[0], out[self.ch] = n, ch
        for d, nm in zip(self.sp, sp):
            out[d] = nm
        return out


def _tap(geo, od, jd):
    """Lines: ``ok`` = output position od reads a real input element at kernel position jd, ``xs_d`` its
    spatial indices (pos = od·st + jd·rd − lo on the padded, lhs-dilated input; an input where pos/ld is
    a whole index)."""
    lines = ["int ok = 1;"]
    for d, (n, st, (lo, _), ld, rd) in enumerate(zip(geo.inp, geo.st, geo.pads, geo.ld, geo.rd)):
        lines += [f"long xs{d} = 0;",
                  f"{{ const long pos = {od[d]} * {st}L + {jd[d]} * {rd}L - {lo}L;",
                  f"  if (pos < 0 || pos % {ld}L != 0 || pos / {ld}L >= {n}L) ok = 0; else xs{d} = pos / {ld}L; }}"]
    return lines


def conv_fwd(g, k, op, a, b, s):
    """y[n, o, p] = Σ_(c, kk) w[o, c, kk] · x[n, g·Cg + c, p·st + kk·rd − lo] (channels last: Σ over (kk, c))"""
    geo = geometry(g.p.shapes[a], g.p.shapes[b], s)
    L = _Lay(geo)
    nsp = len(geo.k)
    od, jd, xs = [f"od{d}" for d in range(nsp)], [f"jd{d}" for d in range(nsp)], [f"xs{d}" for d in range(nsp)]
    zero = g.d.lit(0.0)
    lines = _decode("i", L.ysh, L.names("nb", "oc", od)) + [f"const long grp = oc / {geo.og}L;", f"real acc = {zero};"]
    loops = [f"for (long c = 0; c < {geo.cg}L; c++)", f"for (long kk = 0; kk < {geo.kk}L; kk++)"]
    if geo.last:
        loops.reverse()
    xat, wat = L.x("nb", f"grp * {geo.cg}L + c", xs), L.w("oc", "c", jd)
    body = _decode("kk", geo.k, jd) + _tap(geo, od, jd) + \
        [f"const real x = ok ? v{a}[{xat}] : {zero};", f"acc = {g.add('acc', g.mul(f'v{b}[{wat}]', 'x'))};"]
    lines += [loops[0], loops[1] + " {"] + ["    " + ln for ln in body] + ["}", f"v{k}[i] = acc;"]
    return [g.flat(f"f{k}", math.prod(L.ysh), lines)]


def conv_d(g, k, side, first):
    """dx[n, c, xs] = Σ_kk (Σ_o∈group w[o, c, kk] · g[n, o, p(xs, kk)]) over the kernel positions that read
    xs (col2im of Wᵀ·g); dW[o, c, kk] = Σ_(n, p) g[n, o, p] · x[n, c, p·st + kk·rd − lo] (g·colsᵀ)."""
    _, a, b, s = g.p.nodes[k]
    geo = geometry(g.p.shapes[a], g.p.shapes[b], s)
    L = _Lay(geo)
    nsp = len(geo.k)
    od, jd, xs = [f"od{d}" for d in range(nsp)], [f"jd{d}" for d in range(nsp)], [f"xs{d}" for d in range(nsp)]
    zero = g.d.lit(0.0)
    if side == "a":
        lines = _decode("i", L.xsh, L.names("nb", "cc", xs)) + \
            [f"const long grp = cc / {geo.cg}L, c = cc % {geo.cg}L;", f"real acc = {zero};",
             f"for (long kk = 0; kk < {geo.kk}L; kk++) {{"]
        body = _decode("kk", geo.k, jd) + ["int ok = 1;"]
        for d, (n, st, (lo, _), ld, rd, m) in enumerate(zip(geo.inp, geo.st, geo.pads, geo.ld, geo.rd, geo.out)):
            body += [f"long od{d} = 0;",   # the output position with od·st + jd·rd − lo = xs·ld
                     f"{{ const long q = {xs[d]} * {ld}L + {lo}L - {jd[d]} * {rd}L;",
                     f"  if (q < 0 || q % {st}L != 0 || q / {st}L >= {m}L) ok = 0; else od{d} = q / {st}L; }}"]
        term = g.mul(f"v{b}[{L.w('oc', 'c', jd)}]", f"g{k}[{L.y('nb', 'oc', od)}]")
        body += ["if (ok) {", f"    real t = {zero};",
                 f"    for (long oc = grp * {geo.og}L; oc < (grp + 1) * {geo.og}L; oc++) t = {g.add('t', term)};",
                 f"    acc = {g.add('acc', 't')};", "}"]
        lines += ["    " + ln for ln in body] + ["}", g.put(f"g{a}[i]", "acc", first)]
        return [g.flat(f"da{k}", math.prod(L.xsh), lines)]
    wnames = jd + ["c", "oc"] if geo.last else ["oc", "c"] + jd
    lines = _decode("i", L.wsh, wnames) + [f"const long grp = oc / {geo.og}L;", f"real acc = {zero};",
                                           f"for (long nb = 0; nb < {geo.n}L; nb++)",
                                           f"for (long p = 0; p < {geo.p}L; p++) {{"]
    xat, yat = L.x("nb", f"grp * {geo.cg}L + c", xs), L.y("nb", "oc", od)
    body = _decode("p", geo.out, od) + _tap(geo, od, jd) + \
        [f"const real x = ok ? v{a}[{xat}] : {zero};", f"acc = {g.add('acc', g.mul(f'g{k}[{yat}]', 'x'))};"]
    lines += ["    " + ln for ln in body] + ["}", g.put(f"g{b}[i]", "acc", first)]
    return [g.flat(f"db{k}", math.prod(L.wsh), lines)]


FORWARD = {"conv": conv_fwd, "max_pool": pool_fwd, "sum_pool": pool_fwd}
BACKWARD = {"conv": conv_d, "max_pool": pool_da, "sum_pool": pool_da}
