"""The scan family: NumPy's sequential orders, ties (sort, cummax, min), prod with zeros, logsumexp at
extremes, var/std against jnp, bad input, and native programs bit-identical to the tape.

The registry suites (test_ops, test_oracle_ops at rtol 1e-12, test_native ==/within tier, test_fuse,
test_emit) cover every op of the family already; this file tests what they cannot."""
import functools
import math
import operator

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tapegrad as tg
from tapegrad import ops as O

EPS = np.finfo(np.float64).eps


def value_and_grad(f, x):
    tape = tg.Tape()
    v = tape.param(np.asarray(x, np.float64))
    y = f(v)
    assert tape.backward(y.sum())
    return tape.value(y), tape.grad(v)


# ── NumPy's orders, which the native kernels repeat ─────────────────────────

def test_numpy_accumulations_and_the_product_reduction_are_sequential():
    """np.add.accumulate, np.multiply.accumulate and np.multiply.reduce add/multiply left to right (unlike
    np.add.reduce, which is pairwise): on 1000 values the bits equal a Python left fold."""
    x = np.random.default_rng(0).uniform(0.5, 1.5, 1000)
    assert np.cumsum(x)[-1] == functools.reduce(operator.add, x.tolist())
    assert np.cumprod(x)[-1] == functools.reduce(operator.mul, x.tolist())
    assert np.multiply.reduce(x) == functools.reduce(operator.mul, x.tolist())
    assert np.add.reduce(x) != functools.reduce(operator.add, x.tolist())   # pairwise: another order


def test_cumsum_and_cumprod_are_left_folds_forward_and_reversed():
    x = np.random.default_rng(1).uniform(0.5, 1.5, 300)
    for f, fold in ((tg.cumsum, operator.add), (tg.cumprod, operator.mul)):
        fwd, _ = value_and_grad(lambda v: f(v, 0), x)
        rev, _ = value_and_grad(lambda v: f(v, 0, reverse=True), x)
        assert fwd[-1] == functools.reduce(fold, x.tolist())
        assert rev[0] == functools.reduce(fold, x[::-1].tolist())


# ── prod with zeros ──────────────────────────────────────────────────────────

@pytest.mark.parametrize("x", [[2.0, 0.0, 3.0, 4.0], [0.0, 5.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.5, -2.0, 0.5, 3.0]])
def test_prod_gradient_with_zeros_is_the_product_of_the_others(x):
    x = np.array(x)
    v, g = value_and_grad(tg.prod, x)
    assert v == np.prod(x)
    want = np.array([np.prod(np.delete(x, i)) for i in range(len(x))])
    assert np.array_equal(g, want)


