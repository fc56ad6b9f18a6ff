"""The registry's helpers called afresh (the registry itself is built once, at import): ``op`` registers,
``maximum_d`` builds max's balanced derivative, ``into`` writes a one-ufunc rule into scratch; and the
NumPy rules of the core ops return their contributions in scratch, allocating no array per call."""
import tracemalloc

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.replay import Scratch


def test_op_registers_the_entry_under_its_name_once():
    fwd = lambda a, b, s, out, ws: np.copyto(out, a)  # noqa: E731
    da = lambda g, out, a, b, s, ws: g  # noqa: E731
    try:
        entry = O.op("t_probe_copy", 1, O.same, fwd=fwd, da=da, kind="layout")
        assert O.OPS["t_probe_copy"] is entry
        assert (entry.name, entry.arity, entry.shape, entry.fwd, entry.da, entry.kind) == (
            "t_probe_copy", 1, O.same, fwd, da, "layout")
        assert (entry.inputs, entry.data) == ("f", False)      # inputs default to floats
        with pytest.raises(AssertionError, match="t_probe_copy"):
            O.op("t_probe_copy", 1, O.same, fwd=fwd, da=da)
    finally:
        O.OPS.pop("t_probe_copy", None)


def test_an_entry_declares_its_input_kinds_and_data_inputs_come_last():
    assert O.Op("t_probe_all", 3, O.same, inputs="fib").inputs == "fib"     # every kind at once
    e = O.Op("t_probe_take", 3, O.same, inputs="ffi")
    assert (e.inputs, e.data) == ("ffi", True)
    assert (O.Op("t_probe_mix", 2, O.same, inputs="fb").data, O.Op("t_probe_ff", 2, O.same, inputs="ff").data) == (
        True, False)
    for arity, kinds in ((2, "f"), (2, "fx"), (2, "fX"), (1, "fib"), (2, "fibx")):
        with pytest.raises(AssertionError, match=r"\('t_probe_bad', '" + kinds + r"'\)"):
            O.Op("t_probe_bad", arity, O.same, inputs=kinds)
    with pytest.raises(AssertionError, match="t_probe_3f: a third input is data"):
        O.Op("t_probe_3f", 3, O.same, inputs="fff")


def test_kept_buffers_are_for_ops_of_float_inputs_only():
    """Kept buffers (``Op.keep``) are passed where a data input would go: an op has one or the other."""
    keep = lambda a, s: (a,)  # noqa: E731
    assert O.Op("t_probe_keep1", 1, O.same, keep=keep).keep is keep
    assert O.Op("t_probe_keep2", 2, O.same, keep=keep).inputs == "ff"
    for arity, kinds in ((2, "fi"), (2, "fb"), (3, "ffi")):
        with pytest.raises(AssertionError, match="t_probe_keep: kept buffers take a data input's place"):
            O.Op("t_probe_keep", arity, O.same, inputs=kinds, keep=keep)


def test_maximum_derivative_is_one_where_x_wins_half_on_ties_zero_where_y_wins():
    ws = Scratch(np.float64)
    ws.begin(0)
    a, b = np.array([1.0, 3.0, 2.0, -0.0]), np.array([3.0, 3.0, 1.0, 0.0])
    g = np.array([2.0, 2.0, 2.0, 4.0])
    da = O.maximum_d(lambda a, b: a, lambda a, b: b)(g, None, a, b, None, ws)
    db = O.maximum_d(lambda a, b: b, lambda a, b: a)(g, None, a, b, None, ws)
    assert da.tolist() == [0.0, 1.0, 2.0, 2.0] and db.tolist() == [2.0, 1.0, 0.0, 2.0]
    assert da is ws.cache[0][0] and db is ws.cache[0][2]          # computed in scratch, not a fresh array


def test_into_runs_the_ufunc_into_a_fresh_scratch_buffer():
    ws = Scratch(np.float64)
    ws.begin(0)
    g, out, a = np.full(3, 2.0), np.zeros(3), np.array([1.0, -2.0, 4.0])
    seen = []
    rule = O.into(lambda g_, out_, a_, b_, s_, t: seen.append((g_, out_, a_, b_, s_)) or np.multiply(g_, a_, out=t))
    b = np.ones(3)
    r = rule(g, out, a, b, ("s",), ws)
    assert r.tolist() == [2.0, -4.0, 8.0] and r is ws.cache[0][0]
    assert seen == [(g, out, a, b, ("s",))]


BIG = (512, 512)   # 2 MiB per float64 array, 256 KiB per mask: one temporary of either is above the bound


def core_graph(tape):
    rng = np.random.default_rng(3)
    x = tape.param(rng.uniform(0.5, 1.5, BIG))
    w = tape.param(rng.standard_normal(BIG) * 0.05)
    y = tape.param(np.eye(BIG[1])[rng.integers(0, BIG[1], 256)])     # a param: cross-entropy's db runs too
    h = abs(x - 1.0) + x.square() + x ** 1.5 + (2.0 / x) + x.sigmoid() + (x - 1.0).relu()
    m = tg.maximum(h, x) @ w
    bm = tg.bmm(m.reshape((4, 128, 512)), w.reshape((4, 512, 128))).reshape((128, 512))
    s = tg.concat([m[:128, :], bm], axis=0)
    return tg.softmax_cross_entropy(s, y) + (s.softmax(axis=1) * s).sum() + (s.log_softmax(axis=1) * y).sum()


def test_the_core_rules_allocate_no_array_per_episode():
    """A NumPy replay of abs, square, pow, rdivs, sigmoid, maximum, matmul, bmm, slices, concat, softmax
    and cross-entropy, forward and backward: after two episodes, a third stays within NumPy's ufunc
    buffer plus 128 KiB of transient Python objects; any rule computing into a fresh array instead of
    its scratch adds a temporary of 256 KiB (a mask) or more."""
    tape = tg.Tape()
    loss = core_graph(tape)
    prog = tg.capture(tape, loss)
    prog.forward(); prog.backward(); prog.forward(); prog.backward()  # noqa: E702
    bound = np.getbufsize() * 8 + 131072
    assert BIG[0] * BIG[1] > bound   # one bool mask
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        prog.forward()
        prog.backward()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < bound, peak - base


def test_mean_over_some_axes_divides_by_their_sizes_only():
    tape = tg.Tape()
    x = tape.param(np.arange(24.0).reshape(2, 3, 4))
    y = x.mean(axis=(0, 2))
    tape.backward(y.sum())
    assert np.array_equal(tape.value(y), np.arange(24.0).reshape(2, 3, 4).mean(axis=(0, 2)))
    assert np.array_equal(tape.grad(x), np.full((2, 3, 4), 1 / 8))


def test_gradcheck_fails_a_gradient_that_is_not_finite():
    """sqrt at 0: the tape's gradient is inf, the finite difference NaN; max() used to drop the NaN error."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = tg.gradcheck(lambda t, x: x.sqrt().sum(), np.array([0.0, 1.0]))
    assert not r.ok and np.isnan(r.errors[0])
