"""A captured program's input slots: exact shapes only, and lazy constants on either side of an op."""
import numpy as np
import pytest

import tapegrad as tg

RNG = np.random.default_rng(29)


def small_program(backend="numpy"):
    tape = tg.Tape()
    w = tape.param(RNG.standard_normal((8, 3)))
    x = tape.const(RNG.standard_normal((12, 8)))
    b = tape.param(RNG.standard_normal(3))
    loss = ((x @ w + b).tanh()).mean()
    return tape, w, x, b, tg.capture(tape, loss, backend=backend)


@pytest.mark.parametrize("shape", [(1, 8), (8,), (12, 1), ()], ids=str)
def test_set_input_rejects_a_shape_that_would_merely_broadcast(shape):
    tape, w, x, b, prog = small_program()
    before = float(prog.forward())
    with pytest.raises(tg.ShapeError, match=rf"set_input \(node 1\): expected shape \(12, 8\) for const node 1, "
                                            rf"got {re_shape(shape)}"):
        prog.set_input(x, np.ones(shape))
    assert float(prog.forward()) == before           # the slot is unchanged
    with pytest.raises(tg.ShapeError, match=r"expected shape \(3,\) for param 'param_1' node 2, got \(1, 3\)"):
        prog.set_input(b, np.ones((1, 3)))
    assert float(prog.forward()) == before


def re_shape(shape):
    return str(shape).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("form", ["mul", "sub", "div", "matmul"])
def test_a_lazy_constant_on_the_b_side_of_a_binary_op(backend, form):
    """The lazy constant is op input b: the tape records shapes only, the program computes it."""
    w0, k0 = RNG.standard_normal((3, 4)), RNG.uniform(0.5, 2.0, (4,) if form != "matmul" else (4, 2))
    rule = {"mul": lambda a, b: a * b, "sub": lambda a, b: a - b, "div": lambda a, b: a / b,
            "matmul": lambda a, b: a @ b}[form]

    def graph(tape, frozen):
        w = tape.param(w0)
        y = rule(w, frozen)
        return w, y, (y * y).sum()

    ref = tg.Tape()
    rw, ry, rloss = graph(ref, ref.const(k0))
    ref.backward(rloss)

    tape = tg.Tape()
    k = tape.const_lazy(k0.shape)
    w, y, loss = graph(tape, k)
    assert y.shape == ry.shape
    with pytest.raises(tg.LazyValueError, match=rf"{form} \(node 2\): has no value on the tape: it depends on the "
                                                r"lazy constant node 0"):
        tape.value(y)
    prog = tg.capture(tape, loss, backend=backend)
    with pytest.raises(tg.LazyValueError, match=r"lazy constant node\(s\) \[0\] have no values yet"):
        prog.forward()
    prog.set_input(k, k0)
    prog.forward()
    prog.backward()
    exact = backend == "numpy" or form != "matmul"
    for v, rv in ((y, ry), (loss, rloss)):
        got, want = prog.value(v), ref.value(rv)
        assert np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-13, atol=0)
    got, want = prog.grad(w), ref.grad(rw)
    assert np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-13, atol=0)
