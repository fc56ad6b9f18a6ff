"""The eager tape's C core (tapegrad/_ctape.c) does what the Python paths do: the same nodes, values,
arena positions, sources, gradients and errors, on every registry op and on random programs; and the
Python paths still pass the tape's own tests where the core is switched off."""
import gc
import os
import subprocess
import sys
import sysconfig
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import tape as T
from tapegrad.errors import TapeError

from op_cases import make

ROOT = Path(__file__).resolve().parents[1]
CORE = T.Tape._fast
needs_core = pytest.mark.skipif(CORE is None, reason="the C core is not built here")


class PureTape(tg.Tape):
    """A tape on the Python paths only (Var methods fall back to them for any subclass of Tape)."""
    apply = tg.Tape._apply_py
    _fast = None


def test_the_core_is_built_where_python_headers_are():
    if os.environ.get("TAPEGRAD_PURE"):
        assert CORE is None and tg.Tape.apply is tg.Tape._apply_py
        return
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers here: the core cannot be built, and the Python paths serve")
    assert CORE is not None, "Python's headers are here but tapegrad/_ctape.c was not built (pip install -e .)"
    assert tg.Tape.apply is not tg.Tape._apply_py and type(tg.Var.tanh).__name__ == "Method"
    assert tg.Var.tanh.__wrapped__ is tg.tanh and tg.Var.tanh.__doc__ == tg.tanh.__doc__


