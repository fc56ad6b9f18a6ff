"""Tape behaviour the op harnesses do not reach: leaf conversion and flags, caches on a cold start, gradients
of nodes backward never reached, dead nodes inside the sweep, float32 buffers, anomaly reports."""
import re

import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as T


def test_leaves_have_no_inputs_and_the_right_flags():
    tape = tg.Tape()
    p, c, k = tape.param(np.ones(2)), tape.const(np.ones(2)), tape.const_lazy((2,))
    m = tape.mark()
    e = tape.const(np.ones(2))        # a per-episode constant
    for v, req, lazy in ((p, True, False), (c, False, False), (k, False, True), (e, False, False)):
        n = tape.nodes[v.id]
        assert (n.a, n.b, n.req, n.lazy) == (-1, -1, req, lazy), n
    assert m == 3 and tape.nodes[e.id].pos is not None and tape.nodes[c.id].pos is None


def test_constants_receive_no_gradient():
    tape = tg.Tape()
    p, c = tape.param(np.array([1.0, 2.0])), tape.const(np.array([3.0, 4.0]))
    m = tape.mark()
    e = tape.const(np.array([5.0, 6.0]))
    tape.backward((p * c * e).sum())
    assert np.array_equal(tape.grad(p), [15.0, 24.0])
    for v in (c, e):
        assert not tape.touched(v) and np.array_equal(tape.grad(v), [0.0, 0.0])
    assert m == 2


def test_lists_and_numpy_scalars_become_tape_floats():
    for dtype in (np.float64, np.float32):
        tape = tg.Tape(dtype)
        a = tape.param([1, 2, 3])                     # ints in a list: converted to the tape's dtype
        b = tape.const(np.float32(2.5))               # a NumPy scalar keeps its float type, then is copied in
        c = tape.const(np.array([1.0, 2.0], np.float32 if dtype == np.float64 else np.float64))
        m = tape.mark()
        d = tape.const(np.array([0.25], np.float32))  # per-episode, from the other float type
        for v, want in ((a, [1.0, 2.0, 3.0]), (b, 2.5), (c, [1.0, 2.0]), (d, [0.25])):
            assert tape.value(v).dtype == np.dtype(dtype) and np.array_equal(tape.value(v), want)
        assert m == 3
    tape = tg.Tape()
    for bad in (np.ones(2, np.float16), np.ones(2, np.complex128), np.array(["a"])):
        with pytest.raises(tg.DTypeError, match=re.escape(f"param (node 0): expected float32 or float64 data, got "
                                                          f"{bad.dtype}")):
            tape.param(bad)
    assert len(tape) == 0


def test_gradients_of_nodes_backward_never_reached_are_zeros_of_the_tapes_dtype():
    for dtype in (np.float64, np.float32):
        tape = tg.Tape(dtype)
        x = tape.param(np.array([1.0, -2.0]))
        unused = (x * 3.0).tanh()
        tape.backward((x * x).sum())
        g = tape.grad(unused)
        assert g.dtype == np.dtype(dtype) and g.shape == (2,) and np.array_equal(g, [0.0, 0.0])
        assert not tape.touched(unused) and tape.touched(x)
        assert not g.flags.writeable


def test_a_dead_node_between_live_ones_does_not_stop_the_sweep():
    tape = tg.Tape()
    x = tape.param(np.array([1.0, -2.0]))
    sq = x * x
    dead = x * 3.0                    # recorded after sq, not on the loss's path
    loss = sq.sum()
    tape.backward(loss)
    assert np.array_equal(tape.grad(x), [2.0, -4.0]) and dead.id == 2


def test_an_aliasing_contribution_arriving_first_on_the_b_side_is_copied():
    """y = q + h hands g_y to h as h's first contribution; h·5 adds to h later: g_y must stay 3."""
    tape = tg.Tape()
    p, q = tape.param(np.array([1.0, 2.0])), tape.param(np.array([0.5, 0.5]))
    h = p * 2.0
    h5 = h * 5.0
    y = q + h
    loss = (y * 3.0).sum() + h5.sum()
    tape.backward(loss)
    assert np.array_equal(tape.grad(y), [3.0, 3.0])
    assert np.array_equal(tape.grad(h), [8.0, 8.0]) and np.array_equal(tape.grad(p), [16.0, 16.0])


