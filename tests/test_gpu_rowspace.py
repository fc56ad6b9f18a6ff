"""The fused backward's runs (tapegrad/gpu/rowspace.py): which schedule entries fuse into one row-space and
one param-space kernel, the order-safety rules that stop a run, and wide param-space jobs — each program
emulated fused and per-node against the native program, bit for bit (two backward passes: a first
contribution assigns), with the backward's kernels named."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.gpu.host import emulate

from test_gpu import episode_program, train

RNG = np.random.default_rng(11)
X3, C32, W22, Q = (RNG.standard_normal(s) for s in ((3, 3), (3, 2), (2, 2), (2, 2, 3)))


def check(build, ordered=True):
    """Native, fused and per-node programs of ``build(tape) -> (params, loss)``: their gradients equal bit for
    bit; returns the backward kernel tags (the name without the program prefix) of the fused and the
    per-node program."""
    tags, grads = [], []
    for backend, fuse in (("native", True), ("numpy", True), ("numpy", False)):
        tape = tg.Tape(ordered=ordered)
        params, loss = build(tape)
        prog = tg.capture(tape, loss, backend=backend, fuse=fuse)
        if backend == "numpy":
            emulate(prog)
            tags.append([L.name[len(prog.runner.cp.prefix):] for L in prog.runner.cp.backward])
        for _ in range(2):
            prog.forward()
            prog.backward()
        grads.append([np.array(prog.grad(p)) for p in params])
    for got in grads[1:]:
        assert all(np.array_equal(u, v) and (np.signbit(u) == np.signbit(v)).all() for u, v in zip(got, grads[0]))
    return tags


def test_a_gradient_finished_in_param_space_is_not_read_in_the_same_run():
    """W2 = W·c gets its gradient from x @ W2's param-space job (aᵀ·g); W2's own backward (row space) must
    wait for it, so it is not fused into that run."""
    def build(t):
        w = t.param(C32)
        y = t.const(X3) @ (w * t.const(C32 + 1.0))
        return [w], (y * y).sum()
    fused, per_node = check(build)
    assert fused == ["seed", "br6_4", "bp6_4", "b3_3"] and per_node == ["seed", "da6", "b5_5", "db4", "b3_3"]


def test_a_param_space_target_takes_no_row_space_contribution_in_the_same_run():
    """W's first contribution comes from x @ W (param space), then W·c adds one in row space: fused, the
    row kernel would add before the param kernel assigns; the run stops before it."""
    def build(t):
        w = t.param(C32)
        y2 = w * t.const(C32 + 1.0)
        y1 = t.const(X3) @ w
        return [w], (y1 * y1).sum() + (y2 * y2).sum()
    fused, per_node = check(build)
    assert fused == ["seed", "b9_9", "br8_4", "bp8_4", "b2_2"] and len(per_node) == 8


def test_full_sums_and_means_spread_in_row_space_in_either_mode():
    """A full sum or mean of an elementwise chain: one run (the seed, then one row-space kernel)."""
    for ordered in (True, False):
        for reduce in ("sum", "mean"):
            def build(t):
                w = t.param(C32)
                z = (w * t.const(C32 + 1.0)) ** 2
                return [w], getattr(z, reduce)()
            fused, per_node = check(build, ordered)
            assert fused == ["seed", "br4_2"] and per_node == ["seed", "da4", "b3_3", "b2_2"], (ordered, reduce)


def test_both_inputs_in_row_space_a_bias_on_the_left_and_a_second_use():
    """h·h (two row-space jobs of one entry), b·(x@W) (a scale as input a: a param-space column sum of
    side a's rule), h read by two consumers (the matmul's da is not h's first contribution)."""
    def build(t):
        w1, w2, b = t.param(C32), t.param(W22), t.param(np.array([[0.5, -0.25]]))
        h = b * (t.const(X3) @ w1)
        u = h @ w2
        return [w1, w2, b], (u * u).sum() + (h * h).mean()
    fused, per_node = check(build)
    assert fused == ["seed", "b11_11", "br10_4", "bp10_4"] and len(per_node) == 11


def test_one_row_and_higher_rank_elementwise_nodes_stay_per_node():
    """A broadcast into a one-row node (w + v, node 3) and elementwise nodes of rank 1 or 3 (v·v, q·q) are
    not row-local: only the one-row square and its sum (nodes 4, 5) fuse."""
    def build(t):
        w, v, q = t.param(np.array([[0.5, -1.5, 2.0]])), t.param(np.array([1.0, 2.0, 3.0])), \
            t.param(Q)
        return [w, v, q], ((w + v) ** 2).sum() + (v * v).sum() + (q * q).sum()
    fused, per_node = check(build)
    assert fused == ["seed", "b11_11", "da10", "b9_9", "b8_8", "da7", "b6_6", "br5_4", "b3_3", "u3b"]
    assert per_node == ["seed", "b11_11", "da10", "b9_9", "b8_8", "da7", "b6_6", "da5", "b4_4", "b3_3", "u3b"]


@pytest.mark.parametrize("fuse", [True, False])
def test_param_space_jobs_wider_than_one_block(fuse):
    """A 257-wide hidden layer: W2 has 771 = 3·257 elements, more than one block of 256 threads (4 blocks)."""
    sizes = (2, 257, 3)
    ref = train(*episode_program("adam", "mse", True, "native", sizes=sizes))
    prog, params, x, y, data = episode_program("adam", "mse", True, fuse=fuse, sizes=sizes)
    got = train(emulate(prog), params, x, y, data)
    assert got[0] == ref[0] and all((a == b).all() for a, b in zip(got[1], ref[1]))
    grids = {L.name[len(prog.runner.cp.prefix):]: L.grid for L in prog.runner.cp.backward}
    assert not fuse or any(k.startswith("bp") and g == (4, 1) for k, g in grids.items()), grids


def test_a_param_space_contribution_after_a_row_space_one_adds_to_it():
    """W·c (recorded last: its row-space contribution to W comes first) then x @ W's aᵀ·g in the same run:
    the param kernel adds to what the row kernel assigned; a two-row bias is a column sum in that run too."""
    def build(t):
        w, b = t.param(C32[:2]), t.param(np.array([0.25, -0.5]))
        y1 = t.const(X3[:2, :2]) @ w + b
        y2 = w * t.const(C32[:2] + 1.0)
        return [w, b], (y1 * y1).sum() + (y2 * y2).sum()
    fused, per_node = check(build)
    # the run stops before x @ W (node 3): W already took a row-space contribution in it
    assert fused == ["seed", "b11_11", "br10_4", "bp10_4", "db3"] and len(per_node) == 10

    def twice(t):   # two aᵀ·g jobs into W in one run: the second adds
        w = t.param(C32)
        y = t.const(X3) @ w + t.const(X3[::-1]) @ w
        return [w], (y * y).sum()
    fused, per_node = check(twice)
    assert fused == ["seed", "br7_2", "bp7_2"] and len(per_node) > 3


def test_a_mask_at_node_zero_is_a_third_input():
    """where(mask, a, b) with the mask recorded first (node 0): a three-input node, not row-local."""
    def build(t):
        mask = t.const(np.array([[True, False], [False, True], [True, True]]))
        w = t.param(C32)
        return [w], (t.apply(tg.ops.OPS["where"], w * 2.0, w * w, None, mask) ** 2).sum()
    fused, per_node = check(build)
    assert fused == ["seed", "br6_5", "b4_4", "br3_2"] and len(per_node) == 6
