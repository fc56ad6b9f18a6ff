"""The tape: errors that name who failed and leave the tape as it was, poison mode, episodes, anomalies."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O


def snapshot(tape):
    """Everything a failed op must leave untouched."""
    return (tape.nodes, [None if v is None else v.copy() for v in tape._val], tape._vals.pos, tape._params.pos,
            dict(tape._kept))


def assert_unchanged(tape, before):
    nodes, vals, vpos, ppos, kept = before
    assert tape.nodes == nodes and tape._kept == kept
    assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(vals, tape._val))
    assert len(vals) == len(tape._val)
    assert (tape._vals.pos, tape._params.pos) == (vpos, ppos)


@pytest.fixture
def tape():
    t = tg.Tape()
    t.x = t.param(np.ones((2, 4)))
    t.y = t.param(np.ones(3))
    return t


BAD = [
    ("broadcast", lambda t: t.x + t.y, tg.ShapeError, "add (node 2): shapes (2, 4) and (3,) do not broadcast"),
    ("matmul", lambda t: t.x @ t.x, tg.ShapeError, "matmul (node 2): inner dimensions differ: (2, 4) @ (2, 4) (4 != 2)"),
    ("axis", lambda t: t.x.sum(axis=2), tg.ShapeError, "sum (node 2): axis 2 is out of range for an input of shape (2, 4)"),
    ("softmax axis", lambda t: t.x.softmax(axis=-3), tg.ShapeError, "softmax (node 2): axis -3 is out of range"),
    ("reshape", lambda t: t.x.reshape(3, 3), tg.ShapeError, "reshape (node 2): cannot reshape (2, 4) (8 elements) into (3, 3)"),
    ("transpose", lambda t: t.x.transpose((0, 0)), tg.ShapeError, "transpose (node 2): axes (0, 0) are not a permutation"),
    ("slice", lambda t: t.x[1:1], tg.ShapeError, "slice (node 2): axis 0: range 1:1 is empty"),
    ("concat", lambda t: tg.concat([t.x, t.y], axis=0), tg.ShapeError, "concat (node 2): shapes (2, 4) and (3,) cannot be joined"),
    ("dtype", lambda t: t.param(np.arange(3)), tg.DTypeError, "param (node 2): expected float32 or float64 data, got int64"),
    ("not a var", lambda t: t.apply(O.add, np.ones(4), t.x), tg.TapeError, "add (node 2): argument a must be a Var, got ndarray"),
    ("other tape", lambda t: t.x + tg.Tape().param(np.ones(4)), tg.ForeignVarError,
     "add (node 2): argument b (node 0) belongs to another tape"),
    ("xent shapes", lambda t: tg.softmax_cross_entropy(t.x, np.ones((2, 3))), tg.ShapeError,
     "softmax_xent (node 3): logits (2, 4) and targets (2, 3) must have the same shape"),
]


@pytest.mark.parametrize("name,bad,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_named_error_and_changes_nothing(tape, name, bad, exc, message):
    before = snapshot(tape)
    with pytest.raises(exc) as info:
        bad(tape)
    assert message in str(info.value)
    if before is not None:
        assert_unchanged(tape, before)
    z = (tape.x * 2.0).sum()  # the tape still works
    assert tape.backward(z) and np.array_equal(tape.grad(tape.x), np.full((2, 4), 2.0))


def test_error_family_subclasses_builtin_exceptions():
    assert issubclass(tg.ShapeError, ValueError) and issubclass(tg.DTypeError, TypeError)
    assert issubclass(tg.ForeignVarError, ValueError) and issubclass(tg.NonFiniteError, FloatingPointError)
    with pytest.raises(tg.DTypeError, match="Tape: dtype must be float64 or float32, got int32"):
        tg.Tape(np.int32)


def test_stale_var_after_reset_is_refused(tape):
    m = tape.mark()
    old = tape.x * 3.0
    tape.reset_to(m)
    fresh = tape.x * 5.0  # reuses node id 2
    assert fresh.id == old.id
    before = snapshot(tape)
    with pytest.raises(tg.ForeignVarError, match=r"mul \(node 3\): argument a \(node 2\) was dropped by reset_to"):
        old * old
    assert_unchanged(tape, before)
    with pytest.raises(tg.ForeignVarError, match="dropped by reset_to"):
        tape.value(old)


def test_non_scalar_backward_needs_a_seed(tape):
    before = snapshot(tape)
    with pytest.raises(tg.ShapeError, match=r"backward \(node 0\): expected a scalar loss \(one element\), got shape \(2, 4\)"):
        tape.backward(tape.x)
    assert_unchanged(tape, before)
    with pytest.raises(tg.ShapeError, match=r"seed must have the loss's shape \(2, 4\), got \(4,\)"):
        tape.backward(tape.x, seed=np.ones(4))
    assert tape.backward(tape.x, seed=np.full((2, 4), 3.0))
    assert np.array_equal(tape.grad(tape.x), np.full((2, 4), 3.0))


def test_poison_mode_keeps_returning_and_keeps_the_first_reason():
    tape = tg.Tape(on_error="poison")
    x, y = tape.param(np.ones((2, 4))), tape.param(np.ones(3))
    bad = x + y
    worse = (bad * 2.0).reshape(7)
    also = x.sum(axis=9)
    assert not tape.ok
    assert isinstance(tape.error, tg.ShapeError) and "add (node 2)" in str(tape.error)
    assert repr(bad) == "<Var poisoned>" and repr(worse) == repr(also) == "<Var poisoned>"
    assert len(tape) == 2
    assert tape.backward(x.sum()) is False


def test_values_and_grads_are_read_only_aligned_views(tape):
    z = (tape.x @ tape.param(np.ones((4, 5)))).relu().sum()
    tape.backward(z)
    for i in range(len(tape)):
        v = tape.value(tg.Var(tape, i, 0))
        g = tape.grad(tg.Var(tape, i, 0))
        for a in (v, g):
            assert not a.flags.writeable
            assert a.__array_interface__["data"][0] % 64 == 0
    with pytest.raises(ValueError):
        tape.value(tape.x)[0, 0] = 1.0


def test_reset_reuses_buffers_and_zeroes_gradients():
    tape = tg.Tape()
    w = tape.param(np.full((3, 2), 0.5))
    start = tape.mark()
    ptrs = []
    for _ in range(3):
        x = tape.const(np.arange(12.0).reshape(4, 3))
        h = (x @ w).tanh()
        loss = (h * h).mean()
        tape.backward(loss)
        ptrs.append([tape.value(v).__array_interface__["data"][0] for v in (x, h, loss)]
                    + [tape.grad(h).__array_interface__["data"][0]])
        slabs = [id(s) for s in tape._vals.slabs + tape._grads.slabs]
        assert tape.touched(w) and np.abs(tape.grad(w)).sum() > 0
        tape.reset_to(start)
        assert len(tape) == start and not tape.touched(w)
        assert np.array_equal(tape.grad(w), np.zeros((3, 2)))
    assert ptrs[1] == ptrs[2]  # the steady state reuses every buffer
    assert slabs == [id(s) for s in tape._vals.slabs + tape._grads.slabs]


def test_kept_buffers_belong_to_their_node_and_survive_only_with_it():
    """softmax_xent's forward keeps exp(a − max) and its row sums for its backward (``Op.keep``). Two
    losses in one episode read their own; a reset to the mark just before the second drops its buffers
    while the first keeps its own; values and gradients (the targets' too: a parameter at node 0) equal
    those of a fresh tape recording the same losses, bit for bit."""
    rng = np.random.default_rng(5)
    w0, u0 = rng.standard_normal((3, 4)), rng.uniform(0.0, 1.0, (3, 4))
    t2, t3 = rng.uniform(0.0, 1.0, (4, 3)), np.eye(3)[[2, 0, 1, 1]]

    def first_and_last(tape, u, w):
        return tg.softmax_cross_entropy(w * 2.0, u), tg.softmax_cross_entropy(((w * 3.0).T + 0.0) * 1.0, t3)

    tape = tg.Tape()
    u = tape.param(u0)        # node 0: the first loss's targets, trained too
    w = tape.param(w0)
    start = tape.mark()
    for ep in range(3):
        l1 = tg.softmax_cross_entropy(w * 2.0, u)
        logits, targets = w.T - 1.0, tape.const(t2)
        mid = tape.mark()
        tape.backward(tg.softmax_cross_entropy(logits, targets, axis=0) * 0.5)   # node mid keeps buffers
        tape.reset_to(mid)                      # the second loss goes; the first and its buffers stay
        l3 = tg.softmax_cross_entropy(((w * 3.0).T + 0.0) * 1.0, t3)
        assert sorted(tape._kept) == [l1.id, l3.id]
        assert tape.backward(l1 + l3)
        fresh = tg.Tape()
        fu, fw = fresh.param(u0), fresh.param(w0)
        f1, f3 = first_and_last(fresh, fu, fw)
        assert fresh.backward(f1 + f3)
        assert np.array_equal(tape.grad(w), fresh.grad(fw)), ep
        assert np.array_equal(tape.grad(u), fresh.grad(fu)) and tape.touched(u), ep
        assert np.array_equal(tape.value(l1), fresh.value(f1))
        tape.reset_to(start)


def test_the_source_memo_refills_with_the_same_answers():
    """The frame walk behind each node's source memoizes, per code object, whether it is tapegrad's own;
    emptied, it fills again with the same answers, under each code's own id."""
    from tapegrad import tape as T
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    (x * 2.0).sum()
    before = dict(T._OURS)
    T._OURS.clear()
    y = (x * 2.0).sum()
    code = tape.nodes[y.id].src[0]
    assert T._OURS[id(code)] == (code, False) and not code.co_filename.startswith(T._PKG)
    assert all(T._OURS[k] == v for k, v in before.items() if k in T._OURS)
    T._OURS.update(before)


def test_second_backward_accumulates_leaf_gradients():
    tape = tg.Tape()
    x = tape.param(np.array([1.0, 2.0]))
    y = (x * x * 3.0).sum()
    tape.backward(y)
    tape.backward(y)
    assert np.array_equal(tape.grad(x), 2 * (6.0 * np.array([1.0, 2.0])))


def test_a_100k_node_chain_needs_no_recursion():
    tape = tg.Tape()
    x = tape.param(np.array([0.25]))
    y = x
    for _ in range(50_000):
        y = (y + 1.0) * 1.0
    assert len(tape) == 100_001
    assert tape.backward(y.sum())
    assert tape.grad(x)[0] == 1.0 and tape.value(y)[0] == 50_000.25


def test_check_finite_names_the_first_bad_node_and_its_line():
    tape = tg.Tape(check_finite=True)
    x = tape.param(np.array([1.0, -1.0]))
    before = snapshot(tape)
    with pytest.raises(tg.NonFiniteError, match=r"log \(node 1\): first non-finite value, inputs \(\(2,\),\), "
                                                r"created at test_tape.py:\d+"), np.errstate(invalid="ignore"):
        x.log()
    assert_unchanged(tape, before)


def test_a_refused_loss_keeps_no_buffers():
    """check_finite refuses a loss that overflows after its forward filled the buffers it keeps
    (Op.keep): the tape is left as it was, kept buffers included, and the next loss is recorded."""
    tape = tg.Tape(check_finite=True)
    z = tape.param(np.array([[1.0, 2.0], [0.5, -1.0]]))
    good = tg.softmax_cross_entropy(z, np.eye(2))
    huge, targets = tape.const(np.array([[1e308, -1e308], [0.0, 1.0]])), tape.const(np.eye(2)[::-1])
    before = snapshot(tape)
    with pytest.raises(tg.NonFiniteError, match=r"^softmax_xent \(node 5\): first non-finite value, inputs "
                                                r"\(\(2, 2\), \(2, 2\)\)"), np.errstate(over="ignore"):
        tg.softmax_cross_entropy(huge, targets)    # a − max overflows to −inf for the target's class
    assert_unchanged(tape, before)
    assert tape.backward(good + tg.softmax_cross_entropy(z * 2.0, targets))
    assert sorted(tape._kept) == [good.id, len(tape) - 2]


def test_first_nonfinite_finds_values_then_gradients():
    tape = tg.Tape()
    x = tape.param(np.array([0.0, 4.0]))
    r = x.sqrt()
    loss = r.sum()
    assert tape.first_nonfinite() is None
    with np.errstate(divide="ignore"):
        tape.backward(loss)
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind) == (0, "param", "grad")
    assert bad.where.startswith("test_tape.py:")
    with np.errstate(divide="ignore"):
        z = (x.log() * 2.0).sum()
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.kind, bad.input_shapes) == (z.id - 2, "log", "value", ((2,),))
    strict = tg.Tape(check_finite=True)
    s = strict.param(np.array([0.0, 4.0]))
    with pytest.raises(tg.NonFiniteError, match=r"param \(node 0\): first non-finite grad"), np.errstate(divide="ignore"):
        strict.backward(s.sqrt().sum())