def test_intermediate_gradients_hold_the_latest_pass_even_through_a_broadcast():
    tape = tg.Tape()
    p = tape.param(np.array([1.0, 2.0, 3.0]))
    b = p * 1.0                                  # an op node that a broadcast add reads
    y = tape.const(np.ones((4, 3))) + b
    tape.backward((y * 2.0).sum())
    assert np.array_equal(tape.grad(b), [8.0, 8.0, 8.0])
    tape.backward((y * 3.0).sum())
    assert np.array_equal(tape.grad(b), [12.0, 12.0, 12.0])        # the latest pass, not the sum
    assert np.array_equal(tape.grad(p), [20.0, 20.0, 20.0])        # leaves accumulate across passes


def test_cold_caches_give_the_same_results(monkeypatch):
    """The tape memoises shape rules, broadcast reductions and backward seeds per process: a fresh process
    (empty caches) must compute exactly what a warm one does."""
    def run():
        tape = tg.Tape(np.float32)
        w = tape.param(np.arange(6.0).reshape(2, 3) / 7.0)
        b = tape.param(np.array([[0.5], [-1.0]]))
        c = tape.param(np.array([1.0, 2.0, 3.0]))
        y = ((w * b) + c).tanh().sum(axis=1, keepdims=True)
        loss = y.reshape((1, 1, 2)).mean(axis=2)
        tape.backward(loss)
        return [np.array(tape.value(loss))] + [np.array(tape.grad(v)) for v in (w, b, c)]
    warm = run()
    for cache in ("_SHAPES", "_UNBROADCAST", "_ONES"):
        monkeypatch.setattr(T, cache, {})
    cold = run()
    for a, b in zip(cold, warm):
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a, b)
    assert T._ONES and T._UNBROADCAST and T._SHAPES


def test_float32_tapes_compute_in_float32():
    tape = tg.Tape(np.float32)
    x = tape.param(np.array([-3.0, -0.5, 0.25, 4.0], np.float32))
    s = x.sigmoid()
    tape.backward((s * s).sum())
    xs = np.array([-3.0, -0.5, 0.25, 4.0], np.float32)
    e = np.exp(-np.abs(xs))                      # sigmoid's rule, in float32 throughout
    want = np.where(xs >= 0, np.float32(1.0), e) / (np.float32(1.0) + e)
    assert tape.value(s).dtype == np.float32 and np.array_equal(tape.value(s), want)
    assert tape.grad(s).dtype == np.float32 and tape.grad(x).dtype == np.float32


def test_anomaly_reports_name_node_kind_inputs_and_a_place():
    tape = tg.Tape()
    x = tape.param(np.array([0.0, 4.0]))
    assert tape.error is None and tape.ok
    r = x.sqrt()
    with np.errstate(divide="ignore"):
        tape.backward(r.sum())
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes) == (0, "param", "grad", ())
    assert re.fullmatch(r"\w+\.py:\d+", bad.where)
    assert str(bad) == f"param (node 0): first non-finite grad, inputs (), created at {bad.where}"
    with np.errstate(divide="ignore"):
        z = x.log()
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes) == (z.id, "log", "value", ((2,),))
    quiet = tg.Tape(sources=False)
    n = quiet.param(np.array([np.nan]))
    assert quiet.first_nonfinite().where == "?" and n.id == 0
    loud = tg.Tape()
    loud.param(np.array([np.inf]))
    assert loud.first_nonfinite().where != "?"


