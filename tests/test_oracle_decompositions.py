"""The oracle on decompositions whose derivative is written here: ``svd`` (thin, or singular values only)
replays JAX's (s, U, Vᵀ) with the thin-SVD reverse rule of ``interop/oracle/rules.py``, so ``pinv``,
``norm(ord=2)``, ``norm('nuc')`` and ``lstsq`` replay; each is checked against ``jax.vjp`` and against
finite differences (independent of both AD sides), a derivative 1% off is caught, and singular vectors
of a near-degenerate spectrum are refused as ill-conditioned by name."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from interop.oracle.rules import UnsupportedPrimitiveError  # noqa: E402
from test_oracle_promotion import _fd  # noqa: E402

SHAPES = {"tall": (5, 3), "wide": (3, 5)}


def _svd_functions(m, n):
    """Functions of an m × n matrix through svd, each free of the singular vectors' signs (finite
    differences recompute the decomposition, whose signs are LAPACK's choice)."""
    rng = np.random.default_rng(m * 10 + n)
    c, b = jnp.asarray(rng.standard_normal((m, n))), jnp.asarray(rng.standard_normal(m))
    w = jnp.arange(1.0, min(m, n) + 1.0)

    def vectors(a):
        u, s, vt = jnp.linalg.svd(a, full_matrices=False)
        return (jnp.sum((u * s) @ vt * c) + jnp.sum(u[:, 0] ** 4) + jnp.sum((vt ** 2) * jnp.arange(n))
                + jnp.sum((u @ u.T) * (c @ c.T)) + jnp.sum(s * w))

    return {
        "singular values": lambda a: jnp.sum(jnp.linalg.svd(a, compute_uv=False) ** 2 * w),
        "vectors": vectors,
        "pinv": lambda a: jnp.sum(jnp.linalg.pinv(a) * c.T) + jnp.sum(jnp.linalg.pinv(a) ** 2),
        "norm ord=2": lambda a: jnp.linalg.norm(a, ord=2),
        "norm nuc": lambda a: jnp.linalg.norm(a, ord="nuc"),
        "lstsq": lambda a: jnp.sum(jnp.linalg.lstsq(a, b)[0] ** 2) + jnp.sum(jnp.linalg.lstsq(a, b)[0] * w[0]),
    }


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(_svd_functions(5, 3)))
def test_svd_and_what_uses_it_match_jax_vjp_and_finite_differences(name, shape):
    m, n = SHAPES[shape]
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(m + 2 * n).standard_normal((m, n)))
        f = _svd_functions(m, n)[name]
        assert " svd[" in str(jax.make_jaxpr(f)(a))   # at the top or inside a call (pinv's custom_jvp)
        report = interop.check_grads(f, a)
        assert report.ok and report.verdict == "agree" and report.error <= 1e-12, str(report)
        assert report.value == pytest.approx(report.jax_value, rel=1e-12), str(report)
        tape = np.asarray(report.grads[0])
        vjp = np.asarray(jax.vjp(f, a)[1](1.0)[0])
        np.testing.assert_allclose(tape, vjp, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(tape, _fd(f, a), rtol=0, atol=1e-6)


def test_singular_values_replay_inside_a_gradient_penalty():
    """The penalty's jaxpr holds JAX's own svd derivative steps (an svd with vectors): replayed through
    this rule's first derivatives of U, s and Vᵀ."""
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(8).standard_normal((4, 3)))
        f = lambda a: jnp.sum(jnp.linalg.svd(a, compute_uv=False) ** 3)   # noqa: E731
        report = interop.check_grads(lambda a: f(a) + jnp.sum(jax.grad(f)(a) ** 2), a)
        assert report.ok and report.error <= 1e-12, str(report)


