"""Convolution and pooling: lax.conv_general_dilated / reduce_window values and VJPs over strides, padding,
dilations, groups and layouts; max pooling's first-maximum tie rule; bad input; a small CNN against
jax.grad, captured and replayed natively."""
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.native.kernels.conv import conv_tables
from tapegrad.ops.conv import geometry

from test_tape import assert_unchanged, snapshot

interop = pytest.importorskip("interop")
from interop import jax, jnp  # noqa: E402
from jax import lax  # noqa: E402

RTOL = 1e-12


def rel(got, want):
    """max|got − want| / max|want| (normwise, the bound of the oracle suite)."""
    want = np.asarray(want)
    return np.abs(np.asarray(got) - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-300)


def dnums(layout, nd):
    sp = "DHW"[3 - (nd - 2):]
    return ("N" + sp + "C", sp + "IO", "N" + sp + "C") if layout == "NHWC" else ("NC" + sp, "OI" + sp, "NC" + sp)


# (x shape, w shape, tg.conv keyword arguments); padding strings are handed to lax unresolved, so the
# comparison also checks tg.conv's SAME/SAME_LOWER resolution.
SWEEP = [
    ((2, 3, 9), (4, 3, 3), dict(stride=2, padding="SAME")),
    ((2, 3, 9), (4, 3, 4), dict(padding="SAME_LOWER", rhs_dilation=2)),
    ((1, 9, 2), (3, 2, 4), dict(layout="NWC", stride=3, padding=((2, 1),))),
    ((2, 2, 7, 6), (3, 2, 3, 3), dict(stride=(2, 1), padding="SAME")),
    ((2, 2, 7, 6), (3, 2, 2, 3), dict(padding=((0, 2), (1, 1)), lhs_dilation=(2, 1), rhs_dilation=(1, 2))),
    ((2, 6, 5, 5), (6, 2, 3, 3), dict(groups=3, padding="SAME")),
    ((2, 6, 5, 5), (6, 1, 3, 3), dict(groups=6, padding="VALID", stride=2)),                 # depthwise
    ((3, 5, 6, 4), (3, 3, 4, 5), dict(layout="NHWC", padding="SAME", stride=(1, 2))),
    ((2, 5, 6, 4), (2, 2, 2, 6), dict(layout="NHWC", groups=2, padding=((1, 0), (0, 1)), rhs_dilation=2)),
    ((2, 5, 5, 6), (3, 3, 2, 6), dict(layout="NHWC", groups=3, lhs_dilation=(1, 2), padding=((1, 1), (0, 0)))),
    ((1, 2, 4, 5, 3), (3, 2, 2, 3, 2), dict(stride=(1, 2, 1), padding="SAME")),
    ((2, 4, 3, 5, 4), (2, 2, 2, 2, 4), dict(layout="NDHWC", groups=2, padding="VALID")),
]


@pytest.mark.parametrize("xs,ws,kw", SWEEP, ids=[str(i) for i in range(len(SWEEP))])
def test_conv_matches_lax_values_and_vjp(xs, ws, kw):
    rng = np.random.default_rng(len(xs) * 100 + sum(ws))
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    tape = tg.Tape()
    vx, vw = tape.param(x), tape.param(w)
    y = tg.conv(vx, vw, **kw)
    g = rng.standard_normal(y.shape)
    tape.backward(y, seed=g)
    layout = {"NWC": "NHWC", "NDHWC": "NHWC"}.get(kw.get("layout"), kw.get("layout", "NCHW"))
    nsp = len(xs) - 2
    per = lambda v: (v,) * nsp if isinstance(v, int) else v   # noqa: E731

    def ref(x, w):
        return lax.conv_general_dilated(x, w, per(kw.get("stride", 1)), kw.get("padding", "VALID"),
                                        per(kw.get("lhs_dilation", 1)), per(kw.get("rhs_dilation", 1)),
                                        dnums(layout, len(xs)), feature_group_count=kw.get("groups", 1),
                                        precision=lax.Precision.HIGHEST)
    want, (dx, dw) = jax.jit(lambda x, w, g: (ref(x, w), jax.vjp(ref, x, w)[1](g)))(x, w, g)
    assert tape.value(y).shape == want.shape
    assert rel(tape.value(y), want) <= RTOL
    assert rel(tape.grad(vx), dx) <= RTOL
    assert rel(tape.grad(vw), dw) <= RTOL