def test_lazy_constants_record_shapes_but_have_no_values():
    tape = tg.Tape()
    w = tape.param(np.ones((3, 2)))
    frozen = tape.const_lazy((4, 3))
    out = (frozen @ w).relu().sum()
    assert out.shape == () and (frozen @ w).shape == (4, 2)
    with pytest.raises(tg.LazyValueError, match=r"relu \(node \d+\): has no value on the tape: it depends on the lazy "
                                                r"constant node 1"):
        tape.value(tape.nodes and tg.Var(tape, out.id - 1, 0))
    with pytest.raises(tg.LazyValueError, match="has no gradient on the tape"):
        tape.backward(out)


def test_drop_consts_frees_host_values_of_frozen_constants():
    tape = tg.Tape()
    big = tape.const(np.ones((256, 256)))
    w = tape.param(np.ones((256, 2)))
    start = tape.mark()
    assert tape.drop_consts() == 256 * 256 * 8
    assert tape._val[big.id] is None and tape._val[w.id] is not None
    with pytest.raises(tg.LazyValueError, match="dropped \\(drop_consts\\) constant node 0"):
        tape.value(big @ w)
    tape.reset_to(start)


def test_float32_tapes_keep_float32():
    tape = tg.Tape(np.float32)
    x = tape.param(np.array([1.0, 2.0]))
    y = (x * 3.0).sigmoid().sum()
    tape.backward(y)
    assert tape.value(y).dtype == np.float32 and tape.grad(x).dtype == np.float32
    assert tg.gradcheck(lambda t, x: (x * 3.0).sigmoid().sum(), np.array([1.0, 2.0])).ok


