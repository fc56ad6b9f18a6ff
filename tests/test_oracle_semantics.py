"""The oracle's replay semantics on code written the way real code is: low-precision floats (bfloat16,
float16), per-leaf rows of gradients that are zero on both sides, custom rules named and trusted,
non-array leaves in the arguments, batched while loops."""
import numpy as np
import pytest

pytest.importorskip("interop")
import interop  # noqa: E402
from interop import jax, jnp  # noqa: E402


def _fd(f, leaves, h=1e-6):
    """Central differences of f over a list of float64 arrays (one gradient per array)."""
    out = []
    for i, a in enumerate(leaves):
        g = np.zeros(a.shape)
        for j in np.ndindex(a.shape):
            up, dn = [np.array(x, np.float64) for x in leaves], [np.array(x, np.float64) for x in leaves]
            up[i][j] += h
            dn[i][j] -= h
            g[j] = (f(up) - f(dn)) / (2 * h)
        out.append(g)
    return out


def _close(a, b, bound):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) <= bound * max(1.0, float(np.abs(b).max()))


# ── 1. bfloat16 and float16 are floats ───────────────────────────────────────────────

def test_a_flax_dense_computing_in_bfloat16_is_checked_at_bfloat16s_bound():
    nn = pytest.importorskip("flax.linen")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    model = nn.Dense(3, dtype=jnp.bfloat16)                       # the standard mixed-precision setup
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p):
        return jnp.sum(model.apply(p, x).astype(jnp.float32) ** 2)
    r = interop.check_grads(loss, params)
    assert r.ok and r.verdict == "agree", str(r)
    assert r.precision.dtype == "bfloat16" and r.bound == pytest.approx(np.sqrt(2.0 ** -7))
    assert "float32 arguments were checked in float64" in r.notes
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        ref = jax.grad(loss)(p64)
        exact = nn.Dense(3, dtype=jnp.float64, param_dtype=jnp.float64)
        kb = [np.asarray(p64["params"]["kernel"]), np.asarray(p64["params"]["bias"])]
        fd = _fd(lambda ls: float(jnp.sum(exact.apply({"params": {"kernel": ls[0], "bias": ls[1]}},
                                                       jnp.asarray(x, jnp.float64)) ** 2)), kb)
    for name, g_fd in zip(("kernel", "bias"), fd):
        assert _close(r.grads[0]["params"][name], ref["params"][name], r.bound)    # jax.grad, at the bound
        assert _close(r.grads[0]["params"][name], g_fd, r.bound)                   # the float64 derivative


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_arguments_are_differentiated_in_float64(dtype):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 3)), dtype)
    x = rng.standard_normal((5, 3))

    def loss(w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    r = interop.check_grads(loss, w)
    assert r.ok and r.bound == 1e-12 and r.precision is None, str(r)
    assert f"{np.dtype(dtype)} arguments were checked in float64" in r.notes
    w64 = np.asarray(w, np.float64)
    with jax.enable_x64(True):
        ref = jax.grad(loss)(jnp.asarray(w64))
    assert _close(r.grads[0], ref, 1e-12)
    assert _close(r.grads[0], _fd(lambda ls: float(np.sum(np.tanh(x @ ls[0]) ** 2)), [w64])[0], 1e-7)


# ── 2. gradients zero on both sides up to rounding ─────────────────────────────────

def test_the_attention_key_bias_row_says_both_sides_are_rounding_noise():
    nn = pytest.importorskip("flax.linen")
    x = np.random.default_rng(0).standard_normal((1, 3, 4))
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)
    params = model.init(jax.random.PRNGKey(0), x)
    r = interop.check_grads(lambda p: jnp.sum(model.apply(p, x) ** 2), params)
    assert r.ok, str(r)
    row = next(line for line in str(r).splitlines() if "['key']['bias']" in line)
    assert "both ≈ 0: rounding noise" in row and "rel=" not in row, row
    # softmax is shift-invariant per query, so the key bias's true gradient is 0: both sides hold rounding only
    kb = r.grads[0]["params"]["key"]["bias"]
    with jax.enable_x64(True):
        ref = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params))["params"]["key"]["bias"]
    assert max(np.abs(kb).max(), np.abs(ref).max()) <= 1e-12 * r.scale
    others = [line for line in str(r).splitlines() if "kernel']" in line]
    assert others and all("rel=" in line for line in others)     # real gradients keep their relative error


# ── 3. custom rules meant to differ: named, and trusted on request ───────────────────

@jax.custom_vjp
def grad_reverse(x):
    """A gradient-reversal layer (domain-adversarial training): identity forward, negated gradient."""
    return x


grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-g,))


def _adversarial(params, x, y, d):
    """Shared features, a task head, and a domain head behind gradient reversal."""
    h = jnp.tanh(x @ params["features"])
    task = jnp.mean((h @ params["task"] - y) ** 2)
    domain = jnp.mean(jax.nn.softplus(-d * (grad_reverse(h) @ params["domain"])))
    return task + domain


