"""The oracle on operands JAX accepts and the tape did not: a bool or integer operand of ``dot_general`` (mixed
dtypes with a ``preferred_element_type``: a matmul of a mask, of an integer one-hot matrix), promoted as
JAX promotes it (it raised ``ArgumentError``), negative convolution padding, a crop (``ShapeError``), and the
primitives ``tile``, ``scatter-max``/``-min``, ``cumlogsumexp`` and the special functions ``erf_inv``,
``bessel_i0e``/``i1e``, ``polygamma``, ``igamma``/``igammac``, ``eigh`` and ``psum`` over a ``vmap`` axis
(``UnsupportedPrimitiveError``)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import interop  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))


def _fd(f, w, eps=1e-6):
    """Central differences of f at w, element by element (the reference independent of both AD sides)."""
    w = np.asarray(w)
    g = np.zeros_like(w)
    for i in np.ndindex(w.shape):
        d = np.zeros_like(w)
        d[i] = eps
        g[i] = (float(f(jnp.asarray(w + d))) - float(f(jnp.asarray(w - d)))) / (2 * eps)
    return g


@pytest.mark.parametrize("data", ["bool mask", "int8 one-hot"])
def test_a_product_of_data_and_floats_replays_and_matches_finite_differences(data):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        W = jnp.asarray(rng.standard_normal((5, 3)))
        x = jnp.asarray(rng.standard_normal((4, 5)))
        labels = jnp.asarray(rng.integers(0, 5, 4))

        def f(W, x, labels):
            m = x > 0.2 if data == "bool mask" else jax.nn.one_hot(labels, 5, dtype=jnp.int8)
            h = lax.dot_general(m, W, DIMS, preferred_element_type=jnp.float64)
            return jnp.sum(jnp.tanh(h * (x @ W)))

        report = interop.check_grads(f, W, x, labels, argnums=0)
        assert report.ok, str(report)   # within check_grads' rtol of 1e-12 against jax.grad
        want = jax.grad(f)(W, x, labels)
        fd = _fd(lambda w: f(w, x, labels), W)
        np.testing.assert_allclose(np.asarray(want), fd, rtol=0, atol=1e-7)


def _conv(x, w, stride, padding="VALID", lhs_dilation=None):
    return lax.conv_general_dilated(x, w, stride, padding, lhs_dilation=lhs_dilation,
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))


def test_negative_convolution_padding_crops_as_jax_s_transpose_of_a_strided_conv_asks():
    """The norm of a strided conv's weight gradient (as per-example clipping in DP-SGD computes it):
    differentiating it again, JAX transposes the weight gradient into a conv with padding ((0, -1), (0, -1))."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((1, 2, 6, 6)))
        w = jnp.asarray(rng.standard_normal((2, 2, 2, 2)))

        def penalty(w, x):
            gw = jax.grad(lambda w: jnp.sum(jnp.tanh(_conv(x, w, (3, 3)))))(w)
            return jnp.sum(gw ** 2)

        pads = [e.params["padding"] for e in jax.make_jaxpr(jax.grad(penalty))(w, x).jaxpr.eqns
                if e.primitive.name == "conv_general_dilated"]
        assert any(lo < 0 or hi < 0 for p in pads for lo, hi in p)   # the case this test is about
        report = interop.check_grads(lambda w, x: jnp.sum(jnp.sin(jax.grad(penalty)(w, x))), w, x, argnums=0)
        assert report.ok, str(report)


@pytest.mark.parametrize("padding", [((-1, 2), (1, -2)), ((-3, -1), (0, -4))])
def test_negative_padding_of_an_lhs_dilated_conv_matches_jax_and_finite_differences(padding):
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((2, 3, 5, 4)))
        w = jnp.asarray(rng.standard_normal((2, 3, 2, 3)))

        def f(x, w):
            return jnp.sum(jnp.sin(_conv(x, w, (1, 1), padding, lhs_dilation=(2, 3))))

        report = interop.check_grads(f, x, w)
        assert report.ok, str(report)
        fd = _fd(lambda w_: f(x, w_), w)
        np.testing.assert_allclose(np.asarray(jax.grad(f, argnums=1)(x, w)), fd, rtol=0, atol=1e-7)


