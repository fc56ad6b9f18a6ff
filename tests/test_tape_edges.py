"""The tape's less travelled paths, each at the case that separates it from a near miss: integer data
at the int64 boundary, data ops refused by their whole messages, nodes recorded with exactly the
fields the node table documents, ordered tapes, poisoned Vars after a reset, drop_consts and backward,
float32 buffers on every path, cold memo tables. No JAX."""
import math
import re
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import ordered as ORD
from tapegrad import tape as T
from tapegrad.errors import ArgumentError, DomainError, DTypeError, ForeignVarError, LazyValueError, NonFiniteError

BIG = 2 ** 63 - 1


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def fields(node):
    """The node as the node table documents it, without its source line and allocator position."""
    return (node.op.name, node.a, node.b, node.s, node.req, node.lazy, node.shape, node.c)


# ── integer and bool data ────────────────────────────────────────────────────

def test_unsigned_data_up_to_the_int64_maximum_is_kept_and_beyond_it_refused():
    tape = tg.Tape()
    ok = tape.const(np.array([0, BIG], np.uint64))
    assert tape.value(ok).dtype == np.int64 and tape.value(ok).tolist() == [0, BIG]
    small = tape.const(np.array([3, 1], np.uint8))
    assert tape.value(small).dtype == np.int64 and tape.value(small).tolist() == [3, 1]
    empty_u, empty_i = tape.const(np.array([], np.uint64)), tape.const(np.array([], np.int64))
    assert tape.value(empty_u).shape == tape.value(empty_i).shape == (0,)
    n = len(tape)
    refuses(DTypeError, f"const (node {n}): integer data must fit int64, got uint64 values up to {BIG + 1}",
            lambda: tape.const(np.array([1, BIG + 1], np.uint64)))
    assert len(tape) == n


def test_a_data_node_is_a_leaf_that_needs_no_gradient():
    tape = tg.Tape()
    tape.param(np.ones(2))
    i = tape.const(np.array([1, 0]))
    m = tape.const(np.array([True, False]))
    for v in (i, m):
        assert fields(tape.nodes[v.id]) == ("data", -1, -1, None, False, False, (2,), -1)


# ── the data-op path ─────────────────────────────────────────────────────────

def test_a_data_op_records_its_inputs_in_the_documented_slots():
    tape = tg.Tape()
    x = tape.param(np.arange(10.0).reshape(5, 2))
    idx = tape.const(np.array([4, 0]))
    y = tg.take(x, idx)
    assert fields(tape.nodes[y.id]) == ("take", x.id, idx.id, 0, True, False, (2, 2), -1)
    z = tg.index_add(x, idx, 1.0)
    nz = tape.nodes[z.id]
    assert (nz.op.name, nz.a, nz.c, nz.req, nz.lazy, nz.shape) == ("index_add", x.id, idx.id, True, False, (5, 2))
    assert tape.value(y).tolist() == [[8.0, 9.0], [0.0, 1.0]]


def test_a_data_op_on_a_lazy_constant_records_shapes_only():
    tape = tg.Tape()
    k = tape.const_lazy((5, 2))
    idx = tape.const(np.array([4, 0, 4]))
    y = tg.take(k, idx, axis=0)
    assert fields(tape.nodes[y.id]) == ("take", k.id, idx.id, 0, False, True, (3, 2), -1)
    refuses(LazyValueError, f"take (node {y.id}): has no value on the tape: it depends on the lazy constant node "
                            f"{k.id}; run it through a captured program (tapegrad.capture) instead",
            lambda: tape.value(y))
    w = tape.param(np.ones((3, 2)))
    loss = (y * w).sum()
    prog = tg.capture(tape, loss)
    prog.set_input(k, np.arange(10.0).reshape(5, 2))
    assert float(prog.forward()) == (8 + 9) * 2 + 1.0