def test_gradcheck_catches_a_wrong_rule_and_names_the_input():
    wrong = O.Op("wrong_sin", 1, O.same, fwd=lambda a, b, s, out, ws: np.sin(a, out=out),
                 da=lambda g, out, a, b, s, ws: g * np.sin(a))
    report = tg.gradcheck(lambda t, x, y: (t.apply(wrong, x) + y * y).sum(), np.linspace(0.1, 1, 4), np.ones(4))
    assert not report.ok and report.worst == 0
    assert report.errors[1] < 1e-8 and report.errors[0] > 1e-2
    assert "FAILED: worst input 0" in str(report)


def test_operators_and_methods_match_numpy():
    rng = np.random.default_rng(5)
    a_np, b_np = rng.uniform(0.5, 2.0, (3, 4)), rng.uniform(0.5, 2.0, 4)
    tape = tg.Tape()
    a, b = tape.param(a_np), tape.param(b_np)
    cases = [
        (a + b, a_np + b_np), (2.0 - a, 2.0 - a_np), (a - 1.5, a_np - 1.5), (3 * a, 3 * a_np),
        (a / b, a_np / b_np), (1.0 / a, 1.0 / a_np), (a / 4.0, a_np / 4.0), (a ** 3, a_np ** 3),
        (a ** 2, a_np * a_np), (-a, -a_np), (b_np + a, b_np + a_np), (a @ a.T, a_np @ a_np.T),
        (a[1:3, :2], a_np[1:3, :2]), (a.sum(axis=0), a_np.sum(axis=0)), (a.max(axis=1, keepdims=True),
        a_np.max(axis=1, keepdims=True)), (a.reshape(-1), a_np.reshape(-1)), (abs(a - 1.0), np.abs(a_np - 1.0)),
        (tg.maximum(a, b), np.maximum(a_np, b_np)), (tg.concat([a, a], axis=1), np.concatenate([a_np, a_np], 1)),
        (tg.broadcast_to(b, (2, 4)), np.broadcast_to(b_np, (2, 4))), (a.transpose((1, 0)), a_np.T),
        (tg.mse(a, b), np.mean((a_np - b_np) ** 2)),
    ]
    for var, want in cases:
        np.testing.assert_allclose(tape.value(var), want, rtol=1e-15, err_msg=repr(var))