def test_prod_over_axes_with_zeros_and_cumprod_with_zeros():
    x = np.array([[1.0, 0.0, 2.0], [3.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
    _, g = value_and_grad(lambda v: v.prod(axis=0), x)
    assert np.array_equal(g, [[0.0, 0.0, 0.0], [0.0, 0.0, 10.0], [3.0, 0.0, 0.0]])
    _, g = value_and_grad(lambda v: v.prod(axis=1), x)
    assert np.array_equal(g, [[0.0, 2.0, 0.0], [0.0, 0.0, 12.0], [0.0, 0.0, 0.0]])
    # cumprod of [2, 0, 3]: out = [2, 0, 0]; d/dx0 = 1 + x1 + x1·x2, d/dx1 = x0 + x0·x2, d/dx2 = x0·x1
    _, g = value_and_grad(lambda v: tg.cumprod(v, 0), np.array([2.0, 0.0, 3.0]))
    assert np.array_equal(g, [1.0, 8.0, 0.0])


# ── ties ─────────────────────────────────────────────────────────────────────

def test_sort_ties_route_gradients_through_the_stable_argsort():
    """Of tied inputs, the earlier receives the earlier output's gradient (jax.grad of jnp.sort agrees:
    its sort is stable too)."""
    x = np.array([2.0, 1.0, 2.0, 1.0, 3.0])
    w = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    v, g = value_and_grad(lambda t: (tg.sort(t) * w).sum(), x)
    assert np.array_equal(g, [30.0, 10.0, 40.0, 20.0, 50.0])
    y, _ = value_and_grad(tg.sort, np.array([np.nan, 1.0, -np.inf, 0.0, -0.0]))
    assert np.array_equal(y, [-np.inf, 0.0, -0.0, 1.0, np.nan], equal_nan=True)
    assert np.signbit(y[2]) and not np.signbit(y[1])   # stable: 0.0 came first


def brute_cummax_grad(x, g):
    """Each g_k shared equally by the j <= k with x_j == max(x_0..x_k)."""
    d = np.zeros_like(x)
    for k in range(len(x)):
        m = x[:k + 1].max()
        ties = [j for j in range(k + 1) if x[j] == m]
        for j in ties:
            d[j] += g[k] / len(ties)
    return d


def test_cummax_ties_share_the_gradient_equally_forward_and_reversed():
    rng = np.random.default_rng(2)
    for _ in range(20):
        x = rng.integers(0, 4, 9).astype(float)
        g = rng.standard_normal(9)
        tape = tg.Tape()
        v = tape.param(x)
        assert tape.backward(tg.cummax(v, 0), seed=g)
        np.testing.assert_allclose(tape.grad(v), brute_cummax_grad(x, g), rtol=1e-14, atol=1e-15)
        tape2 = tg.Tape()
        v2 = tape2.param(x)
        assert tape2.backward(tg.cummax(v2, 0, reverse=True), seed=g)
        np.testing.assert_allclose(tape2.grad(v2), brute_cummax_grad(x[::-1], g[::-1])[::-1], rtol=1e-14,
                                   atol=1e-15)


def test_min_ties_share_the_gradient_equally():
    _, g = value_and_grad(tg.min, np.array([1.0, 0.0, 0.0, 2.0]))
    assert np.array_equal(g, [0.0, 0.5, 0.5, 0.0])
    _, g = value_and_grad(lambda v: v.min(axis=1, keepdims=True), np.array([[3.0, 1.0, 1.0], [0.0, 2.0, 5.0]]))
    assert np.array_equal(g, [[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])


# ── logsumexp ────────────────────────────────────────────────────────────────

def test_logsumexp_is_stable_at_extremes():
    with np.errstate(over="raise", invalid="raise"):
        v, g = value_and_grad(lambda t: tg.logsumexp(t, axis=1), np.array([[1000.0, 1000.0], [-1000.0, -1000.0],
                                                                             [-np.inf, 0.0]]))
    assert np.array_equal(v, [1000.0 + math.log(2.0), -1000.0 + math.log(2.0), 0.0])
    # exp(a − out) carries out's rounding at 1000 (one ulp there is 1.1e-13) into the gradient
    assert np.all(np.abs(g - [[0.5, 0.5], [0.5, 0.5], [0.0, 1.0]]) <= np.spacing(1000.0)) and g[2, 0] == 0.0


def test_logsumexp_keepdims_and_all_axes_match_the_direct_formula():
    x = np.random.default_rng(3).standard_normal((3, 4))
    v, g = value_and_grad(lambda t: tg.logsumexp(t, axis=0, keepdims=True), x)
    assert v.shape == (1, 4)
    np.testing.assert_allclose(v, np.log(np.exp(x).sum(axis=0, keepdims=True)), rtol=4 * EPS)
    np.testing.assert_allclose(g, np.exp(x) / np.exp(x).sum(axis=0), rtol=8 * EPS)
    v, _ = value_and_grad(tg.logsumexp, x)
    assert v.shape == () and abs(v - np.log(np.exp(x).sum())) <= 4 * EPS * abs(v)


# ── var / std against jnp ────────────────────────────────────────────────────

MOMENTS = [((5,), None, 0), ((4, 6), 1, 1), ((3, 4, 5), (0, 2), 0), ((6, 3), 0, 2), ((2, 3), -1, 1)]


@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("shape,axis,ddof", MOMENTS)
def test_var_std_match_jnp_values_and_gradients(name, shape, axis, ddof):
    """rtol 1e-12 on random data (XLA sums in another order than NumPy's pairwise sum)."""
    interop = pytest.importorskip("interop")
    jax, jnp = interop.jax, interop.jnp
    x = np.random.default_rng(4).standard_normal(shape)
    w = np.random.default_rng(5).standard_normal(np.asarray(getattr(np, name)(x, axis=axis, ddof=ddof)).shape)
    tape = tg.Tape()
    v = tape.param(x)
    y = getattr(tg, name)(v, axis, ddof=ddof)
    assert tape.backward((y * tape.const(w)).sum())
    want = getattr(jnp, name)(x, axis=axis, ddof=ddof)
    gwant = jax.grad(lambda z: (getattr(jnp, name)(z, axis=axis, ddof=ddof) * w).sum())(x)
    for got, ref in ((tape.value(y), want), (tape.grad(v), gwant)):
        ref = np.asarray(ref)
        assert got.shape == ref.shape and np.max(np.abs(got - ref)) <= 1e-12 * np.max(np.abs(ref))


@pytest.mark.parametrize("name", ["var", "std"])
def test_var_std_equal_jnp_bit_for_bit_where_every_sum_is_exact(name):
    """Integer data over power-of-two counts: every sum of the forward is exact in any order, so the other
    steps (mean's division, centring, squaring, the division by N − ddof, sqrt) round as JAX's: values ==.
    var's gradient with ddof = 0 sums dyadic numbers, exact too: ==. With ddof > 0 the gradient sums
    g/(N − ddof) terms, which NumPy adds pairwise and XLA in another order; std's VJP divides g by 2·out where
    JAX multiplies it by 0.5/out: within 4 ulp of the largest element there."""
    interop = pytest.importorskip("interop")
    jax, jnp = interop.jax, interop.jnp
    x = np.random.default_rng(6).integers(-20, 20, (4, 8)).astype(float)
    for axis, ddof in ((1, 0), (1, 1), (None, 0), (0, 0), (None, 1)):
        tape = tg.Tape()
        v = tape.param(x)
        y = getattr(tg, name)(v, axis, ddof=ddof)
        assert tape.backward(y.sum())
        want = np.asarray(getattr(jnp, name)(x, axis=axis, ddof=ddof))
        gwant = np.asarray(jax.grad(lambda z: getattr(jnp, name)(z, axis=axis, ddof=ddof).sum())(x))
        assert np.array_equal(tape.value(y), want), (axis, ddof)
        if name == "var" and ddof == 0:
            assert np.array_equal(tape.grad(v), gwant), (axis, ddof)
        else:
            assert np.max(np.abs(tape.grad(v) - gwant)) <= 4 * EPS * np.max(np.abs(gwant)), (axis, ddof)


def test_var_matches_numpy_and_std_is_its_root():
    x = np.random.default_rng(7).standard_normal((4, 5))
    for axis, ddof, keep in ((None, 0, False), (0, 1, True), (1, 2, False)):
        tape = tg.Tape()
        v = tape.param(x)
        var, std = tg.var(v, axis, ddof, keep), v.std(axis, ddof, keep)
        np.testing.assert_allclose(tape.value(var), np.var(x, axis=axis, ddof=ddof, keepdims=keep), rtol=1e-14)
        assert np.array_equal(tape.value(std), np.sqrt(tape.value(var)))


# ── bad input ────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("call,message", [
    (lambda v: tg.cumsum(v, 2), r"^cumsum \(node 1\): axis 2 is out of range for an input of shape \(3, 4\) "
                                r"\(ndim 2\)$"),
    (lambda v: tg.cummax(v, -3), r"^cummax \(node 1\): axis -3 is out of range for an input of shape \(3, 4\) "
                                 r"\(ndim 2\)$"),
    (lambda v: tg.cumprod(v, 0, reverse="yes"), r"^cumprod \(node 1\): reverse must be True or False, got 'yes'$"),
    (lambda v: tg.cumsum(v, 1.0), r"^cumsum \(node 1\): axis must be an int, got 1.0$"),
    (lambda v: tg.sort(v, True), r"^sort \(node 1\): axis must be an int, got True$"),
    (lambda v: tg.sort(v, 5), r"^sort \(node 1\): axis 5 is out of range for an input of shape \(3, 4\) \(ndim 2\)$"),
    (lambda v: tg.min(v, axis=(0, 0)), r"^min \(node 1\): axis \(0, 0\) repeats an axis$"),
    (lambda v: tg.prod(v, axis=7), r"^prod \(node 1\): axis 7 is out of range for an input of shape \(3, 4\) "
                                   r"\(ndim 2\)$"),
    (lambda v: tg.logsumexp(v, axis=-5), r"^logsumexp \(node 1\): axis -5 is out of range"),
    (lambda v: tg.var(v, 1, ddof=4), r"^var \(node 1\): ddof must be an int in \[0, 4\) for 4 reduced elements of "
                                     r"shape \(3, 4\), got 4$"),
    (lambda v: tg.std(v, None, ddof=-1), r"^std \(node 1\): ddof must be an int in \[0, 12\) for 12 reduced "
                                         r"elements of shape \(3, 4\), got -1$"),
    (lambda v: tg.var(v, 3), r"^var \(node 1\): axis 3 is out of range for an input of shape \(3, 4\) \(ndim 2\)$"),
])
def test_bad_arguments_name_the_op_and_leave_the_tape_unchanged(call, message):
    tape = tg.Tape()
    v = tape.param(np.ones((3, 4)))
    tg.cumsum(v, 1), tg.sort(v, 1)           # valid calls first: their shapes are memoised per static operand
    tape.reset_to(1)
    with pytest.raises(tg.ShapeError, match=message):
        call(v)
    assert len(tape) == 1


def test_poison_mode_keeps_the_first_reason():
    tape = tg.Tape(on_error="poison")
    v = tape.param(np.ones((3, 4)))
    bad = tg.cumsum(v, 9)
    assert not tape.ok and "cumsum (node 1): axis 9" in str(tape.error)
    assert tg.sort(bad).id < 0 and len(tape) == 1


# ── captured programs ────────────────────────────────────────────────────────

def scan_model(tape, w, x):
    """Every scan-family op in one small graph (a sort-based ranking loss, say)."""
    h = x @ w
    s = tg.sort(h, axis=1)
    c = tg.cumsum(s, 1) + tg.cumsum(h, 0, reverse=True)
    p = tg.cumprod((h * 0.1).tanh() + 1.0, 1, reverse=True)
    m = tg.cummax(h, 1) + tg.min(h, axis=1, keepdims=True)
    q = (p * 0.5 + 1.0).prod(axis=0)
    return (c * m).mean() + q.sum() + tg.var(h, 1, ddof=1).mean() + tg.logsumexp(h, axis=1).sum()


def test_native_scan_program_equals_the_tape_and_the_numpy_replay_bit_for_bit():
    """sort, cumsum, cumprod, cummax, min and prod are exact-tier: the native replay of the exact part ==
    the tape; the whole graph (with tanh and logsumexp: libm) is fused == unfused and within 1e-13."""
    rng = np.random.default_rng(8)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((4, 6)))
    x = tape.const(rng.standard_normal((5, 4)))
    h = x @ w
    exact = (tg.cumsum(tg.sort(h, axis=1), 1) * tg.cummax(h, 0, reverse=True)).sum() + \
        tg.cumprod(h, 1, reverse=True).sum() + tg.min(h, axis=0).sum() + h.prod(axis=1).sum()
    tape.backward(exact)
    prog = tg.capture(tape, exact, backend="native")
    prog.forward()
    prog.backward()
    assert prog.loss() == tape.value(exact)
    assert np.array_equal(prog.grad(w), tape.grad(w))
    tape2 = tg.Tape()
    w2 = tape2.param(rng.standard_normal((4, 6)))
    loss = scan_model(tape2, w2, tape2.const(rng.standard_normal((5, 4))))
    tape2.backward(loss)
    progs = [tg.capture(tape2, loss, backend="native", fuse=f) for f in (False, True)]
    for p in progs:
        p.forward()
        p.backward()
    assert np.array_equal(progs[0].grad(w2), progs[1].grad(w2))
    assert abs(progs[1].loss() - tape2.value(loss)) <= 1e-13 * abs(tape2.value(loss))
    np.testing.assert_allclose(progs[1].grad(w2), tape2.grad(w2), rtol=1e-13, atol=1e-13)


def test_native_training_episodes_with_scan_ops_equal_the_numpy_replay():
    rng = np.random.default_rng(9)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((4, 6)) * 0.5)
    x = tape.const(rng.standard_normal((5, 4)))
    h = x @ w
    loss = (tg.cumsum(tg.sort(h, axis=1), 1) * tg.cummax(h, 0)).mean() + (h * 0.5).prod(axis=0).sum() + \
        tg.min(h, axis=1).sum()
    progs = []
    for backend in ("numpy", "native"):
        p = tg.capture(tape, loss, backend=backend)
        p.attach(tg.SGD(0.01))
        progs.append(p)
    batches = [rng.standard_normal((5, 4)) for _ in range(4)]
    got = [[p.episode({x: b}) for b in batches] for p in progs]
    assert got[0] == got[1]
    assert np.array_equal(progs[0].value(w), progs[1].value(w))


