"""interop.capture_jax / value_and_grad / train_step: JAX, flax and equinox losses, none rewritten,
as tapegrad programs — checked against jax.value_and_grad (float64: 1e-12 relative; float32: 1e-5) and
finite differences, with integer labels, token ids and masks that change between calls."""
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


def agree(vg, fn, args, bound=1e-12, argnums=0):
    v, g = jax.jit(vg)(*args)
    jv, jg = jax.value_and_grad(fn, argnums=argnums)(*args)
    assert jax.tree.structure(g) == jax.tree.structure(jg)
    assert abs(float(v) - float(jv)) <= bound * max(1.0, abs(float(jv)))
    assert rel(g, jg) <= bound, rel(g, jg)
    return v, g


def fd_check(fn, params, args, grads, h=1e-6, tol=1e-6):
    """Central differences along three random directions agree with the directional derivative."""
    rng = np.random.default_rng(1)
    for _ in range(3):
        d = jax.tree.map(lambda p: rng.standard_normal(p.shape), params)
        plus = fn(jax.tree.map(lambda p, u: np.asarray(p) + h * u, params, d), *args)
        minus = fn(jax.tree.map(lambda p, u: np.asarray(p) - h * u, params, d), *args)
        fd = (float(plus) - float(minus)) / (2 * h)
        dd = sum(float(np.sum(np.asarray(g) * u)) for g, u in zip(jax.tree.leaves(grads), jax.tree.leaves(d)))
        assert abs(fd - dd) <= tol * max(1.0, abs(dd)), (fd, dd)


def mlp_loss(w, x, labels):
    h = jax.nn.relu(x @ w["w1"] + w["b1"])
    logits = h @ w["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mlp_params(rng, d=6, h=8, c=4, dtype=jnp.float64):
    return {"w1": jnp.asarray(rng.standard_normal((d, h)), dtype), "b1": jnp.asarray(rng.uniform(0.1, 0.5, h), dtype),
            "w2": jnp.asarray(rng.standard_normal((h, c)), dtype)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp_with_integer_labels_matches_jax_and_finite_differences_on_new_batches(backend):
    rng = np.random.default_rng(0)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.array([0, 3, 1, 2, 3])
    vg = interop.value_and_grad(mlp_loss, w, x, y, backend=backend)
    assert vg.captured.program.backend == backend and vg.captured.program.data   # labels are a data slot
    for _ in range(3):   # new labels and inputs each call: nothing of the example is frozen in
        x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))
        v, g = agree(vg, mlp_loss, (w, x, y))
        fd_check(mlp_loss, w, (x, y), g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_model_runs_in_float32_within_its_bound(backend):
    with jax.enable_x64(False):
        rng = np.random.default_rng(2)
        w = mlp_params(rng, dtype=jnp.float32)
        x, y = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32), jnp.array([1, 0, 2, 2, 3])
        vg = interop.value_and_grad(mlp_loss, w, x, y, backend=backend)
        assert vg.captured.program.dtype == np.float32
        v, g = agree(vg, mlp_loss, (w, x, jnp.array([3, 3, 0, 1, 2])), bound=1e-5)
        assert v.dtype == jnp.float32 and g["w1"].dtype == jnp.float32


def attention_loss(p, x, lengths):
    """One attention head with a causal mask and a padding mask from per-sequence lengths."""
    B, T, _ = x.shape
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    scores = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((T, T), bool))
    pad = jnp.arange(T)[None, :] < lengths[:, None]
    mask = causal[None] & pad[:, None, :]
    att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    out = jnp.einsum("bts,bsd->btd", att, v)
    return jnp.sum(jnp.where(pad[:, :, None], jnp.tanh(out), 0.0) ** 2) / jnp.sum(lengths)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_masks_from_lengths_follows_each_call(backend):
    rng = np.random.default_rng(3)
    p = {n: jnp.asarray(rng.standard_normal((4, 4)) / 2) for n in "qkv"}
    x = jnp.asarray(rng.standard_normal((2, 5, 4)))
    vg = interop.value_and_grad(attention_loss, p, x, jnp.array([5, 3]), backend=backend)
    for lengths in ([5, 3], [2, 4], [1, 5]):
        _, g = agree(vg, attention_loss, (p, x, jnp.array(lengths)))
    fd_check(attention_loss, p, (x, jnp.array([1, 5])), g)


