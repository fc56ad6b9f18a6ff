"""CUDA kernels of the serial reductions: max, min and prod, softmax, logsoftmax, logsumexp, and bmm's dot.

Each mirrors the native C element for element: max/min/prod visit the reduced elements of each output
in row-major order from -inf/+inf/1 with the native update (NaN propagates, the first of equal extremes
stays: ``tg_reduce``'s modes 1–3); max/min share the gradient among ties
(``native.kernels.core.max_da``: hit · (g / Σ hit)); prod's gradient is prefix · suffix products with no
division (``tg_prod_da``); softmax and logsoftmax run one thread per line with the sums serial in j
(``tg_softmax``), logsumexp sums in NumPy's order (``tg_reduce``: a trailing block of reduced axes
pairwise); bmm is a serial dot over k per output element (tier "blas", like NumPy's within the bound).
One thread per output element (or per line). Slice and concat, which only move data: ``source_layout``.
"""
import math

from ..native.kernels import keep, strides


# ── max / min / prod: serial in row-major order over the reduced elements ────

def _reduced(g, a, s):
    """(shape, kept dims [(size, stride)], reduced dims, outputs, reduced count) of a reduction of a."""
    sh = g.p.shapes[a]
    axes = range(len(sh)) if s[0] is None else s[0]
    st = strides(sh)
    kept = [(m, t) for d, (m, t) in enumerate(zip(sh, st)) if d not in axes]
    red = [(m, t) for d, (m, t) in enumerate(zip(sh, st)) if d in axes]
    return sh, kept, red, math.prod(m for m, _ in kept), math.prod(m for m, _ in red)


def _offset(var, dims):
    terms, div = [], 1
    for m, t in reversed(dims):
        terms.append(f"(({var} / {div}L) % {m}L) * {t}L")
        div *= m
    return " + ".join(terms) or "0L"


def reduce_fwd(g, k, op, a, b, s):
    sh, kept, red, nout, nred = _reduced(g, a, s)
    x = f"v{a}[base + {_offset('r', red)}]"
    if op.name == "prod":
        init, start, step = g.d.lit(1.0), 0, f"acc = {g.mul('acc', 'x')};"
    else:   # from ∓inf the native update takes the first element whatever it is: start from it
        init, start = f"v{a}[base]", 1
        step = f"if (acc == acc && (x {'>' if op.name == 'max' else '<'} acc || x != x)) acc = x;"
    lines = [f"const long base = {_offset('i', kept)};", f"real acc = {init};",
             f"for (long r = {start}L; r < {nred}L; r++) {{", f"    const real x = {x};", f"    {step}", "}",
             f"v{k}[i] = acc;"]
    return [g.flat(f"f{k}", nout, lines)]


def extreme_da(g, k, side, first):
    """hit = (a == out); ties = Σ hit per output; da = hit · (g / ties)"""
    _, a, _, s = g.p.nodes[k]
    sh, kept, red, nout, nred = _reduced(g, a, s)
    one, zero = g.d.lit(1.0), g.d.lit(0.0)
    g.scratch(2, nout)
    ties = g.flat(f"t{k}", nout, [f"const long base = {_offset('i', kept)};", f"real n = {zero};",
                                  f"for (long r = 0; r < {nred}L; r++)",
                                  f"    n = {g.add('n', f'(v{a}[base + {_offset(chr(114), red)}] == v{k}[i] ? {one} : {zero})')};",
                                  f"S2[i] = {g.div(f'g{k}[i]', 'n')};"])
    ost = [t for t in strides(keep(sh, s))]
    at = " + ".join(f"((i / {t}L) % {m}L) * {o}L" for m, t, o, kk in zip(sh, strides(sh), ost, keep(sh, s)) if kk != 1) \
        or "0L"
    spread = g.flat(f"da{k}", math.prod(sh), [f"const long o = {at};",
                                              f"const real hit = v{a}[i] == v{k}[o] ? {one} : {zero};",
                                              g.put(f"g{a}[i]", g.mul("hit", "S2[o]"), first)])
    return [ties, spread]