@pytest.mark.parametrize("xs,ws,kw", SWEEP[3:6], ids=["stride", "dilations", "groups"])
def test_conv_vjp_matches_finite_differences(xs, ws, kw):
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    probe = None

    def f(tape, vx, vw):
        nonlocal probe
        y = tg.conv(vx, vw, **kw)
        probe = rng.standard_normal(y.shape) if probe is None else probe
        return (y * tape.const(probe)).sum()
    assert tg.gradcheck(f, x, w, directions=3).ok


def test_im2col_tables_read_padding_and_dilation_holes_as_minus_one():
    geo = geometry((1, 1, 3), (1, 1, 2), ("NCHW", (1,), ((1, 1),), (2,), (2,), 1))
    # padded+dilated input: [pad, x0, hole, x1, hole, x2, pad]; kernel taps at offsets 0 and 2; 5 outputs
    assert geo.out == (5,)
    assert conv_tables(geo)[1] == [-1, 0, -1, 1, -1] + [-1, 1, -1, 2, -1]


# ── pooling ──────────────────────────────────────────────────────────────────

POOLS = [((2, 3, 6, 7), (2, 2), None, "VALID", "NCHW"),
         ((2, 7, 6, 3), (3, 3), (2, 2), "SAME", "NHWC"),
         ((2, 7, 5, 3), (3, 2), (1, 2), ((1, 1), (0, 1)), "NHWC"),
         ((5, 8), (2, 3), (2, 1), "SAME_LOWER", None)]


def full(v, nd, layout):
    if layout is None:
        return v
    return (1,) + tuple(v) + (1,) if layout == "NHWC" else (1, 1) + tuple(v)


@pytest.mark.parametrize("xs,win,st,pad,layout", POOLS, ids=[str(i) for i in range(len(POOLS))])
@pytest.mark.parametrize("kind", ["max", "sum", "avg"])
def test_pooling_matches_reduce_window_and_its_vjp(kind, xs, win, st, pad, layout):
    """Integer-valued inputs: max pooling meets ties in nearly every window."""
    rng = np.random.default_rng(11)
    x = rng.integers(-2, 3, xs).astype(float)
    tape = tg.Tape()
    vx = tape.param(x)
    y = getattr(tg, kind + "_pool")(vx, win, st, pad, layout)
    g = rng.standard_normal(y.shape)
    tape.backward(y, seed=g)
    fw, fs = full(win, len(xs), layout), full(st if st is not None else win, len(xs), layout)
    fp = pad if isinstance(pad, str) else tuple(full(pad, len(xs), layout)) if layout is None else \
        ((((0, 0),) + pad + ((0, 0),)) if layout == "NHWC" else ((0, 0), (0, 0)) + pad)

    def ref(x):
        if kind == "max":
            return lax.reduce_window(x, -jnp.inf, lax.max, fw, fs, fp)
        s = lax.reduce_window(x, 0.0, lax.add, fw, fs, fp)
        return s / np.prod(fw) if kind == "avg" else s
    want, vjp = jax.vjp(ref, jnp.asarray(x))
    assert rel(tape.value(y), want) <= RTOL
    got, dx = tape.grad(vx), np.asarray(vjp(jnp.asarray(g))[0])
    if kind == "max":   # the tie rule must pick the same element: exact equality, not a tolerance
        assert np.array_equal(tape.value(y), np.asarray(want))
        assert np.array_equal(got != 0, dx != 0)
    assert rel(got, dx) <= RTOL