def _adversarial_data():
    rng = np.random.default_rng(2)
    params = {"features": rng.standard_normal((3, 4)) * 0.5, "task": rng.standard_normal((4, 1)),
              "domain": rng.standard_normal((4, 1))}
    return params, rng.standard_normal((5, 3)), rng.standard_normal((5, 1)), rng.choice([-1.0, 1.0], (5, 1))


def test_a_gradient_reversal_layer_is_reported_at_its_rule_and_passes_when_trusted():
    params, x, y, d = _adversarial_data()
    r = interop.check_grads(_adversarial, params, x, y, d, argnums=0)
    assert not r.ok and r.verdict == "mismatch"
    assert r.first_divergence.rule == "grad_reverse", str(r)
    assert "custom_vjp_call[name=grad_reverse]" in r.first_divergence.eqn
    assert "(vjp of custom rule grad_reverse)" in str(r.first_divergence)
    assert any("trust=('grad_reverse',)" in n for n in r.notes), r.notes
    t = interop.check_grads(_adversarial, params, x, y, d, argnums=0, trust=("grad_reverse",))
    assert t.ok and t.verdict == "agree" and t.bound == 1e-12, str(t)
    with jax.enable_x64(True):
        ref = jax.grad(_adversarial)(params, x, y, d)
    # independently: reversal makes the features' gradient that of task − domain, the heads' that of task + domain
    names = ("features", "task", "domain")

    def split(sign):
        def f(ls):
            p = dict(zip(names, ls))
            h = np.tanh(x @ p["features"])
            task = np.mean((h @ p["task"] - y) ** 2)
            dom = np.mean(np.logaddexp(0.0, -d * (h @ p["domain"])))
            return task + sign * dom
        return _fd(f, [params[n] for n in names])
    minus, plus = split(-1.0), split(1.0)
    for k, n in enumerate(names):
        assert _close(t.grads[n], ref[n], 1e-12)
        assert _close(t.grads[n], (minus if n == "features" else plus)[k], 1e-7)


def test_a_trusted_rule_leaves_the_rest_of_the_function_checked():
    params, x, y, d = _adversarial_data()

    @jax.custom_vjp
    def bad_tanh(z):                                  # a wrong rule elsewhere: 1 − tanh instead of 1 − tanh²
        return jnp.tanh(z)
    bad_tanh.defvjp(lambda z: (jnp.tanh(z), jnp.tanh(z)), lambda t, g: (g * (1 - t),))

    def f(p):
        h = bad_tanh(x @ p["features"])
        return jnp.mean((h @ p["task"] - y) ** 2) + jnp.mean(grad_reverse(h) @ p["domain"])
    r = interop.check_grads(f, params, trust="grad_reverse")
    assert not r.ok and r.first_divergence.rule == "bad_tanh", str(r)


def test_optax_scale_gradient_is_trusted_by_its_name_with_or_without_the_underscore():
    optax = pytest.importorskip("optax")
    w = np.linspace(-1.0, 1.0, 6).reshape(2, 3)

    def f(w):
        return jnp.sum(optax.scale_gradient(jnp.tanh(w), 0.5) ** 2)
    r = interop.check_grads(f, w)
    assert not r.ok and r.first_divergence.rule == "_scale_gradient", str(r)
    for name in ("scale_gradient", "_scale_gradient"):
        t = interop.check_grads(f, w, trust=(name,))
        assert t.ok, str(t)
        # d/dw of sum(tanh²) scaled by 0.5
        assert _close(t.grads[0], 0.5 * 2 * np.tanh(w) * (1 - np.tanh(w) ** 2), 1e-12)


def test_a_straight_through_estimator_passes_trusted():
    @jax.custom_vjp
    def ste_round(x):
        return jnp.round(x)
    ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
    w = np.array([[0.3, -1.2], [2.6, 0.8]])
    x = np.array([[1.0, 0.5], [-0.25, 2.0]])

    def f(w):
        return jnp.sum((x @ ste_round(w * 4.0) / 4.0) ** 2)
    assert not interop.check_grads(f, w).ok
    t = interop.check_grads(f, w, trust=("ste_round",))
    assert t.ok, str(t)
    q = np.round(w * 4.0) / 4.0
    assert _close(t.grads[0], x.T @ (2 * (x @ q)), 1e-12)          # the straight-through gradient


def test_trusting_a_name_f_does_not_have_is_an_error_naming_its_rules():
    params, x, y, d = _adversarial_data()
    with pytest.raises(interop.CheckGradsError, match=r"trust names \['grad_revers'\], but f has no "
                       r"custom_vjp/custom_jvp rule of that name \(its custom rules: \['grad_reverse'"):
        interop.check_grads(_adversarial, params, x, y, d, argnums=0, trust=("grad_revers",))



