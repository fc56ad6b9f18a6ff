"""Emit a recorded scalar tape as one C or CUDA function that returns the loss and adds its gradient.

The emitted code is the tape replayed by hand: forward ``double tN = …;`` in tape order, backward in
reverse order, each node's C form taken from the op registry (``c_fwd``, ``c_da``, ``c_db``), which
mirrors the NumPy arithmetic operation by operation. Compiled with ``-ffp-contract=off`` (C) or with
the explicit round-to-nearest intrinsics of the ``cuda`` dialect, it reproduces the tape bit for bit,
except where the C library's ``exp``/``log``/``tanh``/``pow`` and NumPy's differ (the registry's
"libm" tier).
"""
import math
import re
from collections.abc import Sequence

from . import ops as O
from .errors import TapeError, at
from .tape import Tape, Var, _ancestors


class EmitError(TapeError, ValueError):
    """The tape cannot be emitted as scalar C: a node or op without a scalar form, or a bad binding."""


# Scalar forms of the non-elementwise ops, each the NumPy rule evaluated on one element.
# Reductions and data movement of one element copy it (the sum of one term is the term; x/1 == x).
_PASS = ("a", "g", None)
SCALAR_FORMS = {
    "sum": _PASS, "mean": _PASS, "transpose": _PASS, "reshape": _PASS, "broadcast_to": _PASS,
    "slice": _PASS,
    # max_da: hit = (a == out), ties = Σ hit, hit · (g / ties) — NaN inputs give a NaN gradient as in NumPy.
    "max": ("a", "(a == out ? 1.0 : 0.0) * (g / (a == out ? 1.0 : 0.0))", None),
    # a 1×1 product is one correctly rounded multiplication; da = g @ bᵀ, db = aᵀ @ g.
    "matmul": ("a * b", "g * b", "a * g"),
    "bmm": ("a * b", "g * b", "a * g"),
    # softmax_fwd / logsoftmax_fwd with max = a and Σ over one term; their VJPs likewise.
    "softmax": ("exp(a - a) / exp(a - a)", "out * (g - g * out)", None),
    "logsoftmax": ("(a - a) - log(exp(a - a))", "g - exp(out) * g", None),
    # xent_fwd: −Σ b·logsoftmax(a) / rows with rows = 1; xent_da, xent_db with g/1 and −g/1.
    "softmax_xent": ("(b * ((a - a) - log(exp(a - a)))) / -1.0", "(exp(a - a) / exp(a - a) * b - b) * (g / 1.0)",
                     "((a - a) - log(exp(a - a))) * (-g / 1.0)"),
    # scans of one element copy it; cumprod's VJP is S_0 = g, prod's is (1 · 1) · g, sort's a permutation of one.
    "cumsum": _PASS, "cumprod": _PASS, "sort": _PASS, "prod": ("a", "1.0 * 1.0 * g", None),
    # cummax_da / max_da: hit = (a == out), count = hit, hit · (g / count); min is max's rule
    "cummax": ("a", "(a == out ? 1.0 : 0.0) * (g / (a == out ? 1.0 : 0.0))", None),
    "min": ("a", "(a == out ? 1.0 : 0.0) * (g / (a == out ? 1.0 : 0.0))", None),
    # logsumexp_fwd with max = a (finite) and Σ over one term; its VJP g · exp(a − out)
    "logsumexp": ("log(exp(a - a)) + a", "g * exp(a - out)", None),
}


def forms(op):
    """The ``(c_fwd, c_da, c_db)`` scalar C forms of a registry op, or None when it has none.

    >>> forms(O.mul)
    ('a * b', 'g * b', 'g * a')
    >>> forms(O.concat) is None
    True
    """
    if op.data:   # indices and masks have no place in a scalar tape
        return None
    if op.kind == "elementwise":
        return (op.c_fwd, op.c_da, op.c_db) if op.c_fwd else None
    return SCALAR_FORMS.get(op.name)


def runtime_helper(op):
    """The first native-runtime helper (``tg_*``, e.g. ``tg_digamma``) an op's scalar C forms call, or None:
    c_grad cannot emit such an op.

    >>> runtime_helper(O.OPS["lgamma"]), runtime_helper(O.OPS["erf"])
    ('tg_digamma', None)
    """
    for text in forms(op) or ():
        m = text and re.search(r"\b(tg_\w+)\s*\(", text)
        if m:
            return m.group(1)
    return None