def prod_da(g, k, side, first):
    """d_i = (Π_{j<i} x_j · Π_{j>i} x_j) · g, prefix from the left, suffix from the right (S1 at a's layout)"""
    _, a, _, s = g.p.nodes[k]
    sh, kept, red, nout, nred = _reduced(g, a, s)
    g.scratch(1, math.prod(sh))
    pos = f"base + {_offset('r', red)}"
    lines = [f"const long base = {_offset('i', kept)};", f"real pre = {g.d.lit(1.0)};",
             f"for (long r = 0; r < {nred}L; r++) {{", f"    const long p = {pos};", "    S1[p] = pre;",
             f"    pre = {g.mul('pre', f'v{a}[p]')};", "}",
             f"real suf = {g.d.lit(1.0)};",
             f"for (long r = {nred - 1}L; r >= 0; r--) {{", f"    const long p = {pos};",
             f"    S1[p] = {g.mul(g.mul('S1[p]', 'suf'), f'g{k}[i]')};", f"    suf = {g.mul('suf', f'v{a}[p]')};",
             "    " + g.put(f"g{a}[p]", "S1[p]", first), "}"]
    return [g.flat(f"da{k}", nout, lines)]


FORWARD = {"max": reduce_fwd, "min": reduce_fwd, "prod": reduce_fwd}
BACKWARD = {"max": extreme_da, "min": extreme_da, "prod": prod_da}


# ── softmax / logsoftmax / logsumexp (tier "libm": the device's exp/log; in the emulation the host's) ──

def _sub(g, x, y):
    return g.d.render(("bin", "-", ("var", "a"), ("var", "b")), {"a": x, "b": y})


def _libm(g):
    """exp and log as the native runtime's (runtime_vmath.c, compiled for the device too: the same bits)."""
    return ("tg_exp", "tg_log")


def _max_line(var, at, m):
    """Lines leaving in ``var`` the max of the m elements at(j) (tg_reduce's mode 1: NaN propagates)."""
    return [f"real {var} = {at('0L')};", f"for (long j = 1; j < {m}L; j++) {{", f"    const real x = {at('j')};",
            f"    if ({var} == {var} && (x > {var} || x != x)) {var} = x;", "}"]


def _lines_of(g, k, a, s, body):
    """One thread per softmax line (o, ii) of a's axis s; ``body(P, m)`` with P(j) the flat index."""
    sh = g.p.shapes[a]
    outer, m, inner = math.prod(sh[:s]), sh[s], math.prod(sh[s + 1:])

    def P(j):
        return f"(o * {m}L + {j}) * {inner}L + ii"

    return outer * inner, [f"const long o = i / {inner}L, ii = i % {inner}L;"] + body(P, m)


def softmax_fwd(g, k, op, a, b, s):
    """r = max; out = a − r; softmax: out = exp(out) / Σ exp (serial in j); logsoftmax: out − log Σ exp(out)"""
    exp, log = _libm(g)
    zero = g.d.lit(0.0)

    def body(P, m):
        V = lambda j: f"v{k}[{P(j)}]"   # noqa: E731
        out = _max_line("r", lambda j: f"v{a}[{P(j)}]", m)
        out.append(f"for (long j = 0; j < {m}L; j++) {V('j')} = {_sub(g, f'v{a}[{P(chr(106))}]', 'r')};")
        if op.name == "softmax":
            return out + [f"for (long j = 0; j < {m}L; j++) {V('j')} = {exp}({V('j')});", f"real t = {zero};",
                          f"for (long j = 0; j < {m}L; j++) t = {g.add('t', V('j'))};",
                          f"for (long j = 0; j < {m}L; j++) {V('j')} = {g.div(V('j'), 't')};"]
        return out + [f"real t = {zero};", f"for (long j = 0; j < {m}L; j++) t = {g.add('t', f'{exp}({V(chr(106))})')};",
                      f"t = {log}(t);", f"for (long j = 0; j < {m}L; j++) {V('j')} = {_sub(g, V('j'), 't')};"]
    n, lines = _lines_of(g, k, a, s, body)
    return [g.flat(f"f{k}", n, lines)]


