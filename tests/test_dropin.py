"""interop.value_and_grad and train_step as drop-ins on models written the way researchers write them:
flax's ResNet block (zero-initialised BatchNorm scale, blank inputs: relu's kink at every residual), a relu
CNN on scikit-learn's digits (blank pixels), flax's mnist ``apply_model`` form (value_and_grad built inside
the jitted step over a closure, has_aux), a last partial batch and an eval batch size.

Each is compared with jax.value_and_grad — float64: 1e-12 relative to the largest gradient (XLA and the
tape sum in other orders); float32: 1e-5 — and over K steps with jax.grad + optax.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import flax.linen as nn  # noqa: E402

import interop  # noqa: E402
from pytree_rel import rel  # noqa: E402
from interop import CaptureError  # noqa: E402


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def digits(n, dtype=jnp.float64):
    """scikit-learn's bundled 8x8 digits: a quarter of the pixels are exactly 0."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images[:n] / 16.0).astype(np.float64)[..., None]
    return jnp.asarray(x, dtype), jnp.asarray(d.target[:n])


# ── flax's ResNet block with BatchNorm ───────────────────────────────────────

class ResBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9, scale_init=nn.initializers.zeros)(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = ResBlock(4)(x, train)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


RESNET = ResNet()


def resnet_loss(params, batch_stats, x, y):
    logits, updates = RESNET.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                                   mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (logits, updates["batch_stats"])


def test_flax_resnet_block_at_step_zero_has_jax_s_gradients():
    """The last BatchNorm's scale starts at zero, so every residual enters relu's kink: jax.grad gives the
    BatchNorm parameters their gradients from relu's rule; the body's tie rule was 39-50% off."""
    x, y = digits(12)
    variables = RESNET.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]
    vg = interop.value_and_grad(resnet_loss, has_aux=True)
    (loss, (logits, new_stats)), g = jax.jit(vg)(params, stats, x, y)
    (jloss, (jlogits, jstats)), jg = jax.value_and_grad(resnet_loss, has_aux=True)(params, stats, x, y)
    assert abs(float(loss - jloss)) <= 1e-12 * abs(float(jloss))
    assert rel(g, jg) <= 1e-12, rel(g, jg)
    assert rel(new_stats, jstats) <= 1e-12 and rel(logits, jlogits) <= 1e-12
    bn = jg["ResBlock_0"]["BatchNorm_1"]
    assert float(np.abs(np.asarray(bn["scale"])).max()) > 0   # the zero scale does get a gradient


def f64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64), tree)


def test_train_step_trains_a_batchnorm_model_with_has_aux():
    x, y = digits(16)
    variables = f64(RESNET.init(jax.random.key(1), x))   # flax's float32 parameters, made float64
    params, stats = variables["params"], variables["batch_stats"]
    opt = optax.adam(1e-2)
    step, state = interop.train_step(resnet_loss, params, stats, x, y, optimizer=opt, has_aux=True)
    assert step.native_update and step.why is None

    @jax.jit
    def reference(p, s, stats, x, y):
        (loss, (_, stats)), g = jax.value_and_grad(resnet_loss, has_aux=True)(p, stats, x, y)
        u, s = opt.update(g, s, p)
        return loss, optax.apply_updates(p, u), s, stats
    p_ref, s_ref, stats_ref, ours = params, opt.init(params), stats, stats
    for k in range(5):
        xb, yb = x[k % 2::2], y[k % 2::2]
        (loss, (_, ours)), state = step(state, ours, xb, yb)
        loss_ref, p_ref, s_ref, stats_ref = reference(p_ref, s_ref, stats_ref, xb, yb)
        assert abs(float(loss - loss_ref)) <= 1e-10 * abs(float(loss_ref))
    assert rel(state[0], p_ref) <= 1e-10 and rel(ours, stats_ref) <= 1e-10


# ── a relu CNN on digits, in float32 ─────────────────────────────────────────

class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


CNN_MODEL = CNN()


