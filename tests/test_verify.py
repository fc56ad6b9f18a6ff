"""Verification on first run (tapegrad/verify.py): a miscompiled native program refuses to run, naming the
node, and correct programs of every registry op, both dtypes, fused and unfused, verify."""
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad import verify as V
from tapegrad.native import build
from tapegrad.native.runner import NativeRunner

from capture_util import batches, captured, every_op_graph
from test_native import every_op_tape

SIZES = (8, 16, 16, 3)
DATA = batches(SIZES, 12, 3)
ADVICE = ("CC=", "TAPEGRAD_MARCH=x86-64-v2", 'backend="numpy"', "verify=False")


def softmax_model():
    """W, b, x, y, h = x @ W + b, loss = softmax_cross_entropy(h, y) on a tape (nodes 0..6)."""
    rng = np.random.default_rng(3)
    tape = tg.Tape()
    W = tape.param(rng.standard_normal((4, 3)), name="W")
    b = tape.param(rng.standard_normal(3) * 0.1, name="b")
    x = tape.const(rng.standard_normal((6, 4)))
    y = tape.const(np.eye(3)[rng.integers(0, 3, 6)])
    h = x @ W + b
    loss = tg.softmax_cross_entropy(h, y)
    assert tape._nodes[loss.id].op is O.softmax_xent and tape._nodes[h.id].op is O.add
    return tape, W, h, loss


# ── a compiler that gets log wrong ───────────────────────────────────────────

@pytest.fixture
def log_off(tmp_path, monkeypatch):
    """$CC: the real compiler with every C library ``log(x)`` turned into ``log(x) + 1e-9`` by a header it
    force-includes, building into a cache of its own; returns (wrapper, real compiler). (A float64
    program's exp is the runtime's own; its log the C library's.)"""
    real = build.find_compiler()
    header = tmp_path / "log_off.h"
    header.write_text("#include <math.h>\n#define log(x) (log(x) + 1e-9)\n")
    cc = tmp_path / "cc-exp-off"
    cc.write_text(f'#!/bin/sh\nexec "{real}" -include "{header}" "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(build.ENV, str(tmp_path / "cache"))
    return str(cc), real


def test_a_compiler_whose_log_is_off_by_1e9_is_refused_at_capture(log_off, monkeypatch):
    cc, real = log_off
    tape, W, h, loss = softmax_model()
    with pytest.raises(tg.VerificationError, match=rf"^softmax_xent \(node {loss.id}\): native value differs from "
                                                   rf"NumPy's: expected \|native − NumPy\| <= ") as e:
        tg.capture(tape, loss, backend="native")
    msg = str(e.value)
    assert f"compiled by {cc} (" in msg and " ".join(build.flags()) in msg and "(tier libm)" in msg
    assert all(a in msg for a in ADVICE), msg
    assert tape.value(loss) is not None and len(tape) == loss.id + 1   # the tape is untouched
    prog = tg.capture(tape, loss, backend="native", verify=False)
    # the macro reaches the cross-entropy's log of each row's Σ e (the runtime's tg_log is log in float64)
    assert "r[q] = tg_log(r[q]);" in prog.runner.source and "(real)log((double)x)" in prog.runner.source
    shift = float(prog.forward()) - float(tape.value(loss))
    assert 0.5e-9 < shift < 2e-9, shift   # log Σ e + 1e-9, per row, averaged
    monkeypatch.setenv("CC", real)
    assert tg.capture(tape, loss, backend="native").verified == {"values", "gradients"}


def test_the_error_names_the_values_node_op_and_bound_and_numbers_within_it():
    """A matmul value off by 1e-9 relative is past the blas bound 2·K·eps·(|A|·|B|): the message names
    the node, the index of the largest difference and both numbers."""
    tape, W, h, loss = softmax_model()
    mm = tape._nodes[h.id].a
    with perturbed(NativeRunner, "forward", lambda p: p.val[mm], 1e-9):
        with pytest.raises(tg.VerificationError, match=rf"^matmul \(node {mm}\): native value differs from NumPy's: "
                                                       r"expected \|native − NumPy\| <= \S+ \(2·K·eps·\(\|A\|·\|B\|\), "
                                                       r"true for any summation order \(tier blas\)\), got \S+ at "
                                                       r"index \(\d, \d\) \(native \S+, NumPy \S+\), computed by "
                                                       r"NumPy's matmul from the program's own inputs; compiled by "):
            tg.capture(tape, loss, backend="native")


class perturbed:
    """Within the block, ``cls.method`` runs as before, then multiplies the largest-magnitude element of
    ``pick(program)`` (an array) by 1 + rel."""

    def __init__(self, cls, method, pick, rel):
        self.cls, self.method, self.pick, self.rel = cls, method, pick, rel

    def __enter__(self):
        orig = self.orig = getattr(self.cls, self.method)
        pick, rel = self.pick, self.rel

        def run(runner):
            orig(runner)
            a = pick(runner.p) if not hasattr(runner, "dev") else pick(runner)
            flat = a.reshape(-1)
            i = int(np.argmax(np.abs(flat)))
            flat[i] = flat[i] * (1.0 + rel)
        setattr(self.cls, self.method, run)
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.method, self.orig)
        return False