def bag_loss(table, ids, segments, target):
    """An embedding bag: rows gathered by token id, summed per bag with segment_sum (a scatter-add)."""
    rows = table[ids]
    bags = jax.ops.segment_sum(rows, segments, num_segments=3)
    return jnp.mean((jnp.tanh(bags) - target) ** 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_bag_with_token_ids_and_segments(backend):
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.standard_normal((10, 3)))
    target = jnp.asarray(rng.standard_normal((3, 3)))
    ids, seg = jnp.array([1, 4, 4, 9, 0, 2]), jnp.array([0, 0, 1, 1, 2, 2])
    vg = interop.value_and_grad(bag_loss, table, ids, seg, target, backend=backend)
    for ids, seg in (([1, 4, 4, 9, 0, 2], [0, 0, 1, 1, 2, 2]), ([7, 7, 7, 3, 5, 6], [0, 1, 1, 1, 2, 2])):
        args = (table, jnp.array(ids), jnp.array(seg), target)
        _, g = agree(vg, bag_loss, args)
    fd_check(bag_loss, table, args[1:], g)


def rnn_loss(p, xs):
    def cell(h, x):
        h = jnp.tanh(x @ p["wx"] + h @ p["wh"])
        return h, jnp.sum(h)
    h, ys = jax.lax.scan(cell, jnp.zeros(3), xs)
    h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ p["wh"]), h)
    return jnp.sum(h ** 2) + jnp.mean(ys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_and_static_fori_loop_are_unrolled_with_the_sequence_fed_each_call(backend):
    rng = np.random.default_rng(5)
    p = {"wx": jnp.asarray(rng.standard_normal((2, 3))), "wh": jnp.asarray(rng.standard_normal((3, 3)) / 2)}
    vg = interop.value_and_grad(rnn_loss, p, jnp.asarray(rng.standard_normal((4, 2))), backend=backend)
    xs = jnp.asarray(rng.standard_normal((4, 2)))
    _, g = agree(vg, rnn_loss, (p, xs))
    fd_check(rnn_loss, p, (xs,), g)


def test_has_aux_and_several_argnums_give_jax_s_structure():
    rng = np.random.default_rng(6)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.array([0, 1, 2, 3, 0])

    def f(w, x, y):
        loss = mlp_loss(w, x, y)
        return loss, {"loss2": loss * 2, "n": jnp.sum(y)}
    vg = interop.value_and_grad(f, w, x, y, argnums=(0, 1), has_aux=True, backend="numpy")
    (v, aux), g = jax.jit(vg)(w, x, y)
    (jv, jaux), jg = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(w, x, y)
    assert isinstance(g, tuple) and len(g) == 2
    assert rel(g, jg) <= 1e-12 and abs(float(v) - float(jv)) <= 1e-12
    assert float(aux["loss2"]) == float(jaux["loss2"]) and int(aux["n"]) == int(jaux["n"])


def test_vmap_gives_per_example_gradients():
    rng = np.random.default_rng(7)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((4, 1, 6))), jnp.array([[0], [1], [2], [3]])
    vg = interop.value_and_grad(mlp_loss, w, x[0], y[0], backend="native")
    v, g = jax.jit(jax.vmap(vg, in_axes=(None, 0, 0)))(w, x, y)
    jv, jg = jax.vmap(jax.value_and_grad(mlp_loss), in_axes=(None, 0, 0))(w, x, y)
    assert rel(g, jg) <= 1e-12 and float(jnp.max(jnp.abs(v - jv))) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_and_equinox_models_as_users_write_them(backend):
    flax_nn = pytest.importorskip("flax.linen")
    eqx = pytest.importorskip("equinox")

    class CNN(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            x = flax_nn.Conv(4, (3, 3), param_dtype=jnp.float64)(x)
            x = flax_nn.avg_pool(flax_nn.gelu(x), (2, 2), strides=(2, 2))
            x = flax_nn.LayerNorm(param_dtype=jnp.float64)(x.reshape(x.shape[0], -1))
            return flax_nn.Dense(3, param_dtype=jnp.float64)(x)
    model = CNN()
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 1)))
    params = model.init(jax.random.key(0), x)["params"]

    def flax_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()
    vg = interop.value_and_grad(flax_loss, params, x, jnp.array([0, 2]), backend=backend)
    _, g = agree(vg, flax_loss, (params, jnp.asarray(rng.standard_normal((2, 6, 6, 1))), jnp.array([1, 1])))

    mlp = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(1), dtype=jnp.float64)
    arrays, static = eqx.partition(mlp, eqx.is_array)

    def eqx_loss(arrays, x, t):
        m = eqx.combine(arrays, static)
        return jnp.mean((jax.vmap(m)(x) - t) ** 2)
    x, t = jnp.asarray(rng.standard_normal((4, 3))), jnp.asarray(rng.standard_normal((4, 2)))
    vg = interop.value_and_grad(eqx_loss, arrays, x, t, backend=backend)
    _, g = agree(vg, eqx_loss, (arrays, x * 2, t))
    fd_check(eqx_loss, arrays, (x * 2, t), g)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "clip+adamw(cosine, mask)": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(optax.cosine_decay_schedule(1e-2, 100), weight_decay=1e-3,
                                                    mask=lambda p: {"w1": True, "b1": False, "w2": True})),
    "sgd": lambda: optax.sgd(0.05),
    "sgd(nesterov, warmup cosine)": lambda: optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.05, 10, 100),
                                                      momentum=0.9, nesterov=True),
    "clip+sgd(momentum)": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.8)),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_train_step_keeps_optax_s_state_and_matches_plain_optax_over_100_steps(name):
    rng = np.random.default_rng(9)
    w = mlp_params(rng)
    batches = [(jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))) for _ in range(4)]
    for opt in (OPTIMIZERS[name](),):
        step, state = interop.train_step(mlp_loss, w, *batches[0], optimizer=opt)
        assert step.native_update and step.why is None   # the whole step is one custom call
        assert jax.tree.structure(state[1]) == jax.tree.structure(opt.init(w))

        @jax.jit
        def ref(state, x, y):
            p, s = state
            loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
            u, s = opt.update(g, s, p)
            return loss, (optax.apply_updates(p, u), s)
        rstate = (w, opt.init(w))
        for k in range(100):
            x, y = batches[k % 4]
            loss, state = step(state, x, y)
            rloss, rstate = ref(rstate, x, y)
            assert abs(float(loss) - float(rloss)) <= 1e-12 * max(1.0, abs(float(rloss)))
        assert rel(state[0], rstate[0]) <= 1e-12
        assert jax.tree.structure(state) == jax.tree.structure(rstate)
        assert rel(state[1], rstate[1]) <= 1e-12   # moments, traces and counts too
        assert [a.dtype for a in jax.tree.leaves(state)] == [a.dtype for a in jax.tree.leaves(rstate)]
        # continue with plain optax from train_step's state
        _, cont = ref(state, *batches[0])
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(cont[0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adam", "clip+adamw(cosine, mask)", "sgd(nesterov, warmup cosine)"])
def test_step_scan_runs_k_steps_in_one_call_as_lax_scan_of_the_step(backend, name):
    rng = np.random.default_rng(13)
    w = mlp_params(rng)
    xs, ys = jnp.asarray(rng.standard_normal((12, 5, 6))), jnp.asarray(rng.integers(0, 4, (12, 5)))
    opt = OPTIMIZERS[name]()
    step, state = interop.train_step(mlp_loss, w, xs[0], ys[0], optimizer=opt, backend=backend)
    assert step.native_update
    copy = lambda s: jax.tree.map(jnp.array, s)   # noqa: E731 — both forms donate their state
    want = jax.jit(lambda s: jax.lax.scan(lambda s, b: step(s, *b)[::-1], s, (xs, ys)))(copy(state))
    got = step.scan(copy(state), xs, ys)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [a.dtype for a in jax.tree.leaves(got)] == [a.dtype for a in jax.tree.leaves(want)]
    if name == "adam":   # the same episodes in the same order: the same bits
        assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    else:   # a schedule's values come from one vectorised evaluation instead of one per step
        assert rel(got, want) <= 1e-12
    @jax.jit   # and both are what plain optax computes, step by step
    def ref(p, s, x, y):
        loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return loss, optax.apply_updates(p, u), s
    p, s = w, opt.init(w)
    for k in range(12):
        loss, p, s = ref(p, s, xs[k], ys[k])
        assert abs(float(got[1][k]) - float(loss)) <= 1e-12 * max(1.0, abs(float(loss))), k
    assert rel(got[0], (p, s)) <= 1e-12
    # the gradient-only form (optax's update in XLA) has the same scan
    xla, state = interop.train_step(mlp_loss, w, xs[0], ys[0], optimizer=opt, backend=backend, native_update=False)
    assert rel(xla.scan(state, xs, ys), got) <= 1e-12


def test_step_scan_names_batches_without_a_shared_step_axis():
    rng = np.random.default_rng(14)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))
    step, state = interop.train_step(mlp_loss, w, x, y, optimizer=optax.adam(1e-2))
    with pytest.raises(CaptureError, match=r"step.scan: every batch leaf must hold one batch per step on a shared "
                                           r"leading axis of K steps \(as lax.scan takes them: stack K batches with jnp.stack\), got "
                                           r"shapes \[\(3, 5, 6\), \(4, 5\)\]"):
        step.scan(state, jnp.stack([x] * 3), jnp.stack([y] * 4))
    loss, state = step(state, x, y)   # the state was not consumed by the refused call
    assert np.isfinite(float(loss))


