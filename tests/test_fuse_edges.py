"""The fusion planner's edges: the libm policy switch, segments after several earlier ones, the plan report."""
import types

import numpy as np

import tapegrad as tg
from tapegrad.native import fuse


def names(prog, fwd, bwd):
    return ([[prog.nodes[k][0].name for k in seg] for seg in fwd],
            [[prog.nodes[e[0]][0].name for e in seg] for seg in bwd])


def sine():
    """sin's derivative calls cos (libm), so its backward is the libm policy's to decide too."""
    rng = np.random.default_rng(2)
    tape = tg.Tape()
    x, c = tape.param(rng.standard_normal((4, 5))), tape.param(rng.standard_normal((4, 5)))
    return tg.capture(tape, ((x * c).sin() * c).sum())


def two_layers():
    rng = np.random.default_rng(3)
    tape = tg.Tape()
    w1, b1 = tape.param(rng.standard_normal((3, 6))), tape.param(rng.standard_normal(6))
    w2, b2 = tape.param(rng.standard_normal((6, 4))), tape.param(rng.standard_normal(4))
    x, y = tape.const(rng.standard_normal((5, 3))), tape.const(rng.standard_normal((5, 4)))
    return tg.capture(tape, tg.mse(((x @ w1 + b1).relu() @ w2 + b2).relu(), y))


def test_libm_calls_stay_alone_by_default_and_fuse_forward_and_backward_when_asked():
    prog = sine()
    assert names(prog, *fuse.plan(prog)) == names(prog, *fuse.plan(prog, True, False)) == (
        [["mul"], ["sin"], ["mul"], ["sum"]], [["sum"], ["mul"], ["sin"], ["mul"]])
    assert names(prog, *fuse.plan(prog, True, True)) == ([["mul", "sin", "mul"], ["sum"]],
                                                         [["sum"], ["mul", "sin", "mul"]])
    assert names(prog, *fuse.plan(prog, False, True)) == ([["mul"], ["sin"], ["mul"], ["sum"]],
                                                          [["sum"], ["mul"], ["sin"], ["mul"]])


def test_a_backward_run_after_several_segments_joins_the_last_one_only():
    """Layer 2's chain (5×4) is segment 1; layer 1's relu+add (5×6) must fuse as segment 3, not join 1."""
    prog = two_layers()
    fwd, bwd = fuse.plan(prog)
    assert names(prog, fwd, bwd) == (
        [["matmul"], ["add", "relu"], ["matmul"], ["add", "relu", "sub", "square"], ["mean"]],
        [["mean"], ["square", "sub", "relu", "add"], ["matmul"], ["relu", "add"], ["matmul"]])


def test_plan_report_names_segments_by_first_and_last_node_and_counts_kernels():
    prog = two_layers()
    assert fuse.report(prog, *fuse.plan(prog)) == {
        "backend": "native", "fused": True,
        "forward_segments": [(6, 6, 1), (7, 8, 2), (9, 9, 1), (10, 13, 4), (14, 14, 1)],
        "backward_segments": [(14, 14, 1), (13, 10, 4), (9, 9, 1), (8, 7, 2), (6, 6, 1)],
        "kernels_forward_unfused": 9, "kernels_forward": 5, "kernels_backward_unfused": 9, "kernels_backward": 5}
    assert fuse.report(prog, *fuse.plan(prog, False))["fused"] is False


def test_two_node_runs_count_as_fused():
    tape = tg.Tape()
    x, c = tape.param(np.ones((4, 5))), tape.const(np.full((4, 5), 2.0))
    prog = tg.capture(tape, (x * x + c).sum())
    fwd, bwd = fuse.plan(prog)
    assert names(prog, fwd, bwd) == ([["mul", "add"], ["sum"]], [["sum"], ["add", "mul"]])
    assert fuse.report(prog, fwd, bwd)["fused"] is True


def test_only_elementwise_ops_with_a_c_expression_fuse():
    """Both conditions are needed: an elementwise op without C, or a C expression on another kind."""
    assert fuse._ew(types.SimpleNamespace(name="t_no_c", kind="elementwise", c_fwd=None), "c_fwd") is False
    assert fuse._ew(types.SimpleNamespace(name="t_rowwise", kind="reduce", c_fwd="a + b"), "c_fwd") is False
    assert fuse._ew(types.SimpleNamespace(name="t_arith", kind="elementwise", c_fwd="a + b"), "c_fwd") is True
