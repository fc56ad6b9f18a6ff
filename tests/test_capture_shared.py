"""Captures shared across the process, as jax.jit's compilations are: a second value_and_grad or
train_step of the same function takes the first one's capture (and its check), steps of other optimizers
get their own, and every step made stays callable whatever is made after it."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import interop  # noqa: E402
from interop.capture import signatures, train  # noqa: E402


def loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)


def setup(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    w = {"a": jnp.asarray(rng.standard_normal((5, 7)), dtype), "b": jnp.asarray(rng.standard_normal(7), dtype)}
    x, y = jnp.asarray(rng.standard_normal((9, 5)), dtype), jnp.asarray(rng.standard_normal(9), dtype)
    return w, x, y


@pytest.fixture(autouse=True)
def fresh():
    interop.clear_caches()
    yield
    interop.clear_caches()


@pytest.fixture
def checks(monkeypatch):
    """The optimizer checks train_step runs (one per call of train._check)."""
    calls = []
    real = train._check

    def counted(*args, **kwargs):
        calls.append(args[5])
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "_check", counted)
    return calls


def run(step, state, x, y, n=3):
    out = []
    for _ in range(n):
        value, state = step(state, x, y)
        out.append(value)
    return out, state


def test_a_second_train_step_of_the_same_function_takes_the_capture_and_its_check(checks):
    w, x, y = setup()
    opt = optax.adam(1e-2)
    first, s1 = interop.train_step(loss, w, x, y, optimizer=opt)
    # another function object computing the same (a loss rebuilt in a loop, a notebook cell run again)
    again = lambda w_, x_, y_: loss(w_, x_, y_)   # noqa: E731
    second, s2 = interop.train_step(again, w, x, y, optimizer=optax.adam(1e-2))
    assert first.native_update and second.native_update
    assert second.captured is first.captured and len(checks) == 1
    l1, s1 = run(first, s1, x, y)
    l2, s2 = run(second, s2, x, y)
    assert [float(v) for v in l1] == [float(v) for v in l2]   # the same program from the same state: same bits
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)))


def test_other_optimizers_other_shapes_and_cleared_caches_capture_again(checks):
    w, x, y = setup()
    adam, _ = interop.train_step(loss, w, x, y, optimizer=optax.adam(1e-2))
    sgd, _ = interop.train_step(loss, w, x, y, optimizer=optax.sgd(1e-2))
    assert sgd.captured is not adam.captured and len(checks) == 2
    half, _ = interop.train_step(loss, w, x[:4], y[:4], optimizer=optax.adam(1e-2))
    assert half.captured is not adam.captured
    interop.clear_caches()
    again, _ = interop.train_step(loss, w, x, y, optimizer=optax.adam(1e-2))
    assert again.captured is not adam.captured and len(checks) == 4


def test_a_new_schedule_is_checked_again_on_the_shared_capture(checks):
    w, x, y = setup()
    make = lambda: optax.adam(optax.cosine_decay_schedule(1e-2, 50))   # noqa: E731
    first, s1 = interop.train_step(loss, w, x, y, optimizer=make())
    second, s2 = interop.train_step(loss, w, x, y, optimizer=make())
    # the program is the same (the schedule feeds it from JAX), the schedule is another function: checked
    assert second.captured is first.captured and len(checks) == 2
    l1, _ = run(first, s1, x, y)
    l2, _ = run(second, s2, x, y)
    assert [float(v) for v in l1] == [float(v) for v in l2]


def test_a_changed_setting_captures_again(monkeypatch):
    w, x, y = setup()
    vg = interop.value_and_grad(loss, w, x, y)
    monkeypatch.setenv("TAPEGRAD_MARCH", "x86-64-v2")   # another target: another program
    other = interop.value_and_grad(loss, w, x, y)
    assert other.captured is not vg.captured
    monkeypatch.delenv("TAPEGRAD_MARCH")
    assert interop.value_and_grad(loss, w, x, y).captured is vg.captured


def test_every_step_made_stays_callable_whatever_is_made_after_it():
    """A value_and_grad and train_steps of several optimizers over one function: attaching an optimizer
    to one capture must not unload the program another capture of the function serves."""
    w, x, y = setup(1, jnp.float64)
    with jax.enable_x64(True):
        vg = jax.jit(interop.value_and_grad(loss))
        before = vg(w, x, y)
        interop.clear_caches()   # the train_step captures anew: two programs of one function, one hash
        adam, sa = interop.train_step(loss, w, x, y, optimizer=optax.adam(1e-2))
        xla, sx = interop.train_step(loss, w, x, y, optimizer=optax.adam(1e-2), native_update=False)
        sgd, ss = interop.train_step(loss, w, x, y, optimizer=optax.sgd(1e-2))
        after = vg(w, x, y)
        assert float(after[0]) == float(before[0])
        assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(after[1]), jax.tree.leaves(before[1])))
        want = jax.value_and_grad(loss)(w, x, y)
        assert abs(float(after[0]) - float(want[0])) <= 1e-12 * abs(float(want[0]))
        for step, state in ((adam, sa), (xla, sx), (sgd, ss)):
            values, _ = run(step, state, x, y, n=2)
            assert float(values[0]) == float(before[0])   # the first step's loss is at w


def test_the_shared_captures_are_bounded(monkeypatch):
    monkeypatch.setattr(signatures, "SHARED_SIZE", 2)
    w, x, y = setup()
    caps = [interop.value_and_grad(loss, w, x[:n], y[:n]).captured for n in (3, 4, 5)]
    assert len(signatures._SHARED) == 2
    assert interop.value_and_grad(loss, w, x[:5], y[:5]).captured is caps[2]      # kept
    assert interop.value_and_grad(loss, w, x[:3], y[:3]).captured is not caps[0]  # the oldest went first


def test_an_optimizer_read_but_not_keyed_falls_back_to_xla_naming_why():
    """adamw with a mask that is a prefix of the parameters (optax accepts it; the native step reads a bool
    per leaf): the step runs optax's update in XLA and says why, or refuses under native_update=True."""
    params = {"layer": {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}}
    fn = lambda p, x: jnp.sum((x @ p["layer"]["w"] + p["layer"]["b"]) ** 2)   # noqa: E731
    x = jnp.ones((4, 3))
    opt = optax.adamw(1e-2, weight_decay=1e-2, mask={"layer": True})
    step, state = interop.train_step(fn, params, x, optimizer=opt)
    assert not step.native_update
    assert step.why == ("add_decayed_weights' mask has the structure PyTreeDef({'layer': *}), not the parameters' "
                        "PyTreeDef({'layer': {'b': *, 'w': *}})")
    value, state = step(state, x)
    ref, s = params, opt.init(params)
    v, g = jax.value_and_grad(fn)(ref, x)
    u, s = opt.update(g, s, ref)
    assert float(value) == float(v)
    assert all(bool(jnp.allclose(a, b, rtol=1e-6)) for a, b in zip(jax.tree.leaves(state[0]),
                                                                    jax.tree.leaves(optax.apply_updates(ref, u))))
    with pytest.raises(interop.CaptureError, match=r"native_update=True, but the optimizer has no native step: "
                                                   r"add_decayed_weights' mask has the structure"):
        interop.train_step(fn, params, x, optimizer=opt, native_update=True)
