"""``Tape.first_nonfinite`` and ``Tape.name_of`` on the cases that separate them from near misses: a
stale gradient of an earlier backward, a name that died with its node, an input that is node 0, a
Var that is not (or no longer) on the tape. No JAX; no file/line claims (mutation testing calls the
tape through a trampoline, which then counts as the caller)."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ArgumentError, ForeignVarError


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def test_a_stale_gradient_of_an_earlier_backward_is_not_reported():
    tape = tg.Tape()
    x = tape.param(np.array([5.0, 4.0]))
    h = tg.where(np.array([False, True]), x, 0.0)       # h = [0, 4]; x's gradient sees only h[1]'s
    with np.errstate(divide="ignore"):
        tape.backward(h.sqrt().sum())                    # d sqrt(h)/dh at 0: inf
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes, bad.name) == (h.id, "where", "grad", ((2,), ()), None)
    assert np.array_equal(tape.grad(x), [0.0, 0.25])
    tape.backward((x * x).sum())                          # h is not reached: its buffer still holds inf
    assert not np.isfinite(tape._grad[h.id]).all()
    assert tape.first_nonfinite() is None


def test_values_come_before_gradients_and_inputs_are_listed_from_node_0():
    tape = tg.Tape()
    x = tape.param(np.array([1.0, 2.0]))
    y = x * np.array([0.0, 1.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        z = y.log()                                      # -inf at 0: a value
        tape.backward(z.sum())                           # and an inf gradient of y, node 2 < z
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes, bad.name) == (z.id, "log", "value", ((2,),), None)
    assert str(bad) == f"log (node {z.id}): first non-finite value, inputs ((2,),), created at {bad.where}"
    tape2 = tg.Tape()
    a = tape2.param(np.array([1e300]))
    with np.errstate(over="ignore"):
        b = a * a                                        # overflows; both inputs are node 0
    bad = tape2.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes) == (b.id, "mul", "value", ((1,), (1,)))


def test_the_report_names_only_a_live_parameter_of_that_node():
    tape = tg.Tape()
    tape.param(np.ones(2), name="W")                    # node 0, finite
    m = tape.mark()
    tape.param(np.array([1.0, np.nan]), name="gone")    # node 1, then dropped with its name
    tape.reset_to(m)
    late = tape.param(np.array([np.inf]))               # node 1 again, unnamed
    bad = tape.first_nonfinite()
    assert (bad.node, bad.name) == (late.id, None) == (1, None)
    assert str(bad).startswith("param (node 1): first non-finite value")
    named = tape.param(np.array([np.nan, 0.0]), name="b")
    tape.reset_to(m)
    tape.param(np.array([np.nan]), name="c")
    bad = tape.first_nonfinite()
    assert (bad.node, bad.name) == (1, "c") and named.id == 2
    assert str(bad).startswith("param 'c' (node 1): first non-finite value")


def test_name_of_a_live_node_never_takes_a_dead_or_other_name():
    tape = tg.Tape()
    w = tape.param(np.ones(2), name="W")
    u = tape.param(np.ones(2))
    m = tape.mark()
    b = tape.param(np.ones(3), name="b")
    assert (tape.name_of(w), tape.name_of(u), tape.name_of(b)) == ("W", None, "b")
    tape.reset_to(m)
    again = tape.param(np.ones(3))                      # b's node id, b's name died with it
    assert again.id == b.id and tape.name_of(again) is None and tape.name_of(u) is None
    y = w * u
    assert tape.name_of(y) is None


def test_name_of_refuses_what_is_not_a_var_of_this_tape():
    tape = tg.Tape()
    tape.param(np.ones(2), name="W")
    m = tape.mark()
    b = tape.param(np.ones(3), name="b")
    tape.reset_to(m)
    refuses(ForeignVarError, "name_of (node 1): argument v (node 1) was dropped by reset_to; Vars created after a mark "
                             "are invalid once the tape is reset to it", lambda: tape.name_of(b))
    refuses(ArgumentError, "name_of (node 1): argument v must be a Var, got str", lambda: tape.name_of("W"))
    other = tg.Tape().param(np.ones(2))
    refuses(ForeignVarError, "name_of (node 1): argument v (node 0) belongs to another tape; record the whole "
                             "computation on one tape", lambda: tape.name_of(other))
    assert len(tape) == 1
