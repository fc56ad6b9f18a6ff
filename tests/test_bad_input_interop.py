"""Bad input at the JAX boundary and to the C emitter: named errors instead of raw JAX, DLPack or
compiler messages, and no stale state after re-attaching an optimizer to a jitted program."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import interop
import tapegrad as tg
from interop import jax, jnp
from tapegrad.emit import EmitError, c_grad

from fault_util import raises_cleanly, tape_state

# ── DLPack bridges ───────────────────────────────────────────────────────────

BRIDGE = [
    ("to_jax object", lambda: interop.to_jax(np.array([1, None], object)), tg.DTypeError,
     r"to_jax: JAX has no dtype for object arrays \(kind 'O'\); convert them first"),
    ("to_jax str", lambda: interop.to_jax(np.array(["a"])), tg.DTypeError, r"to_jax: JAX has no dtype for <U1 arrays"),
    ("to_jax datetime", lambda: interop.to_jax(np.array(["2020-01-01"], "datetime64[D]")), tg.DTypeError,
     r"to_jax: JAX has no dtype for datetime64\[D\] arrays"),
    ("to_jax big-endian no copy", lambda: interop.to_jax(np.ones(3, ">f8"), copy=False), ValueError,
     r"to_jax: cannot share a >f8 \(non-native byte order\) array without a copy"),
    ("to_jax copy=2", lambda: interop.to_jax(np.ones(3), copy=2), ValueError, r"to_jax: copy must be None, True or False, got 2"),
    ("from_jax ndarray", lambda: interop.from_jax(np.ones(3)), tg.ArgumentError, r"from_jax: expected a jax.Array, got ndarray"),
    ("from_jax in jit", lambda: jax.jit(interop.from_jax)(jnp.ones(3)), tg.ArgumentError,
     r"from_jax: got a traced float64\[3\] value \(inside jit, grad or vmap\), which has no memory to view"),
    ("from_jax in grad", lambda: jax.grad(lambda x: interop.from_jax(x).sum())(jnp.ones(3)), tg.ArgumentError,
     r"from_jax: got a traced"),
    ("from_jax bf16 no copy", lambda: interop.from_jax(jnp.ones(3, jnp.bfloat16), copy=False), ValueError,
     r"from_jax: cannot view a bfloat16\[3\] array from NumPy without a copy: NumPy cannot import dtype bfloat16"),
    ("from_jax empty no copy", lambda: interop.from_jax(jnp.ones(0), copy=False), ValueError, r"it is empty"),
]


@pytest.mark.parametrize("case", BRIDGE, ids=[c[0] for c in BRIDGE])
def test_bridge_errors_are_named(case):
    _, fn, exc, match = case
    raises_cleanly(exc, match, fn)


def test_big_endian_arrays_are_converted_not_refused():
    a = np.arange(3.0).astype(">f8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no "copying" warning followed by a failure
        j = interop.to_jax(a)
    assert np.array_equal(np.asarray(j), [0.0, 1.0, 2.0]) and j.dtype == jnp.float64


def test_bfloat16_from_jax_copies_with_a_warning():
    with pytest.warns(interop.CopyWarning, match=r"from_jax: copying a bfloat16\[3\] array: NumPy cannot import"):
        v = interop.from_jax(jnp.array([1.0, 2.0, 3.0], jnp.bfloat16))
    assert v.astype(np.float64).tolist() == [1.0, 2.0, 3.0] and not v.flags.writeable


SHARDED = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import warnings, numpy as np, interop
from interop import jax, jnp
mesh = jax.make_mesh((2,), ("x",))
x = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
try:
    interop.from_jax(x, copy=False)
except ValueError as e:
    print("refused:", e)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    v = interop.from_jax(x)
print("copied:", v.tolist(), str(w[0].message))
"""


def test_an_array_sharded_over_several_devices():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: from_jax: cannot view a float64[4] array from NumPy without a copy: it is sharded over 2 devices" \
        in r.stdout, r.stderr
    assert "copied: [0.0, 1.0, 2.0, 3.0] from_jax: copying a float64[4] array: it is sharded over 2 devices" in r.stdout


# ── jax_function and programs under JAX transformations ─────────────────────

def square_sum(tape, x):
    return (x * x).sum()