def cnn_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(CNN_MODEL.apply({"params": params}, x), y).mean()


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_relu_cnn_on_digits_with_blank_pixels(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x, y = digits(32, dtype)
        params = CNN_MODEL.init(jax.random.key(2), x)["params"]
        vg = interop.value_and_grad(cnn_loss)
        bound = 1e-12 if dtype == jnp.float64 else 1e-5
        (v, g), (jv, jg) = jax.jit(vg)(params, x, y), jax.value_and_grad(cnn_loss)(params, x, y)
        assert abs(float(v - jv)) <= bound * abs(float(jv)) and rel(g, jg) <= bound, rel(g, jg)
        assert float(np.asarray(g["Conv_0"]["bias"]).min()) != float(np.asarray(g["Conv_0"]["bias"]).max())


# ── flax's mnist apply_model, and batches of new sizes ───────────────────────

def apply_model_with(value_and_grad):
    """flax's examples/mnist train.apply_model, with the value_and_grad it is given."""
    @jax.jit
    def apply_model(params, images, labels):
        def loss_fn(params):
            logits = CNN_MODEL.apply({"params": params}, images)
            loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=jax.nn.one_hot(labels, 10)))
            return loss, logits
        grad_fn = value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return grads, loss, accuracy
    return apply_model


def test_flax_mnist_apply_model_form_with_a_last_partial_batch():
    x, y = digits(40)
    params = CNN_MODEL.init(jax.random.key(3), x[:16])["params"]
    ours, theirs = apply_model_with(interop.value_and_grad), apply_model_with(jax.value_and_grad)
    for lo, hi in ((0, 16), (16, 32), (32, 40)):      # the last batch has 8 images
        g, loss, acc = ours(params, x[lo:hi], y[lo:hi])
        jg, jloss, jacc = theirs(params, x[lo:hi], y[lo:hi])
        assert abs(float(loss - jloss)) <= 1e-12 * abs(float(jloss)) and float(acc) == float(jacc)
        assert rel(g, jg) <= 1e-12


def test_train_step_captures_again_for_a_new_batch_size_and_step_scan_names_the_step_axis():
    x, y = digits(40)
    params = f64(CNN_MODEL.init(jax.random.key(4), x[:16])["params"])
    opt = optax.sgd(0.1, momentum=0.9)
    step, state = interop.train_step(cnn_loss, params, x[:16], y[:16], optimizer=opt)
    first = step.captured
    p_ref, s_ref = params, opt.init(params)
    for lo, hi in ((0, 16), (16, 32), (32, 40), (0, 16)):
        loss, state = step(state, x[lo:hi], y[lo:hi])
        jl, g = jax.value_and_grad(cnn_loss)(p_ref, x[lo:hi], y[lo:hi])
        u, s_ref = opt.update(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
        assert abs(float(loss - jl)) <= 1e-9 * abs(float(jl))   # rounding grows over the steps
    assert rel(state[0], p_ref) <= 1e-9
    assert step._sigs.captures == 2 and first is not step.captured   # 16 and 8 images; back at 16: no capture
    state, losses = step.scan(state, jnp.stack([x[:8], x[8:16]]), jnp.stack([y[:8], y[8:16]]))
    assert losses.shape == (2,) and step._sigs.captures == 2    # 8 images a step: the partial batch's capture
    with pytest.raises(CaptureError, match=r"leading axis of K steps"):
        step.scan(state, x[:8], y[:9])


def test_step_scan_over_zero_steps_is_lax_scan_s():
    x, y = digits(8)
    params = CNN_MODEL.init(jax.random.key(5), x)["params"]
    step, state = interop.train_step(cnn_loss, params, x, y, optimizer=optax.adam(1e-3))
    before = jax.tree.map(np.asarray, state)
    state, losses = step.scan(state, x[None][:0], y[None][:0])
    assert losses.shape == (0,) and losses.dtype == jnp.float64
    assert rel(state, before) == 0.0


# ── refusals that teach ──────────────────────────────────────────────────────

class BF16MLP(nn.Module):
    @nn.compact
    def __call__(self, x):   # float32 parameters, bfloat16 compute: the standard mixed-precision setup
        return nn.Dense(4, dtype=jnp.bfloat16)(nn.relu(nn.Dense(8, dtype=jnp.bfloat16)(x)))


class BF16Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.bfloat16)(x)
        return nn.LayerNorm(dtype=jnp.bfloat16)(x + h)


@pytest.mark.parametrize("model, shape", [(BF16MLP(), (3, 5)), (BF16Encoder(), (2, 4, 8))], ids=["mlp", "encoder"])
def test_bf16_compute_is_refused_naming_the_equation_and_the_dtype(model, shape):
    with jax.enable_x64(False):
        x = jnp.ones(shape)
        params = model.init(jax.random.key(0), x)["params"]
        loss = lambda p, x: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32) ** 2)   # noqa: E731
        with pytest.raises(CaptureError, match=r"equation \d+ \(.*bf16.*\).* computes in bfloat16, which the "
                                               r"program would compute in float32"):
            interop.value_and_grad(loss)(params, x)


