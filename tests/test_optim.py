"""Optimizers pinned bit for bit against hand computations; clipping, L2, skipping; checkpoints."""
import math
import os

import numpy as np
import pytest

import tapegrad as tg

W0 = [1.0, -2.0, 0.5]


def quadratic(opt, w0=W0, steps=2):
    """Minimise Σ w² (gradient 2w); returns w after each step."""
    tape = tg.Tape()
    w = tape.param(np.array(w0))
    opt.add(tape, w)
    start = tape.mark()
    out = []
    for _ in range(steps):
        tape.backward((w * w).sum())
        opt.step()
        out.append(np.array(tape.value(w)))
        tape.reset_to(start)
    return out


def hand_adam(w, steps, lr=0.1, b1=0.9, b2=0.999, eps=1e-8, mode="optax"):
    """Adam written out with Python floats, one element at a time, in the documented order."""
    mu = nu = 0.0
    out = []
    for t in range(1, steps + 1):
        g = w + w
        if mode == "optax":
            mu = (1.0 - b1) * g + b1 * mu
            nu = (1.0 - b2) * (g * g) + b2 * nu
            u = (mu / (1.0 - b1 ** t)) / (math.sqrt(nu / (1.0 - b2 ** t)) + eps)
            w = w + (-lr) * u
        else:
            mu = b1 * mu + (1.0 - b1) * g
            nu = b2 * nu + (1.0 - b2) * (g * g)
            lr_t = lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
            w = w - lr_t * (mu / (math.sqrt(nu) + eps))
        out.append(w)
    return out


@pytest.mark.parametrize("mode", ["optax", "hat"])
def test_adam_two_steps_equal_a_hand_computation_bit_for_bit(mode):
    got = quadratic(tg.Adam(0.1, eps_mode=mode))
    want = [hand_adam(w, 2, mode=mode) for w in W0]
    for step in range(2):
        assert np.array_equal(got[step], [w[step] for w in want])


def test_the_two_epsilon_forms_differ():
    a, b = quadratic(tg.Adam(0.1, eps=1e-3)), quadratic(tg.Adam(0.1, eps=1e-3, eps_mode="hat"))
    assert not np.array_equal(a[1], b[1])


def test_sgd_with_l2():
    lr, l2 = 0.05, 0.3
    tape = tg.Tape()
    w, b = tape.param(np.array(W0)), tape.param(np.array([0.25]))
    opt = tg.SGD(lr)
    opt.add(tape, w, l2=l2)
    opt.add(tape, b)
    tape.backward((w * w).sum() + (b * 3.0).sum())
    opt.step()
    assert np.array_equal(tape.value(w), [x - lr * ((x + x) + l2 * x) for x in W0])
    assert np.array_equal(tape.value(b), [0.25 - lr * 3.0])


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_equals_a_hand_computation_bit_for_bit(nesterov):
    """optax's trace: tr ← g + m·tr; the step is lr·tr, or lr·(g + m·tr) with Nesterov."""
    lr, m = 0.1, 0.9
    got = quadratic(tg.SGD(lr, momentum=m, nesterov=nesterov), steps=3)
    for k, w in enumerate(W0):
        tr = 0.0
        for step in range(3):
            g = w + w
            tr = g + m * tr
            w = w - lr * (g + m * tr if nesterov else tr)
            assert got[step][k] == w


def test_adamw_decays_each_parameter_by_its_own_coefficient_bit_for_bit():
    """AdamW: u = m̂/(√v̂ + eps) + wd·w, then w ← w + (−lr)·u; ``wd=0.0`` exempts a parameter (optax's mask)."""
    lr, wd = 0.1, 0.2
    tape = tg.Tape()
    w, b = tape.param(np.array(W0)), tape.param(np.array([0.75]))
    opt = tg.Adam(lr, weight_decay=wd)
    opt.add(tape, w)
    opt.add(tape, b, wd=0.0)
    start = tape.mark()
    for _ in range(3):
        tape.backward((w * w).sum() + (b * b).sum())
        opt.step()
        tape.reset_to(start)
    for got, w0, decay in ((tape.value(w), W0, wd), (tape.value(b), [0.75], 0.0)):
        for x, want in zip(got, w0):
            mu = nu = 0.0
            for t in range(1, 4):
                g = want + want
                mu = (1.0 - 0.9) * g + 0.9 * mu
                nu = (1.0 - 0.999) * (g * g) + 0.999 * nu
                u = (mu / (1.0 - 0.9 ** t)) / (math.sqrt(nu / (1.0 - 0.999 ** t)) + 1e-8)
                if decay:
                    u = u + decay * want
                want = want + (-lr) * u
            assert x == want