def test_train_step_runs_an_optimizer_without_a_native_form_through_xla_and_says_why():
    rng = np.random.default_rng(10)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))
    opt = optax.lion(1e-3)
    step, state = interop.train_step(mlp_loss, w, x, y, optimizer=opt)
    assert not step.native_update and step.why == "optax's scale_by_lion has no native form"
    loss, state = step(state, x, y)
    g = jax.grad(mlp_loss)(w, x, y)
    u, _ = opt.update(g, opt.init(w), w)
    assert rel(state[0], optax.apply_updates(w, u)) <= 1e-12
    with pytest.raises(CaptureError, match="native_update=True, but the optimizer has no native step: optax's "
                                           "scale_by_lion has no native form"):
        interop.train_step(mlp_loss, w, x, y, optimizer=opt, native_update=True)
    with pytest.raises(CaptureError, match=r"the chain \['scale_by_adam', 'trace', 'scale'\] is not adam"):
        interop.train_step(mlp_loss, w, x, y, optimizer=optax.chain(optax.scale_by_adam(), optax.trace(0.9),
                                                                     optax.scale(-0.1)), native_update=True)
    step, _ = interop.train_step(mlp_loss, w, x, y, optimizer=optax.adam(1e-3), native_update=False)
    assert not step.native_update and step.why == "native_update=False"


