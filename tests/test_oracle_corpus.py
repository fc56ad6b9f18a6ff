"""A corpus of real JAX functions through ``interop.check_grads``: installed libraries' functions called
directly (optax losses, jax.nn, jax.scipy, jax.example_libraries.stax layers) and models written here
in the forms real code takes (pytrees of parameters, integer labels, boolean masks, lax control flow,
randomness with a fixed key, checkpointing, custom rules, mixed precision).

Every entry must come back ``ok``; the verdict is ``agree`` except where the truth is otherwise: a
relu at exact zeros is a ``kink`` (JAX's custom rule gives 0 there, the primal body 1/2) and a model
that computes part of itself in float32 agrees at float32's bound (``precision`` named).
"""
import numpy as np
import pytest

interop = pytest.importorskip("interop")
optax = pytest.importorskip("optax")
from interop import jax, jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.example_libraries import stax  # noqa: E402

CORPUS = []


def case(*args, verdict="agree", lowp=False, **kw):
    """Register ``f(*args)`` (args are built lazily, inside x64) with the verdict the truth calls for."""
    def register(f):
        CORPUS.append((f.__name__, f, args, kw, verdict, lowp))
        return f
    return register


def R(*shape, seed=0, scale=1.0, positive=False):
    def make():
        a = np.random.default_rng(seed + sum(shape)).standard_normal(shape) * scale
        return jnp.asarray(np.abs(a) + 0.1 if positive else a)
    return make


def C(value):
    return lambda: jnp.asarray(value)


def LABELS(n, k, seed=0):
    return lambda: jnp.asarray(np.random.default_rng(seed).integers(0, k, n), jnp.int32)


def ONEHOT(n, k, seed=0):
    return lambda: jax.nn.one_hot(np.random.default_rng(seed).integers(0, k, n), k, dtype=jnp.float64)


def PROBS(n, k, seed=0):
    return lambda: jax.nn.softmax(jnp.asarray(np.random.default_rng(seed).standard_normal((n, k))), axis=-1)


# ── optax losses, called directly ────────────────────────────────────────────

@case(R(5, 4), ONEHOT(5, 4))
def optax_softmax_cross_entropy(logits, labels):
    return optax.softmax_cross_entropy(logits, labels).mean()