def test_float32_native_scan_program_equals_the_float32_tape():
    rng = np.random.default_rng(10)
    tape = tg.Tape(np.float32)
    a = tape.param(rng.standard_normal((4, 5)).astype(np.float32))
    loss = (tg.cumsum(a, 1) * tg.sort(a, 0)).sum() + tg.cumprod(a, 0, reverse=True).sum() + \
        tg.cummax(a, 1).sum() + a.prod(axis=1).sum() + a.min(axis=0).sum()
    b = tape.param(rng.standard_normal((4, 5)).astype(np.float32))
    lse = tg.logsumexp(b, axis=1)
    tape.backward(loss + lse.sum())
    prog = tg.capture(tape, loss, backend="native", dtype="float32")
    prog.forward()
    prog.backward()
    assert prog.loss() == tape.value(loss)
    assert np.array_equal(prog.grad(a), tape.grad(a))
    # logsumexp calls expf/logf (libm tier): within float32 rounding
    prog = tg.capture(tape, lse.sum(), backend="native", dtype="float32")
    prog.forward()
    prog.backward()
    f32 = np.finfo(np.float32).eps
    assert np.all(np.abs(prog.value(lse) - tape.value(lse)) <= 8 * f32 * np.maximum(1.0, np.abs(tape.value(lse))))
    assert np.all(np.abs(prog.grad(b) - tape.grad(b)) <= 8 * f32)


