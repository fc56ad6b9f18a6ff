"""tapegrad.emit: emitted C and CUDA source, compiled by the host compiler and compared with the tape.

The oracle is the tape itself. Every program is recorded once, emitted, compiled (warnings as errors,
``-ffp-contract=off``; ``-march=native`` on x86-64 so FMA instructions exist and the flag matters), and
called on hundreds of random inputs, each of which is also recorded on a fresh tape. Values and
gradients must be equal (``==``: only the sign of a zero may differ). Ops of the registry's "libm" tier
call the C library's exp/log/tanh/pow, which on some inputs differ from NumPy's SIMD versions by an ulp
or two; for those the test checks, input by input, whether every libm call of the recorded tape gives
NumPy's bits — then the emitted code must still match exactly — and otherwise reports the ulp distance
and asserts the bound stated at ``libm_close``.

Regenerate the golden sources with ``TAPEGRAD_REGEN_GOLDEN=1 pytest tests/test_emit.py``.
"""
import ctypes
import ctypes.util
import itertools
import math
import os
import pathlib
import platform
import shutil
import subprocess
from typing import Callable, NamedTuple

import numpy as np
import pytest
import scipy.special

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.emit import EmitError, c_grad, forms, literal, runtime_helper

GOLDEN = pathlib.Path(__file__).parent / "golden"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
FLAGS = ["-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS.append("-march=native")
N_INPUTS = 300
EPS = np.finfo(np.float64).eps

# Compiling the CUDA dialect as host C++: the qualifier vanishes, the intrinsics are plain IEEE ops.
PRELUDE = """\
#include <math.h>
#include <string.h>
#define __device__
static inline double __dadd_rn(double x, double y) { return x + y; }
static inline double __dsub_rn(double x, double y) { return x - y; }
static inline double __dmul_rn(double x, double y) { return x * y; }
static inline double __ddiv_rn(double x, double y) { return x / y; }
static inline double __dsqrt_rn(double x) { return sqrt(x); }
static inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, sizeof d); return d; }
"""


# ── programs ─────────────────────────────────────────────────────────────────

class Prog(NamedTuple):
    name: str
    sample: Callable   # rng -> (param arrays, data arrays)
    build: Callable    # (tape, param Vars, data Vars) -> loss Var


def normal(rng, shape=()):
    return rng.standard_normal(shape)


def grid(rng, shape):
    """Few distinct values, so maximum's ties (gradient shared 1/2 : 1/2) occur often."""
    return rng.integers(-3, 4, shape) * 0.37


def sampler(dom):
    return grid if dom is O.spread else dom


# One-element (a_shape, b_shape, s) for each op that is not elementwise.
SCALAR_CASES = {
    "sum": ((1, 1), None, ((1,), False)), "mean": ((1,), None, (None, False)), "max": ((1,), None, ((0,), True)),
    "transpose": ((1, 1), None, (1, 0)), "reshape": ((1,), None, (1, 1)), "broadcast_to": ((), None, (1, 1)),
    "slice": ((1, 1), None, ((0, 1), (0, 1))), "softmax": ((1,), None, 0), "logsoftmax": ((1, 1), None, 1),
    "softmax_xent": ((1,), (1,), 0), "matmul": ((1, 1), (1, 1), None), "bmm": ((1, 1, 1), (1, 1, 1), None),
    "cumsum": ((1,), None, (0, False)), "cumprod": ((1, 1), None, (1, True)), "cummax": ((1,), None, (0, True)),
    "sort": ((1,), None, 0), "min": ((1,), None, ((0,), True)), "prod": ((1, 1), None, ((0, 1), False)),
    "logsumexp": ((1,), None, (None, False)),
}
# concat: two non-empty inputs never make one element; ops with data inputs (indices, masks) and the
# families without a one-element form (emit.forms says None) are refused by name (test below); so are ops
# whose C form calls a native-runtime helper (tg_digamma): tests/test_ops_special.py
NO_SCALAR_FORM = {op.name for op in O.OPS.values() if op.arity and forms(op) is None}
EMITTABLE = [op for op in O.OPS.values() if op.arity and op.name not in NO_SCALAR_FORM and runtime_helper(op) is None]


def scalar_case(op):
    if op.name in SCALAR_CASES:
        return SCALAR_CASES[op.name]
    s = next((c[2] for c in op.cases if c[2] is not None), None)
    return ((1,), () if op.arity == 2 else None, s)


def op_programs(op):
    """``op(x, y) · d`` (d a data leaf, so the cotangent is not 1), and for binary ops ``op(x, x)``
    (both operands one node: a's contribution, then b's) and ``op(x, c)`` with c a constants-only branch."""
    sa, sb, s = scalar_case(op)
    da = sampler(op.domain[0])
    if op.arity == 1:
        return [Prog(op.name, lambda r: ([da(r, sa)], [normal(r)]),
                     lambda t, P, V: t.apply(op, P[0], None, s) * V[0])]
    db = sampler(op.domain[1])
    const_b = (lambda c: c * c + 0.5) if op.domain[1] is O.positive else (lambda c: c * c - 0.5)
    return [
        Prog(op.name, lambda r: ([da(r, sa), db(r, sb)], [normal(r)]),
             lambda t, P, V: t.apply(op, P[0], P[1], s) * V[0]),
        Prog(op.name + "-same", lambda r: ([db(r, sa)], [normal(r)]),
             lambda t, P, V: t.apply(op, P[0], P[0], s) * V[0]),
        Prog(op.name + "-const", lambda r: ([da(r, sa)], [normal(r), normal(r, sb)]),
             lambda t, P, V: t.apply(op, P[0], const_b(V[1]), s) * V[0]),
    ]


def fanout(t, P, V):
    x, y, z = P
    d0, d1 = V
    h = x * y
    k = h + x
    m = h * h
    c = d0 * d1 - 1.5                      # constants only: no backward code
    n = (k - c) / (z * z + 1.0)
    r = tg.maximum(k, c).relu()
    w = (h * h + 1.0).sqrt()
    return m * k - n * h + r + (z - d1).abs() * w + 2.5 / (w + k * k) + (-x).square() / 2.0 - z * 0.1


def logreg(t, P, V):
    *w, b = P
    *x, y = V
    z = w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + b
    return z.relu() - z * y + (1.0 + (-z.abs()).exp()).log()


def mlp(t, P, V):
    a00, a01, a10, a11, c0, c1 = P
    x0, x1, target = V
    h0 = (a00 * x0 + a01 * x1).tanh()
    h1 = (a10 * x0 + a11 * x1).tanh()
    o = (c0 * h0 + c1 * h1).sigmoid()
    return (o - target).square() + 1e-3 * (c0 * c0 + 1.0) ** 1.5 + 0.01 * (a00 * a00 + 1.0).log()


def baked(t, P, V):
    x, = P
    return x / 3.0 + t.const(np.array(0.1)) * x + t.const(np.array([-1e-300])) * x.exp()


COMPOSITE = [
    Prog("fanout", lambda r: ([normal(r) for _ in range(3)], [normal(r), grid(r, ())]), fanout),
    Prog("logreg", lambda r: ([normal(r) for _ in range(4)], [normal(r) for _ in range(3)] + [float(r.integers(0, 2))]),
         logreg),
    Prog("mlp", lambda r: ([normal(r) for _ in range(6)], [normal(r), normal(r), r.uniform()]), mlp),
    Prog("consts_only", lambda r: ([], [normal(r), normal(r)]), lambda t, P, V: (V[0] * V[1]).exp() + V[0]),
    Prog("identity", lambda r: ([normal(r, (1, 1))], []), lambda t, P, V: P[0]),
    Prog("baked", lambda r: ([normal(r)], []), baked),
]
OP_PROGRAMS = {p.name: p for op in EMITTABLE for p in op_programs(op)}
PROGRAMS = OP_PROGRAMS | {p.name: p for p in COMPOSITE}


def record(prog, P, V):
    tape = tg.Tape()
    pv = [tape.param(np.asarray(x, np.float64)) for x in P]
    vv = [tape.const(np.asarray(x, np.float64)) for x in V]
    loss = prog.build(tape, pv, vv)
    assert tape.backward(loss)
    return tape, pv, vv, loss


def emit(prog, dialect="c", name=None):
    P, V = prog.sample(np.random.default_rng(0))
    tape, pv, vv, loss = record(prog, P, V)
    return c_grad(tape, loss, pv, {v: f"v[{j}]" for j, v in enumerate(vv)}, dialect=dialect,
                  name=name or cname(prog), with_data=bool(V), bake=prog.name == "baked")


def cname(prog):
    return "f_" + prog.name.replace("-", "_")


# ── building and calling ─────────────────────────────────────────────────────

LITERALS = [0.1, 1 / 3, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e23, -2.5e-7,
            123456789.00000001, math.inf, -math.inf, math.nan]


def literal_fn(dialect):
    body = "".join(f"    out[{k}] = {literal(x, dialect)};\n" for k, x in enumerate(LITERALS))
    return f"{'__device__ ' if dialect == 'cuda' else ''}void literals(double *out)\n{{\n{body}}}\n"


def build(tmp, dialect):
    """One shared library holding every program (one compiler run per dialect)."""
    if dialect == "c":
        if CC is None:
            pytest.skip("no C compiler (cc, gcc or clang) on PATH")
        src = "".join(emit(p) for p in PROGRAMS.values()) + literal_fn("c")
        cmd, path = [CC, "-std=c99", *FLAGS], tmp / "emit.c"
    else:
        if CXX is None:
            pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
        src = PRELUDE + "".join(emit(p, "cuda") for p in PROGRAMS.values()) + literal_fn("cuda")
        for p in PROGRAMS.values():
            v = has_data(p)
            src += (f'extern "C" double host_{cname(p)}(const double *p, double *g{", const double *v" * v})'
                    f' {{ return {cname(p)}(p, g{", v" * v}); }}\n')
        src += 'extern "C" void host_literals(double *out) { literals(out); }\n'
        cmd, path = [CXX, "-x", "c++", *FLAGS], tmp / "emit_cuda.cpp"
    path.write_text(src)
    lib = path.with_suffix(".so")
    run = subprocess.run(cmd + ["-o", str(lib), str(path), "-lm"], capture_output=True, text=True)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[:4000]}"
    return ctypes.CDLL(str(lib))