@case(R(6, 5), LABELS(6, 5), argnums=0)
def optax_softmax_xent_integer_labels(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@case(R(6, 3), C(np.eye(3)[[0, 1, 2, 0, 1, 2]]), argnums=0)
def optax_safe_softmax_cross_entropy(logits, labels):
    return optax.safe_softmax_cross_entropy(logits, labels).mean()


@case(R(8), C(np.array([0, 1, 1, 0, 1, 0, 0, 1.0])), argnums=0)
def optax_sigmoid_binary_cross_entropy(logits, labels):
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


@case(R(8), C(np.array([0, 1, 1, 0, 1, 0, 0, 1.0])), argnums=0)
def optax_sigmoid_focal_loss(logits, labels):
    return optax.sigmoid_focal_loss(logits, labels, gamma=2.0).sum()


@case(R(7), R(7, seed=1))
def optax_l2_loss(a, b):
    return optax.l2_loss(a, b).sum()


@case(R(9, scale=2.0), R(9, seed=1))
def optax_huber_loss(a, b):
    return optax.huber_loss(a, b, delta=1.0).mean()


@case(R(4, 6), R(4, 6, seed=1))
def optax_cosine_similarity(a, b):
    return optax.cosine_similarity(a, b).mean()


@case(R(8), C(np.array([1, -1, 1, 1, -1, -1, 1, -1.0])), argnums=0)
def optax_hinge_loss(scores, labels):
    return optax.hinge_loss(scores, labels).mean()


@case(R(4, 5), PROBS(4, 5))
def optax_kl_divergence(logits, targets):
    return optax.kl_divergence(jax.nn.log_softmax(logits), targets).mean()


@case(R(6), R(6, seed=2))
def optax_squared_error(a, b):
    return optax.squared_error(a, b).mean()


@case(R(3, 4, positive=True), R(3, 4, seed=1, positive=True))
def optax_generalized_kl_divergence(p, q):
    return optax.generalized_kl_divergence(jnp.log(p), q).mean()


# ── jax.nn ───────────────────────────────────────────────────────────────────

@case(R(3, 5))
def nn_gelu_tanh(x):
    return jnp.sum(jax.nn.gelu(x, approximate=True) ** 2)


@case(R(3, 5))
def nn_gelu_exact(x):
    return jnp.sum(jax.nn.gelu(x, approximate=False) * x)


@case(R(10))
def nn_silu_softplus_log_sigmoid(x):
    return jnp.sum(jax.nn.silu(x) + jax.nn.softplus(x) * jax.nn.log_sigmoid(x))


@case(R(10, scale=2.0))
def nn_elu_celu_selu_leaky(x):
    return jnp.sum(jax.nn.elu(x) + jax.nn.celu(x, 0.7) + jax.nn.selu(x) + jax.nn.leaky_relu(x, 0.1))


@case(R(10, scale=4.0))
def nn_relu6_hard_tanh_hard_sigmoid(x):
    return jnp.sum(jax.nn.relu6(x) * jax.nn.hard_tanh(x) + jax.nn.hard_sigmoid(x))


@case(R(4, 6), C(np.random.default_rng(1).random((4, 6)) > 0.3), argnums=0)
def nn_masked_softmax(x, mask):
    return jnp.sum(jax.nn.softmax(x, where=mask) ** 2)


@case(R(4, 6))
def nn_logsumexp_log_softmax(x):
    return jnp.sum(jax.nn.logsumexp(x, axis=1)) + jnp.sum(jax.nn.log_softmax(x, axis=0)[0])


@case(R(5, 4))
def nn_standardize(x):
    return jnp.sum(jax.nn.standardize(x, axis=-1) ** 3)


@case(R(4, 6))
def nn_glu_mish(x):
    return jnp.sum(jax.nn.glu(x, axis=-1)) + jnp.sum(jax.nn.mish(x))


@case(R(2, 5, 2, 4), R(2, 5, 2, 4, seed=1), R(2, 5, 2, 4, seed=2), verdict="agree", lowp=True)
def nn_dot_product_attention_float32_softmax(q, k, v):
    return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)


@case(C(np.array([[0.0, 1.5, -2.0, 0.0], [0.3, 0.0, 0.0, -0.1]])), verdict="kink")
def nn_relu_at_exact_zeros(x):
    return jnp.sum(jax.nn.relu(x) * jnp.arange(1.0, 5.0))


# ── jax.scipy ────────────────────────────────────────────────────────────────

@case(R(3, 5), R(3, 5, seed=1, positive=True))
def scipy_logsumexp_with_weights(a, b):
    return jnp.sum(jax.scipy.special.logsumexp(a, axis=1, b=b))


@case(R(6, positive=True), R(6, seed=3, positive=True))
def scipy_xlogy_xlog1py_entr(x, y):
    s = jax.scipy.special
    return jnp.sum(s.xlogy(x, y) + s.xlog1py(x, y) + s.entr(x))


@case(R(8, scale=3.0), C(0.3), C(1.7))
def scipy_norm_logpdf_logcdf(x, mu, sigma):
    n = jax.scipy.stats.norm
    return jnp.sum(n.logpdf(x, mu, sigma) + n.logcdf(x, mu, sigma))


@case(R(7, positive=True))
def scipy_gammaln_digamma(x):
    s = jax.scipy.special
    return jnp.sum(s.gammaln(x + 1.0) * s.digamma(x + 0.5))


@case(R(6, scale=2.0))
def scipy_erf_erfc_expit_logit(x):
    s = jax.scipy.special
    return jnp.sum(s.erf(x) * s.erfc(0.5 * x) + s.logit(s.expit(x) * 0.9 + 0.05))


@case(R(5, scale=2.0), C(3.5))
def scipy_student_t_logpdf(x, df):
    return jnp.sum(jax.scipy.stats.t.logpdf(x, df))


