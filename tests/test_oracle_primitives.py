"""The oracle on linear-algebra primitives whose derivative is written here: ``qr`` (reduced, unpivoted,
m >= n) replays JAX's (Q, R) with its own derivative; a shape it does not cover stays a named refusal."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from interop.oracle.rules import UnsupportedPrimitiveError  # noqa: E402
from test_oracle_promotion import _fd  # noqa: E402


def test_qr_least_squares_and_orthonormal_basis_match_jax_vjp_and_finite_differences():
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        A = jnp.asarray(rng.standard_normal((6, 3)))
        b, c = jnp.asarray(rng.standard_normal(6)), jnp.asarray(rng.standard_normal((6, 3)))

        def f(A):   # a least-squares fit by QR, and a sign-free function of the orthonormal basis
            q, r = jnp.linalg.qr(A)
            x = jax.scipy.linalg.solve_triangular(r, q.T @ b)
            return jnp.sum((A @ x - b) ** 2) + jnp.sum((q @ q.T) * (c @ c.T)) + jnp.sum(jnp.abs(jnp.diag(r)))

        report = interop.check_grads(f, A)
        assert report.ok and report.error <= 1e-12, str(report)
        tape = np.asarray(report.grads[0])
        vjp = np.asarray(jax.vjp(f, A)[1](1.0)[0])
        np.testing.assert_allclose(tape, vjp, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(tape, _fd(f, A), rtol=0, atol=1e-6)


def test_qr_of_a_wide_or_full_matrix_is_refused_by_name():
    with jax.enable_x64(True):
        A = jnp.asarray(np.random.default_rng(4).standard_normal((4, 2)))
        wide = lambda A: jnp.sum(jnp.linalg.qr(A.T)[1])                     # noqa: E731
        full = lambda A: jnp.sum(jnp.linalg.qr(A, mode="complete")[0])       # noqa: E731
        for f in (wide, full):
            with pytest.raises(UnsupportedPrimitiveError, match=r"qr of shape .*reduced, unpivoted m >= n"):
                interop.check_grads(f, A)


def test_a_qr_derivative_one_percent_off_is_caught_and_located_at_qr(monkeypatch):
    from interop.oracle import table as oracle_rules
    good = oracle_rules.RULES["qr"]

    def off(r, xs, eqn):   # JAX's (Q, R) kept, dR scaled by 1.01: the value agrees, the gradient must not
        q, R = good(r, xs, eqn)
        R0 = r.var(r.jout(1))
        return [q, R0 + (R - R0) * 1.01]
    monkeypatch.setitem(oracle_rules.RULES, "qr", off)
    with jax.enable_x64(True):
        A = jnp.asarray(np.random.default_rng(5).standard_normal((5, 3)))
        r = interop.check_grads(lambda A: jnp.sum(jnp.linalg.qr(A)[1] ** 2), A)
    assert not r.ok and r.verdict == "mismatch" and r.value == pytest.approx(r.jax_value, rel=1e-12), str(r)
    assert r.error == pytest.approx(0.01, rel=0.05), str(r)   # the 1% put in, not noise
    d = r.first_divergence
    assert d is not None and d.kind == "vjp" and d.index == 0 and "qr" in d.eqn, str(r)


@pytest.mark.skipif(not hasattr(jax.lax, "polynomial"), reason="lax.polynomial, sinpi and asinpi are jax >= 0.12.1's")
@pytest.mark.parametrize("name", ["polynomial", "sinpi", "asinpi"])
def test_jax_0_12_1_primitives_replay(name):
    fns = {"polynomial": lambda x, c: jnp.sum(jax.lax.polynomial(x, [c[0], c[1], 0.5, c[2]])),
           "sinpi": lambda x, c: jnp.sum(jax.lax.sinpi(x * c[0])),
           "asinpi": lambda x, c: jnp.sum(jax.lax.asinpi(jnp.tanh(x) * c[1] * 0.5))}
    x, c = jnp.array([0.3, -1.2, 2.5, 0.0]), jnp.array([0.7, 1.1, -0.4])
    report = interop.check_grads(fns[name], x, c)
    assert report.ok, str(report)
