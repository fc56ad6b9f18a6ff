"""The native backend: per-op exactness tiers vs the tape, whole programs, the ABI, float32, the build cache."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O
from tapegrad.errors import BuildError
from tapegrad.native import build

from op_cases import floats, make, record
from capture_util import batches, captured, eager, every_op_graph, make_opt, mlp, mlp_init, register

# The bound for ops whose tier is not IEEE-exact (registry ``tier``): per element,
# |native − tape| <= ULPS · spacing(max(|native|, |tape|)) + ULPS · eps · max|tape| (the second term
# covers results that cancel to near zero, e.g. a softmax gradient summing to 0). An op whose forms
# differ by more states its own ``(ulps, floor)`` in the registry (``Op.ulps``): the scale of the
# second term is then at least ``floor``.
ULPS = {"libm": 8, "blas": 16}
EPS = np.finfo(np.float64).eps


def within(tier, got, want, bound=None):
    if tier in ("exact", "order"):
        return np.array_equal(got, want)
    k, floor = bound or (ULPS[tier], 0.0)
    scale = max(np.max(np.abs(want)) if np.size(want) else 0.0, floor)
    tol = k * np.spacing(np.maximum(np.abs(got), np.abs(want))) + k * EPS * scale
    return bool(np.all(np.abs(got - want) <= tol))


@pytest.fixture(scope="module")
def all_cases():
    return every_op_programs()


def every_op_tape(dtype="float64"):
    """(tape, loss, [(op, case, its float Vars, its output)]): every registry op on every one of its cases."""
    rng = np.random.default_rng(7)
    tape = tg.Tape(dtype)
    items, loss = [], None
    for op in O.OPS.values():
        if not op.arity:
            continue
        for case in op.cases:
            arrays, s = make(op, case, rng)
            vs, y = record(tape, op, arrays, s)
            term = (y * tape.const(rng.standard_normal(y.shape))).sum()
            loss = term if loss is None else loss + term
            items.append((op, case, floats(op, vs), y))
    return tape, loss, items


def every_op_programs():
    """One tape holding every registry op on every one of its cases (one build for all of them)."""
    tape, loss, items = every_op_tape()
    tape.backward(loss)
    progs = {f: tg.capture(tape, loss, backend="native", fuse=f) for f in (False, True)}
    for p in progs.values():
        p.forward()
        p.backward()
    return tape, items, progs


@pytest.mark.matrix
@pytest.mark.parametrize("op", [o for o in O.OPS.values() if o.arity], ids=lambda o: o.name)
def test_native_op_matches_tape_within_its_tier(op, all_cases):
    """exact/order ops: == (the C mirrors NumPy's arithmetic and its reduction order); libm and blas
    ops: the ULPS bound above."""
    check_ops(all_cases, op)


def check_ops(cases, only=None):
    """Every op of ``every_op_programs()`` (or ``only``) within its tier, fused == unfused."""
    tape, items, progs = cases
    prog = progs[True]
    for op, case, xs, y in items:
        if only is not None and op is not only:
            continue
        assert within(op.tier, prog.value(y), tape.value(y), op.ulps), (op.name, case, "value")
        for v in xs:
            assert within(op.tier, prog.grad(v), tape.grad(v), op.ulps), (op.name, case, "grad")
        for v in [y] + xs:
            assert np.array_equal(progs[False].value(v), prog.value(v))
            assert np.array_equal(progs[False].grad(v), prog.grad(v))


@pytest.mark.matrix
def test_every_op_graph_fused_equals_unfused_and_tape_within_bound():
    tape, params, loss = every_op_graph()
    tape.backward(loss)
    progs = [tg.capture(tape, loss, backend="native", fuse=f) for f in (False, True)]
    for p in progs:
        p.forward()
        p.backward()
    assert progs[1].plan()["kernels_forward"] < progs[1].plan()["kernels_forward_unfused"]
    for p in params:
        assert np.array_equal(progs[0].grad(p), progs[1].grad(p))
        assert within("libm", progs[1].grad(p), tape.grad(p))
    assert within("libm", progs[1].loss(), tape.value(loss))


SIZES = (8, 16, 16, 3)
DATA = batches(SIZES, 12, 5)


@pytest.mark.matrix
@pytest.mark.parametrize("small", ["0", None])
@pytest.mark.parametrize("opt", ["sgd_clip_seed", "adam_clip_optax", "adam_hat_clip_torch"])
@pytest.mark.parametrize("act,loss", [("relu", "mse"), ("tanh", "xent")])
def test_native_training_fused_equals_unfused_and_tracks_the_tape(opt, act, loss, small, monkeypatch):
    """relu + matmul + mse + any optimizer is IEEE-exact end to end when every product runs in the BLAS
    NumPy calls (``TAPEGRAD_SMALL_GEMM=0``): native == tape. With the default small-product kernel (the
    blas tier: another summation order) or libm ops (tanh, softmax cross-entropy) the trajectory stays
    within 1e-12 relative over 5 steps."""
    if small is not None:
        monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", small)
    want_losses, want_params, _ = eager(SIZES, DATA, opt, act, loss)
    runs = []
    for fuse in (False, True):
        prog, tape, params, x, y, _ = captured(SIZES, DATA, opt, "native", act, loss, fuse=fuse)
        losses = [prog.episode({x: xb, y: yb}) for xb, yb in DATA]
        runs.append((losses, [prog.value(p).copy() for p in params], prog))
    (l0, p0, g0), (l1, p1, g1) = runs
    assert l0 == l1
    assert all(np.array_equal(a, b) for a, b in zip(p0, p1))
    assert g1.plan()["fused"]
    if act == "relu" and loss == "mse" and small == "0":
        assert l1 == want_losses
        assert all(np.array_equal(a, b) for a, b in zip(p1, want_params))
    else:
        assert np.allclose(l1, want_losses, rtol=1e-12, atol=0)
        for a, b in zip(p1, want_params):
            assert np.allclose(a, b, rtol=1e-11, atol=1e-14)


def test_native_step_scalars_are_computed_per_step_like_the_host():
    prog, tape, params, x, y, opt = captured(SIZES, DATA, "adam", "native")
    for xb, yb in DATA:
        prog.episode({x: xb, y: yb})
    sc = prog.runner.sc
    assert sc[0] == len(DATA)
    assert tuple(sc[1:4]) == opt.step_scalars(len(DATA))
    prog.load_optimizer_state({**prog.optimizer_state(), "count": 100})
    prog.step()
    assert tuple(prog.runner.sc[1:4]) == opt.step_scalars(101)
    assert prog.optimizer_state()["count"] == 101


def test_native_abi_drives_an_episode_from_raw_pointers():
    """What a C caller does: memcpy inputs into the slots, call episode(ctx), read the loss and grads."""
    ref, _, _, rx, ry, _ = captured(SIZES, DATA, "adam_clip_optax", "native")
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam_clip_optax", "native")
    abi = prog.native_abi()
    assert set(abi) >= {"forward", "backward", "episode", "ctx", "params", "inputs", "grads", "loss", "dtype",
                        "opt_state", "step_scalars"}
    assert abi["dtype"] == "float64" and len(abi["params"]) == 6 and len(abi["inputs"]) == 2
    assert len(abi["opt_state"]) == 12 and all(p % 64 == 0 for p, _ in abi["params"] + abi["inputs"])
    episode = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(abi["episode"])
    for xb, yb in DATA:
        for (ptr, shape), arr in zip(abi["inputs"], (xb, yb)):
            assert shape == arr.shape
            ctypes.memmove(ptr, np.ascontiguousarray(arr).ctypes.data, arr.nbytes)
        episode(abi["ctx"])
        assert ctypes.c_double.from_address(abi["loss"]).value == ref.episode({rx: xb, ry: yb})
    assert ctypes.c_double.from_address(abi["step_scalars"]).value == len(DATA)
    ptr, shape = abi["grads"][2]
    got = np.ctypeslib.as_array((ctypes.c_double * int(np.prod(shape))).from_address(ptr)).reshape(shape)
    assert np.array_equal(got, prog.grad(params[2]))
    for (ptr, shape), p in zip(abi["params"], params):
        got = np.ctypeslib.as_array((ctypes.c_double * int(np.prod(shape))).from_address(ptr)).reshape(shape)
        assert np.array_equal(got, prog.value(p))
    assert prog.hash64 == ref.hash64


@pytest.mark.matrix
def test_native_float32_within_the_stated_bound():
    """float32 native program vs the float64 tape, 5 Adam steps: |Δloss| <= 1e-5·max(1, |loss|)."""
    want_losses, want_params, _ = eager(SIZES, DATA, "adam")
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam", "native", dtype="float32")
    got = [prog.episode({x: xb, y: yb}) for xb, yb in DATA]
    assert prog.native_abi()["dtype"] == "float32"
    for g, w in zip(got, want_losses):
        assert abs(g - w) <= 1e-5 * max(1.0, abs(w))
    for p, w in zip(params, want_params):
        assert np.max(np.abs(prog.value(p) - w)) <= 1e-5 * max(1.0, np.max(np.abs(w)))


# ── the build cache ──────────────────────────────────────────────────────────

SRC = "int tg_probe(void) { return 42; }\n"


def test_cache_hit_does_not_compile(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV, str(tmp_path))
    path = build.build(SRC, "probe")
    assert path.startswith(str(tmp_path)) and os.path.exists(path + ".sum")

    def boom(*a, **k):
        raise AssertionError("compiled again")
    monkeypatch.setattr(build, "_compile", boom)
    assert build.build(SRC, "probe") == path
    assert build.load(path).tg_probe() == 42


def test_corrupt_artifact_is_detected_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV, str(tmp_path))
    path = build.build(SRC, "probe")
    with open(path, "r+b") as f:
        f.truncate(100)                      # a half-written library
    assert not build._valid(path, path + ".sum")
    assert build.build(SRC, "probe") == path
    assert build._valid(path, path + ".sum")
    os.unlink(path + ".sum")                 # no checksum: rebuilt too
    assert build.build(SRC, "probe") == path and build._valid(path, path + ".sum")


def test_concurrent_builds_from_several_processes(tmp_path):
    code = ("import sys; from tapegrad.native import build; "
            "src = 'int tg_probe(void) { return 7; }\\n' + '/* pad */\\n' * 5000; "
            "p = build.build(src, 'race'); print(build.load(p).tg_probe())")
    env = {**os.environ, build.ENV: str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["7"] * 4
    libs = [f for f in os.listdir(tmp_path) if f.endswith(".so")]
    assert len(libs) == 1 and not [f for f in os.listdir(tmp_path) if f.endswith((".tmp", ".c"))]


def test_key_covers_source_flags_and_compiler(tmp_path, monkeypatch):
    cc = build.find_compiler()
    k = build.key_of(SRC, cc)
    assert k != build.key_of(SRC + " ", cc)
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-g",))
    assert build.key_of(SRC, cc) != k
    assert "-ffp-contract=off" in build.FLAGS and "-Werror" in build.flags()


def test_missing_compiler_is_a_clear_error_and_numpy_still_works(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV, str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    tape = tg.Tape()
    w = tape.param(np.ones(3))
    loss = (w * w).sum()
    with pytest.raises(BuildError, match=r"no C compiler found \(looked for cc, gcc, clang on PATH="):
        tg.capture(tape, loss, backend="native")
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(BuildError, match="looked for no-such-cc"):
        tg.capture(tape, loss, backend="native")
    prog = tg.capture(tape, loss)
    assert float(prog.forward()) == 3.0


@pytest.mark.matrix
def test_relu_and_maximum_follow_numpy_on_nan_and_signed_zeros():
    tape = tg.Tape()
    a = tape.param(np.array([-0.0, 0.0, np.nan, 1.0, np.nan, -2.0]))
    b = tape.param(np.array([0.0, -0.0, 1.0, np.nan, np.nan, 3.0]))
    y, r = tg.maximum(a, b), a.relu()
    prog = tg.capture(tape, y.sum() + r.sum(), backend="native")
    prog.forward()
    for v in (y, r):
        assert np.array_equal(prog.value(v), tape.value(v), equal_nan=True)
        assert np.array_equal(np.signbit(prog.value(v)), np.signbit(tape.value(v)))


def test_an_op_without_a_native_form_is_named():
    """Gaps are explicit: an op the native backend cannot print raises naming it (numpy still replays it)."""
    flip = O.Op("flip_test", 1, O.same, fwd=lambda a, b, s, out, ws: np.copyto(out, a[::-1]),
                da=lambda g, out, a, b, s, ws: g[::-1], kind="layout")
    tape = tg.Tape()
    w = tape.param(np.arange(3.0))
    loss = tape.apply(flip, w).sum()
    with pytest.raises(tg.TapeError, match=r"flip_test \(node 1\): the native backend has no kernel"):
        tg.capture(tape, loss, backend="native")
    assert float(tg.capture(tape, loss).forward()) == 3.0


def test_native_capture_of_a_fine_tune_graph_holds_the_frozen_weight_once():
    """Frozen weight (2 MiB const) + small adapter: the program's buffers cost one copy of the weight plus
    activation-sized buffers, and ``drop_consts`` then frees the tape's copy."""
    import tracemalloc
    rng = np.random.default_rng(0)
    big, xb = rng.standard_normal((512, 512)), rng.standard_normal((8, 512))
    tape = tg.Tape()
    frozen, x = tape.const(big), tape.const(xb)
    a, b = tape.param(np.zeros((512, 4))), tape.param(rng.standard_normal((4, 512)) * 0.01)
    loss = tg.mse(x @ frozen + (x @ a) @ b, tape.const(np.zeros((8, 512))))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prog = tg.capture(tape, loss, backend="native")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert big.nbytes <= grown < 1.5 * big.nbytes, grown
    assert tape.drop_consts() >= big.nbytes
    prog.attach(tg.SGD(0.1))
    assert np.isfinite(prog.episode())


@pytest.mark.matrix
@pytest.mark.parametrize("small", ["0", None])
@pytest.mark.parametrize("opt", ["sgd_clip_seed", "adam_clip_optax", "adam_hat_clip_torch"])
def test_float32_tape_and_float32_native_program_agree_bit_for_bit(opt, small, monkeypatch):
    """On a float32 tape, an exact-tier graph (relu, matmul, mse) and every optimizer form replay
    natively in float32 bit for bit when the products run in NumPy's BLAS (``TAPEGRAD_SMALL_GEMM=0``;
    NumPy's float32 libm differs from glibc's: libm ops are bounded); with the default small-product
    kernel (blas tier) the losses agree to 1e-5 relative."""
    if small is not None:
        monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", small)
    init = [a.astype(np.float32) for a in mlp_init(SIZES)]
    tape = tg.Tape(np.float32)
    params = [tape.param(a) for a in init]
    o = make_opt(opt)
    register(o, tape, params)
    m = tape.mark()
    want = []
    for xb, yb in DATA:
        _, _, out = mlp(tape, params, xb, yb, loss="mse")
        want.append(float(tape.value(out)))
        tape.backward(out)
        o.step()
        tape.reset_to(m)
    tape2 = tg.Tape(np.float32)
    params2 = [tape2.param(a) for a in init]
    o2 = make_opt(opt)
    register(o2, tape2, params2)
    tape2.mark()
    x, y, out = mlp(tape2, params2, *DATA[0], loss="mse")
    prog = tg.capture(tape2, out, backend="native", dtype="float32")
    prog.attach(o2)
    got = [prog.episode({x: xb, y: yb}) for xb, yb in DATA]
    if small == "0":
        assert got == want
        for p, q in zip(params2, params):
            assert np.array_equal(prog.value(p), tape.value(q))
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_native_episode_allocates_nothing_traced():
    """One ctypes call per episode: tracemalloc's peak over 20 episodes (inputs copied in each time) stays
    under 2 KiB — transient Python objects only, no array."""
    import tracemalloc
    prog, tape, params, x, y, _ = captured(SIZES, DATA, "adam_clip_optax", "native")
    feed = {x: DATA[0][0], y: DATA[0][1]}
    prog.episode(feed)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(20):
            prog.episode(feed)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 2048 and current - base < 512, (peak - base, current - base)


def test_scipy_cython_blas_fallback(tmp_path):
    """With TAPEGRAD_BLAS=scipy the GEMMs go through scipy.linalg.cython_blas's function pointers."""
    code = ("import numpy as np, tapegrad as tg\n"
            "t = tg.Tape(); a = t.param(np.arange(12.0).reshape(3, 4)); b = t.param(np.ones((4, 5)))\n"
            "l = (a @ b).sum(); t.backward(l)\n"
            "p = tg.capture(t, l, backend='native'); p.forward(); p.backward()\n"
            "print(p.runner.blas[3], float(p.loss()) == float(t.value(l)), "
            "bool((p.grad(a) == t.grad(a)).all() and (p.grad(b) == t.grad(b)).all()))\n")
    env = {**os.environ, "TAPEGRAD_BLAS": "scipy", build.ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["scipy.linalg.cython_blas", "True", "True"]


SMALL_SHAPES = [((4, 8), (8, 8)), ((5, 3), (3, 7)), ((32, 16), (16, 32)), ((33, 32), (32, 4)), ((7, 40), (40, 10)),
                ((1, 9), (9, 1)), ((6, 13), (13, 2)), ((64, 20), (20, 18))]


def small_product_program(ash, bsh, seed, dtype="float64"):
    rng = np.random.default_rng(seed)
    tape = tg.Tape(dtype)
    a, b = tape.param(rng.standard_normal(ash)), tape.param(rng.standard_normal(bsh))
    c = tape.const(rng.standard_normal((ash[0], bsh[1])))
    loss = ((a @ b) * c).sum()
    tape.backward(loss)
    return tape, a, b, loss


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("ash,bsh", SMALL_SHAPES, ids=str)
def test_small_product_kernel_within_the_blas_bound_and_deterministic(ash, bsh, dtype, monkeypatch):
    """Every product forced through the generated C's own kernel (all three forms: A@B forward, G@Bᵀ and
    Aᵀ@G backward; vector blocks, half-vector and scalar edges): the value and both gradients within the
    blas tier's bound of NumPy's matmul, and the same bits from a second, separately built program."""
    monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", str(1 << 30))
    tape, a, b, loss = small_product_program(ash, bsh, sum(ash) + sum(bsh), dtype)
    runs = []
    for fuse in (True, False):
        prog = tg.capture(tape, loss, backend="native", fuse=fuse, dtype=dtype)
        assert "TG_MM_SMALL 1073741824L" in prog.runner.source
        prog.forward()
        prog.backward()
        runs.append([np.array(prog.loss()), np.array(prog.grad(a)), np.array(prog.grad(b))])
    want = [tape.value(loss), tape.grad(a), tape.grad(b)]
    if dtype == "float32":   # a float32 program against the float64 tape: float32's rounding bounds it
        for got, w in zip(runs[0], want):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))
    else:
        for got, w in zip(runs[0], want):
            assert within("blas", got, w)
    for x, y in zip(*runs):
        assert np.array_equal(x, y)