def has_data(prog):
    return bool(prog.sample(np.random.default_rng(0))[1])


def function(lib, prog, dialect):
    f = getattr(lib, ("host_" if dialect == "cuda" else "") + cname(prog))
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.POINTER(ctypes.c_double)] * (2 + has_data(prog))
    ptr = lambda x: x.ctypes.data_as(ctypes.POINTER(ctypes.c_double))  # noqa: E731

    def call(P, V, g=None):
        p = np.array([np.asarray(x).reshape(-1)[0] for x in P], np.float64)
        g = np.zeros(max(len(P), 1)) if g is None else g
        v = np.array([np.asarray(x).reshape(-1)[0] for x in V], np.float64)
        args = (ptr(p), ptr(g)) + ((ptr(v),) if V else ())
        return [f(*args)] + [float(x) for x in g[:len(P)]]
    return call


def expected(tape, pv, loss):
    """The tape's loss and gradients, as the emitted function returns them."""
    return [float(tape.value(loss).reshape(-1)[0])] + [float(tape.grad(v).reshape(-1)[0]) for v in pv]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emit")
    return {d: build(tmp, d) for d in ("c", "cuda")}


# ── comparing ────────────────────────────────────────────────────────────────

def ulps(x, y):
    """Distance in units in the last place (0 when x == y, or both are NaN)."""
    if math.isnan(x) or math.isnan(y):
        return 0 if math.isnan(x) and math.isnan(y) else math.inf
    i, j = (int(np.float64(v).view(np.int64)) for v in (x, y))
    i, j = (k if k >= 0 else -(k & 0x7FFFFFFFFFFFFFFF) for k in (i, j))
    return abs(i - j)


LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _f, _n in (("exp", 1), ("log", 1), ("tanh", 1), ("pow", 2), ("log1p", 1), ("expm1", 1), ("erf", 1), ("erfc", 1),
               ("sin", 1), ("cos", 1), ("tan", 1), ("atan2", 2), ("asinh", 1)):
    getattr(LIBM, _f).restype = ctypes.c_double
    getattr(LIBM, _f).argtypes = [ctypes.c_double] * _n

# The C-library calls each libm-tier op makes in the emitted code, from its input a and operand s.
LIBM_CALLS = {
    "exp": lambda a, s: [("exp", a)], "log": lambda a, s: [("log", a)], "tanh": lambda a, s: [("tanh", a)],
    "sigmoid": lambda a, s: [("exp", -abs(a))], "pow": lambda a, s: [("pow", a, s), ("pow", a, s - 1.0)],
    "softmax": lambda a, s: [("exp", 0.0)], "logsoftmax": lambda a, s: [("exp", 0.0), ("log", 1.0)],
    "softmax_xent": lambda a, s: [("exp", 0.0), ("log", 1.0)],
    "logsumexp": lambda a, s: [("exp", 0.0), ("log", 1.0)],
    "log1p": lambda a, s: [("log1p", a)], "expm1": lambda a, s: [("expm1", a)],
    "erf": lambda a, s: [("erf", a), ("exp", -(a * a))], "erfc": lambda a, s: [("erfc", a), ("exp", -(a * a))],
    "sin": lambda a, s: [("sin", a), ("cos", a)], "cos": lambda a, s: [("cos", a), ("sin", a)],
    "tan": lambda a, s: [("tan", a)], "asinh": lambda a, s: [("asinh", a)],
    "softplus": lambda a, s: [("exp", -abs(a)), ("log1p", float(np.exp(-abs(a))))],
    "log_sigmoid": lambda a, s: [("exp", -abs(a)), ("log1p", float(np.exp(-abs(a))))],
}
# binary libm ops: the calls from both inputs
LIBM_CALLS2 = {"atan2": lambda a, b, s: [("atan2", a, b)]}
# the tape's function for each C-library name (NumPy's, else SciPy's)
TAPE_FN = {"atan2": np.arctan2, "asinh": np.arcsinh, "erf": scipy.special.erf, "erfc": scipy.special.erfc}


