"""The core shape rules of ``tapegrad.ops`` called directly, at their boundaries, with whole messages (the
tape prefixes them with the op and node; ``tapegrad.functional`` normalises most arguments first, so these
branches are otherwise reached only through ``Tape.apply``)."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import ops as O


def bad(rule, a, b, s):
    with pytest.raises(O.Bad) as e:
        rule(a, b, s)
    return str(e.value)


def test_matmul_and_bmm_shapes():
    assert O.matmul_shape((2, 3), (3, 4), None) == (2, 4)
    assert bad(O.matmul_shape, (3,), (3, 4), None) == "expected two 2-D operands, got shapes (3,) and (3, 4)"
    assert bad(O.matmul_shape, (2, 3), (3,), None) == "expected two 2-D operands, got shapes (2, 3) and (3,)"
    assert O.bmm_shape((2, 3, 4), (2, 4, 5), None) == (2, 3, 5)
    assert bad(O.bmm_shape, (2, 3), (2, 3, 4), None) == ("expected two 3-D operands (batch, m, k) and (batch, k, n), "
                                                          "got (2, 3) and (2, 3, 4)")
    assert bad(O.bmm_shape, (2, 3, 4), (2, 4), None) == ("expected two 3-D operands (batch, m, k) and (batch, k, n), "
                                                          "got (2, 3, 4) and (2, 4)")
    assert bad(O.bmm_shape, (2, 3, 4), (3, 4, 5), None) == "expected (B, m, k) @ (B, k, n), got (2, 3, 4) @ (3, 4, 5)"
    assert bad(O.bmm_shape, (2, 3, 4), (2, 5, 5), None) == "expected (B, m, k) @ (B, k, n), got (2, 3, 4) @ (2, 5, 5)"


def test_axes_shapes_at_their_bounds():
    with pytest.raises(O.Bad) as e:
        O.check_axes((2, 3), (-3,))
    assert str(e.value) == "axis -3 is out of range for an input of shape (2, 3) (ndim 2)"
    O.check_axes((2, 3), (-2,))                       # -ndim is a valid axis
    with pytest.raises(O.Bad) as e:
        O.check_axes((2, 3), (0, 0))
    assert str(e.value) == "axis (0, 0) repeats an axis"
    assert O.axis_shape((2, 3), None, 1) == (2, 3)
    assert bad(O.axis_shape, (2, 3), None, 2) == "axis 2 is out of range for shape (2, 3)"


def test_reshape_and_broadcast_to_shapes():
    assert O.reshape_shape((0, 3), None, (3, 0)) == (3, 0)      # zero-size dims are allowed
    assert bad(O.reshape_shape, (2, 3), None, (3, -2)) == "cannot reshape (2, 3) (6 elements) into (3, -2)"
    # broadcastable both ways but not into s: (3, 1) and (3,) give (3, 3), not (3,)
    assert bad(O.broadcast_to_shape, (3, 1), None, (3,)) == "cannot broadcast (3, 1) to (3,)"


def test_slice_shapes_at_their_bounds():
    assert O.slice_shape((5,), None, ((4, 0, -1),)) == (4,)
    assert O.slice_shape((5,), None, ((0, 5, 2),)) == (3,)
    assert O.slice_shape((5, 4), None, ((1, 4), (0, 4, 3))) == (3, 2)     # (start, stop) means step 1
    assert bad(O.slice_shape, (5, 2), None, ((0, 5),)) == "expected one (start, stop[, step]) per axis of (5, 2), got 1"
    assert bad(O.slice_shape, (5,), None, ((0, 5, 0),)) == "axis 0: range 0:5:0 is empty or outside 0:5"
    assert bad(O.slice_shape, (5,), None, ((5, 6, 2),)) == "axis 0: range 5:6:2 is empty or outside 0:5"
    assert bad(O.slice_shape, (5,), None, ((6, 4, -1),)) == "axis 0: range 6:4:-1 is empty or outside 0:5"
    assert bad(O.slice_shape, (5,), None, ((3, 6, 2),)) == "axis 0: range 3:6:2 is empty or outside 0:5"    # ends at 5
    assert bad(O.slice_shape, (5,), None, ((5, 2, -1),)) == "axis 0: range 5:2:-1 is empty or outside 0:5"  # starts at 5
    assert bad(O.slice_shape, (5,), None, ((4, -2, -1),)) == "axis 0: range 4:-2:-1 is empty or outside 0:5"


def test_a_reversed_slice_down_to_index_zero_keeps_element_zero_out():
    tape = tg.Tape()
    x = tape.param(np.arange(5.0))
    y = tape.apply(O.slice, x, None, ((3, 0, -1),))
    assert tape.value(y).tolist() == [3.0, 2.0, 1.0]


def test_concat_shapes():
    assert O.concat_shape((2, 3), (2, 4), 1) == (2, 7)
    assert bad(O.concat_shape, (2, 3), (3, 4), 0) == ("shapes (2, 3) and (3, 4) cannot be joined along axis 0 (other "
                                                      "dims must match)")
    assert bad(O.concat_shape, (2, 3), (2, 3), 2) == ("shapes (2, 3) and (2, 3) cannot be joined along axis 2 (other "
                                                      "dims must match)")
