"""The NumPy replay's less travelled paths: its scratch provider, the per-parameter optimizer step (some
parameters untouched), float32 programs, and its error and plan reports."""
import math

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.optim import l2_grad, sq_norm
from tapegrad.replay import Scratch

# ── the scratch provider ─────────────────────────────────────────────────────


def test_scratch_hands_out_the_requested_buffers_and_the_same_ones_again():
    ws = Scratch(np.float32)
    ws.begin(0)
    a, m, b = ws.take((2, 3)), ws.take_mask((2, 3)), ws.take((4,))
    assert (a.shape, a.dtype, m.shape, m.dtype, b.shape, b.dtype) == (
        (2, 3), np.float32, (2, 3), np.bool_, (4,), np.float32)
    ws.begin(-1)
    c = ws.take((5,))
    assert ws.nbytes() == 0                      # nothing packed yet
    ws.pack()
    # the largest step: 24, 6 and 16 bytes, each padded to 64
    assert ws.nbytes() == ws.slab.nbytes == 192
    views = ws.cache[0] + ws.cache[-1]
    assert [v.shape for v in views] == [(2, 3), (2, 3), (4,), (5,)]
    base = ws.slab.__array_interface__["data"][0]
    assert [v.__array_interface__["data"][0] - base for v in views] == [0, 64, 128, 0]
    assert all(np.shares_memory(v, ws.slab) for v in views)
    # the next episode: the very same view objects, in request order, and packing again changes nothing
    for _ in range(2):
        ws.begin(0)
        got = [ws.take((2, 3)), ws.take_mask((2, 3)), ws.take((4,))]
        assert all(x is y for x, y in zip(got, views[:3]))
        ws.begin(-1)
        assert ws.take((5,)) is views[3]
        ws.pack()
        assert all(x is y for x, y in zip(ws.cache[0] + ws.cache[-1], views))
        assert ws.nbytes() == 192


def test_a_changed_request_gets_a_fresh_buffer_and_the_next_pack_takes_it_in():
    ws = Scratch(np.float64)
    ws.begin(7)
    a, b = ws.take((3,)), ws.take((3,))
    assert not np.shares_memory(a, b)
    ws.pack()
    ws.begin(7)
    assert ws.take((3,)) is ws.cache[7][0]
    m = ws.take_mask((3,))                       # same shape, another dtype
    assert m.dtype == np.bool_ and not np.shares_memory(m, ws.slab)
    ws.begin(7)
    n = ws.take((2, 2))                          # same dtype, another shape
    assert n.shape == (2, 2) and n.dtype == np.float64 and not np.shares_memory(n, ws.slab)
    assert ws.nbytes() == 0                      # unpacked again until the next pack
    ws.pack()
    assert np.shares_memory(ws.cache[7][0], ws.slab) and ws.cache[7][0].shape == (2, 2)
    assert ws.nbytes() == 64 and ws.slab.__array_interface__["data"][0] % 64 == 0


def test_an_unused_scratch_packs_to_nothing():
    ws = Scratch(np.float64)
    ws.pack()
    assert ws.nbytes() == 0


def mlp_params(tape):
    rng = np.random.default_rng(4)
    return (tape.param(rng.standard_normal((3, 6))), tape.param(rng.standard_normal(6)),
            tape.param(rng.standard_normal((6, 4))))


XS = np.random.default_rng(5).standard_normal((5, 3))
YS = np.eye(4)[np.random.default_rng(6).integers(0, 4, 5)]


def mlp_loss(tape, params):
    """tanh, softmax and the fused cross-entropy: forward and backward steps that take scratch."""
    w1, b1, w2 = params
    h = (tape.const(XS) @ w1 + b1).tanh()
    return tg.softmax_cross_entropy(h @ w2, tape.const(YS)) + (h.softmax(axis=1) * h).sum()


def test_every_episode_after_the_first_reuses_the_packed_scratch_views():
    tape = tg.Tape()
    params = mlp_params(tape)
    opt = tg.Adam(1e-2)
    for p in params:
        opt.add(tape, p)
    prog = tg.capture(tape, mlp_loss(tape, params))
    prog.attach(opt)
    prog.episode()
    ws = prog.runner.ws
    before = {k: list(v) for k, v in ws.cache.items()}
    assert sum(map(len, before.values())) > 4
    for _ in range(2):
        prog.episode()
        assert ws.cache.keys() == before.keys()
        for k, views in ws.cache.items():
            assert len(views) == len(before[k]) and all(x is y for x, y in zip(views, before[k])), k
    assert all(np.shares_memory(v, ws.slab) and v.__array_interface__["data"][0] % 64 == 0
               for views in ws.cache.values() for v in views)
    plan = prog.plan()
    assert plan == {"backend": "numpy", "segments": [(k, k) for k in prog.compute],
                    "kernels_forward": len(prog.compute), "kernels_backward": len(prog.sched),
                    "scratch_bytes": ws.slab.nbytes}
    assert plan["scratch_bytes"] > 0