def test_a_misread_optimizer_is_caught_against_optax_before_it_trains(monkeypatch):
    from interop.capture import optax_native
    real = optax_native.read

    def misread(opt):
        spec = real(opt)
        spec.b2 = 0.9   # optax.adam's b2 is 0.999
        return spec
    monkeypatch.setattr(optax_native, "read", misread)
    rng = np.random.default_rng(11)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))
    step, _ = interop.train_step(mlp_loss, w, x, y, optimizer=optax.adam(1e-2))
    assert not step.native_update and "differs from optax's" in step.why and "misread" in step.why


def test_train_step_trains_equinox_and_plain_jnp_losses_natively():
    eqx = pytest.importorskip("equinox")
    rng = np.random.default_rng(12)
    mlp = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(1), dtype=jnp.float64)
    arrays, static = eqx.partition(mlp, eqx.is_array)

    def eqx_loss(arrays, x, t):
        return jnp.mean((jax.vmap(eqx.combine(arrays, static))(x) - t) ** 2)

    def jnp_loss(w, x, t):
        return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - t) ** 2) + 1e-3 * jnp.sum(w["a"] ** 2)
    w = {"a": jnp.asarray(rng.standard_normal((3, 4))), "b": jnp.asarray(rng.standard_normal((4, 2)))}
    x, t = jnp.asarray(rng.standard_normal((6, 3))), jnp.asarray(rng.standard_normal((6, 2)))
    for fn, p in ((eqx_loss, arrays), (jnp_loss, w)):
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(1e-2, 50)))
        step, state = interop.train_step(fn, p, x, t, optimizer=opt)
        assert step.native_update
        ref = (p, opt.init(p))

        @jax.jit
        def ref_step(ref, fn=fn, opt=opt):
            u, s = opt.update(jax.grad(fn)(ref[0], x, t), ref[1], ref[0])
            return optax.apply_updates(ref[0], u), s
        for _ in range(50):
            loss, state = step(state, x, t)
            ref = ref_step(ref)
        assert rel(state, ref) <= 1e-12
        assert jax.tree.structure(state) == jax.tree.structure(ref)