def test_sort_of_a_long_line_with_many_ties_equals_numpy_natively():
    """The merge sort's stability on a line longer than any case (and NaN last), forward and backward."""
    rng = np.random.default_rng(11)
    xs = rng.integers(0, 7, (3, 300)).astype(float)
    xs[1, ::17] = np.nan
    tape = tg.Tape()
    v = tape.param(xs)
    y = tg.sort(v, axis=1)
    g = tape.const(rng.standard_normal((3, 300)))
    loss = (y * g).sum()
    tape.backward(loss)
    assert np.array_equal(tape.value(y), np.sort(xs, axis=1), equal_nan=True)
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.value(y), tape.value(y), equal_nan=True)
    assert np.array_equal(prog.grad(v), tape.grad(v))


# ── random shapes, axes and directions ───────────────────────────────────────

SCANS = ("cumsum", "cumprod", "cummax", "sort")
REDUCTIONS = ("min", "prod", "logsumexp")


def random_call(name, rng):
    """(function of a Var, input array) for a random shape, axis and direction (or axes and keepdims)."""
    shape = tuple(int(n) for n in rng.integers(1, 5, rng.integers(1, 4)))
    x = O.spread(rng, shape) if name in ("cummax", "sort", "min") else rng.uniform(0.5, 1.5, shape) * \
        rng.choice([-1.0, 1.0], shape)
    if name in SCANS:
        axis = int(rng.integers(-len(shape), len(shape)))
        if name == "sort":
            return (lambda v: tg.sort(v, axis)), x
        reverse = bool(rng.integers(0, 2))
        return (lambda v: getattr(tg, name)(v, axis, reverse=reverse)), x
    axes = tuple(int(k) for k in np.flatnonzero(rng.integers(0, 2, len(shape)))) or None
    keep = bool(rng.integers(0, 2))
    return (lambda v: getattr(tg, name)(v, axis=axes, keepdims=keep)), x