@pytest.mark.parametrize("target", ["add", "W"])
def test_a_gradient_off_by_1e6_relative_is_named_with_its_node(target):
    tape, W, h, loss = softmax_model()
    v = h if target == "add" else W
    j = v.id
    who = rf"add \(node {j}\)" if target == "add" else rf"param 'W' \(node {j}\)"
    feeds = rf"softmax_xent \(node {loss.id}\)" if target == "add" else rf"matmul \(node {h.id - 1}\)"
    with perturbed(NativeRunner, "backward", lambda p: p.grads[j], 1e-6):
        with pytest.raises(tg.VerificationError, match=rf"^{who}: native gradient differs from NumPy's: .* rebuilt by "
                                                       rf"NumPy's rules from the program's own values and the "
                                                       rf"gradients of {feeds}; compiled by ") as e:
            tg.capture(tape, loss, backend="native")
        assert all(a in str(e.value) for a in ADVICE)
        prog = tg.capture(tape, loss, backend="native", verify=False)   # runs anyway
        prog.forward()
        prog.backward()
        wrong = np.array(prog.grad(v))
    clean = tg.capture(tape, loss, backend="native")
    assert clean.verified == {"values", "gradients"}
    clean.forward()
    clean.backward()
    off = np.flatnonzero(wrong != clean.grad(v))
    assert len(off) == 1 and abs(wrong.flat[off[0]] / clean.grad(v).flat[off[0]] - 1 - 1e-6) < 1e-12


def test_verify_false_runs_nothing_at_capture(monkeypatch):
    def boom(prog):
        raise AssertionError("verification ran")
    monkeypatch.setattr(V, "check_run", boom)
    tape, W, h, loss = softmax_model()
    prog = tg.capture(tape, loss, backend="native", verify=False)
    prog.attach(tg.Adam(1e-2))
    prog.episode()
    assert prog.verified == set() and not prog.verify
    with pytest.raises(AssertionError, match="verification ran"):
        tg.capture(tape, loss, backend="native")
    assert tg.capture(tape, loss).verified == set()   # numpy: the reference itself, never checked


# ── the optimizer's first step ───────────────────────────────────────────────

def opt_state(prog):
    st = prog.optimizer_state()
    return [np.array(prog.value(n)) for n in prog.param_names], st.get("mu", []), st.get("nu", []), st["count"]


def same_state(a, b):
    (pa, ma, na, ca), (pb, mb, nb, cb) = a, b
    return ca == cb and all(np.array_equal(x, y) for x, y in zip(pa + ma + na, pb + mb + nb))


@pytest.mark.parametrize("opt,buffer,call", [("adam_clip_optax", "nu", "step"), ("adam", "mu", "episode"),
                                             ("sgd_clip_seed", "value", "episode")])
def test_a_wrong_first_step_is_refused_and_undone(opt, buffer, call):
    prog, tape, params, x, y, _ = captured(SIZES, DATA, opt, "native")
    prog.forward()
    prog.backward()
    before = opt_state(prog)
    pick = {"nu": lambda p: p.opt.nu[1], "mu": lambda p: p.opt.mu[1], "value": lambda p: p.val[params[1].id]}[buffer]
    kind = "SGD" if opt.startswith("sgd") else "Adam"
    with perturbed(NativeRunner, call, pick, 1e-6):
        with pytest.raises(tg.VerificationError, match=rf"^{kind} step of param 'param_1' \(node {params[1].id}\): "
                                                       rf"native {buffer} after the first update differs from NumPy's: "
                                                       r"expected \|native − NumPy\| <= 0 \(==: the update is "
                                                       r"IEEE-exact\), got .*the parameters, moments and count were "
                                                       r"restored to their values before the step; compiled by "):
            prog.step() if call == "step" else prog.episode()
    assert same_state(opt_state(prog), before) and prog.runner.sc[0] == 0
    assert "step" not in prog.verified
    prog.step() if call == "step" else prog.episode()   # the real step now: checked, and nothing was lost
    assert "step" in prog.verified
    ref, _, _, _, _, _ = captured(SIZES, DATA, opt, "native", fuse=False)
    ref.forward()
    ref.backward()
    ref.step() if call == "step" else ref.episode()
    assert same_state(opt_state(prog), opt_state(ref))