@case(R(4, 3), R(3), R(3, 3, seed=5))
def scipy_multivariate_normal_logpdf(x, mean, a):
    cov = a @ a.T + 3.0 * jnp.eye(3)
    return jnp.sum(jax.scipy.stats.multivariate_normal.logpdf(x, mean, cov))


@case(R(4, 4), R(4, 2, seed=1))
def scipy_cho_solve(a, b):
    spd = a @ a.T + 4.0 * jnp.eye(4)
    c = jax.scipy.linalg.cho_factor(spd, lower=True)
    return jnp.sum(jax.scipy.linalg.cho_solve(c, b) ** 2)


# ── jax.example_libraries.stax layers ────────────────────────────────────────

def _stax_params(init_fn, shape, seed=0):
    with jax.enable_x64(True):
        _, params = init_fn(jax.random.PRNGKey(seed), shape)
        return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)


_MLP_INIT, _MLP_APPLY = stax.serial(stax.Dense(8), stax.Relu, stax.Dense(8), stax.Tanh, stax.Dense(3),
                                    stax.LogSoftmax)


@case(lambda: _stax_params(_MLP_INIT, (-1, 5)), R(6, 5, seed=4), ONEHOT(6, 3, seed=2), argnums=0)
def stax_mlp_dense_relu_logsoftmax(params, x, y):
    return -jnp.mean(jnp.sum(_MLP_APPLY(params, x) * y, axis=-1))


_CNN_INIT, _CNN_APPLY = stax.serial(stax.Conv(4, (3, 3), padding="SAME"), stax.Relu, stax.MaxPool((2, 2)),
                                    stax.Conv(3, (2, 2)), stax.Elu, stax.AvgPool((2, 2)), stax.Flatten,
                                    stax.Dense(2))


@case(lambda: _stax_params(_CNN_INIT, (-1, 8, 8, 2)), R(2, 8, 8, 2, seed=5), argnums=0)
def stax_cnn_conv_pool(params, x):
    return jnp.sum(_CNN_APPLY(params, x) ** 2)


_BN_INIT, _BN_APPLY = stax.serial(stax.Dense(6), stax.BatchNorm(axis=(0,)), stax.Gelu, stax.Dense(1))


@case(lambda: _stax_params(_BN_INIT, (-1, 4)), R(8, 4, seed=6), argnums=0)
def stax_batchnorm_gelu(params, x):
    return jnp.mean(_BN_APPLY(params, x) ** 2)


_DROP_INIT, _DROP_APPLY = stax.serial(stax.Dense(6), stax.Dropout(0.5, mode="train"), stax.Softplus,
                                      stax.Dense(2))


@case(lambda: _stax_params(_DROP_INIT, (-1, 4)), R(5, 4, seed=7), C(jax.random.key_data(jax.random.PRNGKey(3))),
      argnums=0)
def stax_dropout_with_fixed_key(params, x, key):
    return jnp.sum(_DROP_APPLY(params, x, rng=key) ** 2)


# ── jax.numpy ────────────────────────────────────────────────────────────────

@case(R(5, 4))
def jnp_var_std(x):
    return jnp.var(x) + jnp.sum(jnp.std(x, axis=0)) + jnp.var(x, axis=1, ddof=1).sum()


@case(R(4, 5))
def jnp_norms(x):
    return jnp.linalg.norm(x) + jnp.sum(jnp.linalg.norm(x, axis=1)) + jnp.linalg.norm(x, ord=1)


@case(R(3, 5, positive=True))
def jnp_cumsum_cumprod_prod(x):
    return jnp.sum(jnp.cumsum(x, axis=1) ** 2) + jnp.sum(jnp.cumprod(x, axis=0)) + jnp.prod(x[0])


@case(R(9))
def jnp_sort_median_topk(x):
    return jnp.sum(jnp.sort(x) * jnp.arange(9.0)) + jnp.median(x) + jnp.sum(lax.top_k(x, 3)[0])