def fd_step(name, x):
    """The central-difference step for ``random_call(name)``'s input ``x``: the difference is exact but for
    rounding, and the rounding far below gradcheck's atol (1e-9).

    sort, cummax and min are linear between ties. Their input is ``spread``: any two values at least
    ``O.MARGIN[O.spread]`` apart (checked). With a quarter of the smallest gap as the step, a unit direction
    moves no difference of two entries by more than √2/4 of it: no tie is crossed, the function is linear
    on the whole stencil, and the central difference is exact up to rounding, eps·|f|/step (~1e-13).
    cumsum is linear everywhere: the same step. cumprod, prod and logsumexp are smooth: 1e-5 ≈ eps^(1/3),
    where a central difference's truncation (step²·|f‴|/6) and rounding (eps·|f|/step) balance for
    |f| ~ 10. (At gradcheck's default 1e-6 the rounding alone reaches ~1e-9 absolute once |f| ~ 30-90;
    with a directional derivative of 1e-4 that failed sort at seed 13, and cummax, cumprod and logsumexp
    at about one seed in 2,000-20,000, with no tie anywhere near.)"""
    if name == "cumsum":
        return O.MARGIN[O.spread] / 4
    if name in ("sort", "cummax", "min"):
        gaps = np.diff(np.sort(x, axis=None))
        gap = float(gaps.min()) if gaps.size else O.MARGIN[O.spread]
        assert gap >= O.MARGIN[O.spread] * (1 - 1e-9), (name, gap)
        return gap / 4
    return 1e-5