def literal(x, dialect="c"):
    """The one printer of float literals: ``repr`` is the shortest string that reads back exactly, and C
    parses decimal literals with correct rounding. Negative values are parenthesised; non-finite
    values are spelled so each dialect's compiler accepts them.

    >>> literal(0.1), literal(-2.0), literal(1e-300), literal(float("inf")), literal(float("nan"), "cuda")
    ('0.1', '(-2.0)', '1e-300', 'INFINITY', '__longlong_as_double(0x7ff8000000000000LL)')
    """
    x = float(x)
    if math.isfinite(x):
        r = repr(x)
        return f"({r})" if r.startswith("-") else r
    if dialect == "cuda":
        r = "__longlong_as_double(0x7ff8000000000000LL)" if math.isnan(x) else \
            "__longlong_as_double(0x7ff0000000000000LL)"
    else:
        r = "NAN" if math.isnan(x) else "INFINITY"
    return f"(-{r})" if x < 0 else r


# ── the registry's C expressions: a tiny parser (numbers, names, calls, unary −, * / + −,
#    comparisons, || &&, ?:) so the cuda dialect can spell every rounding step as an intrinsic ───────────

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)|([A-Za-z_]\w*)|(>=|<=|==|!=|\|\||&&|[-+*/()?:,<>]))")
_INTRINSIC = {"+": "__dadd_rn", "-": "__dsub_rn", "*": "__dmul_rn", "/": "__ddiv_rn"}
_CMP = (">", "<", ">=", "<=", "==", "!=")


def _tokens(text):
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"cannot read C expression {text!r} at {text[pos:]!r}")
        out.append(m.group(m.lastindex))
        pos = m.end()
    return out


def parse(text):
    """A registry C expression as a tree of tuples: ``("num"|"name", text)``, ``("call", f, args)``,
    ``("neg", x)``, ``("bin", op, x, y)``, ``("cond", c, x, y)``.

    >>> parse("g * (1.0 - out)")
    ('bin', '*', ('name', 'g'), ('bin', '-', ('num', '1.0'), ('name', 'out')))
    >>> parse("a > b || a != a ? a : b")[1]
    ('bin', '||', ('bin', '>', ('name', 'a'), ('name', 'b')), ('bin', '!=', ('name', 'a'), ('name', 'a')))
    """
    toks = _tokens(text)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take(want=None):
        nonlocal pos
        tok = peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"cannot read C expression {text!r}: expected {want or 'more'}, got {tok!r}")
        pos += 1
        return tok

    def cond():
        c = logical("||", lambda: logical("&&", compare))
        if peek() != "?":
            return c
        take("?")
        x = cond()
        take(":")
        return ("cond", c, x, cond())

    def logical(op, operand):
        x = operand()
        while peek() == op:
            x = ("bin", take(), x, operand())
        return x

    def compare():
        x = additive()
        if peek() in _CMP:
            return ("bin", take(), x, additive())
        return x

    def additive():
        x = term()
        while peek() in ("+", "-"):
            x = ("bin", take(), x, term())
        return x

    def term():
        x = unary()
        while peek() in ("*", "/"):
            x = ("bin", take(), x, unary())
        return x

    def unary():
        if peek() == "-":
            take()
            return ("neg", unary())
        tok = take()
        if tok == "(":
            x = cond()
            take(")")
            return x
        if tok[0].isdigit():
            return ("num", tok)
        if not (tok[0].isalpha() or tok[0] == "_"):
            raise ValueError(f"cannot read C expression {text!r}: unexpected {tok!r}")
        if peek() != "(":
            return ("name", tok)
        take("(")
        args = [cond()]
        while peek() == ",":
            take()
            args.append(cond())
        take(")")
        return ("call", tok, tuple(args))

    tree = cond()
    if pos != len(toks):
        raise ValueError(f"cannot read C expression {text!r}: unexpected {toks[pos]!r}")
    return tree


