"""Real-library functions for measuring ``interop.check_grads`` (issue 24): flax.linen and flax.nnx
modules through ``apply``/``merge``, equinox modules, optax losses and whole update steps, jax.nn,
jax.scipy, jnp.linalg, lax control flow and composed transforms, called the way research code calls
them. Each case is ``(name, library, f, make_args, kw)``; ``make_args`` runs inside ``jax.enable_x64``.
"""
import numpy as np

from interop import jax, jnp
from jax import lax

import equinox as eqx
import flax.linen as nn
import optax
from flax import nnx

CASES = []


def case(library, **kw):
    """Register ``f`` under ``library``; ``kw`` go to ``check_grads`` (``argnums``, ``has_aux``, ``trust``)."""
    def register(make_args):
        def wrap(f):
            CASES.append((f.__name__, library, f, make_args, kw))
            return f
        return wrap
    return register


def rnd(*shape, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed + 7 * len(shape) + sum(shape)).standard_normal(shape) * scale)


def spd(n, seed=0):
    a = np.random.default_rng(seed).standard_normal((n, n))
    return jnp.asarray(a @ a.T + n * np.eye(n))


KEY = lambda s=0: jax.random.PRNGKey(s)   # noqa: E731


def linen(module, x_shape, method_kw=None, init_kw=None, mutable=False, rngs=None):
    """Arguments ``(params, x)`` of a linen module's ``apply``, its variables initialised in x64."""
    def make():
        x = rnd(*x_shape)
        v = module.init({"params": KEY(0), **({"dropout": KEY(1)} if rngs else {})}, x, **(init_kw or {}))
        return (v, x)
    return make


# ── flax.linen ────────────────────────────────────────────────────────────────

_dense = nn.Dense(5)


@case("flax.linen")(linen(_dense, (3, 4)))
def linen_dense(v, x):
    return jnp.sum(jnp.tanh(_dense.apply(v, x)) ** 2)


_dense_bf16 = nn.Dense(4, dtype=jnp.bfloat16)


@case("flax.linen")(linen(_dense_bf16, (3, 4)))
def linen_dense_bfloat16(v, x):
    return jnp.sum(_dense_bf16.apply(v, x).astype(jnp.float32) ** 2)


_conv = nn.Conv(4, (3, 3), padding="SAME")


@case("flax.linen")(linen(_conv, (2, 6, 6, 3)))
def linen_conv_same(v, x):
    return jnp.mean(nn.relu(_conv.apply(v, x)) ** 2)


_conv_strided = nn.Conv(3, (3, 3), strides=(2, 2), padding="VALID")


@case("flax.linen")(linen(_conv_strided, (1, 7, 7, 2)))
def linen_conv_strided(v, x):
    return jnp.sum(jnp.sin(_conv_strided.apply(v, x)))


_ln = nn.LayerNorm()


@case("flax.linen")(linen(_ln, (4, 6)))
def linen_layernorm(v, x):
    return jnp.sum(_ln.apply(v, x) * jnp.arange(6.0))


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.relu(x) @ jnp.ones((6,))


_bn = _BNNet()


@case("flax.linen", argnums=0, has_aux=True)(linen(_bn, (8, 3)))
def linen_batchnorm_train(v, x):
    y, updates = _bn.apply(v, x, mutable=["batch_stats"])
    return jnp.mean(y ** 2), updates


class _DropNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8)(x)
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(1)(nn.gelu(x))


_drop = _DropNet()


@case("flax.linen", argnums=0)(linen(_drop, (4, 3), rngs=True))
def linen_dropout_rng(v, x):
    return jnp.mean(_drop.apply(v, x, rngs={"dropout": KEY(3)}) ** 2)


_mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)


def _mha_args():
    x = rnd(2, 5, 8)
    return (_mha.init(KEY(0), x, x), x)


@case("flax.linen")(_mha_args)
def linen_attention_causal(v, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    return jnp.sum(_mha.apply(v, x, x, mask=mask) ** 2)


@case("flax.linen")(_mha_args)
def linen_attention_padding(v, x):
    lengths = jnp.array([5, 3])
    valid = jnp.arange(5)[None, :] < lengths[:, None]
    mask = nn.make_attention_mask(valid, valid)
    return jnp.sum(_mha.apply(v, x, x, mask=mask) ** 2)


_embed = nn.Embed(10, 4)


def _embed_args():
    ids = jnp.array([[1, 4, 9], [0, 0, 3]])
    return (_embed.init(KEY(0), ids), ids)


@case("flax.linen", argnums=0)(_embed_args)
def linen_embed(v, ids):
    return jnp.sum(jnp.tanh(_embed.apply(v, ids)) ** 2)


class _ScanLSTM(nn.Module):
    @nn.compact
    def __call__(self, xs):
        cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)(features=4)
        carry = cell.initialize_carry(KEY(9), xs[:, 0].shape)
        _, ys = cell(carry, xs)
        return ys


