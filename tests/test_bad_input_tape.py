"""Bad input to the tape, the ops and the functional API: a named error, and the tape exactly as it was.

Every case asserts the exception type, that the message names the op (with the node id it would have
had) or the argument and what was expected, and that the tape's nodes, values, gradients and flags are
bit-for-bit unchanged. Registry-driven cases sweep every op of the right arity, so a new op is probed
with no edit here.
"""
import types

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import tape as T

from fault_util import raises_cleanly, same, tape_state

UNARY = [op for op in O.OPS.values() if op.arity == 1 and op.kind == "elementwise" and op.fwd is not None]
BINARY = [op for op in O.OPS.values() if op.arity == 2 and op.shape is O.broadcast]


def env():
    t = tg.Tape()
    e = types.SimpleNamespace(t=t)
    e.w = t.param(np.arange(6.0).reshape(2, 3) / 7)
    e.b = t.param(np.ones(3))
    e.x = t.const(np.ones((4, 2)))
    e.m = t.mark()
    e.y = (e.x @ e.w + e.b).tanh()
    e.loss = e.y.sum()
    t.backward(e.loss)
    stale = e.w * 2.0
    t.reset_to(t.mark())        # a reset past nothing: stale Vars come from below
    e.t2 = tg.Tape()
    e.f = e.t2.param(np.ones((2, 3)))
    m = t.mark()
    e.s = (e.w * 3.0)
    t.reset_to(m)               # e.s is stale now
    del stale
    e.y = (e.x @ e.w + e.b).tanh()
    e.loss = e.y.sum()
    e.z = t.const(np.zeros((0, 3)))
    t.backward(e.loss)
    return e


S, D, F, A, L = tg.ShapeError, tg.DTypeError, tg.ForeignVarError, tg.ArgumentError, tg.LazyValueError

