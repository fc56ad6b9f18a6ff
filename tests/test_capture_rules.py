"""Custom derivative rules and kinks under capture: interop.value_and_grad follows each custom_jvp/custom_vjp
rule as jax.grad does (relu's 0 at 0, a straight-through estimator's identity, a reversal layer's −λ·g),
where the oracle (check_grads) replays the body and reports the rule.

Bounds: float64 1e-12 relative to the largest gradient (XLA and the tape sum in other orders); float32 1e-5.
"""
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import interop  # noqa: E402
from pytree_rel import rel  # noqa: E402
from interop import CaptureError  # noqa: E402

BACKENDS = ("numpy", "native")


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def same_as_jax(vg, fn, *args, bound=1e-12, argnums=0):
    (v, g), (jv, jg) = jax.jit(vg)(*args), jax.value_and_grad(fn, argnums=argnums)(*args)
    assert float(v) == float(jv) or abs(float(v) - float(jv)) <= bound * max(1.0, abs(float(jv))), (v, jv)
    assert rel(g, jg) <= bound, rel(g, jg)
    return g, jg


# ── relu at exactly zero ─────────────────────────────────────────────────────

def relu_layer(p, x):
    return jnp.sum(jax.nn.relu(x @ p["w"] + p["b"]) * jnp.arange(1.0, 4.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_at_exactly_zero_gets_jax_s_zero_slope(backend):
    """Blank inputs and a zero bias put every pre-activation of the first rows on relu's kink: jax.grad's
    rule gives them slope 0 (the body max(x, 0) would give 1/2)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((4, 3))), "b": jnp.zeros(3)}
    x = jnp.asarray(rng.standard_normal((6, 4))).at[:3].set(0.0)
    vg = interop.value_and_grad(relu_layer, p, x, backend=backend)
    g, jg = same_as_jax(vg, relu_layer, p, x)
    assert float(np.abs(np.asarray(g["b"])).max()) > 0
    # the half slope of the body's tie rule would be 1.5 units per kinked row away
    body = jax.grad(lambda p, x: jnp.sum(jnp.maximum(x @ p["w"] + p["b"], 0.0) * jnp.arange(1.0, 4.0)))(p, x)
    assert float(np.abs(np.asarray(body["b"]) - np.asarray(jg["b"])).min()) == 1.5 * 1   # three kinked rows · ½
    report = interop.check_grads(relu_layer, p, x)   # the oracle still replays the body, and says so
    assert report.kinks


@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_kinks_in_float32(backend):
    with jax.enable_x64(False):
        rng = np.random.default_rng(1)
        p = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
        x = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32).at[::2].set(0.0)
        vg = interop.value_and_grad(relu_layer, p, x, backend=backend)
        assert vg.captured.program.dtype == np.float32
        same_as_jax(vg, relu_layer, p, x, bound=1e-5)


# ── rules that differ from their bodies on purpose ───────────────────────────

@jax.custom_jvp
def ste_round(x):
    return jnp.round(x)


ste_round.defjvp(lambda primals, tangents: (ste_round(primals[0]), tangents[0]))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reverse_gradient(x, lam):
    return x


reverse_gradient.defvjp(lambda x, lam: (x, None), lambda lam, _, g: (-lam * g,))


@jax.custom_vjp
def sigmoid_by_hand(x):
    return 1 / (1 + jnp.exp(-x))


def _sig_fwd(x):
    y = sigmoid_by_hand(x)
    return y, y


sigmoid_by_hand.defvjp(_sig_fwd, lambda y, g: (g * y * (1 - y),))


def quantised(p, x):
    """Quantisation-aware training: a straight-through estimator on 4-level weights."""
    wq = ste_round(jnp.tanh(p["w"]) * 2) / 2
    return jnp.mean((x @ wq - 1.0) ** 2)


def domain_adversarial(p, x):
    """A gradient-reversal layer between a feature extractor and a domain head."""
    f = jnp.tanh(x @ p["f"])
    return jnp.mean(sigmoid_by_hand(reverse_gradient(f, 0.3) @ p["d"]) ** 2) + jnp.mean(f ** 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_straight_through_estimator_passes_the_gradient_the_body_would_zero(backend):
    rng = np.random.default_rng(2)
    p, x = {"w": jnp.asarray(rng.standard_normal((5, 3)))}, jnp.asarray(rng.standard_normal((8, 5)))
    vg = interop.value_and_grad(quantised, p, x, backend=backend)
    g, _ = same_as_jax(vg, quantised, p, x)
    assert float(np.abs(np.asarray(g["w"])).min()) > 0   # round's own derivative is 0 everywhere
    for k in range(3):   # new points: the rule is recorded, not its value at the example
        q = jax.tree.map(lambda a: a * (1 + 0.3 * k), p)
        same_as_jax(vg, quantised, q, x[::-1] + k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_reversal_and_a_hand_written_vjp_follow_their_bwd(backend):
    rng = np.random.default_rng(3)
    p = {"f": jnp.asarray(rng.standard_normal((4, 6))), "d": jnp.asarray(rng.standard_normal((6, 1)))}
    x = jnp.asarray(rng.standard_normal((10, 4)))
    vg = interop.value_and_grad(domain_adversarial, p, x, backend=backend)
    g, jg = same_as_jax(vg, domain_adversarial, p, x)
    plain = jax.grad(without_reversal)(p, x)
    assert rel(jg["f"], plain["f"]) > 0.01          # the reversal matters to the extractor's gradient
    assert rel(g["d"], plain["d"]) <= 1e-12         # and not to the head's


def without_reversal(p, x):
    f = jnp.tanh(x @ p["f"])
    return jnp.mean(jax.nn.sigmoid(f @ p["d"]) ** 2) + jnp.mean(f ** 2)


def clip_gradient(lo, hi, x):
    return _clip_gradient(x, lo, hi)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _clip_gradient(x, lo, hi):
    return x


_clip_gradient.defvjp(lambda x, lo, hi: (x, None), lambda lo, hi, _, g: (jnp.clip(g, lo, hi),))


def test_a_bwd_not_linear_in_the_cotangent_is_refused_by_name():
    loss = lambda w, x: jnp.sum(clip_gradient(-0.1, 0.1, x @ w) ** 2)   # noqa: E731
    with pytest.raises(CaptureError, match=r"custom rule '_clip_gradient'.*bwd is not linear in the cotangent"):
        interop.value_and_grad(loss, jnp.ones((3, 2)), jnp.ones((4, 3)), backend="numpy")


# ── real library functions at their special points ───────────────────────────

def kinked_points():
    """Exact zeros, ties, relu6's 6, large magnitudes, and ordinary values."""
    return jnp.array([[0.0, -0.0, 6.0, 1e-30, -3.0], [2.5, -1e3, 40.0, 0.0, 0.5]])


LIBRARY = {
    "relu": jax.nn.relu, "relu6": jax.nn.relu6, "leaky_relu": jax.nn.leaky_relu, "elu": jax.nn.elu,
    "celu": jax.nn.celu, "selu": jax.nn.selu, "gelu": jax.nn.gelu, "silu": jax.nn.silu,
    "softplus": jax.nn.softplus, "log_sigmoid": jax.nn.log_sigmoid, "hard_tanh": jax.nn.hard_tanh,
    "softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
    "logaddexp": lambda x: jnp.logaddexp(x, 0.0), "abs": jnp.abs, "maximum": lambda x: jnp.maximum(x, 0.0),
    "clip": lambda x: jnp.clip(x, 0.0, 6.0), "xlogy": lambda x: jax.scipy.special.xlogy(x, x * x + 1),
    "logsumexp": lambda x: jax.scipy.special.logsumexp(x, axis=-1, keepdims=True),
    "safe_norm": lambda x: optax.safe_norm(x, 1e-6, axis=-1, keepdims=True),
    "sinc": jnp.sinc, "xlog1py": lambda x: jax.scipy.special.xlog1py(x, jnp.abs(x)),
    "entr": lambda x: jax.scipy.special.entr(jnp.abs(x)), "log1mexp": lambda x: jax.nn.log1mexp(jnp.abs(x) + 0.1),
    "logit": lambda x: jax.scipy.special.logit(jax.nn.sigmoid(x)), "sparse_plus": jax.nn.sparse_plus,
    "squareplus": jax.nn.squareplus, "mish": jax.nn.mish, "hard_swish": jax.nn.hard_swish,
    "glu": lambda x: jax.nn.glu(jnp.concatenate([x, -x], -1)),
    "det": lambda x: jnp.linalg.det(x[:, :2] + jnp.eye(2)) * jnp.ones_like(x),
    "slogdet": lambda x: jnp.linalg.slogdet(x[:, :2] + 3 * jnp.eye(2))[1] * jnp.ones_like(x),
    "norm": lambda x: jnp.linalg.norm(x, axis=-1, keepdims=True) * jnp.ones_like(x),
    "huber_loss": optax.huber_loss, "sigmoid_bce": lambda x: optax.sigmoid_binary_cross_entropy(x, jnp.ones_like(x)),
    "scale_gradient": lambda x: optax.scale_gradient(x, 0.3),
}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_functions_at_their_kinks_match_jax_grad(name):
    fn = LIBRARY[name]
    w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5)))

    def loss(x, w):
        return jnp.sum(fn(x) * w)
    x = kinked_points()
    if " lu " in str(jax.make_jaxpr(jax.grad(loss))(x, w)):
        # jax 0.12.1's det: a custom_jvp whose tangent solves with the primal's LU (0.10's 2x2 det is a
        # formula), which a program cannot keep for later calls: refused, naming lu and what to do
        with pytest.raises(interop.UnsupportedPrimitiveError, match=r"equation \d+ \(.* = lu .*\) uses lu: .*train "
                                                                    r"this function with jax.jit"):
            interop.value_and_grad(loss, x, w, backend="numpy")
        return
    vg = interop.value_and_grad(loss, x, w, backend="numpy")
    same_as_jax(vg, loss, x, w)
    same_as_jax(vg, loss, -x, w)


