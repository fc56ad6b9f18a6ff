"""What differs across the JAX releases interop supports (0.10.2 to 0.12.x), decided in interop/_jax.py.

These run on whichever jax is installed: `make test` on .venv's, tools/jax_rows.sh on Python 3.12 and
3.13 with JAX 0.12 (docs/testing.md).
"""
import numpy as np
import pytest

interop = pytest.importorskip("interop")
from interop import _jax, jax, jnp  # noqa: E402
from interop.oracle.replay import compiled  # noqa: E402
from jax import lax  # noqa: E402

RNG = np.random.default_rng(26)


def test_release_reads_the_first_three_numbers():
    assert _jax.release("0.12.0.1") == (0, 12, 0)
    assert _jax.release("0.11.0.dev20260101") == (0, 11, 0)
    assert _jax.release("0.10.2") == (0, 10, 2)
    with pytest.raises(ValueError, match=r"not a jax version: 'nightly' \(expected major.minor.patch"):
        _jax.release("nightly")


def test_the_installed_jaxlib_is_in_the_supported_range():
    import jaxlib
    assert (0, 10, 2) <= _jax.JAXLIB < (0, 13, 0), jaxlib.__version__
    assert _jax.CPU_FUSION_EMITTERS_SWITCH == (_jax.JAXLIB <= (0, 11, 0))


def test_the_oracles_compile_options_are_accepted_by_this_jaxlib():
    # jaxlib 0.11.1 rejects xla_cpu_use_fusion_emitters ("No such compile option"): FAST_COMPILE only
    # names it below that.
    x = jnp.asarray(RNG.standard_normal(5))
    assert np.array_equal(np.asarray(compiled(lambda v: v * 2.0)(x)), np.asarray(x) * 2.0)


def _scan_eqn(f, *args):
    (eqn,) = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_scan_counts_split_the_operands_on_this_jax():
    w1, w2 = jnp.ones(3), jnp.ones(3) * 2
    xs = jnp.ones((4, 3))

    def f(w1, w2, xs):
        def body(carry, x):
            h, c = carry
            return (jnp.tanh(h * w1 + x), c + (h * w2).sum()), h.sum()
        return lax.scan(body, (jnp.zeros(3), 0.0), xs)

    eqn = _scan_eqn(f, w1, w2, xs)
    nc, nk = _jax.scan_counts(eqn.params)
    assert (nc, nk) == (2, 2)
    assert len(eqn.invars) == nc + nk + 1
    # the body's carry inputs are its first nk results' types
    body = eqn.params["jaxpr"].jaxpr
    assert [(v.aval.shape, v.aval.dtype) for v in body.invars[nc:nc + nk]] == \
        [(v.aval.shape, v.aval.dtype) for v in body.outvars[:nk]]


def test_scan_counts_read_the_jax_0_10_params():
    assert _jax.scan_counts({"num_consts": 3, "num_carry": 1, "length": 5}) == (3, 1)


@pytest.mark.skipif(not hasattr(lax, "one_minus_square"), reason="lax.one_minus_square is new in jax 0.11")
def test_one_minus_square_replays_with_jaxs_value_and_derivative():
    # tiny |a| (where (1 − a) − (1 + a) would cancel), |a| near 1 (where 1 − a² would), and beyond 1
    a = np.array([1e-9, -3e-5, 0.3, -0.49, 0.5, 0.9999999, -0.99999999, 1.7, -2.5])
    c = RNG.standard_normal(a.size)

    def f(x):
        return jnp.sum(lax.one_minus_square(x) * c)

    x = jnp.asarray(a)
    assert "one_minus_square" in str(jax.make_jaxpr(f)(x))
    r = interop.check_grads(f, x)
    assert r.ok and r.verdict == "agree", str(r)
    (tape,) = r.grads
    g = np.asarray(jax.grad(f)(x))
    assert np.array_equal(g, -2 * a * c) or np.abs(g - (-2 * a * c)).max() <= 1e-15 * np.abs(g).max()
    assert np.all(np.abs(tape - g) <= 1e-12 * np.abs(g)), (tape, g)   # elementwise, tiny a included
    # central differences of the sum, one element at a time (step 1e-6: truncation error 0, a quadratic)
    h = 1e-6
    fd = np.array([(float(f(x.at[i].add(h))) - float(f(x.at[i].add(-h)))) / (2 * h) for i in range(a.size)])
    assert np.abs(fd - tape).max() <= 1e-7 * max(1.0, np.abs(fd).max()), (fd, tape)
    assert abs(r.value - r.jax_value) <= 1e-15 * abs(r.jax_value)
    # log magnifies a relative error of the value near |a| = 1 (where 1 − a² loses half its bits)
    inside = jnp.asarray(a[np.abs(a) < 1])
    r = interop.check_grads(lambda x: jnp.sum(jnp.log(lax.one_minus_square(x)) * c[:x.size]), inside)
    assert r.ok and r.verdict == "agree", str(r)
    assert abs(r.value - r.jax_value) <= 1e-13 * abs(r.jax_value)


@pytest.mark.skipif(not hasattr(lax, "one_minus_square"), reason="lax.one_minus_square is new in jax 0.11")
def test_a_gradient_penalty_through_tanh_replays():
    # jax >= 0.11 writes tanh's derivative with one_minus_square: a grad inside the checked function has it
    w = jnp.asarray(RNG.standard_normal((3, 4)))
    x = jnp.asarray(RNG.standard_normal((5, 3)) * 3)

    def loss(w):
        inner = jax.grad(lambda z: jnp.tanh(z @ w).sum())(x)
        return jnp.sum(inner ** 2) + jnp.tanh(x @ w).mean()

    assert "one_minus_square" in str(jax.make_jaxpr(loss)(w))
    r = interop.check_grads(loss, w)
    assert r.ok and r.verdict == "agree", str(r)
    (tape,) = r.grads
    g = np.asarray(jax.grad(loss)(w))
    assert np.abs(tape - g).max() <= 1e-12 * np.abs(g).max()
