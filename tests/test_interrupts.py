"""A KeyboardInterrupt (or any exception) part-way through ``tape.backward`` undoes the pass: every leaf's
gradient and ``touched`` are as before the call, the recorded sweep still replays, and running the call
again gives the gradient of an uninterrupted run, bit for bit. The interrupt is injected at every Python
call and return inside the call (``sys.setprofile``), on the first pass of an episode, the pass that
records the sweep, the replayed pass and an accumulating second pass, with and without the C core; and
by a timer, as a user's Ctrl-C comes."""
import signal
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O

from fault_util import profiler

X = np.random.default_rng(1).standard_normal((3, 4))
IDX = np.array([0, 2, 3])


class PureTape(tg.Tape):
    """A tape on the Python paths only: the recorded sweep replays in Python, not in the C core."""
    apply = tg.Tape._apply_py
    _fast = None


TAPES = [tg.Tape, PureTape]


def setup(cls, check_finite=False):
    tape = cls(check_finite=check_finite)
    rng = np.random.default_rng(0)
    W = tape.param(rng.standard_normal((4, 4)) * 0.5)
    b = tape.param(rng.standard_normal(4))
    return tape, (W, b), tape.mark()


def episode(tape, W, b):
    """W shared by three layers (in-place adds into a leaf), b broadcast (summed contributions), kept
    buffers (log_softmax) and a data input (take)."""
    h = tape.const(X)
    for _ in range(3):
        h = (h @ W + b).tanh()
    h = tg.take(tg.log_softmax(h), tape.const(IDX), axis=1)
    return (h * h).sum() + (W * W).sum()


def leaves(tape, ps):
    return [(tape.touched(p), np.array(tape.grad(p)).tobytes()) for p in ps]


def state(tape):
    """What the next backward depends on besides the graph: per node whether it is touched (with its
    gradient's bytes if so) and whether it holds a buffer; the pass count, the scratch arena, the
    recorded sweep."""
    seen = []
    for i, n in enumerate(tape._nodes):
        t = n.op is not O.data and tape._touched(i)
        seen.append((t, tape._grad[i].tobytes() if t else None, tape._grad[i] is None))
    return seen, tape._pass, tape._since, tape._grads.pos, list(tape._arena_grads), tape._sched, tape._last_top


class Injected(BaseException):
    pass


def at_event(k, exc):
    """A profiler raising ``exc`` at the k-th Python call or return (then removing itself), the return
    of the call under test excepted: raised there, the call has finished its work."""
    def throw():
        raise exc
    return profiler(k, throw)


def interrupted(fn, k, *args, exc=KeyboardInterrupt):
    """Run ``fn(*args)`` (a Python function) with ``exc`` injected at the k-th event inside it; True if it
    was raised, False if fn finished first."""
    sys.setprofile(at_event(k, exc))
    try:
        fn(*args)
    except exc:
        return True
    finally:
        sys.setprofile(None)
    return False


def history(cls, episodes, accumulate=False, check_finite=False):
    """A tape after ``episodes`` complete episodes, and the loss of the next one (backward once already
    when ``accumulate``)."""
    tape, ps, m = setup(cls, check_finite)
    for _ in range(episodes):
        tape.backward(episode(tape, *ps))
        tape.reset_to(m)
    loss = episode(tape, *ps)
    if accumulate:
        tape.backward(loss)
        tape._recycle_scratch()   # what the next backward does first (values kept), so states compare
    return tape, ps, m, loss


def reference(cls, episodes, accumulate):
    """The gradients of an uninterrupted run: the pass in question, then two more episodes."""
    tape, ps, m, loss = history(cls, episodes, accumulate)
    tape.backward(loss)
    out = [leaves(tape, ps)]
    for _ in range(2):
        tape.reset_to(m)
        tape.backward(episode(tape, *ps))
        out.append(leaves(tape, ps))
    return out


CASES = [("first pass", 0, False), ("recording pass", 1, False), ("replayed pass", 2, False),
         ("accumulating pass", 0, True), ("accumulating after replays", 2, True)]