def softmax_da(g, k, side, first):
    """softmax: c = out · (g − Σ g·out); logsoftmax: c = g − exp(out) · Σ g (sums serial in j)"""
    op, a, _, s = g.p.nodes[k]
    exp, _ = _libm(g)
    zero = g.d.lit(0.0)

    def body(P, m):
        G, V, J = (lambda j: f"g{k}[{P(j)}]"), (lambda j: f"v{k}[{P(j)}]"), "j"   # noqa: E731
        head = [f"real t = {zero};"]
        if op.name == "softmax":
            return head + [f"for (long j = 0; j < {m}L; j++) t = {g.add('t', g.mul(G(J), V(J)))};",
                           f"for (long j = 0; j < {m}L; j++)",
                           "    " + g.put(f"g{a}[{P(J)}]", g.mul(V(J), _sub(g, G(J), "t")), first)]
        return head + [f"for (long j = 0; j < {m}L; j++) t = {g.add('t', G(J))};",
                       f"for (long j = 0; j < {m}L; j++)",
                       "    " + g.put(f"g{a}[{P(J)}]", _sub(g, G(J), g.mul(f"{exp}({V(J)})", "t")), first)]
    n, lines = _lines_of(g, k, a, s, body)
    return [g.flat(f"da{k}", n, lines)]


def _out_index(sh, s):
    """The C expression of the output element that a's flat element i reduces into."""
    ks = keep(sh, s)
    return " + ".join(f"((i / {t}L) % {m}L) * {o}L" for m, t, o, kk in zip(sh, strides(sh), strides(ks), ks)
                      if kk != 1) or "0L"


def _numpy_sum(g, x, sh, s):
    """Lines leaving in ``acc`` output i's sum of x over the axes of s in tg_reduce's order (NumPy's): a
    trailing block of reduced axes summed pairwise per leading index, else serial in row-major order."""
    axes = set(range(len(sh)) if s[0] is None else s[0])
    st = strides(sh)
    kept = [(m, t) for d, (m, t) in enumerate(zip(sh, st)) if d not in axes]
    unit = [d for d, m in enumerate(sh) if m == 1]   # dropped, as NumPy's iterator (and tg_reduce) drop them
    axes = {d - sum(u < d for u in unit) for d in axes if sh[d] != 1}
    sh, st = tuple(m for m in sh if m != 1), tuple(q for m, q in zip(sh, st) if m != 1)
    t = len(sh)
    while t > 0 and t - 1 in axes:
        t -= 1
    lines = [f"const long base = {_offset('i', kept)};", f"real acc = {g.d.lit(0.0)};"]
    if t < len(sh):
        g.pairwise = True
        inner = math.prod(sh[t:])
        lead = [(m, q) for d, (m, q) in enumerate(zip(sh, st)) if d < t and d in axes]
        return lines + [f"for (long r = 0; r < {math.prod(m for m, _ in lead)}L; r++)",
                        f"    acc = {g.add('acc', f'tg_pw({x} + base + {_offset(chr(114), lead)}, {inner}L)')};"]
    red = [(m, q) for d, (m, q) in enumerate(zip(sh, st)) if d in axes]
    return lines + [f"for (long r = 0; r < {math.prod(m for m, _ in red)}L; r++)",
                    f"    acc = {g.add('acc', f'{x}[base + {_offset(chr(114), red)}]')};"]