def test_data_ops_refuse_wrong_inputs_by_their_whole_message():
    tape = tg.Tape()
    x = tape.param(np.ones((3, 2)))
    idx = tape.const(np.array([0, 2]))
    fl = tape.const(np.array([0.0, 1.0]))
    n = len(tape)
    refuses(ArgumentError, f"take (node {n}): argument a (node {idx.id}) must be a float Var, got integer data; data "
                           f"leaves are not differentiable; make a float constant with tape.const(x.astype(float))",
            lambda: tape.apply(O.OPS["take"], idx, idx, 0))
    refuses(ArgumentError, f"take (node {n}): argument b (node {fl.id}) must be integer data, got a float Var; make "
                           f"indices with tape.const(np.asarray(i, int))", lambda: tg.take(x, fl))
    refuses(ArgumentError, f"take (node {n}): expected 2 inputs", lambda: tape.apply(O.OPS["take"], x, idx, 0, idx))
    refuses(ArgumentError, f"index_add (node {n}): expected 3 inputs",
            lambda: tape.apply(O.OPS["index_add"], x, None, 0, idx))
    other = tg.Tape().const(np.array([0]))
    refuses(ForeignVarError, f"take (node {n}): argument b (node 0) belongs to another tape; record the whole "
                             f"computation on one tape", lambda: tape.apply(O.OPS["take"], x, other, 0))
    assert len(tape) == n


def test_a_data_var_as_the_first_input_of_a_float_op_is_refused():
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    idx = tape.const(np.array([0, 1]))
    n = len(tape)
    refuses(ArgumentError, f"add (node {n}): argument a (node {idx.id}) must be a float Var, got integer data; data "
                           f"leaves are not differentiable; make a float constant with tape.const(x.astype(float))",
            lambda: tape.apply(O.add, idx, x))
    assert len(tape) == n


def test_check_finite_refuses_a_data_op_that_overflows_and_keeps_the_arena():
    tape = tg.Tape(check_finite=True)
    x = tape.param(np.array([1e308, 0.0]))
    idx = tape.const(np.array([0]))
    v = tape.const(np.array([1e308]))
    n, pos = len(tape), tape._vals.pos
    with np.errstate(over="ignore"), pytest.raises(NonFiniteError) as e:
        tg.index_add(x, idx, v)
    assert re.fullmatch(rf"index_add \(node {n}\): first non-finite value, inputs \(\(2,\), \(1,\), \(1,\)\), created at "
                        rf"\S+\.py:\d+", str(e.value))
    assert len(tape) == n and tape._vals.pos == pos


def test_an_episode_of_data_ops_hands_its_arena_back_at_reset():
    tape = tg.Tape()
    x = tape.param(np.arange(6.0).reshape(3, 2))
    m = tape.mark()
    pos = tape._vals.pos
    for _ in range(3):
        y = tg.take(x, np.array([2, 0]))     # the episode's first node: an integer const, then the data op
        tape.backward((y * y).sum())
        tape.reset_to(m)
        assert tape._vals.pos == pos


# ── the float-op path ────────────────────────────────────────────────────────

def test_op_nodes_have_no_third_input_and_unary_nodes_no_second():
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    y = x.exp()
    z = y * x
    assert fields(tape.nodes[y.id]) == ("exp", x.id, -1, None, True, False, (2,), -1)
    assert fields(tape.nodes[z.id]) == ("mul", y.id, x.id, None, True, False, (2,), -1)


def test_a_value_the_op_cannot_take_is_a_domain_error_and_the_tape_is_kept():
    tape = tg.Tape()
    a = tape.param(np.array([[1.0, 2.0], [2.0, 1.0]]))
    n, pos = len(tape), tape._vals.pos
    refuses(DomainError, "cholesky (node 1): the matrix is not positive definite: its leading minor of order 2 is not "
                         "(LAPACK potrf info 2); expected a symmetric positive definite matrix", lambda: tg.cholesky(a))
    assert len(tape) == n and tape._vals.pos == pos
    ok = tg.cholesky(tape.param(np.array([[4.0, 2.0], [2.0, 2.0]])))
    assert tape.value(ok).tolist() == [[2.0, 0.0], [1.0, 1.0]]