def float32_run(episodes, program):
    tape = tg.Tape(np.float32)
    params = mlp_params(tape)
    opt = tg.Adam(0.05, clip=0.5)
    for k, p in enumerate(params):
        opt.add(tape, p, l2=0.1 if k == 0 else 0.0)
    if program:
        prog = tg.capture(tape, mlp_loss(tape, params), dtype="float32")
        prog.attach(opt)
        return [prog.episode() for _ in range(episodes)], [prog.value(p) for p in params]
    m = tape.mark()
    losses = []
    for _ in range(episodes):
        loss = mlp_loss(tape, params)
        losses.append(float(tape.value(loss)))
        tape.backward(loss)
        opt.step()
        tape.reset_to(m)
    return losses, [tape.value(p) for p in params]


def test_float32_program_of_a_float32_tape_replays_it_bit_for_bit():
    """Scratch, seed and optimizer buffers all in float32: a float64 buffer anywhere rounds differently."""
    got, gparams = float32_run(3, True)
    want, wparams = float32_run(3, False)
    assert got == want
    for g, w in zip(gparams, wparams):
        assert g.dtype == np.float32 and np.array_equal(g, w)


# ── the per-parameter optimizer step (a parameter the loss does not reach) ───

C1 = np.random.default_rng(7).standard_normal(6)
C2 = np.random.default_rng(8).standard_normal((2, 3)) * 3.0
W0, U0, V0 = np.linspace(-1.0, 1.0, 6), np.ones(3), np.zeros((2, 3))
L2 = 0.1


def first_norm():
    """The global norm of the first step: √(0 + |c1 + l2·w0|² + |c2|²), the untouched u left out."""
    gt = l2_grad(C1, W0, L2, np.empty(6))
    return math.sqrt(0.0 + sq_norm(gt) + sq_norm(C2))


NORM = first_norm()
OPTS = {
    "sgd-optax-clip": lambda: tg.SGD(0.5, clip=NORM / 2),
    "sgd-seed-clip": lambda: tg.SGD(0.5, clip=NORM / 3, clip_mode="seed"),
    # just above the norm: optax leaves g alone, where the torch rule (maxn / (norm + 1e-6) < 1) would clip
    "sgd-optax-no-clip": lambda: tg.SGD(0.5, clip=NORM + 1e-7),
    "sgd": lambda: tg.SGD(0.5),
    "adam-hat-torch-clip": lambda: tg.Adam(0.1, eps_mode="hat", clip=NORM / 2, clip_mode="torch"),
    "adam-optax-clip": lambda: tg.Adam(0.1, clip=NORM / 2),
}


def linear_run(kind, program, dtype="float64", backend="numpy", episodes=3):
    """loss = Σ w·c1 + Σ v·c2 (gradients exactly c1, c2); u is registered between them and never reached."""
    tape = tg.Tape(dtype)
    w, u, v = tape.param(W0), tape.param(U0), tape.param(V0)
    opt = OPTS[kind]()
    opt.add(tape, w, l2=L2)
    opt.add(tape, u, l2=L2)
    opt.add(tape, v)
    m = tape.mark()

    def loss():
        return (w * tape.const(C1)).sum() + (v * tape.const(C2)).sum()
    if program:
        prog = tg.capture(tape, loss(), backend=backend, dtype=dtype)
        prog.attach(opt)
        assert not prog.opt.whole or not all(prog.opt.touched)   # the per-parameter path, not the slab
        losses = [prog.episode() for _ in range(episodes)]
        return losses, [np.array(prog.value(p)) for p in (w, u, v)], prog.optimizer_state()
    losses = []
    for _ in range(episodes):
        out = loss()
        losses.append(float(tape.value(out)))
        tape.backward(out)
        opt.step()
        tape.reset_to(m)
    return losses, [np.array(tape.value(p)) for p in (w, u, v)], opt


@pytest.mark.parametrize("kind,dtype,backend", [(k, "float64", "numpy") for k in OPTS] + [
    ("sgd-optax-clip", "float32", "numpy"), ("adam-optax-clip", "float32", "numpy"),
    ("sgd-optax-clip", "float64", "native"), ("adam-hat-torch-clip", "float64", "native")])
def test_a_program_steps_each_touched_parameter_like_the_tape(kind, dtype, backend):
    got, gparams, gstate = linear_run(kind, True, dtype, backend)
    want, wparams, wopt = linear_run(kind, False, dtype)
    assert got == want
    for g, w in zip(gparams, wparams):
        assert g.dtype == dtype and np.array_equal(g, w)
    assert np.array_equal(gparams[1], U0)           # untouched: no step, not even its L2 decay
    assert not np.array_equal(gparams[2], V0)       # the parameter after the untouched one did step
    if kind.startswith("adam"):
        for key in ("mu", "nu"):
            for a, b in zip(gstate[key], getattr(wopt, key)):
                assert np.array_equal(a, b)


def test_a_value_the_op_cannot_take_names_the_op_and_node_in_full():
    tape = tg.Tape()
    m = tape.const(np.eye(3) * 2.0)
    d = tg.logdet(m)
    prog = tg.capture(tape, d + (m * m).sum())
    prog.set_input(m, -np.eye(3))
    with pytest.raises(tg.DomainError) as e:
        prog.forward()
    assert str(e.value) == (f"logdet (node {d.id}): the matrix is not positive definite: its leading minor of "
                            "order 1 is not (LAPACK potrf info 1); expected a symmetric positive definite matrix")
    assert e.value.__cause__ is None and e.value.__suppress_context__