CASES = [
    # leaves
    ("param complex", lambda e: e.t.param(np.ones(2, complex)), D, r"param \(node \d+\): expected float32 or float64 data, got complex128"),
    ("param object", lambda e: e.t.param(np.array([1, None], object)), D, r"param \(node \d+\): expected float32 or float64 data, got object"),
    ("param int16 array", lambda e: e.t.param(np.ones(2, np.int16)), D, r"param \(node \d+\): .*got int16; convert"),
    ("param float16", lambda e: e.t.param(np.ones(2, np.float16)), D, r"param \(node \d+\): .*got float16"),
    ("const complex scalar", lambda e: e.t.const(1 + 2j), D, r"const \(node \d+\): expected float32 or float64 data, got complex128"),
    ("const complex list", lambda e: e.t.const([1 + 2j]), D, r"const \(node \d+\): .*got complex128"),
    ("const str", lambda e: e.t.const("abc"), D, r"const \(node \d+\): .*got <U3"),
    ("param list with None", lambda e: e.t.param([1.0, None]), D, r"param \(node \d+\): .*got object"),
    ("param of a Var", lambda e: e.t.param(e.w), TypeError, r"param \(node \d+\): expected an array, got a Var"),
    ("const_lazy negative dim", lambda e: e.t.const_lazy((2, -1)), S, r"const_lazy \(node \d+\): shape must have non-negative dims, got \(2, -1\)"),
    ("const_lazy int dtype", lambda e: e.t.const_lazy((2,), np.int32), D, r"const_lazy \(node \d+\): dtype must be float32 or float64, got int32"),
    # operands that are not numbers
    ("add None", lambda e: e.w + None, D, r"add \(node \d+\): argument b must be a Var or real numbers, got NoneType"),
    ("add str", lambda e: e.w + "a", D, r"add \(node \d+\): argument b must be a Var or real numbers, got str"),
    ("radd complex array", lambda e: np.ones(3, complex) + e.b, D, r"add \(node \d+\): argument a must be .* complex128"),
    ("mul list of str", lambda e: e.w * ["a", "b", "c"], D, r"mul \(node \d+\): argument b .*got list"),
    ("maximum object", lambda e: tg.maximum(e.w, np.array([None] * 3)), D, r"maximum \(node \d+\): argument b .*object"),
    ("pow by a Var", lambda e: e.w ** e.w, TypeError, r"pow \(node \d+\): the exponent must be a constant number, got Var"),
    ("pow by a list", lambda e: e.w ** [2.0], TypeError, r"pow \(node \d+\): the exponent must be a constant number, got list"),
    ("no Var at all", lambda e: tg.add(np.ones(2), np.ones(2)), TypeError, r"expected at least one Var"),
    # foreign, stale and poisoned Vars
    ("foreign b", lambda e: e.w + e.f, F, r"add \(node \d+\): argument b \(node 0\) belongs to another tape"),
    ("foreign a", lambda e: e.f * e.w, F, r"mul \(node \d+\): argument b \(node 0\) belongs to another tape"),
    ("stale a", lambda e: e.s.tanh(), F, r"tanh \(node \d+\): argument a \(node \d+\) was dropped by reset_to"),
    ("stale b", lambda e: e.w - e.s, F, r"sub \(node \d+\): argument b \(node \d+\) was dropped by reset_to"),
    ("stale value", lambda e: e.t.value(e.s), F, r"value \(node \d+\): argument v \(node \d+\) was dropped"),
    ("stale grad", lambda e: e.t.grad(e.s), F, r"grad \(node \d+\): argument v \(node \d+\) was dropped"),
    ("stale touched", lambda e: e.t.touched(e.s), F, r"touched \(node \d+\): argument v .*dropped"),
    ("foreign value", lambda e: e.t.value(e.f), F, r"value \(node \d+\): argument v \(node 0\) belongs to another tape"),
    ("array as Var", lambda e: e.t.value(np.ones(3)), A, r"value \(node \d+\): argument v must be a Var, got ndarray"),
    # shapes
    ("matmul inner", lambda e: e.w @ e.w, S, r"matmul \(node \d+\): inner dimensions differ: \(2, 3\) @ \(2, 3\)"),
    ("matmul 1-D", lambda e: e.b @ e.b, S, r"matmul \(node \d+\): expected two 2-D operands"),
    ("bmm 2-D", lambda e: tg.bmm(e.w, e.w), S, r"bmm \(node \d+\):"),
    ("broadcast_to", lambda e: e.w.broadcast_to((3, 3)), S, r"broadcast_to \(node \d+\): shapes \(2, 3\) and \(3, 3\) do not broadcast"),
    ("reshape size", lambda e: e.w.reshape(4, 2), S, r"reshape \(node \d+\): cannot reshape \(2, 3\) \(6 elements\) into \(4, 2\)"),
    ("reshape float", lambda e: e.w.reshape(2.9, 3), S, r"reshape \(node \d+\): the new shape must be ints, got \(2.9, 3\)"),
    ("reshape str", lambda e: e.w.reshape("ab"), S, r"reshape \(node \d+\): the new shape must be ints"),
    ("reshape two -1", lambda e: e.w.reshape(-1, -1), S, r"reshape \(node \d+\): cannot reshape"),
    ("reshape bool", lambda e: e.w.reshape(True, 6), S, r"reshape \(node \d+\): the new shape must be ints"),
    ("transpose out of range", lambda e: e.w.transpose((0, 3)), S, r"transpose \(node \d+\): axes must be ints in \[-2, 2\) .* got \(0, 3\)"),
    ("transpose short", lambda e: e.w.transpose((0,)), S, r"transpose \(node \d+\): axes \(0,\) are not a permutation"),
    ("transpose repeated", lambda e: e.w.transpose((1, 1)), S, r"transpose \(node \d+\): axes \(1, 1\) are not a permutation"),
    ("transpose float axes", lambda e: e.w.transpose((0.0, 1.0)), S, r"transpose \(node \d+\): axes must be ints"),
    ("sum float axis", lambda e: e.w.sum(axis=1.0), S, r"sum \(node \d+\): axis must be an int, a tuple of ints or None, got float 1.0"),
    ("sum str axis", lambda e: e.w.sum(axis="0"), S, r"sum \(node \d+\): axis must be an int.*got str"),
    ("sum axis out of range", lambda e: e.w.sum(axis=2), S, r"sum \(node \d+\): axis 2 is out of range for an input of shape \(2, 3\)"),
    ("mean repeated axis", lambda e: e.w.mean(axis=(0, -2)), S, r"mean \(node \d+\): axis \(0, -2\) repeats an axis"),
    ("max bool axis", lambda e: e.w.max(axis=True), S, r"max \(node \d+\): axis must be an int"),
    ("max of empty", lambda e: e.z.max(), S, r"max \(node \d+\): max over an empty axis of shape \(0, 3\) has no value"),
    ("max over empty axis", lambda e: e.z.max(axis=0), S, r"max \(node \d+\): max over an empty axis"),
    ("np.sum out=", lambda e: np.sum(e.w, out=np.zeros(())), A, r"sum \(node \d+\): dtype= and out= are not supported on a Var"),
    ("sum dtype=", lambda e: e.w.sum(dtype=np.float32), A, r"sum \(node \d+\): dtype= and out= are not supported"),
    ("concat third fails", lambda e: tg.concat([e.w, e.w, e.b]), S, r"concat \(node \d+\):"),
    ("concat complex", lambda e: tg.concat([e.w, np.ones((2, 3), complex)]), D, r"concat \(node \d+\): argument xs\[1\] must be"),
    ("sub shapes with array", lambda e: e.w - np.ones(2), S, r"sub \(node \d+\): shapes \(2, 3\) and \(2,\) do not broadcast"),
    ("radd shapes with array", lambda e: np.ones((3, 3)) + e.w, S, r"add \(node \d+\): shapes \(3, 3\) and \(2, 3\)"),
    ("softmax axis", lambda e: tg.softmax(e.w, axis=2), S, r"softmax \(node \d+\): axis 2 is out of range for an input of shape \(2, 3\)"),
    ("log_softmax float axis", lambda e: tg.log_softmax(e.w, axis=0.5), S, r"logsoftmax \(node \d+\): axis 0.5 is out of range"),
    ("xent axis", lambda e: tg.softmax_cross_entropy(e.w, np.ones((2, 3)), axis=5), S, r"softmax_xent \(node \d+\): axis 5 is out of range for logits of rank 2"),
    ("xent shapes", lambda e: tg.softmax_cross_entropy(e.w, np.ones((3, 2))), S, r"softmax_xent \(node \d+\):"),
    ("concat empty", lambda e: tg.concat([]), A, r"concat: expected a non-empty sequence with at least one Var, got \[\]"),
    ("concat no Var", lambda e: tg.concat([np.ones(2)]), A, r"concat: expected a non-empty sequence with at least one Var, got \['ndarray'\]"),
    ("concat shapes", lambda e: tg.concat([e.w, e.b]), S, r"concat \(node \d+\):"),
    ("concat axis", lambda e: tg.concat([e.w, e.w], axis=3), S, r"concat \(node \d+\):"),
    ("getitem str", lambda e: e.w["0"], S, r"getitem \(node \d+\): unsupported index str '0'"),
    ("getitem float", lambda e: e.w[1.5], S, r"getitem \(node \d+\): unsupported index float 1.5"),
    ("getitem out of range", lambda e: e.w[5], S, r"getitem \(node \d+\): index 5 is out of range for axis 0 of length 2"),
    ("getitem second axis", lambda e: e.w[0, 7], S, r"getitem \(node \d+\): index 7 is out of range for axis 1 of length 3"),
    ("getitem too many", lambda e: e.w[:, :, :], S, r"getitem \(node \d+\): too many indices for shape \(2, 3\)"),
    ("getitem empty slice", lambda e: e.w[1:1], S, r"slice \(node \d+\): axis 0: range 1:1 is empty"),
    # backward
    ("backward non-scalar", lambda e: e.t.backward(e.y), S, r"backward \(node \d+\): expected a scalar loss \(one element\), got shape \(4, 3\)"),
    ("backward seed shape", lambda e: e.t.backward(e.y, seed=np.ones(3)), S, r"backward \(node \d+\): seed must have the loss's shape \(4, 3\), got \(3,\)"),
    ("backward complex seed", lambda e: e.t.backward(e.y, seed=np.ones((4, 3), complex)), D, r"backward \(node \d+\): seed must hold real numbers, got complex128"),
    ("backward str seed", lambda e: e.t.backward(e.loss, seed=np.array("a")), D, r"backward \(node \d+\): seed must hold real numbers"),
    ("backward int loss", lambda e: e.t.backward(3), A, r"backward \(node \d+\): argument loss must be a Var, got int"),
    ("backward stale loss", lambda e: e.t.backward(e.s), F, r"backward \(node \d+\): argument loss \(node \d+\) was dropped"),
    ("backward foreign loss", lambda e: e.t.backward(e.f), F, r"backward \(node \d+\): argument loss \(node 0\) belongs to another tape"),
    # episodes and construction
    ("reset_to negative", lambda e: e.t.reset_to(-1), tg.TapeError, r"reset_to: mark must be an int in \[0, \d+\], got -1"),
    ("reset_to float", lambda e: e.t.reset_to(1.0), tg.TapeError, r"reset_to: mark must be an int in \[0, \d+\], got 1.0"),
    ("reset_to past the end", lambda e: e.t.reset_to(10 ** 6), tg.TapeError, r"reset_to: mark must be an int in \[0, \d+\], got 1000000"),
    ("bool of a Var", lambda e: bool(e.w), TypeError, r"a Var has no truth value"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_named_error_and_changes_nothing(case):
    _, fn, exc, match = case
    e = env()
    raises_cleanly(exc, match, lambda: fn(e), lambda: tape_state(e.t))
    assert e.t.backward(e.loss)          # the tape still works afterwards
    assert np.isfinite(e.t.grad(e.w)).all()


@pytest.mark.parametrize("op", BINARY, ids=lambda o: o.name)
def test_every_broadcasting_op_rejects_shapes_that_do_not_broadcast(op):
    e = env()
    raises_cleanly(S, rf"{op.name} \(node \d+\): shapes \(2, 3\) and \(2,\) do not broadcast",
                   lambda: tg.functional._binary(op, None, e.w, np.ones(2)), lambda: tape_state(e.t))


@pytest.mark.parametrize("op", BINARY, ids=lambda o: o.name)
def test_every_binary_op_rejects_a_foreign_and_a_stale_operand(op):
    e = env()
    raises_cleanly(F, rf"{op.name} \(node \d+\): argument b \(node 0\) belongs to another tape",
                   lambda: e.t.apply(op, e.w, e.f), lambda: tape_state(e.t))
    raises_cleanly(F, rf"{op.name} \(node \d+\): argument a \(node \d+\) was dropped by reset_to",
                   lambda: e.t.apply(op, e.s, e.w), lambda: tape_state(e.t))


@pytest.mark.parametrize("op", UNARY, ids=lambda o: o.name)
def test_every_unary_op_rejects_an_array_where_a_var_belongs(op):
    e = env()
    raises_cleanly(A, rf"{op.name} \(node \d+\): argument a must be a Var, got ndarray",
                   lambda: e.t.apply(op, np.ones(3), None, 1.0), lambda: tape_state(e.t))


def test_poison_mode_keeps_the_first_reason_even_for_numpy_level_failures():
    t = tg.Tape(on_error="poison")
    e = t.const(np.zeros(0))
    v = e.max()
    assert v.id < 0 and not t.ok and isinstance(t.error, S) and "max (node 1)" in str(t.error)
    (t.param(np.ones(2)) @ t.param(np.ones(2)))   # a second error does not replace the first
    assert "max (node 1)" in str(t.error) and t.backward(v) is False


def test_repr_of_stale_and_poisoned_vars():
    e = env()
    assert repr(e.s) == f"<Var node {e.s.id}: dropped by reset_to>"
    assert repr(tg.Var(e.t, -1, -1)) == "<Var poisoned>"
    assert repr(e.w) == "<Var node 0: param (2, 3)>"


def test_size_zero_leaves_and_ops_work():
    t = tg.Tape()
    z = t.const(np.zeros((0, 3)))
    p = t.param(np.zeros((3, 2)))
    loss = (z @ p).sum() + p.sum()
    assert t.backward(loss) and float(t.value(loss)) == 0.0 and np.array_equal(t.grad(p), np.ones((3, 2)))


def test_backward_after_drop_consts_names_the_dropped_constant():
    t = tg.Tape()
    c, w = t.const(np.ones(3)), t.param(np.ones(3))
    loss = (c * w).sum()
    t.drop_consts()
    before = tape_state(t)
    with pytest.raises(L, match=r"sum \(node 3\): has no gradient on the tape: it depends on the dropped "
                                r"\(drop_consts\) constant node 0"):
        t.backward(loss)
    assert same(tape_state(t), before)


def test_np_sum_of_a_var_is_the_sum_op():
    t = tg.Tape()
    w = t.param(np.arange(3.0))
    s = np.sum(w)
    assert isinstance(s, tg.Var) and float(t.value(s)) == 3.0


def test_a_changing_scalar_does_not_grow_the_shape_memo():
    t = tg.Tape()
    w = t.param(np.ones(3))
    m = t.mark()
    for i in range(2 * T._Memo.LIMIT + 10):
        (w * (1.0 + i * 1e-6)).sum()
        t.reset_to(m)
    assert len(T._SHAPES) <= T._Memo.LIMIT


def test_repeated_backward_without_reset_reuses_its_scratch():
    t = tg.Tape()
    w = t.param(np.ones((8, 8)))
    x = t.const(np.ones((4, 8)))
    loss = ((x @ w).tanh() * 0.5).sum()
    for _ in range(3):
        t.backward(loss)
    size = t._grads.nbytes()
    first = np.array(t.grad(w))
    for _ in range(200):
        t.backward(loss)
    assert t._grads.nbytes() == size
    assert np.array_equal(t.grad(w), first * 203 / 3)   # leaf gradients keep accumulating (exact: powers)


def test_jacobian_rows_by_seed_accumulate_exactly_with_scratch_reuse():
    rng = np.random.default_rng(0)
    W, X = rng.standard_normal((3, 3)), rng.standard_normal((3, 2))

    def fresh():
        t = tg.Tape()
        w = t.param(W)
        return t, w, (w @ t.const(X)).tanh()
    seeds = [np.eye(6)[k].reshape(3, 2) for k in range(6)]
    rows = []
    for seed in seeds:
        t, w, y = fresh()
        t.backward(y, seed=seed)
        rows.append(np.array(t.grad(w)))
    t, w, y = fresh()
    acc = np.zeros((3, 3))
    for seed, row in zip(seeds, rows):
        t.backward(y, seed=seed)
        acc = acc + row
        assert np.array_equal(t.grad(w), acc)
