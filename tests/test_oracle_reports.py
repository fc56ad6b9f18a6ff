"""The oracle's report texts, whole: kinks, divergences and precision notes with and without a location,
and the message naming primitives that cannot be replayed (each kind of reason)."""
import numpy as np
import pytest

pytest.importorskip("interop")
from interop.oracle import check as oracle  # noqa: E402


def test_a_kink_names_its_step_and_where_it_sits_only_when_nested():
    k = oracle.Kink(index=3, eqn="b = max a 0.0", elements=2, jax="d/dx = 0", tape="d/dx = 0.5", detail="ties")
    assert str(k) == ("equation 3: b = max a 0.0: gradients differ at 2 element(s), all at a kink (ties); JAX gives "
                      "d/dx = 0, the tape gives d/dx = 0.5")
    k.where = "scan (step 2) › iteration 1"
    assert str(k) == ("equation 3 in scan (step 2) › iteration 1: b = max a 0.0: gradients differ at 2 element(s), "
                      "all at a kink (ties); JAX gives d/dx = 0, the tape gives d/dx = 0.5")


def test_a_divergence_and_a_precision_note_read_whole():
    d = oracle.Divergence(index=7, eqn="c = tanh b", kind="vjp", max_abs=0.00125, max_rel=3e-9)
    assert str(d) == "equation 7 (vjp): c = tanh b  max|Δ|=0.00125  rel=3e-09"
    d.where = "cond (step 4) › branch 1"
    assert str(d) == "equation 7 in cond (step 4) › branch 1 (vjp): c = tanh b  max|Δ|=0.00125  rel=3e-09"
    p = oracle.Precision(dtype="float32", eqn="c = convert_element_type b", index=2, bound=0.000346)
    assert str(p) == "computes in float32 from equation 2 (c = convert_element_type b): compared at √eps(float32) = 0.00035"


def test_unsupported_primitives_are_named_with_each_kind_of_reason():
    found = {"fft": ["fft", "ifft"], "custom_thing": "a custom rule tapegrad cannot see", "bessel_i1e": [],
             "zeta": None}
    assert oracle._unsupported_message(found) == (
        "check_grads: cannot replay ['bessel_i1e', 'custom_thing', 'fft', 'zeta'] on a tape (applied to values "
        "that depend on the differentiated arguments): bessel_i1e; custom_thing (a custom rule tapegrad cannot "
        "see); fft (needs tg.fft, tg.ifft, which this tapegrad lacks); zeta. Everything computed from constants, "
        "integers or keys only is evaluated by JAX; interop.oracle.primitive_table() lists what replays")



def test_assert_grads_passes_every_option_on_to_check_grads():
    import interop
    from interop import jax, jnp

    @jax.custom_vjp
    def off(x, y):
        return x * y

    # wrong by 1e-9 relative on x, right on y
    off.defvjp(lambda x, y: (x * y, (x, y)), lambda res, g: (g * res[1] * (1 + 1e-9), g * res[0]))
    x, y = jnp.linspace(0.5, 1.5, 4), jnp.linspace(-1.0, 2.0, 4)
    f = lambda x, y: off(x, y).sum()  # noqa: E731
    with pytest.raises(interop.GradientMismatchError):
        interop.assert_grads(f, x, y)
    assert interop.assert_grads(f, x, y, argnums=1).ok                 # only y is judged
    assert interop.assert_grads(f, x, y, rtol=1e-6).ok                 # within a looser bound
    # an aux holding a Python int (a literal in the jaxpr) used to crash the replay: unhashable Literal
    r = interop.assert_grads(lambda x: (jnp.sum(x * x), {"n": x.size}), x, has_aux=True)
    assert r.aux == {"n": 4}
    r = interop.assert_grads(lambda x: jnp.sum(jax.nn.relu(x)), jnp.array([0.0, 1.0]))   # kinks allowed by default
    assert r.verdict == "kink"


