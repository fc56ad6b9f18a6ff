"""check_grads refuses what it cannot check with a ``CheckGradsError`` (a ``TapeError`` and, as before, a
``ValueError``) naming the argument or the equation: complex numbers anywhere on the differentiable path
(the tape holds real values: complex data was cast to float64, with only NumPy's ComplexWarning, and
reported as a mismatch), arguments with nothing to differentiate, outputs that are not one real scalar."""
import warnings

import numpy as np
import pytest

import tapegrad as tg

jax = pytest.importorskip("jax")
import interop  # noqa: E402
from interop import jnp  # noqa: E402
from interop.oracle import CheckGradsError  # noqa: E402

COMPLEX = "complex numbers are not supported"


def refused(match, f, *args, **kw):
    """check_grads(f, *args) raises CheckGradsError matching ``match`` and warns nothing (no cast ran)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckGradsError, match=match) as e:
            interop.check_grads(f, *args, **kw)
    assert isinstance(e.value, tg.TapeError) and isinstance(e.value, ValueError)
    return str(e.value)


def test_complex_data_meeting_the_differentiated_argument_is_refused_naming_it():
    """The issue's case: value 2.0 against JAX's 2.236, reported as a mismatch at abs."""
    refused(r"check_grads: arg 1 \(complex128\[2\]\) meets the differentiated arguments at equation 1 "
            rf"\(.*mul.*\): {COMPLEX}",
            lambda w, z: jnp.abs(jnp.sum(w * z)), jnp.array([1.0, 2.0]), jnp.array([1j, 1 + 0j]), argnums=0)


def test_complex_leaf_of_a_pytree_is_named_by_its_path():
    refused(rf"check_grads: arg 1\['z'\] \(complex128\[2\]\) meets the differentiated arguments at equation \d+ "
            rf"\(.*mul.*\): {COMPLEX}",
            lambda w, p: jnp.abs(jnp.sum(w * p["z"])), jnp.ones(2), {"z": jnp.array([1j, 2.0])}, argnums=0)


def test_a_complex_argument_to_differentiate_says_complex_not_no_float_leaf():
    msg = refused(rf"check_grads: arg 0 is complex \(complex128\[2\]\); {COMPLEX}",
                  lambda z: jnp.abs(jnp.sum(z)), jnp.array([1j, 2.0]))
    assert "no float leaf" not in msg
    refused(rf"check_grads: arg 0\[1\] is complex \(complex128\[\]\); {COMPLEX}",
            lambda p: jnp.abs(p[0] * p[1]), [1.0, 2j])


def test_complex_values_computed_inside_f_on_the_differentiable_path_are_refused():
    """The first equation that makes a complex value is named: jax 0.10 converts w (equation 0), 0.12.1
    multiplies the parts and joins them with `complex`."""
    f, w = (lambda w: jnp.abs(jnp.sum(w * 1j))), jnp.array([1.0, 2.0])
    first = next(k for k, e in enumerate(jax.make_jaxpr(f)(w).eqns)
                 if any(jnp.issubdtype(v.aval.dtype, jnp.complexfloating) for v in e.outvars))
    refused(rf"check_grads: equation {first} \(a:c128\[2\] = .*\) computes in complex128 on values that depend "
            rf"on the differentiated arguments; {COMPLEX}", f, w)


def test_complex_values_inside_a_loop_body_are_refused():
    def f(w):
        return jax.lax.fori_loop(0, 2, lambda i, c: c + jnp.abs(jnp.sum(w * 1j)), 0.0)
    refused(rf"check_grads: equation \d+ \(.*\) computes in complex128 on values that depend on the "
            rf"differentiated arguments; {COMPLEX}", f, jnp.array([1.0, 2.0]))


def test_complex_numbers_away_from_the_differentiable_path_are_fine():
    """JAX evaluates what does not depend on the differentiated arguments; only its real result is used."""
    r = interop.check_grads(lambda w, z: jnp.sum(w * jnp.abs(z)), jnp.array([1.0, 2.0]), jnp.array([3j, 4.0]),
                            argnums=0)
    assert r.ok and np.array_equal(r.grads, [3.0, 4.0])


def test_a_complex_output_is_refused():
    refused(rf"check_grads: f must return one scalar .*got \['complex128\[\]'\]; {COMPLEX}",
            lambda w: jnp.sum(w * 1j), jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("f, args, kw, match", [
    (lambda x: x * 2, (jnp.ones(3),), {}, r"f must return one scalar .*got \['float64\[3\]'\]"),
    (lambda x: jnp.sum(x).astype(int), (jnp.ones(3),), {}, r"f must return one scalar .*got \['int64\[\]'\]"),
    (lambda x: x.sum(), (jnp.ones(3),), {"has_aux": True}, r"has_aux=True needs f to return a pair"),
    (lambda x: x.sum(), (jnp.ones(3),), {"argnums": 3}, r"argnums 3 is out of range for 1 positional"),
    (lambda n: jnp.sum(n * 1.0), (jnp.arange(3),), {}, r"no float leaf to differentiate in arguments \(0,\)"),
], ids=["vector output", "integer output", "has_aux without a pair", "argnums out of range", "integer arguments only"])
def test_argument_errors_are_in_the_tapeerror_family(f, args, kw, match):
    refused(match, f, *args, **kw)


def test_an_unsupported_primitive_on_complex_values_is_named_as_unsupported():
    """Its error names every primitive without a rule (fft here); complex support comes after that."""
    with pytest.raises(interop.UnsupportedPrimitiveError, match=r"\['fft'\]"):
        interop.check_grads(lambda x: jnp.fft.fft(x).real.sum(), jnp.ones(3))


def test_the_error_class_is_exported():
    assert "CheckGradsError" in interop.oracle.__all__
