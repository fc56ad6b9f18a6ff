"""``check_grads``' modes for functions ``jax.grad`` handles and the default trace did not (issue "the oracle
wherever jax.grad works"):

* ``precision="as_given"``: float32/bfloat16 leaves are not upgraded to float64; the caller's own float32
  ``jax.grad`` is compared, at float32's bound (√eps, the bound the replay states for a low-precision step);
* the float64 upgrade falling back to the given precision, with a note, when f makes float32 values of its
  own that the upgrade conflicts with (flax's ``initialize_carry`` in an ``nn.scan`` LSTM);
* ``concrete=True``: Python ``if``/``while`` on traced values, run as under ``jax.grad`` at these values.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import interop  # noqa: E402
from interop.oracle.replay import lowp_bound  # noqa: E402

F32_BOUND = lowp_bound(float(jnp.finfo(jnp.float32).eps), 1e-12)


# ── precision="as_given" ──────────────────────────────────────────────────────

def _flax_mlp():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in (8, 8):
                x = nn.tanh(nn.Dense(w)(x))
            return nn.Dense(3)(x)

    m = MLP()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), jnp.float32)
    labels = jnp.array([0, 2, 1, 1, 0, 2])
    v = m.init(jax.random.PRNGKey(0), x)   # flax's default: float32 parameters

    def loss(v, x, labels):
        logits = m.apply(v, x)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1).mean()
    return loss, v, x, labels


def test_a_float32_flax_model_is_checked_as_float32_against_the_callers_own_jax_grad():
    loss, v, x, labels = _flax_mlp()
    assert {a.dtype for a in jax.tree.leaves(v)} == {np.dtype(np.float32)}
    r = interop.check_grads(loss, v, x, labels, argnums=0, precision="as_given")
    assert r.ok and r.verdict == "agree", str(r)
    assert (r.mode, r.checked, r.bound) == ("as_given", "float32", F32_BOUND)
    assert "checked as given, in float32" in str(r) and "checked in float64" not in str(r)
    # JAX's side is the caller's float32 jax.grad, not a float64 one
    want = jax.grad(loss)(v, x, labels)
    for got, w in zip(jax.tree.leaves(r.jax_grads), jax.tree.leaves(want)):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np.asarray(w), rtol=1e-5, atol=1e-7)
    assert 0 < r.error <= F32_BOUND   # float32 rounding against the tape's float64 sweep, well inside the bound


def test_the_default_still_upgrades_to_float64():
    loss, v, x, labels = _flax_mlp()
    r = interop.check_grads(loss, v, x, labels, argnums=0)
    assert r.ok and (r.mode, r.checked, r.bound) == ("float64", "float64", 1e-12), str(r)
    assert "float32 arguments were checked in float64" in str(r)
    assert all(np.asarray(g).dtype == np.float64 for g in jax.tree.leaves(r.jax_grads))


def test_as_given_keeps_float32_under_the_callers_x64_too():
    w = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    with jax.enable_x64(True):
        r = interop.check_grads(lambda w: jnp.sum(jnp.tanh(w) * jnp.arange(5.0)), w, precision="as_given")
    assert r.ok and r.checked == "float32" and r.jax_grads[0].dtype == np.float32, str(r)


def _wrong_sq(factor):
    @jax.custom_vjp
    def sq(x):
        return x * x
    sq.defvjp(lambda x: (x * x, x), lambda x, g: (factor * x * g,))
    return sq


@pytest.mark.parametrize("factor, ok", [(2.0, True), (2.004, False), (-2.0, False)])
def test_a_wrong_float32_custom_vjp_is_caught_at_float32s_bound(factor, ok):
    sq = _wrong_sq(factor)
    w = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    r = interop.check_grads(lambda w: jnp.sum(sq(jnp.tanh(w))), w, precision="as_given")
    assert r.ok is ok and r.bound == F32_BOUND and r.checked == "float32", str(r)
    if not ok:   # 0.2% off is 6x float32's bound: caught, and located at the rule by its name
        assert r.error > F32_BOUND and r.first_divergence.rule == "sq"


def test_bfloat16_as_given_is_held_to_bfloat16s_bound():
    w = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.bfloat16)
    r = interop.check_grads(lambda w: jnp.sum(jnp.sin(w) ** 2).astype(jnp.float32), w, precision="as_given")
    assert r.ok and r.checked == "bfloat16", str(r)
    assert r.bound == lowp_bound(float(jnp.finfo(jnp.bfloat16).eps), 1e-12)


def test_assert_grads_passes_precision_through():
    w = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    r = interop.assert_grads(lambda w: jnp.sum(jnp.tanh(w) ** 2), w, precision="as_given")
    assert r.mode == "as_given"
    sq = _wrong_sq(2.004)
    with pytest.raises(interop.GradientMismatchError, match="checked as given, in float32"):
        interop.assert_grads(lambda w: jnp.sum(sq(w)), w, precision="as_given")


@pytest.mark.parametrize("bad", ["float32", "as-given", None, 64])
def test_a_wrong_precision_is_named_with_the_allowed_values(bad):
    with pytest.raises(interop.CheckGradsError, match=r"precision must be 'float64' .* or 'as_given' .*got " +
                       repr(bad).replace("'", "'")):
        interop.check_grads(lambda x: x.sum(), jnp.ones(3), precision=bad)


def test_a_wrong_concrete_is_named():
    with pytest.raises(interop.CheckGradsError, match=r"concrete must be None \(automatic\), True or False, got 'yes'"):
        interop.check_grads(lambda x: x.sum(), jnp.ones(3), concrete="yes")


# ── the float64 upgrade falling back to the given precision ──────────────────

def test_a_flax_scan_lstm_with_a_float32_carry_is_checked_as_float32_and_says_why():
    nn = pytest.importorskip("flax.linen")

    class ScanLSTM(nn.Module):
        @nn.compact
        def __call__(self, xs):
            cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params", split_rngs={"params": False},
                           in_axes=1, out_axes=1)(features=4)
            carry = cell.initialize_carry(jax.random.PRNGKey(9), xs[:, 0].shape)   # float32, always
            return cell(carry, xs)[1]

    m = ScanLSTM()
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 3)), jnp.float32)
    v = m.init(jax.random.PRNGKey(0), xs)
    f = lambda v, xs: jnp.sum(m.apply(v, xs)[:, -1] ** 2)  # noqa: E731
    r = interop.check_grads(f, v, xs)
    assert r.ok and (r.mode, r.checked, r.bound) == ("as_given", "float32", F32_BOUND), str(r)
    note = " ".join(r.notes)
    assert "carry input and carry output must have equal types" in note
    assert "checked at the arguments' own precision, float32" in note
    # the second (cached) call takes the same way
    r2 = interop.check_grads(f, v, xs)
    assert r2.ok and r2.mode == "as_given" and r2.notes == r.notes


def test_a_type_error_that_is_not_the_upgrades_is_raised_as_it_is():
    with pytest.raises(TypeError, match="unsupported operand"):
        interop.check_grads(lambda x: (x + "a").sum(), jnp.ones(3, jnp.float32))


# ── concrete=True: Python control flow as under jax.grad ─────────────────────

def test_python_branches_on_traced_values_say_concrete_true_is_the_way():
    f = lambda x: jnp.sum(x) * 2 if jnp.sum(x) > 0 else -jnp.sum(x)  # noqa: E731
    with pytest.raises(interop.TracingError, match=r"leave concrete unset \(or pass concrete=True\)"):
        interop.check_grads(f, jnp.ones(3), concrete=False)


def test_optax_warmup_cosine_decay_schedule_inside_a_loss():
    optax = pytest.importorskip("optax")

    def loss(peak, w):
        # optax: `alpha = 0.0 if peak_value == 0.0 else end_value / peak_value`, a Python branch on peak
        sched = optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps=3, decay_steps=10, end_value=1e-3)
        return sum(sched(t) * jnp.sum(jnp.sin(w * t)) for t in range(6))
    args = (jnp.asarray(0.1), jnp.linspace(0.5, 1.5, 3))
    with pytest.raises(interop.TracingError):
        interop.check_grads(loss, *args, concrete=False)
    r = interop.check_grads(loss, *args, concrete=True)
    assert r.ok, str(r)
    assert len(r.branches) == 1 and "_schedule.py" in r.branches[0] and "bool → False" in r.branches[0]
    assert "peak_value == 0.0" in r.branches[0] and "at these argument values only" in str(r)
    with jax.enable_x64(True):
        want = jax.grad(loss, argnums=(0, 1))(jnp.asarray(0.1, jnp.float64), jnp.linspace(0.5, 1.5, 3))
    for got, w in zip(r.jax_grads, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-12)


def _newton_sqrt(a):
    x = a
    while jnp.abs(x * x - a) > 1e-12 * a:     # until converged: as many steps as these values take
        x = 0.5 * (x + a / x)
    return x * jnp.sin(a)


@pytest.mark.parametrize("a", [2.0, 30.0])
def test_a_python_while_loop_until_converged_is_checked_along_the_iterations_that_ran(a):
    r = interop.check_grads(_newton_sqrt, jnp.asarray(a), concrete=True)
    assert r.ok and r.verdict == "agree", str(r)
    with jax.enable_x64(True):
        want = float(jax.grad(_newton_sqrt)(jnp.asarray(a, jnp.float64)))
    assert abs(float(r.jax_grads[0]) - want) <= 1e-12 * abs(want)
    assert abs(want - (np.sin(a) / (2 * np.sqrt(a)) + np.sqrt(a) * np.cos(a))) < 1e-9
    (line,) = r.branches
    assert "while jnp.abs(x * x - a)" in line and "bool → True ×" in line and line.count("False") == 1


def test_another_value_taking_another_branch_is_another_trace():
    f = lambda x: jnp.sin(x) if x > 0 else x ** 3  # noqa: E731
    hi = interop.check_grads(f, jnp.asarray(1.0), concrete=True)
    lo = interop.check_grads(f, jnp.asarray(-1.0), concrete=True)
    assert hi.ok and lo.ok
    assert abs(float(hi.grads[0]) - np.cos(1.0)) < 1e-12 and abs(float(lo.grads[0]) - 3.0) < 1e-12
    assert "bool → True" in hi.branches[0] and "bool → False" in lo.branches[0]
    again = interop.check_grads(f, jnp.asarray(2.0), concrete=True)   # the cached trace of the True branch
    assert again.ok and abs(float(again.grads[0]) - np.cos(2.0)) < 1e-12


def test_concrete_int_and_index_reads_work_as_under_jax_grad():
    def f(x, n):
        k = int(jnp.argmax(x))            # an index read from the values
        return jnp.sum(x[:k + 1] ** 2) * jnp.sum(jnp.ones(int(n)))
    x = jnp.asarray([0.5, 2.0, 1.0, -1.0])
    r = interop.check_grads(f, x, jnp.asarray(3), argnums=0, concrete=True)
    assert r.ok, str(r)
    np.testing.assert_allclose(np.asarray(r.grads), [3.0, 12.0, 0.0, 0.0], rtol=1e-12)
    assert len(r.branches) == 2 and all(" int → " in b for b in r.branches)


def test_concrete_with_as_given_checks_the_float32_path():
    w = jnp.linspace(0.1, 1.0, 4, dtype=jnp.float32)
    f = lambda w: jnp.sum(jnp.tanh(w)) if jnp.max(w) < 2 else jnp.sum(w)  # noqa: E731
    r = interop.check_grads(f, w, concrete=True, precision="as_given")
    assert r.ok and r.checked == "float32" and r.branches, str(r)


def test_what_jax_grad_cannot_make_concrete_either_is_a_clear_error():
    # float() of a traced value: jax.grad refuses it too
    f = lambda x: jnp.sin(x).sum() * float(x.sum())  # noqa: E731
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.grad(f)(jnp.ones(3))
    with pytest.raises(interop.TracingError, match=r"concrete=True.*abstract even there.*float\(\)"):
        interop.check_grads(f, jnp.ones(3), concrete=True)
    # a Python branch inside jax.jit: abstract under jax.grad as well
    g = jax.jit(lambda x: x * 2 if x.sum() > 0 else x)
    with pytest.raises(interop.TracingError, match=r"inside a jax.jit"):
        interop.check_grads(lambda x: g(x).sum(), jnp.ones(3), concrete=True)


def test_the_patch_is_gone_after_a_concrete_check():
    from jax._src.interpreters import partial_eval as pe
    interop.check_grads(lambda x: x.sum() if x.sum() > 0 else -x.sum(), jnp.ones(3), concrete=True)
    assert "to_concrete_value" not in pe.DynamicJaxprTracer.__dict__
    with pytest.raises(interop.TracingError):
        interop.check_grads(lambda x: x.sum() if x.sum() > 0 else -x.sum(), jnp.ones(3), concrete=False)


# ── cold checks: one compile per distinct loop body ──────────────────────────

def test_identical_loop_bodies_are_one_object_so_compiled_once():
    from interop.oracle import check as O

    def ns(g):   # a Newton–Schulz-like scan, traced anew (a new jaxpr object) at every call
        return jax.lax.scan(lambda x, _: (1.5 * x - 0.5 * x @ x.T @ x, None), g / jnp.linalg.norm(g), None,
                            length=3)[0]

    def f(w):
        u = ns(jnp.tanh(w))
        return jnp.sum(ns(w - 0.1 * u) ** 2)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 3)))
    with jax.enable_x64(True):
        raw = jax.make_jaxpr(f)(w)
    bodies = [e.params["jaxpr"] for e in raw.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(bodies) == 2 and bodies[0] is not bodies[1] and str(bodies[0]) == str(bodies[1])
    shared = O._shared_bodies(raw)
    a, b = [e.params["jaxpr"] for e in shared.jaxpr.eqns if e.primitive.name == "scan"]
    assert a is b
    r = interop.check_grads(f, w)
    assert r.ok, str(r)
    with jax.enable_x64(True):
        np.testing.assert_allclose(r.grads[0], np.asarray(jax.grad(f)(w)), rtol=1e-10, atol=1e-12)