def test_an_op_node_remembers_where_it_was_made_unless_sources_are_off():
    loud, quiet = tg.Tape(), tg.Tape(sources=False)
    for tape, want in ((loud, True), (quiet, False)):
        x = tape.param(np.array([1e300]))
        with np.errstate(over="ignore"):
            y = x * x
        bad = tape.first_nonfinite()
        assert bad.node == y.id and (bad.where != "?") is want


# ── ordered tapes ────────────────────────────────────────────────────────────

def test_an_ordered_tape_records_the_ordered_variants_and_nothing_else_changes():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((3, 40)), rng.standard_normal((40, 2))
    assert tg.Tape(ordered=1).ordered is True and tg.Tape().ordered is False
    tape = tg.Tape(ordered=True)
    A, B = tape.param(a), tape.param(b)
    y = A @ B
    s = (y * y).exp().sum()
    ops = [tape.nodes[k].op for k in range(len(tape))]
    assert ops[2] is ORD.matmul and ops[3] is O.mul and ops[4] is O.exp and ops[5] is ORD.sum_ and s.id == 5
    want = np.array([[sum(a[i, k] * b[k, j] for k in range(40)) for j in range(2)] for i in range(3)])
    assert np.array_equal(tape.value(y), want)
    plain = tg.Tape()
    assert plain.nodes == () and (plain.param(a) @ plain.param(b)).tape.nodes[2].op is O.matmul


# ── poisoned tapes ───────────────────────────────────────────────────────────

def test_a_poisoned_var_stays_poisoned_after_a_reset():
    tape = tg.Tape(on_error="poison")
    x = tape.param(np.ones(2))
    m = tape.mark()
    tape.reset_to(m)             # epoch 1: a poisoned Var must not pass for the tape's last node
    last = x * 3.0
    bad = x @ tape.param(np.ones(3))
    assert (bad.id, bad.epoch) == (-1, -1) and repr(bad) == "<Var poisoned>"
    after = tape.apply(O.exp, bad)
    both = tape.apply(O.mul, bad, last)
    assert after.id == -1 and both.id == -1 and last.id == 1
    assert [n.op.name for n in tape.nodes] == ["param", "muls", "param"] and not tape.ok


def test_a_poisoned_backward_with_a_bad_seed_reports_failure():
    tape = tg.Tape(on_error="poison")
    x = tape.param(np.ones(2))
    y = x * 2.0
    assert tape.backward(y, seed=np.array([1 + 1j, 0j])) is False and not tape.ok
    assert str(tape.error) == f"backward (node {y.id}): seed must hold real numbers, got complex128"


# ── backward ─────────────────────────────────────────────────────────────────

def test_the_sweep_reaches_op_nodes_below_a_later_parameter():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    h = w * 3.0                      # an op node below v
    v = tape.param(np.array([5.0, 7.0]))
    tape.backward((h * v).sum())
    assert tape.grad(w).tolist() == [15.0, 21.0] and tape.grad(v).tolist() == [3.0, 6.0]


def test_backward_after_drop_consts_needs_only_the_values_it_reads():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    c = tape.const(np.array([3.0, 4.0]))
    uses_c = (w * c).sum()
    own = (w * w).sum()
    tape.drop_consts()
    assert tape.backward(own) is True and tape.grad(w).tolist() == [2.0, 4.0]
    refuses(LazyValueError, f"sum (node {uses_c.id}): has no gradient on the tape: it depends on the dropped "
                            f"(drop_consts) constant node {c.id}; run it through a captured program "
                            f"(tapegrad.capture) instead", lambda: tape.backward(uses_c))


def test_a_lazy_constant_is_named_even_when_another_one_is_the_last_node():
    tape = tg.Tape()
    k1 = tape.const_lazy((2,))
    y = k1.exp()
    tape.const_lazy((3,))           # the last node: a lazy constant that y does not read
    refuses(LazyValueError, f"exp (node {y.id}): has no value on the tape: it depends on the lazy constant node "
                            f"{k1.id}; run it through a captured program (tapegrad.capture) instead",
            lambda: tape.value(y))