def test_what_cannot_be_captured_is_named():
    w = jnp.ones(3)

    def newton(w):
        def body(c):
            x, i = c
            return x - (x * x - w.sum()) / (2 * x), i + 1
        x, _ = jax.lax.while_loop(lambda c: jnp.abs(c[0] * c[0] - w.sum()) > 1e-9, body, (jnp.array(1.0), 0))
        return x
    with pytest.raises(CaptureError, match="while_loop whose trip count depends on the arguments"):
        interop.capture_jax(newton, w, backend="numpy")
    def cond_in_loop(w, f):
        return jax.lax.fori_loop(0, 2, lambda i, a: a + jax.lax.cond(f * a > 0, jnp.sum, jnp.prod, w), 0.0)
    with pytest.raises(CaptureError, match="operand .* changes between calls and is not a float|inside a loop"):
        interop.capture_jax(cond_in_loop, w, jnp.array(1.0), backend="numpy")
    with pytest.raises(CaptureError, match="differentiated arguments hold floats only"):
        interop.capture_jax(lambda p: jnp.sum(p["w"]) * p["n"], {"w": w, "n": jnp.array(2)}, backend="numpy")
    with pytest.raises(CaptureError, match="no float leaf"):
        interop.capture_jax(lambda n: jnp.sum(n * 1.0), jnp.arange(3), backend="numpy")
    vg = interop.value_and_grad(lambda w, x: jnp.sum(w * x), w, w, backend="numpy")
    with pytest.raises(TypeError, match=r"incompatible shapes for broadcasting: \(3,\), \(4,\)"):
        vg(w, jnp.ones(4))       # a new signature is traced again, and JAX says what jax.value_and_grad says
    cap = interop.capture_jax(lambda w, x: jnp.sum(w * x), w, w, backend="numpy")
    with pytest.raises(CaptureError, match=r"argument leaf 1 must be float64\[3\] \(as captured\), got float64\[4\]"):
        cap.operands(w, jnp.ones(4))


@pytest.mark.parametrize("name", ["eigh", "svd", "qr"])
def test_a_rule_taking_jax_s_value_is_refused_by_capture_not_frozen_at_the_example(name):
    # the oracle keeps JAX's value of these (its derivative written here): a program would replay the
    # example's value at every later call, so capture refuses them by name
    fns = {"eigh": lambda a: jnp.sum(jnp.linalg.eigh(a @ a.T + jnp.eye(3))[0] ** 2),
           "svd": lambda a: jnp.sum(jnp.linalg.svd(a, compute_uv=False) ** 3),
           "qr": lambda a: jnp.sum(jnp.linalg.qr(a)[1] ** 3)}
    with pytest.raises(interop.UnsupportedPrimitiveError, match=name):
        interop.capture_jax(fns[name], jnp.eye(3) * 0.5 + 0.1, backend="numpy")


