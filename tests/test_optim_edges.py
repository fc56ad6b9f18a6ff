"""Optimizer paths the common cases miss: each clip mode's own threshold, float32 state, L2 on partly
touched runs and on runs that do not start the parameter store, and the argument errors."""
import math
import re

import numpy as np
import pytest

import tapegrad as tg

G = np.array([3.0, -4.0, 12.0])     # ‖G‖ = 13 exactly


def one_step(opt, g=G, w0=None):
    """Register w (w0, default 0) on a fresh tape; loss Σ g·w has gradient g; one step; returns w."""
    tape = tg.Tape()
    w = tape.param(np.zeros_like(g) if w0 is None else w0)
    opt.add(tape, w)
    tape.backward((w * tape.const(g)).sum())
    opt.step()
    return np.array(tape.value(w))


@pytest.mark.parametrize("mode, maxn, clipped", [
    ("seed", 13.0 + 5e-7, False),     # seed: only norm > maxn clips
    ("torch", 13.0 + 5e-7, True),     # torch: maxn / (norm + 1e-6) < 1 clips, even just above the norm
    ("torch", 13.0 + 2e-6, False),
    ("torch", 19.5, False),           # a factor above 1 never scales up
    ("seed", 12.5, True),
    ("optax", 13.0 + 5e-7, False),
])
def test_each_clip_mode_has_its_own_threshold(mode, maxn, clipped):
    got = one_step(tg.SGD(1.0, clip=maxn, clip_mode=mode))
    if not clipped:
        want = -G
    elif mode == "seed":
        want = -(G * (maxn / 13.0))
    else:
        want = -(G * (maxn / (13.0 + 1e-6)))
    assert np.array_equal(got, want)


def test_clip_must_be_positive():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=re.escape(f"SGD: clip (the max global norm) must be a finite number in "
                                                       f"(0.0, inf], got {bad!r}")):
            tg.SGD(0.1, clip=bad)
    with pytest.raises(ValueError, match=re.escape("Adam: clip_mode must be one of ('optax', 'seed', 'torch'), got "
                                                   "'keras'")):
        tg.Adam(0.1, clip_mode="keras")
    with pytest.raises(ValueError, match=re.escape("Adam: eps_mode must be 'optax' or 'hat', got 'torch'")):
        tg.Adam(0.1, eps_mode="torch")
    assert tg.Adam(0.1, clip=2.0).clip == 2.0 and tg.Adam(0.1, clip=2.0, clip_mode="seed").clip_mode == "seed"


def test_adam_on_a_float32_tape_keeps_float32_state_and_arithmetic():
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(5).astype(np.float32)
    tape = tg.Tape(np.float32)
    w = tape.param(w0)
    opt = tg.Adam(0.1)
    opt.add(tape, w, l2=0.3)
    tape.backward((w * w).sum())
    opt.step()
    assert all(a.dtype == np.float32 for a in opt.state_dict()["mu"] + opt.state_dict()["nu"])
    # the same update on float32 arrays throughout (gradient, L2 term, moments and scratch)
    from tapegrad.optim import adam_update, l2_grad
    f = np.float32
    g = l2_grad(w0 + w0, w0, f(0.3), np.empty(5, f))
    want, mu, nu, t, u = w0.copy(), np.zeros(5, f), np.zeros(5, f), np.empty(5, f), np.empty(5, f)
    adam_update(want, g, mu, nu, 0.9, 0.999, 1e-8, opt.step_scalars(1), "optax", t, u)
    assert np.array_equal(tape.value(w), want) and np.array_equal(opt.mu[0], mu)
    # the float64 scratch this must not use would round differently here
    g64 = (w0.astype(np.float64) + w0) + 0.3 * w0.astype(np.float64)
    assert not np.array_equal(g64.astype(np.float32), g)


def hand_sgd(w, g, lr, l2):
    return w - lr * (g + l2 * w)


def test_l2_on_a_run_that_does_not_start_the_parameter_store():
    """A frozen parameter first, then two registered ones with their own L2: the run starts mid-store."""
    tape = tg.Tape()
    frozen = tape.param(np.ones(5))
    a, b = tape.param(np.array([1.0, 2.0])), tape.param(np.array([-3.0, 0.5, 4.0]))
    opt = tg.SGD(0.5)
    opt.add(tape, a, l2=0.1)
    opt.add(tape, b, l2=0.3)
    tape.backward((a * a).sum() + (b * b).sum() + frozen.sum())
    opt.step()
    assert np.array_equal(tape.value(a), hand_sgd(np.array([1.0, 2.0]), np.array([2.0, 4.0]), 0.5, 0.1))
    assert np.array_equal(tape.value(b), hand_sgd(np.array([-3.0, 0.5, 4.0]), np.array([-6.0, 1.0, 8.0]), 0.5, 0.3))
    assert np.array_equal(tape.value(frozen), np.ones(5))