# ── rules one tapegrad op computes: recorded as that op ─────────────────────

@jax.custom_jvp
def relu(x):   # the name of jax.nn.relu, another rule: slope 1 at 0
    return jnp.maximum(x, 0.0)


relu.defjvp(lambda primals, tangents: (relu(primals[0]), jnp.where(primals[0] >= 0, tangents[0], 0.0)))


def test_jax_nn_relu_is_one_relu_node_and_a_rule_of_the_same_name_is_not():
    x = jnp.array([[0.0, 1.0, -1.0, 0.0]])
    theirs = lambda w, x: jnp.sum(jax.nn.relu(x * w) * jnp.arange(1.0, 5.0))   # noqa: E731
    mine = lambda w, x: jnp.sum(relu(x * w) * jnp.arange(1.0, 5.0))            # noqa: E731
    w = jnp.ones(4)
    a = interop.value_and_grad(theirs, w, x, backend="numpy")
    b = interop.value_and_grad(mine, w, x, backend="numpy")
    names = lambda vg: [node[0].name for node in vg.captured.program.nodes]   # noqa: E731
    assert names(a).count("relu") == 1 and "with_grad" not in names(a)
    assert "relu" not in names(b) and "with_grad" in names(b)
    same_as_jax(a, theirs, w, x)
    same_as_jax(b, mine, w, x)
    assert float(jax.grad(mine)(w, x)[0]) == 0.0 and float(jax.grad(mine)(w + 0.5, x + 0.0)[3]) == 0.0


def test_softmax_as_a_custom_jvp_is_one_softmax_node():
    prior = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", True)
    try:
        loss = lambda w, x: jnp.sum(jax.nn.softmax(x @ w, axis=-1) * jnp.arange(3.0))   # noqa: E731
        rng = np.random.default_rng(5)
        w, x = jnp.asarray(rng.standard_normal((4, 3))), jnp.asarray(rng.standard_normal((5, 4)))
        vg = interop.value_and_grad(loss, w, x, backend="native")
        assert [n[0].name for n in vg.captured.program.nodes].count("softmax") == 1
        same_as_jax(vg, loss, w, x)
        assert rel(jax.vmap(lambda w: vg(w, x)[1])(jnp.stack([w, -w])),
                   jax.vmap(lambda w: jax.grad(loss)(w, x))(jnp.stack([w, -w]))) <= 1e-12
    finally:
        jax.config.update("jax_softmax_custom_jvp", prior)
