"""The index family: data leaves, bad input, exact scatter order, and real models built on it, each
against the same model in jax.numpy through jax.grad and replayed as a native program."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ArgumentError, DTypeError, ShapeError

interop = pytest.importorskip("interop")
from interop import jax, jnp  # noqa: E402

REL = 1e-12   # max |Δgrad| / max |grad| per parameter, tape vs jax.grad (float64)


def rel(got, want):
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max() / max(np.abs(want).max(), 1e-300))


def unchanged(tape):
    n = len(tape)
    return lambda: len(tape) == n


# ── bad input: each a clear error, the tape as it was ────────────────────────

def test_a_float_mask_is_refused_by_name():
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    same = unchanged(tape)
    with pytest.raises(ArgumentError, match=r"^where \(node 1\): argument mask must be a bool mask \(an array or a "
                                            r"data Var\), got a float64 array; convert with np.asarray\(x, bool\)$"):
        tg.where(np.array([1.0, 0.0]), x, 0.0)
    assert same()
    m = tape.const(np.array([1.0, 0.0]))      # a float Var is a mask computed on the tape: select by it
    assert np.array_equal(tape.value(tg.where(m, x, 0.0)), [1.0, 0.0])


def test_indices_out_of_range_are_an_error_not_a_clamp():
    tape = tg.Tape()
    x = tape.param(np.ones((5, 2)))
    same = unchanged(tape)
    with pytest.raises(ShapeError, match=r"^take \(node 2\): index 7 is out of range for an axis of length 5 "
                                         r"\(expected -5 <= index < 5; JAX would clamp"):
        tg.take(x, np.array([1, 7]))
    with pytest.raises(ShapeError, match=r"index -6 is out of range"):
        x[np.array([-6])]
    with pytest.raises(ShapeError, match=r"^index_add \(node \d+\): index 5 is out of range"):
        tg.index_add(x, [5], 1.0)
    assert same()


def test_float_indices_and_data_in_float_ops_are_refused():
    tape = tg.Tape()
    x = tape.param(np.ones(2))
    idx = tape.const(np.array([0, 1]))
    same = unchanged(tape)
    with pytest.raises(ArgumentError, match=r"^take \(node 2\): argument indices must be integer indices \(an array "
                                            r"or a data Var\), got a float64 array"):
        tg.take(x, np.array([0.0, 1.0]))
    with pytest.raises(ArgumentError, match=r"^take \(node 3\): argument b \(node 2\) must be integer data, got a "
                                            r"float Var"):
        tg.take(x, tape.const(np.array([0.0, 1.0])))
    assert len(tape) == 3
    same = unchanged(tape)
    with pytest.raises(ArgumentError, match=r"^add \(node 3\): argument b \(node 1\) must be a float Var, got "
                                            r"integer data; data leaves are not differentiable"):
        x + idx
    with pytest.raises(ArgumentError, match=r"^grad \(node 1\): a data node \(int64 indices or mask\) has no "
                                            r"gradient"):
        tape.grad(idx)
    assert same()


def test_mask_shapes_that_do_not_broadcast():
    tape = tg.Tape()
    x = tape.param(np.ones((2, 3)))
    same = unchanged(tape)
    with pytest.raises(ShapeError, match=r"^where \(node \d+\): shapes \(2, 3\) \(taken where the mask holds\), \(\) "
                                         r"\(elsewhere\) and mask \(4,\) do not broadcast$"):
        tg.where(np.ones(4, bool), x, 0.0)
    assert same()


def test_arithmetic_with_integer_arrays_promotes_as_numpy_does():
    tape = tg.Tape()
    x = tape.param(np.array([1.5, 2.0]))
    assert (x * np.array([2, 3])).value.tolist() == [3.0, 6.0]
    assert (x + np.array([True, False])).value.tolist() == [2.5, 2.0]


def test_set_input_checks_data_slots_and_leaves_the_program_unchanged():
    tape = tg.Tape()
    emb = tape.param(np.arange(10.0).reshape(5, 2))
    ids = tape.const(np.array([0, 3, 3]))
    mask = tape.const(np.array([True, False, True]))
    loss = tg.where(mask, tg.take(emb, ids).sum(axis=1), 0.0).sum()
    prog = tg.capture(tape, loss)
    before = prog.value(ids).copy()
    with pytest.raises(ShapeError, match=r"^set_input \(node 1\): data node 1 does not fit take \(node 3\): index 5 "
                                         r"is out of range for an axis of length 5"):
        prog.set_input(ids, np.array([0, 5, 1]))
    with pytest.raises(DTypeError, match=r"^set_input \(node 1\): expected integer data for data node 1, got float64"):
        prog.set_input(ids, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ShapeError, match=r"^set_input \(node 1\): expected shape \(3,\) for data node 1, got \(2,\)"):
        prog.set_input(ids, np.array([0, 1]))
    with pytest.raises(DTypeError, match=r"^set_input \(node 2\): expected bool data for data node 2, got int64"):
        prog.set_input(mask, np.array([1, 0, 1]))
    assert np.array_equal(prog.value(ids), before)
    prog.set_input(ids, np.array([4, -1, 0]))
    prog.set_input(mask, np.array([False, True, True]))
    assert float(prog.forward()) == 17.0 + 1.0     # rows 4, 4, 0 (sums 17, 17, 1), the first masked out


def test_poison_mode_keeps_going_with_the_first_reason():
    tape = tg.Tape(on_error="poison")
    x = tape.param(np.ones(3))
    y = tg.take(x, np.array([9]))
    z = (y * 2.0).sum()
    assert not tape.ok and z.id < 0 and "index 9 is out of range" in str(tape.error)
    assert tape.backward(z) is False


# ── order and exactness ──────────────────────────────────────────────────────

def test_scatter_add_sums_in_index_order_on_every_backend():
    """1e16 + 1 − 1e16 depends on the order: every backend adds in increasing index position."""
    tape = tg.Tape()
    x = tape.param(np.zeros(2))
    v = tape.param(np.array([1e16, 1.0, -1e16, 3.0]))
    y = tg.index_add(x, np.array([0, 0, 0, 1]), v)
    loss = (tg.take(y, np.array([0, 0, 0])) * np.array([1e16, 1.0, -1e16])).sum()
    tape.backward(loss)
    want = ((0.0 + 1e16) + 1.0) + -1e16
    assert tape.value(y).tolist() == [want, 3.0]
    gx = ((0.0 + 1e16) + 1.0) + -1e16
    assert tape.grad(x).tolist() == [gx, 0.0]
    for backend in ("numpy", "native"):
        prog = tg.capture(tape, loss, backend=backend)
        prog.forward()
        prog.backward()
        assert np.array_equal(prog.value(y), tape.value(y)) and np.array_equal(prog.grad(x), tape.grad(x))
        assert np.array_equal(prog.grad(v), tape.grad(v))


def test_index_set_keeps_the_last_write_and_its_gradient():
    tape = tg.Tape()
    x = tape.param(np.zeros(3))
    v = tape.param(np.array([1.0, 2.0, 3.0]))
    y = tg.index_set(x, [2, 0, 2], v)
    loss = (y * np.array([10.0, 20.0, 30.0])).sum()
    tape.backward(loss)
    assert tape.value(y).tolist() == [2.0, 0.0, 3.0]
    assert tape.grad(v).tolist() == [0.0, 10.0, 30.0] and tape.grad(x).tolist() == [0.0, 20.0, 0.0]
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.grad(v), tape.grad(v)) and np.array_equal(prog.grad(x), tape.grad(x))


def test_strided_slices_flip_split_stack():
    tape = tg.Tape()
    a = np.arange(24.0).reshape(4, 6)
    x = tape.param(a)
    assert np.array_equal(x[::2, ::-3].value, a[::2, ::-3])
    assert np.array_equal(x[..., None, 1].value, a[..., None, 1])
    assert np.array_equal(tg.flip(x, 1).value, np.flip(a, 1)) and np.array_equal(tg.flip(x).value, np.flip(a))
    parts = tg.split(x, [1, 4], axis=1)
    assert [p.shape for p in parts] == [(4, 1), (4, 3), (4, 2)]
    s = tg.stack(parts[:1] * 3, axis=0)
    assert s.shape == (3, 4, 1)
    loss = (s.sum() + tg.flip(x, 0)[1:, ::2].square().sum())
    tape.backward(loss)
    f = lambda a: jnp.sum(jnp.stack([a[:, :1]] * 3)) + jnp.sum(jnp.flip(a, 0)[1:, ::2] ** 2)  # noqa: E731
    assert rel(tape.grad(x), jax.grad(f)(jnp.asarray(a))) == 0.0
    prog = tg.capture(tape, loss, backend="native")
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.grad(x), tape.grad(x))


# ── models on the tape vs jax.grad, and replayed natively ────────────────────

def check_model(build_tape, jax_loss, params, data, native_bound=1e-13):
    """Tape gradients vs jax.grad (≤ REL), finite differences on the tape, and the native program vs
    the tape (== for exact-tier graphs, else within ``native_bound`` relative)."""
    tape = tg.Tape()
    ps = [tape.param(p) for p in params]
    loss = build_tape(tape, ps, data)
    tape.backward(loss)
    want_loss, want = jax.value_and_grad(jax_loss)([jnp.asarray(p) for p in params], data)
    assert rel(tape.value(loss), want_loss) <= REL
    for p, w in zip(ps, want):
        assert rel(tape.grad(p), w) <= REL, rel(tape.grad(p), w)
    report = tg.gradcheck(lambda t, *xs: build_tape(t, list(xs), data), *params, directions=2)
    assert report.ok, report
    for fuse in (False, True):
        prog = tg.capture(tape, loss, backend="native", fuse=fuse)
        prog.forward()
        prog.backward()
        assert rel(prog.loss(), tape.value(loss)) <= native_bound
        for p in ps:
            assert rel(prog.grad(p), tape.grad(p)) <= native_bound
    return tape, ps, loss


def test_embedding_bag_classifier_with_integer_labels():
    rng = np.random.default_rng(0)
    V, d, C, B, L = 11, 4, 3, 6, 5
    params = [rng.standard_normal((V, d)) * 0.5, rng.standard_normal((d, C)) * 0.5, np.zeros(C)]
    ids, labels = rng.integers(0, V, (B, L)), rng.integers(0, C, B)

    def on_tape(tape, ps, data):
        E, W, b = ps
        bag = tg.take(E, data[0]).mean(axis=1)                  # (B, d): the mean embedding of each bag
        logp = (bag @ W + b).log_softmax(axis=1)
        return -tg.take_along_axis(logp, data[1][:, None], axis=1).mean()

    def in_jax(ps, data):
        E, W, b = ps
        logits = E[data[0]].mean(axis=1) @ W + b
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), data[1][:, None], axis=1))
    check_model(on_tape, in_jax, params, (ids, labels))


def test_masked_causal_attention_with_minus_inf():
    rng = np.random.default_rng(1)
    T, d = 5, 4
    params = [rng.standard_normal((d, d)) * 0.5 for _ in range(3)]
    x, target = rng.standard_normal((T, d)), rng.standard_normal((T, d))
    causal = np.tril(np.ones((T, T), bool))

    def on_tape(tape, ps, data):
        Wq, Wk, Wv = ps
        X = tape.const(data[0])
        scores = (X @ Wq) @ (X @ Wk).T / np.sqrt(d)
        att = tg.where(causal, scores, -np.inf).softmax(axis=1)
        return tg.mse(att @ (X @ Wv), data[1])

    def in_jax(ps, data):
        Wq, Wk, Wv = ps
        X = data[0]
        scores = (X @ Wq) @ (X @ Wk).T / np.sqrt(d)
        att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=1)
        return jnp.mean((att @ (X @ Wv) - data[1]) ** 2)
    check_model(on_tape, in_jax, params, (x, target))


def test_gru_unrolled_by_a_python_loop_matches_lax_scan():
    """Loops need no op: the Python loop records the unrolled recurrence; JAX runs it under lax.scan."""
    rng = np.random.default_rng(2)
    T, B, n, h = 6, 3, 4, 5
    params = [rng.standard_normal(s) * 0.4 for s in ((n, 3 * h), (h, 3 * h), (3 * h,), (h, 2))]
    xs, ys = rng.standard_normal((T, B, n)), rng.standard_normal((B, 2))

    def on_tape(tape, ps, data):
        Wx, Wh, b, Wo = ps
        H = tape.const(np.zeros((B, h)))
        for t in range(T):
            gx, gh = tape.const(data[0][t]) @ Wx + b, H @ Wh
            z = (gx[:, :h] + gh[:, :h]).sigmoid()
            r = (gx[:, h:2 * h] + gh[:, h:2 * h]).sigmoid()
            cand = (gx[:, 2 * h:] + r * gh[:, 2 * h:]).tanh()
            H = (1.0 - z) * H + z * cand
        return tg.mse(H @ Wo, data[1])

    def in_jax(ps, data):
        Wx, Wh, b, Wo = ps

        def cell(H, x):
            gx, gh = x @ Wx + b, H @ Wh
            z = jax.nn.sigmoid(gx[:, :h] + gh[:, :h])
            r = jax.nn.sigmoid(gx[:, h:2 * h] + gh[:, h:2 * h])
            cand = jnp.tanh(gx[:, 2 * h:] + r * gh[:, 2 * h:])
            return (1.0 - z) * H + z * cand, None
        H, _ = jax.lax.scan(cell, jnp.zeros((B, h)), data[0])
        return jnp.mean((H @ Wo - data[1]) ** 2)
    check_model(on_tape, in_jax, params, (xs, ys), native_bound=1e-12)


def test_graph_convolution_with_scatter_add():
    rng = np.random.default_rng(3)
    N, E, f, h = 7, 16, 3, 4
    params = [rng.standard_normal((f, h)) * 0.5, rng.standard_normal((h, 1)) * 0.5]
    feats, y = rng.standard_normal((N, f)), rng.standard_normal((N, 1))
    src, dst = rng.integers(0, N, E), rng.integers(0, N, E)
    deg = np.maximum(np.bincount(dst, minlength=N), 1).astype(float)[:, None]

    def on_tape(tape, ps, data):
        W1, W2 = ps
        msg = tg.take(tape.const(data[0]) @ W1, src)                        # (E, h) messages from sources
        agg = tg.index_add(tape.const(np.zeros((N, h))), dst, msg) / deg    # summed at the destinations
        return tg.mse(agg.relu() @ W2, data[1])

    def in_jax(ps, data):
        W1, W2 = ps
        agg = jax.ops.segment_sum((data[0] @ W1)[src], dst, num_segments=N) / deg
        return jnp.mean((jax.nn.relu(agg) @ W2 - data[1]) ** 2)
    check_model(on_tape, in_jax, params, (feats, y))


def test_cnn_with_integer_labels():
    """conv + relu + max pool + dense, cross-entropy on integer labels (take_along_axis)."""
    rng = np.random.default_rng(4)
    params = [rng.standard_normal((4, 1, 3, 3)) / 3, rng.standard_normal((1, 4, 1, 1)) * 0.1,
              rng.standard_normal((100, 3)) / 10, np.zeros(3)]
    x, labels = rng.standard_normal((5, 1, 12, 12)), rng.integers(0, 3, (5, 1))

    def on_tape(tape, ps, data):
        w1, b1, w2, b2 = ps
        h = tg.max_pool((tg.conv(tape.const(data[0]), w1) + b1).relu(), 2, layout="NCHW")   # (5, 4, 5, 5)
        logp = (h.reshape(5, 100) @ w2 + b2).log_softmax(axis=1)
        return -tg.take_along_axis(logp, data[1], axis=1).mean()

    def in_jax(ps, data):
        w1, b1, w2, b2 = ps
        h = jax.lax.conv_general_dilated(data[0], w1, (1, 1), "VALID", precision=jax.lax.Precision.HIGHEST)
        h = jax.lax.reduce_window(jax.nn.relu(h + b1), -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        logp = jax.nn.log_softmax(h.reshape(5, 100) @ w2 + b2, axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, data[1], axis=1))
    check_model(on_tape, in_jax, params, (x, labels))


def test_data_slots_are_part_of_the_program_inside_jax_jit():
    """A fixed mask or index table stays in the program; the call's inputs are its float constants."""
    tape = tg.Tape()
    E = tape.param(np.arange(8.0).reshape(4, 2))
    w = tape.const(np.ones(2))
    loss = (tg.take(E, np.array([0, 3])) * w).sum()
    prog = tg.capture(tape, loss, backend="native")
    f = interop.program_call(prog)
    with jax.enable_x64(True):
        value, g = jax.jit(jax.value_and_grad(f))(jnp.asarray(prog.value(E)), jnp.ones(2))
    assert float(value) == 0 + 1 + 6 + 7
    assert np.asarray(g).tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(interop.ProgramError, match=r"expected 1 inputs arrays"):
        f(jnp.asarray(prog.value(E)), jnp.ones(2), jnp.array([0, 3]))
