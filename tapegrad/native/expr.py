"""The registry's scalar C expressions: parsed once, constant-folded, printed in a dialect (C or CUDA).

An expression is over the names ``a b c s out g`` (see ``tapegrad.ops``). Printing binds those names to
operand strings; ``s`` and literal-only subtrees are folded in Python doubles, as NumPy computes them
on the host before one ufunc call, and every literal goes through one exact printer.

>>> e = parse("g * (s * pow(a, s - 1.0))")
>>> C64.render(e, {"g": "g1[i]", "a": "v0[i]"}, s=3.0)
'(g1[i] * (3.0 * pow(v0[i], 2.0)))'
>>> CUDA64.render(e, {"g": "g1[i]", "a": "v0[i]"}, s=3.0)
'__dmul_rn(g1[i], __dmul_rn(3.0, pow(v0[i], 2.0)))'
>>> C32.render(parse("a > 0.0 ? a : 0.0"), {"a": "x"})
'tg_sel((x > 0.0f), x, 0.0f)'
>>> CUDA32.render(parse("c ? a : 0.0"), {"a": "x", "c": "m[i]"})
'(m[i] ? x : 0.0f)'
>>> C32.render(parse("g * tg_digamma(a) + lgamma(a)"), {"g": "y", "a": "x"})
'((y * tg_digamma(x)) + lgammaf(x))'
>>> C64.render(parse("log(a)"), {"a": "x"}), C32.render(parse("log(a)"), {"a": "x"})
('log(x)', 'tg_log(x)')
"""
import math
import re
import struct

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)"   # a number
                    r"|([A-Za-z_]\w*)"                                         # a name
                    r"|(>=|<=|==|!=|&&|\|\||[-+*/?:(),<>!]))")                  # an operator
_BIN = [("?",), ("||",), ("&&",), ("==", "!="), ("<", ">", "<=", ">="), ("+", "-"), ("*", "/")]
# The C functions an expression may call: name -> (float64 spelling, float32 spelling). The C library's
# float functions carry an ``f`` suffix; CUDA's device functions have the same names in both precisions.
# ``tg_*`` are helpers of the native runtime (``runtime_special.c``), written over ``real`` (either
# precision) and spelled the same in both; a CUDA build must compile them as device functions too.
_LIBM = ("exp", "log", "sqrt", "fabs", "tanh", "pow", "log1p", "expm1", "erf", "erfc", "lgamma", "sin", "cos",
         "tan", "atan2", "asinh")
FUNCS = {**{f: (f, f + "f") for f in _LIBM}, "tg_digamma": ("tg_digamma",) * 2, "tg_trigamma": ("tg_trigamma",) * 2}
RUNTIME_FUNCS = frozenset(f for f in FUNCS if f.startswith("tg_"))
# exp and tanh as the native runtime's (runtime_vmath.c): the C library's cannot be vectorised; a CUDA
# program compiles the same file for the device, so both compute the same bits. A float32 program also
# takes the runtime's log and erf (float64 keeps the C library's: the runtime has no double log or erf).
VECTOR_MATH = {"exp": "tg_exp", "tanh": "tg_tanh"}
VECTOR_MATH32 = {**VECTOR_MATH, "log": "tg_log", "erf": "tg_erf"}


def tokens(src):
    pos, out = 0, []
    src = src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise ValueError(f"C expression {src!r}: cannot read at {src[pos:]!r}")
        num, name, sym = m.groups()
        out.append(("num", float(num)) if num else ("name", name) if name else ("sym", sym))
        pos = m.end()
    return out


def parse(src):
    """A tuple AST: ("num", x) ("var", n) ("neg", e) ("not", e) ("bin", op, x, y) ("tern", c, x, y)
    ("call", f, args)."""
    toks = tokens(src)
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else ("end", None)

    def take(sym=None):
        t = peek()
        if sym is not None and t != ("sym", sym):
            raise ValueError(f"C expression {src!r}: expected {sym!r}, got {t[1]!r}")
        pos[0] += 1
        return t

    def level(k):
        if k == len(_BIN):
            return unary()
        if _BIN[k] == ("?",):
            c = level(k + 1)
            if peek() == ("sym", "?"):
                take()
                x = level(0)
                take(":")
                y = level(0)
                return ("tern", c, x, y)
            return c
        x = level(k + 1)
        while peek()[0] == "sym" and peek()[1] in _BIN[k]:
            op = take()[1]
            x = ("bin", op, x, level(k + 1))
        return x

    def unary():
        t = peek()
        if t == ("sym", "-"):
            take()
            return ("neg", unary())
        if t == ("sym", "!"):
            take()
            return ("not", unary())
        if t == ("sym", "("):
            take()
            x = level(0)
            take(")")
            return x
        if t[0] == "num":
            take()
            return ("num", t[1])
        if t[0] == "name":
            take()
            if peek() == ("sym", "("):
                if t[1] not in FUNCS:
                    raise ValueError(f"C expression {src!r}: unknown function {t[1]!r}")
                take()
                args = [level(0)]
                while peek() == ("sym", ","):
                    take()
                    args.append(level(0))
                take(")")
                return ("call", t[1], tuple(args))
            if t[1] not in ("a", "b", "c", "s", "out", "g"):
                raise ValueError(f"C expression {src!r}: unknown name {t[1]!r} (allowed: a b c s out g)")
            return ("var", t[1])
        raise ValueError(f"C expression {src!r}: unexpected {t[1]!r}")

    e = level(0)
    if pos[0] != len(toks):
        raise ValueError(f"C expression {src!r}: trailing {toks[pos[0]][1]!r}")
    return e