def libm_agrees(tape, loss):
    """Whether every libm call the emitted code makes on this tape's values returns NumPy's bits."""
    for n in tape.nodes[:loss.id + 1]:
        if n.op.tier != "libm":
            continue
        a = float(tape._val[n.a].reshape(-1)[0])
        if n.op.name in LIBM_CALLS2:
            todo = LIBM_CALLS2[n.op.name](a, float(tape._val[n.b].reshape(-1)[0]), n.s)
        else:
            todo = LIBM_CALLS[n.op.name](a, n.s)
        for f, *args in todo:
            ref = np.power(np.array([args[0]]), args[1]) if f == "pow" else \
                TAPE_FN.get(f, getattr(np, f, None))(*[np.array([x]) for x in args])
            if ulps(float(ref[0]), getattr(LIBM, f)(*args)):
                return False
    return True


def libm_close(c, t, scale):
    """The stated bound where a libm call and NumPy's differ: within 4 ulp, or within 8·eps·scale
    absolutely (scale = max(1, |data|), the cotangents and factors the programs multiply by).

    NumPy's AVX-512 exp/log/tanh/pow and glibc's are each within about 1 ulp of the true result, so one
    call differs by at most 2 ulp (measured: 2 for tanh, 1 for the others). Without cancellation
    afterwards that stays within a few ulp. The derivatives 1 − out², out·(1 − out) and sums like
    z·y − log(1 + e) cancel, which inflates the ulp count but not the absolute error: the outputs
    involved are at most 1 in magnitude (2 ulp ≤ 2 eps) and what follows has a derivative of at most
    2·scale with respect to them, hence 4·eps·scale plus rounding."""
    return ulps(c, t) <= 4 or abs(c - t) <= 8 * EPS * scale


# ── the oracle ───────────────────────────────────────────────────────────────

