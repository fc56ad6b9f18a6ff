"""Code-generator paths the model tests miss: gradients into broadcast inputs over an axis of exactly two,
a broadcast_to that changes nothing, and which elementwise kernels the CUDA dialect prints."""
import dataclasses
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import codegen, fuse, kernels
from tapegrad.native.runner import layout

RNG = np.random.default_rng(31)


def wild(shape):
    return RNG.standard_normal(shape) * 10.0 ** RNG.integers(-3, 3, shape)


@pytest.mark.parametrize("fused", [False, True])
def test_gradients_into_inputs_broadcast_over_an_axis_of_two_equal_the_tape(fused):
    """b (1, 3) and c (2, 1) broadcast over axes of length 2 and 3 (NumPy sums them out); d goes through
    broadcast_to its own shape, which needs no reduction at all; a receives g twice (fan-in)."""
    tape = tg.Tape()
    a, b = tape.param(wild((2, 3))), tape.param(wild((1, 3)))
    c, d = tape.param(wild((2, 1))), tape.param(wild((2, 3)))
    w = tape.const(wild((2, 3)))
    t = (a * b + c) * w + tg.broadcast_to(d, (2, 3)) * a
    u = (t + b) * (c - a)
    loss = (u * u).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native", fuse=fused)
    for _ in range(2):   # the second pass must overwrite the first's gradients, not add to them
        assert float(prog.forward()) == float(tape.value(loss))
        prog.backward()
        for v in (a, b, c, d):
            assert np.array_equal(prog.grad(v), tape.grad(v)), v


def test_cuda_dialect_prints_a_kernel_for_every_elementwise_segment_and_no_other():
    """Forward: a lone libm node (sin) and fused runs each get a kernel, the reduction none; backward
    likewise (sin's derivative calls cos: a lone segment), each kernel named after its first node."""
    tape = tg.Tape()
    x, c = tape.param(wild((3, 4))), tape.const(wild((3, 4)))
    h = (x * c).sin()
    loss = (h * c + x).sum()
    prog = tg.capture(tape, loss)
    fwd, bwd = fuse.plan(prog, True)
    text = codegen.Emitter(prog, layout(prog)[1], fwd, bwd, target="cuda").elementwise_kernels()
    want = [f"tg_f{seg[0]}" for seg in fwd if prog.nodes[seg[0]][0].kind == "elementwise"] + \
           [f"tg_b{seg[0][0]}" for seg in bwd if prog.nodes[seg[0][0]][0].kind == "elementwise"]
    assert [len(seg) for seg in fwd] == [1, 1, 2, 1] and [len(seg) for seg in bwd] == [1, 2, 1, 1]
    assert re.findall(r"__global__ void (\w+)\(", text) == want == ["tg_f2", "tg_f3", "tg_f4", "tg_b5", "tg_b3", "tg_b2"]


def test_every_op_in_one_native_program_matches_the_tape_within_its_tier():
    """test_native.py checks each op in its own test but builds all of them once in a shared fixture, so a
    mutation tool that picks tests by the functions they call credits the code generator to the first
    op's test alone; this test builds the same programs itself (a build-cache hit in a normal run)."""
    from test_native import check_ops, every_op_programs
    check_ops(every_op_programs())


def emitter(tape, loss):
    prog = tg.capture(tape, loss)
    return prog, codegen.Emitter(prog, layout(prog)[1], *fuse.plan(prog, True))


def test_an_elementwise_op_without_a_c_expression_is_named_in_full():
    tape = tg.Tape()
    x = tape.param(wild((2, 3)))
    loss = x.exp().sum()
    prog, em = emitter(tape, loss)
    k = prog.compute[0]
    op, a, b, s = prog.nodes[k]
    prog.nodes[k] = (dataclasses.replace(op, c_fwd=None), a, b, s)
    with pytest.raises(tg.TapeError) as e:
        em.emit()
    assert str(e.value) == (f"exp (node {k}): the native backend has no C form of this elementwise op (its "
                            "registry entry lacks c_fwd); use backend='numpy'")


def test_an_op_without_a_backward_kernel_is_named_in_full(monkeypatch):
    tape = tg.Tape()
    x, w = tape.param(wild((2, 3))), tape.param(wild((3, 4)))
    y = x @ w
    prog, em = emitter(tape, y.sum())
    monkeypatch.delitem(kernels.BACKWARD, "matmul")
    with pytest.raises(tg.TapeError) as e:
        em.emit()
    assert str(e.value) == f"matmul (node {y.id}): the native backend has no backward kernel for this op"


def test_a_rank_nine_program_sizes_the_runtimes_index_arrays_for_it():
    """The runtime's index arrays hold 8 dimensions unless the program defines TG_MAXD."""
    shape = (2, 1, 3, 1, 2, 1, 2, 1, 3)
    tape = tg.Tape()
    x = tape.param(wild(shape))
    y = tg.transpose(x, tuple(reversed(range(9)))) * tape.const(wild(shape[::-1]))
    loss = y.sum(axis=(0, 2, 4)).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    assert "#define TG_MAXD 9" in prog.runner.source
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    assert np.array_equal(prog.grad(x), tape.grad(x))


