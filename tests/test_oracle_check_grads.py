"""interop.check_grads / assert_grads: the calling convention, the reports, located divergences, errors."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

interop = pytest.importorskip("interop")
from interop import jax, jnp  # noqa: E402
from jax import lax  # noqa: E402

import tapegrad as tg  # noqa: E402

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
RNG = np.random.default_rng(3)
X = jnp.asarray(RNG.standard_normal((6, 4)))
Y = jnp.asarray(np.eye(3)[RNG.integers(0, 3, 6)])
PARAMS = {"W1": jnp.asarray(RNG.standard_normal((4, 5)) * 0.5), "b1": jnp.zeros(5),
          "W2": jnp.asarray(RNG.standard_normal((5, 3)) * 0.5), "b2": jnp.zeros(3)}


def mlp_loss(p):
    h = jax.nn.relu(X @ p["W1"] + p["b1"])
    logits = h @ p["W2"] + p["b2"]
    return -jnp.mean(jnp.sum(Y * jax.nn.log_softmax(logits), axis=-1))


@jax.custom_vjp
def good_tanh(x):
    return jnp.tanh(x)


good_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda t, g: (g * (1.0 - t * t),))


@jax.custom_vjp
def bad_tanh(x):
    return jnp.tanh(x)


bad_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda t, g: (g * (1.0 - t * t) * (1 + 1e-9),))


def test_mlp_pytree_agrees_with_jax_grad():
    r = interop.check_grads(mlp_loss, PARAMS)
    assert r.ok and r.verdict == "agree", str(r)
    (g,) = r.grads
    assert set(g) == set(PARAMS) and g["W1"].shape == (4, 5)
    assert max(r.max_rel) <= 1e-12 and r.first_divergence is None
    assert abs(r.value - r.jax_value) <= 1e-12 * abs(r.jax_value)
    assert r.leaves == ("arg 0['W1']", "arg 0['W2']", "arg 0['b1']", "arg 0['b2']")


def test_many_primitives():
    def f(x, w):
        z = jax.lax.stop_gradient(jax.nn.sigmoid(x))
        return (jnp.sum(jnp.where(x > 0, x, 0.0) ** 3 * z) + jax.jit(jnp.tanh)(x).sum() + jnp.max(x)
                + jnp.min(x) + jnp.square(x).sum() + jnp.concatenate([x, 2 * x]).sum() + (x[1:3] @ w)[0]
                + jnp.einsum("ij,kj->ik", w, w).sum() + jnp.exp(-x).mean() + jnp.log(x * x + 1).sum()
                + (1.0 / jnp.sqrt(x * x + 2)).sum() + w.T.reshape(-1)[2] + jnp.abs(x).sum() / x.shape[0]
                + jnp.maximum(x, 0.3).sum() + good_tanh(x).sum() + jnp.expand_dims(x, 0).squeeze().sum()
                + jnp.einsum("bij,bjk->bik", w[None] * x[:2, None, None], w[None]).sum())
    r = interop.check_grads(f, jnp.asarray(RNG.standard_normal(4)), jnp.asarray(RNG.standard_normal((2, 2))))
    assert r.ok, str(r)


# ── calling convention: argnums, has_aux, data leaves ────────────────────────

def test_argnums_and_has_aux_mirror_jax_grad():
    def loss(w, x, labels, mask):
        logp = jax.nn.log_softmax(x @ w)
        nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
        return jnp.sum(jnp.where(mask, nll, 0.0)), {"n": mask.sum(), "logp": logp}
    w, x = jnp.asarray(RNG.standard_normal((4, 3))), jnp.asarray(RNG.standard_normal((5, 4)))
    labels, mask = jnp.array([0, 2, 1, 1, 0]), jnp.array([True, False, True, True, True])
    r = interop.check_grads(loss, w, x, labels, mask, argnums=0, has_aux=True)
    g, aux = jax.grad(loss, argnums=0, has_aux=True)(w, x, labels, mask)
    assert r.ok and r.grads.shape == (4, 3) and np.abs(r.grads - g).max() <= 1e-12 * np.abs(g).max()
    assert int(r.aux["n"]) == 4 and r.aux["logp"].shape == (5, 3)
    assert np.asarray(labels).dtype.kind == "i"            # integers are never cast
    r2 = interop.check_grads(loss, w, x, labels, mask, argnums=(1, 0), has_aux=True)
    assert isinstance(r2.grads, tuple) and r2.grads[0].shape == (5, 4) and r2.grads[1].shape == (4, 3)
    r3 = interop.check_grads(loss, w, x, labels, mask, has_aux=True)   # argnums=None: every argument
    assert r3.grads[2] is None and r3.grads[3] is None and r3.leaves == ("arg 0", "arg 1")


def test_data_leaves_inside_a_differentiated_pytree_are_not_differentiated():
    def f(p):
        return jnp.sum(p["w"][p["idx"]] ** 2)
    r = interop.check_grads(f, {"w": jnp.arange(5.0), "idx": jnp.array([4, 1, 1])})
    assert r.ok and r.grads[0]["idx"] is None
    assert np.array_equal(r.grads[0]["w"], [0, 4, 0, 0, 8])


def test_argument_errors_are_clear():
    with pytest.raises(ValueError, match="one scalar"):
        interop.check_grads(lambda x: x * 2, jnp.ones(3))
    with pytest.raises(ValueError, match="has_aux=True needs f to return a pair"):
        interop.check_grads(lambda x: x.sum(), jnp.ones(3), has_aux=True)
    with pytest.raises(ValueError, match="argnums 3 is out of range for 1 positional"):
        interop.check_grads(lambda x: x.sum(), jnp.ones(3), argnums=3)
    with pytest.raises(ValueError, match="no float leaf to differentiate"):
        interop.check_grads(lambda n: jnp.sum(n * 1.0), jnp.arange(3))


def test_python_control_flow_says_what_to_use_instead():
    with pytest.raises(interop.TracingError, match=r"traces f the way jax.jit does.*lax.cond") as e:
        interop.check_grads(lambda x: x.sum() if x.sum() > 0 else -x.sum(), jnp.ones(3), concrete=False)
    assert isinstance(e.value, tg.TapeError) and isinstance(e.value, TypeError)


def test_unsupported_primitives_are_all_named_and_part_of_the_family():
    # (a batched svd: one matrix replays since svd has a rule)
    f = lambda x: jnp.linalg.svd(jnp.stack([jnp.outer(x, x) + jnp.eye(3)] * 2), compute_uv=False).sum() + jnp.fft.fft(x).real.sum()  # noqa: E731,E501
    with pytest.raises(interop.UnsupportedPrimitiveError, match=r"\['fft', 'svd'\]") as e:
        interop.check_grads(f, jnp.ones(3))
    assert isinstance(e.value, tg.TapeError) and isinstance(e.value, NotImplementedError)
    # on constants only they are fine: JAX evaluates them
    r = interop.check_grads(lambda x: (x * jnp.fft.fft(jnp.arange(3.0)).real).sum(), jnp.ones(3))
    assert r.ok


def test_jax_grad_failing_is_reported_as_such():
    f = lambda x: lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0))[0].sum()  # noqa: E731
    with pytest.raises(ValueError, match="jax.grad itself cannot differentiate f"):
        interop.check_grads(f, jnp.ones(2))


# ── reports that tell the truth ──────────────────────────────────────────────

def test_wrong_custom_vjp_is_caught_and_located():
    r = interop.check_grads(lambda x: bad_tanh(x * 2.0).sum() + x.sum(), jnp.linspace(-1, 1, 5))
    assert not r.ok and r.verdict == "mismatch" and r.max_rel[0] > 1e-12
    d = r.first_divergence
    assert d.kind == "vjp" and "custom_vjp_call" in d.eqn and "bad_tanh" in d.eqn and d.index == 1
    assert "MISMATCH" in str(r) and "first divergence: equation 1" in str(r)


def test_wrong_custom_vjp_inside_a_scan_body_is_located_in_its_iteration():
    def f(w, xs):
        def body(h, x):
            h = bad_tanh(h * w + x)
            return h, h.sum()
        return lax.scan(body, jnp.zeros(3), xs)[1].sum()
    r = interop.check_grads(f, jnp.asarray(RNG.standard_normal(3)), jnp.asarray(RNG.standard_normal((4, 3))))
    assert not r.ok and r.verdict == "mismatch"
    d = r.first_divergence
    assert d.kind == "vjp" and "bad_tanh" in d.eqn and d.where.startswith("scan (step") and "iteration 0" in d.where


def test_wrong_custom_vjp_inside_a_cond_branch_is_located_in_the_branch():
    def f(x):
        return lax.cond(x.sum() > 0, lambda v: bad_tanh(v * 3.0).sum(), lambda v: jnp.sum(v ** 2), x)
    r = interop.check_grads(f, jnp.array([0.5, 0.2, -0.1]))
    d = r.first_divergence
    assert not r.ok and d.kind == "vjp" and "bad_tanh" in d.eqn and "cond (step" in d.where and "branch 1" in d.where
    # the other branch taken: nothing wrong to find
    assert interop.check_grads(f, jnp.array([-0.5, 0.2, -0.1])).ok


def test_select_does_not_leak_the_untaken_branch():
    r = interop.check_grads(jnp.var, jnp.asarray(RNG.standard_normal(7)))
    assert r.ok and np.isfinite(r.value), str(r)
    r = interop.check_grads(lambda x: jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0)), jnp.array([1.0, -2.0, 0.5]))
    assert r.ok and np.all(np.isfinite(r.grads[0])), str(r)
    r = interop.check_grads(lambda x: jax.nn.logsumexp(jnp.where(x > 0, x, -jnp.inf)), jnp.array([1.0, -2.0, 0.5]))
    assert r.ok and r.grads[0][1] == 0.0, str(r)


def test_a_nan_on_one_side_is_a_divergence_located_where_it_appears():
    @jax.custom_jvp
    def safe_sqrt(x):
        return jnp.sqrt(x)
    safe_sqrt.defjvp(lambda p, t: (jnp.sqrt(p[0]), t[0] * 0.5 / jnp.sqrt(jnp.maximum(p[0], 1.0))))
    r = interop.check_grads(lambda x: jnp.sum(safe_sqrt(x * x)), jnp.array([0.0, 2.0]))
    # JAX's rule gives a finite gradient at 0; the primal body's derivative there is inf·0 = nan
    assert not r.ok and not np.isfinite(r.max_rel[0]) and r.first_divergence is not None
    assert r.first_divergence.kind == "vjp" and "safe_sqrt" in r.first_divergence.eqn


def test_ok_requires_the_values_to_agree():
    @jax.custom_jvp
    def lying(x):
        return x * 2.0
    lying.defjvp(lambda p, t: (p[0] * 2.0 + 1.0, t[0] * 2.0))   # the rule's primal output differs from the body
    r = interop.check_grads(lambda x: jnp.sum(lying(x)), jnp.ones(3))
    assert not r.ok and abs(r.value - r.jax_value) > 1
    assert "another primal output than its body" in str(r)


def test_keys_as_arguments_and_multi_result_primitives():
    def f(x, key):
        a, b = lax.optimization_barrier((x * 2.0, jnp.tanh(x)))
        keys = jax.random.split(key, 3)
        noise = jax.vmap(lambda k: jax.random.normal(k, (2,)))(keys)
        return jnp.sum(a * b) + jnp.sum(noise * x[:2])
    x = jnp.asarray(RNG.standard_normal(4))
    r = interop.check_grads(f, x, jax.random.key(0), argnums=0)
    assert r.ok and r.grads.shape == (4,), str(r)
    r = interop.check_grads(f, x, jax.random.PRNGKey(0))            # raw uint32 keys are data too
    assert r.ok and r.grads[1] is None


def test_relu_at_exact_zero_is_a_kink_with_both_conventions():
    r = interop.check_grads(lambda x: jnp.sum(jax.nn.relu(x) * jnp.arange(1.0, 5.0)), jnp.array([0.0, 1.0, -1.0, 0.0]))
    assert r.ok and r.verdict == "kink" and r.max_rel[0] > 0.1
    (k,) = r.kinks
    assert k.elements == 2 and "relu" in k.eqn and k.jax == "d/dx = 0" and k.tape == "d/dx = 0.5"
    assert "differences only at kinks" in str(r) and "JAX gives d/dx = 0, the tape gives d/dx = 0.5" in str(r)
    with pytest.raises(interop.GradientMismatchError):
        interop.assert_grads(lambda x: jnp.sum(jax.nn.relu(x)), jnp.array([0.0, 1.0]), allow_kinks=False)


def test_a_wrong_rule_at_a_kink_is_not_excused_as_one():
    @jax.custom_jvp
    def bad_relu(x):
        return jnp.maximum(x, 0.0)
    bad_relu.defjvp(lambda p, t: (jnp.maximum(p[0], 0.0), t[0] * jnp.where(p[0] > 0, 1.1, 0.0)))
    r = interop.check_grads(lambda x: jnp.sum(bad_relu(x)), jnp.array([0.0, 1.0, -1.0]))
    assert not r.ok and r.verdict == "mismatch" and "bad_relu" in r.first_divergence.eqn


def test_float32_inside_a_float64_function_is_compared_at_float32():
    def f(w, x):
        logits = (x @ w).astype(jnp.float32)
        return jnp.sum(jax.nn.softmax(logits) ** 2).astype(jnp.float64)
    r = interop.check_grads(f, jnp.asarray(RNG.standard_normal((4, 3))), X)
    assert r.ok and r.verdict == "agree" and r.precision is not None
    assert r.precision.dtype == "float32" and "convert_element_type" in r.precision.eqn
    assert r.bound == pytest.approx(np.sqrt(np.finfo(np.float32).eps)) and max(r.max_rel) > 1e-12
    assert "compared at √eps(float32)" in str(r)


def test_assert_grads_raises_like_jax_test_util():
    assert interop.assert_grads(lambda x: jnp.sum(jnp.tanh(x) ** 2), jnp.linspace(0.0, 1.0, 4)).ok
    with pytest.raises(AssertionError, match="MISMATCH") as e:
        interop.assert_grads(lambda x: bad_tanh(x).sum(), jnp.linspace(-1, 1, 3))
    assert isinstance(e.value, tg.TapeError)


def test_warm_calls_reuse_the_trace():
    f = lambda x: jnp.sum(jnp.tanh(x) ** 2)  # noqa: E731
    interop.check_grads(f, jnp.ones(3))
    n = len(interop.oracle.check._PREP)
    interop.check_grads(f, jnp.zeros(3))
    assert len(interop.oracle.check._PREP) == n
    interop.check_grads(f, jnp.zeros(4))              # a new shape is a new trace
    assert len(interop.oracle.check._PREP) == n + 1


# ── no global state ──────────────────────────────────────────────────────────

_X64_OFF = r"""
import jax, numpy as np
before = {k: getattr(jax.config, k) for k in ("jax_enable_x64", "jax_default_matmul_precision")}
import interop, tapegrad as tg
from interop import jnp
assert {k: getattr(jax.config, k) for k in before} == before, "import changed jax.config"
r = interop.check_grads(lambda w: jnp.sum(jnp.tanh(w @ w)), np.eye(3))
assert r.ok and r.grads[0].dtype == np.float64, r
assert not jax.config.jax_enable_x64 and jnp.ones(2).dtype == jnp.float32, "the oracle leaked x64"
tape = tg.Tape()
w = tape.param(np.ones((3, 2)))
x = tape.const(np.ones((4, 3)))
loss = ((x @ w) ** 2).mean()
for dtype, ok in (("float64", False), ("float32", True)):
    prog = tg.capture(tape, loss, backend="numpy", dtype=dtype)
    call = interop.program_call(prog, native=False)
    args = [np.ones((3, 2), dtype), np.ones((4, 3), dtype)]
    try:
        out = call(*args)
        assert ok and out.dtype == np.float32, (dtype, out.dtype)
    except interop.ProgramError as e:
        assert not ok and "64-bit mode is off" in str(e) and "dtype='float32'" in str(e), e
