"""The fusion planner: which nodes fuse, fused == unfused bit for bit, and the generated source (golden)."""
import os
import pathlib

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import codegen, fuse
from tapegrad.native.runner import layout

GOLDEN = pathlib.Path(__file__).parent / "golden" / "native_mlp.c"


def tiny_mlp():
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    w, b = tape.param(rng.standard_normal((3, 4))), tape.param(rng.standard_normal(4))
    x, y = tape.const(rng.standard_normal((5, 3))), tape.const(rng.standard_normal((5, 4)))
    loss = tg.mse((x @ w + b).relu(), y)
    return tape, loss, (w, b)


def chain():
    """A long elementwise chain with a shared input (x·x) and a value used twice."""
    rng = np.random.default_rng(1)
    tape = tg.Tape()
    a, c = tape.param(rng.standard_normal((6, 7))), tape.param(rng.uniform(0.5, 2.0, (6, 7)))
    t = (a * a + c).tanh()
    u = (t * c - a).sigmoid().log() / c
    v = (u * t).exp() + (c.sqrt() - t).abs()
    return tape, (v * v).mean(), (a, c)


def test_mlp_plan_fuses_bias_and_activation_and_keeps_gemms_alone():
    tape, loss, _ = tiny_mlp()
    prog = tg.capture(tape, loss)
    fwd, bwd = fuse.plan(prog, True)
    assert [[prog.nodes[k][0].name for k in seg] for seg in fwd] == [["matmul"], ["add", "relu", "sub", "square"],
                                                                    ["mean"]]
    # backward: the bias add joins the chain; its b gradient (a row sum of g) is reduced after the loop
    assert [[prog.nodes[e[0]][0].name for e in seg] for seg in bwd] == [["mean"], ["square", "sub", "relu", "add"],
                                                                        ["matmul"]]
    assert fuse.plan(prog, False)[0] == [[k] for k in prog.compute]


def test_libm_calls_run_alone_and_everything_else_fuses():
    """Forward: a libm call (log) is a run of its own (measured: fusing it is slower); tanh, sigmoid and
    exp are the runtime's vector code and fuse; backward: these derivatives read ``out`` and call
    nothing, so the whole chain is one loop."""
    tape, loss, _ = chain()
    prog = tg.capture(tape, loss)
    fwd, bwd = fuse.plan(prog, True)
    assert [[prog.nodes[k][0].name for k in seg] for seg in fwd] == [
        ["mul", "add", "tanh", "mul", "sub", "sigmoid"], ["log"], ["div", "mul", "exp", "sqrt", "sub", "abs", "add", "mul"],
        ["mean"]]
    assert [len(seg) for seg in bwd] == [1, 15]


@pytest.mark.matrix
def test_chain_fused_is_bit_identical_to_unfused_through_optimizer_steps():
    tape, loss, params = chain()
    tape.backward(loss)
    progs = [tg.capture(tape, loss, backend="native", fuse=f) for f in (False, True)]
    plan = progs[1].plan()
    assert plan["kernels_forward"] == 4 and plan["kernels_forward_unfused"] == 16
    assert plan["kernels_backward"] == 2 and plan["kernels_backward_unfused"] == 16
    opt = tg.Adam(0.05, clip=0.5)
    for p in params:
        opt.add(tape, p)
    for prog in progs:
        prog.attach(opt)
        for _ in range(3):
            prog.episode()
        prog.forward()
        prog.backward()
    for v in params:
        assert np.array_equal(progs[0].value(v), progs[1].value(v))
        assert np.array_equal(progs[0].grad(v), progs[1].grad(v))
    assert np.array_equal(progs[0].loss(), progs[1].loss())


def test_generated_source_golden():
    """The printed program (runtime omitted) for a fused tiny MLP; review diffs like code. Regenerate with
    TAPEGRAD_REGEN_GOLDEN=1."""
    tape, loss, _ = tiny_mlp()
    prog = tg.capture(tape, loss)
    _, index = layout(prog)
    src = codegen.Emitter(prog, index, *fuse.plan(prog, True), blas_bits=32).emit()
    head, body = src.split(codegen.runtime_source())
    text = head + "/* … runtime.c … */\n" + body
    if os.environ.get("TAPEGRAD_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"{GOLDEN} differs; review and regenerate with TAPEGRAD_REGEN_GOLDEN=1"


def test_cuda_dialect_of_the_same_segments_golden():
    """The fused segments printed as CUDA kernels from the same expressions (``__d*_rn``: no FMA
    contraction by nvcc); the future GPU backend's starting point. Regenerate with TAPEGRAD_REGEN_GOLDEN=1."""
    tape, loss, _ = tiny_mlp()
    prog = tg.capture(tape, loss)
    _, index = layout(prog)
    text = codegen.Emitter(prog, index, *fuse.plan(prog, True), target="cuda").elementwise_kernels()
    path = GOLDEN.with_name("native_mlp_elementwise.cu")
    if os.environ.get("TAPEGRAD_REGEN_GOLDEN") == "1":
        path.write_text(text)
    assert "__dmul_rn" in text and "__dadd_rn" in text and "t7 * t7" not in text
    assert text == path.read_text(), f"{path} differs; review and regenerate with TAPEGRAD_REGEN_GOLDEN=1"


def test_a_fused_local_nothing_reads_is_not_computed():
    """with_grad reads its path only in the backward: in the fused forward loop the path's local has no
    reader, so it is dropped (codegen._live) and its chain with it; the program still equals the tape."""
    tape = tg.Tape()
    x = tape.param(np.linspace(-1.0, 1.0, 12).reshape(3, 4))
    scaled = x * 3.0
    path = scaled + 1.0              # linear: its backward needs no value, so the loop keeps it in a local
    y = tg.with_grad(x * x + 0.5, path)
    loss = (y * y).sum()
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend="native")
    src = prog.runner.source
    fwd = src[:src.index("void tg_forward(")]
    kernels = [k for k in fwd.split("static __attribute__((noinline)) void ")[1:] if k.startswith("tg_f")]
    assert kernels and all(f"t{path.id} =" not in k and f"t{scaled.id} =" not in k for k in kernels), fwd
    assert any(f"t{y.id} =" in k or f"v{y.id}[i] =" in k for k in kernels), fwd
    assert float(prog.forward()) == float(tape.value(loss))
    prog.backward()
    assert np.array_equal(prog.grad(x), tape.grad(x))