_lstm = _ScanLSTM()


def _lstm_args():
    xs = rnd(2, 5, 3).astype(jnp.float32)
    return (_lstm.init(KEY(0), xs), xs)


@case("flax.linen")(_lstm_args)
def linen_scan_lstm(v, xs):
    return jnp.sum(_lstm.apply(v, xs)[:, -1] ** 2)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for w in (8, 8):
            x = nn.swish(nn.Dense(w)(x))
        return nn.Dense(3)(x)


_mlp = _MLP()


def _mlp_xent_args():
    x = rnd(6, 4)
    return (_mlp.init(KEY(0), x), x, jnp.array([0, 2, 1, 1, 0, 2]))


@case("flax.linen", argnums=0)(_mlp_xent_args)
def linen_mlp_integer_xent(v, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(_mlp.apply(v, x), labels).mean()


# ── flax.nnx ──────────────────────────────────────────────────────────────────

class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.gelu(self.norm(self.l1(x))))


def _nnx_args():
    graphdef, state = nnx.split(_NNXNet(nnx.Rngs(0)))
    _nnx_graph[0] = graphdef
    return (state, rnd(3, 4))


_nnx_graph = [None]


@case("flax.nnx", argnums=0)(_nnx_args)
def nnx_split_merge_mlp(state, x):
    model = nnx.merge(_nnx_graph[0], state)
    return jnp.mean(model(x) ** 2)


class _NNXConv(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 3, kernel_size=(3, 3), rngs=rngs)
        self.out = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.mean(nnx.relu(self.conv(x)), axis=(1, 2)))


_nnx_conv_graph = [None]


def _nnx_conv_args():
    graphdef, state = nnx.split(_NNXConv(nnx.Rngs(1)))
    _nnx_conv_graph[0] = graphdef
    return (state, rnd(2, 5, 5, 2))


@case("flax.nnx", argnums=0)(_nnx_conv_args)
def nnx_split_merge_conv(state, x):
    return jnp.sum(nnx.merge(_nnx_conv_graph[0], state)(x) ** 2)


# ── equinox ───────────────────────────────────────────────────────────────────

def _eqx(build, *x_shape):
    def make():
        m = build()
        params, static = eqx.partition(m, eqx.is_inexact_array)
        _eqx_static[id(make)] = static
        return (params, rnd(*x_shape))
    return make


_eqx_static = {}


def _static(make):
    return _eqx_static[id(make)]


_eqx_mlp = _eqx(lambda: eqx.nn.MLP(3, 2, 8, 2, key=KEY(0)), 5, 3)


@case("equinox", argnums=0)(_eqx_mlp)
def eqx_mlp_vmap(params, x):
    m = eqx.combine(params, _static(_eqx_mlp))
    return jnp.mean(jax.vmap(m)(x) ** 2)



_eqx_conv = _eqx(lambda: eqx.nn.Conv2d(2, 3, 3, padding=1, key=KEY(2)), 2, 5, 5)


@case("equinox", argnums=0)(_eqx_conv)
def eqx_conv2d(params, x):
    return jnp.sum(jnp.tanh(eqx.combine(params, _static(_eqx_conv))(x)) ** 2)


_eqx_ln = _eqx(lambda: eqx.nn.LayerNorm(6), 6)


@case("equinox")(_eqx_ln)
def eqx_layernorm(params, x):
    return jnp.sum(eqx.combine(params, _static(_eqx_ln))(x) * jnp.arange(6.0))


def _gru_args():
    m = eqx.nn.GRUCell(3, 4, key=KEY(3))
    params, static = eqx.partition(m, eqx.is_inexact_array)
    _eqx_static["gru"] = static
    return (params, rnd(6, 3))


@case("equinox", argnums=0)(_gru_args)
def eqx_grucell_scan(params, xs):
    cell = eqx.combine(params, _eqx_static["gru"])
    h, _ = lax.scan(lambda h, x: (cell(x, h), None), jnp.zeros(4), xs)
    return jnp.sum(h ** 2)


def _eqx_mha_args():
    m = eqx.nn.MultiheadAttention(2, 8, key=KEY(4))
    params, static = eqx.partition(m, eqx.is_inexact_array)
    _eqx_static["mha"] = static
    return (params, rnd(5, 8))