def test_an_svd_derivative_one_percent_off_is_caught_and_located_at_svd(monkeypatch):
    from interop.oracle import table as oracle_rules
    good = oracle_rules.RULES["svd"]

    def off(r, xs, eqn):   # JAX's (s, U, Vᵀ) kept, dU scaled by 1.01: the value agrees, the gradient must not
        s, u, vt = good(r, xs, eqn)
        u0 = r.var(r.jout(1))
        return [s, u0 + (u - u0) * 1.01, vt]
    monkeypatch.setitem(oracle_rules.RULES, "svd", off)
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(9).standard_normal((5, 3)))
        r = interop.check_grads(lambda a: jnp.sum(jnp.linalg.svd(a, full_matrices=False)[0] ** 4), a)
    assert not r.ok and r.verdict == "mismatch" and r.value == pytest.approx(r.jax_value, rel=1e-12), str(r)
    assert r.error == pytest.approx(0.01, rel=0.05), str(r)   # the 1% put in, not noise
    d = r.first_divergence
    assert d is not None and d.kind == "vjp" and "svd" in d.eqn, str(r)


def test_singular_vectors_of_a_degenerate_spectrum_are_refused_as_ill_conditioned_by_name():
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(10).standard_normal((3, 3)))
        d = jnp.asarray(np.random.default_rng(11).standard_normal((3, 3)))
        flat = lambda a: jnp.sum(jnp.linalg.svd(jnp.eye(3) + 0.0 * a)[0] ** 2 * d)   # noqa: E731
        with pytest.raises(UnsupportedPrimitiveError, match=r"svd: singular values 0 and 1 agree to 0\.0e\+00 "
                                                             r"relative .*ill-conditioned"):
            interop.check_grads(flat, a)
        rank_one = lambda a: jnp.sum(jnp.linalg.svd(jnp.outer(a[:, 0], a[0]), full_matrices=False)[2] ** 3)  # noqa
        with pytest.raises(UnsupportedPrimitiveError, match=r"svd: singular values 1 and 2 agree .*ill-conditioned"):
            interop.check_grads(rank_one, a)
        # singular values alone stay differentiable there (a kink at most): only their vectors are refused
        report = interop.check_grads(lambda a: jnp.sum(jnp.linalg.svd(jnp.eye(3) + a, compute_uv=False)), 0.0 * a)
        assert report.ok, str(report)


def test_a_zero_singular_value_of_a_non_square_matrix_refuses_its_vectors_by_name():
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(12).standard_normal((4, 2)))
        f = lambda a: jnp.sum(jnp.linalg.svd(a.at[:, 1].set(0.0), full_matrices=False)[0] ** 4)   # noqa: E731
        with pytest.raises(UnsupportedPrimitiveError, match=r"svd: singular value 1 is 0\.0e\+00 of the largest"):
            interop.check_grads(f, a)


def test_a_batched_svd_is_refused_by_name_and_complete_vectors_are_jax_s_refusal():
    with jax.enable_x64(True):
        a = jnp.asarray(np.random.default_rng(13).standard_normal((4, 3)))
        batched = lambda a: jnp.sum(jnp.linalg.svd(jnp.stack([a, 2 * a]), compute_uv=False))   # noqa: E731
        with pytest.raises(UnsupportedPrimitiveError, match=r"svd of shape \(2, 4, 3\)"):
            interop.check_grads(batched, a)
        complete = lambda a: jnp.sum(jnp.linalg.svd(a)[0] ** 4)   # noqa: E731
        with pytest.raises(NotImplementedError, match="jax.grad itself cannot differentiate"):
            interop.check_grads(complete, a)


# ── cholesky: what cho_factor leaves unspecified, and the tangent JAX's rule takes ────────────────────

def _cho_solve(b, lower=True):
    return lambda a: jnp.sum(jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a, lower=lower), b) ** 2)