def test_max_pool_gradient_goes_to_the_first_maximum_in_row_major_window_order():
    x = np.array([[5.0, 1.0, 5.0],
                  [5.0, 5.0, 2.0],
                  [0.0, 5.0, 5.0]])
    tape = tg.Tape()
    vx = tape.param(x)
    y = tg.max_pool(vx, (2, 2), strides=(1, 1))           # four overlapping 2x2 windows, each max 5
    tape.backward(y.sum())
    # windows at (0,0), (0,1), (1,0), (1,1) pick (0,0), (0,2), (1,0), (1,1): first 5 scanning rows
    assert np.array_equal(tape.grad(vx), [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    want = jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID").sum())(jnp.asarray(x))
    assert np.array_equal(tape.grad(vx), np.asarray(want))


def test_avg_pool_counts_padding_in_the_window_size():
    tape = tg.Tape()
    y = tg.avg_pool(tape.const(np.ones((1, 3))), (1, 2), padding="SAME")   # the last window is half padding
    assert np.array_equal(tape.value(y), [[1.0, 0.5]])


# ── bad input ────────────────────────────────────────────────────────────────

@pytest.fixture
def tape():
    t = tg.Tape()
    t.x = t.param(np.ones((2, 4, 5, 5)))
    t.w = t.param(np.ones((6, 2, 3, 3)))
    t.v = t.param(np.ones(3))
    t.w5 = t.param(np.ones((5, 1, 3, 3)))
    return t


BAD = [
    ("channels", lambda t: tg.conv(t.x, t.w),
     "conv (node 4): the OIHW kernel (6, 2, 3, 3) has 2 input channels; expected 4 (the input's 4 channels / "
     "groups=1)"),
    ("groups in", lambda t: tg.conv(t.x, t.w, groups=3),
     "conv (node 4): groups=3 must divide the 4 input channels of (2, 4, 5, 5)"),
    ("groups out", lambda t: tg.conv(t.x, t.w5, groups=4),
     "conv (node 4): groups=4 must divide the 5 output channels of the OIHW kernel (5, 1, 3, 3)"),
    ("window", lambda t: tg.conv(t.x, t.w, groups=2, rhs_dilation=3),
     "conv (node 4): spatial dim 0: the dilated kernel spans 7 but the padded input has 5 (input 5, padding "
     "(0, 0), lhs_dilation 1)"),
    ("rank", lambda t: tg.conv(t.v, t.w),
     "conv (node 4): expected an input of rank >= 3 (batch, channels, spatial...), got shape (3,)"),
    ("kernel rank", lambda t: tg.conv(t.x, t.v),
     "conv (node 4): expected a kernel of rank 4 like the input (2, 4, 5, 5), got shape (3,)"),
    ("layout", lambda t: tg.conv(t.x, t.w, layout="NCW"),
     "conv (node 4): layout must be 'NCHW' or 'NHWC' (or 'NCW'/'NWC', 'NCDHW'/'NDHWC' matching the input's "
     "rank 4), got 'NCW'"),
    ("padding", lambda t: tg.conv(t.x, t.w, groups=2, padding="FULL"),
     "conv (node 4): padding must be 'VALID', 'SAME', 'SAME_LOWER' or (lo, hi) pairs, got 'FULL'"),
    ("negative padding", lambda t: tg.conv(t.x, t.w, groups=2, padding=((-1, 0), (0, 0))),
     "conv (node 4): padding must be 2 (low, high) pairs of integers >= 0, got ((-1, 0), (0, 0))"),
    ("strides", lambda t: tg.conv(t.x, t.w, groups=2, stride=(1, 0)),
     "conv (node 4): strides must be 2 integer(s) >= 1 (one per spatial dimension), got (1, 0)"),
    ("pool window", lambda t: tg.max_pool(t.x, (5, 5), layout="NHWC"),
     "max_pool (node 4): axis 1: the window (5) is larger than the padded input (4 = 4 + padding (0, 0))"),
    ("pool rank", lambda t: tg.sum_pool(t.x, (2, 2)),
     "sum_pool (node 4): window must be an int or 4 ints (one per axis), got (2, 2)"),
]


@pytest.mark.parametrize("name,bad,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_named_error_and_changes_nothing(tape, name, bad, message):
    before = snapshot(tape)
    with pytest.raises(tg.ShapeError) as info:
        bad(tape)
    assert str(info.value) == message
    assert_unchanged(tape, before)
    y = tg.conv(tape.x, tape.w, groups=2)                 # the tape still works
    assert tape.backward(y.sum()) and np.array_equal(tape.grad(tape.w), np.full((6, 2, 3, 3), 18.0))


def test_conv_of_arrays_that_do_not_fit_lifts_nothing():
    tape = tg.Tape()
    w = tape.param(np.ones((2, 3, 3, 3)))
    with pytest.raises(tg.ShapeError, match="conv \\(node 1\\): the OIHW kernel"):
        tg.conv(np.ones((1, 2, 4, 4)), w)
    assert len(tape) == 1


# ── a small CNN on the tape vs the same model in jax.numpy ───────────────────

def cnn_init(layout, seed=0):
    rng = np.random.default_rng(seed)
    kshape = (lambda o, i, k: (o, i, k, k)) if layout == "NCHW" else (lambda o, i, k: (k, k, i, o))
    bshape = (lambda o: (1, o, 1, 1)) if layout == "NCHW" else (lambda o: (1, 1, 1, o))
    return [rng.standard_normal(kshape(4, 1, 3)) / 3, rng.standard_normal(bshape(4)) * 0.1,
            rng.standard_normal(kshape(6, 4, 2)) / 4, rng.standard_normal(bshape(6)) * 0.1,
            rng.standard_normal((54, 3)) / 7, rng.standard_normal(3) * 0.1]


def cnn_data(layout, batch=5, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 1, 12, 12) if layout == "NCHW" else (batch, 12, 12, 1))
    return x, np.eye(3)[rng.integers(0, 3, batch)]


def cnn_tape(tape, P, x, y, layout, loss="xent"):
    """conv 3x3 + relu → 2x2 max pool → conv 2x2 SAME + relu → 2x2 SAME avg pool → dense → cross-entropy."""
    w1, b1, w2, b2, w3, b3 = P
    h = (tg.conv(x, w1, layout=layout) + b1).relu()                        # (B, 4, 10, 10)
    h = tg.max_pool(h, 2, layout=layout)                                   # (B, 4, 5, 5)
    h = (tg.conv(h, w2, padding="SAME", layout=layout) + b2).relu()        # (B, 6, 5, 5)
    h = tg.avg_pool(h, 2, padding="SAME", layout=layout)                   # (B, 6, 3, 3)
    logits = h.reshape(h.shape[0], -1) @ w3 + b3
    return tg.softmax_cross_entropy(logits, y) if loss == "xent" else tg.mse(logits, y)


def cnn_jax(P, x, y, layout):
    w1, b1, w2, b2, w3, b3 = P
    dn = dnums(layout, 4)
    win = (1, 1, 2, 2) if layout == "NCHW" else (1, 2, 2, 1)
    h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=dn,
                                             precision=lax.Precision.HIGHEST) + b1)
    h = lax.reduce_window(h, -jnp.inf, lax.max, win, win, "VALID")
    h = jax.nn.relu(lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=dn,
                                             precision=lax.Precision.HIGHEST) + b2)
    h = lax.reduce_window(h, 0.0, lax.add, win, win, "SAME") / 4.0
    logits = h.reshape(h.shape[0], -1) @ w3 + b3
    return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=1))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_small_cnn_gradients_match_jax_grad(layout):
    init, (x, y) = cnn_init(layout), cnn_data(layout)
    tape = tg.Tape()
    P = [tape.param(p) for p in init]
    loss = cnn_tape(tape, P, tape.const(x), tape.const(y), layout)
    assert tape.backward(loss)
    vg = jax.jit(jax.value_and_grad(cnn_jax), static_argnums=3)   # one compile beats op-by-op dispatch
    want_loss, want = vg([jnp.asarray(p) for p in init], jnp.asarray(x), jnp.asarray(y), layout)
    assert rel(tape.value(loss), want_loss) <= RTOL
    worst = max(rel(tape.grad(p), g) for p, g in zip(P, want))
    assert worst <= RTOL, worst