def test_the_core_compiles_without_warnings(tmp_path):
    """The build itself lets warnings pass (a newer compiler must not cost users the core); here they fail."""
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        pytest.skip("no Python headers here")
    cc = os.environ.get("CC", "cc")
    run = subprocess.run([cc, "-c", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
                          "-I", str(include), str(ROOT / "tapegrad" / "_ctape.c"), "-o", str(tmp_path / "c.o")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def state(tape):
    """Everything an op or a backward changes, comparable with ==. A node's source is compared as the
    line it names: the bytecode offset of a call differs by the callee's kind (a call into C is made
    from an earlier instruction of the same line)."""
    nodes = [n._replace(src=T._where(n.src)) for n in tape._nodes]
    vals = [None if v is None else (v.dtype.str, v.shape, v.tobytes()) for v in tape._val]
    grads = [None if tape._grad[i] is None or not tape.touched(tg.Var(tape, i, tape._nodes[i].epoch))
             else tape._grad[i].tobytes() for i in range(len(tape))]
    kept = {i: [k.tobytes() for k in ks] for i, ks in tape._kept.items()}
    return (nodes, vals, grads, kept, tape._vals.pos, tape._tmp.pos, tape._grads.pos, tape.ok,
            repr(tape.error), tape._epoch, list(tape._gpass), tape._pass, tape._since, list(tape._arena_grads))


def twins(**kw):
    return tg.Tape(**kw), PureTape(**kw)


def both(tapes, f):
    """f on each tape at one source line; the outcome (a Var's id, or the error's type and text) must agree."""
    out = []
    for tape in tapes:
        try:
            v = f(tape)
            out.append(("var", v.id, v.epoch))
        except TapeError as e:
            out.append((type(e).__name__, str(e)))
    assert out[0] == out[1], out
    return out[0]


OPS = [(name, k) for name, op in O.OPS.items() if op.arity and op.kind != "leaf" for k in range(len(op.cases or ()))]


@needs_core
@pytest.mark.parametrize("name,k", OPS, ids=[f"{n}-{k}" for n, k in OPS])
def test_every_registry_op_records_and_sweeps_as_the_python_paths_do(name, k):
    op, rng = O.OPS[name], np.random.default_rng(k)
    arrays, s = make(op, op.cases[k], rng)
    tapes = twins()
    params = [[t.param(np.ones(np.shape(x))) if kind == "f" else None for kind, x in zip(op.inputs, arrays)]
              for t in tapes]
    marks = [t.mark() for t in tapes]

    def episode(tape, ps, arrays):
        vs = [p * tape.const(x) if p is not None else tape.const(x) for p, x in zip(ps, arrays)]
        a, b, c = (vs + [None, None])[:3]
        y = tape.apply(op, a, b, s, c)
        return (y * tape.const(np.cos(np.arange(y.size)).reshape(y.shape))).sum()

    for ep in range(3):   # 0: the memo and the arena learn the shapes; 1: recorded; 2: the C paths throughout
        arrays, _ = make(op, op.cases[k], rng)
        losses = [episode(t, ps, arrays) for t, ps in zip(tapes, params)]
        assert [t.backward(y) for t, y in zip(tapes, losses)] == [True, True]
        assert state(tapes[0]) == state(tapes[1]), f"{name} case {k} episode {ep}"
        for t, m in zip(tapes, marks):
            t.reset_to(m)


SHAPES = [(3, 4), (4,), (1, 4), (), (5,)]   # (5,) broadcasts with none of (3, 4), (4,), (1, 4)
UNARY = ["tanh", "relu", "exp", "log", "sigmoid", "neg", "abs", "square", "sum", "T"]
BINARY = ["add", "sub", "mul", "div", "maximum", "matmul", "rsub", "radd", "scalar_mul", "scalar_div", "lifted"]


def step(tape, vs, kind, i, j):
    a, b = vs[i % len(vs)], vs[j % len(vs)]
    if kind == "tanh":
        return a.tanh()
    if kind == "relu":
        return a.relu()
    if kind == "exp":
        return (a * 0.1).exp()
    if kind == "log":   # nan for negative values: what check_finite stops
        with np.errstate(invalid="ignore", divide="ignore"):
            return a.log()
    if kind == "sigmoid":
        return a.sigmoid()
    if kind == "neg":
        return -a
    if kind == "abs":
        return abs(a)
    if kind == "square":
        return a.square()
    if kind == "sum":
        return a.sum()
    if kind == "T":
        return a.T
    if kind == "add":
        return a + b
    if kind == "sub":
        return a - b
    if kind == "mul":
        return a * b
    if kind == "div":
        return a / (b * b + 1.0)
    if kind == "maximum":
        return tg.maximum(a, b)
    if kind == "matmul":
        return a @ b
    if kind == "rsub":
        return 2.0 - a
    if kind == "radd":
        return np.ones(4) + a
    if kind == "scalar_mul":
        return a * 3.0
    if kind == "scalar_div":
        return a / 4.0
    return a * np.full((3, 4), 0.5)   # "lifted": an array becomes a constant inside the op


programs = st.lists(st.tuples(st.sampled_from(UNARY + BINARY), st.integers(0, 50), st.integers(0, 50)),
                    min_size=1, max_size=14)


@needs_core
@settings(max_examples=300, deadline=None)
@given(programs, st.sampled_from(["raise", "poison"]), st.booleans(), st.sampled_from([np.float64, np.float32]),
       st.sampled_from([{}, {"ordered": True}, {"check_finite": True}]))
def test_random_programs_agree_with_the_python_paths(program, on_error, sources, dtype, mode):
    """Random graphs over broadcasting shapes, including ones that fail (a (5,) operand, a matmul of
    mismatched shapes, exp overflowing under check_finite), three episodes each, in raise and poison
    mode, plain, ordered and checking values: the C core and the Python paths leave the same tape
    behind after every op and every backward."""
    tapes = twins(on_error=on_error, sources=sources, dtype=dtype, **mode)
    rng = np.random.default_rng(len(program))
    inits = [rng.standard_normal(s) for s in SHAPES]
    leaves = {id(t): [t.param(x) for x in inits] for t in tapes}
    marks = [t.mark() for t in tapes]
    for ep in range(3):
        pools = {k: list(ls) for k, ls in leaves.items()}
        for kind, i, j in program:
            made = {}

            def op(tape):
                made[id(tape)] = v = step(tape, pools[id(tape)], kind, i, j)
                return v
            out = both(tapes, op)
            assert state(tapes[0]) == state(tapes[1]), (ep, kind, i, j)
            if out[0] == "var" and out[1] >= 0:
                for t in tapes:
                    pools[id(t)].append(made[id(t)])
        if all(t.ok for t in tapes):
            losses = {}

            def total(tape):
                losses[id(tape)] = v = pools[id(tape)][-1].sum()
                return v
            assert both(tapes, total)[0] == "var"
            assert [t.backward(losses[id(t)]) for t in tapes] == [True, True]
        assert state(tapes[0]) == state(tapes[1]), ep
        for t, m in zip(tapes, marks):
            t.reset_to(m)
            t.ok, t.error = True, None


@needs_core
def test_a_value_the_op_cannot_take_reports_and_rewinds_on_the_c_path():
    """cholesky of a matrix that is not positive definite, on an episode whose shapes the memo and the
    arena know (so the C path runs the forward): the same DomainError, the tape as it was."""
    tapes = twins()
    ps = {id(t): t.param(np.eye(3)) for t in tapes}
    marks = [t.mark() for t in tapes]
    for scale in (1.0, 1.0, -1.0):
        ms = {k: p * scale for k, p in ps.items()}
        before = [state(t) for t in tapes]
        out = both(tapes, lambda t: tg.cholesky(ms[id(t)]))
        if scale > 0:
            assert out[0] == "var"
        else:
            assert out[0] == "DomainError" and "cholesky" in out[1] and "not positive definite" in out[1]
            assert [state(t) for t in tapes] == before
        assert state(tapes[0]) == state(tapes[1])
        for t, m in zip(tapes, marks):
            t.reset_to(m)


@needs_core
@pytest.mark.parametrize("swap", ["stale", "lazy a", "lazy b"])
def test_stale_vars_and_lazy_constants_on_an_episode_the_c_path_knows(swap):
    """Two episodes record y = x·x and then y·x; a third gives that second op, at the arena place and
    with the shapes the C path knows, a Var of the episode before whose id is taken again (the Python
    paths' ForeignVarError), or a lazy constant on either side (a lazy node, no value)."""
    tapes = twins()
    xs = {id(t): t.param(np.ones(4)) for t in tapes}
    marks = [t.mark() for t in tapes]
    prev = {}
    for ep in range(3):
        ys = {id(t): xs[id(t)] * xs[id(t)] for t in tapes}
        lazy = {id(t): t.const_lazy((4,)) for t in tapes} if ep == 2 and swap != "stale" else None
        if ep < 2:
            out = both(tapes, lambda t: ys[id(t)] * xs[id(t)])
            assert out[0] == "var"
        elif swap == "stale":
            assert [ys[id(t)].id for t in tapes] == [prev[id(t)].id for t in tapes]
            out = both(tapes, lambda t: prev[id(t)] * xs[id(t)])
            assert out[0] == "ForeignVarError" and "dropped by reset_to" in out[1], out
        else:
            out = both(tapes, lambda t: lazy[id(t)] * xs[id(t)] if swap == "lazy a" else xs[id(t)] * lazy[id(t)])
            assert out[0] == "var" and all(t.nodes[-1].lazy and t._val[-1] is None for t in tapes)
        assert state(tapes[0]) == state(tapes[1])
        prev = ys
        for t, m in zip(tapes, marks):
            t.reset_to(m)


@needs_core
def test_a_var_never_initialised_gets_pythons_error_not_a_crash():
    tape = tg.Tape()
    x = tape.param(np.ones(3))
    blank = tg.Var.__new__(tg.Var)   # its slots are empty
    for f in (lambda: blank * x, lambda: x * blank, lambda: blank.tanh(), lambda: -blank,
              lambda: tape.apply(O.mul, x, blank)):
        with pytest.raises((AttributeError, TapeError)):
            f()
    assert len(tape) == 1 and tape.ok


@needs_core
def test_sources_follow_the_tapes_flag_on_the_c_path():
    tape = tg.Tape()
    x = tape.param(np.ones(4))
    start = tape.mark()
    for _ in range(2):   # the second episode on the C path throughout
        y = (x * x).tanh(); line = sys._getframe().f_lineno   # noqa: E702
        assert T._where(tape.nodes[y.id].src).endswith(f"test_ctape.py:{line}")
        tape.sources = False
        z = y * x
        assert tape.nodes[z.id].src is None
        tape.sources = True
        tape.reset_to(start)


@needs_core
def test_a_subclass_of_tape_keeps_its_own_apply():
    """Var methods enter the C path only for a Tape itself: a subclass's apply sees every op."""
    calls = []

    class Counting(tg.Tape):
        def apply(self, op, a, b=None, s=None, c=None):
            calls.append(op.name)
            return super().apply(op, a, b, s, c)

    tape = Counting()
    x = tape.param(np.ones(4))
    start = tape.mark()
    for _ in range(3):   # from the second episode on, the memo and the arena know every op
        (x * x).tanh() - x
        tape.reset_to(start)
    assert calls == ["mul", "tanh", "sub"] * 3


@needs_core
def test_the_c_paths_hold_no_references_and_no_memory_per_episode():
    """Reference counts of what every op touches are the same after the 50th and the 250th episode,
    and the memory in use grows no more than on the Python paths (NumPy 2.4 itself keeps ~48 bytes per
    reshape to a new shape tuple, which a sum's backward does once per episode): a missed decref on the
    per-op path would grow both by each of the 12,000 ops."""
    def loop(tape):
        x = tape.param(np.linspace(0.1, 0.4, 4))
        start = tape.mark()

        def episode():
            y = x
            for _ in range(20):
                y = (y * x).tanh() + 1.0
            assert tape.backward(y.sum())
            tape.reset_to(start)
        return episode, (O.mul, O.tanh, O.adds, tape, x, tape.value(x).base, tape._vals, tape._grads, T._SHAPES)

    grown = []
    for tape in twins():
        episode, watched = loop(tape)
        for _ in range(50):
            episode()
        gc.collect()   # cyclic garbage of earlier tests still holds registry ops, and may go at any time
        counts = [sys.getrefcount(o) for o in watched]
        tracemalloc.start()
        for _ in range(10):
            episode()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            episode()
        grown.append(tracemalloc.get_traced_memory()[0] - base)
        tracemalloc.stop()
        gc.collect()
        assert [sys.getrefcount(o) for o in watched] == counts
    # one leaked object per op is 12,000 objects of 32 bytes or more: 384 KB; dict resizes elsewhere are ~1 KB
    assert grown[0] <= grown[1] + 32768, f"{grown[0]} bytes more after 200 episodes ({grown[1]} on the Python paths)"


@needs_core
def test_the_python_paths_pass_the_tapes_own_tests():
    """The tape's tests once more with TAPEGRAD_PURE=1, where the core is built but switched off: the
    paths a machine without Python's headers runs."""
    files = ["test_tape.py", "test_schedule.py", "test_tape_edges.py", "test_tape_errors.py", "test_tape_semantics.py",
             "test_tape_sweep.py", "test_bad_input_tape.py", "test_tape_reports.py", "test_ctape.py"]
    env = dict(os.environ, TAPEGRAD_PURE="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
                          *[str(ROOT / "tests" / f) for f in files]], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
