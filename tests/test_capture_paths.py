"""Capture's less travelled paths: its defaults (fuse, ordered) as a program shows them, float32 programs'
buffers of every kind, Adam registered in another order than the tape's, lazy constants before they
are given, attach hooks, a count of zero. No JAX."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import ordered as ORD
from tapegrad.errors import ForeignVarError, LazyValueError

RNG = np.random.default_rng(11)
A, B = RNG.standard_normal((3, 40)), RNG.standard_normal((40, 2))   # 40-long dot products: order shows


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def matmul_model(tape):
    w = tape.param(B)
    x = tape.const(A)
    y = x @ w
    return w, x, y, (y * y).sum()


def test_fuse_defaults_to_on_and_is_normalised():
    tape = tg.Tape()
    *_, loss = matmul_model(tape)
    assert tg.capture(tape, loss).fuse is True
    assert tg.capture(tape, loss, fuse=0).fuse is False and tg.capture(tape, loss, fuse=1).fuse is True
    assert tg.capture(tape, loss, fuse="libm").fuse == "libm"


def test_a_default_native_capture_fuses():
    tape = tg.Tape()
    w = tape.param(np.linspace(-1.0, 1.0, 8))
    loss = ((w * 2.0).tanh() * w + 1.0).sum()
    fused, plain = tg.capture(tape, loss, backend="native"), tg.capture(tape, loss, backend="native", fuse=False)
    assert fused.plan()["kernels_forward"] < plain.plan()["kernels_forward"]
    assert float(fused.forward()) == float(plain.forward())
    abi = fused.native_abi()
    assert isinstance(abi, dict) and abi


def ops_of(prog):
    return [n[0] for n in prog.nodes]


def test_capture_follows_the_tapes_order_unless_told():
    ordered_tape, default_tape = tg.Tape(ordered=True), tg.Tape()
    *_, lo = matmul_model(ordered_tape)
    *_, ld = matmul_model(default_tape)
    assert ops_of(tg.capture(ordered_tape, lo))[2] is ORD.matmul
    for tape, loss, flag, want in ((ordered_tape, lo, None, True), (default_tape, ld, None, False),
                                   (default_tape, ld, 1, True), (ordered_tape, lo, 0, False)):
        prog = tg.capture(tape, loss, ordered=flag)
        assert prog.ordered is want
        assert ops_of(prog)[2] is (ORD.matmul if want else O.matmul)
        assert ops_of(prog)[4] is (ORD.sum_ if want else O.sum)
    # the replay computes what the tape of its mode computes, bit for bit
    assert float(tg.capture(default_tape, ld, ordered=True).forward()) == float(ordered_tape.value(lo))
    assert float(tg.capture(ordered_tape, lo, ordered=False).forward()) == float(default_tape.value(ld))


def f32_model():
    tape = tg.Tape()
    w = tape.param(np.array([0.5, -1.5, 2.0]))
    c = tape.const(np.array([1.0, 2.0, 3.0]))
    k = tape.const_lazy((3,))
    side = tape.param(np.ones(2))
    dead = side * 3.0
    y = (w * c + k).tanh()
    return tape, (w, c, k, side, dead, y), (y * y).sum()


def test_a_float32_program_holds_every_buffer_in_float32():
    tape, (w, c, k, side, dead, y), loss = f32_model()
    prog = tg.capture(tape, loss, dtype="float32")
    for v in (w, c, k, side, dead, y, loss):
        assert prog.value(v).dtype == np.float32
    assert np.array_equal(prog.value(k), np.zeros(3))          # a lazy constant reads zeros until given
    prog.set_input(k, np.full(3, 0.25))
    prog.forward()
    prog.backward()
    for v in (w, c, k, side, dead, y):
        assert prog.grad(v).dtype == np.float32
    assert np.array_equal(prog.grad(dead), np.zeros(2)) and np.array_equal(prog.grad(side), np.zeros(2))


def test_a_lazy_constant_must_be_given_before_any_run():
    tape = tg.Tape()
    k1 = tape.const_lazy((2,))
    w = tape.param(np.ones(2))
    k2 = tape.const_lazy((2,))
    prog = tg.capture(tape, (w * k1 + k2).sum())
    for what, run in (("forward", prog.forward), ("backward", prog.backward), ("episode", prog.episode)):
        refuses(LazyValueError, f"{what} (node 0): lazy constant node(s) [0, 2] have no values yet; give each one "
                                f"with program.set_input(var, array) before running", run)
    prog.set_input(k1, np.ones(2))
    refuses(LazyValueError, "episode (node 2): lazy constant node(s) [2] have no values yet; give each one with "
                            "program.set_input(var, array) before running", prog.episode)
    assert prog.episode({k2: np.array([1.0, -1.0])}) == 2.0


def test_set_input_names_itself_for_a_var_it_does_not_know():
    tape = tg.Tape()
    w = tape.param(np.ones(2), name="W")
    prog = tg.capture(tape, (w * w).sum())
    late = w * 2.0
    refuses(ForeignVarError, f"set_input (node {late.id}): this Var is not a node of the captured episode (another "
                             f"tape, or created after the capture); pass the Vars the captured episode used",
            lambda: prog.set_input(late, np.ones(2)))
    refuses(ForeignVarError, "set_input: the program has no parameter named 'V'; its parameters are ['W']",
            lambda: prog.set_input("V", np.ones(2)))
    refuses(ForeignVarError, f"set_input (node {late.id}): this Var is not a node of the captured episode (another "
                             f"tape, or created after the capture); pass the Vars the captured episode used",
            lambda: prog.episode({late: np.ones(2)}))


SHAPES = ((3,), (2, 2), (5,))


def adam_run(order, dtype, seed, steps=3):
    """Adam over the parameters in ``order`` (indices into SHAPES), run ``steps`` episodes in a program."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape()
    ps = [tape.param(rng.standard_normal(s)) for s in SHAPES]
    opt = tg.Adam(0.05)
    for k in order:
        opt.add(tape, ps[k])
    prog = tg.capture(tape, sum(((p * p).tanh()).sum() for p in ps), dtype=dtype)
    prog.attach(opt)
    for _ in range(steps):
        prog.episode()
    return ps, prog, prog.optimizer_state()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_adam_registered_out_of_tape_order_steps_each_parameter_as_in_order(dtype):
    got = {}
    for order in ((0, 1, 2), (2, 0, 1), (1, 2)):
        ps, prog, st = adam_run(order, dtype, seed=5)
        assert prog.opt.whole is (order == (0, 1, 2))       # the one-slab path, and the per-parameter one
        assert all(m.dtype == np.dtype(dtype) for m in st["mu"] + st["nu"])
        got[order] = ([np.array(prog.value(p)) for p in ps], dict(zip(order, st["mu"])), dict(zip(order, st["nu"])))
    ref_w, ref_mu, ref_nu = got[(0, 1, 2)]
    for order in ((2, 0, 1), (1, 2)):
        w, mu, nu = got[order]
        for k in order:
            assert np.array_equal(w[k], ref_w[k]) and np.array_equal(mu[k], ref_mu[k]) and np.array_equal(nu[k], ref_nu[k])
    start = np.random.default_rng(5).standard_normal(3).astype(dtype)
    assert np.array_equal(got[(1, 2)][0][0], start)                  # not registered: never updated