@case(R(6, 3), C(np.array([4, 0, 0, 2, 5])), argnums=0)
def jnp_take_and_scatter_add(x, idx):
    y = x[idx] * 2.0
    z = jnp.zeros((6, 3)).at[idx].add(y)
    return jnp.sum(z * x) + jnp.sum(jnp.take(x, idx, axis=0, mode="clip") ** 2)


@case(R(4, 5))
def jnp_pad_flip_roll_strided(x):
    return (jnp.sum(jnp.pad(x, ((1, 2), (0, 1)), constant_values=0.5) ** 2) + jnp.sum(jnp.flip(x, 1) * x)
            + jnp.sum(jnp.roll(x, 2, axis=1) * x) + jnp.sum(x[::2, 1::2] ** 3))


@case(R(4, 4), R(4, seed=2))
def jnp_linalg_solve_slogdet_inv(a, b):
    m = a + 4.0 * jnp.eye(4)
    sign, logdet = jnp.linalg.slogdet(m)
    return jnp.sum(jnp.linalg.solve(m, b) ** 2) + logdet + jnp.sum(jnp.linalg.inv(m))


@case(R(12, scale=2.0))
def jnp_clip_where_safe_log(x):
    safe = jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), 0.0)
    return jnp.sum(jnp.clip(x, -1.0, 1.0) ** 2) + jnp.sum(safe)


@case(R(12, scale=2.0))
def jnp_where_inf_before_exp(x):
    masked = jnp.where(x > 0, x, -jnp.inf)
    return jnp.sum(jnp.exp(masked)) + jax.nn.logsumexp(masked)


@case(R(2, 3, 4), R(4, 5, seed=1))
def jnp_einsum_tensordot(a, b):
    return jnp.sum(jnp.einsum("bij,jk->bik", a, b) ** 2) + jnp.sum(jnp.tensordot(a, b, axes=1))


@case(R(3, 4), R(4, 2, seed=1))
def jnp_dynamic_slice_update(a, b):
    s = lax.dynamic_slice(a, (1, 1), (2, 2))
    u = lax.dynamic_update_slice(a, s * 3.0, (0, 2))
    return jnp.sum(u @ b) + jnp.sum(s ** 2)


@case(R(5, 2), R(2))
def jnp_stack_split_concat(a, b):
    p, q = jnp.split(a, [2], axis=0)
    return jnp.sum(jnp.stack([p[0], q[0], b]) ** 2) + jnp.sum(jnp.concatenate([p, q * b], axis=0))


# ── models written here, in the forms real code takes ─────────────────────────

def _mlp_params(sizes, seed=0):
    def make():
        rng = np.random.default_rng(seed)
        return [{"w": jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m)),
                 "b": jnp.asarray(0.1 * rng.standard_normal(n))} for m, n in zip(sizes[:-1], sizes[1:])]
    return make


def mlp(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


@case(_mlp_params((4, 8, 3)), R(7, 4, seed=9), LABELS(7, 3), C(np.array([1, 1, 0, 1, 0, 1, 1], bool)), argnums=0)
def model_mlp_integer_labels_bool_mask(params, x, labels, mask):
    logp = jax.nn.log_softmax(mlp(params, x))
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(mask.sum(), 1)


def _attn_params(d=8, h=2, seed=0):
    def make():
        rng = np.random.default_rng(seed)
        w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]))  # noqa: E731
        return {"wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d), "w1": w(d, 2 * d), "w2": w(2 * d, d),
                "g1": jnp.ones(d), "b1": jnp.zeros(d), "g2": jnp.ones(d), "b2": jnp.zeros(d)}
    return make


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * g + b


