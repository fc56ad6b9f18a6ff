"""The recorded sweep of a repeated episode (tapegrad.schedule): replaying it gives the gradients a full
sweep gives, bit for bit, for every registry op, and it is not used when the episode differs."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import schedule

from op_cases import make, parts

CASES = [(name, k) for name, op in O.OPS.items() if op.arity and op.kind != "leaf"
         for k in range(len(op.cases or ()))]


@pytest.fixture
def replays(monkeypatch):
    """Counts Schedule.replay calls."""
    count = [0]
    real = schedule.Schedule.replay

    def counted(self, tape):
        count[0] += 1
        return real(self, tape)
    monkeypatch.setattr(schedule.Schedule, "replay", counted)
    return count


def episode(tape, op, params, arrays, s, w):
    """One episode: each float input is its parameter (all ones) times this episode's values, the op,
    and a weighted sum (so the gradient reaching the op is not all ones)."""
    vs, fl = [], iter(params)
    for kind, x in zip(op.inputs, arrays):
        vs.append(next(fl) * tape.const(x) if kind == "f" else tape.const(x))
    a, b, c = (vs + [None, None])[:3]
    y = tape.apply(op, a, b, s, c)
    weights = np.cos(np.arange(y.size)).reshape(y.shape) * w
    return (y * tape.const(weights)).sum()


def grads_of(tape, params):
    return [tape.grad(p).copy() for p in params]


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_replayed_sweeps_equal_full_sweeps_for_every_op(name, k, replays):
    op = O.OPS[name]
    case = op.cases[k]
    rng = np.random.default_rng(k)
    arrays, s = make(op, case, rng)
    shapes = [np.shape(x) for kind, x in zip(op.inputs, arrays) if kind == "f"]
    tape = tg.Tape()
    params = [tape.param(np.ones(sh)) for sh in shapes]
    start = tape.mark()
    for ep in range(4):
        arrays, _ = make(op, case, rng)   # new values, the same shapes: the same graph
        w = ep + 1.5   # the seed reaching the op: a weight per output element, new every episode
        assert tape.backward(episode(tape, op, params, arrays, s, w))
        got = grads_of(tape, params)
        fresh = tg.Tape()
        fp = [fresh.param(np.ones(sh)) for sh in shapes]
        assert fresh.backward(episode(fresh, op, fp, arrays, s, w))
        for g, h in zip(got, grads_of(fresh, fp)):
            assert np.array_equal(g, h, equal_nan=True), f"{name} case {k} episode {ep}"
        tape.reset_to(start)
    assert replays[0] == 2   # episode 0 swept, 1 swept and recorded, 2 and 3 replayed


def mlp_episode(tape, ps, x, y, scale=1.0):
    h = (tape.const(x) @ ps[0] + ps[1]).relu()
    h = h * scale   # a static operand: muls
    z = h @ ps[2] + ps[3]
    d = z - tape.const(y)
    return (d * d).mean() + (ps[0] * ps[0]).sum() * 0.01   # ps[0] reaches the loss twice


@pytest.mark.parametrize("dtype,ordered", [(np.float64, False), (np.float32, False), (np.float64, True)])
def test_a_training_loop_replays_and_stays_bit_identical_to_fresh_tapes(dtype, ordered, replays):
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s) for s in ((5, 8), (8,), (8, 3), (1, 3))]
    tape = tg.Tape(dtype, ordered=ordered)
    ps = [tape.param(p) for p in init]
    opt = tg.Adam(1e-2)
    for p in ps:
        opt.add(tape, p)
    twin = tg.Tape(dtype, ordered=ordered)   # the same loop on a tape whose every episode is swept in full
    qs = [twin.param(p) for p in init]
    opt2 = tg.Adam(1e-2)
    for q in qs:
        opt2.add(twin, q)
    start, start2 = tape.mark(), twin.mark()
    for step in range(6):
        x, y = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
        loss = mlp_episode(tape, ps, x, y)
        assert tape.backward(loss)
        twin._sched, twin._last_top = None, None
        assert twin.backward(mlp_episode(twin, qs, x, y))
        for p, q in zip(ps, qs):
            assert np.array_equal(tape.grad(p), twin.grad(q))
        opt.step()
        opt2.step()
        tape.reset_to(start)
        twin.reset_to(start2)
    assert replays[0] == 4
    for p, q in zip(ps, qs):
        assert np.array_equal(tape.value(p), twin.value(q))


def test_a_replay_writes_weight_gradients_in_place_and_adopts_final_views(replays):
    """Two things a replay does that the sweep does not, both in every MLP: a matmul's weight gradient is
    written by its ``into`` rule straight into the parameter's buffer (the sweep writes scratch, then
    copies), and the g a bias add passes through becomes the matmul output's gradient (the sweep copies
    it) when nothing adds to that gradient later. ``h + h`` does add later: that copy stays. The bits
    are those of full sweeps (the training loop test above)."""
    rng = np.random.default_rng(2)
    init = [rng.standard_normal(s) for s in ((5, 8), (8,), (8, 3), (1, 3))]
    tape = tg.Tape()
    ps = [tape.param(p) for p in init]
    names = {p.id: f"p{i}" for i, p in enumerate(ps)}
    start = tape.mark()
    for _ in range(3):
        x, y = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
        assert tape.backward(mlp_episode(tape, ps, x, y))
        codes = {}
        for k, j, *_, code, buf in tape._sched.steps if tape._sched else ():
            codes.setdefault((tape.nodes[k].op.name, names.get(j) or tape.nodes[j].op.name), set()).add(code)
        tape.reset_to(start)
    assert codes[("matmul", "p2")] == {schedule.DIRECT}
    assert codes[("add", "matmul")] == {schedule.ADOPT}      # both layers
    assert replays[0] == 1
    h = tape.param(np.array([0.5, -1.0, 2.0]))
    for _ in range(3):
        y = h * 2.0
        z = y + y
        e = h.exp()                             # DIRECT, and exp's rule reads its output
        v = tape.const(np.ones(3)) + e * 1.0    # the view reaches the b side only
        tape.backward((z * 3.0).sum() + v.sum())
        assert np.array_equal(tape.grad(h), 12.0 + np.exp(tape.value(h)))
        steps = [(step[0], step[1], step[9]) for step in (tape._sched.steps if tape._sched else ())]
        assert np.array_equal(tape.grad(y), np.full(3, 6.0)) and np.array_equal(tape.grad(z), np.full(3, 3.0))
        tape.reset_to(start + 1)
    # z's a side is copied, as its b side adds into y's gradient afterwards
    assert [code for k, j, code in steps if (k, j) == (z.id, y.id)] == [schedule.NEW, schedule.ADD]
    assert replays[0] == 2


def test_a_changed_graph_is_swept_in_full(replays):
    """A different batch size, a different op, a different static operand's sign: no replay, and the
    gradients are those of the episode actually recorded."""
    rng = np.random.default_rng(1)
    init = [rng.standard_normal(s) for s in ((5, 8), (8,), (8, 3), (1, 3))]
    tape = tg.Tape()
    ps = [tape.param(p) for p in init]
    start = tape.mark()
    for batch, scale in ((4, 1.0), (4, 1.0), (4, 1.0), (6, 1.0), (6, 1.0), (6, -0.0), (6, 0.0), (6, 0.0)):
        x, y = rng.standard_normal((batch, 5)), rng.standard_normal((batch, 3))
        assert tape.backward(mlp_episode(tape, ps, x, y, scale))
        fresh = tg.Tape()
        fs = [fresh.param(p) for p in init]
        assert fresh.backward(mlp_episode(fresh, fs, x, y, scale))
        for p, f in zip(ps, fs):
            g, h = tape.grad(p), fresh.grad(f)
            assert np.array_equal(g, h) and np.array_equal(np.signbit(g), np.signbit(h)), (batch, scale)
        tape.reset_to(start)
    # replayed: the third episode of batch 4, the second of batch 6 (recorded by the first: the same loss
    # id), and the episodes with 0.0 after the one with -0.0 (recorded there): -0.0 == 0.0 matches the
    # recorded graph, and the replay reads the static operand of the episode it runs (the sign bits above)
    assert replays[0] == 4


def test_intermediate_gradients_and_touched_flags_match_a_full_sweep(replays):
    tape = tg.Tape()
    x = tape.param(np.array([0.5, -1.0, 2.0]))
    b = tape.param(np.array([[0.25, 0.5, 0.75]]))   # broadcast into (2, 3): summed into its buffer
    unused = tape.param(np.ones(3))
    start = tape.mark()
    for _ in range(4):
        h = x * tape.const(np.ones((2, 3))) + b     # x's contribution is summed over the broadcast axis
        y = h + h                                   # add aliases g: copied, then added
        loss = (y * 3.0).sum()
        tape.backward(loss)
        assert np.array_equal(tape.grad(y), np.full((2, 3), 3.0))
        assert np.array_equal(tape.grad(h), np.full((2, 3), 6.0))
        assert np.array_equal(tape.grad(x), np.full(3, 12.0))
        assert np.array_equal(tape.grad(b), np.full((1, 3), 12.0))
        assert tape.touched(h) and tape.touched(x) and not tape.touched(unused)
        tape.reset_to(start)
    assert replays[0] == 2


def test_a_second_backward_in_one_episode_accumulates_as_without_replay(replays):
    tape = tg.Tape()
    x = tape.param(np.array([1.0, 2.0]))
    start = tape.mark()
    for _ in range(4):
        loss = (x * x).sum()
        tape.backward(loss)
        tape.backward(loss)   # leaf gradients accumulate: 2x + 2x
        assert np.array_equal(tape.grad(x), np.array([4.0, 8.0]))
        tape.reset_to(start)
    assert replays[0] == 2


def test_an_op_node_before_the_mark_keeps_its_gradient_across_replays(replays):
    """A node recorded before the mark (here w·2) whose gradient buffer moves out of the episode arena
    at the first reset: the replay must write the buffer the tape holds now."""
    tape = tg.Tape()
    w = tape.param(np.array([1.0, -2.0]))
    w2 = w * 2.0
    start = tape.mark()
    for k in range(5):
        c = tape.const(np.array([1.0, float(k + 1)]))
        tape.backward((w2 * c).sum())
        assert np.array_equal(tape.grad(w2), np.array([1.0, k + 1.0]))
        assert np.array_equal(tape.grad(w), np.array([2.0, 2.0 * (k + 1)]))
        tape.reset_to(start)
    assert replays[0] == 3


def test_a_replay_reads_the_static_operand_of_its_own_episode(replays):
    """-0.0 == 0.0, so an episode scaling by -0.0 replays the sweep recorded with 0.0; the gradient's sign
    must still be that of -0.0."""
    tape = tg.Tape()
    x = tape.param(np.array([1.0, 2.0]))
    start = tape.mark()
    for scale in (0.0, 0.0, -0.0, 0.0, -0.0):
        tape.backward((x * scale).sum())
        assert np.array_equal(np.signbit(tape.grad(x)), np.signbit([scale, scale])), scale
        tape.reset_to(start)
    assert replays[0] == 3


def _variants():
    """Episodes that each differ from the first in one thing the sweep reads."""
    def base(t, p, q, m):
        return (p * t.const(np.array([2.0, 3.0])) * 2.0).sum()

    def other_a(t, p, q, m):      # the product's first input: q instead of p
        return (q * t.const(np.array([2.0, 3.0])) * 2.0).sum()

    def other_b(t, p, q, m):      # the product's second input: q instead of the constant
        return (p * q * 2.0).sum()

    def other_op(t, p, q, m):     # + instead of ·
        return ((p + t.const(np.array([2.0, 3.0]))) * 2.0).sum()

    def other_s(t, p, q, m):      # the static operand
        return (p * t.const(np.array([2.0, 3.0])) * 5.0).sum()

    def other_top(t, p, q, m):    # the loss op itself
        return (p * t.const(np.array([2.0, 3.0])) * 2.0).mean()

    def longer(t, p, q, m):       # the same nodes, then one more: only the loss id differs
        return (p * t.const(np.array([2.0, 3.0])) * 2.0).sum() * 1.0
    return base, [other_a, other_b, other_op, other_s, other_top, longer]


@pytest.mark.parametrize("k", range(6))
def test_an_episode_differing_in_one_field_is_swept_in_full(k, replays):
    base, others = _variants()
    other = others[k]
    tape = tg.Tape()
    p, q = tape.param(np.array([1.0, -2.0])), tape.param(np.array([0.5, 4.0]))
    start = tape.mark()
    for fn in (base, base, base, other):
        tape.backward(fn(tape, p, q, None))
        fresh = tg.Tape()
        fp, fq = fresh.param(np.array([1.0, -2.0])), fresh.param(np.array([0.5, 4.0]))
        fresh.backward(fn(fresh, fp, fq, None))
        assert np.array_equal(tape.grad(p), fresh.grad(fp)) and np.array_equal(tape.grad(q), fresh.grad(fq))
        tape.reset_to(start)
    assert replays[0] == 1


def test_a_data_input_at_node_0_and_a_bias_broadcast_along_its_last_axis(replays):
    """where's mask is the tape's first node (id 0), and a (2, 1) parameter is summed over axis 1."""
    tape = tg.Tape()
    mask = tape.const(np.array([[True, False, True], [False, True, True]]))
    p = tape.param(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    b = tape.param(np.array([[0.5], [-1.5]]))
    start = tape.mark()
    for k in range(4):
        c = tape.const(np.full((2, 3), k + 1.0))
        loss = (tg.where(mask, p * c, c) + b).sum()
        tape.backward(loss)
        assert np.array_equal(tape.grad(p), np.where(mask.value, k + 1.0, 0.0))
        assert np.array_equal(tape.grad(b), np.full((2, 1), 3.0))
        tape.reset_to(start)
    assert replays[0] == 2


def test_a_node_after_the_loss_does_not_stop_the_replay(replays):
    """Only the nodes up to the loss are the recorded graph: something computed after it (a metric)
    may change from episode to episode."""
    tape = tg.Tape()
    x = tape.param(np.array([1.0, 2.0]))
    start = tape.mark()
    for k in range(4):
        loss = (x * x).sum()
        _ = x * float(k)   # after the loss, different every episode
        _ = x * float(k)
        tape.backward(loss)
        assert np.array_equal(tape.grad(x), np.array([2.0, 4.0]))
        tape.reset_to(start)
    assert replays[0] == 2


def test_a_program_captured_after_replayed_episodes_matches_the_replayed_gradients(replays):
    """The NumPy replay is bit-identical to the tape (products included: the same NumPy calls)."""
    rng = np.random.default_rng(3)
    init = [rng.standard_normal(s) for s in ((5, 8), (8,), (8, 3), (1, 3))]
    tape = tg.Tape()
    ps = [tape.param(p) for p in init]
    start = tape.mark()
    for _ in range(3):
        x, y = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
        loss = mlp_episode(tape, ps, x, y)
        tape.backward(loss)
        if replays[0] == 0:
            tape.reset_to(start)
    assert replays[0] == 1
    prog = tg.capture(tape, loss, backend="numpy")
    prog.forward()
    prog.backward()
    assert prog.value(loss) == tape.value(loss)
    for p in ps:
        assert np.array_equal(prog.grad(p), tape.grad(p))
