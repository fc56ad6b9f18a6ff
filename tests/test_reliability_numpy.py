"""NumPy's functions and ufuncs on Vars give NumPy's value through tapegrad's op, or an ArgumentError naming
the function and what to use: never NumPy's scalar-object fallback (``np.dot(x, x)`` was ``<Var mul>``,
``np.argmax(x)`` 0, ``np.cumsum(x)`` an object array). And a ragged list given to ``param`` or ``const``
is a ShapeError naming the leaf, not NumPy's bare message."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import numpy_dispatch as D

RNG = np.random.default_rng(3)
A = RNG.standard_normal((3, 4))
V = np.arange(1.0, 11.0)
IDX = np.array([2, 0, 1])

# NumPy function -> [(args, kwargs)], "A" and "V" standing for Vars holding those arrays.
CASES = {
    np.sum: [(("A",), {}), (("A", 0), {}), (("A",), {"axis": 1, "keepdims": True}), (("A", 1, None, None, True), {})],
    np.mean: [(("A",), {"axis": (0, 1)})], np.max: [(("A", 1), {})], np.amax: [(("A",), {})],
    np.min: [(("A",), {"axis": 0})], np.amin: [(("V",), {})], np.prod: [(("V",), {})],
    np.std: [(("A",), {"axis": 0, "ddof": 1})], np.var: [(("A", 1), {})],
    np.cumsum: [(("V",), {}), (("A",), {}), (("A", 1), {})], np.cumprod: [(("A",), {"axis": 0})],
    np.sort: [(("A",), {}), (("A", None), {}), (("A",), {"axis": 0, "kind": "stable"})],
    np.take: [(("V", IDX), {}), (("A", IDX), {"axis": 1}), (("A", IDX), {})],
    np.take_along_axis: [(("A", np.argsort(A, axis=1)), {"axis": 1})],
    np.transpose: [(("A",), {}), (("A", (1, 0)), {})],
    np.reshape: [(("A", (4, 3)), {}), (("A", -1), {})], np.ravel: [(("A",), {})],
    np.broadcast_to: [(("V", (2, 10)), {})], np.flip: [(("A",), {}), (("A", 1), {})],
    np.concatenate: [((["A", np.ones((2, 4))],), {}), ((["A", "A"], 1), {}), ((["V", "A"],), {"axis": None})],
    np.stack: [((["V", np.ones(10)],), {}), ((["V", "V"],), {"axis": 1})],
    np.split: [(("V", 5), {}), (("A", [1]), {"axis": 1})],
    np.where: [((V > 5, "V", 0.0), {})],
    np.dot: [(("V", "V"), {}), (("A", np.ones(4)), {}), ((np.ones(3), "A"), {}), (("A", np.ones((4, 2))), {})],
    np.shape: [(("A",), {})], np.ndim: [(("A",), {})], np.size: [(("A",), {}), (("A", 1), {})],
}


def on_tape(tape, x):
    if isinstance(x, str):
        return tape.param({"A": A, "V": V}[x])
    if isinstance(x, list):
        return [on_tape(tape, y) for y in x]
    return x


def plain(x):
    if isinstance(x, str):
        return {"A": A, "V": V}[x]
    if isinstance(x, list):
        return [plain(y) for y in x]
    return x


def test_every_function_of_the_table_has_cases():
    assert set(CASES) == set(D.FUNCTIONS)


CALLS = [(f, k) for f in CASES for k in range(len(CASES[f]))]


@pytest.mark.parametrize("func, k", CALLS, ids=[f"{f.__name__}-{k}" for f, k in CALLS])
def test_a_numpy_function_on_a_var_gives_numpys_value(func, k):
    args, kwargs = CASES[func][k]
    tape = tg.Tape()
    got = func(*[on_tape(tape, a) for a in args], **kwargs)
    want = func(*[plain(a) for a in args], **kwargs)
    if isinstance(want, (list, tuple)) and not isinstance(want, tuple) or func is np.split:
        assert len(got) == len(want)
        pairs = list(zip(got, want))
    else:
        pairs = [(got, want)]
    for g, w in pairs:
        if not isinstance(g, tg.Var):      # shape, ndim, size: Python values
            assert g == w
            continue
        assert g.shape == np.shape(w)
        np.testing.assert_allclose(tape.value(g), w, rtol=1e-13, atol=1e-13)


def test_the_reported_cases():
    tape = tg.Tape()
    x = tape.param(np.arange(10.0))
    d = np.dot(x, x)
    assert isinstance(d, tg.Var) and d.shape == () and float(tape.value(d)) == 285.0
    assert tape.value(np.cumsum(x)).tolist() == np.cumsum(np.arange(10.0)).tolist()
    with pytest.raises(tg.ArgumentError, match=re.escape(
            "numpy.argmax: not an op on Vars (got <Var node 0: param (10,)>); compute it on the value, "
            "numpy.argmax(tape.value(v)) (no gradient flows through it), or build it from tapegrad's ops")):
        np.argmax(x)


def test_gradients_flow_through_numpy_calls():
    tape = tg.Tape()
    w = tape.param(A)
    loss = np.sum(np.tanh(np.dot(w, np.ones(4))) ** 2) + np.mean(np.exp(w))
    tape.backward(loss)
    h = np.tanh(A @ np.ones(4))
    want = np.outer(2 * h * (1 - h * h), np.ones(4)) + np.exp(A) / A.size
    np.testing.assert_allclose(tape.grad(w), want, rtol=1e-13)


@pytest.mark.parametrize("uf", list(D.UFUNCS), ids=lambda u: u.__name__)
def test_a_numpy_ufunc_on_a_var_gives_numpys_value(uf):
    tape = tg.Tape()
    x = np.linspace(0.2, 0.9, 4)
    if uf is np.matmul:
        args = (A, x)
    elif uf is np.power:
        args = (x, 3.0)
    else:
        args = (x,) * uf.nin
    got = uf(*[tape.param(a) if k == 0 else a for k, a in enumerate(args)])
    assert isinstance(got, tg.Var)
    np.testing.assert_allclose(tape.value(got), uf(*args), rtol=1e-14)
    if uf.nin == 2 and uf is not np.power:     # the Var second: ndarray ⊕ Var
        got = uf(args[0], tape.param(args[1]))
        np.testing.assert_allclose(tape.value(got), uf(*args), rtol=1e-14)


def test_array_operators_with_a_var_still_record_ops():
    tape = tg.Tape()
    x = tape.param(V)
    for got, want in ((np.ones(10) + x, 1 + V), (np.ones(10) - x, 1 - V), (2 * np.ones(10) * x, 2 * V),
                      (np.ones(10) / x, 1 / V), (np.float64(3.0) * x, 3 * V), (np.ones((2, 10)) @ x, 2 * [V.sum()])):
        assert isinstance(got, tg.Var)
        np.testing.assert_allclose(tape.value(got), want, rtol=1e-15)


@pytest.mark.parametrize("call, msg", [
    (lambda x: np.ones(10) < x, "numpy.less: not an op on Vars (its result is boolean: no gradient) (got <Var node 0"),
    (lambda x: np.isnan(x), "numpy.isnan: not an op on Vars (its result is boolean: no gradient)"),
    (lambda x: np.add.reduce(x), "numpy.add: the ufunc method add.reduce is not an op on Vars (got <Var node 0: "
                                 "param (10,)>); use tapegrad's reductions"),
    (lambda x: np.exp(x, out=np.ones(10)), "numpy.exp: out= cannot write a Var's result into an array"),
    (lambda x: np.exp(x, where=V > 3), "numpy.exp: arguments ['where'] are not supported on Vars"),
    (lambda x: np.sum(x, where=V > 3), "numpy.sum: argument where=a bool array of shape (10,) is not supported on "
                                       "Vars (got <Var node 0: param (10,)>); use tapegrad.sum (the op, with its own "
                                       "arguments)"),
    (lambda x: np.clip(x, 0, 1), "numpy.clip: not an op on Vars (got <Var node 0: param (10,)>); compute it on the "
                                 "value, numpy.clip(tape.value(v))"),
    (lambda x: np.linalg.norm(x), "numpy.linalg.norm: not an op on Vars"),
    (lambda x: np.dot(x, np.ones((10, 2, 2))), "matmul (node 1): numpy.matmul / numpy.dot on Vars take 1-D and 2-D "
                                               "operands, got shapes (10,) and (10, 2, 2); for batches use tapegrad.bmm"),
    (lambda x: np.where(x), "numpy.where: only the three-argument form where(condition, x, y) is an op on Vars"),
    (lambda x: np.power(2.0, x), "pow (node 1): numpy.power with a Var exponent is not an op"),
    (lambda x: np.sort(x, order="f"), "numpy.sort: argument order='f' is not supported on Vars"),
    (lambda x: np.cumsum(x, dtype=np.float32), "numpy.cumsum: argument dtype=<class 'numpy.float32'> is not "
                                               "supported on Vars"),
])
def test_numpy_calls_without_an_op_raise_a_named_type_error(call, msg):
    tape = tg.Tape()
    x = tape.param(V)
    with pytest.raises(TypeError) as info:
        call(x)
    assert isinstance(info.value, tg.TapeError)
    assert str(info.value).startswith(msg), str(info.value)
    assert len(tape) == 1                          # nothing recorded


def test_in_place_array_arithmetic_with_a_var_is_refused():
    tape = tg.Tape()
    x = tape.param(V)
    a = np.ones(10)
    with pytest.raises(tg.ArgumentError, match=r"^numpy\.add: out= cannot write a Var's result into an array"):
        a += x
    assert a.tolist() == [1.0] * 10


@pytest.mark.parametrize("leaf", ["param", "const"])
def test_a_ragged_list_is_a_shape_error_naming_the_leaf(leaf):
    tape = tg.Tape()
    tape.param(np.ones(2))
    with pytest.raises(tg.ShapeError) as info:
        getattr(tape, leaf)([[1.0, 2.0], [3.0]])
    msg = str(info.value)
    assert msg.startswith(f"{leaf} (node 1): expected an array or a rectangular nested list of numbers, got a list "
                          f"NumPy cannot make one array of (setting an array element with a sequence."), msg
    assert msg.endswith("; pad the rows to one length, or register the pieces separately")
    assert "inhomogeneous shape after 1 dimensions" in msg
    assert len(tape) == 1
    poisoned = tg.Tape(on_error="poison")
    v = poisoned.param([[1.0], [2.0, 3.0]])
    assert v.id < 0 and not poisoned.ok and isinstance(poisoned.error, tg.ShapeError)
