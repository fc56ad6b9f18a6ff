"""capture(..., memory="reuse"): a native program's intermediate buffers assigned by liveness, as XLA
assigns its own. The same generated code runs on either layout, so every result is the keep layout's
bit for bit, from an arena filled with NaN before every run (a kernel that read a byte it had not
written would show it); parameters, inputs, the loss and parameter gradients keep their own buffers;
intermediate values refuse to be read; a transformer's buffers shrink."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import functional as F
from tapegrad.errors import ConfigError, TapeError
from tapegrad.native.runner import liveness

from test_native import every_op_tape


def garbage(prog):
    """Every byte of the program's liveness arena set to 0xFF (NaN in float32 and float64)."""
    prog.runner.arena.fill(0xFF)


def run_both(keep, reuse, episodes=2):
    for _ in range(episodes):
        garbage(reuse)
        keep.forward()
        keep.backward()
        reuse.forward()
        reuse.backward()
        assert keep.loss().tobytes() == reuse.loss().tobytes()
        for name in keep.param_names:
            assert keep.grad(name).tobytes() == reuse.grad(name).tobytes(), name


@pytest.mark.matrix
@pytest.mark.parametrize("fuse", [False, True])
def test_every_registry_op_on_reused_buffers_equals_its_own_buffers(fuse):
    tape, loss, _ = every_op_tape()
    keep = tg.capture(tape, loss, backend="native", fuse=fuse)
    reuse = tg.capture(tape, loss, backend="native", fuse=fuse, memory="reuse")
    assert reuse.runner.freed and reuse.runner.nbytes() < keep.runner.nbytes()
    run_both(keep, reuse)