def names(e):
    """The operand names an expression reads."""
    if e[0] == "var":
        return {e[1]}
    if e[0] == "num":
        return set()
    kids = e[2] if e[0] == "call" else e[2:] if e[0] == "bin" else e[1:]
    out = set()
    for k in kids:
        out |= names(k)
    return out


def branch_names(e):
    """The operand names read inside a branch of a ``?:`` (a compiler may load those conditionally).

    >>> sorted(branch_names(parse("c ? a : b"))), sorted(branch_names(parse("g * (a > 0.0 ? 1.0 : 0.0)")))
    (['a', 'b'], [])
    """
    if e[0] in ("num", "var"):
        return set()
    if e[0] == "tern":
        return names(e[2]) | names(e[3]) | branch_names(e[1])
    kids = e[2] if e[0] == "call" else e[2:] if e[0] == "bin" else e[1:]
    out = set()
    for k in kids:
        out |= branch_names(k)
    return out


def calls(e):
    """The functions an expression calls."""
    if e[0] in ("num", "var"):
        return set()
    if e[0] == "call":
        out = {e[1]}
        for x in e[2]:
            out |= calls(x)
        return out
    kids = e[2:] if e[0] == "bin" else e[1:]
    out = set()
    for k in kids:
        out |= calls(k)
    return out


def fold(e, s):
    """Substitute the static scalar ``s`` and evaluate literal-only arithmetic in Python doubles."""
    kind = e[0]
    if kind == "var" and e[1] == "s":
        return ("num", float(s))
    if kind in ("num", "var"):
        return e
    if kind == "neg":
        x = fold(e[1], s)
        return ("num", -x[1]) if x[0] == "num" else ("neg", x)
    if kind == "not":
        return ("not", fold(e[1], s))
    if kind == "bin":
        x, y = fold(e[2], s), fold(e[3], s)
        if x[0] == "num" and y[0] == "num" and e[1] in "+-*/":
            a, b = x[1], y[1]
            return ("num", a + b if e[1] == "+" else a - b if e[1] == "-" else a * b if e[1] == "*" else a / b)
        return ("bin", e[1], x, y)
    if kind == "tern":
        return ("tern", fold(e[1], s), fold(e[2], s), fold(e[3], s))
    return ("call", e[1], tuple(fold(x, s) for x in e[2]))


_TESTS = ("<", ">", "<=", ">=", "==", "!=", "&&", "||")


class Dialect:
    """How one target spells literals, arithmetic and libm: plain C (float64/float32) or CUDA.

    ``select``: the function that prints ``c ? x : y`` (the native runtime's ``tg_sel``, a blend of
    both arms' bits), or None for C's ``?:``. Printed as ``?:``, a select whose arm is a constant lets
    GCC fold the constant into the code after it and branch, which it will not vectorise without
    AVX-512's masks (runtime_vmath.c's tg_vm_sel); both arms of a vector select are computed anyway."""

    def __init__(self, real, suffix, rn=None, spelled=None, select=None):
        self.real, self.suffix, self.rn, self.spelled, self.select = real, suffix, rn, spelled or {}, select

    def lit(self, x):
        """The one literal printer: exact (``repr`` round-trips), typed as ``real``."""
        if math.isnan(x):
            return "NAN"
        if math.isinf(x):
            return "INFINITY" if x > 0 else "(-INFINITY)"
        r = repr(float(x))
        if self.real == "float":
            r = r + "f" if _f32(x) == x else f"((float){r})"
        return r if x >= 0 or r.startswith("(") else f"({r})"

    def func(self, f):
        return self.spelled.get(f) or FUNCS[f][self.real == "float"]

    def render(self, e, env, s=None):
        return self.print(fold(e, s), env)

    def print(self, e, env):
        kind = e[0]
        if kind == "num":
            return self.lit(e[1])
        if kind == "var":
            return env[e[1]]
        if kind == "neg":
            return f"(-{self.print(e[1], env)})"
        if kind == "not":
            return f"(!{self.print(e[1], env)})"
        if kind == "tern":
            c, x, y = self.print(e[1], env), self.print(e[2], env), self.print(e[3], env)
            if self.select is None:
                return f"({c} ? {x} : {y})"
            test = e[1][0] == "not" or (e[1][0] == "bin" and e[1][1] in _TESTS)
            return f"{self.select}({c if test else f'({c} != 0)'}, {x}, {y})"
        if kind == "call":
            return f"{self.func(e[1])}({', '.join(self.print(x, env) for x in e[2])})"
        op, x, y = e[1], self.print(e[2], env), self.print(e[3], env)
        if self.rn and op in "+-*/":
            name = {"+": "add", "-": "sub", "*": "mul", "/": "div"}[op]
            return f"__{self.rn}{name}_rn({x}, {y})"
        return f"({x} {op} {y})"


def _f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


C64 = Dialect("double", "", spelled=VECTOR_MATH, select="tg_sel")
C32 = Dialect("float", "f", spelled=VECTOR_MATH32, select="tg_sel")
CUDA64 = Dialect("double", "", rn="d", spelled=VECTOR_MATH)
CUDA32 = Dialect("float", "f", rn="f", spelled=VECTOR_MATH32)


def dialect(dtype, target="c"):
    f32 = str(dtype) == "float32"
    if target == "cuda":
        return CUDA32 if f32 else CUDA64
    return C32 if f32 else C64