@pytest.mark.parametrize("name", SCANS + REDUCTIONS)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_shapes_vjp_matches_finite_differences(name, seed):
    rng = np.random.default_rng(seed)
    f, x = random_call(name, rng)
    w = rng.standard_normal(np.shape(value_and_grad(f, x)[0]))
    report = tg.gradcheck(lambda tape, v: (f(v) * tape.const(w)).sum(), x, directions=3, eps=fd_step(name, x))
    assert report.ok, (name, x.shape, report)


def test_random_shapes_replay_natively_bit_for_bit():
    """Forty random scans and reductions in one program (one build): the exact-tier ones == the tape."""
    rng = np.random.default_rng(12)
    tape = tg.Tape()
    loss, outs = None, []
    for k in range(40):
        name = (SCANS + ("min", "prod"))[k % 6]
        f, x = random_call(name, rng)
        v = tape.param(x)
        y = f(v)
        outs.append((v, y))
        term = (y * tape.const(rng.standard_normal(y.shape))).sum()
        loss = term if loss is None else loss + term
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    for v, y in outs:
        assert np.array_equal(prog.value(y), tape.value(y))
        assert np.array_equal(prog.grad(v), tape.grad(v))


def test_float32_sort_of_a_line_beyond_2_to_the_24_is_refused_by_name():
    """The native argsort keeps indices as reals: a float32 program refuses lines it could not index
    exactly (checked on the printer itself: such an array is 64 MiB)."""
    from tapegrad.native import expr, kernels
    n = kernels.Node(None, "sort", 3, 2, -1, 0, "v2", None, "v3", "g3", (2 ** 24 + 1,), None, (2 ** 24 + 1,),
                     None, 2, None, False, expr.C32)
    with pytest.raises(tg.TapeError, match=r"^sort \(node 3\): a float32 program sorts lines of at most 2\*\*24 "
                                           r"elements \(its argsort indices are floats\); got 16777217; capture in "
                                           r"float64$"):
        kernels.FORWARD["sort"](n)
    assert kernels.FORWARD["sort"](n._replace(d=expr.C64))[0].startswith("tg_sort(0, v2, v2, v3,")