@pytest.mark.parametrize("cls", TAPES, ids=["core", "pure"])
@pytest.mark.parametrize("name, episodes, accumulate", CASES, ids=[c[0] for c in CASES])
def test_an_interrupt_anywhere_in_backward_undoes_the_pass(cls, name, episodes, accumulate):
    want = reference(cls, episodes, accumulate)
    k = 0
    while True:
        k += 1
        tape, ps, m, loss = history(cls, episodes, accumulate)
        before, grads_before = state(tape), leaves(tape, ps)
        if not interrupted(tape.backward, k, loss):
            assert k > 50, f"{name}: the backward made only {k} Python calls"
            break
        after = state(tape)
        assert leaves(tape, ps) == grads_before, f"{name}, event {k}: a leaf's gradient changed"
        for i, (b, a) in enumerate(zip(before[0], after[0])):   # intermediates: as before, or reset to untouched
            assert a == b or (not a[0] and a[2] == b[2] and tape._nodes[i].op.arity), (name, k, i)
        assert after[1:] == before[1:], f"{name}, event {k}: pass count, arena or recorded sweep changed"
        assert tape.backward(loss)                           # the re-run is the whole pass, once
        assert leaves(tape, ps) == want[0], f"{name}, event {k}: the re-run's gradient differs"
        for e in range(2):                                   # and later episodes record and replay as before
            tape.reset_to(m)
            assert tape.backward(episode(tape, *ps))
            assert leaves(tape, ps) == want[e + 1], f"{name}, event {k}: episode {e + 1} after differs"


@pytest.mark.parametrize("cls", TAPES, ids=["core", "pure"])
def test_an_interrupted_recording_does_not_leave_a_half_recorded_sweep(cls):
    """The second episode records its sweep for the third to replay: interrupted, the recording is
    dropped (every later backward used to raise ``TypeError: cannot unpack non-iterable NoneType``)."""
    tape, ps, m, loss = history(cls, 1)
    sched = tape._sched
    assert interrupted(tape.backward, 60, loss)
    assert tape._sched is sched and tape._last_top is not None
    tape.reset_to(m)
    assert tape.backward(episode(tape, *ps))      # records now
    assert tape._sched is not None and tape._sched.end is not None
    recorded = tape._sched
    tape.reset_to(m)
    assert tape.backward(episode(tape, *ps))      # and replays it
    assert tape._sched is recorded
    assert leaves(tape, ps) == reference(cls, 2, False)[0]


@pytest.mark.parametrize("exc", [MemoryError, Injected], ids=["MemoryError", "BaseException"])
def test_any_exception_in_the_pass_undoes_it(exc):
    for episodes, accumulate in ((0, False), (1, False), (0, True)):
        want = reference(tg.Tape, episodes, accumulate)[0]
        for k in (5, 40, 90):
            tape, ps, m, loss = history(tg.Tape, episodes, accumulate)
            before = leaves(tape, ps)
            assert interrupted(tape.backward, k, loss, exc=exc)
            assert leaves(tape, ps) == before
            tape.backward(loss)
            assert leaves(tape, ps) == want


def test_an_interrupt_during_the_finite_check_undoes_the_pass():
    """With ``check_finite`` the scan for non-finite gradients is part of the call: interrupted there, the
    complete gradient is undone too (the call did not return)."""
    want = reference(tg.Tape, 0, False)[0]
    k, hits = 0, 0
    while True:
        k += 1
        tape, ps, m, loss = history(tg.Tape, 0, check_finite=True)
        if not interrupted(tape.backward, k, loss):
            break
        hits += 1
        assert leaves(tape, ps) == [(False, np.zeros((4, 4)).tobytes()), (False, np.zeros(4).tobytes())]
        assert tape.backward(loss) and leaves(tape, ps) == want
    assert hits > 50


def test_ctrl_c_from_a_timer_never_leaves_a_partial_gradient():
    """The reported case: SIGALRM raising KeyboardInterrupt at random times into the backward of a deep
    tanh chain; the gradient read after the interrupt is untouched, and the re-run is exact."""
    def chain(tape, w):
        h = tape.const(np.linspace(-1, 1, 64))
        for _ in range(200):
            h = (h * w).tanh()
        return h.sum()

    tape = tg.Tape()
    w = tape.param(np.full(64, 1.01))
    m = tape.mark()
    tape.backward(chain(tape, w))
    want = np.array(tape.grad(w))
    tape.reset_to(m)

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    rng = np.random.default_rng(5)
    hits = 0
    try:
        for _ in range(30):
            loss = chain(tape, w)
            done = False
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 2e-3))
            try:
                done = tape.backward(loss)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                if not done:          # (not the rare alarm between the return and the cancel)
                    hits += 1
                    assert not tape.touched(w) and not tape.grad(w).any()
                    tape.backward(loss)
            assert np.array_equal(tape.grad(w), want)
            tape.reset_to(m)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert hits > 0
