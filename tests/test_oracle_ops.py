"""Every registry op's VJP against ``jax.vjp`` of its independent JAX reference, float64.

The bound is rtol=1e-12 normwise (max|Δ| <= 1e-12·max|ref|) for every op: NumPy's and XLA's libm and
summation orders differ by a few ulp at most on these sizes, four orders of magnitude inside it.
"""
import numpy as np
import pytest

from tapegrad import Tape, ops as O

interop = pytest.importorskip("interop")
from interop import jax, jnp  # noqa: E402
from op_cases import call, floats, make, record  # noqa: E402

RTOL = 1e-12
DIFF = [op for op in O.OPS.values() if op.arity and op.ref is not None]


def random_cases(op, rng, n=3):
    """Extra random shapes: broadcasting pairs for elementwise binaries, rank-1..3 for unaries."""
    if op.kind != "elementwise" or op.arity == 3 or (op.arity == 2 and op.shape is not O.broadcast):
        return []
    out = []
    for _ in range(n):
        shape = tuple(int(k) for k in rng.integers(1, 5, rng.integers(1, 4)))
        if op.arity == 2:
            other = tuple(1 if rng.random() < 0.4 else k for k in shape[rng.integers(0, len(shape)):])
            pair = (shape, other) if rng.random() < 0.5 else (other, shape)
            out.append((*pair, None))
        else:
            s = op.cases[0][2] if op.cases else None
            out.append((shape, None, s))
    return out


# jax.numpy with jax.lax and jax.scipy reachable as jnp.lax / jnp.scipy: what registry refs are given
JNP = type(jnp)("jnp")
JNP.__dict__.update(vars(jnp), lax=jax.lax, scipy=jax.scipy)


def check(op, case, rng):
    arrays, s = make(op, case, rng)
    tape = Tape()
    vs, y = record(tape, op, arrays, s)
    g = rng.standard_normal(y.shape)
    tape.backward(y, seed=g)
    diff = [k for k, kind in enumerate(op.inputs) if kind == "f"]

    def f(*xs):
        full = list(arrays)
        for k, x in zip(diff, xs):
            full[k] = x
        return call(op, lambda a, b, s, *c: op.ref(JNP, a, b, s, *c), full + [None] * (2 - len(full)), s)
    ref, vjp = jax.vjp(f, *(jnp.asarray(arrays[k]) for k in diff))
    want = vjp(jnp.asarray(g))
    got = (tape.value(y),) + tuple(tape.grad(v) for v in floats(op, vs))
    for what, x, r in zip(("value", "da", "db"), got, (ref, *want)):
        r = np.asarray(r)
        assert x.shape == r.shape, (what, x.shape, r.shape)
        err = np.abs(x - r).max(initial=0.0)
        assert err <= RTOL * max(np.abs(r).max(initial=0.0), 1e-300), \
            f"{op.name} {case}: {what} off by {err:.3g} (max|ref| {np.abs(r).max():.3g})"


@pytest.mark.parametrize("op", DIFF, ids=lambda o: o.name)
def test_vjp_matches_jax(op):
    rng = np.random.default_rng(sum(map(ord, op.name)))
    for case in op.cases + tuple(random_cases(op, rng)):
        check(op, case, rng)


def test_every_differentiable_op_has_a_reference():
    assert [op.name for op in O.OPS.values() if op.arity and op.ref is None] == []