def within_blas(got, want, k=16):
    """The native test suite's "blas" tier bound, per element."""
    eps = np.finfo(np.float64).eps
    tol = k * np.spacing(np.maximum(np.abs(got), np.abs(want))) + k * eps * np.abs(want).max()
    return bool(np.all(np.abs(got - want) <= tol))


@pytest.mark.matrix
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_small_cnn_training_replays_natively(layout, monkeypatch):
    """Three Adam episodes: NumPy replay == tape; native fused == unfused; native vs tape: == with an
    exact loss and every product in BLAS (mse, TAPEGRAD_SMALL_GEMM=0: the conv GEMMs are NumPy's own
    dgemm calls, pooling and the rest IEEE-exact), within 1e-12 with softmax cross-entropy (libm tier)
    and the default threshold, where small products take the program's own kernel (blas tier: its
    rounding matches no particular BLAS kernel family)."""
    init, data = cnn_init(layout), [cnn_data(layout, seed=s) for s in range(3)]
    for loss in ("mse", "xent"):
        if loss == "mse":
            monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", "0")
        else:
            monkeypatch.delenv("TAPEGRAD_SMALL_GEMM", raising=False)
        want = None
        runs = {}
        for backend, fuse in (("eager", None), ("numpy", True), ("native", False), ("native", True)):
            tape = tg.Tape()
            P = [tape.param(p) for p in init]
            opt = tg.Adam(1e-2)
            for p in P:
                opt.add(tape, p)
            m = tape.mark()
            x, y = tape.const(data[0][0]), tape.const(data[0][1])
            out = cnn_tape(tape, P, x, y, layout, loss)
            losses = []
            if backend == "eager":
                for xb, yb in data:
                    if losses:
                        tape.reset_to(m)
                        x, y = tape.const(xb), tape.const(yb)
                        out = cnn_tape(tape, P, x, y, layout, loss)
                    losses.append(float(tape.value(out)))
                    tape.backward(out)
                    opt.step()
                want = (losses, [tape.value(p).copy() for p in P])
                continue
            prog = tg.capture(tape, out, backend=backend, fuse=fuse)
            prog.attach(opt)
            losses = [prog.episode({x: xb, y: yb}) for xb, yb in data]
            runs[(backend, fuse)] = (losses, [prog.value(p).copy() for p in P])
        assert runs[("numpy", True)][0] == want[0]
        assert all(np.array_equal(a, b) for a, b in zip(runs[("numpy", True)][1], want[1]))
        (l0, p0), (l1, p1) = runs[("native", False)], runs[("native", True)]
        assert l0 == l1 and all(np.array_equal(a, b) for a, b in zip(p0, p1))
        if loss == "mse":
            assert l1 == want[0]
            assert all(np.array_equal(a, b) for a, b in zip(p1, want[1]))
        else:
            assert np.allclose(l1, want[0], rtol=1e-12, atol=0)
            assert all(rel(a, b) <= 1e-12 for a, b in zip(p1, want[1]))