def test_data_operands_of_program_call_are_checked_by_kind_and_shape():
    rng = np.random.default_rng(10)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.array([0, 1, 2, 3, 0])
    cap = interop.capture_jax(mlp_loss, w, x, y, backend="native")
    call = interop.program_call(cap.program, data=True)
    params, inputs, data, _ = cap.operands(w, x, y)
    kinds = [d.dtype.kind for d in data]   # gather index maps (from the labels), fill and is_finite masks
    assert len(kinds) == len(cap.program.data) and kinds[:2] == ["i", "b"]
    loss = call(*params, *inputs, *data)
    assert float(loss) == pytest.approx(float(mlp_loss(w, x, y)), rel=1e-12)
    with pytest.raises(interop.ProgramError, match=r"data\[0\] must be int32 or int64 \(a data slot of the "
                                                    r"program\), got float64"):
        call(*params, *inputs, data[0].astype(jnp.float64), *data[1:])
    with pytest.raises(interop.ProgramError, match=r"data\[1\] must have shape \(5, 1\)"):
        call(*params, *inputs, data[0], data[1][:3], *data[2:])
    with pytest.raises(interop.ProgramError, match=rf"expected {len(data)} data arrays"):
        call(*params, *inputs, data[0])


def test_flax_batchnorm_in_training_mode_and_dropout_keys_per_call():
    nn = pytest.importorskip("flax.linen")
    F = {"param_dtype": jnp.float64, "dtype": jnp.float64}

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.BatchNorm(use_running_average=not train, **F)(nn.Dense(8, **F)(x))
            x = nn.Dropout(0.3, deterministic=not train)(jax.nn.relu(x))
            return nn.Dense(3, **F)(x)
    m = M()
    rng = np.random.default_rng(11)
    x, y = jnp.asarray(rng.standard_normal((6, 4))), jnp.array([0, 1, 2, 0, 1, 2])
    v = m.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, True)

    def loss(p, bs, x, y, key):   # batch_stats mutable, returned as aux, as flax training loops do
        logits, upd = m.apply({"params": p, "batch_stats": bs}, x, True, rngs={"dropout": key},
                              mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd["batch_stats"]
    vg = interop.value_and_grad(loss, v["params"], v["batch_stats"], x, y, jax.random.key(2), has_aux=True)
    for k in (3, 4):   # another dropout key each call: another mask, computed by JAX
        args = (v["params"], v["batch_stats"], x * 1.1, y, jax.random.key(k))
        (val, stats), g = jax.jit(vg)(*args)
        (jval, jstats), jg = jax.value_and_grad(loss, has_aux=True)(*args)
        assert abs(float(val) - float(jval)) <= 1e-12 and rel(g, jg) <= 1e-12 and rel(stats, jstats) <= 1e-12


def test_flax_nnx_module_through_split_and_merge():
    nnx = pytest.importorskip("flax.nnx")

    class M(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs, param_dtype=jnp.float64)
            self.l2 = nnx.Linear(8, 3, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.l2(jax.nn.silu(self.l1(x)))
    graphdef, state = nnx.split(M(nnx.Rngs(0)))

    def loss(state, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, state)(x), y).mean()
    rng = np.random.default_rng(12)
    x, y = jnp.asarray(rng.standard_normal((6, 4))), jnp.array([0, 1, 2, 0, 1, 2])
    vg = interop.value_and_grad(loss, state, x, y)
    _, g = agree(vg, loss, (state, x, y[::-1]))
    fd_check(loss, state, (x, y[::-1]), g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cond_and_switch_on_call_values_capture_every_branch(backend):
    def f(w, flag, k):
        a = jax.lax.cond(flag > 0, lambda w: jnp.sum(jnp.tanh(w) ** 2), lambda w: jnp.sum(jnp.sin(w)), w)
        b = jax.lax.switch(k, [lambda w: jnp.sum(w * w), lambda w: jnp.prod(w), lambda w: jnp.max(w)], w)
        return a + b
    w = jnp.array([0.3, -0.5, 1.2])
    vg = interop.value_and_grad(f, w, jnp.array(1.0), jnp.array(0), backend=backend)
    for flag, k in ((1.0, 0), (-1.0, 1), (2.0, 2), (-3.0, 7)):   # 7: clamped to the last branch, as in JAX
        _, g = agree(vg, f, (w, jnp.array(flag), jnp.array(k)))
    fd_check(f, w, (jnp.array(-3.0), jnp.array(7)), g)


def test_a_whole_equinox_module_as_the_argument_says_to_partition_it():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0), dtype=jnp.float64)
    with pytest.raises(CaptureError, match=r"argument leaf .* is a \w+, not an array; .*eqx.partition\(model, "
                                           r"eqx.is_array\)"):
        interop.capture_jax(lambda m, x: jnp.sum(m(x)), mlp, jnp.ones(3), backend="numpy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_gradient_and_the_softmax_shift_are_computed_in_the_program(backend):
    """No JAX forward per call: stop_gradient and select(is_finite(m), m, 0) become program ops, so the
    fed operands are the data only (x, the labels' index maps), never a value of the parameters."""
    rng = np.random.default_rng(13)
    w = mlp_params(rng)
    x, y = jnp.asarray(rng.standard_normal((5, 6))), jnp.asarray(rng.integers(0, 4, 5))

    def loss(w, x, y, mask, held=None):   # jax.nn.log_softmax (a stop_gradient shift), optax's xent (is_finite)
        h = jnp.tanh(x @ w["w1"] + w["b1"]) @ w["w2"]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(jnp.where(mask, h, -jnp.inf)), y[:, None], axis=1)[:, 0]
        xent = optax.softmax_cross_entropy_with_integer_labels(h, y)
        frozen = jax.lax.stop_gradient(w["b1"] ** 2) if held is None else held
        return jnp.mean(nll) + jnp.mean(xent) + jnp.sum(w["b1"] * frozen)
    mask = jnp.ones((5, 4), bool).at[:, 3].set(False)
    y = jnp.minimum(y, 2)
    vg = interop.value_and_grad(loss, w, x, y, mask, backend=backend)
    prog = vg.captured.program
    names = [nd[0].name for nd in prog.nodes]
    assert "stop_gradient" in names and "finite_or_zero" in names
    assert vg.captured.fed == [(5, 6)]   # x only: nothing computed from w by JAX
    w2 = jax.tree.map(lambda a: a * 1.5, w)
    _, g = agree(vg, loss, (w2, x, y, mask))
    fd_check(loss, w2, (x, y, mask, w2["b1"] ** 2), g)   # finite differences with the stopped value held