def test_jax_function_argument_errors():
    f = interop.jax_function(square_sum)
    raises_cleanly(tg.DTypeError, r"jax_function\(square_sum\): arguments must be float32/float64 arrays, got \['int32'\]",
                   lambda: f(jnp.ones(3, jnp.int32)))
    g = interop.jax_function(lambda tape, x: 3.0)
    raises_cleanly(tg.ArgumentError, r"jax_function\(<lambda>\): build must return a Var, got float", lambda: g(jnp.ones(3)))
    h = interop.jax_function(lambda tape, x: x @ x)
    raises_cleanly(tg.ShapeError, r"matmul \(node 1\): inner dimensions differ", lambda: h(jnp.ones((2, 3))))


@pytest.mark.parametrize("transform", ["hessian", "jvp", "jacfwd", "grad of grad"])
def test_second_order_and_forward_mode_say_first_order_only(transform):
    tape = tg.Tape()
    w = tape.param(np.ones(3))
    prog = tg.capture(tape, (w * w * w).sum())
    f = interop.program_call(prog)
    x = jnp.array([1.0, 2.0, 3.0])
    run = {"hessian": lambda: jax.hessian(f)(x), "jvp": lambda: jax.jvp(f, (x,), (x,)),
           "jacfwd": lambda: jax.jacfwd(f)(x), "grad of grad": lambda: jax.grad(lambda y: jax.grad(f)(y).sum())(x)}
    raises_cleanly(interop.TransformError, r"program_call: forward-mode and higher-order differentiation .* tapegrad "
                                           r"gradients are first-order only: use jax.grad / vjp / jacrev", run[transform])
    assert float(jax.grad(f)(x)[1]) == 12.0         # first order still works


def test_program_call_argument_errors_name_the_slot():
    tape = tg.Tape()
    w = tape.param(np.ones(3))
    c = tape.const(np.ones(3))
    prog = tg.capture(tape, (w * c).sum())
    f = interop.program_call(prog)
    for args, match in [((jnp.ones(4), jnp.ones(3)), r"program_call: params\[0\] \('param_0'\) must have shape \(3,\) \(the captured shape\), got \(4,\)"),
                        ((jnp.ones(3),), r"program_call: expected 1 inputs arrays \[\(3,\)\], got 0"),
                        ((jnp.ones(3, jnp.float32), jnp.ones(3)), r"program_call: params\[0\] \('param_0'\) must be float64"),
                        ((jnp.ones(3), jnp.ones((3, 1))), r"program_call: inputs\[0\] must have shape \(3,\)")]:
        raises_cleanly(interop.ProgramError, match, lambda: f(*args), lambda: np.array(prog.val[0]))
    raises_cleanly(interop.ProgramError, r"program_episode: attach an optimizer first", lambda: interop.program_episode(prog))


def reattach_model(backend, rows=5):
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((4, 3)))
    x = tape.const(rng.standard_normal((rows, 4)))
    loss = (x @ w).tanh().sum()
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    p = tg.capture(tape, loss, backend=backend)
    p.attach(opt)
    return tape, w, p


def test_reattaching_an_optimizer_after_jit_uses_the_new_state():
    tape, w, p = reattach_model("native")
    episode = interop.program_episode(p)
    assert episode.native
    step = jax.jit(episode)
    params, st = interop.episode_state(p)
    inputs = interop.program_inputs(p)
    for _ in range(3):
        _, params, st = step(params, st, inputs)
    fresh = tg.Adam(0.1)
    fresh.add(tape, w)
    p.attach(fresh)                               # new moment buffers inside the program
    params, st = interop.episode_state(p)
    _, wref, ref = reattach_model("native")       # the same program driven directly: the expected bits
    ref.set_input(wref, np.asarray(params["param_0"]))
    for _ in range(3):
        _, params, st = step(params, st, inputs)
        ref.episode()
    rs = ref.optimizer_state()
    assert np.array_equal(np.asarray(params["param_0"]), ref.value(wref))
    assert np.array_equal(np.asarray(st.mu["param_0"]), rs["mu"][0])
    assert np.array_equal(np.asarray(st.nu["param_0"]), rs["nu"][0])
    assert int(st.count) == rs["count"] == 3


