"""Optimizer edge cases that only show at a boundary or across a hand-over.

- Global-norm clipping exactly at the limit: "optax" clips when ``norm >= maxn`` (``(g/norm)·maxn``
  rounds differently from ``g``), and does not clip one ulp above it. ("seed" and "torch" at their
  boundaries rescale by exactly 1.0, so there the comparison is unobservable by design.)
- A program that attaches an optimizer which already stepped on the tape continues its trajectory:
  the step count (Adam's bias correction) and the moments carry over.
"""
import math

import numpy as np
import pytest

import tapegrad as tg

RNG = np.random.default_rng(5)
W0 = np.zeros(16)   # w − lr·g with w = 0, lr = 1 is exactly −g: a rounding of g stays visible
C = RNG.standard_normal(16) * 10.0 ** RNG.integers(-2, 3, 16)
LR = 1.0


def linear(tape):
    """loss = Σ w·c: the gradient is exactly c."""
    w = tape.param(W0)
    return w, (w * tape.const(C)).sum()


def norm_of(g):
    """The optimizer's global norm of one gradient: √(0 + g·g) (one BLAS dot)."""
    flat = np.ascontiguousarray(g).reshape(-1)
    return math.sqrt(0.0 + float(np.dot(flat, flat)))


NORM = norm_of(C)
CLIPPED = (C / NORM) * NORM          # optax's rounding of a clip at exactly the limit


def test_the_boundary_is_observable_with_these_values():
    assert not np.array_equal(W0 - LR * CLIPPED, W0 - LR * C)


def eager_step(maxn, mode="optax"):
    tape = tg.Tape()
    w, loss = linear(tape)
    opt = tg.SGD(LR, clip=maxn, clip_mode=mode)
    opt.add(tape, w)
    tape.backward(loss)
    assert np.array_equal(tape.grad(w), C)
    opt.step()
    return np.array(tape.value(w)), tape, w, loss, opt


def test_optax_clip_applies_at_exactly_the_limit():
    got, *_ = eager_step(NORM)
    assert np.array_equal(got, W0 - LR * CLIPPED)


def test_optax_clip_does_not_apply_one_ulp_above_the_limit():
    got, *_ = eager_step(math.nextafter(NORM, math.inf))
    assert np.array_equal(got, W0 - LR * C)


def test_optax_clip_applies_one_ulp_below_the_limit():
    below = math.nextafter(NORM, 0.0)
    got, *_ = eager_step(below)
    assert np.array_equal(got, W0 - LR * ((C / NORM) * below))


def test_tapes_gradient_is_not_rescaled_by_clipping():
    _, tape, w, _, _ = eager_step(NORM / 4)
    assert np.array_equal(tape.grad(w), C)


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("maxn", [NORM, math.nextafter(NORM, math.inf)], ids=["at", "above"])
def test_programs_clip_at_the_same_boundary_as_the_tape(backend, maxn):
    want, tape, w, loss, _ = eager_step(maxn)
    tape2 = tg.Tape()
    w2, loss2 = linear(tape2)
    opt = tg.SGD(LR, clip=maxn)
    opt.add(tape2, w2)
    prog = tg.capture(tape2, loss2, backend=backend)
    prog.attach(opt)
    prog.episode()
    assert np.array_equal(prog.value(w2), want)


# ── attaching an optimizer that already stepped ─────────────────────────────

X = RNG.standard_normal((3, 4))
V0 = RNG.standard_normal(4)


def model(tape, w):
    # exact-tier ops only, so the native program must match the tape bit for bit
    x = tape.const(X)
    return ((x * w) * (x * w) + x * w).sum()


def eager_adam(steps, **kw):
    tape = tg.Tape()
    w = tape.param(V0)
    opt = tg.Adam(0.05, **kw)
    opt.add(tape, w)
    m = tape.mark()
    for _ in range(steps):
        tape.backward(model(tape, w))
        opt.step()
        tape.reset_to(m)
    return tape, w, opt


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("eps_mode", ["optax", "hat"])
def test_a_program_continues_the_trajectory_of_an_optimizer_that_already_stepped(backend, eps_mode):
    tape, w, opt = eager_adam(3, eps_mode=eps_mode)
    loss = model(tape, w)
    prog = tg.capture(tape, loss, backend=backend)
    prog.attach(opt)
    assert prog.optimizer_state()["count"] == 3
    for _ in range(2):
        prog.episode()
    ref_tape, ref_w, ref_opt = eager_adam(5, eps_mode=eps_mode)
    assert np.array_equal(prog.value(w), ref_tape.value(ref_w))
    st = prog.optimizer_state()
    assert st["count"] == 5
    assert np.array_equal(st["mu"][0], ref_opt.mu[0]) and np.array_equal(st["nu"][0], ref_opt.nu[0])
    # and the tape optimizer picks the program's state back up
    prog.sync_params(tape, opt)
    assert opt.count == 5 and np.array_equal(tape.value(w), ref_tape.value(ref_w))