def test_flax_lstm_language_model_and_encoder_block_train_natively():
    """An LSTM under nn.RNN (a scan) over token ids, and a transformer encoder block with causal and
    padding masks from lengths: gradients as jax.grad's, 20 native Adam steps as optax's."""
    nn = pytest.importorskip("flax.linen")
    F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(20, 8, param_dtype=jnp.float64)(tokens)
            return nn.Dense(20, **F64)(nn.RNN(nn.OptimizedLSTMCell(12, param_dtype=jnp.float64))(x))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, lengths):
            T = x.shape[1]
            pad = jnp.arange(T)[None, :] < lengths[:, None]
            mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((x.shape[0], T))), nn.make_attention_mask(pad, pad))
            h = nn.LayerNorm(**F64)(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, **F64)(h, h, mask=mask)
            x = x + nn.Dense(x.shape[-1], **F64)(nn.gelu(nn.Dense(2 * x.shape[-1], **F64)(nn.LayerNorm(**F64)(x))))
            return nn.Dense(3, **F64)((x * pad[..., None]).sum(1) / lengths[:, None])
    rng = np.random.default_rng(14)
    lm, block = LM(), Block()
    tok = jnp.asarray(rng.integers(0, 20, (3, 6)))
    x, lengths, y = jnp.asarray(rng.standard_normal((3, 5, 8))), jnp.array([5, 3, 1]), jnp.array([0, 2, 1])
    cases = [
        (lambda p, tok: optax.softmax_cross_entropy_with_integer_labels(
            lm.apply({"params": p}, tok[:, :-1]), tok[:, 1:]).mean(), jax.jit(lm.init)(jax.random.key(0), tok)["params"],
         (tok,), (jnp.asarray(rng.integers(0, 20, (3, 6))),)),
        (lambda p, x, n, y: optax.softmax_cross_entropy_with_integer_labels(block.apply({"params": p}, x, n), y).mean(),
         jax.jit(block.init)(jax.random.key(1), x, lengths)["params"], (x, lengths, y),
         (x * 0.5, jnp.array([2, 5, 4]), y[::-1])),
    ]
    for loss, params, example, other in cases:
        vg = interop.value_and_grad(loss, params, *example)
        _, g = agree(vg, jax.jit(loss), (params, *other))
        fd_check(jax.jit(loss), params, other, g)
        opt = optax.adam(1e-2)
        step, state = interop.train_step(loss, params, *example, optimizer=opt)
        assert step.native_update
        ref = (params, opt.init(params))

        @jax.jit
        def ref_step(ref, batch, loss=loss, opt=opt):
            u, s = opt.update(jax.grad(loss)(ref[0], *batch), ref[1], ref[0])
            return optax.apply_updates(ref[0], u), s
        for k in range(20):
            batch = example if k % 2 else other
            _, state = step(state, *batch)
            ref = ref_step(ref, batch)
        # The attention's key bias has an exactly zero gradient (softmax ignores a constant added to a
        # query's scores): both sides step on rounding noise there, so it is bounded, not compared.
        noise = lambda t: {k: v for k, v in jax.tree_util.tree_flatten_with_path(t)[0]  # noqa: E731
                           if "'key'" in jax.tree_util.keystr(k) and "'bias'" in jax.tree_util.keystr(k)}
        for tree in (state, ref):
            assert all(float(jnp.max(jnp.abs(v))) <= 1e-8 for v in noise(tree).values())
        drop = lambda t: [v for k, v in jax.tree_util.tree_flatten_with_path(t)[0]  # noqa: E731
                          if not ("'key'" in jax.tree_util.keystr(k) and "'bias'" in jax.tree_util.keystr(k))]
        assert rel(drop(state), drop(ref)) <= 1e-12