def test_a_wrong_clip_norm_is_refused_and_undone():
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam_clip_optax", "native")
    before = opt_state(prog)
    with perturbed(NativeRunner, "episode", lambda p: p.runner.sc[4:5], 1e-9):
        with pytest.raises(tg.VerificationError, match=r"^Adam step: the native program's global gradient norm for "
                                                       r"clipping differs from NumPy's: expected \|native − NumPy\| <= "
                                                       r"\S+ \(a sum of \d+ squares in any order\)"):
            prog.episode()
    assert same_state(opt_state(prog), before)


def test_each_attach_checks_its_first_step_again():
    prog, tape, params, x, y, opt = captured(SIZES, DATA, "adam", "native")
    prog.episode()
    assert prog.verified == {"values", "gradients", "step"}
    sgd = tg.SGD(0.1)
    for p in params:
        sgd.add(tape, p)
    prog.attach(sgd)
    assert prog._unverified_step
    with perturbed(NativeRunner, "episode", lambda p: p.val[params[0].id], 1e-6):
        with pytest.raises(tg.VerificationError, match=r"^SGD step of param 'param_0'"):
            prog.episode()


# ── no false positives ───────────────────────────────────────────────────────


# float64 shares test_native's builds (the same source); float32 fused only: one more build of every op
# (fused and unfused verify through the same comparisons)
@pytest.mark.parametrize("dtype,fuse", [("float64", True), ("float64", False), ("float32", True)])
def test_every_registry_op_verifies_natively(dtype, fuse, monkeypatch):
    """Every op's every case, each compared: no value or gradient differs beyond its tier. What a fused
    loop keeps in a local has no buffer to compare; its first stored consumer is compared."""
    compared = spy(monkeypatch)
    tape, loss, _ = every_op_tape()
    prog = tg.capture(tape, loss, backend="native", fuse=fuse, dtype=dtype)
    assert prog.verified == {"values", "gradients"}
    held = prog.runner.registers
    assert bool(held) == fuse
    assert len(compared) == len(prog.compute) + len(prog.reached) - len(held)


def spy(monkeypatch):
    """The shapes of every comparison ``_mismatch`` makes (one per value and per gradient)."""
    seen = []
    orig = V._mismatch

    def recording(got, want, tol):
        seen.append(np.shape(got))
        return orig(got, want, tol)
    monkeypatch.setattr(V, "_mismatch", recording)
    return seen


def test_every_op_graph_and_the_mlp_with_adam_and_clipping_verify():
    tape, params, loss = every_op_graph()
    assert tg.capture(tape, loss, backend="native").verified == {"values", "gradients"}
    for act, loss_kind in (("relu", "mse"), ("tanh", "xent")):
        for dtype in ("float64", "float32"):
            prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam_clip_optax", "native", act, loss_kind,
                                                   dtype=dtype)
            prog.episode({x: DATA[1][0], y: DATA[1][1]})
            assert prog.verified == {"values", "gradients", "step"}


def test_a_lazy_constant_program_verifies_on_its_first_run_once():
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    W = tape.param(rng.standard_normal((4, 3)), name="W")
    k = tape.const_lazy((5, 4))
    loss = (k @ W).tanh().sum()
    prog = tg.capture(tape, loss, backend="native")
    assert prog.verified == set() and prog._unverified
    with pytest.raises(tg.LazyValueError):
        prog.forward()
    prog.set_input(k, rng.standard_normal((5, 4)))
    with perturbed(NativeRunner, "forward", lambda p: p.val[loss.id], 1e-9):
        for _ in range(2):   # refused at each run until it verifies
            with pytest.raises(tg.VerificationError, match=rf"^sum \(node {loss.id}\): native value"):
                prog.forward()
    calls = spy_run(prog)
    prog.backward()   # the first run that verifies: forward and backward, checked
    prog.forward()
    prog.backward()
    assert calls == ["forward", "backward", "forward", "backward"]
    assert prog.verified == {"values", "gradients"}
    want = np.tanh(prog.value(k) @ prog.value(W)).sum()
    assert abs(float(prog.loss()) - want) <= 1e-14 * abs(want)


def test_a_lazy_program_with_an_optimizer_checks_both_on_its_first_episode():
    tape = tg.Tape()
    W = tape.param(np.ones((4, 3)) * 0.1)
    k = tape.const_lazy((5, 4))
    loss = (k @ W).tanh().sum()
    prog = tg.capture(tape, loss, backend="native")
    prog.attach(tg.Adam(1e-2, clip=0.1))
    prog.episode({k: np.arange(20.0).reshape(5, 4) / 20})
    assert prog.verified == {"values", "gradients", "step"}


def test_native_abi_verifies_a_lazy_program_whose_inputs_came_before_a_c_caller_runs_it():
    tape = tg.Tape()
    W = tape.param(np.ones((4, 3)) * 0.1)
    k = tape.const_lazy((5, 4))
    prog = tg.capture(tape, (k @ W).sum(), backend="native")
    prog.native_abi()
    assert prog.verified == set()   # still missing: the C caller will write it
    prog.set_input(k, np.ones((5, 4)))
    prog.native_abi()
    assert prog.verified == {"values", "gradients"}