@pytest.mark.parametrize("reps", [(2, 3), (3,), (2, 1, 2)])
def test_tile_replays_as_a_broadcast_and_matches_finite_differences(reps):
    """``jnp.tile`` is a primitive of its own since JAX 0.10 (``tile[reps]``)."""
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((2, 3)))
        c = jnp.asarray(rng.standard_normal(np.tile(np.zeros((2, 3)), reps).shape))

        def f(x):
            return jnp.sum(jnp.sin(jnp.tile(x, reps)) * c)

        assert "tile" in {e.primitive.name for e in jax.make_jaxpr(f)(x).jaxpr.eqns}
        report = interop.check_grads(f, x)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), _fd(f, x), rtol=0, atol=1e-7)


def test_segment_max_and_min_replay_scatter_extrema_with_jax_s_tie_split():
    """``jax.ops.segment_max``/``segment_min`` (graph networks' pooling) are scatter-max/-min; ties share
    the gradient as JAX's rule splits it (the operand's initial value counts as a candidate)."""
    rng = np.random.default_rng(4)
    seg = jnp.array([0, 0, 1, 2, 2, 2, 1])
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal(7))

        def f(x):
            return jnp.sum(jnp.sin(jax.ops.segment_max(x, seg, 4)[:3]) + jnp.cos(jax.ops.segment_min(x, seg, 3)))

        assert {"scatter-max", "scatter-min"} <= {e.primitive.name for e in jax.make_jaxpr(f)(x).jaxpr.eqns}
        report = interop.check_grads(f, x)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), _fd(f, x), rtol=0, atol=1e-7)
        tied = jnp.array([0.5, 0.5, -1.0, 2.0, 2.0, 1.0, 3.0])   # two maxima in segments 0 and 2
        report = interop.check_grads(lambda x: jnp.sum(jax.ops.segment_max(x, seg, 3) ** 2), tied)
        assert report.ok, str(report)


@pytest.mark.parametrize("axis, reverse", [(0, False), (1, True)])
def test_cumlogsumexp_replays_stably_and_matches_finite_differences(axis, reverse):
    """Values 30 apart: a single shift by the maximum would underflow the early prefixes to log(0)."""
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((3, 5)) * 30)

        def f(x):
            return jnp.sum(jnp.sin(lax.cumlogsumexp(x, axis=axis, reverse=reverse)))

        report = interop.check_grads(f, x)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), _fd(f, x), rtol=0, atol=1e-6)


SPECIAL = {
    "erf_inv": (lambda x: jnp.sum(jnp.sin(jax.scipy.special.erfinv(0.3 * x))), False),
    "bessel_i0e": (lambda x: jnp.sum(jax.scipy.special.i0e(x) ** 2), False),
    "bessel_i1e": (lambda x: jnp.sum(jnp.cos(jax.scipy.special.i1e(x))), False),
    "polygamma": (lambda x: jnp.sum(jax.scipy.special.polygamma(2, x)), True),
    "igamma": (lambda x: jnp.sum(jax.scipy.stats.gamma.logcdf(x, 2.5)), True),
    "igammac": (lambda x: jnp.sum(jax.scipy.special.gammaincc(2.5, x) * x), True),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special_functions_replay_with_their_derivative_written_here(name):
    """JAX's value with an independently written derivative; checked against jax.grad (the oracle) and
    finite differences, and inside a gradient penalty (the jaxpr then holds JAX's own derivative steps)."""
    f, positive = SPECIAL[name]
    with jax.enable_x64(True):
        x = jnp.array([0.3, 1.2, -0.7, 2.5, 1e-4])
        x = jnp.abs(x) + 0.1 if positive else x
        assert name in {e.primitive.name for e in jax.make_jaxpr(f)(x).jaxpr.eqns}
        report = interop.check_grads(f, x)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), _fd(f, x), rtol=1e-6, atol=1e-7)
        penalty = interop.check_grads(lambda x: f(x) + jnp.sum(jax.grad(f)(x) ** 2), x)
        assert penalty.ok, str(penalty)


