"""interop: DLPack bridges and tape functions as JAX functions (jit, grad, vmap and compositions)."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

import tapegrad as tg

interop = pytest.importorskip("interop")
chex = pytest.importorskip("chex")
from interop import CopyWarning, TransformError, jax, jnp  # noqa: E402


def ptr(a):
    return a.__array_interface__["data"][0]


# ── DLPack ───────────────────────────────────────────────────────────────────

def test_tapegrad_never_imports_jax():
    code = "import sys, tapegrad, tapegrad.optim, tapegrad.gradcheck; print(any(m == 'jax' or m.startswith('jax.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_tape_value_and_grad_go_to_jax_without_copy():
    tape = tg.Tape()
    w = tape.param(np.arange(6.0).reshape(2, 3))
    tape.backward((w * w).sum())
    for view in (tape.value(w), tape.grad(w)):
        j = interop.to_jax(view, copy=False)
        assert j.unsafe_buffer_pointer() == ptr(view)
        np.testing.assert_array_equal(np.asarray(j), view)


def test_program_buffers_go_to_jax_without_copy():
    tape = tg.Tape()
    w = tape.param(np.arange(6.0).reshape(2, 3))
    prog = tg.capture(tape, (w * w).sum())
    prog.forward()
    prog.backward()
    for view in (prog.value(w), prog.grad(w), prog.loss()):
        j = interop.to_jax(view, copy=False)
        assert j.unsafe_buffer_pointer() == ptr(view)
        np.testing.assert_array_equal(np.asarray(j), view)


def test_from_jax_is_a_read_only_view():
    j = jnp.arange(8.0)
    v = interop.from_jax(j, copy=False)
    assert ptr(v) == j.unsafe_buffer_pointer() and not v.flags.writeable
    with pytest.raises(ValueError):
        v[0] = 1.0
    c = interop.from_jax(j, copy=True)
    assert c.flags.writeable and ptr(c) != j.unsafe_buffer_pointer()


@pytest.mark.parametrize("make, why", [
    (lambda: np.arange(9.0)[1:], "64-byte"),
    (lambda: tg._arena.aligned_empty((4, 4), np.float64)[:, ::2], "strided"),
    (lambda: interop.from_jax(jnp.ones(8)), "read-only"),
    (lambda: np.zeros(0), "empty"),
], ids=["unaligned", "strided", "read-only", "empty"])
def test_copy_false_says_why_and_none_copies_loudly(make, why):
    a = make()
    with pytest.raises(ValueError, match=why):
        interop.to_jax(a, copy=False)
    with pytest.warns(CopyWarning, match=why):
        j = interop.to_jax(a)
    np.testing.assert_array_equal(np.asarray(j), a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        j = interop.to_jax(a, copy=True)
    np.testing.assert_array_equal(np.asarray(j), a)


def test_copy_true_is_a_snapshot():
    a = tg._arena.aligned_empty((4,), np.float64)
    a[:] = 1.0
    shared, snap = interop.to_jax(a), interop.to_jax(a, copy=True)
    a[:] = 2.0  # the documented aliasing: a zero-copy array follows the tape's memory
    assert float(shared[0]) == 2.0 and float(snap[0]) == 1.0


def test_cupy_bridges_need_cupy():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="CuPy"):
            interop.cupy_to_jax(np.ones(3))
        return
    pytest.skip("CuPy present: the GPU bridge is exercised by the GPU device check")


# ── jax_function ─────────────────────────────────────────────────────────────

def _mlp(tape, x, w, b):
    return ((x @ w + b).tanh() * 1.5).sum()


def _mlp_ref(x, w, b):
    return (jnp.tanh(x @ w + b) * 1.5).sum()


F = interop.jax_function(_mlp)
RNG = np.random.default_rng(0)
X, W, B = (jnp.asarray(RNG.standard_normal(s)) for s in ((3, 4), (4, 2), (2,)))
XS = jnp.asarray(RNG.standard_normal((5, 3, 4)))


def close(a, b, rtol=1e-12):
    """Trees of equal structure, every leaf within ``rtol`` of ``b``'s (atol: rtol × that leaf's max |b|)."""
    jax.tree.map(lambda x, y: chex.assert_trees_all_close(
        x, y, rtol=rtol, atol=rtol * float(np.abs(np.asarray(y)).max() + 1e-300)), a, b)


@pytest.mark.parametrize("transform", [
    lambda f: jax.jit(f),
    lambda f: jax.grad(f, (0, 1, 2)),
    lambda f: jax.jit(jax.value_and_grad(f, (1, 2))),
], ids=["jit", "grad", "jit_value_and_grad"])
def test_jax_function_matches_jax(transform):
    close(transform(F)(X, W, B), transform(_mlp_ref)(X, W, B))


class JaxFunctionJitAndEagerTest(chex.TestCase):
    """A tape-backed function gives the same bits jitted and eagerly (the tape runs on the host either way)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_and_grad(self):
        for fn in (F, jax.value_and_grad(F, (0, 1, 2))):
            got = self.variant(fn)(X, W, B)
            chex.assert_trees_all_equal(got, jax.jit(fn)(X, W, B))
        close(got, jax.value_and_grad(_mlp_ref, (0, 1, 2))(X, W, B))

    @chex.variants(with_jit=True, without_jit=True)
    def test_vmap_of_grad(self):
        vg = jax.vmap(jax.grad(F, 1), (0, None, None))
        got = self.variant(vg)(XS, W, B)
        chex.assert_trees_all_equal(got, jax.jit(vg)(XS, W, B))
        close(got, jax.vmap(jax.grad(_mlp_ref, 1), (0, None, None))(XS, W, B))