def test_check_finite_refuses_the_op_and_leaves_the_tape_as_it_was():
    tape = tg.Tape(check_finite=True)
    x = tape.param(np.array([1.0, -1.0]))
    pos = tape._vals.pos
    with pytest.raises(tg.NonFiniteError, match=r"^log \(node 1\): first non-finite value, inputs \(\(2,\),\), "
                                                r"created at \S+\.py:\d+$"), np.errstate(invalid="ignore"):
        x.log()
    assert len(tape) == 1 and tape._vals.pos == pos
    y = (x * x).sqrt()
    assert tape.backward(y.sum())
    z = tape.param(np.array([0.0]))
    with np.errstate(divide="ignore"), pytest.raises(tg.NonFiniteError, match=r"^param \(node \d+\): first "
                                                                              r"non-finite grad"):
        tape.backward(z.sqrt().sum())
    soft = tg.Tape(check_finite=True, on_error="poison")
    w = soft.param(np.array([0.0]))
    with np.errstate(divide="ignore"):
        assert soft.backward(w.sqrt().sum()) is False
    assert isinstance(soft.error, tg.NonFiniteError) and str(soft.error).startswith("param (node 0): first non-finite")


def test_poisoned_backward_returns_false_and_keeps_the_reason():
    soft = tg.Tape(on_error="poison")
    w = soft.param(np.ones(2))
    other = tg.Tape()
    assert soft.backward(other.param(np.ones(1)).sum()) is False
    assert isinstance(soft.error, tg.ForeignVarError) and str(soft.error).startswith("backward (node 1): argument "
                                                                                      "loss (node 1) belongs")
    soft = tg.Tape(on_error="poison")
    w = soft.param(np.ones(2))
    assert soft.backward(w.sum(), seed=np.ones(3)) is False
    assert isinstance(soft.error, tg.ShapeError) and str(soft.error) == ("backward (node 1): seed must have the loss's "
                                                                        "shape (), got (3,)")
    soft = tg.Tape(on_error="poison")
    k = soft.const_lazy((2,))
    assert soft.backward((soft.param(np.ones(2)) * k).sum()) is False
    assert isinstance(soft.error, tg.LazyValueError)


def test_reset_marks_at_both_ends_and_epochs_stay_distinct():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    tape.reset_to(1)                                # the end: nothing to drop
    assert len(tape) == 1 and np.array_equal(tape.value(w), [1.0, 1.0])
    m = tape.mark()
    stale = []
    for _ in range(3):
        v = w * 2.0                                 # node 1 in every episode
        tape.backward(v.sum())
        stale.append(v)
        tape.reset_to(m)
    v = w * 3.0
    for old in stale:                               # the same id, an earlier episode: refused
        with pytest.raises(tg.ForeignVarError, match="was dropped by reset_to"):
            tape.value(old)
    assert np.array_equal(tape.value(v), [3.0, 3.0])
    tape.reset_to(0)
    assert len(tape) == 0


def test_drop_consts_reports_the_bytes_it_frees():
    tape = tg.Tape()
    tape.const(np.ones(3))
    tape.const(np.ones((2, 2), np.float32))
    tape.param(np.ones(5))
    tape.mark()
    tape.const(np.ones(7))                          # lives in the episode arena: reused, not freed
    assert tape.drop_consts() == 3 * 8 + 4 * 8
    assert tape.drop_consts() == 0


def test_new_nodes_are_untouched_until_a_backward_reaches_them():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    assert not tape.touched(w)
    tape.backward((w * 2.0).sum())
    late = w * 5.0                                  # recorded after the pass
    fresh = tape.param(np.ones(3))
    assert tape.touched(w) and not tape.touched(late) and not tape.touched(fresh)
    assert np.array_equal(tape.grad(late), [0.0, 0.0]) and np.array_equal(tape.grad(fresh), np.zeros(3))


def test_episode_memory_comes_back_at_every_reset():
    """reset_to hands the value arena back to where the mark left it, and an op's forward scratch is
    returned right after the op: a long minibatch loop runs in constant memory."""
    tape = tg.Tape()
    w = tape.param(np.ones((4, 3)))
    m = tape.mark()
    at_mark = tape._vals.pos
    for _ in range(3):
        x = tape.const(np.full((2, 4), 0.5))
        y = (x @ w).sigmoid()                       # sigmoid takes forward scratch
        assert tape._tmp.pos == (0, 0)
        tape.backward(y.sum())
        tape.reset_to(m)
        assert tape._vals.pos == at_mark