def test_small_product_threshold_follows_the_blas_kernel(monkeypatch):
    """OpenBLAS cores with their own small-matrix kernels (SkylakeX family) take every product; others
    take products above the measured threshold only; the environment overrides both."""
    from tapegrad.native import runner
    monkeypatch.setattr(runner, "blas_core", lambda dtype: "SkylakeX")
    assert runner.small_gemm_limit("float64") == 0
    monkeypatch.setattr(runner, "blas_core", lambda dtype: "Haswell")
    assert runner.small_gemm_limit("float64") == runner.SMALL_GEMM
    monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", "12")
    assert runner.small_gemm_limit("float64") == 12


@pytest.mark.matrix
@pytest.mark.parametrize("kind", ["adam", "adam-hat-clip", "sgd-l2"])
def test_an_update_split_over_threads_gives_the_one_thread_bits(kind):
    """The native runner splits an optimizer update of at least ``SPLIT_UPDATES`` parameters into
    element ranges on threads it starts (``tg_threads_team``); each element's arithmetic is unchanged,
    so three episodes give the bits of the unsplit update, also with ranges that end inside a
    parameter (three parts) and a parameter the loss does not reach (skipped)."""
    from tapegrad.native import runner as R

    def trained(parts, min_upd):
        rng = np.random.default_rng(7)
        tape = tg.Tape()
        ps = [tape.param(rng.standard_normal((512, 257)) * 0.05),   # 131,584 parameters: above SPLIT_UPDATES
              tape.param(np.zeros(257)), tape.param(rng.standard_normal((257, 3)) * 0.05),
              tape.param(np.ones(5))]                                # no gradient reaches it
        x, y = tape.const(rng.standard_normal((8, 512))), tape.const(np.eye(3)[rng.integers(0, 3, 8)])
        loss = tg.softmax_cross_entropy((x @ ps[0] + ps[1]).tanh() @ ps[2], y)
        prog = tg.capture(tape, loss, backend="native")
        opt = {"adam": lambda: tg.Adam(1e-2), "adam-hat-clip": lambda: tg.Adam(1e-2, eps_mode="hat", clip=0.5),
               "sgd-l2": lambda: tg.SGD(1e-2)}[kind]()
        for p in ps:
            opt.add(tape, p, l2=1e-3 if kind == "sgd-l2" else 0.0)
        prog.attach(opt)
        r = prog.runner
        assert r.team != 0 and r.table[6] == r.team   # every runner has the team
        r.team = r.lib.tg_threads_team(parts, min_upd) if parts > 1 else 0
        r._fill_table()
        for _ in range(3):
            r.episode()
        r.lib.tg_threads_team(R.update_parts(), R.SPLIT_UPDATES)   # (the library's team, as loaded)
        return [np.array(prog.value(p)) for p in ps], ps[0].size

    (one, n), (two, _), (three, _) = trained(1, 0), trained(2, R.SPLIT_UPDATES), trained(3, 1)
    assert n >= R.SPLIT_UPDATES
    for got in (two, three):
        assert all(np.array_equal(a, b) for a, b in zip(got, one))
    assert not np.array_equal(one[0], np.random.default_rng(7).standard_normal((512, 257)) * 0.05)
    assert np.array_equal(one[3], np.ones(5))