@case("equinox", argnums=0)(_eqx_mha_args)
def eqx_multihead_attention_causal(params, x):
    mha = eqx.combine(params, _eqx_static["mha"])
    mask = jnp.tril(jnp.ones((5, 5), bool))
    return jnp.sum(mha(x, x, x, mask=mask) ** 2)


# ── optax losses ──────────────────────────────────────────────────────────────

_onehot = lambda: jax.nn.one_hot(jnp.array([0, 3, 1, 2, 3]), 4)   # noqa: E731


@case("optax", argnums=0)(lambda: (rnd(5, 4), _onehot()))
def optax_softmax_cross_entropy(logits, labels):
    return optax.softmax_cross_entropy(logits, labels).mean()


@case("optax", argnums=0)(lambda: (rnd(8), jnp.array([0, 1, 1, 0, 1, 0, 0, 1.0])))
def optax_sigmoid_bce(logits, labels):
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


@case("optax")(lambda: (rnd(7, scale=2.0), rnd(7, seed=1)))
def optax_huber(pred, target):
    return optax.huber_loss(pred, target, delta=0.5).sum()


@case("optax")(lambda: (rnd(6), rnd(6, seed=2)))
def optax_l2_loss(pred, target):
    return optax.l2_loss(pred, target).sum()


@case("optax")(lambda: (rnd(3, 5), rnd(3, 5, seed=3)))
def optax_cosine_distance(pred, target):
    return optax.cosine_distance(pred, target).mean()


# ── optax update steps (a jax.grad inside) ────────────────────────────────────

def _quad_loss(p, x):
    return jnp.sum((x @ p["w"] + p["b"]) ** 2)


def _params():
    return {"w": rnd(3, 2), "b": rnd(2, seed=5)}


def _step(tx):
    def f(p, x):
        state = tx.init(p)
        g = jax.grad(_quad_loss)(p, x)
        updates, state = tx.update(g, state, p)
        p2 = optax.apply_updates(p, updates)
        g2 = jax.grad(_quad_loss)(p2, x)
        updates, _ = tx.update(g2, state, p2)
        return _quad_loss(optax.apply_updates(p2, updates), x)
    return f


def _step_case(name, tx):
    f = _step(tx)
    f.__name__ = name
    case("optax step", argnums=0)(lambda: (_params(), rnd(4, 3)))(f)


_step_case("optax_adam_step", optax.adam(1e-2))
_step_case("optax_adamw_masked_step", optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: {"w": True, "b": False}))
_step_case("optax_lamb_step", optax.lamb(1e-2))
_step_case("optax_lion_step", optax.lion(1e-3))
_step_case("optax_clip_chain_step", optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)))
_step_case("optax_clip_adam_schedule_step",
           optax.chain(optax.clip_by_global_norm(0.5),
                       optax.adam(optax.exponential_decay(1e-2, transition_steps=10, decay_rate=0.9))))


@case("optax", argnums=0, trust=("scale_gradient",))(lambda: (rnd(4), rnd(4, seed=1)))
def optax_scale_gradient_trusted(x, y):
    return jnp.sum(jnp.sin(optax.scale_gradient(x, 0.5)) * y)


# ── jax.nn ────────────────────────────────────────────────────────────────────

@case("jax.nn")(lambda: (rnd(3, 5),))
def jnn_softmax(x):
    return jnp.sum(jax.nn.softmax(x, axis=-1) * jnp.arange(5.0))


@case("jax.nn")(lambda: (rnd(3, 5),))
def jnn_log_softmax(x):
    return jnp.sum(jax.nn.log_softmax(x)[:, 1])


@case("jax.nn")(lambda: (rnd(6),))
def jnn_gelu_tanh_and_exact(x):
    return jnp.sum(jax.nn.gelu(x) + jax.nn.gelu(x, approximate=False) ** 2)


@case("jax.nn")(lambda: (rnd(3, 6),))
def jnn_glu(x):
    return jnp.sum(jax.nn.glu(x, axis=-1) ** 2)


@case("jax.nn")(lambda: (rnd(1, 4, 2, 4), rnd(1, 4, 2, 4, seed=1), rnd(1, 4, 2, 4, seed=2)))
def jnn_dot_product_attention_causal(q, k, v):
    return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)


@case("jax.nn", argnums=0)(lambda: (rnd(4, 3), jnp.array([2, 0, 1, 2])))
def jnn_one_hot_nll(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, 3) * jax.nn.log_softmax(logits), -1))


@case("jax.nn")(lambda: (rnd(8),))
def jnn_activations(x):
    return jnp.sum(jax.nn.silu(x) + jax.nn.softplus(x) + jax.nn.elu(x) ** 2 + jax.nn.celu(x))