with jax.enable_x64(True):
    prog = tg.capture(tape, loss, backend="numpy")
    assert float(interop.program_call(prog, native=False)(np.ones((3, 2)), np.ones((4, 3)))) == 9.0
print("ok")
"""


def test_interop_changes_no_jax_config_and_float64_programs_ask_for_x64():
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _X64_OFF], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_forward_value_divergence_is_located_at_its_first_equation(monkeypatch):
    # A replay rule gone wrong (here: a NaN where JAX has a value) must be found where it first appears.
    from interop.oracle import table as oracle_rules
    good = oracle_rules.RULES["tanh"]

    def leaky(r, xs, eqn):
        y = good(r, xs, eqn)
        return y * r.var(np.where(r.value(xs[0]) < 0, np.nan, 1.0))
    monkeypatch.setitem(oracle_rules.RULES, "tanh", leaky)
    r = interop.check_grads(lambda x: jnp.sum(jnp.exp(jnp.tanh(x * 2.0)) * 3.0), jnp.array([0.5, -1.0]))
    assert not r.ok and np.isnan(r.value)
    d = r.first_divergence
    assert d.kind == "value" and d.index == 1 and "tanh" in d.eqn and d.max_rel == np.inf


def test_pow_with_array_exponents_and_a_negative_base():
    x, y = jnp.array([-1.5, 2.0, 0.7]), jnp.array([2.0, 1.5, -0.5])
    r = interop.check_grads(lambda x, y: jnp.sum(x ** jnp.array([2.0, 3.0, 1.0]) + jnp.abs(x) ** y), x, y)
    assert r.ok and max(r.max_rel) <= 1e-12, str(r)


def test_empty_intermediates_and_associative_scan():
    f = lambda x: jnp.sum(lax.associative_scan(jnp.add, x) ** 2) + jnp.sum(x[3:3] * 2.0)  # noqa: E731
    before = interop.oracle.check.FULL_EVALUATIONS[0]
    r = interop.check_grads(f, jnp.asarray(RNG.standard_normal(8)))
    assert r.ok and r.verdict == "agree" and interop.oracle.check.FULL_EVALUATIONS[0] == before, str(r)


def test_nan_on_both_sides_is_not_called_agreement():
    r = interop.check_grads(lambda x: jnp.sqrt(x - 10.0).sum(), jnp.ones(3))
    assert not r.ok and r.verdict == "nonfinite"
    assert "NOT CHECKED (not finite on either side)" in str(r)
