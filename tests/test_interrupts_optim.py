"""Ctrl-C during an optimizer step: the step happens completely, then the KeyboardInterrupt arrives."""
import os
import signal

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
def test_ctrl_c_mid_step_lets_the_step_finish_then_interrupts(factory):
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
                while True:   # the timer may fire after the step: wait for it outside
                    signal.pause()
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
