"""The routing ops: float masks, select by a float mask, and with_grad (a value with another's gradient)."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O


def grads(build, *arrays):
    tape = tg.Tape()
    xs = [tape.param(a) for a in arrays]
    out = build(tape, *xs)
    assert tape.backward(out)
    return np.array(tape.value(out)), [np.array(tape.grad(x)) for x in xs]


@pytest.mark.parametrize("name,np_fn", [("greater", np.greater), ("greater_equal", np.greater_equal),
                                        ("equal", np.equal), ("not_equal", np.not_equal)])
def test_comparisons_are_numpy_comparisons_as_floats_nan_included(name, np_fn):
    a = np.array([[1.0, 0.0, -0.0, np.nan, np.inf, -2.0]])
    b = np.array([[0.0], [-0.0], [np.nan], [-2.0]])
    tape = tg.Tape()
    out = getattr(tg, name)(tape.const(a), tape.const(b))
    assert np.array_equal(tape.value(out), np_fn(a, b).astype(np.float64))


def test_select_by_a_computed_mask_is_where_by_the_bool_mask_to_the_bit():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5)), rng.standard_normal(5)
    y[2] = np.inf                                 # the untaken branch's inf reaches neither value nor gradient
    x[:, 2] = 1.0
    w = rng.standard_normal((4, 5))

    def by_mask(tape, x, y):
        return (tg.where(tg.greater(x, tape.const(np.array(0.1))), x, y) * tape.const(w)).sum()

    def by_bool(tape, x, y):
        return (tg.where(tape.const(np.asarray(tape.value(x)) > 0.1), x, y) * tape.const(w)).sum()

    v1, g1 = grads(by_bool, x, y)
    v2, g2 = grads(by_mask, x, y)
    assert v1 == v2 and all(np.array_equal(a, b) for a, b in zip(g1, g2))
    assert np.array_equal(g2[0], np.where(x > 0.1, w, 0.0))


def test_select_takes_any_nonzero_mask_as_true():
    tape = tg.Tape()
    a, b = tape.param(np.ones(4)), tape.param(np.zeros(4))
    out = tape.apply(O.route.select, a, b, None, tape.const(np.array([0.0, 2.0, -1.0, np.nan])))
    assert np.array_equal(tape.value(out), [0.0, 1.0, 1.0, 1.0])


def test_with_grad_gives_the_value_of_one_and_the_gradient_of_the_other_exactly():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(7) * 3
    w = rng.standard_normal(7)

    def ste(tape, x):   # a straight-through estimator: round forward, identity backward
        rounded = tape.const(np.round(tape.value(x)))
        return (tg.with_grad(rounded, x) * tape.const(w)).sum()
    value, (g,) = grads(ste, x)
    assert value == (np.round(x) * w).sum()
    assert np.array_equal(g, w)


def test_with_grad_refuses_paths_of_another_shape_and_leaves_the_tape_as_it_was():
    tape = tg.Tape()
    a, b = tape.param(np.ones(3)), tape.param(np.ones((3, 1)))
    n = len(tape)
    with pytest.raises(tg.ShapeError, match=r"with_grad.*value \(3,\) and the gradient path \(3, 1\)"):
        tg.with_grad(a, b)
    assert len(tape) == n


def test_comparisons_pass_no_gradient():
    x = np.array([0.5, -1.0, 2.0])
    _, (g,) = grads(lambda tape, x: (tg.greater(x, tape.const(np.zeros(3))) * x).sum(), x)
    assert np.array_equal(g, np.array([1.0, 0.0, 1.0]))   # only the product's own path