def test_sources_false_skips_the_frame_lookup_and_says_so():
    tape = tg.Tape(sources=False)
    x = tape.param(np.array([-1.0]))
    with np.errstate(invalid="ignore"):
        x.sqrt()
    bad = tape.first_nonfinite()
    assert (bad.node, bad.op, bad.where) == (1, "sqrt", "?")


def test_parameters_created_inside_an_episode_give_their_memory_back():
    tape = tg.Tape()
    w = tape.param(np.ones(3))
    start = tape.mark()
    homes = []
    for k in range(3):
        v = tape.param(np.full(5, float(k)))
        tape.backward((v * w.sum()).sum())
        assert np.array_equal(tape.grad(v), np.full(5, 3.0))
        homes.append(tape.value(v).__array_interface__["data"][0])
        tape.reset_to(start)
    assert homes[0] == homes[1] == homes[2]
    assert np.array_equal(tape.value(w), np.ones(3)) and tape._params.pos == tape.nodes[0].pos[:1] + (8,)


def test_first_nonfinite_reports_the_exact_line_of_each_creating_call():
    """The source is kept as (code, bytecode offset) and turned into a line only when reported."""
    import inspect
    tape = tg.Tape()
    x = tape.param(np.array([-1.0, 4.0]))
    here = inspect.currentframe().f_lineno
    with np.errstate(invalid="ignore"):
        y = x * 2.0                       # here + 2: finite
        z = (y
             .sqrt())                     # here + 4 (the call's line): nan
    assert tape.first_nonfinite().where == f"test_tape.py:{here + 4}"
    assert (tape.first_nonfinite().node, z.id) == (y.id + 1, y.id + 1)
    lean = tg.Tape(sources=False)
    w = lean.param(np.array([-1.0]))
    with np.errstate(invalid="ignore"):
        w.sqrt()
    assert lean.first_nonfinite().where == "?"


def test_the_seed_of_a_scalar_loss_is_copied_into_the_tapes_own_gradient():
    """backward's default seed (ones, cached per shape) is copied, never adopted: two tapes' loss
    gradients share no memory, and accumulating into one leaves the next seed at one."""
    tapes = [tg.Tape(), tg.Tape()]
    losses = [(t.param(np.ones(3)) * 2.0).sum() for t in tapes]
    for t, y in zip(tapes, losses):
        assert t.backward(y)
    assert not np.shares_memory(tapes[0].grad(losses[0]), tapes[1].grad(losses[1]))
    assert tapes[0].backward(losses[0]) and float(tapes[0].grad(losses[0])) == 1.0   # (the latest pass)
    third = tg.Tape()
    y = (third.param(np.ones(3)) * 2.0).sum()
    assert third.backward(y) and float(third.grad(y)) == 1.0