def _cuda(tree, env):
    """Print a tree with every + − × ÷ and sqrt as a round-to-nearest intrinsic (never contracted)."""
    kind = tree[0]
    if kind == "num":
        return tree[1]
    if kind == "name":
        return env.get(tree[1], tree[1])
    if kind == "neg":
        x = _cuda(tree[1], env)
        return f"-({x})" if x.startswith("-") else f"-{x}"
    if kind == "call":
        f = "__dsqrt_rn" if tree[1] == "sqrt" else tree[1]
        return f"{f}({', '.join(_cuda(x, env) for x in tree[2])})"
    if kind == "cond":
        return f"({_cuda(tree[1], env)} ? {_cuda(tree[2], env)} : {_cuda(tree[3], env)})"
    op, x, y = tree[1:]
    if op in _CMP:
        return f"{_cuda(x, env)} {op} {_cuda(y, env)}"
    if op in ("||", "&&"):
        return f"({_cuda(x, env)} {op} {_cuda(y, env)})"
    return f"{_INTRINSIC[op]}({_cuda(x, env)}, {_cuda(y, env)})"


_NAMES = re.compile(r"\b(a|b|s|out|g)\b")


def _expr(text, env, dialect):
    if dialect == "cuda":
        return _cuda(parse(text), env)
    return _NAMES.sub(lambda m: env[m.group(1)], text)


# ── the emitter ──────────────────────────────────────────────────────────────

# C11 keywords and the names the emitted function itself uses: a function called one of them fails to
# compile (or shadows <math.h>), so c_grad refuses them up front.
_RESERVED = frozenset("""auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void
volatile while _Bool _Complex _Imaginary _Alignas _Alignof _Atomic _Generic _Noreturn _Static_assert
_Thread_local p g v exp log tanh sqrt pow fabs fmax fmin expm1 log1p main""".split())