def test_zero_dimensional_window_updates_write_and_do_not_add():
    tape = tg.Tape()
    a, u = tape.param(np.array(5.0)), tape.param(np.array(-2.0))
    y = tg.dynamic_update_slice(a, u, np.zeros(0, np.int64))
    loss = y * 3.0 + tg.dynamic_slice(a * u, np.zeros(0, np.int64), ())
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    assert float(prog.forward()) == float(tape.value(loss)) == -16.0
    prog.backward()
    assert [float(prog.grad(v)) for v in (a, u)] == [float(tape.grad(v)) for v in (a, u)]


def test_data_inputs_at_node_zero_keep_their_c_types():
    """Node 0 is a bool mask and node 1 integer indices: their buffers are declared as data, and every
    scratch or gradient buffer (S0, g1…) as real, whatever the node with the same number holds."""
    tape = tg.Tape()
    mask, idx = tape.const(np.array([[True, False, True], [False, True, True]])), tape.const(np.array([2, 0, 2]))
    x, y = tape.param(wild((3, 3))), tape.param(wild((2, 3)))
    rows = tg.take(x, idx)                       # x gathered twice into row 0 and 2: a scatter-add through S0
    t = tg.where(mask, rows[:2] * y, y - rows[1:])
    loss = (t * t).sum() + (rows * rows).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    assert re.search(r"#define v0 \(\(const unsigned char \*\)TG_B\(\d+\)\)", prog.runner.source)
    assert re.search(r"#define v1 \(\(const long long \*\)TG_B\(\d+\)\)", prog.runner.source)
    assert not re.search(r"#define [gS]\d+ \(\(const", prog.runner.source)
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    for v in (x, y):
        assert np.array_equal(prog.grad(v), tape.grad(v))


@pytest.mark.parametrize("fused", [False, True])
def test_both_inputs_broadcast_and_a_constant_first_operand(fused):
    """b (1, 3) · c (2, 1): both contributions need their own scratch row and reduction; w · a with w a
    constant: only the b side is differentiated."""
    tape = tg.Tape()
    a, b, c = tape.param(wild((2, 3))), tape.param(wild((1, 3))), tape.param(wild((2, 1)))
    w = tape.const(wild((2, 3)))
    t = b * c + w * a
    loss = (t * (t - a)).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native", fuse=fused)
    for _ in range(2):   # b's and c's first contributions must overwrite the last pass's gradients
        assert float(prog.forward()) == float(tape.value(loss))
        prog.backward()
        for v in (a, b, c):
            assert np.array_equal(prog.grad(v), tape.grad(v)), v


def test_float32_programs_print_float32_literals():
    """x · 0.1 in float32 is x · 0.1f; in double, then rounded, it differs for many x."""
    tape = tg.Tape(np.float32)
    x = tape.param(np.linspace(-3.0, 3.0, 64))
    y = x * 0.1 + 0.3
    loss = (y * y).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native", dtype="float32", fuse=False)
    prog.forward()
    prog.backward()
    assert prog.value(y).dtype == np.float32
    assert np.array_equal(prog.value(y), tape.value(y)) and np.array_equal(prog.grad(x), tape.grad(x))
    want64 = (tape.value(x).astype(np.float64) * 0.1 + 0.3).astype(np.float32)
    assert not np.array_equal(want64, tape.value(y))    # the difference is observable with these values


def test_a_kernel_printer_names_its_node_when_it_cannot_print_it():
    tape = tg.Tape()
    x, w = tape.param(np.ones((1, 1) + (2,) * 9)), tape.param(np.ones((1, 1) + (1,) * 9))
    y = tg.conv(x, w)
    prog, em = emitter(tape, y.sum())
    with pytest.raises(tg.TapeError) as e:
        em.emit()
    assert str(e.value) == (f"conv (node {y.id}): the native backend handles at most 8 windowed dimensions, got 9; "
                            "use backend='numpy'")


def test_a_window_update_whose_starts_are_node_zero():
    """The starts (a data input) are node 0: the third operand's buffer is v0, not missing."""
    tape = tg.Tape()
    starts = tape.const(np.array([1, 2]))
    a, u = tape.param(wild((4, 5))), tape.param(wild((2, 2)))
    y = tg.dynamic_update_slice(a, u, starts)
    loss = (y * y).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    assert np.array_equal(prog.grad(a), tape.grad(a)) and np.array_equal(prog.grad(u), tape.grad(u))


def test_a_scatter_whose_indices_are_node_zero():
    """index_add's indices (node 0) size its loops: their shape must reach the printer."""
    tape = tg.Tape()
    idx = tape.const(np.array([2, 0, 2]))
    a, v = tape.param(wild((4, 3))), tape.param(wild((3, 3)))
    y = tg.index_add(a, idx, v)
    loss = (y * y).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    assert np.array_equal(prog.grad(a), tape.grad(a)) and np.array_equal(prog.grad(v), tape.grad(v))