def transformer_tape(dtype="float32", T=16, d=32, heads=4, layers=2, batch=4, seed=0):
    """A decoder-style stack (attention with a causal mask, MLP, layer norms) on a tape."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape(dtype)
    x = tape.const(rng.standard_normal((batch, T, d)))
    mask = tape.const(np.where(np.tril(np.ones((T, T))), 0.0, -1e9))
    h, params = x, []
    for _ in range(layers):
        wq, wk, wv, wo = (tape.param(rng.standard_normal((d, d)) / np.sqrt(d)) for _ in range(4))
        w1, w2 = tape.param(rng.standard_normal((d, 4 * d)) / np.sqrt(d)), tape.param(
            rng.standard_normal((4 * d, d)) / np.sqrt(4 * d))
        flat = h.reshape((batch * T, d))
        split = lambda t: t.reshape((batch, T, heads, d // heads)).transpose((0, 2, 1, 3)).reshape(  # noqa: E731
            (batch * heads, T, d // heads))
        q, k, v = split(flat @ wq), split(flat @ wk), split(flat @ wv)
        scores = F.bmm(q, k.transpose((0, 2, 1))) * (1.0 / np.sqrt(d // heads))
        att = (scores.reshape((batch, heads, T, T)) + mask).softmax(axis=-1).reshape((batch * heads, T, T))
        o = F.bmm(att, v).reshape((batch, heads, T, d // heads)).transpose((0, 2, 1, 3)).reshape((batch * T, d))
        h = h + (o @ wo).reshape((batch, T, d))
        mu = h.mean(axis=-1, keepdims=True)
        c = h - mu
        n = c * ((c * c).mean(axis=-1, keepdims=True) + 1e-5) ** -0.5
        h = h + ((n.reshape((batch * T, d)) @ w1).tanh() @ w2).reshape((batch, T, d))
        params += [wq, wk, wv, wo, w1, w2]
    return tape, (h * h).mean(), params


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_transformer_trains_on_reused_buffers_as_on_its_own_in_far_less_memory(dtype):
    tape, loss, params = transformer_tape(dtype)
    progs = {}
    for memory in ("keep", "reuse"):
        opt = tg.Adam(1e-3)
        for w in params:
            opt.add(tape, w)
        progs[memory] = p = tg.capture(tape, loss, backend="native", dtype=dtype, memory=memory)
        p.attach(opt)
    keep, reuse = progs["keep"], progs["reuse"]
    # the values and gradients of the attention, softmax and MLP live only while read: the intermediates
    # take under a third of the bytes they had, the whole program (parameters, Adam's state) under 0.6
    arena, total = reuse.runner.arena.nbytes, reuse.runner.nbytes()
    assert arena <= (keep.runner.nbytes() - (total - arena)) / 3, (arena, total, keep.runner.nbytes())
    assert total <= 0.6 * keep.runner.nbytes()
    for _ in range(4):
        garbage(reuse)
        assert keep.episode() == reuse.episode()
    for name in keep.param_names:
        assert keep.value(name).tobytes() == reuse.value(name).tobytes(), name


def test_intermediate_values_refuse_to_be_read_and_backward_needs_its_forward():
    tape = tg.Tape()
    w = tape.param(np.ones((3, 2)))
    x = tape.const(np.arange(12.0).reshape(4, 3))
    h = (x @ w).tanh()
    loss = (h * h).sum()
    prog = tg.capture(tape, loss, backend="native", memory="reuse")
    prog.forward()
    assert float(prog.loss()[()]) == pytest.approx(float(loss.value))
    assert prog.value(w).shape == (3, 2) and prog.value(x).shape == (4, 3)
    with pytest.raises(TapeError, match=r"value: tanh \(node \d+\) is an intermediate node of a program that "
                                        r"reuses buffers by liveness \(capture\(\.\.\., memory='reuse'\)\): its "
                                        r"bytes hold a later node's by now; capture with memory='keep'"):
        prog.value(h)
    prog.backward()
    assert np.array_equal(prog.grad(w), tg.capture(tape, loss, backend="native").grad(w))
    with pytest.raises(TapeError, match=r"grad: .* memory='keep'"):
        prog.grad(h)
    with pytest.raises(TapeError, match=r"backward: this program reuses buffers by liveness .* run forward \(or "
                                        r"episode\) before each backward"):
        prog.backward()
    prog.forward()
    prog.backward()   # with its forward: fine
    with pytest.raises(ConfigError, match=r"capture: memory must be 'keep' or 'reuse', got 'less'"):
        tg.capture(tape, loss, backend="native", memory="less")


def test_liveness_shares_bytes_only_between_entries_never_alive_together():
    # steps: entry 0 lives over steps 0-1, entry 1 over 1-2, entry 2 over 3-4, entry 3 is never touched,
    # entry 4 is kept (it has its own buffer)
    steps = [{0}, {0, 1}, {1}, {2}, {2, 4}]
    sizes = {0: 100, 1: 64, 2: 200, 3: 1000, 4: 8}
    offsets, top = liveness(steps, sizes, kept={4})
    assert offsets[3] is None and 4 not in offsets
    assert offsets[0] != offsets[1] and offsets[0] % 64 == offsets[1] % 64 == 0
    spans = {i: (offsets[i], offsets[i] + -(-sizes[i] // 64) * 64) for i in (0, 1, 2)}
    assert spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0]   # 0 and 1 overlap in time: apart
    assert spans[2][0] == 0 and top == 256   # 2 reuses 0's and 1's bytes: 256 = max(2's 256, 128 + 64)


@pytest.mark.parametrize("make,rows", [(lambda: tg.SGD(0.1), 0), (lambda: tg.SGD(0.1, 0.9), 1),
                                       (lambda: tg.Adam(0.1), 2), (lambda: tg.Adam(0.1, clip=1.0), 3)],
                         ids=["sgd", "momentum", "adam", "adam-clip"])
def test_an_attached_optimizer_takes_only_the_rows_its_step_writes(make, rows):
    """Adam keeps two moments, momentum SGD a trace, plain SGD nothing; a transformed gradient (the
    clipped or L2-decayed copy) only under clipping or L2."""
    rng = np.random.default_rng(2)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((64, 32)))
    loss = ((tape.const(rng.standard_normal((8, 64))) @ w).tanh() ** 2).sum()
    prog = tg.capture(tape, loss, backend="native", memory="reuse")
    before = prog.runner.nbytes()
    opt = make()
    opt.add(tape, w)
    prog.attach(opt)
    assert prog.runner.nbytes() - before == rows * w.value.nbytes
    want = tg.capture(tape, loss, backend="numpy")
    ref = make()
    ref.add(tape, w)
    want.attach(ref)
    for _ in range(3):   # the NumPy replay's steps: the same, within tanh's libm tier (a few ulp)
        got, ref_loss = prog.episode(), want.episode()
        assert abs(got - ref_loss) <= 1e-12 * abs(ref_loss)
    got, ref_w = prog.value(w), want.value(w)
    assert np.max(np.abs(got - ref_w)) <= 1e-12 * np.max(np.abs(ref_w))
    assert not np.array_equal(prog.value(w), w.value)   # it did step
