"""interop.program_call / program_episode: captured programs as XLA FFI custom calls inside jax.jit."""
import os
import subprocess
import sys

import numpy as np
import pytest

import tapegrad as tg

interop = pytest.importorskip("interop")
chex = pytest.importorskip("chex")
optax = pytest.importorskip("optax")
from absl.testing import parameterized  # noqa: E402  (installed with chex)

from interop import ProgramError, jax, jnp  # noqa: E402
from interop.xla import program as P  # noqa: E402

RNG = np.random.default_rng(7)
DATA = [(RNG.standard_normal((5, 4)), np.eye(3)[RNG.integers(0, 3, 5)]) for _ in range(12)]
W0, B0 = RNG.standard_normal((4, 3)) * 0.5, RNG.standard_normal(3) * 0.1
NATIVE = P.native_library() is not None
BACKENDS = ["native", "numpy"] if NATIVE else ["numpy"]


def model(tape, W, b, x, y):
    return tg.softmax_cross_entropy((x @ W + b).tanh(), y)


def build(backend, optimizer=False):
    """The model's program; W is named "W", b keeps the default name "param_1"."""
    tape = tg.Tape()
    W, b = tape.param(W0, name="W"), tape.param(B0)
    x, y = tape.const(DATA[0][0]), tape.const(DATA[0][1])
    loss = model(tape, W, b, x, y)
    opt = None
    if optimizer == "plain":     # optax.adam's exact twin
        opt = tg.Adam(1e-2)
        opt.add(tape, W)
        opt.add(tape, b)
    elif optimizer == "sgd":
        opt = tg.SGD(0.1)
        opt.add(tape, W)
        opt.add(tape, b)
    elif optimizer:
        opt = tg.Adam(1e-2, clip=1.0)
        opt.add(tape, W, l2=1e-3)
        opt.add(tape, b)
    prog = tg.capture(tape, loss, backend=backend)
    if opt is not None:
        prog.attach(opt)
    return prog


def tape_reference(x, y, W=W0, b=B0):
    tape = tg.Tape()
    Wv, bv = tape.param(W), tape.param(b)
    loss = model(tape, Wv, bv, tape.const(x), tape.const(y))
    tape.backward(loss)
    return float(tape.value(loss)), np.array(tape.grad(Wv)), np.array(tape.grad(bv))


PROGS = {b: build(b) for b in BACKENDS}
CALLS = {b: interop.program_call(p) for b, p in PROGS.items()}
VG = {b: jax.jit(jax.value_and_grad(f, (0, 1))) for b, f in CALLS.items()}
ARGS = (jnp.asarray(W0), jnp.asarray(B0), jnp.asarray(DATA[1][0]), jnp.asarray(DATA[1][1]))


def close(a, b, rtol=1e-12):
    """Trees of equal structure, every leaf within ``rtol`` of ``b``'s (atol: rtol × that leaf's max |b|)."""
    jax.tree.map(lambda x, y: chex.assert_trees_all_close(
        x, y, rtol=rtol, atol=rtol * float(np.abs(np.asarray(y)).max() + 1e-300)), a, b)


