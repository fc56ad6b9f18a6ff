"""Ctrl-C during an optimizer step: the step happens completely, then the KeyboardInterrupt arrives."""
import os
import signal
import time

import numpy as np
import pytest

import tapegrad as tg


def trained(factory, n=24, size=40_000):
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    ws = [tape.param(rng.standard_normal(size)) for _ in range(n)]
    opt = factory()
    for w in ws:
        opt.add(tape, w)
    tape.backward(sum_all(ws))
    return tape, ws, opt


def sum_all(ws):
    total = (ws[0] * ws[0]).sum()
    for w in ws[1:]:
        total = total + (w * w).sum()
    return total


def state(tape, ws, opt):
    return [np.array(tape.value(w)) for w in ws], opt.state_dict()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("factory", [lambda: tg.Adam(0.1, weight_decay=0.01, clip=1.0),
                                     lambda: tg.SGD(0.1, momentum=0.9)], ids=["adamw", "momentum"])
def test_ctrl_c_mid_step_lets_the_step_finish_then_interrupts(factory, request):
    if not os.environ.get("TAPEGRAD_SIGNAL_TEST"):
        # in a fresh interpreter: a pytest worker that has run other tests may hold threads or handlers
        # (XLA's, OpenBLAS's) that take the process's signals, and the timer would never reach this one
        import subprocess
        import sys
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"{__file__}::{request.node.name}"], env={**os.environ, "TAPEGRAD_SIGNAL_TEST": "1"},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return
    tape, ws, opt = trained(factory)
    ref_tape, ref_ws, ref_opt = trained(factory)
    ref_opt.step()
    want_w, want_state = state(ref_tape, ref_ws, ref_opt)
    old = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))
    hits = 0
    try:
        for delay in (1e-4, 5e-4, 1e-3, 2e-3, 4e-3):
            before_w, before_state = state(tape, ws, opt)
            signal.setitimer(signal.ITIMER_REAL, delay)
            try:
                opt.step()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:   # the timer may fire after the step: wait for it outside,
                    time.sleep(1e-3)   # polling: signal.pause() never wakes if another thread takes the signal
                raise AssertionError(f"the timer ({delay} s) never interrupted")
            except KeyboardInterrupt:
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            got_w, got_state = state(tape, ws, opt)
            if got_state["count"] == before_state["count"]:   # the interrupt came before the step began
                assert all(np.array_equal(a, b) for a, b in zip(got_w, before_w))
                continue
            hits += 1
            assert got_state["count"] == before_state["count"] + 1
            if before_state["count"] == 0:
                assert all(np.array_equal(a, b) for a, b in zip(got_w, want_w))
                for key in ("mu", "nu")[:opt.moments]:
                    assert all(np.array_equal(a, b) for a, b in zip(got_state[key], want_state[key]))
            else:   # a later step: every parameter moved
                assert all(not np.array_equal(a, b) for a, b in zip(got_w, before_w))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert hits >= 3


def test_the_previous_sigint_handler_is_back_after_a_step():
    tape, ws, opt = trained(lambda: tg.Adam(0.1), n=2, size=4)

    def mine(signum, frame):
        pass
    old = signal.signal(signal.SIGINT, mine)
    try:
        opt.step()
        assert signal.getsignal(signal.SIGINT) is mine and opt.count == 1
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("factory", [lambda: tg.Adam(0.1, weight_decay=0.01, clip=1.0),
                                     lambda: tg.SGD(0.1, momentum=0.9, nesterov=True)], ids=["adamw", "nesterov"])
def test_an_interrupt_anywhere_in_a_small_step_undoes_it(factory):
    """Below HOLD_FROM elements the step copies its state first: an exception at any Python call or return
    inside it (a Ctrl-C between two ufuncs) leaves count, moments and parameters exactly as before, or,
    when it comes after the last write, exactly as after the step."""
    import sys

    from fault_util import profiler
    assert 3 * 50 < tg.optim.HOLD_FROM

    def second_step(interrupt_at=None):
        tape, ws, opt = trained(factory, n=3, size=50)
        opt.step()                       # a second step: the moments are not zero
        before = state(tape, ws, opt)
        if interrupt_at is not None:
            def ctrl_c():
                raise KeyboardInterrupt
            sys.setprofile(profiler(interrupt_at, ctrl_c))
        try:
            opt.step()
        except KeyboardInterrupt:
            return before, state(tape, ws, opt), True
        finally:
            sys.setprofile(None)
        return before, state(tape, ws, opt), False

    def same(x, y):
        return x[1]["count"] == y[1]["count"] and all(np.array_equal(a, b) for a, b in zip(x[0], y[0])) and all(
            np.array_equal(a, b) for key in ("mu", "nu") if key in x[1] for a, b in zip(x[1][key], y[1][key]))
    _, done, _ = second_step()
    k, undone = 0, 0
    while True:
        k += 1
        before, after, interrupted = second_step(k)
        if not interrupted:
            assert same(after, done)
            break
        assert same(after, before) or same(after, done), f"an interrupt at event {k} left a half-done step"
        undone += same(after, before)
    assert undone > 10
