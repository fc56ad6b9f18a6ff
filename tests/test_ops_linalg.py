"""The linear-algebra ops: JAX's flag semantics, bad input, replays == the tape, a Gaussian process.

The registry suites (test_ops, test_oracle_ops, test_capture, test_native) already check every case
of cholesky / triangular_solve / solve / logdet / logabsdet / det_sign against finite differences,
jax.vjp at rtol 1e-12 (no op needs a looser bound: the test domains are well conditioned), and
the NumPy and native replays; here: what those cannot see.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.native import build
from tapegrad.ops.linalg import TRI_FLAGS, general, spd, triangular

LINALG = [o for o in O.OPS.values() if o.kind == "linalg"]


def jax_or_skip():
    interop = pytest.importorskip("interop")
    return interop.jax, interop.jnp


# ── semantics: JAX's flags, batches, float32 ─────────────────────────────────

@pytest.mark.parametrize("flags", TRI_FLAGS, ids=lambda f: "".join("LlTu"[k] if f[k] else "-" for k in range(4)))
def test_triangular_solve_means_what_jax_lax_linalg_means(flags):
    """Value and VJP of both operands against jax.lax.linalg.triangular_solve with the same flags."""
    jax, jnp = jax_or_skip()
    left, lower, trans, unit = flags
    rng = np.random.default_rng(11)
    a = triangular(rng, (2, 4, 4))
    b = rng.standard_normal((2, 4, 3) if left else (2, 3, 4))
    tape = tg.Tape()
    va, vb = tape.param(a), tape.param(b)
    x = tg.triangular_solve(va, vb, left_side=left, lower=lower, transpose_a=trans, unit_diagonal=unit)
    g = rng.standard_normal(b.shape)
    assert tape.backward(x, seed=g)

    def f(a, b):
        return jax.lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=trans,
                                               unit_diagonal=unit)
    want, vjp = jax.vjp(f, jnp.asarray(a), jnp.asarray(b))
    for got, ref in zip((tape.value(x), tape.grad(va), tape.grad(vb)), (want, *vjp(jnp.asarray(g)))):
        ref = np.asarray(ref)
        assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()
    # the triangle that is not read gets no gradient (nor the diagonal, with a unit diagonal)
    unread = ~np.tri(4, 4, -1 if unit else 0, dtype=bool)
    assert np.all(tape.grad(va)[:, unread if lower else unread.T] == 0.0)


def test_cholesky_gradient_is_symmetric_like_jax_numpy_linalg():
    jax, jnp = jax_or_skip()
    a = spd(np.random.default_rng(0), (5, 5))
    w = np.random.default_rng(1).standard_normal((5, 5))
    tape = tg.Tape()
    va = tape.param(a)
    assert tape.backward((tg.cholesky(va) * w).sum())
    want = np.asarray(jax.grad(lambda a: jnp.sum(jnp.linalg.cholesky(a) * w))(jnp.asarray(a)))
    got = tape.grad(va)
    assert np.array_equal(got, got.T)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_solve_takes_a_vector_right_hand_side_like_numpy():
    rng = np.random.default_rng(2)
    a, b = general(rng, (4, 4)), rng.standard_normal(4)
    tape = tg.Tape()
    x = tg.solve(tape.param(a), b)
    assert x.shape == (4,)
    np.testing.assert_allclose(tape.value(x), np.linalg.solve(a, b), rtol=1e-13)


def test_slogdet_of_general_and_singular_matrices_is_numpys():
    rng = np.random.default_rng(3)
    a = general(rng, (3, 4, 4))
    tape = tg.Tape()
    sign, ld = tg.slogdet(tape.param(a))
    want = np.linalg.slogdet(a)
    assert np.array_equal(tape.value(sign), want.sign) and set(want.sign) == {-1.0, 1.0}
    np.testing.assert_allclose(tape.value(ld), want.logabsdet, rtol=1e-14)
    sign, ld = tg.slogdet(tape.const(np.array([[1.0, 2.0], [2.0, 4.0]])))
    assert float(tape.value(sign)) == 0.0 and float(tape.value(ld)) == -math.inf
    m = spd(rng, (5, 5))
    np.testing.assert_allclose(tape.value(tg.slogdet(tape.const(m))[1]), tape.value(tg.logdet(tape.const(m))),
                               rtol=1e-14)


def test_float32_tapes_run_single_precision_lapack():
    a = spd(np.random.default_rng(4), (6, 6))
    tape = tg.Tape(np.float32)
    L = tape.value(tg.cholesky(tape.param(a)))
    assert L.dtype == np.float32
    np.testing.assert_allclose(L, np.linalg.cholesky(a.astype(np.float32)), rtol=2e-6, atol=2e-6)


# ── bad input: one message each, the tape left as it was ────────────────────

def state(tape):
    return len(tape), tape._vals.pos, tape._tmp.pos


def fails(tape, build, kind, message):
    before = state(tape)
    with pytest.raises(kind) as e:
        build()
    assert str(e.value) == message
    assert state(tape) == before


def test_bad_input_errors_name_the_op_and_node_and_leave_the_tape():
    tape = tg.Tape()
    rect = tape.param(np.ones((2, 3)))
    not_pd = tape.param(np.array([[1.0, 2.0], [2.0, 1.0]]))   # eigenvalues 3 and -1
    sq = tape.param(spd(np.random.default_rng(0), (3, 3)))
    singular = tape.param(np.array([[1.0, 2.0], [2.0, 4.0]]))
    batch = tape.const(np.stack([np.eye(2), np.array([[1.0, 0.0], [0.0, -1.0]])]))
    b21, b32, b232 = (tape.const(np.ones(s)) for s in ((2, 1), (3, 2), (2, 3, 2)))   # nodes 5-7
    fails(tape, lambda: tg.cholesky(rect), tg.ShapeError,
          "cholesky (node 8): expected a to be a non-empty square matrix (…, n, n), got shape (2, 3)")
    fails(tape, lambda: tg.cholesky(not_pd), tg.DomainError,
          "cholesky (node 8): the matrix is not positive definite: its leading minor of order 2 is not "
          "(LAPACK potrf info 2); expected a symmetric positive definite matrix")
    fails(tape, lambda: tg.logdet(not_pd), tg.DomainError,
          "logdet (node 8): the matrix is not positive definite: its leading minor of order 2 is not "
          "(LAPACK potrf info 2); expected a symmetric positive definite matrix")
    fails(tape, lambda: tg.cholesky(batch), tg.DomainError,
          "cholesky (node 8): matrix 1 of the batch is not positive definite: its leading minor of order 2 is "
          "not (LAPACK potrf info 2); expected a symmetric positive definite matrix")
    fails(tape, lambda: tg.solve(singular, b21), tg.DomainError,
          "solve (node 8): the matrix is singular: U[1, 1] of its LU factorisation is exactly zero "
          "(LAPACK gesv info 2)")
    fails(tape, lambda: tg.solve(sq, b21), tg.ShapeError,
          "solve (node 8): expected b of shape (…, 3, k) with a's batch dims () (a is (3, 3)), got (2, 1)")
    fails(tape, lambda: tg.triangular_solve(sq, b32, left_side=False), tg.ShapeError,
          "triangular_solve (node 8): expected b of shape (…, m, 3) with a's batch dims () (right side, a is "
          "(3, 3)), got (3, 2)")
    fails(tape, lambda: tg.triangular_solve(sq, b232), tg.ShapeError,
          "triangular_solve (node 8): expected b of shape (…, 3, n) with a's batch dims () (left side, a is "
          "(3, 3)), got (2, 3, 2)")
    # the tape still works, and poison mode records the first failure instead of raising
    assert np.allclose(tape.value(tg.cholesky(sq)), np.linalg.cholesky(tape.value(sq)))
    p = tg.Tape(on_error="poison")
    bad = tg.cholesky(p.param(np.array([[-1.0]])))
    assert bad.id < 0 and not p.ok and isinstance(p.error, tg.DomainError)


def test_a_program_fed_a_matrix_that_is_not_positive_definite():
    """NumPy replay raises naming op and node; a native program (no exception to give a C caller)
    fills the value with NaN, and the loss is NaN."""
    tape = tg.Tape()
    m = tape.const(spd(np.random.default_rng(5), (3, 3)))
    loss = tg.logdet(m) + tg.cholesky(m).sum()
    bad = -np.eye(3)
    prog = tg.capture(tape, loss)
    with pytest.raises(tg.DomainError, match=r"^logdet \(node 1\): the matrix is not positive definite"):
        prog.set_input(m, bad) or prog.forward()
    native = tg.capture(tape, loss, backend="native")
    native.set_input(m, bad)
    assert math.isnan(float(native.forward()))


# ── replays == the tape, exactly, in both dtypes ─────────────────────────────

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_native_and_numpy_replays_equal_the_tape_bit_for_bit(dtype):
    """Tape and program call the same LAPACK addresses with the same arguments; everything around the
    calls is IEEE-exact (logdet's log is the C library's on both sides), so every value and gradient is
    ==, though the registry tier is 'blas'."""
    rng = np.random.default_rng(7)
    tape = tg.Tape(dtype)
    items, loss = [], None
    for op in LINALG:
        for ash, bsh, s in op.cases:
            a = tape.param(op.domain[0](rng, ash))
            b = tape.param(op.domain[1](rng, bsh)) if op.arity == 2 else None
            y = tape.apply(op, a, b, s)
            term = (y * tape.const(rng.standard_normal(y.shape))).sum()
            loss = term if loss is None else loss + term
            items.append((a, b, y))
    assert tape.backward(loss)
    for backend in ("numpy", "native"):
        prog = tg.capture(tape, loss, backend=backend, dtype=dtype)
        prog.forward()
        prog.backward()
        for a, b, y in items:
            assert np.array_equal(prog.value(y), tape.value(y))
            for v in (a, b) if b is not None else (a,):
                assert np.array_equal(prog.grad(v), tape.grad(v))


# ── a Gaussian process on the tape ───────────────────────────────────────────

def gp_data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(-3.0, 3.0, (n, 1)), axis=0)
    y = np.sin(2.0 * x) + 0.1 * rng.standard_normal((n, 1))
    return x, y


def gp_nll(tape, theta, x, y, kernel):
    """−log p(y) = ½ yᵀK⁻¹y + ½ log det K + n/2 log 2π with K = k(x, x) + noise·I, through the Cholesky
    factor: ½|L⁻¹y|² + Σ log Lᵢᵢ. theta = (lengthscale, variance, noise) as square roots."""
    ell, var, noise = (t * t for t in theta)
    n = y.shape[0]
    d = x - x.T                                     # (n, n) pairwise differences
    r = (d * d) / ell
    k = var * ((-0.5 * r).exp() if kernel == "se" else 1.0 / (1.0 + r))
    K = k + noise * tape.const(np.eye(n))
    L = tg.cholesky(K)
    alpha = tg.triangular_solve(L, y)
    half_logdet = (L * tape.const(np.eye(n))).sum(axis=1).log().sum() if kernel == "se" else 0.5 * tg.logdet(K)
    return 0.5 * (alpha * alpha).sum() + half_logdet + 0.5 * n * math.log(2.0 * math.pi)


def gp_nll_jax(jnp, jsl, theta, x, y, kernel):
    ell, var, noise = (t * t for t in theta)
    n = y.shape[0]
    d = x - x.T
    r = d * d / ell
    k = var * (jnp.exp(-0.5 * r) if kernel == "se" else 1.0 / (1.0 + r))
    K = k + noise * jnp.eye(n)
    L = jnp.linalg.cholesky(K)
    alpha = jsl.solve_triangular(L, y, lower=True)
    return 0.5 * jnp.sum(alpha * alpha) + jnp.sum(jnp.log(jnp.diag(L))) + 0.5 * n * jnp.log(2.0 * jnp.pi)


THETA = [np.array(0.9), np.array(1.1), np.array(0.3)]


def record_gp(kernel, x, y, dtype="float64"):
    tape = tg.Tape(dtype)
    theta = [tape.param(t) for t in THETA]
    xv = tape.param(x)
    yv = tape.const(y)
    loss = gp_nll(tape, theta, xv, yv, kernel)
    assert tape.backward(loss)
    return tape, theta + [xv], yv, loss


@pytest.mark.parametrize("kernel", ["se", "cauchy"])
def test_gp_marginal_likelihood_gradients_match_jax_grad(kernel):
    """Hyperparameters and inputs: max relative gradient difference <= 1e-12 (cond K is about 120;
    measured 4.5e-14 with the exp kernel, 2.5e-15 with the rational one)."""
    jax, jnp = jax_or_skip()
    import jax.scipy.linalg as jsl
    x, y = gp_data()
    tape, params, _, loss = record_gp(kernel, x, y)
    f = jax.value_and_grad(lambda th, x: gp_nll_jax(jnp, jsl, th, x, jnp.asarray(y), kernel), argnums=(0, 1))
    val, (gth, gx) = f([jnp.asarray(t) for t in THETA], jnp.asarray(x))
    assert abs(float(tape.value(loss)) - float(val)) <= 1e-12 * abs(float(val))
    for p, want in zip(params, list(gth) + [gx]):
        want = np.asarray(want)
        assert np.abs(tape.grad(p) - want).max() <= 1e-12 * np.abs(want).max(), (p, tape.grad(p), want)


def test_gp_captured_natively_equals_the_tape_and_takes_new_data():
    """The Cauchy-kernel model uses only IEEE-exact ops besides the linalg ones: native == tape, in the
    recorded episode and on new targets (compared with a fresh tape)."""
    x, y = gp_data()
    tape, params, yv, loss = record_gp("cauchy", x, y)
    prog = tg.capture(tape, loss, backend="native")
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    for p in params:
        assert np.array_equal(prog.grad(p), tape.grad(p))
    y2 = gp_data(seed=1)[1]
    got = prog.episode({yv: y2})
    fresh, fparams, _, floss = record_gp("cauchy", x, y2)
    assert got == float(fresh.value(floss))
    for p, q in zip(params, fparams):
        assert np.array_equal(prog.grad(p), fresh.grad(q))


def test_gp_with_exp_kernel_natively_within_the_libm_bound():
    """With exp and log (libm tier: the C library's vs NumPy's SIMD versions) the native gradients stay
    within 1e-13 relative of the tape's."""
    x, y = gp_data()
    tape, params, _, loss = record_gp("se", x, y)
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    assert abs(float(prog.loss()) - float(tape.value(loss))) <= 1e-13 * abs(float(tape.value(loss)))
    for p in params:
        want = tape.grad(p)
        assert np.abs(prog.grad(p) - want).max() <= 1e-13 * np.abs(want).max()


