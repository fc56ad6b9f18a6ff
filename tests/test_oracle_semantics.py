"""The oracle's replay semantics on code written the way real code is: low-precision floats (bfloat16,
float16), per-leaf rows of gradients that are zero on both sides, custom rules named and trusted,
non-array leaves in the arguments, batched while loops."""
import numpy as np
import pytest

pytest.importorskip("interop")
import interop  # noqa: E402
from interop import jax, jnp  # noqa: E402


def _fd(f, leaves, h=1e-6):
    """Central differences of f over a list of float64 arrays (one gradient per array)."""
    out = []
    for i, a in enumerate(leaves):
        g = np.zeros(a.shape)
        for j in np.ndindex(a.shape):
            up, dn = [np.array(x, np.float64) for x in leaves], [np.array(x, np.float64) for x in leaves]
            up[i][j] += h
            dn[i][j] -= h
            g[j] = (f(up) - f(dn)) / (2 * h)
        out.append(g)
    return out


def _close(a, b, bound):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) <= bound * max(1.0, float(np.abs(b).max()))


# ── 1. bfloat16 and float16 are floats ───────────────────────────────────────────────

def test_a_flax_dense_computing_in_bfloat16_is_checked_at_bfloat16s_bound():
    nn = pytest.importorskip("flax.linen")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    model = nn.Dense(3, dtype=jnp.bfloat16)                       # the standard mixed-precision setup
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p):
        return jnp.sum(model.apply(p, x).astype(jnp.float32) ** 2)
    r = interop.check_grads(loss, params)
    assert r.ok and r.verdict == "agree", str(r)
    assert r.precision.dtype == "bfloat16" and r.bound == pytest.approx(np.sqrt(2.0 ** -7))
    assert "float32 arguments were checked in float64" in r.notes
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        ref = jax.grad(loss)(p64)
        exact = nn.Dense(3, dtype=jnp.float64, param_dtype=jnp.float64)
        kb = [np.asarray(p64["params"]["kernel"]), np.asarray(p64["params"]["bias"])]
        fd = _fd(lambda ls: float(jnp.sum(exact.apply({"params": {"kernel": ls[0], "bias": ls[1]}},
                                                       jnp.asarray(x, jnp.float64)) ** 2)), kb)
    for name, g_fd in zip(("kernel", "bias"), fd):
        assert _close(r.grads[0]["params"][name], ref["params"][name], r.bound)    # jax.grad, at the bound
        assert _close(r.grads[0]["params"][name], g_fd, r.bound)                   # the float64 derivative


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_arguments_are_differentiated_in_float64(dtype):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 3)), dtype)
    x = rng.standard_normal((5, 3))

    def loss(w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    r = interop.check_grads(loss, w)
    assert r.ok and r.bound == 1e-12 and r.precision is None, str(r)
    assert f"{np.dtype(dtype)} arguments were checked in float64" in r.notes
    w64 = np.asarray(w, np.float64)
    with jax.enable_x64(True):
        ref = jax.grad(loss)(jnp.asarray(w64))
    assert _close(r.grads[0], ref, 1e-12)
    assert _close(r.grads[0], _fd(lambda ls: float(np.sum(np.tanh(x @ ls[0]) ** 2)), [w64])[0], 1e-7)


# ── 2. gradients zero on both sides up to rounding ─────────────────────────────────

def test_the_attention_key_bias_row_says_both_sides_are_rounding_noise():
    nn = pytest.importorskip("flax.linen")
    x = np.random.default_rng(0).standard_normal((1, 3, 4))
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)
    params = model.init(jax.random.PRNGKey(0), x)
    r = interop.check_grads(lambda p: jnp.sum(model.apply(p, x) ** 2), params)
    assert r.ok, str(r)
    row = next(line for line in str(r).splitlines() if "['key']['bias']" in line)
    assert "both ≈ 0: rounding noise" in row and "rel=" not in row, row
    # softmax is shift-invariant per query, so the key bias's true gradient is 0: both sides hold rounding only
    kb = r.grads[0]["params"]["key"]["bias"]
    with jax.enable_x64(True):
        ref = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params))["params"]["key"]["bias"]
    assert max(np.abs(kb).max(), np.abs(ref).max()) <= 1e-12 * r.scale
    others = [line for line in str(r).splitlines() if "kernel']" in line]
    assert others and all("rel=" in line for line in others)     # real gradients keep their relative error