def test_a_partly_touched_run_keeps_l2_and_clipping_per_parameter():
    """Two neighbours in one run; only b is touched: b alone steps, with its L2 and the clip norm of b alone."""
    tape = tg.Tape()
    a, b = tape.param(np.array([1.0, 2.0])), tape.param(np.array([3.0, -4.0]))
    opt = tg.SGD(1.0, clip=2.5, clip_mode="seed")
    opt.add(tape, a, l2=0.5)
    opt.add(tape, b, l2=0.5)
    tape.backward((b * tape.const(np.array([1.0, 1.0]))).sum())
    opt.step()
    g = np.array([1.0, 1.0]) + 0.5 * np.array([3.0, -4.0])
    norm = math.sqrt(0.0 + float(np.dot(g, g)))
    assert norm > 2.5
    assert np.array_equal(tape.value(b), np.array([3.0, -4.0]) - 1.0 * (g * (2.5 / norm)))
    assert np.array_equal(tape.value(a), [1.0, 2.0])


def test_add_names_the_optimizer_and_the_argument():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    other = tg.Tape()
    v = other.param(np.ones(2))
    opt = tg.Adam(0.1)
    with pytest.raises(tg.ForeignVarError, match=re.escape("Adam.add (node 1): argument var (node 0) belongs to "
                                                           "another tape; record the whole computation on one tape")):
        opt.add(tape, v)
    c = tape.const(np.ones(2))
    with pytest.raises(tg.TapeError, match=re.escape("Adam.add (node 1): expected a param, got a const node")):
        opt.add(tape, c)
    opt.add(tape, w)
    with pytest.raises(tg.TapeError, match=re.escape("Adam.add (node 0): parameter already registered")):
        opt.add(tape, w)
    with pytest.raises(tg.TapeError, match=re.escape("Adam.add: this optimizer already serves another tape")):
        opt.add(other, v)


def test_load_state_dict_messages():
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    for bad in (-1, 1.5, None):
        with pytest.raises(tg.TapeError, match=re.escape(f"Adam.load_state_dict: count must be a non-negative int, "
                                                         f"got {bad!r}")):
            opt.load_state_dict({"count": bad, "mu": [np.zeros(2)], "nu": [np.zeros(2)]})
    with pytest.raises(tg.TapeError, match=re.escape("Adam.load_state_dict: expected 1 'mu' arrays, got None")):
        opt.load_state_dict({"count": 0})
    with pytest.raises(tg.TapeError, match=re.escape("Adam.load_state_dict: expected 1 'nu' arrays, got 2")):
        opt.load_state_dict({"count": 0, "mu": [np.zeros(2)], "nu": [np.zeros(2)] * 2})
    opt.load_state_dict({"count": 0, "mu": [np.ones(2)], "nu": [np.ones(2)]})
    assert opt.count == 0 and np.array_equal(opt.mu[0], [1.0, 1.0])


def test_config_names_every_setting():
    opt = tg.Adam(0.25, b1=0.8, b2=0.95, eps=1e-6, eps_mode="hat", clip=3.0, clip_mode="torch")
    tape = tg.Tape()
    opt.add(tape, tape.param(np.ones(1)), l2=0.5)
    assert opt.config() == {"kind": "Adam", "lr": 0.25, "clip": 3.0, "clip_mode": "torch", "l2": [0.5],
                            "wd": [0.0], "b1": 0.8, "b2": 0.95, "eps": 1e-6, "eps_mode": "hat"}
    assert tg.SGD(0.5).config() == {"kind": "SGD", "lr": 0.5, "clip": None, "clip_mode": "optax", "l2": [], "wd": [],
                                    "momentum": 0.0, "nesterov": False}
    adamw = tg.Adam(0.1, weight_decay=0.01)
    adamw.add(tape, tape.param(np.ones(1)))
    adamw.add(tape, tape.param(np.ones(1)), wd=0.0)
    assert adamw.config()["wd"] == [0.01, 0.0]


@pytest.mark.parametrize("sizes", [(3, 7, 5), (1, 13, 2), (8, 9, 4)])
def test_runs_of_odd_sized_neighbours_update_each_parameter_once(sizes):
    """Parameters side by side in the store form one run; its span must end at its last member's padding,
    never inside the next parameter."""
    rng = np.random.default_rng(len(sizes) + sizes[1])
    tape = tg.Tape()
    w0 = [rng.standard_normal(n) for n in sizes]
    ws = [tape.param(a) for a in w0]
    opt = tg.SGD(0.5)
    for k, w in enumerate(ws):
        opt.add(tape, w, l2=0.1 * k)
    loss = ws[0].sum() * 0.0
    for w in ws:
        loss = loss + (w * w).sum()
    tape.backward(loss)
    opt.step()
    for k, (w, a) in enumerate(zip(ws, w0)):
        assert np.array_equal(tape.value(w), a - 0.5 * ((a + a) + (0.1 * k) * a)), k
