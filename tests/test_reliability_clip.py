"""Global-norm clipping with a non-finite gradient, against optax itself.

optax's ``clip_by_global_norm`` keeps ``g`` only when ``norm < max_norm`` and otherwise scales by
``(g / norm) · max_norm``: a NaN anywhere makes the norm NaN and every leaf's update NaN; an infinite
gradient makes the norm inf, every finite element 0 and the infinite ones NaN. ``clip_mode="optax"`` says
it behaves as optax, so its state must evolve as optax's does, NaNs included: in the eager optimizers,
the NumPy replay, the native program, the CuPy kernels (under the fake CuPy) and ``interop.train_step``.
PyTorch's ``clip_grad_norm_`` multiplies by ``min(max_norm / (norm + 1e-6), 1)`` with the NaN kept
(``clip_mode="torch"``); the seed's rule scales only when ``norm > max_norm`` (a NaN norm clips nothing).
"""
import sys

import numpy as np
import pytest

import tapegrad as tg

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import fake_cupy  # noqa: E402

W0 = np.linspace(-1.0, 1.0, 12).reshape(4, 3)
B0 = np.ones(3)
X = np.random.default_rng(3).standard_normal((4, 3))


def batches(kind):
    """Three steps of data ``x`` (W's gradient is x; b's is 2·(b − 2), always finite)."""
    bad = X.copy()
    if kind == "nan":
        bad[2, 1] = np.nan
        return [X, bad, X]
    bad[0, 0] = np.inf
    return [bad, bad, bad]


def optax_run(data, maxn=1.0):
    opt = optax.chain(optax.clip_by_global_norm(maxn), optax.adam(1e-2))
    p = {"W": jnp.asarray(W0), "b": jnp.asarray(B0)}
    s = opt.init(p)
    out = []
    for x in data:
        g = {"W": jnp.asarray(x), "b": 2.0 * (p["b"] - 2.0)}
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
        out.append((np.asarray(p["W"]), np.asarray(p["b"]), np.asarray(s[1][0].mu["b"]),
                    np.asarray(s[1][0].nu["W"])))
    return out


def tape_loss(tape, w, b, x):
    return (w * x).sum() + ((b - 2.0) * (b - 2.0)).sum()


def eager_run(data, opt):
    tape = tg.Tape()
    w, b = tape.param(W0), tape.param(B0)
    opt.add(tape, w)
    opt.add(tape, b)
    m = tape.mark()
    out = []
    for x in data:
        tape.backward(tape_loss(tape, w, b, tape.const(x)))
        with np.errstate(invalid="ignore"):
            opt.step()
        tape.reset_to(m)
        st = opt.state_dict()
        out.append((tape.value(w).copy(), tape.value(b).copy()) + ((st["mu"][1], st["nu"][0]) if "nu" in st else ()))
    return out


def program_run(data, backend):
    tape = tg.Tape()
    w, b = tape.param(W0), tape.param(B0)
    x = tape.const_lazy((4, 3))
    opt = tg.Adam(1e-2, clip=1.0)
    opt.add(tape, w)
    opt.add(tape, b)
    prog = tg.capture(tape, tape_loss(tape, w, b, x), backend=backend)
    prog.attach(opt)
    out = []
    for xb in data:
        with np.errstate(invalid="ignore"):
            prog.episode({x: xb})
        st = prog.optimizer_state()
        out.append((np.array(prog.value(w)), np.array(prog.value(b)), st["mu"][1], st["nu"][0]))
    return out


def assert_like_optax(got, want):
    for k, (g, r) in enumerate(zip(got, want)):
        for name, a, c in zip(("W", "b", "mu[b]", "nu[W]"), g, r):
            assert np.array_equal(np.isnan(a), np.isnan(c)), (k, name, a, c)
            np.testing.assert_allclose(a, c, rtol=1e-13, atol=0, equal_nan=True, err_msg=f"step {k} {name}")