def c_grad(tape: Tape, loss: Var, params: Sequence[Var], leaves: dict[Var, str], *, dialect: str = "c",
           name: str = "grad", with_data: bool = False, bake: bool = False) -> str:
    """C (or CUDA) source of one function computing a scalar tape's loss and gradient.

    Every node the loss depends on must hold one element. The function has a fixed ABI:

    - ``dialect="c"``: ``double NAME(const double *p, double *g)`` — returns the loss and ADDS
      d loss/d ``p[j]`` into ``g[j]`` (so a caller can sum gradients over a dataset). With
      ``with_data=True`` a third argument ``const double *v`` follows (a data row), which the leaf
      expressions may read. Compile with ``-ffp-contract=off`` and link ``-lm``.
    - ``dialect="cuda"``: the same function as ``__device__``, with every + − × ÷ written as
      ``__dadd_rn``/``__dsub_rn``/``__dmul_rn``/``__ddiv_rn`` and sqrt as ``__dsqrt_rn``; nvcc never
      fuses these intrinsics into an FMA, so the result does not depend on ``--fmad``.

    Forward and backward follow the tape's arithmetic and its accumulation order (a node's gradient
    starts as a copy of its highest consumer's contribution; the others are added consumer by
    consumer, highest id first, a before b), so the emitted code is bit-exact wherever the registry's
    tier is "exact". Constants-only branches get no backward code.

    Args:
        tape: A float64 tape, not poisoned.
        loss: The one-element Var to differentiate.
        params: Every parameter the loss depends on, each exactly once: ``params[j]`` reads ``p[j]``.
        leaves: ``{Var: C expression}`` for every constant the loss reads (``"v[3]"``,
            ``"(double)x"``).
        dialect: "c" or "cuda".
        name: The function's name, a C identifier the emitted code does not use itself.
        with_data: Give the function the data row argument ``v``.
        bake: Print each unbound constant's recorded value as an exact literal instead of raising
            (otherwise a forgotten data leaf would compile in its placeholder value).

    Returns:
        The source text, deterministic for a given tape.

    Raises:
        EmitError: If the tape cannot be emitted (the message names the node and op; nothing is
            emitted): a non-scalar node, an op with no scalar C form, a binding that is not a
            constant feeding the loss, a ``params`` list that does not match, an unbound constant
            without ``bake``, a leaf expression reading ``v`` without ``with_data``, a bad
            ``dialect`` or ``name``, a float32 or poisoned tape.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape()
        >>> w, x = tape.param(np.array(2.0)), tape.const(np.array(0.5))
        >>> loss = (w * x).tanh() * 3.0
        >>> print(tg.emit.c_grad(tape, loss, [w], {x: "v[0]"}, with_data=True))
        /* tapegrad.emit.c_grad: returns t4; p[0] = node 0. */
        #include <math.h>
        <BLANKLINE>
        double grad(const double *p, double *g, const double *v)
        {
            double t0 = p[0];
            double t1 = v[0];
            double t2 = t0 * t1;
            double t3 = tanh(t2);
            double t4 = t3 * 3.0;
        <BLANKLINE>
            double g4 = 1.0;
            double g3 = g4 * 3.0;
            double g2 = g3 * (1.0 - t3 * t3);
            double g0 = g2 * t1;
        <BLANKLINE>
            g[0] += g0;
            return t4;
        }
        <BLANKLINE>
    """
    if dialect not in ("c", "cuda"):
        raise EmitError(f"c_grad: dialect must be 'c' or 'cuda', got {dialect!r}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise EmitError(f"c_grad: name must be a C identifier, got {name!r}")
    if name in _RESERVED or re.fullmatch(r"[tg]\d+", name):
        raise EmitError(f"c_grad: name {name!r} is a C keyword or a name the emitted code uses (p, g, v, tN, gN, "
                        f"<math.h> functions); choose another function name")
    if tape.dtype.itemsize != 8:
        raise EmitError(f"c_grad: expected a float64 tape (the emitted code computes in double), got "
                        f"{tape.dtype}")
    if not tape.ok:
        raise EmitError(f"c_grad: the tape is poisoned ({tape.error}); nothing to emit")
    top = tape._index(loss, "c_grad", "loss")
    nodes = tape._nodes
    live = _ancestors(nodes, top)
    for k in live:
        op = nodes[k].op
        if math.prod(nodes[k].shape) != 1:
            raise EmitError(f"{at(op.name, k)}: expected one element (c_grad emits scalar tapes), got shape "
                            f"{nodes[k].shape}; record the per-example loss on one-element Vars")
        if op.arity and forms(op) is None:
            raise EmitError(f"{at(op.name, k)}: op {op.name} has no scalar C form (no c_fwd in the registry, "
                            f"nor in emit.SCALAR_FORMS); it cannot be emitted")
        helper = runtime_helper(op)
        if helper:
            raise EmitError(f"{at(op.name, k)}: op {op.name}'s C form calls {helper}, a function of the native "
                            f"runtime that c_grad does not emit (it emits libm calls only); capture the tape "
                            f"with backend='native' instead")
    if not isinstance(leaves, dict):
        raise EmitError(f"c_grad: leaves must be a dict {{Var: C expression}}, got {type(leaves).__name__}")
    bind = _bindings(tape, live, params, leaves, dialect, bake)
    if not with_data:
        for v, expr in leaves.items():
            if isinstance(expr, str) and re.search(r"\bv\b", expr):
                raise EmitError(f"{at('const', v.id)}: the leaf expression {expr!r} reads the data row v, but "
                                f"with_data=False gives the function no v argument; pass with_data=True")
    return _source(tape, top, live, bind, [tape._index(v, "c_grad", "params") for v in params], dialect, name,
                   with_data)


def _bindings(tape, live, params, leaves, dialect, bake):
    """The C expression each leaf reads: ``p[j]``, a caller's expression, or a baked literal."""
    nodes, upstream = tape._nodes, set(live)
    bind = {}
    for j, v in enumerate(params):
        k = tape._index(v, "c_grad", f"params[{j}]")
        if nodes[k].op is not O.param:
            raise EmitError(f"{at(nodes[k].op.name, k)}: params[{j}] must be a parameter, got a "
                            f"{nodes[k].op.name} node")
        if k in bind:
            raise EmitError(f"{at('param', k)}: params lists this parameter twice ({bind[k]} and p[{j}])")
        if k not in upstream:
            raise EmitError(f"{at('param', k)}: params[{j}] does not feed the loss; list exactly the "
                            f"parameters the loss depends on")
        bind[k] = f"p[{j}]"
    missing = [k for k in live if nodes[k].op is O.param and k not in bind]
    if missing:
        raise EmitError(f"{at('param', missing[0])}: the loss depends on this parameter but params does not "
                        f"list it (missing nodes {missing}); list every parameter upstream of the loss")
    for v, expr in leaves.items():
        k = tape._index(v, "c_grad", "leaves")
        op = nodes[k].op.name
        if nodes[k].op is not O.const:
            raise EmitError(f"{at(op, k)}: leaves binds constants only, got a {op} node"
                            + ("; parameters bind to p[j] through params" if op == "param" else ""))
        if k not in upstream:
            raise EmitError(f"{at(op, k)}: leaves binds a constant that does not feed the loss")
        if not isinstance(expr, str) or not expr.strip() or re.search(r"[;{}\n]", expr):
            raise EmitError(f"{at(op, k)}: expected a C expression for this constant, got {expr!r}")
        bind[k] = expr.strip()
    unbound = [k for k in live if nodes[k].op is O.const and k not in bind]
    if unbound and not bake:
        raise EmitError(f"{at('const', unbound[0])}: the loss reads this constant but leaves does not bind it "
                        f"(unbound nodes {unbound}); bind each to a C expression, or pass bake=True to compile "
                        f"in its recorded value")
    for k in live:
        if nodes[k].op is O.const and k not in bind:
            if tape._val[k] is None:
                raise EmitError(f"{at('const', k)}: a lazy or dropped constant has no value to bake in; bind it "
                                f"to a C expression in leaves")
            bind[k] = literal(tape._val[k].reshape(-1)[0], dialect)
    return bind


def _source(tape, top, live, bind, pids, dialect, name, with_data):
    nodes = tape._nodes
    env_s = {}
    fwd, bwd = [], []
    for k in live:
        n = nodes[k]
        if not n.op.arity:
            fwd.append(f"double t{k} = {bind[k]};")
            continue
        env = {"a": f"t{n.a}", "b": f"t{n.b}", "out": f"t{k}"}
        if isinstance(n.s, (int, float)):
            env["s"] = literal(n.s, dialect)
        env_s[k] = env
        fwd.append(f"double t{k} = {_expr(forms(n.op)[0], env, dialect)};")
    # A gradient is declared by its first contribution, which the tape copies (0.0 + c would turn a
    # -0.0 into +0.0); later ones are added in the tape's order: consumers from the highest id down,
    # a before b.
    seen = set()
    if nodes[top].req:
        bwd.append(f"double g{top} = 1.0;")
        seen.add(top)
    for k in reversed(live):
        n = nodes[k]
        if not (n.req and n.op.arity):
            continue
        env = dict(env_s[k], g=f"g{k}")
        for j, text in ((n.a, forms(n.op)[1]), (n.b, forms(n.op)[2])):
            if j < 0 or not nodes[j].req:
                continue
            c = _expr(text, env, dialect)
            if j not in seen:
                seen.add(j)
                bwd.append(f"double g{j} = {c};")
            elif dialect == "cuda":
                bwd.append(f"g{j} = __dadd_rn(g{j}, {c});")
            else:
                bwd.append(f"g{j} += {c};")
    epi = [f"g[{j}] = __dadd_rn(g[{j}], g{k});" if dialect == "cuda" else f"g[{j}] += g{k};"
           for j, k in enumerate(pids)]
    args = ["const double *p", "double *g"] + (["const double *v"] if with_data else [])
    unused = ["p", "g"] if not pids else []
    if with_data and not any(re.search(r"\bv\b", bind[k]) for k in live if not nodes[k].op.arity):
        unused.append("v")
    where = "".join(f"; p[{j}] = node {k}" for j, k in enumerate(pids))
    head = [f"/* tapegrad.emit.c_grad: returns t{top}{where}. */"]
    if dialect == "c":
        head += ["#include <math.h>", ""]
        sig = f"double {name}({', '.join(args)})"
    else:
        head += ["/* Every + - * / is a round-to-nearest intrinsic, so no FMA contraction changes the result. */",
                 ""]
        sig = f"__device__ double {name}({', '.join(args)})"
    body = [f"(void){u};" for u in unused] + fwd + ([""] + bwd if bwd else []) + ([""] + epi if epi else [])
    body.append(f"return t{top};")
    return "\n".join(head + [sig, "{"] + [f"    {s}" if s else "" for s in body] + ["}", ""])