def test_repeated_backwards_reuse_the_gradient_scratch():
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    loss = ((w * 2.0).exp() * w).sum()
    sizes = []
    for _ in range(4):
        tape.backward(loss)
        sizes.append(tape._grads.pos)
    assert sizes[1] == sizes[2] == sizes[3]


def test_a_float32_tape_keeps_float32_gradients_on_every_path():
    saved = dict(T._ONES), dict(T._UNBROADCAST)
    T._ONES.clear()
    T._UNBROADCAST.clear()
    try:
        tape = tg.Tape(np.float32)
        w = tape.param(np.array([[1.0, 2.0]]))
        h = w * 2.0                                          # an op node before the mark
        m = tape.mark()
        for _ in range(2):
            loss = ((h * tape.const(np.ones((3, 2)))) ** 2).sum()
            for _ in range(2):                               # a second backward recycles the scratch
                tape.backward(loss)
            assert tape.grad(loss).dtype == np.float32 and tape.grad(h).dtype == np.float32
            assert tape.grad(w).dtype == np.float32
            tape.reset_to(m)
        assert np.array_equal(tape.grad(w), np.zeros((1, 2), np.float32))
    finally:
        T._ONES.update(saved[0])
        T._UNBROADCAST.update(saved[1])


@pytest.mark.parametrize("cshape, shape, axes", [
    ((2, 3, 4), (2, 1, 4), (1,)), ((2, 3, 4), (3, 1), (0, 2)), ((5, 1, 4), (1, 1, 4), (0,)),
    ((2, 1, 3, 4), (1, 3, 1), (0, 3)), ((4, 2), (2,), (0,))])
def test_unbroadcast_sums_exactly_the_stretched_axes_with_a_cold_plan_cache(cshape, shape, axes):
    saved = dict(T._UNBROADCAST)
    T._UNBROADCAST.clear()
    try:
        c = np.arange(math.prod(cshape), dtype=float).reshape(cshape)
        out = np.empty(shape)
        T.unbroadcast(c, shape, None, out=out)
        assert np.array_equal(out, c.sum(axis=axes).reshape(shape))
        assert T._UNBROADCAST[(cshape, shape)][0] == axes
    finally:
        T._UNBROADCAST.clear()
        T._UNBROADCAST.update(saved)


# ── small things ─────────────────────────────────────────────────────────────

def test_a_memo_table_forgets_everything_when_it_reaches_its_limit():
    memo = T._Memo()
    memo.LIMIT = 3
    value = object()
    for k in range(3):
        memo[k] = value
    assert len(memo) == 3 and memo[2] is value
    memo["x"] = value
    assert dict(memo) == {"x": value}


def test_names_are_listed_in_registration_order_and_only_param_k_is_reserved():
    tape = tg.Tape()
    tape.param(np.ones(1), name="zeta")
    tape.param(np.ones(1), name="alpha")
    tape.param(np.ones(1), name="layer_1")
    tape.param(np.ones(1), name="params_2")
    tape.param(np.ones(1), name="param_x")
    assert list(tape.names()) == ["zeta", "alpha", "layer_1", "params_2", "param_x"]
    refuses(ArgumentError, "param (node 5): name 'param_5' is reserved: unnamed parameters are called param_<k> "
                           "(k = registration index)", lambda: tape.param(np.ones(1), name="param_5"))


def test_the_repr_of_a_var_dropped_as_the_last_node():
    tape = tg.Tape()
    tape.param(np.ones(2))
    m = tape.mark()
    v = tape.param(np.ones(3))
    assert repr(v) == "<Var node 1: param (3,)>"
    tape.reset_to(m)
    assert v.id == len(tape) and repr(v) == "<Var node 1: dropped by reset_to>"


def test_an_intermediate_gradient_before_any_backward_reads_as_zeros():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    h = w * 2.0
    assert tape.grad(h).tolist() == [0.0, 0.0] and tape.grad(w).tolist() == [0.0, 0.0]