def test_out_of_order_adam_in_a_program_equals_the_eager_tape():
    ps, prog, st = adam_run((2, 0, 1), "float64", seed=9, steps=2)
    rng = np.random.default_rng(9)
    tape = tg.Tape()
    qs = [tape.param(rng.standard_normal(s)) for s in SHAPES]
    opt = tg.Adam(0.05)
    for k in (2, 0, 1):
        opt.add(tape, qs[k])
    m = tape.mark()
    for _ in range(2):
        tape.backward(sum(((q * q).tanh()).sum() for q in qs))
        opt.step()
        tape.reset_to(m)
    for p, q in zip(ps, qs):
        assert np.array_equal(prog.value(p), tape.value(q))
    assert all(np.array_equal(a, b) for a, b in zip(st["mu"] + st["nu"], opt.mu + opt.nu))


def test_attach_runs_the_programs_attach_hooks_with_the_program():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    prog = tg.capture(tape, (w * w).sum())
    seen = []
    prog._attach_hooks = [seen.append, lambda p: seen.append(p.opt.kind)]
    opt = tg.SGD(0.1)
    opt.add(tape, w)
    prog.attach(opt)
    assert seen == [prog, "SGD"]


def test_a_program_takes_an_optimizer_count_of_zero():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    prog = tg.capture(tape, (w * w).sum())
    prog.attach(opt)
    prog.episode()
    prog.load_optimizer_state({"count": 0, "mu": [np.zeros(2)], "nu": [np.zeros(2)]})
    assert prog.optimizer_state()["count"] == 0
    before = np.array(prog.value(w))
    prog.episode()                      # a first step again, from the program's weights
    fresh = tg.Tape()
    v = fresh.param(before)
    again = tg.Adam(0.1)
    again.add(fresh, v)
    fresh.backward((v * v).sum())
    again.step()
    assert prog.optimizer_state()["count"] == 1 and np.array_equal(prog.value(w), fresh.value(v))
