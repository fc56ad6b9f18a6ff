"""Every error a Program raises, matched whole, and the program state it must leave alone; program identity."""
import re

import numpy as np
import pytest

import tapegrad as tg


def full(message):
    return "^" + re.escape(message) + "$"


def small(backend="numpy", opt=None):
    tape = tg.Tape()
    w = tape.param(np.array([[1.0, -2.0], [0.5, 3.0]]))
    b = tape.param(np.array([0.25, -0.5]))
    x = tape.const(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    h = (x @ w + b).tanh()
    loss = (h * h).mean()
    if opt is not None:
        opt.add(tape, w)
        opt.add(tape, b)
    return tape, (w, b, x, h, loss), tg.capture(tape, loss, backend=backend)


def test_capture_arguments():
    tape, (w, b, x, h, loss), _ = small()
    with pytest.raises(ValueError, match=full("capture: backend must be one of ('numpy', 'native', 'cupy'), got 'cuda'")):
        tg.capture(tape, loss, backend="cuda")
    with pytest.raises(tg.DTypeError, match=full("capture: dtype must be float64 or float32, got float16")):
        tg.capture(tape, loss, dtype="float16")
    with pytest.raises(tg.ShapeError, match=full(f"capture (node {h.id}): expected a scalar loss (one element), got "
                                                 f"shape (3, 2)")):
        tg.capture(tape, h)
    other = tg.Tape()
    with pytest.raises(tg.ForeignVarError, match=full(f"capture (node {len(tape)}): argument loss (node 1) belongs to "
                                                      f"another tape; record the whole computation on one tape")):
        tg.capture(tape, other.param(np.ones(1)).sum())


def test_slots_name_the_call_and_the_node():
    tape, (w, b, x, h, loss), prog = small()
    with pytest.raises(TypeError, match=full("value: expected a Var of the captured tape or a parameter name, got ndarray")):
        prog.value(np.ones(2))
    late = w * 2.0
    for what, call in (("grad", prog.grad), ("value", prog.value)):
        with pytest.raises(tg.ForeignVarError, match=full(f"{what} (node {late.id}): this Var is not a node of the "
                                                          f"captured episode (another tape, or created after the "
                                                          f"capture); pass the Vars the captured episode used")):
            call(late)
    with pytest.raises(tg.TapeError, match=full(f"set_input (node {h.id}): expected a const or param slot, got a "
                                                f"tanh node (its value is computed by the program)")):
        prog.set_input(h, np.ones((3, 2)))
    with pytest.raises(tg.DTypeError, match=full(f"set_input (node {x.id}): expected float64 or float32 data for "
                                                 f"const node {x.id} (program dtype float64), got int64; convert "
                                                 f"with .astype(np.float64)")):
        prog.set_input(x, np.ones((3, 2), np.int64))


def test_set_input_converts_float32_and_parameters_take_new_values():
    tape, (w, b, x, h, loss), prog = small()
    prog.set_input(x, np.ones((3, 2), np.float32))
    prog.set_input(b, np.array([0.0, 0.0], np.float32))
    assert prog.value(x).dtype == np.float64 and np.array_equal(prog.value(x), np.ones((3, 2)))
    ref = tg.Tape()
    rw, rb = ref.param(np.array(tape.value(w))), ref.param(np.zeros(2))
    rloss = (((ref.const(np.ones((3, 2))) @ rw) + rb).tanh() ** 2).mean()
    assert float(prog.forward()) == float(ref.value(rloss))


def test_optimizer_calls_without_an_optimizer():
    tape, (w, b, x, h, loss), prog = small()
    with pytest.raises(tg.TapeError, match=full("step: no optimizer attached; call program.attach(optimizer) first")):
        prog.step()
    with pytest.raises(tg.TapeError, match=full("optimizer_state: no optimizer attached")):
        prog.optimizer_state()
    with pytest.raises(tg.TapeError, match=full("load_optimizer_state: no optimizer attached")):
        prog.load_optimizer_state({"count": 0})
    with pytest.raises(tg.TapeError, match=full("native_abi: only a native program has one (capture with "
                                                "backend='native')")):
        prog.native_abi()


def test_attach_checks_the_optimizer():
    tape, (w, b, x, h, loss), prog = small()
    other = tg.Tape()
    foreign = tg.SGD(0.1)
    foreign.add(other, other.param(np.ones(2)))
    with pytest.raises(tg.ForeignVarError, match=full("attach: the optimizer serves another tape than the captured one")):
        prog.attach(foreign)

    class Lion(tg.SGD):
        kind = "Lion"
    with pytest.raises(tg.TapeError, match=full("attach: unsupported optimizer Lion")):
        prog.attach(Lion(0.1))
    late = tape.param(np.ones(2))
    opt = tg.SGD(0.1)
    opt.add(tape, late)
    with pytest.raises(tg.ForeignVarError, match=full(f"attach (node {late.id}): this Var is not a node of the captured "
                                                      f"episode (another tape, or created after the capture); pass "
                                                      f"the Vars the captured episode used")):
        prog.attach(opt)
    assert prog.opt is None


def test_load_optimizer_state_validates_everything_first():
    opt = tg.Adam(0.1)
    tape, (w, b, x, h, loss), prog = small(opt=opt)
    prog.attach(opt)
    prog.episode()
    before = prog.optimizer_state()
    for bad, message in (
            ({"count": -1}, "load_optimizer_state: count must be a non-negative int, got -1"),
            ({"count": 2.0}, "load_optimizer_state: count must be a non-negative int, got 2.0"),
            ({"count": 2, "mu": before["mu"]}, "load_optimizer_state: expected 2 'nu' arrays"),
            ({"count": 2, "mu": before["mu"][:1], "nu": before["nu"]}, "load_optimizer_state: expected 2 'mu' arrays"),
    ):
        with pytest.raises(tg.TapeError, match=full(message)):
            prog.load_optimizer_state(bad)
    with pytest.raises(tg.ShapeError, match=full("load_optimizer_state: nu[1] (param 'param_1' node 1) must have shape (2,), got (3,)")):
        prog.load_optimizer_state({"count": 2, "mu": before["mu"], "nu": [before["nu"][0], np.zeros(3)]})
    after = prog.optimizer_state()
    assert after["count"] == 1 and all(np.array_equal(a, c) for a, c in zip(after["mu"] + after["nu"],
                                                                            before["mu"] + before["nu"]))
    prog.load_optimizer_state({"count": np.int64(7), "mu": [np.ones((2, 2)), np.ones(2)],
                               "nu": [np.ones((2, 2)), np.ones(2)]})
    st = prog.optimizer_state()
    assert st["count"] == 7 and np.array_equal(st["mu"][1], [1.0, 1.0]) and np.array_equal(st["nu"][0], np.ones((2, 2)))


def test_sync_params_writes_parameters_and_optimizer_state_back():
    opt = tg.Adam(0.1)
    tape, (w, b, x, h, loss), prog = small(opt=opt)
    prog.attach(opt)
    prog.episode()
    prog.episode()
    with pytest.raises(tg.ForeignVarError, match=full("sync_params: not the tape this program was captured from")):
        prog.sync_params(tg.Tape())
    prog.sync_params(tape, opt)
    assert np.array_equal(tape.value(w), prog.value(w)) and np.array_equal(tape.value(b), prog.value(b))
    assert opt.count == 2 and np.array_equal(opt.mu[0], prog.optimizer_state()["mu"][0])
    assert np.array_equal(tape.value(x), prog.value(x))          # constants stay


def test_hash64_is_stable_and_covers_graph_shapes_dtype_and_optimizer():
    _, _, p1 = small()
    _, _, p2 = small()
    assert p1.hash64 == p2.hash64 and 0 <= p1.hash64 < 2 ** 64
    tape, (w, b, x, h, loss), _ = small()
    assert tg.capture(tape, loss, dtype="float32").hash64 != p1.hash64
    other = tg.Tape()
    ow, ob = other.param(np.ones((2, 2))), other.param(np.ones(2))
    ox = other.const(np.ones((4, 2)))                                  # another batch size
    assert tg.capture(other, (((ox @ ow) + ob).tanh() ** 2).mean()).hash64 != p1.hash64
    hashes = set()
    for opt in (tg.SGD(0.1), tg.SGD(0.2), tg.Adam(0.1), tg.Adam(0.1, b1=0.8), tg.Adam(0.1, eps_mode="hat")):
        t, (tw, tb, *_), prog = small(opt=opt)
        prog.attach(opt)
        hashes.add(prog.hash64)
    assert len(hashes) == 5 and p1.hash64 not in hashes


def test_repr_and_plan():
    tape, (w, b, x, h, loss), prog = small()
    assert repr(prog) == f"<Program numpy float64 nodes={len(tape)} params=2 consts=1 loss=node {loss.id}>"
    plan = prog.plan()
    assert plan["backend"] == "numpy" and plan["kernels_forward"] == len(tape) - 3
    assert plan["segments"] == [(k, k) for k in range(3, len(tape))]


def test_gradients_of_unreached_nodes_read_as_zeros():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    side = tape.param(np.ones(3))
    dead = side * 2.0
    loss = (w * w).sum()
    prog = tg.capture(tape, loss)
    prog.forward()
    prog.backward()
    for v, shape in ((side, (3,)), (dead, (3,))):
        g = prog.grad(v)
        assert g.shape == shape and np.array_equal(g, np.zeros(shape)) and not g.flags.writeable
    assert np.array_equal(prog.grad(w), [2.0, 4.0])
    assert prog.loss().shape == () and not prog.loss().flags.writeable
    assert not prog.value(w).flags.writeable


def test_untouched_parameters_are_skipped_inside_the_program():
    tape = tg.Tape()
    w, side = tape.param(np.array([1.0, 2.0])), tape.param(np.array([5.0]))
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    opt.add(tape, side)
    prog = tg.capture(tape, (w * w).sum())
    prog.attach(opt)
    prog.episode()
    assert np.array_equal(prog.value(side), [5.0]) and not np.array_equal(prog.value(w), [1.0, 2.0])
    st = prog.optimizer_state()
    assert np.array_equal(st["mu"][1], [0.0]) and np.array_equal(st["nu"][1], [0.0]) and st["count"] == 1