def test_log2_and_expm_replay_whether_log2_is_a_primitive_jax_0_12_or_a_division_jax_0_10():
    def f(a):   # expm's scaling step takes log2 of the norm (a constant to the gradient: floor follows)
        return jnp.sum(jnp.log2(a * a + 1.0) ** 2) + jnp.sum(jax.scipy.linalg.expm(0.3 * a) ** 2)
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(5).standard_normal((3, 3)))
        report = interop.check_grads(f, a)
        assert report.ok and report.error <= 1e-12, str(report)
        np.testing.assert_allclose(np.asarray(report.grads[0]), _fd(f, a), rtol=0, atol=1e-6)


def test_the_shape_parameter_of_igamma_is_refused_by_name():
    from interop.oracle.rules import UnsupportedPrimitiveError
    with jax.enable_x64(True):
        f = lambda a: jnp.sum(jax.scipy.stats.gamma.cdf(jnp.array([0.5, 2.0]), a))   # noqa: E731
        with pytest.raises(UnsupportedPrimitiveError, match=r"igamma \(igamma differentiated in its first operand"):
            interop.check_grads(f, jnp.array([1.5, 2.5]))


def test_eigh_replays_eigenvalues_and_eigenvectors_and_refuses_a_degenerate_spectrum_by_name():
    from interop.oracle.rules import UnsupportedPrimitiveError
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        A = jnp.asarray(rng.standard_normal((4, 4)))
        c, d = jnp.asarray(rng.standard_normal(4)), jnp.asarray(rng.standard_normal((4, 4)))

        def f(A):   # eigenvalues of a Gram matrix, and squared eigenvectors (their sign does not matter)
            return jnp.sum(jnp.linalg.eigh(A @ A.T)[0] * c) + jnp.sum(jnp.linalg.eigh(A + A.T)[1] ** 2 * d)

        report = interop.check_grads(f, A)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(A)), _fd(f, A), rtol=0, atol=1e-6)
        flat = lambda A: jnp.sum(jnp.linalg.eigh(jnp.eye(3) + 0.0 * A)[1] ** 2 * d[:3, :3])   # noqa: E731
        with pytest.raises(UnsupportedPrimitiveError, match=r"eigh: eigenvalues 0 and 1 agree to 0\.0e\+00 "
                                                             r"relative .*ill-conditioned"):
            interop.check_grads(flat, A[:3, :3])


def test_psum_over_a_vmap_axis_name_replays_as_a_sum():
    """equinox's BatchNorm under ``vmap(axis_name=...)``: the batched jaxpr keeps ``psum`` over the
    positional batch axis, a sum over it."""
    eqx = pytest.importorskip("equinox")
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(7).standard_normal((5, 4)))
        bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
        state = eqx.nn.State(bn)
        params, static = eqx.partition(bn, eqx.is_inexact_array)

        def loss(params, x):
            y, _ = jax.vmap(eqx.combine(params, static), axis_name="batch", in_axes=(0, None),
                            out_axes=(0, None))(x, state)
            return jnp.sum(jnp.tanh(y) * jnp.arange(4.0))

        assert "psum" in {e.primitive.name for e in jax.make_jaxpr(loss)(params, x).jaxpr.eqns}
        report = interop.check_grads(loss, params, x)
        assert report.ok, str(report)
        np.testing.assert_allclose(np.asarray(jax.grad(loss, argnums=1)(params, x)),
                                   _fd(lambda x_: loss(params, x_), x), rtol=0, atol=1e-6)
