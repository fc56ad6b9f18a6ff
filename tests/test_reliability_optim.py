"""The eager optimizers per parameter: registering n tensors lays the state out once (``Adam.add`` rebuilt
every moment view per registration: 300 tensors took 7-19 s, 10,000 never finished; the time is measured in
experiments/bench/bench_optim_add.py), moments survive registrations after steps; and any exception a signal
handler raises mid-step (a timeout's alarm, not only Ctrl-C) leaves ``Adam.step`` all or nothing."""
import os
import signal
import time

import numpy as np
import pytest

import tapegrad as tg


def test_ten_thousand_registrations_lay_the_state_out_once(monkeypatch):
    tape = tg.Tape()
    ws = [tape.param(np.full(3, k + 1.0)) for k in range(10_000)]
    calls = []
    layout = tg.optim.Optimizer._layout
    monkeypatch.setattr(tg.optim.Optimizer, "_layout", lambda self: calls.append(1) or layout(self))
    opt = tg.Adam(0.1)
    for w in ws:
        opt.add(tape, w)
    loss = (ws[0] * ws[-1]).sum()
    tape.backward(loss)
    opt.step()
    opt.step()
    assert len(calls) == 1
    assert [np.array_equal(tape.value(w), np.full(3, k + 1.0)) for k, w in enumerate(ws)].count(False) == 2
    with pytest.raises(tg.TapeError, match=r"^Adam.add \(node 9999\): parameter already registered$"):
        opt.add(tape, ws[-1])
    assert len(opt.params) == 10_000 and len(calls) == 1


def test_a_parameter_registered_after_steps_joins_with_the_others_moments_kept():
    """w1 steps twice alone, then w2 joins: w1 goes on as if alone, w2 steps as a fresh Adam whose
    count is already 2 (one count for all parameters, as optax)."""
    rng = np.random.default_rng(1)
    x1, x2 = rng.standard_normal(5), rng.standard_normal(4)

    def grads(tape, w1, w2, opt):
        loss = (w1 * w1 * tape.const(x1)).sum() + ((w2 * w2 * tape.const(x2)).sum() if w2 is not None else 0.0)
        tape.backward(loss)
        opt.step()

    tape = tg.Tape()
    w1, w2 = tape.param(np.ones(5)), tape.param(np.full(4, 2.0))
    opt = tg.Adam(0.1)
    opt.add(tape, w1)
    m = tape.mark()
    for _ in range(2):
        grads(tape, w1, None, opt)
        tape.reset_to(m)
    opt.add(tape, w2)
    grads(tape, w1, w2, opt)

    alone = tg.Tape()
    a1 = alone.param(np.ones(5))
    ref = tg.Adam(0.1)
    ref.add(alone, a1)
    m = alone.mark()
    for _ in range(3):
        grads(alone, a1, None, ref)
        alone.reset_to(m)
    late = tg.Tape()
    b2 = late.param(np.full(4, 2.0))
    ref2 = tg.Adam(0.1)
    ref2.add(late, b2)
    ref2.load_state_dict({"count": 2, "mu": [np.zeros(4)], "nu": [np.zeros(4)]})
    late.backward((b2 * b2 * late.const(x2)).sum())
    ref2.step()
    assert np.array_equal(tape.value(w1), alone.value(a1)) and np.array_equal(tape.value(w2), late.value(b2))
    assert np.array_equal(opt.mu[0], ref.mu[0]) and np.array_equal(opt.nu[1], ref2.nu[0]) and opt.count == 3


class Timeout(Exception):
    """What a timeout's SIGALRM handler raises (as a test runner's or a notebook's)."""


def trained(n=16, size=250_000):   # 4M parameters
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    ws = [tape.param(rng.standard_normal(size)) for _ in range(n)]
    opt = tg.Adam(0.1, weight_decay=0.01, clip=1.0)
    for w in ws:
        opt.add(tape, w)
    total = (ws[0] * ws[0]).sum()
    for w in ws[1:]:
        total = total + (w * w).sum()
    tape.backward(total)
    return tape, ws, opt


def state(tape, ws, opt):
    return [np.array(tape.value(w)) for w in ws], opt.state_dict()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_an_alarm_handler_raising_mid_step_of_4m_parameters_leaves_it_all_or_nothing(request):
    if not os.environ.get("TAPEGRAD_SIGNAL_TEST"):
        # in a fresh interpreter, as tests/test_interrupts_optim.py's Ctrl-C test: a loaded pytest worker's
        # threads may take the process's signals
        import subprocess
        import sys
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"{__file__}::{request.node.name}"], env={**os.environ, "TAPEGRAD_SIGNAL_TEST": "1"},
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return
    tape, ws, opt = trained()
    ref_tape, ref_ws, ref_opt = trained()
    ref_opt.step()
    want_w, want_state = state(ref_tape, ref_ws, ref_opt)

    def alarm(signum, frame):
        raise Timeout("the cell ran past its time limit")
    old = signal.signal(signal.SIGALRM, alarm)
    hits = 0
    try:
        t0 = time.perf_counter()
        ref_opt.step()
        took = time.perf_counter() - t0
        for frac in (0.05, 0.2, 0.4, 0.6, 0.8):
            before_w, before_state = state(tape, ws, opt)
            signal.setitimer(signal.ITIMER_REAL, frac * took)
            try:
                opt.step()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    time.sleep(1e-3)
                raise AssertionError(f"the alarm ({frac} of a step) never came")
            except Timeout:
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            got_w, got_state = state(tape, ws, opt)
            if got_state["count"] == before_state["count"]:   # the alarm came before the step began
                assert all(np.array_equal(a, b) for a, b in zip(got_w, before_w))
                assert all(np.array_equal(a, b) for key in ("mu", "nu")
                           for a, b in zip(got_state[key], before_state[key]))
                continue
            hits += 1
            assert got_state["count"] == before_state["count"] + 1
            if before_state["count"] == 0:   # the very step the reference took
                assert all(np.array_equal(a, b) for a, b in zip(got_w, want_w))
                for key in ("mu", "nu"):
                    assert all(np.array_equal(a, b) for a, b in zip(got_state[key], want_state[key]))
            else:   # a later step: every parameter and moment moved
                assert all(not np.array_equal(a, b) for a, b in zip(got_w, before_w))
                assert all(not np.array_equal(a, b) for a, b in zip(got_state["nu"], before_state["nu"]))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert hits >= 3


def test_every_held_handler_runs_after_the_step_and_the_first_exception_rises():
    from tapegrad._interrupts import signals_held
    seen = []

    def usr1(signum, frame):
        seen.append("usr1")
        raise Timeout("first")

    def usr2(signum, frame):
        seen.append("usr2")
        raise KeyboardInterrupt

    def step():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        seen.append("step done")
        return 1
    olds = signal.signal(signal.SIGUSR1, usr1), signal.signal(signal.SIGUSR2, usr2)
    try:
        with pytest.raises(Timeout, match="^first$"):
            signals_held(step)
        assert seen == ["step done", "usr1", "usr2"]
        assert signal.getsignal(signal.SIGUSR1) is usr1 and signal.getsignal(signal.SIGUSR2) is usr2
    finally:
        signal.signal(signal.SIGUSR1, olds[0])
        signal.signal(signal.SIGUSR2, olds[1])