# ── jax.scipy ─────────────────────────────────────────────────────────────────

@case("jax.scipy")(lambda: (rnd(3, 4),))
def jsp_logsumexp(x):
    return jnp.sum(jax.scipy.special.logsumexp(x, axis=1) ** 2)


@case("jax.scipy")(lambda: (jnp.abs(rnd(5)) + 0.5,))
def jsp_gammaln_digamma(x):
    return jnp.sum(jax.scipy.special.gammaln(x) + jax.scipy.special.digamma(x) ** 2)


@case("jax.scipy")(lambda: (rnd(5, scale=0.5),))
def jsp_erf(x):
    return jnp.sum(jax.scipy.special.erf(x) ** 2)


@case("jax.scipy")(lambda: (jnp.tanh(rnd(5)) * 0.9,))
def jsp_erfinv(x):
    return jnp.sum(jax.scipy.special.erfinv(x))


@case("jax.scipy")(lambda: (rnd(5, scale=2.0),))
def jsp_i0e(x):
    return jnp.sum(jax.scipy.special.i0e(x))


@case("jax.scipy")(lambda: (jnp.abs(rnd(4)) + 0.5,))
def jsp_polygamma(x):
    return jnp.sum(jax.scipy.special.polygamma(1, x))


@case("jax.scipy")(lambda: (rnd(6), jnp.array(0.3), jnp.array(1.5)))
def jsp_norm_logpdf(x, loc, scale):
    return jnp.sum(jax.scipy.stats.norm.logpdf(x, loc, scale))


@case("jax.scipy")(lambda: (rnd(6), jnp.array(4.0)))
def jsp_t_logpdf(x, df):
    return jnp.sum(jax.scipy.stats.t.logpdf(x, df))


@case("jax.scipy")(lambda: (spd(4), rnd(4, 2)))
def jsp_cho_solve(a, b):
    c = jax.scipy.linalg.cho_factor(a, lower=True)
    return jnp.sum(jax.scipy.linalg.cho_solve(c, b) ** 2)


@case("jax.scipy")(lambda: (jnp.tril(rnd(4, 4)) + 3 * jnp.eye(4), rnd(4, 2)))
def jsp_solve_triangular(a, b):
    return jnp.sum(jax.scipy.linalg.solve_triangular(a, b, lower=True) ** 2)


@case("jax.scipy")(lambda: (rnd(3, 3, scale=0.3),))
def jsp_expm(a):
    return jnp.sum(jax.scipy.linalg.expm(a) ** 2)


# ── jnp.linalg ────────────────────────────────────────────────────────────────

@case("jnp.linalg")(lambda: (spd(3),))
def linalg_det(a):
    return jnp.linalg.det(a)


@case("jnp.linalg")(lambda: (rnd(4, 4) + 3 * jnp.eye(4),))
def linalg_slogdet(a):
    return jnp.linalg.slogdet(a)[1]


@case("jnp.linalg")(lambda: (spd(3),))
def linalg_inv(a):
    return jnp.sum(jnp.linalg.inv(a) ** 2)


@case("jnp.linalg")(lambda: (rnd(4, 4) + 3 * jnp.eye(4), rnd(4)))
def linalg_solve(a, b):
    return jnp.sum(jnp.linalg.solve(a, b) ** 2)


@case("jnp.linalg")(lambda: (rnd(4, 3),))
def linalg_svd_singular_values(a):
    return jnp.sum(jnp.linalg.svd(a, compute_uv=False) ** 2 + jnp.linalg.svd(a, compute_uv=False))


@case("jnp.linalg")(lambda: (rnd(4, 3),))
def linalg_svd_vectors(a):
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    return jnp.sum((u * s) @ vt * jnp.arange(3.0)) + jnp.sum(u[:, 0] ** 4)


@case("jnp.linalg")(lambda: (spd(4),))
def linalg_eigh(a):
    w, v = jnp.linalg.eigh(a)
    return jnp.sum(w ** 2) + jnp.sum(v[:, -1] ** 4)


@case("jnp.linalg")(lambda: (rnd(5, 3),))
def linalg_qr(a):
    q, r = jnp.linalg.qr(a)
    return jnp.sum(jnp.abs(jnp.diag(r))) + jnp.sum(q[:, 0] ** 3)


@case("jnp.linalg")(lambda: (rnd(4, 3),))
def linalg_pinv(a):
    return jnp.sum(jnp.linalg.pinv(a) ** 2)


