"""Several threads on one program: calls run one at a time, each episode sees its own inputs."""
import threading

import numpy as np
import pytest

import tapegrad as tg

BACKENDS = ("numpy", "native")


def build(backend, optimizer=None):
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    W = tape.param(rng.standard_normal((128, 64)) * 0.1, name="W")
    x = tape.const(rng.standard_normal((256, 128)))
    loss = ((x @ W).tanh() ** 2).mean()
    prog = tg.capture(tape, loss, backend=backend)
    if optimizer is not None:
        optimizer.add(tape, W)
        prog.attach(optimizer)
    return prog, x


def hammer(fn, threads=4, calls=40):
    errors = []

    def work(t):
        try:
            for k in range(calls):
                fn(t, k)
        except BaseException as e:   # surfaced below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_episodes_from_threads_each_see_their_own_inputs(backend):
    prog, x = build(backend)
    batches = [np.random.default_rng(t).standard_normal((256, 128)) for t in range(4)]
    want = [prog.episode({x: b}) for b in batches]
    got = {}

    def call(t, k):
        got[(t, k)] = prog.episode({x: batches[t]})
    hammer(call)
    wrong = [(t, k) for (t, k), v in got.items() if v != want[t]]
    assert not wrong, f"{len(wrong)} of {len(got)} losses differ from the serial ones"


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_episodes_from_threads_step_once_each(backend):
    prog, x = build(backend, tg.Adam(1e-3))
    hammer(lambda t, k: prog.episode(), calls=30)
    state = prog.optimizer_state()
    assert state["count"] == 120
    assert np.isfinite(prog.value("W")).all() and all(np.isfinite(m).all() for m in state["mu"] + state["nu"])