def logsumexp_fwd(g, k, op, a, b, s):
    """r = max (0 where not finite) into S1; S2 = exp(a − r); out = log(Σ S2) + r"""
    sh, kept, red, nout, nred = _reduced(g, a, s)
    exp, log = _libm(g)
    g.scratch(1, nout)
    g.scratch(2, math.prod(sh))
    zero = g.d.lit(0.0)
    mx = g.flat(f"m{k}", nout, [f"const long base = {_offset('i', kept)};"] +
                _max_line("r", lambda j: f"v{a}[base + {_offset(j, red)}]", nred) +
                [f"S1[i] = r - r == {zero} ? r : {zero};"])
    ex = g.flat(f"e{k}", math.prod(sh), [f"S2[i] = {exp}({_sub(g, f'v{a}[i]', f'S1[{_out_index(sh, s)}]')});"])
    tot = g.flat(f"f{k}", nout, _numpy_sum(g, "S2", sh, s) + [f"v{k}[i] = {g.add(f'{log}(acc)', 'S1[i]')};"])
    return [mx, ex, tot]


def logsumexp_da(g, k, side, first):
    """g · exp(a − out), out and g spread over the reduced axes"""
    _, a, _, s = g.p.nodes[k]
    sh = g.p.shapes[a]
    exp, _ = _libm(g)
    o = _out_index(sh, s)
    return [g.flat(f"da{k}", math.prod(sh), [f"const long o = {o};",
                                             g.put(f"g{a}[i]", g.mul(f"g{k}[o]", f"{exp}({_sub(g, f'v{a}[i]', f'v{k}[o]')})"),
                                                   first)])]


FORWARD.update({"softmax": softmax_fwd, "logsoftmax": softmax_fwd, "logsumexp": logsumexp_fwd})
BACKWARD.update({"softmax": softmax_da, "logsoftmax": softmax_da, "logsumexp": logsumexp_da})


# ── bmm: a serial dot over k per output element (tier "blas": within the BLAS bound of NumPy's) ──

def _batched_dot(g, tag, dst, A, B, bs, m, n, kk, sa, sb, first):
    """dst[q, r, c] (+)= Σ_t A[q][r·sa0 + t·sa1] · B[q][t·sb0 + c·sb1], serially in t from 0; A and B
    advance by their batch strides (sa2, sb2)."""
    term = g.mul(f"{A}[q * {sa[2]}L + r * {sa[0]}L + t * {sa[1]}L]", f"{B}[q * {sb[2]}L + t * {sb[0]}L + c * {sb[1]}L]")
    return g.flat(tag, bs * m * n, [f"const long q = i / {m * n}L, r = (i / {n}L) % {m}L, c = i % {n}L;",
                                    f"real acc = {g.d.lit(0.0)};",
                                    f"for (long t = 0; t < {kk}L; t++) acc = {g.add('acc', term)};",
                                    g.put(f"{dst}[i]", "acc", first)])


def bmm_fwd(g, k, op, a, b, s):
    bs, m, kk = g.p.shapes[a]
    n = g.p.shapes[b][2]
    return [_batched_dot(g, f"f{k}", f"v{k}", f"v{a}", f"v{b}", bs, m, n, kk, (kk, 1, m * kk), (n, 1, kk * n), True)]


def bmm_d(g, k, side, first):
    """da = g · bᵀ, db = aᵀ · g per batch"""
    _, a, b, _ = g.p.nodes[k]
    bs, m, kk = g.p.shapes[a]
    n = g.p.shapes[b][2]
    if side == "a":
        return [_batched_dot(g, f"da{k}", f"g{a}", f"g{k}", f"v{b}", bs, m, kk, n, (n, 1, m * n), (1, n, kk * n), first)]
    return [_batched_dot(g, f"db{k}", f"g{b}", f"v{a}", f"g{k}", bs, kk, n, m, (1, kk, m * kk), (n, 1, m * n), first)]


FORWARD["bmm"], BACKWARD["bmm"] = bmm_fwd, bmm_d
