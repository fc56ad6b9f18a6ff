"""Optimizer arguments checked whole: each bound crossed exactly at the bound (accepted on the inside,
refused with the full message on the outside), and an optimizer whose parameter ``reset_to`` dropped
refuses to step or grow. No JAX: these run in mutation testing's forked children."""
import math
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ConfigError, ForeignVarError
from tapegrad.optim import Optimizer, sq_norm

BELOW_ONE = math.nextafter(1.0, 0.0)
TINY = math.nextafter(0.0, 1.0)


def refuses(msg, make, cls=ConfigError):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        make()


@pytest.mark.parametrize("name", ["b1", "b2"])
def test_adam_betas_live_in_the_half_open_unit_interval(name):
    for ok in (0.0, 0.5, BELOW_ONE):
        opt = tg.Adam(0.1, **{name: ok})
        assert getattr(opt, name) == ok and type(getattr(opt, name)) is float
    for bad in (1.0, 1.5, -TINY, float("nan")):
        refuses(f"Adam: {name} must be a finite number in [0.0, 1.0), got {bad!r}", lambda: tg.Adam(0.1, **{name: bad}))
    refuses(f"Adam: {name} must be a real number, got str 'x'", lambda: tg.Adam(0.1, **{name: "x"}))


def test_adam_eps_must_be_positive_and_finite():
    for ok in (TINY, 1e-8, 3.0):
        assert tg.Adam(0.1, eps=ok).eps == ok
    for bad in (0.0, -1e-8, float("nan")):
        refuses(f"Adam: eps must be a finite number in (0.0, inf], got {bad!r}", lambda: tg.Adam(0.1, eps=bad))
    refuses("Adam: eps must be finite, got inf", lambda: tg.Adam(0.1, eps=math.inf))
    refuses("Adam: eps must be a real number, got NoneType None", lambda: tg.Adam(0.1, eps=None))


@pytest.mark.parametrize("make", [tg.SGD, tg.Adam])
def test_the_learning_rate_may_be_zero_but_not_negative_or_infinite(make):
    kind = make.kind
    assert make(0.0).lr == 0.0 and make(np.float32(0.5)).lr == 0.5 and type(make(np.float32(0.5)).lr) is float
    refuses(f"{kind}: lr (the learning rate) must be a finite number in [0.0, inf], got -1e-300",
            lambda: make(-1e-300))
    refuses(f"{kind}: lr (the learning rate) must be finite, got inf", lambda: make(math.inf))
    refuses(f"{kind}: lr (the learning rate) must be a finite number in [0.0, inf], got nan", lambda: make(math.nan))
    refuses(f"{kind}: lr (the learning rate) must be a real number, got list [0.1]", lambda: make([0.1]))
    refuses(f"{kind}: clip (the max global norm) must be finite, got inf", lambda: make(0.1, clip=math.inf))
    assert make(0.1, clip=TINY).clip == TINY


def test_a_bad_l2_names_the_node_and_leaves_the_optimizer_as_it_was():
    tape = tg.Tape()
    a, b = tape.param(np.ones(2)), tape.param(np.ones(3))
    opt = tg.SGD(0.1)
    opt.add(tape, a, l2=0.0)
    refuses("SGD.add (node 1): l2 must be a finite number in [0.0, inf], got -0.5", lambda: opt.add(tape, b, l2=-0.5))
    refuses("SGD.add (node 1): l2 must be finite, got inf", lambda: opt.add(tape, b, l2=math.inf))
    refuses("SGD.add (node 1): l2 must be a real number, got str 'big'", lambda: opt.add(tape, b, l2="big"))
    assert [p.id for p in opt.params] == [0] and opt.l2 == [0.0]
    opt.add(tape, b, l2=TINY)
    assert opt.l2 == [0.0, TINY]


def the_last_param_dropped(opt):
    """A tape whose only registered parameter (node 1, the last node) was dropped by reset_to."""
    tape = tg.Tape()
    tape.param(np.ones(2))
    m = tape.mark()
    w = tape.param(np.ones(3))
    opt.add(tape, w)
    tape.backward((w * w).sum())
    tape.reset_to(m)
    return tape


DROPPED = ("{}: parameter 0 (node 1) was dropped by reset_to; register parameters before tape.mark() (or build a "
           "new optimizer after the reset)")


@pytest.mark.parametrize("make", [tg.SGD, tg.Adam])
def test_step_refuses_a_parameter_dropped_before_the_first_step(make):
    # node id == len(nodes): the dropped parameter was the tape's last node
    opt = make(0.1)
    tape = the_last_param_dropped(opt)
    assert len(tape._nodes) == opt.params[0].id
    refuses(DROPPED.format(f"{make.kind}.step"), opt.step, ForeignVarError)
    assert opt.count == 0


def test_step_refuses_a_parameter_whose_slot_now_holds_another_node():
    # node id < len(nodes): a new node took the dropped parameter's id (another epoch)
    opt = tg.Adam(0.1)
    tape = the_last_param_dropped(opt)
    x = tape.param(np.full(3, 7.0))
    assert x.id == opt.params[0].id
    tape.backward((x * x).sum())
    refuses(DROPPED.format("Adam.step"), opt.step, ForeignVarError)
    assert opt.count == 0 and np.array_equal(tape.value(x), np.full(3, 7.0))
    refuses(DROPPED.format("Adam.add"), lambda: opt.add(tape, x), ForeignVarError)
    assert len(opt.params) == 1


def test_step_checks_again_after_each_drop_and_not_before():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    opt = tg.SGD(0.5)
    opt.add(tape, w)
    m = tape.mark()
    for _ in range(2):       # drops that keep the parameter: steps go on
        tape.backward((w * w).sum())
        opt.step()
        tape.reset_to(m)
    assert opt.count == 2 and np.array_equal(tape.value(w), np.zeros(2))
    tape.reset_to(0)
    refuses("SGD.step: parameter 0 (node 0) was dropped by reset_to; register parameters before tape.mark() (or "
            "build a new optimizer after the reset)", opt.step, ForeignVarError)


def test_the_base_class_has_no_update():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    opt = Optimizer(0.1)
    opt.add(tape, w)
    tape.backward((w * w).sum())
    refuses("Optimizer: an optimizer defines its update", opt.step, NotImplementedError)


def test_sq_norm_sums_the_squares_of_an_array_of_any_shape():
    g = np.arange(6.0).reshape(2, 3)
    assert sq_norm(g) == 55.0 and sq_norm(g.T) == 55.0 and sq_norm(np.full((3, 3), 2.0)) == 36.0