@case("jnp.linalg")(lambda: (rnd(3, 4),))
def linalg_norms(a):
    return jnp.linalg.norm(a) + jnp.linalg.norm(a, ord=1) + jnp.linalg.norm(a[0])


@case("jnp.linalg")(lambda: (rnd(3, 4),))
def linalg_norm_spectral(a):
    return jnp.linalg.norm(a, ord=2)


# ── lax control flow ──────────────────────────────────────────────────────────

@case("lax")(lambda: (rnd(3), rnd(5, 3, seed=1)))
def lax_scan_rnn(h0, xs):
    h, ys = lax.scan(lambda h, x: (jnp.tanh(h + x * h[::-1]), h.sum()), h0, xs)
    return jnp.sum(h ** 2) + jnp.sum(ys)


@case("lax")(lambda: (rnd(3),))
def lax_fori_loop(x):
    return jnp.sum(lax.fori_loop(0, 5, lambda i, y: jnp.sin(y) * 1.1 + i, x) ** 2)



@case("lax")(lambda: (rnd(4),))
def lax_cond(x):
    return lax.cond(jnp.sum(x) > 0, lambda v: jnp.sum(v ** 2), lambda v: jnp.sum(jnp.sin(v)), x)


@case("lax")(lambda: (rnd(4),))
def lax_switch(x):
    i = jnp.argmax(x) % 3
    return lax.switch(i, [lambda v: jnp.sum(v ** 3), lambda v: jnp.sum(jnp.exp(v)), lambda v: jnp.sum(v)], x)


@case("lax")(lambda: (jnp.array(3.0),))
def lax_custom_root_sqrt(a):
    def solve(f, x0):
        return lax.while_loop(lambda x: jnp.abs(f(x)) > 1e-12, lambda x: x - f(x) / (2 * x), x0)
    f = lambda x: x ** 2 - a   # noqa: E731
    return lax.custom_root(f, 1.0, solve, lambda g, y: y / 2.0) ** 2



# ── composed transforms ───────────────────────────────────────────────────────

def _mlp_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@case("transforms")(lambda: (rnd(3, 2), rnd(4, 3, seed=1)))
def vmap_of_grad_per_example(w, xs):
    g = jax.vmap(jax.grad(_mlp_loss), in_axes=(None, 0))(w, xs[:, None, :])
    return jnp.sum(g ** 2)


@case("transforms")(lambda: (rnd(3, 2), rnd(3, 2, seed=2)))
def hessian_vector_product(w, v):
    x = jnp.eye(3)
    hvp = jax.jvp(jax.grad(_mlp_loss), (w, x), (v, jnp.zeros_like(x)))[1]
    return jnp.sum(hvp ** 2)


@jax.custom_vjp
def _grad_reverse(x):
    return x


_grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-g,))


@case("transforms", trust=("_grad_reverse",))(lambda: (rnd(4),))
def custom_vjp_gradient_reversal_trusted(x):
    return jnp.sum(jnp.sin(_grad_reverse(x * 2.0)))


@jax.custom_vjp
def _clip_grad(x):
    return jnp.tanh(x)


_clip_grad.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))


@case("transforms")(lambda: (rnd(5),))
def custom_vjp_faithful_rule(x):
    return jnp.sum(_clip_grad(x) ** 2)


@case("transforms")(lambda: (rnd(3, 3),))
def jacfwd_in_loss(w):
    j = jax.jacfwd(lambda v: jnp.tanh(w @ v))(jnp.ones(3))
    return jnp.sum(j ** 2)


@case("transforms")(lambda: (rnd(4, 3),))
def checkpointed_block(w):
    block = jax.checkpoint(lambda h: jnp.tanh(h @ w.T @ w))
    return jnp.sum(block(block(jnp.ones((2, 3)))) ** 2)


# ── precision and masks ───────────────────────────────────────────────────────

@case("masks", argnums=0)(lambda: (rnd(4, 3), jnp.array([[1, 0, 1, 1], [0, 1, 1, 0]], bool)))
def bool_mask_matmul(w, mask):
    return jnp.sum(jnp.tanh(mask @ w) ** 2)


@case("masks", argnums=0)(lambda: (rnd(5, 3), jnp.array([True, True, False, True, False])))
def where_masked_mean(x, mask):
    row = jnp.sum(x ** 2, axis=1)
    return jnp.sum(jnp.where(mask, row, 0.0)) / jnp.sum(mask)


@case("masks")(lambda: (rnd(4, 4),))
def float32_inner_matmul(w):
    return jnp.sum(jnp.tanh(w.astype(jnp.float32) @ w.astype(jnp.float32)).astype(jnp.float64))