def attention(p, x, mask, heads=2):
    t, d = x.shape
    split = lambda a: a.reshape(t, heads, d // heads).transpose(1, 0, 2)  # noqa: E731
    q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
    logits = jnp.einsum("htd,hsd->hts", q, k) / np.sqrt(d // heads)
    logits = jnp.where(mask[None], logits, -jnp.inf)
    out = jnp.einsum("hts,hsd->htd", jax.nn.softmax(logits, axis=-1), v)
    return out.transpose(1, 0, 2).reshape(t, d) @ p["wo"]


def transformer_block(p, x, mask):
    x = x + attention(p, layer_norm(x, p["g1"], p["b1"]), mask)
    h = jax.nn.gelu(layer_norm(x, p["g2"], p["b2"]) @ p["w1"])
    return x + h @ p["w2"]


@case(_attn_params(), R(5, 8, seed=11), C(np.tril(np.ones((5, 5), bool))), argnums=0)
def model_transformer_block_causal_mask(p, x, mask):
    return jnp.sum(transformer_block(p, x, mask) ** 2)


@case(R(4, 6), R(4, 6, seed=1), C(np.array([True, True, True, False])), argnums=(0, 1))
def model_contrastive_infonce_padding_mask(a, b, valid):
    a = a / jnp.linalg.norm(a, axis=1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=1, keepdims=True)
    logits = (a @ b.T) / 0.1
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
    loss = -jnp.diagonal(jax.nn.log_softmax(logits, axis=1))
    return jnp.sum(jnp.where(valid, loss, 0.0)) / valid.sum()


def _lstm_params(n_in=3, n_h=4, seed=0):
    def make():
        rng = np.random.default_rng(seed)
        return {"wx": jnp.asarray(rng.standard_normal((n_in, 4 * n_h)) * 0.5),
                "wh": jnp.asarray(rng.standard_normal((n_h, 4 * n_h)) * 0.5),
                "b": jnp.zeros(4 * n_h), "wo": jnp.asarray(rng.standard_normal((n_h, 1)))}
    return make


@case(_lstm_params(), R(6, 2, 3, seed=12), argnums=0)
def model_lstm_under_scan(p, xs):
    n_h = p["wh"].shape[0]

    def cell(carry, x):
        h, c = carry
        z = x @ p["wx"] + h @ p["wh"] + p["b"]
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h @ p["wo"]
    init = (jnp.zeros((2, n_h)), jnp.zeros((2, n_h)))
    (h, c), ys = lax.scan(cell, init, xs)
    return jnp.sum(ys ** 2) + jnp.sum(h * c)


@case(R(3, 3, seed=13, scale=0.5), R(3, seed=14), argnums=0)
def model_gru_reverse_scan(w, x0):
    def step(h, t):
        z = jax.nn.sigmoid(h @ w + t)
        return (1 - z) * h + z * jnp.tanh(h @ w.T), h.sum()
    h, hs = lax.scan(step, x0, jnp.linspace(0.0, 1.0, 4), reverse=True)
    return jnp.sum(h ** 2) + jnp.sum(hs * jnp.arange(4.0))


@case(R(3, 3, seed=15, scale=0.3), R(3, seed=16))
def model_rk4_ode_fori_loop(a, y0):
    def f(y):
        return jnp.tanh(a @ y)

    def rk4(i, y):
        h = 0.1
        k1 = f(y)
        k2 = f(y + h / 2 * k1)
        k3 = f(y + h / 2 * k2)
        k4 = f(y + h * k3)
        return y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return jnp.sum(lax.fori_loop(0, 5, rk4, y0) ** 2)


@case(R(6, scale=2.0))
def model_piecewise_cond_switch(x):
    a = lax.cond(jnp.sum(x) > 0, lambda v: jnp.sum(jnp.tanh(v)), lambda v: jnp.sum(v ** 2), x)
    b = lax.switch(jnp.argmax(x) % 3, [jnp.sum, lambda v: jnp.sum(jnp.exp(v)), lambda v: jnp.max(v)], x)
    return a * b


@case(_mlp_params((4, 16, 16, 1), seed=3), R(5, 4, seed=17), argnums=0)
def model_mlp_under_checkpoint(params, x):
    block = jax.checkpoint(lambda layer, h: jnp.tanh(h @ layer["w"] + layer["b"]))
    for layer in params[:-1]:
        x = block(layer, x)
    return jnp.sum((x @ params[-1]["w"]) ** 2)


@case(_mlp_params((4, 8, 2), seed=4), R(6, 4, seed=18), argnums=0)
def model_dropout_fixed_key(params, x):
    key = jax.random.PRNGKey(42)
    h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    keep = jax.random.bernoulli(key, 0.7, h.shape)
    h = jnp.where(keep, h / 0.7, 0.0)
    return jnp.sum((h @ params[1]["w"]) ** 2)


@case(R(3, 4, seed=19), R(4, seed=20), R(4, seed=21, positive=True))
def model_vae_reparameterisation(w, mu, log_sigma):
    eps = jax.random.normal(jax.random.key(7), (5, 4))
    z = mu + jnp.exp(log_sigma) * eps
    recon = jnp.sum(jnp.tanh(z @ w.T) ** 2)
    kl = 0.5 * jnp.sum(jnp.exp(2 * log_sigma) + mu ** 2 - 1.0 - 2 * log_sigma)
    return recon + kl


@case(R(4, seed=22), R(6, 4, seed=23))
def model_dp_noise_and_clip(w, x):
    per_example = jax.vmap(lambda xi: jnp.tanh(xi @ w) * xi)(x)
    norms = jnp.linalg.norm(per_example, axis=1, keepdims=True)
    clipped = per_example / jnp.maximum(1.0, norms / 0.5)
    noise = 0.1 * jax.random.normal(jax.random.PRNGKey(1), w.shape)
    return jnp.sum((clipped.mean(0) + noise) ** 2)


@case(R(3, 4, seed=24), R(5, 3, seed=25), argnums=0)
def model_gradient_penalty_grad_inside(w, x):
    def critic(xi):
        return jnp.sum(jnp.tanh(xi @ w))
    g = jax.vmap(jax.grad(critic))(x)
    return jnp.mean((jnp.sqrt(jnp.sum(g ** 2, axis=1) + 1e-12) - 1.0) ** 2)


def _graph():
    senders = np.array([0, 1, 2, 3, 0, 2, 4])
    receivers = np.array([1, 2, 3, 4, 2, 0, 1])
    return senders, receivers


@case(R(5, 3, seed=26), R(3, 3, seed=27), R(3, 3, seed=28), C(_graph()[0]), C(_graph()[1]), argnums=(0, 1, 2))
def model_graph_network_segment_sum(nodes, w_msg, w_upd, senders, receivers):
    msgs = jnp.tanh(nodes[senders] @ w_msg)
    agg = jax.ops.segment_sum(msgs, receivers, num_segments=5)
    deg = jax.ops.segment_sum(jnp.ones_like(receivers, dtype=nodes.dtype), receivers, num_segments=5)
    new = jax.nn.relu(nodes @ w_upd + agg / jnp.maximum(deg, 1.0)[:, None] + 0.5)
    return jnp.sum(new ** 2)


@case(R(10, 4, seed=29), C(np.array([[1, 3, 3, 0], [2, 9, 0, 0]])), C(np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)),
      argnums=0)
def model_embedding_masked_mean(table, tokens, mask):
    emb = table[tokens]
    pooled = jnp.sum(emb * mask[..., None], axis=1) / jnp.sum(mask, axis=1, keepdims=True)
    return jnp.sum(jnp.tanh(pooled) ** 2)


@case(R(4, seed=30), R(4, 3, seed=31), R(2, 4, seed=32), argnums=(0, 1))
def model_mixture_density_logsumexp(logit_pi, mus, y):
    logp = jax.nn.log_softmax(logit_pi)[None, :, None] - 0.5 * (y[:, :, None] - mus[None]) ** 2
    return -jnp.sum(jax.nn.logsumexp(logp, axis=1))


@case(R(2, 6, 6, 1, seed=33), R(3, 3, 1, 2, seed=34), argnums=(0, 1))
def model_lax_conv_reduce_window(x, k):
    y = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.sum(jnp.tanh(y) ** 2) + jnp.sum(lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "VALID"))


