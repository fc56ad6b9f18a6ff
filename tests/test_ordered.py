"""Ordered mode: the eager tape, the NumPy replay and the native C program of an MLP agree bit for bit."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ordered
from tapegrad import ops as O

from capture_util import batches, make_opt, mlp, mlp_init, register

SIZES = (6, 9, 7, 3)


def run_eager(data, opt_kind, loss, ordered_mode=True):
    tape = tg.Tape(ordered=ordered_mode)
    params = [tape.param(a) for a in mlp_init(SIZES)]
    opt = make_opt(opt_kind)
    register(opt, tape, params)
    m = tape.mark()
    losses = []
    for xb, yb in data:
        _, _, out = mlp(tape, params, xb, yb, "relu", loss)
        losses.append(float(tape.value(out)))
        tape.backward(out)
        opt.step()
        tape.reset_to(m)
    return losses, [tape.value(p).copy() for p in params]


def run_program(data, opt_kind, loss, backend, fuse=True):
    tape = tg.Tape(ordered=True)
    params = [tape.param(a) for a in mlp_init(SIZES)]
    opt = make_opt(opt_kind)
    register(opt, tape, params)
    tape.mark()
    x, y, out = mlp(tape, params, *data[0], "relu", loss)
    prog = tg.capture(tape, out, backend=backend, fuse=fuse)
    prog.attach(opt)
    losses = [prog.episode({x: xb, y: yb}) for xb, yb in data]
    return losses, [np.array(prog.value(p)) for p in params], prog


def serial_matmul(a, b):
    out = np.zeros((a.shape[0], b.shape[1]))
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = 0.0
            for k in range(a.shape[1]):
                acc = acc + a[i, k] * b[k, j]
            out[i, j] = acc
    return out


def test_ordered_ops_are_serial_index_order_sums():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 33)), rng.standard_normal((33, 5))
    t = tg.Tape(ordered=True)
    A, B = t.param(a), t.param(b)
    y = A @ B
    assert t._nodes[y.id].op is ordered.matmul
    assert (t.value(y) == serial_matmul(a, b)).all()
    s = A.sum(axis=1)
    want = np.zeros(4)
    for j in range(33):
        want = want + a[:, j]
    assert (t.value(s) == want).all()
    tot = A.mean()
    acc = 0.0
    for v in a.ravel():
        acc = acc + v
    assert float(t.value(tot)) == acc / a.size
    t.backward((y * y).sum())
    g = 2.0 * t.value(y)
    assert (t.grad(A) == serial_matmul(g, b.T)).all() and (t.grad(B) == serial_matmul(a.T, g)).all()


def test_ordered_gradients_match_finite_differences():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    assert tg.gradcheck(lambda t, x, y: (t.apply(ordered.matmul, x, y) ** 2).sum(), a, b).ok
    assert tg.gradcheck(lambda t, x: (t.apply(ordered.sum_, x, None, ((1,), False)) ** 2).sum(), a).ok
    assert tg.gradcheck(lambda t, x: t.apply(ordered.mean, x * x, None, (None, True)).sum(), a).ok


@pytest.mark.parametrize("opt_kind", ["sgd", "adam", "adam_hat_clip_torch"])
@pytest.mark.parametrize("loss", ["mse"])
def test_ordered_mlp_tape_numpy_native_bit_for_bit(opt_kind, loss):
    data = batches(SIZES, 5, 3)
    le, pe = run_eager(data, opt_kind, loss)
    ln, pn, _ = run_program(data, opt_kind, loss, "numpy")
    assert ln == le and all((x == y).all() for x, y in zip(pn, pe))
    lc, pc, prog = run_program(data, opt_kind, loss, "native")
    assert lc == le and all((x == y).all() for x, y in zip(pc, pe))
    # and ordered mode really differs from the default (BLAS/pairwise) somewhere over three steps
    ld, pd = run_eager(data, opt_kind, loss, ordered_mode=False)
    assert np.allclose(ld, le, rtol=1e-12) and any((x != y).any() for x, y in zip(pd, pe))


def test_the_docs_ordered_example_runs():
    from docs_pages import block
    exec(compile(block("exactness.md", "## Ordered mode"), "docs/exactness.md", "exec"), {})


def test_a_variant_is_its_base_entry_with_another_name_summation_and_tier():
    """_variant copies every field of the default entry but those given, and makes the variant exact."""
    def fwd(a, b, s, out, ws):
        out[...] = 0.0
    v = ordered._variant(O.sum, "sum_test_variant", fwd=fwd, doc="a test variant")
    assert v.name == "sum_test_variant" and v.fwd is fwd and v.doc == "a test variant" and v.tier == "exact"
    for f in ("arity", "shape", "da", "db", "ref", "kind", "aliases", "domain", "cases", "inputs", "check"):
        assert getattr(v, f) is getattr(O.sum, f) or getattr(v, f) == getattr(O.sum, f), f
    assert v.data == O.sum.data and "sum_test_variant" not in O.OPS   # not a registry entry of its own
    blas = ordered._variant(O.matmul, "mm_test_variant")
    assert O.matmul.tier == "blas" and blas.tier == "exact" and blas.fwd is O.matmul.fwd and blas.doc == O.matmul.doc
    assert [ordered.order_of(o) for o in (O.matmul, O.sum, O.mean, O.exp, ordered.sum_)] == \
        [ordered.matmul, ordered.sum_, ordered.mean, O.exp, ordered.sum_]
    assert ordered.DEFAULT == {ordered.matmul: O.matmul, ordered.sum_: O.sum, ordered.mean: O.mean}


@pytest.mark.parametrize("axes,keep", [((0, 2), False), ((1,), True), ((0, 1, 2), False), ((2,), False)])
def test_ordered_sum_and_mean_over_several_axes_are_serial_in_row_major_order(axes, keep):
    """Each output element: acc = 0; acc = acc + x over the reduced elements, the reduced index row-major."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((3, 4, 5)) * 10.0 ** rng.integers(-8, 8, (3, 4, 5))   # order matters in the last bits
    kept = [d for d in range(3) if d not in axes]
    want = np.zeros([a.shape[d] for d in kept])
    for out_idx in np.ndindex(*want.shape):
        acc = 0.0
        for red in np.ndindex(*[a.shape[d] for d in axes]):
            idx = [0, 0, 0]
            for d, i in zip(kept, out_idx):
                idx[d] = i
            for d, i in zip(axes, red):
                idx[d] = i
            acc = acc + a[tuple(idx)]
        want[out_idx] = acc
    count = int(np.prod([a.shape[d] for d in axes]))
    shape = tuple(1 if d in axes else a.shape[d] for d in range(3)) if keep else want.shape
    t = tg.Tape(ordered=True)
    x = t.param(a)
    s, m = t.apply(ordered.sum_, x, None, (axes, keep)), t.apply(ordered.mean, x, None, (axes, keep))
    assert t.value(s).shape == shape and np.array_equal(t.value(s).reshape(want.shape), want)
    assert np.array_equal(t.value(m).reshape(want.shape), want / count)
    assert not np.array_equal(want, a.sum(axis=axes)) or len(axes) == 1   # NumPy's pairwise order differs