SHARDED = r'''
import os, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, optax, interop
from interop import jax, jnp
from jax.sharding import PartitionSpec as P, NamedSharding
jax.config.update("jax_enable_x64", True)

def loss(w, x, labels):
    logits = jax.nn.relu(x @ w["w1"] + w["b1"]) @ w["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()
rng = np.random.default_rng(0)
w = {"w1": jnp.asarray(rng.standard_normal((6, 8))), "b1": jnp.full(8, 0.1), "w2": jnp.asarray(rng.standard_normal((8, 4)))}
X, Y = jnp.asarray(rng.standard_normal((10, 6))), jnp.asarray(rng.integers(0, 4, 10))
vg = interop.value_and_grad(loss, w, X[:5], Y[:5])          # captured at one shard's shapes
mesh = jax.make_mesh((2,), ("data",))

@jax.jit
@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
def dp(w, x, y):
    l, g = vg(w, x, y)
    return jax.lax.psum(l, "data"), g      # the replicated parameters' gradients are summed by the cast
sh = NamedSharding(mesh, P("data"))
l, g = dp(w, jax.device_put(X, sh), jax.device_put(Y, sh))
jl, jg = jax.value_and_grad(loss)(w, X, Y)
err = max([abs(float(l - jl)) / abs(float(jl))] + [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                                                   for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(jg))])
assert len(jax.devices()) == 2 and err <= 1e-12, err
print("maxrel", err)
'''


def test_value_and_grad_under_shard_map_is_data_parallel():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "maxrel" in r.stdout