def test_eager_adam_clips_one_nan_in_one_leaf_and_an_infinite_gradient_as_optax():
    want = optax_run(batches("nan"))
    assert np.isnan(want[1][1]).all() and np.isnan(want[1][0]).all()   # optax: b too, from the NaN in W's g
    assert_like_optax(eager_run(batches("nan"), tg.Adam(1e-2, clip=1.0)), want)
    want = optax_run(batches("inf"))
    # norm = inf: finite elements of g become 0 (b's moments stay 0, b stays put), the inf one NaN
    assert np.array_equal(want[2][1], B0) and np.isnan(want[0][0][0, 0]) and np.isfinite(want[0][0].flat[1:]).all()
    assert_like_optax(eager_run(batches("inf"), tg.Adam(1e-2, clip=1.0)), want)


@pytest.mark.matrix
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_programs_clip_a_non_finite_norm_as_optax(backend):
    for kind in ("nan", "inf"):
        assert_like_optax(program_run(batches(kind), backend), optax_run(batches(kind)))


def test_the_cupy_kernels_clip_a_non_finite_norm_as_optax(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make())
    for kind in ("nan", "inf"):
        assert_like_optax(program_run(batches(kind), "cupy"), optax_run(batches(kind)))


def torch_reference(data, maxn, lr=0.5):
    """SGD after PyTorch's clip_grad_norm_: g · clamp(maxn / (norm + 1e-6), max=1), a NaN factor kept."""
    w, b = W0.copy(), B0.copy()
    out = []
    for x in data:
        g = [x, 2.0 * (b - 2.0)]
        with np.errstate(invalid="ignore", over="ignore"):
            norm = np.sqrt(sum(np.sum(a * a) for a in g))
            f = np.minimum(maxn / (norm + 1e-6), 1.0)   # np.minimum keeps NaN, as torch.clamp
            w, b = w - lr * (g[0] * f), b - lr * (g[1] * f)
        out.append((w, b))
    return out


def test_torch_mode_keeps_a_nan_factor_as_pytorch_and_the_seed_mode_clips_nothing():
    for kind in ("nan", "inf"):
        want = torch_reference(batches(kind), 1.0)
        got = eager_run(batches(kind), tg.SGD(0.5, clip=1.0, clip_mode="torch"))
        assert np.isnan(want[-1][1]).all() == (kind == "nan")
        for (gw, gb), (rw, rb) in zip(got, want):
            np.testing.assert_allclose(gw, rw, rtol=1e-14, atol=0, equal_nan=True)
            np.testing.assert_allclose(gb, rb, rtol=1e-14, atol=0, equal_nan=True)
    # the seed's "scale when norm > maxn": a NaN norm leaves every g as it is, so b keeps training
    seed = eager_run(batches("nan"), tg.SGD(0.5, clip=1.0, clip_mode="seed"))
    assert np.isfinite(seed[-1][1]).all() and np.isnan(seed[1][0][2, 1])


def test_train_step_clips_a_non_finite_gradient_as_optax():
    from interop import train_step

    def loss(p, x):
        return jnp.sum(p["W"] * x) + jnp.sum((p["b"] - 2.0) ** 2)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    p = {"W": jnp.asarray(W0), "b": jnp.asarray(B0)}
    step, state = train_step(loss, p, jnp.asarray(X), optimizer=opt)
    assert step.native_update
    for kind in ("nan", "inf"):
        init = jax.tree.map(jnp.array, p)   # copies: the step donates its state
        state = (init, opt.init(init))
        want = optax_run(batches(kind))
        for k, x in enumerate(batches(kind)):
            _, state = step(state, jnp.asarray(x))
            params, (_, (adam, _)) = state[0], state[1]
            got = (np.asarray(params["W"]), np.asarray(params["b"]), np.asarray(adam.mu["b"]),
                   np.asarray(adam.nu["W"]))
            assert_like_optax([got], [want[k]])