@pytest.mark.matrix
@pytest.mark.parametrize("xs,ws,kw", [SWEEP[3], SWEEP[5], SWEEP[7], SWEEP[8]], ids=["nchw", "groups", "nhwc", "nhwc-groups"])
def test_native_conv_equals_the_tape_where_numpy_takes_its_gemm_path(xs, ws, kw, monkeypatch):
    """Every GEMM of these convolutions has all dimensions > 1, so NumPy calls dgemm: with every product
    sent to BLAS (TAPEGRAD_SMALL_GEMM=0) the native program passes dgemm the very same arguments, and
    values and both gradients are bit-identical on any BLAS kernel family. With the default threshold
    these small products take the program's own kernel: within the blas tier's bound."""
    rng = np.random.default_rng(2)
    tape = tg.Tape()
    vx, vw = tape.param(rng.standard_normal(xs)), tape.param(rng.standard_normal(ws))
    y = tg.conv(vx, vw, **kw)
    loss = (y * tape.const(rng.standard_normal(y.shape))).sum()
    tape.backward(loss)
    for small, same in (("0", np.array_equal), (None, within_blas)):
        if small is None:
            monkeypatch.delenv("TAPEGRAD_SMALL_GEMM", raising=False)
        else:
            monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", small)
        prog = tg.capture(tape, loss, backend="native")
        prog.forward()
        prog.backward()
        assert same(prog.value(y), tape.value(y)), small
        assert same(prog.grad(vx), tape.grad(vx)), small
        assert same(prog.grad(vw), tape.grad(vw)), small


def test_the_docs_cnn_example_trains():
    from docs_pages import block
    code = block("tape.md", "## Models on the tape", 1)
    scope = {}
    exec(compile(code.replace("print(", "(lambda *a: None)("), "docs/tape.md", "exec"), scope)
    assert float(scope["tape"].value(scope["loss"])) < 0.05
    assert scope["cnn"].episode() < 0.05


def test_small_cnn_in_float32_replays_natively_close_to_the_float64_tape():
    init, (x, y) = cnn_init("NHWC"), cnn_data("NHWC")
    grads = {}
    for dt in ("float64", "float32"):
        tape = tg.Tape(dtype=dt)
        P = [tape.param(p.astype(dt)) for p in init]
        loss = cnn_tape(tape, P, tape.const(x.astype(dt)), tape.const(y.astype(dt)), "NHWC")
        tape.backward(loss)
        prog = tg.capture(tape, loss, backend="native")
        prog.forward()
        prog.backward()
        grads[dt] = [prog.grad(p) if dt == "float32" else tape.grad(p) for p in P]
    assert max(rel(a, b) for a, b in zip(grads["float32"], grads["float64"])) <= 1e-5


