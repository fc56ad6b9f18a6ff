"""Fused loops keep what nothing else reads in locals (tapegrad/native/fuse.py's ``registers``): the
same bits as unfused, still verified on the first run, and a value or gradient that was never stored is
rebuilt with the loop's bits, not read stale."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import codegen


def gelu_model():
    """A tanh-approximated GELU after a dense layer, as flax's ``nn.gelu`` is built: u = h + 0.044715·h³,
    t = tanh(0.79788·u), out = h · 0.5 · (1 + t); the loss is a mean."""
    rng = np.random.default_rng(7)
    tape = tg.Tape()
    W = tape.param(rng.standard_normal((6, 16)) * 0.5, name="W")
    b = tape.param(rng.standard_normal(16) * 0.1, name="b")
    x = tape.const(rng.standard_normal((12, 6)))
    h = x @ W + b
    sq = h * h
    cube = h * sq
    u = h + cube * 0.044715
    t = (u * 0.7978845608028654).tanh()
    half = (t + 1.0) * 0.5
    out = h * half
    loss = (out * out).mean()
    return tape, (W, b), {"h": h, "sq": sq, "cube": cube, "u": u, "t": t, "half": half, "out": out}, loss


@pytest.mark.matrix
def test_a_fused_gelu_stores_only_what_other_kernels_read_and_gives_the_unfused_bits():
    tape, params, at, loss = gelu_model()
    fused = tg.capture(tape, loss, backend="native")
    plain = tg.capture(tape, loss, backend="native", fuse=False)
    assert fused.verified == {"values", "gradients"}
    regs = fused.runner.registers
    # h³ and the tanh's argument are exact-tier and read only inside the loop: locals, never stored
    assert ("v", at["cube"].id) in regs and ("v", at["u"].id) in regs
    # tanh is libm-tier (its bits are not NumPy's), h feeds the backward, the loss leaves the loop: stored
    assert not {("v", at["t"].id), ("v", at["h"].id), ("v", loss.id)} & regs
    assert any(kind == "g" for kind, _ in regs)
    assert not plain.runner.registers
    src = fused.runner.source
    for kind, k in regs:
        assert not re.search(rf"\b{kind}{k}\[i\] =", src), (kind, k)
    assert float(fused.forward()) == float(plain.forward())
    fused.backward()
    plain.backward()
    for p in params:
        assert np.array_equal(fused.grad(p), plain.grad(p))


@pytest.mark.matrix
def test_values_and_gradients_held_only_in_a_loop_are_rebuilt_with_the_loops_bits():
    tape, params, at, loss = gelu_model()
    prog = tg.capture(tape, loss, backend="native")
    plain = tg.capture(tape, loss, backend="native", fuse=False)
    for p in (prog, plain):
        p.forward()
        p.backward()
    regs = prog.runner.registers
    held = [(kind, v) for v in at.values() for kind in "vg" if (kind, v.id) in regs]
    assert {kind for kind, _ in held} == {"v", "g"}
    for kind, v in held:
        read = prog.value if kind == "v" else prog.grad
        other = plain.value if kind == "v" else plain.grad
        got = read(v)
        assert np.array_equal(got, other(v)) and not got.flags.writeable, (kind, v.id)
        buf = prog.val[v.id] if kind == "v" else prog.grads[v.id]
        assert not np.array_equal(buf, got)   # the buffer itself was never written
    assert np.array_equal(prog.value(at["u"]), tape.value(at["u"]))


def test_a_miscompiled_register_is_caught_at_its_first_stored_consumer(monkeypatch):
    """The verifier recomputes a local's value by NumPy's rule, which for an exact-tier op is the local's
    own bits; a loop that got it wrong shows up at the first value that is stored."""
    tape, params, at, loss = gelu_model()
    u = at["u"].id
    kernel = codegen.Emitter.kernel

    def scaled(self, name, os_, stmts):   # the loop computes u·(1 + 1e-9)
        return kernel(self, name, os_, [s.replace(f"const real t{u} = ", f"const real t{u} = (1.0 + 1e-9) * ")
                                        for s in stmts])
    monkeypatch.setattr(codegen.Emitter, "kernel", scaled)
    with pytest.raises(tg.VerificationError, match=r"^tanh \(node \d+\): native value differs from NumPy's"):
        tg.capture(tape, loss, backend="native")


@pytest.mark.matrix
@pytest.mark.parametrize("fuse", [True, "libm"])
def test_libm_tier_values_and_gradients_stay_in_buffers(fuse):
    """A libm-tier result (tanh of data that needs no gradient; erf's gradient, which calls exp) is a
    few ulp from NumPy's, so verification could not rebuild it exactly: it is stored and compared
    itself, and the exact-tier node after it is compared at ==."""
    rng = np.random.default_rng(11)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((64, 64)))
    x = tape.const(rng.standard_normal((64, 64)) * 2.0)
    t = (x * 0.75).tanh()          # no gradient reaches it; only the next node (in its loop) reads it
    u = x * w                      # erf's gradient, rule g·2/√π·exp(-u²), flows into u, then into w
    loss = (w * (t + 1.0)).sum() + u.erf().sum() * 0.5
    prog = tg.capture(tape, loss, backend="native", fuse=fuse)
    assert prog.verified == {"values", "gradients"}
    held = prog.runner.registers
    assert ("v", t.id) not in held
    if fuse == "libm":
        assert ("g", u.id) not in held
    prog.forward()
    prog.backward()
    tape.backward(loss)
    # each element sums two terms below 10 in magnitude, each a few ulp from NumPy's
    assert np.max(np.abs(prog.grad(w) - tape.grad(w))) < 1e-13