@case(R(5, 3, seed=35), R(3, 2, seed=36))
def model_weight_norm_custom_jvp_logaddexp(x, v):
    w = v / jnp.linalg.norm(v, axis=0, keepdims=True)
    return jnp.sum(jnp.logaddexp(x @ w, 0.5))


@case(R(4, 6, seed=37), R(6, 3, seed=38))
def model_gumbel_softmax(logits_w, x):
    logits = logits_w @ x
    g = jax.random.gumbel(jax.random.key(5), logits.shape)
    y = jax.nn.softmax((logits + g) / 0.5)
    return jnp.sum(y * jnp.arange(3.0))


@case(R(6, 5, seed=39), C(np.array([0, 0, 1, 1, 1, 2])), argnums=0, lowp=True)
def model_float32_softmax_in_float64_model(h, labels):
    logits = (h @ jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)).astype(jnp.float32)
    p = jax.nn.softmax(logits, axis=-1).astype(jnp.float64)
    return -jnp.mean(jnp.log(p[jnp.arange(6), labels]))


@case(R(3, seed=40), R(3, seed=41))
def model_pytree_dict_tuple_float_args(w, b):
    params = {"layer": (w, b), "scale": 2.0}
    return jnp.sum(jnp.tanh(params["layer"][0] * params["scale"] + params["layer"][1]) ** 2)