def test_reattaching_another_configuration_makes_old_executables_fail_loudly():
    # a model of its own: no other program in the process has its hash (one that has serves the old entry)
    tape, w, p = reattach_model("native", rows=7)
    step = jax.jit(interop.program_episode(p))
    step(*interop.episode_state(p), interop.program_inputs(p))
    other = tg.Adam(0.5)
    other.add(tape, w)
    p.attach(other)                               # another hash: the old executable's entry is gone
    with pytest.raises(Exception, match=r"is not loaded in this process"):
        jax.block_until_ready(step(*interop.episode_state(p), interop.program_inputs(p)))
    fresh = jax.jit(interop.program_episode(p))
    loss, *_ = fresh(*interop.episode_state(p), interop.program_inputs(p))
    assert np.isfinite(float(loss))


# ── the C emitter ────────────────────────────────────────────────────────────

def scalar_tape():
    t = tg.Tape()
    w = t.param(np.array(2.0))
    x = t.const(np.array(0.5))
    return t, w, x, (w * x).tanh() * 3.0


EMIT = [
    ("keyword name", lambda t, w, x, l: c_grad(t, l, [w], {x: "v[0]"}, with_data=True, name="int"),
     r"c_grad: name 'int' is a C keyword or a name the emitted code uses"),
    ("math.h name", lambda t, w, x, l: c_grad(t, l, [w], {x: "v[0]"}, with_data=True, name="exp"), r"name 'exp' is a C keyword"),
    ("generated name", lambda t, w, x, l: c_grad(t, l, [w], {x: "v[0]"}, with_data=True, name="g4"), r"name 'g4'"),
    ("not an identifier", lambda t, w, x, l: c_grad(t, l, [w], {x: "1.0"}, name="my-grad"), r"c_grad: name must be a C identifier, got 'my-grad'"),
    ("v without with_data", lambda t, w, x, l: c_grad(t, l, [w], {x: "v[0]"}),
     r"const \(node 1\): the leaf expression 'v\[0\]' reads the data row v, but with_data=False"),
    ("leaves not a dict", lambda t, w, x, l: c_grad(t, l, [w], [(x, "1.0")]), r"c_grad: leaves must be a dict"),
    ("statement in a leaf", lambda t, w, x, l: c_grad(t, l, [w], {x: "1.0; system(0)"}), r"const \(node 1\): expected a C expression"),
    ("param as leaf", lambda t, w, x, l: c_grad(t, l, [w], {w: "1.0", x: "1.0"}), r"param \(node 0\): leaves binds constants only"),
    ("missing param", lambda t, w, x, l: c_grad(t, l, [], {x: "1.0"}), r"param \(node 0\): the loss depends on this parameter"),
    ("param twice", lambda t, w, x, l: c_grad(t, l, [w, w], {x: "1.0"}), r"param \(node 0\): params lists this parameter twice"),
    ("unbound const", lambda t, w, x, l: c_grad(t, l, [w], {}), r"const \(node 1\): the loss reads this constant but leaves does not bind it"),
    ("dialect", lambda t, w, x, l: c_grad(t, l, [w], {x: "1.0"}, dialect="opencl"), r"c_grad: dialect must be 'c' or 'cuda', got 'opencl'"),
]


@pytest.mark.parametrize("case", EMIT, ids=[c[0] for c in EMIT])
def test_emit_errors_come_before_the_compiler(case):
    _, fn, match = case
    t, w, x, loss = scalar_tape()
    raises_cleanly(EmitError, match, lambda: fn(t, w, x, loss), lambda: tape_state(t))


def test_emit_non_scalar_and_float32_tapes():
    t = tg.Tape()
    w = t.param(np.ones(2))
    total = w.sum()
    raises_cleanly(EmitError, r"param \(node 0\): expected one element \(c_grad emits scalar tapes\), got shape \(2,\)",
                   lambda: c_grad(t, total, [w], {}), lambda: tape_state(t))
    t32 = tg.Tape(np.float32)
    w32 = t32.param(np.ones(1))
    raises_cleanly(EmitError, r"c_grad: expected a float64 tape", lambda: c_grad(t32, w32 * 2.0, [w32], {}))


FALLBACK = r"""
import logging
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from interop.xla import program
print(program.native_library())
"""


def test_the_fallback_to_the_host_callback_is_logged_once():
    env = {**os.environ, "CC": "/nonexistent/cc", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "None"
    lines = [x for x in r.stderr.splitlines() if x.startswith("tapegrad ")]
    assert len(lines) == 1 and lines[0].startswith("tapegrad INFO interop: the native FFI handler is unavailable, "
                                                   "programs run through the host callback instead (BuildError: ")