def test_momentum_and_decay_settings_are_checked():
    with pytest.raises(tg.ConfigError, match="SGD: nesterov=True needs a momentum > 0"):
        tg.SGD(0.1, nesterov=True)
    with pytest.raises(tg.ConfigError, match=r"SGD: momentum must be a finite number in \[0.0, 1.0\], got 1.5"):
        tg.SGD(0.1, momentum=1.5)
    with pytest.raises(tg.ConfigError, match="Adam: weight_decay .* needs eps_mode='optax'"):
        tg.Adam(0.1, weight_decay=0.1, eps_mode="hat")
    tape = tg.Tape()
    with pytest.raises(tg.ConfigError, match=r"SGD.add \(node 0\): wd \(decoupled weight decay\) is Adam's"):
        tg.SGD(0.1).add(tape, tape.param(np.ones(2)), wd=0.1)


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("factory", [lambda: tg.SGD(0.1, momentum=0.9), lambda: tg.SGD(0.1, momentum=0.5, nesterov=True,
                                                                                         clip=1.0),
                                     lambda: tg.Adam(0.1, weight_decay=0.2, clip=2.0)],
                         ids=["momentum", "nesterov-clip", "adamw-clip"])
def test_programs_replay_momentum_and_decay_bit_for_bit(backend, factory):
    """The quadratic's gradient 2w is exact on every backend, so the program's steps equal the tape's."""
    tape = tg.Tape()
    w, b = tape.param(np.array(W0), name="w"), tape.param(np.array([0.75]), name="b")
    opt = factory()
    opt.add(tape, w)
    opt.add(tape, b, wd=0.0 if opt.kind == "Adam" else None)
    prog = tg.capture(tape, (w * w).sum() + (b * b).sum(), backend=backend)
    prog.attach(opt)
    for _ in range(5):
        prog.episode()
    start = tape.mark()
    for _ in range(5):
        tape.backward((w * w).sum() + (b * b).sum())
        opt.step()
        tape.reset_to(start)
    assert np.array_equal(prog.value("w"), tape.value(w)) and np.array_equal(prog.value("b"), tape.value(b))
    state = prog.optimizer_state()
    assert state["count"] == 5 and all(np.array_equal(x, y) for x, y in zip(state["mu"], opt.state_dict()["mu"]))
    if backend == "native":
        assert "step" in prog.verified


@pytest.mark.parametrize("mode", ["optax", "seed", "torch"])
def test_global_norm_clipping_in_each_rounding(mode):
    maxn = 1.0
    tape = tg.Tape()
    w, v = tape.param(np.array(W0)), tape.param(np.array([4.0]))
    opt = tg.SGD(1.0, clip=maxn, clip_mode=mode)
    opt.add(tape, w)
    opt.add(tape, v)
    tape.backward((w * w).sum() + (v * v).sum())
    opt.step()
    g = [x + x for x in W0] + [8.0]
    norm = math.sqrt(sum(x * x for x in g[:3]) + g[3] * g[3])
    scaled = {"optax": [(x / norm) * maxn for x in g], "seed": [x * (maxn / norm) for x in g],
              "torch": [x * (maxn / (norm + 1e-6)) for x in g]}[mode]
    assert np.array_equal(np.r_[tape.value(w), tape.value(v)], np.r_[W0, 4.0] - np.array(scaled))


def test_no_clip_below_the_threshold():
    tape = tg.Tape()
    w = tape.param(np.array([0.1]))
    opt = tg.SGD(1.0, clip=10.0)
    opt.add(tape, w)
    tape.backward((w * w).sum())
    opt.step()
    assert tape.value(w)[0] == 0.1 - 0.2


def test_untouched_parameters_are_skipped_and_keep_their_moments():
    tape = tg.Tape()
    a, b = tape.param(np.array([1.0])), tape.param(np.array([2.0]))
    opt = tg.Adam(0.1)
    opt.add(tape, a)
    opt.add(tape, b)
    start = tape.mark()
    tape.backward((a * b).sum())
    opt.step()
    tape.reset_to(start)
    b_after, nu_b = float(tape.value(b)[0]), float(opt.nu[1][0])
    tape.backward((a * a).sum())  # b untouched this episode
    opt.step()
    assert opt.count == 2
    assert float(tape.value(b)[0]) == b_after and float(opt.nu[1][0]) == nu_b
    assert float(tape.value(a)[0]) != 1.0


def train(tape, params, opt, steps, seed):
    rng = np.random.default_rng(seed)
    start = tape.mark()
    losses = []
    for _ in range(steps):
        x = tape.const(rng.standard_normal((8, 3)))
        y = tape.const(rng.standard_normal((8, 2)))
        loss = tg.mse((x @ params[0] + params[1]).tanh(), y)
        tape.backward(loss)
        opt.step()
        losses.append(float(tape.value(loss)))
        tape.reset_to(start)
    return losses


