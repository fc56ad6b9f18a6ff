"""Every registry op: VJP vs central finite differences, exact identities, numerical stability."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import tapegrad as tg
from tapegrad import ops as O

from op_cases import call, floats, make

OPS = [op for op in O.OPS.values() if op.arity]
CASES = [(op, case) for op in OPS for case in op.cases]
DERIVED = [(op, case) for op, case in CASES if op.derivative]   # with_grad's backward is not its derivative


def projected(op, arrays, s, w):
    """f(float inputs) = Σ w · op(inputs): a random projection makes every output element count; data
    inputs (indices, masks) are held fixed as constants."""
    def fn(tape, *xs):
        it = iter(xs)
        vs = [next(it) if kind == "f" else tape.const(x) for kind, x in zip(op.inputs, arrays)]
        a, b, c = (vs + [None, None])[:3]
        out = tape.apply(op, a, b, s, c)
        return (out * tape.const(w)).sum()
    return fn


@pytest.mark.parametrize("op,case", DERIVED, ids=[f"{op.name}-{i}" for op in OPS if op.derivative
                                                  for i in range(len(op.cases))])
def test_vjp_matches_finite_differences(op, case):
    rng = np.random.default_rng(7)
    arrays, s = make(op, case, rng)
    out_shape = call(op, op.shape, [x.shape for x in arrays], s)
    w = rng.standard_normal(out_shape)
    report = tg.gradcheck(projected(op, arrays, s, w), *floats(op, arrays), directions=4)
    assert report.ok, f"{op.name} {case}: {report}"


@pytest.mark.parametrize("op", [op for op in OPS if op.kind == "elementwise" and op.arity == 2 and op.inputs == "ff"],
                         ids=lambda o: o.name)
@settings(max_examples=15, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, min_side=1, max_side=3),
       seed=st.integers(0, 2**31 - 1))
def test_broadcasting_vjp_matches_finite_differences(op, shapes, seed):
    rng = np.random.default_rng(seed)
    (sa, sb), out_shape = shapes
    # the domains keep every kink out of the step's reach (ops.MARGIN): maximum's a and b lie on two
    # interleaved grids (spread, between) that never meet, atan2's a off its branch cut (away0)
    a, b = op.domain[0](rng, sa), op.domain[1](rng, sb)
    w = rng.standard_normal(out_shape)
    report = tg.gradcheck(projected(op, (a, b), None, w), a, b, directions=3)
    assert report.ok, f"{op.name} {sa} {sb}: {report}"


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_registry_entry_is_complete(op):
    assert op.fwd and op.ref and op.cases and len(op.domain) == op.arity
    assert (op.da is not None) == (op.inputs[0] in "fn")
    assert (op.db is not None) == (op.arity >= 2 and op.inputs[1] in "fn")
    assert op.tier in O.TIERS
    if op.kind == "elementwise":
        assert op.c_fwd and op.c_da and (op.arity == 1 or op.c_db), f"{op.name}: elementwise ops carry C forms"


# ── identities exact to the bit ──────────────────────────────────────────────

def grads_of(build, *arrays):
    tape = tg.Tape()
    xs = [tape.param(a) for a in arrays]
    assert tape.backward(build(*xs))
    return [np.array(tape.grad(x)) for x in xs]


def test_sum_of_squares_gradient_is_exactly_2x():
    x = np.random.default_rng(0).standard_normal(37)
    (g,) = grads_of(lambda x: (x * x).sum(), x)
    assert np.array_equal(g, 2 * x)
    (g,) = grads_of(lambda x: x.square().sum(), x)
    assert np.array_equal(g, 2 * x)
    (g,) = grads_of(lambda x: (x ** 2).sum(), x)
    assert np.array_equal(g, 2 * x)


def test_mean_gradient_is_exactly_one_over_n():
    x = np.random.default_rng(1).standard_normal((7, 3))
    (g,) = grads_of(lambda x: x.mean(), x)
    assert np.array_equal(g, np.full((7, 3), 1.0 / 21))


def test_bias_gradient_counts_rows_exactly():
    x = np.random.default_rng(2).standard_normal((9, 4))
    _, gb = grads_of(lambda x, b: (x + b).sum(), x, np.zeros(4))
    assert np.array_equal(gb, np.full(4, 9.0))


def test_unary_gradients_reuse_the_forward_value_exactly():
    x = np.random.default_rng(3).standard_normal(11)
    (g,) = grads_of(lambda x: x.exp().sum(), x)
    assert np.array_equal(g, np.exp(x))
    (g,) = grads_of(lambda x: x.tanh().sum(), x)
    assert np.array_equal(g, 1.0 - np.tanh(x) * np.tanh(x))
    (g,) = grads_of(lambda x: x.relu().sum(), x)
    assert np.array_equal(g, (x > 0).astype(float))
    (g,) = grads_of(lambda x: x.log().sum(), np.abs(x) + 0.5)
    assert np.array_equal(g, 1.0 / (np.abs(x) + 0.5))


def test_fan_out_sums_contributions():
    x = np.array([0.5, -1.5, 2.0])
    (g,) = grads_of(lambda x: (x * x + x).sum(), x)
    assert np.array_equal(g, (x + x) + 1.0)


# ── numerical stability ──────────────────────────────────────────────────────

def test_saturating_unaries_are_finite_and_silent_at_extremes():
    big = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise"):
        warnings.simplefilter("error")
        tape = tg.Tape()
        x = tape.param(big)
        s, t = x.sigmoid(), x.tanh()
        sm = x.softmax()
        lsm = x.log_softmax()
        xe = tg.softmax_cross_entropy(x.reshape(1, 5), np.eye(5)[[0]])
        assert tape.backward((s + t + sm + lsm).sum() + xe)
        assert np.isfinite(tape.grad(x)).all()
    sig = tape.value(s)
    assert sig[0] == 0.0 and sig[2] == 0.5 and sig[4] == 1.0
    np.testing.assert_allclose(sig[[1, 3]], [1.0 / (1.0 + np.exp(50.0)), 1.0], rtol=1e-15)
    assert np.array_equal(tape.value(t), [-1.0, -1.0, 0.0, 1.0, 1.0])
    assert np.array_equal(tape.value(sm), [0.0, 0.0, 0.0, 0.0, 1.0])
    assert tape.value(lsm)[-1] == 0.0 and tape.value(lsm)[0] == -2000.0
    assert float(tape.value(xe)) == 2000.0


def test_sigmoid_matches_the_naive_formula_where_that_is_safe():
    x = np.linspace(-30, 30, 601)
    tape = tg.Tape()
    got = tape.value(tape.param(x).sigmoid())
    np.testing.assert_allclose(got, 1.0 / (1.0 + np.exp(-x)), rtol=4e-16, atol=0)