@pytest.mark.parametrize("lower", [True, False])
def test_cho_solve_replays_jax_s_unspecified_triangle_and_matches_jax_vjp_and_finite_differences(lower):
    """cho_factor does not symmetrise its input: JAX's cholesky leaves the other triangle as LAPACK left it
    (the input's), and its rule takes the tangent as given (jax 0.10) or mirrors its lower triangle (jax
    0.12). The replay keeps that triangle's value and follows the installed JAX's rule; finite differences
    along symmetric directions (of B in A = B Bᵀ + 4 I) agree with both."""
    from interop.oracle.rules import jax_cholesky_mirrors_its_tangent
    rng = np.random.default_rng(14)
    with jax.enable_x64(True):
        B = jnp.asarray(rng.standard_normal((4, 4)))
        b = jnp.asarray(rng.standard_normal((4, 2)))
        spd = B @ B.T + 4 * jnp.eye(4)
        f = _cho_solve(b, lower)
        report = interop.check_grads(f, spd)
        assert report.ok and report.error <= 1e-12 and report.first_divergence is None, str(report)
        tape = np.asarray(report.grads[0])
        np.testing.assert_allclose(tape, np.asarray(jax.vjp(f, spd)[1](1.0)[0]), rtol=1e-12, atol=1e-12)
        if jax_cholesky_mirrors_its_tangent():   # then the gradient is LAPACK's function's, element by element
            np.testing.assert_allclose(tape, _fd(f, spd), rtol=0, atol=1e-7)
        of_b = lambda B: f(B @ B.T + 4 * jnp.eye(4))   # noqa: E731
        report = interop.check_grads(of_b, B)
        assert report.ok and report.error <= 1e-12, str(report)
        np.testing.assert_allclose(np.asarray(report.grads[0]), _fd(of_b, B), rtol=0, atol=1e-7)
        # an input whose other triangle is not the mirror: cho_factor reads one triangle only, as the replay
        noisy = (jnp.tril if lower else jnp.triu)(spd) + (jnp.triu if lower else jnp.tril)(
            jnp.asarray(rng.standard_normal((4, 4))), 1 if lower else -1)
        report = interop.check_grads(f, noisy)
        assert report.ok and report.error <= 1e-12 and report.first_divergence is None, str(report)


def test_cholesky_symmetrised_batched_and_in_a_gradient_penalty_still_replay():
    rng = np.random.default_rng(15)
    with jax.enable_x64(True):
        B = jnp.asarray(rng.standard_normal((3, 3)))
        spd = B @ B.T + 3 * jnp.eye(3)
        x = jnp.asarray(rng.standard_normal((2, 3)))
        mvn = lambda a: jnp.sum(jax.scipy.stats.multivariate_normal.logpdf(x, jnp.zeros(3), a))   # noqa: E731
        cho = _cho_solve(x.T)
        cases = {"multivariate_normal": (mvn, spd),
                 "batched": (lambda a: jnp.sum(jnp.linalg.cholesky(a) ** 3), jnp.stack([spd, spd + jnp.eye(3)])),
                 "vmap of cho_solve": (lambda a: jnp.sum(jax.vmap(cho)(a)), jnp.stack([spd, 2 * spd])),
                 "gradient penalty": (lambda a: cho(a) + jnp.sum(jax.grad(cho)(a) ** 2), spd)}
        for name, (f, a) in cases.items():
            report = interop.check_grads(f, a)
            assert report.ok and report.error <= 1e-12, f"{name}: {report}"
        of_b = lambda B: mvn(B @ B.T + 3 * jnp.eye(3))   # noqa: E731
        np.testing.assert_allclose(np.asarray(interop.check_grads(of_b, B).grads[0]), _fd(of_b, B), rtol=0, atol=1e-6)


def test_a_captured_cholesky_computes_its_factor_at_every_call_not_the_example_s():
    """The rule reads no value of JAX's in the lower triangle (its factor is tg.cholesky on the tape, the
    derivative from it), so a captured program is right at arguments other than the example."""
    rng = np.random.default_rng(16)
    with jax.enable_x64(True):
        B = jnp.asarray(rng.standard_normal((4, 4)))
        b = jnp.asarray(rng.standard_normal((4, 2)))
        f = _cho_solve(b)
        vg = interop.value_and_grad(f, B @ B.T + 4 * jnp.eye(4), backend="numpy")
        other = B.T @ B + 2 * jnp.eye(4)
        v, g = jax.jit(vg)(other)
        assert float(v) == pytest.approx(float(f(other)), rel=1e-12)
        np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(f)(other)), rtol=1e-10, atol=1e-12)
