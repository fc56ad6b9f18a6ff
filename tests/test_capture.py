"""Capture and the NumPy replay: bit-identical to the eager tape, allocation-free, with clear errors."""
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.errors import DTypeError, ForeignVarError, LazyValueError, ShapeError, TapeError

from op_cases import floats, make, record
from capture_util import batches, captured, eager, every_op_graph, mlp, mlp_init

SIZES = (8, 16, 16, 3)
DATA = batches(SIZES, 12, 5)
OPTS = ["sgd", "sgd_clip_seed", "adam", "adam_clip_optax", "adam_hat_clip_torch"]


@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("act,loss", [("relu", "xent"), ("tanh", "mse"), ("sigmoid", "logsoftmax")])
def test_numpy_replay_trajectory_is_the_tape_bit_for_bit(opt, act, loss):
    want_losses, want_params, want_opt = eager(SIZES, DATA, opt, act, loss)
    prog, tape, params, x, y, _ = captured(SIZES, DATA, opt, "numpy", act, loss)
    got = [prog.episode({x: xb, y: yb}) for xb, yb in DATA]
    assert got == want_losses
    for p, w in zip(params, want_params):
        assert np.array_equal(prog.value(p), w)
    st = prog.optimizer_state()
    assert st["count"] == len(DATA) == want_opt.count
    for key in ("mu", "nu") if "adam" in opt else ():
        for a, b in zip(st[key], getattr(want_opt, key)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("op", [o for o in O.OPS.values() if o.arity], ids=lambda o: o.name)
def test_numpy_replay_of_every_op_equals_the_tape(op):
    rng = np.random.default_rng(3)
    for case in op.cases:
        tape = tg.Tape()
        arrays, s = make(op, case, rng)
        vs, y = record(tape, op, arrays, s)
        loss = (y * tape.const(rng.standard_normal(y.shape))).sum()
        tape.backward(loss)
        prog = tg.capture(tape, loss)
        prog.forward()
        prog.backward()
        assert np.array_equal(prog.value(y), tape.value(y))
        for v in floats(op, vs):
            assert np.array_equal(prog.grad(v), tape.grad(v))


def test_every_op_graph_values_and_gradients():
    tape, params, loss = every_op_graph()
    tape.backward(loss)
    prog = tg.capture(tape, loss)
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    for p in params:
        assert np.array_equal(prog.grad(p), tape.grad(p))


def test_views_are_read_only_and_not_copies():
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam")
    prog.forward()
    prog.backward()
    for view in (prog.value(params[0]), prog.grad(params[0]), prog.loss()):
        assert not view.flags.writeable
    assert np.shares_memory(prog.value(params[0]), prog.value(params[0]))
    assert prog.value(params[0]).base is not None


def test_set_input_errors_name_the_node_and_change_nothing():
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam")
    before = prog.value(x).copy()
    with pytest.raises(ShapeError, match=rf"set_input \(node {x.id}\): expected shape \(12, 8\) for const node "
                                         rf"{x.id}, got \(11, 8\)"):
        prog.set_input(x, np.zeros((11, 8)))
    with pytest.raises(DTypeError, match=rf"set_input \(node {x.id}\): expected float64 or float32 .* got int64"):
        prog.set_input(x, np.zeros((12, 8), np.int64))
    h = tape._nodes[x.id + 2]
    with pytest.raises(TapeError, match="expected a const or param slot, got a matmul node"):
        prog.set_input(tg.Var(tape, x.id + 2, h.epoch), np.zeros((12, 16)))
    other = tg.Tape().const(np.zeros((12, 8)))
    with pytest.raises(ForeignVarError, match="not a node of the captured episode"):
        prog.set_input(other, np.zeros((12, 8)))
    assert np.array_equal(prog.value(x), before)
    prog.set_input(x, np.ones((12, 8), np.float32))      # float32 data is converted
    assert np.array_equal(prog.value(x), np.ones((12, 8)))


def test_lazy_consts_must_be_given_before_running():
    rng = np.random.default_rng(0)
    wv, xv = rng.standard_normal((5, 3)), rng.standard_normal((4, 5))
    tape = tg.Tape()
    frozen = tape.const_lazy((5, 3))
    x = tape.const_lazy((4, 5))
    adapter = tape.param(np.zeros(3))
    loss = ((x @ frozen + adapter).tanh()).mean()
    prog = tg.capture(tape, loss)
    with pytest.raises(LazyValueError, match=rf"lazy constant node\(s\) \[{frozen.id}, {x.id}\] have no values"):
        prog.forward()
    prog.set_input(frozen, wv)
    with pytest.raises(LazyValueError, match=rf"\[{x.id}\]"):
        prog.episode()
    prog.set_input(x, xv)
    prog.forward()
    prog.backward()
    eager = tg.Tape()
    a = eager.param(np.zeros(3))
    ref = ((eager.const(xv) @ eager.const(wv) + a).tanh()).mean()
    eager.backward(ref)
    assert float(prog.loss()) == float(eager.value(ref))
    assert np.array_equal(prog.grad(adapter), eager.grad(a))


def test_drop_consts_after_capture_frees_the_frozen_weights():
    """A fine-tune shape: a large frozen weight (const), a small trainable adapter."""
    rng = np.random.default_rng(0)
    tracemalloc.start()
    big = rng.standard_normal((512, 512))          # 2 MiB of frozen weights
    xb = rng.standard_normal((16, 512))
    tape = tg.Tape()
    frozen = tape.const(big)
    adapter = tape.param(np.zeros((512, 4)))
    head = tape.param(rng.standard_normal((4, 512)) * 0.01)
    x = tape.const(xb)
    loss = tg.mse((x @ frozen) + (x @ adapter) @ head, tape.const(np.zeros((16, 512))))
    want = float(tape.value(loss))
    prog = tg.capture(tape, loss)
    try:
        before = tracemalloc.get_traced_memory()[0]
        freed = tape.drop_consts()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert freed >= big.nbytes + 2 * xb.nbytes
    assert before - after >= big.nbytes           # host memory really went down by the frozen weights
    assert float(prog.forward()) == want          # the program still holds its own copies
    prog.attach(tg.Adam(1e-3))
    prog.episode()


def test_numpy_episode_allocates_no_arrays_after_the_first():
    """What this proves: over 4 episodes after the first two, the peak of traced memory (tracemalloc sees
    every NumPy data buffer) grows by less than NumPy's own ufunc iterator buffer (``np.getbufsize()``
    elements, allocated inside a call for broadcasting or casting ufuncs — the eager tape pays it too)
    plus 8 KiB of transient Python objects (views, floats). Every activation, weight, gradient, scratch
    and optimizer buffer here is >= 128 KiB, so no temporary of any of those shapes is allocated per
    episode. Biases, per-row vectors (1 KiB) and the 0-d loss are too small for this bound to see."""
    sizes = (128, 128, 128, 128)
    data = batches(sizes, 128, 4)
    prog, tape, params, x, y, _ = captured(sizes, data, "adam_clip_optax")
    feed = [{x: xb, y: yb} for xb, yb in data]
    prog.episode(feed[0])
    prog.episode(feed[1])
    bound = np.getbufsize() * 8 + 8192
    big = [a.nbytes for a in prog.val if a.ndim == 2 and min(a.shape) > 1]
    assert min(big) >= 131072 > bound
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for f in feed:
            prog.episode(f)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < bound, peak - base
    assert current - base < 1024, current - base      # and nothing is kept


def test_optimizer_state_round_trips_with_the_tape_optimizer():
    prog, tape, params, x, y, opt = captured(SIZES, DATA, "adam_clip_optax")
    for xb, yb in DATA[:3]:
        prog.episode({x: xb, y: yb})
    prog.sync_params(tape, opt)                   # program -> tape and tape optimizer
    assert opt.count == 3
    m = len(params)
    for p in params:
        assert np.array_equal(tape.value(p), prog.value(p))
    # continue eagerly for two steps, then load that state back into the program and compare
    marks = tape.mark()
    for xb, yb in DATA[3:]:
        _, _, out = mlp(tape, params, xb, yb)
        tape.backward(out)
        opt.step()
        tape.reset_to(marks)
    prog2, tape2, params2, x2, y2, _ = captured(SIZES, DATA, "adam_clip_optax")
    for p2, p in zip(params2, params):
        prog2.set_input(p2, tape.value(p))
    prog2.load_optimizer_state(opt.state_dict())
    prog.load_optimizer_state(prog.optimizer_state())
    assert prog2.optimizer_state()["count"] == 5
    assert m == len(params2)


def test_step_scalars_advance_every_step():
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam")
    prog.forward()
    prog.backward()
    w0 = prog.value(params[0]).copy()
    prog.step()
    prog.step()
    assert prog.optimizer_state()["count"] == 2
    assert not np.array_equal(prog.value(params[0]), w0)
    with pytest.raises(TapeError, match="no optimizer attached"):
        tg.capture(tape, tape._nodes and tg.Var(tape, prog.loss_id, tape._nodes[prog.loss_id].epoch)).step()


def test_float32_program_stays_within_the_stated_bound():
    """float32 program vs float64 tape over 5 Adam steps: |Δloss| <= 1e-5·max(1, |loss|), params 1e-5."""
    want_losses, want_params, _ = eager(SIZES, DATA, "adam")
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam", dtype="float32")
    got = [prog.episode({x: xb, y: yb}) for xb, yb in DATA]
    assert prog.value(params[0]).dtype == np.float32
    for g, w in zip(got, want_losses):
        assert abs(g - w) <= 1e-5 * max(1.0, abs(w))
    for p, w in zip(params, want_params):
        assert np.max(np.abs(prog.value(p) - w)) <= 1e-5 * max(1.0, np.max(np.abs(w)))


def test_hash64_is_stable_across_processes():
    here_dir = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here_dir!r}); from capture_util import *; "
            "p = captured((8, 16, 16, 3), batches((8, 16, 16, 3), 12, 1), 'adam')[0]; print(p.hash64)")
    here = captured(SIZES, DATA, "adam")[0].hash64
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == here
    assert captured(SIZES, DATA, "sgd")[0].hash64 != here
    assert isinstance(here, int) and 0 <= here < 2 ** 64


def test_capture_rejects_bad_arguments():
    tape = tg.Tape()
    v = tape.param(np.ones(3))
    with pytest.raises(ShapeError, match="expected a scalar loss"):
        tg.capture(tape, v * 2.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        tg.capture(tape, v.sum(), backend="gpu")
    with pytest.raises(DTypeError, match="float64 or float32"):
        tg.capture(tape, v.sum(), dtype="float16")
    assert mlp_init((2, 2))