def test_native_refuses_pooling_over_more_axes_than_its_loops_index():
    tape = tg.Tape()
    x = tape.param(np.ones((2,) * 9))
    loss = tg.sum_pool(x, 2).sum()
    tape.backward(loss)
    with pytest.raises(tg.TapeError, match=r"sum_pool \(node 1\): the native backend handles at most 8 windowed "
                                           r"dimensions, got 9; use backend='numpy'"):
        tg.capture(tape, loss, backend="native")
    prog = tg.capture(tape, loss)
    assert prog.forward() == 1.0 * 2 ** 9


# ── random geometries: a direct definition of the convolution, and finite differences ──────────

def conv_by_definition(x, w, st, pads, ld, rd, groups, last):
    """out[n, o, p] = Σ_{c, k} x̃[n, g(o)·Cg + c, p·st + k·rd] · w[o, c, k], x̃ the lhs-dilated, padded input."""
    if last:
        x, w = np.moveaxis(x, -1, 1), np.moveaxis(np.moveaxis(w, -1, 0), -1, 1)
    n, c, *sp = x.shape
    o, cg, *ks = w.shape
    xt = np.zeros((n, c) + tuple((s - 1) * d + 1 + lo + hi for s, d, (lo, hi) in zip(sp, ld, pads)))
    xt[(slice(None), slice(None)) + tuple(slice(lo, lo + (s - 1) * d + 1, d) for s, d, (lo, _) in zip(sp, ld, pads))] = x
    out_sp = [(m - ((k - 1) * r + 1)) // s + 1 for m, k, r, s in zip(xt.shape[2:], ks, rd, st)]
    out = np.zeros((n, o) + tuple(out_sp))
    og = o // groups
    for p in np.ndindex(*out_sp):
        for k in np.ndindex(*ks):
            at_ = tuple(pi * s + ki * r for pi, ki, s, r in zip(p, k, st, rd))
            for j in range(groups):
                xs = xt[(slice(None), slice(j * cg, (j + 1) * cg)) + at_]                 # (n, cg)
                out[(slice(None), slice(j * og, (j + 1) * og)) + p] += xs @ w[(slice(j * og, (j + 1) * og), slice(None)) + k].T
    return np.moveaxis(out, 1, -1) if last else out


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_random_conv_geometries_match_the_definition_and_finite_differences(data):
    nsp = data.draw(st.integers(1, 2))
    groups = data.draw(st.sampled_from([1, 2]))
    cg, og = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    ks = [data.draw(st.integers(1, 3)) for _ in range(nsp)]
    sp = [data.draw(st.integers(1, 5)) for _ in range(nsp)]
    st_ = tuple(data.draw(st.integers(1, 2)) for _ in range(nsp))
    ld = tuple(data.draw(st.integers(1, 2)) for _ in range(nsp))
    rd = tuple(data.draw(st.integers(1, 2)) for _ in range(nsp))
    pads = tuple((data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))) for _ in range(nsp))
    last = data.draw(st.booleans())
    for s, k, d, r, (lo, hi) in zip(sp, ks, ld, rd, pads):
        assume((s - 1) * d + 1 + lo + hi >= (k - 1) * r + 1)
    c, o = groups * cg, groups * og
    xs = (2,) + tuple(sp) + (c,) if last else (2, c) + tuple(sp)
    ws = tuple(ks) + (cg, o) if last else (o, cg) + tuple(ks)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    kw = dict(stride=st_, padding=pads, lhs_dilation=ld, rhs_dilation=rd, groups=groups,
              layout="NHWC" if last else "NCHW")
    tape = tg.Tape()
    y = tg.conv(tape.param(x), tape.param(w), **kw)
    want = conv_by_definition(x, w, st_, pads, ld, rd, groups, last)
    assert rel(tape.value(y), want) <= 1e-14
    probe = rng.standard_normal(want.shape)
    # gradcheck moves one input at a time and a convolution is linear in each: the central difference is
    # exact for any step but for rounding, eps·|f|/step, so a large step (at the default 1e-6 the rounding
    # came within 1.1x of the tolerance in 2,600 random geometries: no kink, only cancellation)
    report = tg.gradcheck(lambda t, vx, vw: (tg.conv(vx, vw, **kw) * t.const(probe)).sum(), x, w, directions=2,
                          eps=0.5)
    assert report.ok, report
