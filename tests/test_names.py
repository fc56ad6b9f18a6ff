"""Parameter names: tape.param(..., name=) and how programs, errors and reports use them."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ArgumentError, ForeignVarError, ShapeError


def test_names_live_and_die_with_their_nodes():
    tape = tg.Tape()
    w = tape.param(np.ones((2, 3)), name="W1")
    u = tape.param(np.zeros(3))
    mark = tape.mark()
    b = tape.param(np.zeros(3), name="b1")
    assert list(tape.names()) == ["W1", "b1"] and tape.names()["b1"] is b
    assert (tape.name_of(w), tape.name_of(u), tape.name_of(b)) == ("W1", None, "b1")
    tape.reset_to(mark)                       # b1's node is gone, and so is its name
    assert list(tape.names()) == ["W1"]
    b2 = tape.param(np.zeros(3), name="b1")   # free again
    assert tape.names()["b1"] is b2


@pytest.mark.parametrize("name, why", [
    ("W1", "already taken by node 0"),
    ("", "non-empty string"),
    (3, "non-empty string"),
    ("param_1", "reserved"),
], ids=["duplicate", "empty", "not-a-string", "reserved"])
def test_bad_names_raise_and_change_nothing(name, why):
    tape = tg.Tape()
    tape.param(np.ones(2), name="W1")
    with pytest.raises(ArgumentError, match=rf"param \(node 1\): .*{why}"):
        tape.param(np.ones(2), name=name)
    assert len(tape) == 1 and list(tape.names()) == ["W1"]


def test_bad_name_poisons_in_poison_mode():
    tape = tg.Tape(on_error="poison")
    tape.param(np.ones(2), name="W1")
    v = tape.param(np.ones(2), name="W1")
    assert v.id < 0 and not tape.ok and "already taken" in str(tape.error)


def _program():
    tape = tg.Tape()
    W = tape.param(np.arange(6.0).reshape(2, 3) / 6, name="W1")
    b = tape.param(np.zeros(3))
    x = tape.const(np.ones((4, 2)))
    loss = ((x @ W + b).tanh() ** 2).sum()
    tape.backward(loss)
    return tape, W, b, tg.capture(tape, loss)


def test_programs_read_and_write_parameters_by_name():
    tape, W, b, prog = _program()
    assert prog.param_names == ["W1", "param_1"]
    prog.forward()
    prog.backward()
    assert (prog.value("W1") == tape.value(W)).all() and (prog.grad("W1") == tape.grad(W)).all()
    assert (prog.grad("param_1") == tape.grad(b)).all()
    prog.set_input("W1", np.zeros((2, 3)))
    assert (prog.value(W) == 0).all()


def test_program_errors_name_the_parameter():
    _, W, _, prog = _program()
    with pytest.raises(ForeignVarError, match=r"value: the program has no parameter named 'W2'; its parameters are "
                                              r"\['W1', 'param_1'\]"):
        prog.value("W2")
    with pytest.raises(ShapeError, match=r"expected shape \(2, 3\) for param 'W1' node 0, got \(3, 2\)"):
        prog.set_input("W1", np.zeros((3, 2)))
    assert (prog.value(W) == np.arange(6.0).reshape(2, 3) / 6).all()   # unchanged


def test_nonfinite_reports_name_the_parameter():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, np.inf]), name="W1")
    bad = tape.first_nonfinite()
    assert (bad.node, bad.name) == (w.id, "W1") and str(bad).startswith("param 'W1' (node 0): first non-finite value")


def test_checkpoints_keep_parameter_names_and_check_them(tmp_path):
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    tape.param(np.ones(2), name="W1")
    tape.param(np.zeros(3))
    tg.save(path, tape)
    meta, _ = tg.checkpoint.read(path)
    assert meta["names"] == ["W1", None]
    other = tg.Tape()
    w = other.param(np.full(2, 7.0), name="W2")
    other.param(np.zeros(3))
    with pytest.raises(tg.TapeError, match=r"^load: parameter 0 \(node 0\) is named 'W2' on the tape, 'W1' in the "
                                           r"checkpoint$"):
        tg.load(path, other)
    assert other.value(w).tolist() == [7.0, 7.0]
    same = tg.Tape()
    v = same.param(np.zeros(2), name="W1")
    same.param(np.zeros(3))
    tg.load(path, same)
    assert same.value(v).tolist() == [1.0, 1.0]