def test_a_report_reads_whole_for_every_verdict():
    base = dict(ok=True, grads=None, jax_grads=None, value=1.5, jax_value=1.25, max_abs=(0.0, 2e-13),
                max_rel=(0.0, 1e-13), rtol=1e-12, n_eqns=3, bound=1e-12, error=1e-13, leaves=("x", "y"))
    rows = "\n  x: max|Δ|=0 rel=0\n  y: max|Δ|=2e-13 rel=1e-13"
    for verdict, word in (("agree", "ok"), ("kink", "ok (differences only at kinks)"), ("mismatch", "MISMATCH"),
                          ("nonfinite", "NOT CHECKED (not finite on either side)")):
        assert str(oracle.GradReport(verdict=verdict, **base)) == (
            f"check_grads: {word} (gradient error 1e-13, bound 1e-12; 3 equations replayed; value 1.5 vs jax 1.25)"
            + rows)
    r = oracle.GradReport(verdict="mismatch", notes=["one", "two"],
                          precision=oracle.Precision("float32", "c = tanh b", 2, 0.000346),
                          kinks=[oracle.Kink(1, "b = max a 0.0", 1, "0", "0.5", "ties")],
                          first_divergence=oracle.Divergence(4, "d = mul c c", "value", 1.0, 0.5), **base)
    assert str(r).split("\n")[3:] == [
        "  precision: computes in float32 from equation 2 (c = tanh b): compared at √eps(float32) = 0.00035",
        "  kink: equation 1: b = max a 0.0: gradients differ at 1 element(s), all at a kink (ties); JAX gives 0, "
        "the tape gives 0.5",
        "  first divergence: equation 4 (value): d = mul c c  max|Δ|=1  rel=0.5",
        "  note: one", "  note: two"]


def test_kinks_inside_a_loop_are_reported_whole_per_iteration():
    """relu at exact zeros inside a scan: every field of each kink (the second iteration also meets the
    zeros the first made of the negative inputs)."""
    import interop
    from interop import jax, jnp

    def f(x):
        c, _ = jax.lax.scan(lambda c, _: (jax.nn.relu(c) * 2.0, None), x, None, length=2)
        return jnp.sum(c * jnp.arange(1.0, 5.0))
    r = interop.check_grads(f, jnp.array([0.0, 1.0, -1.0, 0.0]))
    eqn = "a:f64[4] = custom_jvp_call[name=relu] d"
    assert r.ok and r.verdict == "kink"
    assert r.kinks == [
        oracle.Kink(0, eqn, 2, "d/dx = 0", "d/dx = 0.5", "2 ties of max (a == b)", "scan (step 0) › iteration 0"),
        oracle.Kink(0, eqn, 3, "d/dx = 0", "d/dx = 0.5", "3 ties of max (a == b)", "scan (step 0) › iteration 1")]


def test_a_nudge_moves_each_float_input_off_its_kink_by_a_small_relative_step():
    """_nudged (the kink classifier's probe): every float input moves by 0.5–1 × 1e-7·(max|x| + 1) per
    element, in both directions, keeping its dtype; integer inputs, literals and empty inputs stay."""
    from types import SimpleNamespace
    from jax.core import ShapedArray
    from interop import jnp
    from interop.oracle.replay import Literal
    x = np.array([0.0, 3.0, -2.0, 0.5] * 64)
    ints, empty = np.arange(4, dtype=np.int32), np.zeros((0,))
    lit = Literal(2.0, ShapedArray((), jnp.float64))
    ins = [object(), object(), object(), object(), lit]
    invars = [SimpleNamespace(aval=ShapedArray(x.shape, jnp.float64)),
              SimpleNamespace(aval=ShapedArray(x.shape, jnp.float32)),
              SimpleNamespace(aval=ShapedArray(ints.shape, jnp.int32)),
              SimpleNamespace(aval=ShapedArray(empty.shape, jnp.float64)),
              SimpleNamespace(aval=ShapedArray((), jnp.float64))]
    u = SimpleNamespace(ins=ins, eqn=SimpleNamespace(invars=invars))
    jin = [jnp.asarray(x), jnp.asarray(x, jnp.float32), jnp.asarray(ints), jnp.asarray(empty), jnp.asarray(2.0)]
    out = oracle._nudged(u, jin, np.random.default_rng(0))
    step = 1e-7 * (np.abs(x).max() + 1.0)
    d = np.asarray(out[0]) - x
    assert out[0].dtype == jnp.float64 and out[1].dtype == jnp.float32
    assert np.all(np.abs(d) >= 0.5 * step * (1 - 1e-9)) and np.all(np.abs(d) <= step * (1 + 1e-9))
    assert (d > 0).any() and (d < 0).any()
    assert np.abs(np.asarray(out[1], np.float64) - x).max() > 0
    assert out[2] is jin[2] and out[4] is jin[4] and np.asarray(out[3]).shape == (0,)