class JitAndEagerTest(chex.TestCase):
    """The same program functions jitted and called eagerly: each against the tape, within its tier."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*[(b,) for b in BACKENDS])   # tuples: a lone "numpy" would be one string
    def test_value_and_grad_match_the_tape(self, backend):
        loss, grads = self.variant(jax.value_and_grad(CALLS[backend], (0, 1)))(*ARGS)
        want = tape_reference(DATA[1][0], DATA[1][1])
        if backend == "numpy":  # the NumPy replay is bit-identical to the tape
            chex.assert_trees_all_equal((loss, grads), (np.float64(want[0]), want[1:]))
        close((loss, grads), (np.float64(want[0]), want[1:]))
        assert CALLS[backend].native == (backend == "native")

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*[(b,) for b in BACKENDS])   # tuples: a lone "numpy" would be one string
    def test_episode_step_matches_the_tape(self, backend):
        prog = build(backend, optimizer=True)
        step = self.variant(interop.program_episode(prog))
        params, state = interop.episode_state(prog)
        tape, W, b, opt, mark = _tape_twin()
        for x, y in DATA[:3]:
            loss, params, state = step(params, state, (jnp.asarray(x), jnp.asarray(y)))
            ref = model(tape, W, b, tape.const(x), tape.const(y))
            tape.backward(ref)
            opt.step()
            want = (tape.value(ref).reshape(()), {"W": tape.value(W), "param_1": tape.value(b)})
            if backend == "numpy":
                chex.assert_trees_all_equal((loss, params), want)
            close((loss, params), want, rtol=1e-11)
            tape.reset_to(mark)
        assert int(state.count) == 3 and state.count.dtype == np.int32

    @chex.variants(with_jit=True, without_jit=True)
    def test_flatten_and_unflatten_are_inverse_bit_for_bit(self):
        prog = build(BACKENDS[0], optimizer=True)
        named = interop.episode_state(prog)
        flat = self.variant(lambda p, s: interop.flatten_state(prog, p, s))(*named)
        chex.assert_trees_all_equal(flat, interop.episode_state(prog, flat=True))
        back = self.variant(lambda f: interop.unflatten_state(prog, f))(flat)
        chex.assert_trees_all_equal(back, named)


def _tape_twin():
    """The eager tape + Adam that ``build(..., optimizer=True)`` captures, for step-by-step references."""
    tape = tg.Tape()
    W, b = tape.param(W0), tape.param(B0)
    opt = tg.Adam(1e-2, clip=1.0)
    opt.add(tape, W, l2=1e-3)
    opt.add(tape, b)
    return tape, W, b, opt, tape.mark()


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_callback_fallback_gives_the_same_bits_as_the_ffi_handler():
    host = interop.program_call(PROGS["native"], native=False)
    a = VG["native"](*ARGS)
    b = jax.jit(jax.value_and_grad(host, (0, 1)))(*ARGS)
    chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_and_vmap_of_grad(backend):
    f = CALLS[backend]
    Ws = jnp.stack([ARGS[0], 2 * ARGS[0], -ARGS[0]])
    losses = jax.jit(jax.vmap(f, (0, None, None, None)))(Ws, *ARGS[1:])
    grads = jax.jit(jax.vmap(jax.grad(f), (0, None, None, None)))(Ws, *ARGS[1:])
    for k in range(3):
        l0, gW0, _ = tape_reference(DATA[1][0], DATA[1][1], W=np.asarray(Ws[k]))
        close(losses[k], l0)
        close(grads[k], gW0)
    xs = jnp.stack([jnp.asarray(x) for x, _ in DATA[:3]])
    ys = jnp.stack([jnp.asarray(y) for _, y in DATA[:3]])
    g = jax.grad(lambda W: jax.vmap(f, (None, None, 0, 0))(W, ARGS[1], xs, ys).sum())(ARGS[0])
    close(g, sum(tape_reference(DATA[k][0], DATA[k][1])[1] for k in range(3)))


def test_wrong_arguments_raise_clear_errors():
    f = CALLS[BACKENDS[0]]
    with pytest.raises(ProgramError, match=r"inputs\[0\] must have shape \(5, 4\)"):
        f(ARGS[0], ARGS[1], jnp.ones((6, 4)), ARGS[3])
    with pytest.raises(ProgramError, match=r"params\[0\] \('W'\) must be float64"):
        f(ARGS[0].astype(np.float32), *ARGS[1:])
    with pytest.raises(ProgramError, match="expected 2 inputs"):
        f(*ARGS[:3])
    with pytest.raises(ProgramError, match=r"inputs\[0\]: it is a constant"):
        jax.grad(f, 2)(*ARGS)


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_handler_errors_surface_with_its_message():
    lib, names = P.native_library()
    h = np.int64(P._i64(PROGS["native"].hash64))
    spec = jax.ShapeDtypeStruct((), np.float64)
    with pytest.raises(Exception, match="takes 4 operands and gives 1 results, the call has 1"):
        jax.ffi.ffi_call(names["value"], spec)(ARGS[0], prog=h)
    with pytest.raises(Exception, match=r"operand 2 has 24 elements; the program's inputs\[0\] holds 20"):
        jax.ffi.ffi_call(names["value"], spec)(ARGS[0], ARGS[1], jnp.ones((6, 4)), ARGS[3], prog=h)
    # the handler checks dtypes itself too (program_call checks them first; a direct call meets this one)
    with pytest.raises(Exception, match=r"operand 1 has XLA dtype 11, the program runs in float64"):
        jax.ffi.ffi_call(names["value"], spec)(ARGS[0], ARGS[1].astype(jnp.float32), ARGS[2], ARGS[3], prog=h)
    assert all(n.startswith("tapegrad_") and len(n.rsplit("_", 1)[1]) == 8 for n in names.values())


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_unloaded_program_is_an_xla_error_not_a_crash():
    prog = build("native")
    f = jax.jit(interop.program_call(prog))
    assert float(f(*ARGS)) == pytest.approx(tape_reference(DATA[1][0], DATA[1][1])[0], rel=1e-12)
    assert P.unload(prog)
    try:
        with pytest.raises(Exception, match="FAILED_PRECONDITION.*is not loaded in this process"):
            f(*ARGS).block_until_ready()
    finally:
        P.load(prog)  # PROGS shares the hash (same graph): put it back


@pytest.mark.parametrize("backend", BACKENDS)
def test_episode_in_jit_updates_in_place_and_matches_the_tape(backend):
    prog = build(backend, optimizer=True)
    step = jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
    params, state = interop.episode_state(prog)
    tape, W, b, opt, mark = _tape_twin()
    def arrays(params, state):   # everything but the 0-d int32 count (converted to the program's dtype)
        return [a.unsafe_buffer_pointer() for a in jax.tree.leaves((params, state.mu, state.nu))]

    for x, y in DATA:
        before = arrays(params, state)
        loss, params, state = step(params, state, (jnp.asarray(x), jnp.asarray(y)))
        assert arrays(params, state) == before   # donated and aliased: updated in place
        ref = model(tape, W, b, tape.const(x), tape.const(y))
        tape.backward(ref)
        opt.step()
        if backend == "numpy":
            assert float(loss) == float(tape.value(ref))
        close(loss, tape.value(ref).reshape(()))
        tape.reset_to(mark)
    want = ({"W": tape.value(W), "param_1": tape.value(b)},
            optax.ScaleByAdamState(count=np.int32(len(DATA)), mu={"W": opt.mu[0], "param_1": opt.mu[1]},
                                   nu={"W": opt.nu[0], "param_1": opt.nu[1]}))
    if backend == "numpy":
        chex.assert_trees_all_equal((params, state), want, strict=True)
    close((params, state), want, rtol=1e-11)


def test_episode_state_is_named_and_shaped_as_optax():
    prog = build(BACKENDS[0], optimizer="plain")
    params, state = interop.episode_state(prog)
    assert list(params) == ["W", "param_1"] == prog.param_names
    assert type(state) is optax.ScaleByAdamState and state.count.dtype == np.int32 and int(state.count) == 0
    want = optax.adam(1e-2).init(params)[0]   # optax's own initial state for the same parameters
    chex.assert_trees_all_equal(state, want, strict=True)
    chex.assert_trees_all_equal(params, {"W": W0, "param_1": B0})
    sgd = build(BACKENDS[0], optimizer="sgd")
    assert interop.episode_state(sgd)[1] == interop.SGDState(count=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_goes_to_optax_and_back(backend):
    """Episode, then one optax.adam update on the program's gradient, then episodes again on optax's state:
    the same as episodes throughout (bit for bit on the NumPy replay, whose Adam is optax's op for op)."""
    prog, ref = build(backend, optimizer="plain"), build(backend, optimizer="plain")
    step = jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
    ref_step = jax.jit(interop.program_episode(ref), donate_argnums=(0, 1))
    grad = jax.grad(interop.program_call(prog), (0, 1))
    tx = optax.adam(1e-2)
    params, state = interop.episode_state(prog)
    rparams, rstate = interop.episode_state(ref)
    for k, (x, y) in enumerate(DATA[:4]):
        xy = (jnp.asarray(x), jnp.asarray(y))
        if k == 1:
            g = dict(zip(prog.param_names, grad(params["W"], params["param_1"], *xy)))
            updates, (state, _) = tx.update(g, (state, optax.EmptyState()), params)   # optax, op by op
            params = optax.apply_updates(params, updates)
        else:
            _, params, state = step(params, state, xy)
        _, rparams, rstate = ref_step(rparams, rstate, xy)
    assert type(state) is optax.ScaleByAdamState and int(state.count) == 4
    chex.assert_tree_all_finite((params, state))   # NaNs would compare equal below
    if backend == "numpy":
        chex.assert_trees_all_equal((params, state), (rparams, rstate), strict=True)
    close((params, state), (rparams, rstate), rtol=1e-11)


def test_named_state_errors_name_the_parameter():
    prog = build(BACKENDS[0], optimizer=True)
    step = interop.program_episode(prog)
    params, state = interop.episode_state(prog)
    xy = (jnp.asarray(DATA[0][0]), jnp.asarray(DATA[0][1]))
    with pytest.raises(ProgramError, match=r"params must have the keys \['W', 'param_1'\]; missing \['param_1'\], "
                                           r"unexpected \['b'\]"):
        step({"W": params["W"], "b": params["param_1"]}, state, xy)
    with pytest.raises(ProgramError, match=r"opt_state.nu\['W'\] must be float64\[4, 3\] .* got float64\[3, 4\]"):
        step(params, state._replace(nu={**state.nu, "W": state.nu["W"].T}), xy)
    with pytest.raises(ProgramError, match="opt_state must have a 'count' field"):
        step(params, (state.mu, state.nu), xy)
    with pytest.raises(ProgramError, match="params must be a dict"):
        step(tuple(params.values()), state, xy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_episode_equals_the_separate_layout(backend):
    prog = build(backend, optimizer=True)
    sep = jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
    flat = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
    s1, s2 = interop.episode_state(prog), interop.episode_state(prog, flat=True)
    for x, y in DATA[:4]:
        l1, *s1 = sep(*s1, (jnp.asarray(x), jnp.asarray(y)))
        before = s2.unsafe_buffer_pointer()
        l2, s2 = flat(s2, (jnp.asarray(x), jnp.asarray(y)))
        assert float(l1) == float(l2) and s2.unsafe_buffer_pointer() == before
    chex.assert_trees_all_equal(interop.unflatten_state(prog, s2), tuple(s1), strict=True)
    with pytest.raises(ProgramError, match=r"state\[0\] must have shape"):
        flat(s2[:-1], (jnp.asarray(DATA[0][0]), jnp.asarray(DATA[0][1])))


def test_episode_needs_an_optimizer():
    with pytest.raises(ProgramError, match="attach an optimizer"):
        interop.program_episode(PROGS[BACKENDS[0]])


SHARD = r'''
import os, sys, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, tapegrad as tg, interop
from interop import jax, jnp
from jax.sharding import PartitionSpec as P, NamedSharding
rng = np.random.default_rng(0)
tape = tg.Tape()
W = tape.param(rng.standard_normal((4, 3)) * .5); b = tape.param(np.zeros(3))
loss = tg.softmax_cross_entropy((tape.const(np.zeros((5, 4))) @ W + b).tanh(), tape.const(np.zeros((5, 3))))
f = interop.program_call(tg.capture(tape, loss, backend=sys.argv[1]))
X = jnp.asarray(rng.standard_normal((20, 4))); Y = jnp.asarray(np.eye(3)[rng.integers(0, 3, 20)])
ps = (jnp.asarray(tape.value(W)), jnp.asarray(tape.value(b)))
mesh = jax.make_mesh((4,), ("data",))
@jax.jit
@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), (P(), P())))
def dp(W, b, x, y):
    l, g = jax.value_and_grad(f, (0, 1))(W, b, x, y)
    return jax.lax.psum(l, "data"), g          # no psum on g: the replicated params' grads are summed already
sh = NamedSharding(mesh, P("data"))
l, g = dp(*ps, jax.device_put(X, sh), jax.device_put(Y, sh))
parts = [(X[k * 5:(k + 1) * 5], Y[k * 5:(k + 1) * 5]) for k in range(4)]
ref = [jax.value_and_grad(f, (0, 1))(*ps, x, y) for x, y in parts]
rl = sum(r[0] for r in ref); rg = [sum(r[1][i] for r in ref) for i in (0, 1)]
assert len(jax.devices()) == 4
err = max([abs(float(l - rl)) / abs(float(rl))] + [float(abs(a - r).max() / abs(r).max()) for a, r in zip(g, rg)])
print("maxrel", err)
assert err <= 1e-14, err
'''


@pytest.mark.parametrize("backend", BACKENDS)
def test_data_parallel_grads_under_shard_map_on_four_host_devices(backend):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", SHARD, backend], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "maxrel" in r.stdout


NO_CC = r'''
import numpy as np, tapegrad as tg, interop
from interop import jax, jnp
from interop.xla import program as P
assert P.native_library() is None and "compiler" in P._LIB["why"], P._LIB
tape = tg.Tape()
W = tape.param(np.arange(12.0).reshape(4, 3) / 10); x = tape.const(np.ones((2, 4)))
loss = ((x @ W).tanh() * (x @ W)).mean()
f = interop.program_call(tg.capture(tape, loss))          # numpy backend: no compiler needed
assert not f.native
l, g = jax.jit(jax.value_and_grad(f))(jnp.asarray(tape.value(W)), jnp.asarray(tape.value(x)))
tape.backward(loss)
assert float(l) == float(tape.value(loss)) and (np.asarray(g) == tape.grad(W)).all()
print("ok")
'''


def test_without_a_c_compiler_the_callback_path_runs():
    env = dict(os.environ, CC="/nonexistent/cc")
    r = subprocess.run([sys.executable, "-c", NO_CC], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ── the FFI handler runs on XLA's buffers: the same bits as the copying (host-callback) path ──

def bits(a, b):
    chex.assert_trees_all_equal(a, b, strict=True)   # same structure, shapes, dtypes and bits


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
@pytest.mark.parametrize("flat", [False, True])
def test_zero_copy_episode_gives_the_copying_paths_bits(flat):
    prog = build("native", optimizer=True)
    ffi = jax.jit(interop.program_episode(prog, flat=flat), donate_argnums=0 if flat else (0, 1, 2))
    host = jax.jit(interop.program_episode(prog, flat=flat, native=False))
    a = interop.episode_state(prog, flat=flat)
    b = jax.tree.map(jnp.array, a)
    for x, y in DATA[:6]:
        xy = (jnp.asarray(x), jnp.asarray(y))
        la, *a = ffi(*([a] if flat else a), xy)
        lb, *b = host(*([b] if flat else b), xy)
        a, b = (a[0], b[0]) if flat else (a, b)
        assert float(la) == float(lb)
        bits(a, b)


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_zero_copy_vmap_gives_the_copying_paths_bits():
    ffi, host = CALLS["native"], interop.program_call(PROGS["native"], native=False)
    Ws = jnp.stack([ARGS[0], 2 * ARGS[0], -ARGS[0]])
    xs = jnp.stack([jnp.asarray(x) for x, _ in DATA[:3]])
    for f in (lambda g: jax.vmap(jax.value_and_grad(g, (0, 1)), (0, None, 0, None)),):
        bits(jax.jit(f(ffi))(Ws, ARGS[1], xs, ARGS[3]), jax.jit(f(host))(Ws, ARGS[1], xs, ARGS[3]))


def square_model(backend, optimizer=False):
    """A program whose parameter and two inputs share one shape, so one XLA buffer can fill several."""
    tape = tg.Tape()
    W = tape.param(RNG.standard_normal((3, 3)) * 0.5)
    x, y = tape.const(np.zeros((3, 3))), tape.const(np.zeros((3, 3)))
    loss = ((x @ W).tanh() * y + W * x).sum()
    prog = tg.capture(tape, loss, backend=backend)
    if optimizer:
        opt = tg.Adam(1e-2)
        opt.add(tape, W)
        prog.attach(opt)
    return prog, np.array(tape.value(W))


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_one_buffer_passed_for_several_operands():
    prog, W = square_model("native")
    ffi, host = interop.program_call(prog), interop.program_call(prog, native=False)
    x = jnp.asarray(RNG.standard_normal((3, 3)))
    for f in (ffi, host):
        assert f.native == (f is ffi)
    # inside one jit the same value feeds both inputs (and the parameter): XLA passes one buffer
    same = [jax.jit(jax.value_and_grad(lambda W, x: f(W, x, x)))(jnp.asarray(W), x) for f in (ffi, host)]
    bits(*same)
    every = [jax.jit(lambda x: jax.value_and_grad(lambda W: f(W, x, x))(x))(x) for f in (ffi, host)]
    bits(*every)
    tape = tg.Tape()
    Wv = tape.param(np.asarray(x))
    xv = tape.const(np.asarray(x))
    loss = ((xv @ Wv).tanh() * xv + Wv * xv).sum()
    tape.backward(loss)
    close(every[0][0], tape.value(loss))
    close(every[0][1], tape.grad(Wv))


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_episode_whose_parameter_is_also_an_input():
    prog, W = square_model("native", optimizer=True)
    runs = []
    for native in (True, False):
        f = interop.program_episode(prog, native=native)
        step = jax.jit(lambda p, s, f=f: f(p, s, (p["param_0"], p["param_0"])))
        params, state = interop.episode_state(prog)
        out = []
        for _ in range(3):   # the parameter is read as both inputs while the step updates it
            loss, params, state = step(params, state)
            out.append((loss, params, state))
        runs.append(out)
    bits(*runs)
    assert int(runs[0][-1][2].count) == 3


SHARD_EPISODE = r'''
import os, sys, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, tapegrad as tg, interop
from interop import jax, jnp
from interop.xla import program as PR
from jax.sharding import PartitionSpec as P, NamedSharding
rng = np.random.default_rng(0)
tape = tg.Tape()
W = tape.param(rng.standard_normal((4, 3)) * .5); b = tape.param(np.zeros(3))
loss = tg.softmax_cross_entropy((tape.const(np.zeros((5, 4))) @ W + b).tanh(), tape.const(np.zeros((5, 3))))
prog = tg.capture(tape, loss, backend="native")
opt = tg.Adam(1e-2); opt.add(tape, W); opt.add(tape, b); prog.attach(opt)
step = interop.program_episode(prog, flat=True)
s0 = interop.episode_state(prog, flat=True)
X = jnp.asarray(rng.standard_normal((20, 4))); Y = jnp.asarray(np.eye(3)[rng.integers(0, 3, 20)])
mesh = jax.make_mesh((4,), ("data",))
@jax.jit
@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=(P("data"), P("data")))
def each(s, x, y):     # every shard trains its own copy of the state on its own data: no communication
    l, s = step(s[0], (x, y))
    l, s = step(s, (x, y))
    return l[None], s[None]
sh = NamedSharding(mesh, P("data"))
S = jax.device_put(jnp.stack([s0 * (1 + k) for k in range(4)]), sh)
l, s = jax.block_until_ready(each(S, jax.device_put(X, sh), jax.device_put(Y, sh)))   # (dispatch is asynchronous)
assert len(jax.devices()) == 4 and PR.stats(prog)["instances"] == 4, PR.stats(prog)
l, s = np.asarray(l), np.asarray(s)
one = jax.jit(step)
for k in range(4):
    x, y = X[5 * k:5 * k + 5], Y[5 * k:5 * k + 5]
    lk, sk = one(s0 * (1 + k), (x, y))
    lk, sk = one(sk, (x, y))
    assert float(lk) == l[k] and (np.asarray(sk) == s[k]).all(), k
print("ok", PR.stats(prog)["instances"])
'''


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_episode_per_shard_on_four_host_devices_runs_one_instance_each():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", SHARD_EPISODE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok 4" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_products_split_over_xlas_thread_pool_give_the_same_bits(monkeypatch):
    """Inside the handler, products from SPLIT_PRODUCTS multiply-adds up are split by rows over XLA's
    intra-op pool: loss, gradients and episode the same bits as the copying path (one BLAS call each)."""
    monkeypatch.setattr(P, "SPLIT_PRODUCTS", 64)
    monkeypatch.setenv("TAPEGRAD_SMALL_GEMM", "0")
    rng = np.random.default_rng(3)
    tape = tg.Tape()
    W1, W2 = tape.param(rng.standard_normal((9, 24)) * 0.3), tape.param(rng.standard_normal((24, 5)) * 0.3)
    x, y = tape.const(rng.standard_normal((40, 9))), tape.const(np.eye(5)[rng.integers(0, 5, 40)])
    prog = tg.capture(tape, tg.softmax_cross_entropy((x @ W1).tanh() @ W2, y), backend="native")
    opt = tg.Adam(1e-2)
    opt.add(tape, W1)
    opt.add(tape, W2)
    prog.attach(opt)
    args = [jnp.asarray(tape.value(v)) for v in (W1, W2, x, y)]
    vg = [jax.jit(jax.value_and_grad(interop.program_call(prog, native=n), (0, 1)))(*args) for n in (True, False)]
    bits(*vg)
    eps = []
    for n in (True, False):
        step = jax.jit(interop.program_episode(prog, flat=True, native=n))
        s = interop.episode_state(prog, flat=True)
        for _ in range(3):
            loss, s = step(s, tuple(args[2:]))
        eps.append((loss, s))
    bits(*eps)
    assert P.stats(prog)["splits"] > 0 or os.cpu_count() == 1   # XLA's pool has a thread per core


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
@pytest.mark.parametrize("make", [lambda: tg.Adam(1e-2), lambda: tg.Adam(1e-2, eps_mode="hat", clip=0.5),
                                  lambda: tg.SGD(0.1, clip=0.5, clip_mode="seed")], ids=["adam", "adam-hat", "sgd"])
def test_optimizer_updates_split_over_xlas_thread_pool_give_the_same_bits(monkeypatch, make):
    """Updates of at least SPLIT_UPDATES parameters are split into element ranges over XLA's pool: the
    ranges end inside a parameter (49 elements in two parts: b1's are split 3 + 4) and skip a parameter
    the loss does not reach, and the episode's
    loss and state keep the bits of the unsplit copying path and of the program run directly."""
    monkeypatch.setattr(P, "SPLIT_PRODUCTS", 0)
    monkeypatch.setattr(P, "SPLIT_UPDATES", 8)
    rng = np.random.default_rng(4)
    tape = tg.Tape()
    W1, idle = tape.param(rng.standard_normal((3, 7)) * 0.3), tape.param(rng.standard_normal(5))
    b1, W2 = tape.param(rng.standard_normal(7) * 0.1), tape.param(rng.standard_normal((7, 3)) * 0.3)
    x, y = tape.const(rng.standard_normal((6, 3))), tape.const(rng.standard_normal((6, 3)))
    loss = (((x @ W1 + b1).tanh() @ W2 - y) ** 2).mean()

    def program():
        prog, opt = tg.capture(tape, loss, backend="native"), make()
        for w, l2 in ((W1, 0.0), (idle, 0.0), (b1, 1e-3), (W2, 0.0)):
            opt.add(tape, w, l2=l2)
        prog.attach(opt)
        return prog

    alone = program()   # run directly on its own table: no pool, one thread
    direct = [alone.episode() for _ in range(3)]
    flat = np.concatenate([alone.value(w).ravel() for w in (W1, idle, b1, W2)])
    prog = program()
    data = tuple(jnp.asarray(tape.value(v)) for v in (x, y))
    runs = []
    for native in (True, False):
        step = jax.jit(interop.program_episode(prog, flat=True, native=native))
        s = interop.episode_state(prog, flat=True)
        losses = []
        for _ in range(3):
            value, s = step(s, data)
            losses.append(value)
        runs.append((losses, s))
    bits(*runs)
    assert P.stats(prog)["splits"] == 3 or os.cpu_count() == 1   # one split update per step, no products
    assert [float(v) for v in runs[0][0]] == direct and (np.asarray(runs[0][1])[:flat.size] == flat).all()


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the FFI handler cannot be built")
def test_attaching_again_repoints_the_ffi_entry_or_retires_the_old_configuration():
    """The same configuration attached again keeps the program's hash: the jitted step keeps running (on
    the new state). Another configuration changes the hash: the old entry is dropped, so an executable
    traced for it fails with an XLA error instead of running on stale buffers."""
    tape = tg.Tape()
    W, b = tape.param(W0, name="W"), tape.param(B0)
    loss = model(tape, W, b, tape.const(DATA[0][0]), tape.const(DATA[0][1]))
    prog = tg.capture(tape, loss, backend="native")

    def sgd(lr):
        opt = tg.SGD(lr)
        opt.add(tape, W)
        opt.add(tape, b)
        return opt
    prog.attach(sgd(0.1))
    step = jax.jit(interop.program_episode(prog))
    params, state = interop.episode_state(prog)
    batch = (jnp.asarray(DATA[1][0]), jnp.asarray(DATA[1][1]))
    first = step(params, state, batch)
    h = prog.hash64
    prog.attach(sgd(0.1))                       # same configuration: re-pointed, still callable
    assert prog.hash64 == h and P.stats(prog) is not None
    again = step(params, state, batch)
    chex.assert_trees_all_equal(again, first)
    prog.attach(sgd(0.05))                      # another configuration: the old entry is gone
    assert prog.hash64 != h
    with pytest.raises(Exception, match="is not loaded in this process"):
        jax.block_until_ready(step(params, state, batch))
    assert P.unload(h) is False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factory", [lambda: tg.Adam(0.0, weight_decay=0.1, clip=1.0),
                                     lambda: tg.SGD(0.0, momentum=0.9, nesterov=True)], ids=["adamw", "nesterov"])
def test_an_episode_takes_its_learning_rate_and_data_slots_per_call(backend, factory):
    """lr=True: a schedule's value per step in place of the optimizer's; data=True: the masks of each call."""
    def record(tape, W, mask):
        return (tg.where(mask, (tape.const(DATA[0][0]) @ W).tanh(), 0.0) ** 2).sum()
    tape = tg.Tape()
    W = tape.param(W0, name="W")
    mask = tape.const(np.ones((5, 3), bool))
    opt = factory()
    opt.add(tape, W)
    prog = tg.capture(tape, record(tape, W, mask), backend=backend)
    prog.attach(opt)
    step = interop.program_episode(prog, data=True, lr=True)
    run = jax.jit(step, donate_argnums=(0, 1))
    params, opt_state = interop.episode_state(prog)
    masks = [RNG.random((5, 3)) < 0.6 for _ in range(4)]
    rates = [0.1, 0.05, 0.0, 0.02]
    for m, lr in zip(masks, rates):
        loss, params, opt_state = run(params, opt_state, interop.program_inputs(prog), data=(jnp.asarray(m),),
                                      lr=jnp.asarray(lr))
    # the tape, stepping with each rate and mask
    ref = tg.Tape()
    Wr = ref.param(W0)
    o = factory()
    o.add(ref, Wr)
    start = ref.mark()
    for m, lr in zip(masks, rates):
        o.lr = lr
        ref.backward(record(ref, Wr, ref.const(m)))
        o.step()
        ref.reset_to(start)
    np.testing.assert_allclose(np.asarray(params["W"]), ref.value(Wr), rtol=1e-13, atol=1e-15)
    assert int(opt_state.count) == 4
    with pytest.raises(ProgramError, match="built with lr=True: pass lr="):
        step(params, opt_state, interop.program_inputs(prog), data=(jnp.asarray(masks[0]),))
    with pytest.raises(ProgramError, match=r"data\[0\] must be bool"):
        step(params, opt_state, interop.program_inputs(prog), data=(jnp.zeros((5, 3)),), lr=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "named"])
def test_a_float32_episode_counts_past_2_to_the_24(backend, flat):
    """A float32 holds integers exactly only up to 2**24: the count travels as int32's bits."""
    tape = tg.Tape(dtype="float32")
    W = tape.param(W0.astype(np.float32), name="W")
    opt = tg.Adam(1e-2)
    opt.add(tape, W)
    loss = (tape.const(DATA[0][0].astype(np.float32)) @ W).tanh().sum()
    prog = tg.capture(tape, loss, backend=backend)
    prog.attach(opt)
    prog.load_optimizer_state({**prog.optimizer_state(), "count": 2 ** 24})
    step = jax.jit(interop.program_episode(prog, flat=flat))
    state = interop.episode_state(prog, flat=flat)
    inputs = interop.program_inputs(prog)
    for _ in range(3):
        if flat:
            _, state = step(state, inputs)
        else:
            _, *state = step(*state, inputs)
    count = (interop.unflatten_state(prog, state)[1] if flat else state[1]).count
    assert count.dtype == jnp.int32 and int(count) == 2 ** 24 + 3