def test_a_float32_gradient_carved_before_the_mark_stays_float32_across_episodes():
    tape = tg.Tape(np.float32)
    w = tape.param(np.array([[1.0, 2.0]]))
    h = w * 2.0
    m = tape.mark()
    for _ in range(3):                       # one backward per episode: h's gradient moves out of the arena at reset
        tape.backward((h * h).sum())
        assert tape.grad(h).dtype == np.float32 and tape.grad(h).tolist() == [[4.0, 8.0]]
        tape.reset_to(m)


def test_an_aliasing_contribution_of_a_three_input_op_is_copied_not_adopted():
    tape = tg.Tape()
    p = tape.param(np.array([1.0, 2.0, 3.0]))
    h = p * 2.0
    h5 = h * 5.0                             # h's other consumer, swept after y
    y = tg.index_add(h, np.array([0, 0]), np.array([1.0, 1.0]))   # da is g itself
    loss = (y * 3.0).sum() + h5.sum()
    tape.backward(loss)
    assert tape.grad(y).tolist() == [3.0, 3.0, 3.0]
    assert tape.grad(h).tolist() == [8.0, 8.0, 8.0] and tape.grad(p).tolist() == [16.0, 16.0, 16.0]


def test_dynamic_update_slice_routes_the_gradient_around_and_into_the_window():
    tape = tg.Tape()
    a = tape.param(np.zeros(4))
    u = tape.param(np.array([5.0, 6.0]))
    y = tg.dynamic_update_slice(a, u, np.array([1]))
    assert tape.value(y).tolist() == [0.0, 5.0, 6.0, 0.0]
    tape.backward((y * tape.const(np.array([1.0, 2.0, 3.0, 4.0]))).sum())
    assert tape.grad(a).tolist() == [1.0, 0.0, 0.0, 4.0] and tape.grad(u).tolist() == [2.0, 3.0]


def test_a_float32_tape_computes_in_float32_down_to_its_forward_scratch():
    a = np.random.default_rng(7).standard_normal((3, 500)).astype(np.float32) * 4
    tape = tg.Tape(np.float32)
    y = tape.param(a).softmax(axis=1)
    e = np.exp(a - a.max(axis=1, keepdims=True))
    want = e / np.add.reduce(e, axis=1, keepdims=True)        # every step in float32, as the rule does
    assert want.dtype == np.float32 and np.array_equal(tape.value(y), want)


def test_a_python_list_is_rounded_once_into_a_float32_tape():
    x = 2 ** 53 + 2 ** 29 + 1          # nearer 2**53 + 2**30 in float32; through float64 it would tie down to 2**53
    tape = tg.Tape(np.float32)
    for v in (tape.param([x]), tape.const([x])):
        assert tape.value(v).dtype == np.float32 and int(tape.value(v)[0]) == 2 ** 53 + 2 ** 30


def test_a_direct_apply_names_the_line_that_called_it():
    # (deselected under mutation testing: there every call passes through mutmut's trampoline)
    tape = tg.Tape(check_finite=True)
    x = tape.param(np.array([-1.0]))
    line = sys._getframe().f_lineno + 2
    with pytest.raises(NonFiniteError) as e, np.errstate(invalid="ignore"):
        tape.apply(O.sqrt, x)
    assert str(e.value).endswith(f"created at test_tape_edges.py:{line}")


def test_a_three_input_data_op_on_a_lazy_constant_keeps_its_indices():
    tape = tg.Tape()
    k = tape.const_lazy((4,))
    idx = tape.const(np.array([3, 3]))
    y = tg.index_add(k, idx, np.array([1.0, 2.0]))
    ny = tape.nodes[y.id]
    assert (ny.op.name, ny.a, ny.c, ny.lazy, ny.shape) == ("index_add", k.id, idx.id, True, (4,))
    prog = tg.capture(tape, (y * y).sum())
    prog.set_input(k, np.zeros(4))
    assert float(prog.forward()) == 9.0


def test_without_check_finite_a_data_op_may_overflow():
    tape = tg.Tape()
    x = tape.param(np.array([1e308, 0.0]))
    with np.errstate(over="ignore"):
        y = tg.index_add(x, np.array([0]), np.array([1e308]))
    assert tape.value(y)[0] == np.inf and tape.ok