@jax.custom_vjp
def _fixed_point(a, x0):
    def body(c):
        x, _ = c
        return jnp.tanh(a * x) + 0.5, x
    x, _ = lax.while_loop(lambda c: jnp.max(jnp.abs(c[0] - c[1])) > 1e-15, body, (x0, x0 + 1.0))
    return x


def _fp_fwd(a, x0):
    x = _fixed_point(a, x0)
    return x, (a, x)


def _fp_bwd(res, g):
    a, x = res
    d = 1.0 - jnp.tanh(a * x) ** 2   # x = tanh(a·x) + ½ ⇒ dx = d·(x da + a dx)
    return (g * d * x / (1.0 - d * a), jnp.zeros_like(x))


_fixed_point.defvjp(_fp_fwd, _fp_bwd)


@case(C(np.array([0.3, -0.5, 0.8])), C(np.zeros(3)), argnums=0)
def model_implicit_fixed_point_while_loop(a, x0):
    return jnp.sum(_fixed_point(a, x0) ** 2)


@case(R(3, 4, seed=42))
def model_nested_scan_cond_dropout_per_step(x):
    keys = jax.random.split(jax.random.key(0), 3)

    def step(c, kx):
        k, row = kx
        keep = jax.random.bernoulli(k, 0.5, row.shape)
        inner = lax.scan(lambda a, b: (a * jnp.tanh(b), a), c, jnp.stack([row, row * 2]))[0]
        c = lax.cond(jnp.sum(row) > 0, lambda v: v * 2.0, lambda v: jnp.sin(v), inner)
        return jnp.where(keep, c, c * 0.5), c.sum()
    c, ys = lax.scan(step, jnp.ones(4), (keys, x))
    return jnp.sum(c) + jnp.sum(ys ** 2)


@case(R(3, 4, seed=43))
def model_fori_loop_dynamic_index(x):
    return lax.fori_loop(0, 3, lambda i, c: c + jnp.tanh(c * x[i]), x[0]).sum()


# ── the run ──────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("name,f,args,kw,verdict,lowp", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_entry(name, f, args, kw, verdict, lowp):
    with jax.enable_x64(True):
        values = [a() for a in args]
    before = interop.oracle.check.FULL_EVALUATIONS[0]
    report = interop.check_grads(f, *values, **kw)
    assert report.ok, str(report)
    if verdict == "agree":   # JAX's side is one compiled call: no per-step values unless locating something
        assert interop.oracle.check.FULL_EVALUATIONS[0] == before
    assert report.verdict == verdict, str(report)
    assert (report.precision is not None) == lowp, str(report)
    if verdict == "kink":
        assert report.kinks and all(k.elements > 0 for k in report.kinks), str(report)
    bound = report.precision.bound if lowp else 1e-12
    assert abs(report.value - report.jax_value) <= bound * max(1.0, abs(report.jax_value)), str(report)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 60