def has_libm(prog):
    P, V = prog.sample(np.random.default_rng(0))
    tape, *_ = record(prog, P, V)
    return any(n.op.tier == "libm" for n in tape.nodes)


@pytest.mark.parametrize("dialect", ["c", "cuda"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_emitted_code_equals_tape(libs, name, dialect, record_property):
    prog = PROGRAMS[name]
    call = function(libs[dialect], prog, dialect)
    rng = np.random.default_rng(1)
    exact, worst, libm = 0, [0, 0], has_libm(prog)
    for _ in range(N_INPUTS):
        P, V = prog.sample(rng)
        tape, pv, vv, loss = record(prog, P, V)
        want, got = expected(tape, pv, loss), call(P, V)
        if not libm or libm_agrees(tape, loss):
            exact += 1
            assert [ulps(x, y) for x, y in zip(got, want)] == [0] * len(got), (name, P, V, got, want)
            continue
        scale = max([1.0] + [abs(float(x)) for x in V])
        assert all(libm_close(x, y, scale) for x, y in zip(got, want)), (name, P, V, got, want)
        worst = [max(worst[0], ulps(got[0], want[0])), max([worst[1], *map(ulps, got[1:], want[1:])])]
    record_property("libm_disagreements", N_INPUTS - exact)
    if exact < N_INPUTS:
        print(f"{name} [{dialect}]: {exact}/{N_INPUTS} inputs bit-exact; where libm and NumPy differ: value "
              f"≤ {worst[0]} ulp, gradient ≤ {worst[1]} ulp")


def test_cuda_dialect_gives_the_c_bits(libs):
    rng = np.random.default_rng(2)
    for prog in PROGRAMS.values():
        c, cu = function(libs["c"], prog, "c"), function(libs["cuda"], prog, "cuda")
        for _ in range(20):
            P, V = prog.sample(rng)
            assert np.array_equal(np.array(c(P, V)).view(np.int64), np.array(cu(P, V)).view(np.int64)), prog.name


SPECIAL = [0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 5e-324, 1e308]
# Registry C forms that may differ from NumPy when the input a is NaN (none today: abs's derivative
# now passes NaN through as np.sign does).
NAN_GAPS = set()


def test_exact_ops_on_special_values(libs):
    """Signed zeros, infinities, NaN, subnormals, huge values: exact-tier ops still give the tape's bits."""
    gaps = set()
    for name, prog in OP_PROGRAMS.items():
        P0, V0 = prog.sample(np.random.default_rng(0))
        if has_libm(prog):
            continue
        call = function(libs["c"], prog, "c")
        for combo in itertools.product(SPECIAL, repeat=len(P0)):
            P, V = [np.full(np.shape(p), c) for p, c in zip(P0, combo)], [np.full(np.shape(v), 1.5) for v in V0]
            with np.errstate(all="ignore"):
                tape, pv, _, loss = record(prog, P, V)
            got, want = call(P, V), expected(tape, pv, loss)
            if any(map(ulps, got, want)):
                assert name in NAN_GAPS and math.isnan(combo[0]), (name, combo, got, want)
                gaps.add(name)
    assert gaps == NAN_GAPS


def test_oracle_sees_fma_contraction(tmp_path):
    """The oracle can fail: the same source built with -ffp-contract=fast on an FMA machine differs."""
    if CC is None or "-march=native" not in FLAGS:
        pytest.skip("needs a C compiler and an x86-64 host")
    probe = subprocess.run([CC, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                           text=True)
    if "__FMA__" not in probe.stdout:
        pytest.skip("this CPU has no FMA instructions, so contraction cannot happen")
    prog = PROGRAMS["fanout"]
    path = tmp_path / "fma.c"
    path.write_text(emit(prog))
    flags = [f.replace("-ffp-contract=off", "-ffp-contract=fast") for f in FLAGS]
    subprocess.run([CC, *flags, "-o", str(tmp_path / "fma.so"), str(path), "-lm"], check=True)
    call = function(ctypes.CDLL(str(tmp_path / "fma.so")), prog, "c")
    rng, differ = np.random.default_rng(4), 0
    for _ in range(50):
        P, V = prog.sample(rng)
        tape, pv, _, loss = record(prog, P, V)
        differ += any(map(ulps, call(P, V), expected(tape, pv, loss)))
    assert differ > 0


def test_gradient_is_added_into_g(libs):
    prog = PROGRAMS["fanout"]
    P, V = prog.sample(np.random.default_rng(3))
    tape, pv, _, loss = record(prog, P, V)
    g0 = np.array([0.25, -1e-3, 7.0])
    _, *g = function(libs["c"], prog, "c")(P, V, g0.copy())
    assert np.array_equal(g, g0 + np.array(expected(tape, pv, loss)[1:]))


@pytest.mark.parametrize("dialect", ["c", "cuda"])
def test_literals_round_trip(libs, dialect):
    f = getattr(libs[dialect], "host_literals" if dialect == "cuda" else "literals")
    f.argtypes = [ctypes.POINTER(ctypes.c_double)]
    out = np.zeros(len(LITERALS))
    f(out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)))
    want = np.array(LITERALS)
    assert np.array_equal(out[:-1].view(np.int64), want[:-1].view(np.int64)) and math.isnan(out[-1])


@pytest.mark.parametrize("op", [op for op in O.OPS.values() if op.arity], ids=lambda op: op.name)
def test_every_op_has_a_scalar_form_or_says_it_has_none(op):
    if op.name in NO_SCALAR_FORM:
        assert forms(op) is None
        assert op.data or op.kind != "elementwise", f"{op.name}: an elementwise float op has a scalar C form"
    elif runtime_helper(op):   # c_grad refuses it with a message (tests/test_ops_special.py)
        assert forms(op) is not None and op.name not in PROGRAMS
    else:
        assert forms(op) is not None and op.name in PROGRAMS


# ── golden source ────────────────────────────────────────────────────────────

@pytest.mark.parametrize("name, dialect", [("logreg", "c"), ("logreg", "cuda"), ("fanout", "c")])
def test_golden_source(name, dialect):
    path = GOLDEN / f"emit_{name}.{'cu' if dialect == 'cuda' else 'c'}"
    src = emit(PROGRAMS[name], dialect, name="grad")
    if os.environ.get("TAPEGRAD_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(src)
    assert src == path.read_text(), f"{path} differs; review and regenerate with TAPEGRAD_REGEN_GOLDEN=1"


@pytest.mark.compilers
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the cuda dialect is checked as host C++ only")
def test_nvcc_contracts_the_c_body_but_not_the_cuda_dialect(tmp_path):
    """The same program (no libm calls, whose device code uses FMAs inside) compiled to PTX with nvcc's
    defaults (--fmad=true): the C body gets FMA contractions, the cuda dialect none."""
    kernel = "__global__ void k(const double *p, double *g, const double *v, double *l) { *l = grad(p, g, v); }\n"
    c_body = emit(PROGRAMS["fanout"], "c", name="grad").replace("double grad(", "__device__ double grad(")
    fmas = []
    for tag, src in (("c", c_body), ("cuda", emit(PROGRAMS["fanout"], "cuda", name="grad"))):
        (tmp_path / f"{tag}.cu").write_text(src + kernel)
        run = subprocess.run(["nvcc", "-ptx", "-Werror", "all-warnings", "-o", str(tmp_path / f"{tag}.ptx"),
                              str(tmp_path / f"{tag}.cu")], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[:4000]
        fmas.append((tmp_path / f"{tag}.ptx").read_text().count("fma.rn.f64"))
    assert fmas[0] > 0 and fmas[1] == 0, fmas


# ── errors ───────────────────────────────────────────────────────────────────

def scalar_tape():
    tape = tg.Tape()
    w, x = tape.param(np.array(2.0)), tape.const(np.array(3.0))
    return tape, w, x, w * x


def test_error_non_scalar_node():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    with pytest.raises(EmitError, match=r"^param \(node 0\): expected one element \(c_grad emits scalar tapes\), "
                                        r"got shape \(2,\); record the per-example loss on one-element Vars$"):
        c_grad(tape, (w * w).sum(), [w], {})


def test_error_op_without_scalar_form():
    fake = O.Op("fake", 1, O.same, fwd=lambda a, b, s, out, ws: np.copyto(out, a))
    tape, w, x, y = scalar_tape()
    with pytest.raises(EmitError, match=r"^fake \(node 3\): op fake has no scalar C form"):
        c_grad(tape, tape.apply(fake, y), [w], {x: "v[0]"})


def test_error_unknown_leaf_binding():
    tape, w, x, y = scalar_tape()
    with pytest.raises(EmitError, match=r"^param \(node 0\): leaves binds constants only, got a param node; "
                                        r"parameters bind to p\[j\] through params$"):
        c_grad(tape, y, [w], {w: "v[0]"})
    with pytest.raises(EmitError, match=r"^mul \(node 2\): leaves binds constants only, got a mul node$"):
        c_grad(tape, y, [w], {y: "v[0]"})
    unused = tape.const(np.array(1.0))
    with pytest.raises(EmitError, match=r"^const \(node 3\): leaves binds a constant that does not feed the loss$"):
        c_grad(tape, y, [w], {x: "v[0]", unused: "v[1]"})
    with pytest.raises(EmitError, match=r"^const \(node 1\): expected a C expression for this constant, got ''$"):
        c_grad(tape, y, [w], {x: ""})
    with pytest.raises(EmitError, match=r"^const \(node 1\): the loss reads this constant but leaves does not "
                                        r"bind it \(unbound nodes \[1\]\); bind each to a C expression, or pass "
                                        r"bake=True to compile in its recorded value$"):
        c_grad(tape, y, [w], {})
    assert "double t1 = 3.0;" in c_grad(tape, y, [w], {}, bake=True)
    lazy = tape.const_lazy((1,))
    with pytest.raises(EmitError, match=r"^const \(node 4\): a lazy or dropped constant has no value to bake in; "
                                        r"bind it to a C expression in leaves$"):
        c_grad(tape, w * lazy, [w], {}, bake=True)


def test_error_parameter_list_mismatch():
    tape, w, x, y = scalar_tape()
    u = tape.param(np.array(1.0))
    z = y + u
    with pytest.raises(EmitError, match=r"^param \(node 3\): the loss depends on this parameter but params does "
                                        r"not list it \(missing nodes \[3\]\); list every parameter upstream of the loss$"):
        c_grad(tape, z, [w], {})
    with pytest.raises(EmitError, match=r"^param \(node 3\): params\[1\] does not feed the loss; list exactly the "
                                        r"parameters the loss depends on$"):
        c_grad(tape, y, [w, u], {})
    with pytest.raises(EmitError, match=r"^param \(node 0\): params lists this parameter twice \(p\[0\] and p\[1\]\)$"):
        c_grad(tape, y, [w, w], {})
    with pytest.raises(EmitError, match=r"^const \(node 1\): params\[0\] must be a parameter, got a const node$"):
        c_grad(tape, y, [x], {})


def test_error_float32_tape_and_bad_arguments():
    tape = tg.Tape(np.float32)
    w = tape.param(np.array(1.0, np.float32))
    with pytest.raises(EmitError, match=r"^c_grad: expected a float64 tape"):
        c_grad(tape, w * w, [w], {})
    tape, w, x, y = scalar_tape()
    with pytest.raises(EmitError, match=r"^c_grad: dialect must be 'c' or 'cuda', got 'opencl'$"):
        c_grad(tape, y, [w], {}, dialect="opencl")
    with pytest.raises(EmitError, match=r"^c_grad: name must be a C identifier, got '2x'$"):
        c_grad(tape, y, [w], {}, name="2x")


def test_constants_only_branch_has_no_backward_code():
    tape, w, x, y = scalar_tape()
    c = (x * x).exp()
    src = c_grad(tape, y * c, [w], {x: "v[0]"}, with_data=True)
    assert "g1" not in src and "g3" not in src and "g4" not in src and "double g2 = g5 * t4;" in src