def spy_run(prog):
    calls = []
    r = prog.runner
    for name in ("forward", "backward"):
        def run(name=name, f=getattr(r, name)):
            calls.append(name)
            f()
        setattr(r, name, run)
    return calls


# ── the bounds themselves ────────────────────────────────────────────────────

def test_the_product_bound_holds_for_any_summation_order_and_catches_1e9():
    """Float64 and float32 products summed in reverse order lie within 2·K·eps·(|A|·|B|) of NumPy's; a
    1e-9 relative change of one float64 element does not."""
    rng = np.random.default_rng(1)
    for dtype in ("float64", "float32"):
        a, b = (rng.standard_normal(s).astype(dtype) for s in ((7, 300), (300, 5)))
        want = a @ b
        backwards = np.zeros_like(want)
        for k in range(a.shape[1] - 1, -1, -1):
            backwards += np.multiply.outer(a[:, k], b[k])
        tol = V._product_bound(O.matmul, "fwd", None, want.shape, a, b, None, V._Fresh(dtype))
        assert V._mismatch(backwards, want, tol) is None and V._mismatch(backwards, want, None) is not None
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    bumped = exact.copy()
    bumped[3, 2] *= 1 + 1e-9
    tol = V._product_bound(O.matmul, "fwd", None, exact.shape, a64, b64, None, V._Fresh("float64"))
    assert V._mismatch(bumped, exact, tol)[0] == (3, 2)


def test_conv_counts_its_products_from_the_rule():
    """K of a convolution comes from its own rule on ones: Cg·kh·kw = 2·3·2 products inside, fewer where the
    window covers padding."""
    op = O.OPS["conv"]
    (ash, bsh, s) = op.cases[1]   # channels first, strides (2, 1), padding ((1, 1), (0, 2))
    ws = V._Fresh("float64")
    a, b = np.ones(ash), np.ones(bsh)
    k = V._terms(op, "fwd", None, op.shape(ash, bsh, s), a, b, s, ws)
    assert k.shape == op.shape(ash, bsh, s) and k.max() == 12 and k.min() < 12


# ── the CuPy runner (tests/fake_cupy.py: no GPU needed) ──────────────────────

@pytest.fixture
def cupy(monkeypatch):
    import fake_cupy
    mod = fake_cupy.make()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


@pytest.mark.parametrize("ordered", [True, False])
def test_cupy_programs_verify_with_the_devices_own_clip_norm(cupy, ordered):
    """The device sums Σ g² serially, the CPU by BLAS dots: the norms differ in the last bits, and the
    update checked from the device's own norm is still ==."""
    from test_gpu import CLIPPING, episode_program
    prog, params, x, y, data = episode_program(CLIPPING["adam_clip_optax"], "xent", ordered, "cupy")
    prog.episode({x: data[1][0], y: data[1][1]})
    assert prog.verified == {"values", "gradients", "step"}


def test_cupy_wrong_value_and_wrong_step_are_refused_and_the_step_undone(cupy):
    from tapegrad.gpu.runner import CupyRunner
    from test_gpu import episode_program
    prog_args = ("adam", "mse", True, "cupy")
    with perturbed(CupyRunner, "forward", lambda r: r.dev[("v", r.p.loss_id)], 1e-9):
        with pytest.raises(tg.VerificationError, match=r"^\w+ \(node \d+\): cupy value differs from NumPy's: .*; "
                                                       r"compiled by NVRTC \(CuPy \?\) with --fmad=false -std=c\+\+14; "
                                                       r".*backend=\"native\".*verify=False"):
            episode_program(*prog_args)
    prog, params, x, y, data = episode_program(*prog_args)
    before = [np.array(prog.value(p)) for p in params], prog.optimizer_state()
    with perturbed(CupyRunner, "episode", lambda r: r.dev[("M", 2)], 1e-6):
        with pytest.raises(tg.VerificationError, match=r"^Adam step of param 'param_2' \(node 2\): cupy mu after"):
            prog.episode()
    after = [np.array(prog.value(p)) for p in params], prog.optimizer_state()   # read from the device
    assert all(np.array_equal(u, v) for u, v in zip(before[0], after[0]))
    assert after[1]["count"] == before[1]["count"] == 0
    assert all(np.array_equal(u, v) for u, v in zip(before[1]["mu"] + before[1]["nu"], after[1]["mu"] + after[1]["nu"]))
    ref, _, rx, ry, _ = episode_program("adam", "mse", True, "native")
    assert prog.episode() == ref.episode() and prog.verified == {"values", "gradients", "step"}