def test_scipy_cython_lapack_fallback(tmp_path):
    """With TAPEGRAD_BLAS=scipy the ops call SciPy's Cython LAPACK exports (32-bit integers) on the tape
    and in the native program alike, still ==."""
    code = ("import numpy as np, tapegrad as tg\n"
            "from tapegrad.ops.linalg import lapack, spd, general\n"
            "r = np.random.default_rng(0); t = tg.Tape()\n"
            "a = t.param(spd(r, (4, 4))); m = t.param(general(r, (4, 4))); b = t.param(r.standard_normal((4, 2)))\n"
            "x = tg.solve(m, tg.triangular_solve(tg.cholesky(a), b, transpose_a=True))\n"
            "l = (x * x).sum() + tg.logdet(a); t.backward(l)\n"
            "p = tg.capture(t, l, backend='native'); p.forward(); p.backward()\n"
            "print(lapack('float64').where, lapack('float64').int, float(p.loss()) == float(t.value(l)), "
            "all(bool((p.grad(v) == t.grad(v)).all()) for v in (a, m, b)))\n")
    env = {**os.environ, "TAPEGRAD_BLAS": "scipy", build.ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["scipy.linalg.cython_lapack", "int32", "True", "True"]


def test_gp_program_inside_jax_jit_is_the_tape():
    """The captured GP as an XLA custom call (interop.program_call) under jax.jit(value_and_grad): the
    LAPACK table travels in the program's context, and loss and gradients are the tape's, ==."""
    jax_or_skip()
    import interop
    jax, jnp = interop.jax, interop.jnp
    x, y = gp_data()
    tape, params, yv, loss = record_gp("cauchy", x, y)
    prog = tg.capture(tape, loss, backend="native")
    call = interop.program_call(prog)
    assert call.native   # the FFI handler calling the compiled program, not a host callback
    f = jax.jit(jax.value_and_grad(call, argnums=(0, 1, 2, 3)))
    val, grads = f(*THETA, x, y, np.eye(len(y)))
    assert float(val) == float(tape.value(loss))
    for p, g in zip(params, grads):
        assert np.array_equal(np.asarray(g), tape.grad(p))


def test_the_docs_gp_example_runs_and_is_right():
    from docs_pages import block
    scope = {}
    exec(compile(block("ops.md", "## Linear algebra"), "docs/ops.md", "exec"), scope)
    tape, nll, x, y = scope["tape"], scope["nll"], scope["x"], scope["y"]

    def closed_form(ell, var, noise):
        K = var * np.exp(-0.5 * (x - x.T) ** 2 / ell) + noise * np.eye(20)
        return 0.5 * (y.T @ np.linalg.solve(K, y)).item() + 0.5 * np.linalg.slogdet(K)[1] + 10 * np.log(2 * np.pi)
    theta = [1.0, 1.0, 0.1]
    assert abs(float(tape.value(nll)) - closed_form(*theta)) <= 1e-12 * abs(closed_form(*theta))
    for k, name in enumerate(("ell", "var", "noise")):
        h = 1e-6
        up, down = list(theta), list(theta)
        up[k] += h
        down[k] -= h
        fd = (closed_form(*up) - closed_form(*down)) / (2 * h)
        assert abs(float(tape.grad(scope[name])) - fd) <= 1e-6 * max(1.0, abs(fd)), name