def test_jax_function_vmap_and_compositions():
    close(jax.vmap(F, (0, None, None))(XS, W, B), jax.vmap(_mlp_ref, (0, None, None))(XS, W, B))
    vg = lambda f: jax.jit(jax.vmap(jax.grad(f, 1), (0, None, None)))  # noqa: E731
    close(vg(F)(XS, W, B), vg(_mlp_ref)(XS, W, B))
    gv = lambda f: jax.grad(lambda w: jax.vmap(f, (0, None, None))(XS, w, B).sum())  # noqa: E731
    close(gv(F)(W), gv(_mlp_ref)(W))
    h = interop.jax_function(lambda tape, x: (x * x).tanh())
    close(jax.jacrev(h)(B), jax.jacrev(lambda x: jnp.tanh(x * x))(B))


@pytest.mark.parametrize("transform", [
    lambda f: jax.jvp(f, (X, W, B), (X, W, B)),
    lambda f: jax.grad(lambda w: jax.grad(f, 1)(X, w, B).sum())(W),
    lambda f: jax.jacfwd(f, 2)(X, W, B),
], ids=["jvp", "grad_of_grad", "jacfwd"])
def test_jax_function_unsupported_transforms_say_so(transform):
    with pytest.raises(TransformError, match="not supported"):
        transform(F)


def test_jax_function_float32_and_bad_dtypes():
    g = jax.grad(F, 1)(X.astype(np.float32), W.astype(np.float32), B.astype(np.float32))
    assert g.dtype == np.float32
    close(g, jax.grad(_mlp_ref, 1)(X, W, B), rtol=1e-5)
    with pytest.raises(TypeError, match="float32/float64"):
        F(X.astype(np.int32), W, B)


def test_interop_errors_belong_to_the_tapegrad_family():
    with pytest.raises(tg.TapeError, match="not supported") as e:
        jax.jvp(F, (X, W, B), (X, W, B))
    assert isinstance(e.value, TransformError) and isinstance(e.value, TypeError)
    tape = tg.Tape()
    w = tape.param(np.ones(2))
    with pytest.raises(tg.TapeError, match="attach an optimizer") as e:
        interop.program_episode(tg.capture(tape, (w * w).sum()))
    assert isinstance(e.value, interop.ProgramError) and isinstance(e.value, ValueError)