def test_float32_parameters_of_a_float64_computation_are_cast_as_jax_casts_them():
    """flax keeps parameters in float32 (param_dtype) while 64-bit data promotes the computation to float64:
    the program computes in float64 and the gradients come back in float32, as jax.grad's do."""
    rng = np.random.default_rng(6)
    p = {"w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32), "b": jnp.asarray(rng.standard_normal(2))}
    x = jnp.asarray(rng.standard_normal((4, 3)))                   # float64 data
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)   # noqa: E731
    vg = interop.value_and_grad(loss)
    (v, g), (jv, jg) = vg(p, x), jax.value_and_grad(loss)(p, x)
    assert vg.captured.program.dtype == np.float64 and v.dtype == jnp.float64
    assert g["w"].dtype == jnp.float32 and g["b"].dtype == jnp.float64
    assert rel(g, jg) <= 1e-7 and abs(float(v - jv)) <= 1e-12   # w's gradient rounded to float32, as JAX's


def test_parameters_in_a_low_precision_and_steps_below_the_program_s_are_refused_by_name():
    x = jnp.ones((2, 3), jnp.float32)
    loss = lambda p, x: jnp.sum((x @ p["w"]).astype(jnp.float64) + p["b"].sum())   # noqa: E731
    mixed = {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.ones(2, jnp.float64)}   # x @ w in float32
    with pytest.raises(CaptureError, match=r"equation \d+ \(.*dot_general.*\) computes in float32, which the "
                                           r"program would compute in float64"):
        interop.value_and_grad(loss)(mixed, x)
    low = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(CaptureError, match=r"parameters \[0\]\['b'\], \[0\]\['w'\] are bfloat16.*Keep "
                                           r"parameters in float32"):
        interop.value_and_grad(loss)(low, x)


def test_an_optimizer_that_is_not_optax_is_refused_by_name():
    with pytest.raises(CaptureError, match=r"optimizer must be an optax GradientTransformation .* got float 0.001"):
        interop.train_step(lambda w, x: jnp.sum(w * x), jnp.ones(3), jnp.ones(3), optimizer=1e-3)


def test_has_aux_needs_a_pair_and_says_what_came():
    with pytest.raises(CaptureError, match=r"has_aux=True needs fn to return a pair \(value, aux\), got PyTreeDef\(\*\)"):
        interop.value_and_grad(lambda w: jnp.sum(w ** 2), has_aux=True)(jnp.ones(3))


@pytest.mark.parametrize("fn,says", [
    (lambda w: jnp.sum(jnp.sort(w) * jnp.arange(3.0)), r"equation 0 \(.*sort.*\) uses sort: sorting values the "
                                                       r"parameters move would freeze the example's order"),
    (lambda w: jnp.sum(w ** w), r"equation 0 \(.*pow b b\) uses pow: .* write jnp.exp\(y \* jnp.log\(x\)\)"),
    (lambda w: jnp.sum(jnp.linalg.eigh(jnp.outer(w, w) + jnp.eye(3))[0]),
     r"uses eigh: the oracle takes JAX's value of it at one point.*train this function with jax.jit")])
def test_a_primitive_without_a_capture_rule_is_refused_with_its_equation_and_what_to_write(fn, says):
    with pytest.raises(interop.UnsupportedPrimitiveError, match=says):
        interop.value_and_grad(fn)(jnp.array([1.0, 3.0, 2.0]))


def test_clamp_is_captured_with_jax_s_rule_at_its_bounds():
    """lax.clamp (flax's PPO example clips the probability ratio): no gradient at a bound, as JAX's rule."""
    loss = lambda w, x: jnp.sum(jax.lax.clamp(0.8, x * w, 1.2) * jnp.arange(1.0, 6.0))   # noqa: E731
    w, x = jnp.ones(5), jnp.array([0.5, 0.8, 1.0, 1.2, 1.5])
    vg = interop.value_and_grad(loss)
    (v, g), (jv, jg) = vg(w, x), jax.value_and_grad(loss)(w, x)
    assert float(v) == float(jv) and np.array_equal(np.asarray(g), np.asarray(jg))
    assert np.asarray(g).tolist() == [0.0, 0.0, 3.0, 0.0, 0.0]
