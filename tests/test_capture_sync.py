"""``Program.sync_params`` refusing every target it cannot write (a parameter reset away, an optimizer
of another tape, kind or parameter list), by its whole message, with the tape, the optimizer and the
program left as they were; and writing exactly the parameters and state back when it can. No JAX."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ForeignVarError, TapeError


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def trained(opt=None, late=False):
    """Parameters a (node 0, shape (2,)) and b (node 1, shape (3,)); with ``late``, b is created after the
    mark, so a reset_to drops it. Two episodes of the captured program (with ``opt`` attached)."""
    tape = tg.Tape()
    a = tape.param(np.array([1.0, -2.0]))
    m = tape.mark() if late else None
    b = tape.param(np.array([0.5, 0.25, -1.0]))
    if m is None:
        m = tape.mark()
    if opt is not None:
        opt.add(tape, a)
        opt.add(tape, b)
    loss = (a * a).sum() + (b * b * b).sum()
    prog = tg.capture(tape, loss)
    if opt is not None:
        prog.attach(opt)
    prog.episode()
    prog.episode()
    return tape, prog, m, (a, b)


def values(tape):
    return [None if v is None else v.copy() for v in tape._val]


def same(xs, ys):
    return len(xs) == len(ys) and all((x is None and y is None) or (x is not None and y is not None and x.tobytes() == y.tobytes())
                                      for x, y in zip(xs, ys))


GONE = ("sync_params (node 1): the captured parameter node 1 (3,) is no longer on the tape (reset_to dropped it; "
        "node 1 is now {}); sync before resetting past the capture")


def test_a_parameter_reset_away_is_named_with_what_took_its_place():
    tape, prog, m, (a, b) = trained(late=True)
    prog_vals = [np.array(prog.value(a)), np.array(prog.value(b))]
    tape.reset_to(m)
    assert len(tape) == 1
    before = values(tape)
    refuses(ForeignVarError, GONE.format("absent"), lambda: prog.sync_params(tape))
    assert same(values(tape), before)
    tape.const(np.zeros(3))
    refuses(ForeignVarError, GONE.format("a const (3,)"), lambda: prog.sync_params(tape))
    tape.reset_to(m)
    tape.param(np.zeros(3))          # a parameter of the same shape at the same node, of a later episode
    before = values(tape)
    refuses(ForeignVarError, GONE.format("a param (3,)"), lambda: prog.sync_params(tape))
    assert same(values(tape), before)          # node 0 (still captured) was not written either
    tape.reset_to(m)
    tape.param(np.zeros((1, 3)))
    refuses(ForeignVarError, GONE.format("a param (1, 3)"), lambda: prog.sync_params(tape))
    assert np.array_equal(prog.value(a), prog_vals[0]) and np.array_equal(prog.value(b), prog_vals[1])


def test_sync_after_a_reset_that_keeps_the_parameters_writes_them():
    tape, prog, m, (a, b) = trained(tg.SGD(0.1))
    tape.reset_to(m)
    tape.const(np.ones(4))            # a new episode's node after the parameters does not matter
    prog.sync_params(tape)
    assert np.array_equal(tape.value(a), prog.value(a)) and np.array_equal(tape.value(b), prog.value(b))
    assert not np.array_equal(tape.value(a), [1.0, -2.0])


def test_an_optimizer_of_another_tape_is_refused_before_anything_is_written():
    opt = tg.SGD(0.1)
    tape, prog, m, (a, b) = trained(opt)
    other = tg.Tape()
    stranger = tg.SGD(0.1)
    stranger.add(other, other.param(np.ones(2)))
    before = values(tape)
    refuses(ForeignVarError, "sync_params: the optimizer serves another tape", lambda: prog.sync_params(tape, stranger))
    assert same(values(tape), before)


def test_an_optimizer_with_a_dropped_parameter_is_refused():
    tape, prog, m, (a, b) = trained(tg.SGD(0.1), late=False)
    opt = tg.SGD(0.1)
    opt.add(tape, a)
    late = tape.param(np.ones(4))            # registered after the capture, dropped by the next reset
    opt.add(tape, late)
    tape.reset_to(m)
    before = values(tape)
    refuses(ForeignVarError, f"sync_params: parameter 1 (node {late.id}) was dropped by reset_to; register parameters "
                             f"before tape.mark() (or build a new optimizer after the reset)",
            lambda: prog.sync_params(tape, opt))
    assert same(values(tape), before) and opt.count == 0


@pytest.mark.parametrize("attached, other, want", [
    (None, lambda t, a, b: tg.SGD(0.1), "the optimizer (SGD, parameters [0, 1]) is not the one attached to the "
                                        "program (None)"),
    ("SGD", lambda t, a, b: tg.Adam(0.1), "the optimizer (Adam, parameters [0, 1]) is not the one attached to the "
                                          "program (('SGD', [0, 1]))"),
    ("Adam", lambda t, a, b: tg.Adam(0.1), "the optimizer (Adam, parameters [1, 0]) is not the one attached to the "
                                           "program (('Adam', [0, 1]))"),
    ("Adam", lambda t, a, b: tg.Adam(0.1), "the optimizer (Adam, parameters [0]) is not the one attached to the "
                                           "program (('Adam', [0, 1]))"),
])
def test_an_optimizer_that_is_not_the_attached_one_is_refused(attached, other, want):
    opt = {"SGD": tg.SGD(0.1), "Adam": tg.Adam(0.1), None: None}[attached]
    tape, prog, m, (a, b) = trained(opt)
    mine = other(tape, a, b)
    order = [b, a] if "[1, 0]" in want else [a] if "[0])" in want else [a, b]
    for p in order:
        mine.add(tape, p)
    before = values(tape)
    state = mine.state_dict()
    refuses(TapeError, "sync_params: " + want, lambda: prog.sync_params(tape, mine))
    assert same(values(tape), before) and mine.count == state["count"] == 0
    assert all(np.array_equal(x, y) for k in ("mu", "nu") for x, y in zip(state.get(k, []), mine.state_dict().get(k, [])))


def test_sync_writes_parameters_and_the_whole_optimizer_state():
    opt = tg.Adam(0.1)
    tape, prog, m, (a, b) = trained(opt)
    st = prog.optimizer_state()
    prog.sync_params(tape, opt)
    assert opt.count == 2 == st["count"]
    for k in range(2):
        assert np.array_equal(opt.mu[k], st["mu"][k]) and np.array_equal(opt.nu[k], st["nu"][k])
    assert np.array_equal(tape.value(a), prog.value(a)) and np.array_equal(tape.value(b), prog.value(b))
    # the tape and its optimizer now continue exactly where the program stopped
    tape.backward((a * a).sum() + (b * b * b).sum())
    opt.step()
    prog.episode()
    assert np.array_equal(tape.value(a), prog.value(a)) and np.array_equal(tape.value(b), prog.value(b))
