"""Every error the tape raises, matched in full (who failed, what was expected, what came, what to do).

The messages are part of the interface (``errors.py``): each is pinned here whole, anchored at both
ends, so a changed op name, argument name or node id in any message fails a test.
"""
import re

import numpy as np
import pytest

import tapegrad as tg


def full(message):
    return "^" + re.escape(message) + "$"


def make():
    tape = tg.Tape()
    x = tape.param(np.ones(3))
    return tape, x


def test_constructor_arguments():
    with pytest.raises(tg.DTypeError, match=full("Tape: dtype must be float64 or float32, got int64")):
        tg.Tape(np.int64)
    with pytest.raises(ValueError, match=full("Tape: on_error must be 'raise' or 'poison', got 'warn'")):
        tg.Tape(on_error="warn")


def test_leaves():
    tape, x = make()
    for kind in ("param", "const"):
        with pytest.raises(TypeError, match=full(f"{kind} (node 1): expected an array, got a Var (use it directly)")):
            getattr(tape, kind)(x)
        bad = np.arange(3) if kind == "param" else np.ones(3, np.complex128)   # integer consts are data leaves
        with pytest.raises(tg.DTypeError, match=full(f"{kind} (node 1): expected float32 or float64 data, got "
                                                      f"{bad.dtype}; convert with .astype(np.float64)")):
            getattr(tape, kind)(bad)
    with pytest.raises(tg.DTypeError, match=full("const_lazy (node 1): dtype must be float32 or float64, got int32")):
        tape.const_lazy((2,), np.int32)
    with pytest.raises(tg.ShapeError, match=full("const_lazy (node 1): shape must have non-negative dims, got (2, -1)")):
        tape.const_lazy((2, -1))
    assert len(tape) == 1


def test_lazy_constants_take_the_tapes_dtype_unless_told():
    for dtype in (np.float32, np.float64):
        tape = tg.Tape(dtype)
        k = tape.const_lazy((0, 2))        # an empty dimension is a valid shape
        assert k.shape == (0, 2) and k.size == 0 and tape.nodes[0].s == "lazy" and tape.nodes[0].lazy
        assert not tape.nodes[0].req and (tape.nodes[0].a, tape.nodes[0].b) == (-1, -1)
        prog = tg.capture(tape, (tape.param(np.ones(2)) * 2.0).sum())
        assert prog.val[0].dtype == np.dtype(np.float64)   # programs run in their own dtype
    tape = tg.Tape(np.float32)
    k = tape.const_lazy((2,))
    w = tape.param(np.ones(2, np.float32))
    prog = tg.capture(tape, (w * k).sum(), dtype="float32")
    prog.set_input(k, np.array([1.5, 2.5]))
    assert float(prog.forward()) == 4.0


@pytest.mark.parametrize("reader", ["value", "grad", "touched"])
def test_readers_name_themselves_and_the_argument(reader):
    tape, x = make()
    other = tg.Tape()
    y = other.param(np.ones(3))
    read = getattr(tape, reader)
    with pytest.raises(tg.ArgumentError, match=full(f"{reader} (node 1): argument v must be a Var, got ndarray")):
        read(np.ones(3))
    with pytest.raises(tg.ForeignVarError, match=full(f"{reader} (node 1): argument v (node 0) belongs to another "
                                                       f"tape; record the whole computation on one tape")):
        read(y)
    m = tape.mark()
    z = x * 2.0
    tape.reset_to(m)
    with pytest.raises(tg.ForeignVarError, match=full(f"{reader} (node 1): argument v (node 1) was dropped by "
                                                       f"reset_to; Vars created after a mark are invalid once the "
                                                       f"tape is reset to it")):
        read(z)


def test_ops_name_the_argument_that_is_wrong():
    tape, x = make()
    other = tg.Tape()
    y = other.param(np.ones(3))
    with pytest.raises(tg.ForeignVarError, match=full("mul (node 1): argument b (node 0) belongs to another tape; "
                                                       "record the whole computation on one tape")):
        tape.apply(tg.ops.mul, x, y)
    with pytest.raises(tg.ForeignVarError, match=full("mul (node 1): argument a (node 0) belongs to another tape; "
                                                       "record the whole computation on one tape")):
        tape.apply(tg.ops.mul, y, x)
    with pytest.raises(tg.ArgumentError, match=full("add (node 1): argument b must be a Var, got list")):
        tape.apply(tg.ops.add, x, [1.0])
    with pytest.raises(tg.ShapeError, match=full("add (node 2): shapes (3,) and (2,) do not broadcast (NumPy rules: "
                                                  "trailing dims equal or 1)")):
        tape.apply(tg.ops.add, x, tape.const(np.ones(2)))


def test_poison_mode_keeps_the_first_error_and_names_poisoned_arguments():
    tape = tg.Tape(on_error="poison")
    x = tape.param(np.ones(3))
    bad = x + tape.const(np.ones(2))
    assert repr(bad) == "<Var poisoned>" and bad.id < 0 and tape.ok is False
    first = tape.error
    assert isinstance(first, tg.ShapeError) and str(first).startswith("add (node 2): shapes (3,) and (2,)")
    worse = bad * 2.0
    assert tape.error is first and worse.id < 0
    assert tape.backward(x.sum()) is False
    strict = tg.Tape()
    w = strict.param(np.ones(3))
    with pytest.raises(tg.ForeignVarError, match=full("mul (node 1): argument a is a poisoned Var (see tape.error)")):
        strict.apply(tg.ops.mul, tg.Var(strict, -1, -1), w)
    # a poisoned tape refuses backward, however valid the loss
    assert tape.ok is False and tape.backward(tape.param(np.ones(1)).sum()) is False


def test_var_repr_and_truth():
    tape, x = make()
    assert repr(x) == "<Var node 0: param (3,)>"
    y = x.sum()
    assert repr(y) == "<Var node 1: sum ()>"
    with pytest.raises(TypeError, match=full("a Var has no truth value; compare values with tape.value(v)")):
        bool(x)


def test_backward_errors_and_poisoned_returns():
    tape, x = make()
    with pytest.raises(tg.ArgumentError, match=full("backward (node 1): argument loss must be a Var, got float")):
        tape.backward(1.0)
    with pytest.raises(tg.ShapeError, match=full("backward (node 0): expected a scalar loss (one element), got shape "
                                                 "(3,); reduce it (e.g. .sum()) or pass seed=")):
        tape.backward(x)
    with pytest.raises(tg.ShapeError, match=full("backward (node 0): seed must have the loss's shape (3,), got (2,)")):
        tape.backward(x, seed=np.ones(2))
    k = tape.const_lazy((3,))
    y = (x * k).sum()
    with pytest.raises(tg.LazyValueError, match=full(f"sum (node {y.id}): has no gradient on the tape: it depends on "
                                                     f"the lazy constant node 1; run it through a captured program "
                                                     f"(tapegrad.capture) instead")):
        tape.backward(y)
    soft = tg.Tape(on_error="poison")
    s = soft.param(np.ones(3))
    assert soft.backward(s) is False and isinstance(soft.error, tg.ShapeError)


def test_reset_to_checks_its_mark():
    tape, x = make()
    for bad in (2, -1, 1.0, "0"):
        with pytest.raises(tg.TapeError, match=full(f"reset_to: mark must be an int in [0, 1], got {bad!r}")):
            tape.reset_to(bad)
    tape.reset_to(np.int64(1))
    assert len(tape) == 1