def model(opt_factory, interleave=False):
    tape = tg.Tape()
    rng = np.random.default_rng(0)
    w = tape.param(rng.standard_normal((3, 2)))
    if interleave:  # a frozen parameter between w and b: the optimizer must update them one by one
        tape.param(np.ones(5))
    b = tape.param(np.zeros(2))
    opt = opt_factory()
    opt.add(tape, w, l2=0.01)
    opt.add(tape, b)
    return tape, [w, b], opt


def test_flat_runs_equal_parameter_by_parameter_updates():
    factory = lambda: tg.Adam(0.05, clip=0.5)  # noqa: E731
    (t1, p1, o1), (t2, p2, o2) = model(factory), model(factory, interleave=True)
    o1._fresh(), o2._fresh()   # the runs are laid out when first used
    assert len(o1._runs) == 1 and len(o2._runs) == 2
    assert train(t1, p1, o1, 20, 3) == train(t2, p2, o2, 20, 3)
    for a, b in zip(p1, p2):
        assert np.array_equal(t1.value(a), t2.value(b))


@pytest.mark.parametrize("factory", [lambda: tg.Adam(0.05, clip=0.5), lambda: tg.SGD(0.1, clip=1.0, clip_mode="seed"),
                                     lambda: tg.SGD(0.1, momentum=0.9, nesterov=True),
                                     lambda: tg.Adam(0.05, weight_decay=0.1)],
                         ids=["adam", "sgd", "sgd-nesterov", "adamw"])
def test_checkpoint_resume_continues_the_trajectory_bit_for_bit(tmp_path, factory):
    tape, params, opt = model(factory)
    train(tape, params, opt, 5, seed=1)
    path = str(tmp_path / "ck.npz")
    tg.save(path, tape, opt)
    straight = train(tape, params, opt, 5, seed=2)
    final = [np.array(tape.value(p)) for p in params]

    tape2, params2, opt2 = model(factory)
    tg.load(path, tape2, opt2)
    assert opt2.count == 5
    assert train(tape2, params2, opt2, 5, seed=2) == straight
    for a, b in zip(final, params2):
        assert np.array_equal(a, tape2.value(b))
    assert [f for f in os.listdir(tmp_path)] == ["ck.npz"]  # no temporary left behind


def test_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    tape, params, opt = model(lambda: tg.Adam(0.1))
    train(tape, params, opt, 2, seed=1)
    path = str(tmp_path / "ck.npz")
    tg.save(path, tape, opt)
    other = tg.Tape()
    w = other.param(np.ones((3, 3)))
    other.param(np.ones(2))
    before = np.array(other.value(w))
    with pytest.raises(tg.TapeError, match=r"load: parameter 0 \(node 0\) has shape \(3, 3\), the checkpoint \(3, 2\)"):
        tg.load(path, other)
    assert np.array_equal(other.value(w), before)
    tape3, params3, _ = model(lambda: tg.Adam(0.1))
    sgd = tg.SGD(0.1)
    sgd.add(tape3, params3[0])
    snapshot = np.array(tape3.value(params3[0]))
    with pytest.raises(tg.TapeError, match="load: expected SGD state in the checkpoint, got Adam"):
        tg.load(path, tape3, sgd)
    assert np.array_equal(tape3.value(params3[0]), snapshot)


def test_load_state_dict_validates_before_writing():
    tape, params, opt = model(lambda: tg.Adam(0.1))
    train(tape, params, opt, 1, seed=1)
    state = opt.state_dict()
    bad = {**state, "nu": [state["nu"][0], np.zeros(3)]}
    with pytest.raises(tg.TapeError, match=r"Adam.load_state_dict: nu\[1\] must have shape \(2,\), got \(3,\)"):
        opt.load_state_dict({**bad, "count": 9})
    assert opt.count == 1
    assert all(np.array_equal(a, b) for a, b in zip(opt.state_dict()["mu"], state["mu"]))


def test_optimizer_configuration_errors():
    with pytest.raises(ValueError, match="Adam: eps_mode must be 'optax' or 'hat', got 'tf'"):
        tg.Adam(0.1, eps_mode="tf")
    with pytest.raises(ValueError, match="SGD: clip_mode must be one of"):
        tg.SGD(0.1, clip=1.0, clip_mode="max")
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    opt = tg.SGD(0.1)
    opt.add(tape, x)
    with pytest.raises(tg.TapeError, match=r"SGD.add \(node 0\): parameter already registered"):
        opt.add(tape, x)
    with pytest.raises(tg.TapeError, match=r"SGD.add \(node 1\): expected a param, got a const node"):
        opt.add(tape, tape.const(np.ones(2)))
    with pytest.raises(tg.TapeError, match="SGD.add: this optimizer already serves another tape"):
        opt.add(tg.Tape(), x)