# ── 4. non-array leaves in the arguments are static ────────────────────────────────

def test_a_whole_equinox_module_as_the_argument_is_checked_as_eqx_filter_grad_differentiates_it():
    eqx = pytest.importorskip("equinox")
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 1))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    with jax.enable_x64(True):
        model = eqx.nn.MLP(3, 1, 4, 2, activation=jax.nn.gelu, key=jax.random.PRNGKey(0), dtype=jnp.float64)
        ref = eqx.filter_grad(loss)(model, x, y)
    r = interop.check_grads(loss, model, x, y, argnums=0)
    assert r.ok and r.verdict == "agree", str(r)
    assert any(n.startswith("2 non-array leaves held static") and "arg 0.activation" in n for n in r.notes), r.notes
    assert r.grads.activation is None and r.grads.final_activation is None        # as filter_grad gives
    mine, theirs = jax.tree.leaves(r.grads), jax.tree.leaves(ref)
    assert len(mine) == len(theirs) == 6
    for a, b in zip(mine, theirs):
        assert _close(a, b, 1e-12)
    last = model.layers[-1]
    with jax.enable_x64(True):
        fd = _fd(lambda ls: float(loss(eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), model,
                                                      (jnp.asarray(ls[0]), jnp.asarray(ls[1]))), x, y)),
                 [np.asarray(last.weight), np.asarray(last.bias)])
    assert _close(r.grads.layers[-1].weight, fd[0], 1e-7) and _close(r.grads.layers[-1].bias, fd[1], 1e-7)


# ── 5. vmap of a while loop with a per-example stopping condition ──────────────────────

def _newton(f, x0, tol=1e-12):
    def cond(c):
        x, k = c
        return (jnp.abs(f(x)) > tol) & (k < 60)

    def body(c):
        x, k = c
        return x - f(x) / jax.grad(f)(x), k + 1
    return jax.lax.while_loop(cond, body, (x0, 0))[0]


def _cube_root(a):
    return jax.lax.custom_root(lambda x: x ** 3 - a, a, _newton, lambda g, y: y / g(1.0))


def test_a_batched_newton_solve_runs_while_any_lane_is_active_with_finished_lanes_frozen():
    # 0.5 converges in a few steps, 100.0 after many (a lane starting at its root would take none, and the
    # tape would then differentiate the identity: the custom rule against a body that did not iterate)
    a = np.array([0.5, 2.0, 9.0, 100.0])
    w = np.arange(1.0, 5.0)

    def loss(a):
        return jnp.sum(jax.vmap(_cube_root)(a) * w)
    r = interop.check_grads(loss, a)
    assert r.ok and r.verdict == "agree" and r.bound == 1e-12, str(r)
    assert r.value == pytest.approx(float(np.sum(np.cbrt(a) * w)), rel=1e-14)   # no lane stepped past its root
    with jax.enable_x64(True):
        ref = jax.grad(loss)(jnp.asarray(a))
    exact = w / (3.0 * np.cbrt(a) ** 2)             # d/da a^(1/3)
    assert _close(r.grads[0], ref, 1e-12) and _close(r.grads[0], exact, 1e-10)


def test_a_batched_bisection_inside_a_custom_vjp_is_replayed_lane_by_lane():
    @jax.custom_vjp
    def inverse_softplus(y):                        # bisection for x with softplus(x) = y, per example
        def cond(c):
            lo, hi = c
            return hi - lo > 1e-13 * (1 + jnp.abs(hi))

        def body(c):
            lo, hi = c
            mid = (lo + hi) / 2
            up = jax.nn.softplus(mid) < y
            return jnp.where(up, mid, lo), jnp.where(up, hi, mid)
        lo, hi = jax.lax.while_loop(cond, body, (y - 30.0, y + 30.0))
        return (lo + hi) / 2
    inverse_softplus.defvjp(lambda y: (inverse_softplus(y), inverse_softplus(y)),
                            lambda x, g: (g / jax.nn.sigmoid(x),))
    y = np.array([0.1, 0.7, 2.0, 5.0])

    def loss(y):
        return jnp.sum(jax.vmap(inverse_softplus)(y) ** 2)
    r = interop.check_grads(loss, y)
    # the bisection's body is piecewise constant in y: the tape's gradient of it is 0, the rule's is not
    assert not r.ok and r.first_divergence.rule == "inverse_softplus", str(r)
    x = np.log(np.expm1(y))
    with jax.enable_x64(True):
        ref = jax.grad(loss)(jnp.asarray(y))
    assert _close(ref, 2 * x / (1 / (1 + np.exp(-x))), 1e-9)        # JAX's side is the implicit derivative
    assert r.value == pytest.approx(float(np.sum(x ** 2)), rel=1e-9)  # the lanes' roots, replayed
