"""The reverse sweep's accumulation rules, pinned where a wrong order or a wrong buffer changes results.

- Within a node, ``a``'s contribution is accumulated before ``b``'s, and nodes are visited in reverse
  order: the last bits of a gradient with fan-in depend on it, and every replay must follow it.
- A contribution that aliases ``g`` (add, sub's a side, reshape…) must never become the input's
  gradient buffer: the next contribution would be added into the consumer's gradient as well.
- ``reset_to`` rewinds the value arena only past the mark: op nodes recorded before the mark keep
  their values across episodes.
"""
import numpy as np
import pytest

import tapegrad as tg

RNG = np.random.default_rng(11)
X0 = RNG.uniform(0.5, 2.0, 64) * 10.0 ** RNG.integers(-3, 4, 64)
W0 = RNG.standard_normal(64)


def fan_in(tape, exact=False):
    """``((x/x)·w + tanh(x)·w).sum()``: x reaches div through both inputs, plus a third consumer.

    ``exact=True`` puts x·x in tanh's place (IEEE-exact, so a native replay must match ``==``)."""
    x, w = tape.param(X0), tape.param(W0)
    d = (x / x) * w                    # div first: the sweep reaches x through the third consumer first
    third = x * x if exact else x.tanh()
    loss = (d + third * w).sum()
    return x, w, loss


def expected_grad_x(x, w):
    """d loss/dx summed in the documented order: reverse node order, a before b within a node.

    The tanh node (node 4) is visited first, then div (node 2): its a-side g/x, then its b-side
    −(g·out/x)."""
    g = np.ones_like(x)
    d, t = x / x, np.tanh(x)
    g_t = g * w                  # mul (node 5), a side
    g_d = g * w                  # mul (node 3), a side
    acc = g_t * (1.0 - t * t)    # tanh's contribution: the first one x receives
    acc = acc + g_d / x          # div, a side
    acc = acc + -(g_d * d / x)   # div, b side
    return acc


def test_fan_in_sums_a_before_b_in_reverse_node_order_bit_for_bit():
    tape = tg.Tape()
    x, w, loss = fan_in(tape)
    tape.backward(loss)
    want = expected_grad_x(X0, W0)
    # the order is observable with these values: b before a rounds differently somewhere
    d, t, gd = X0 / X0, np.tanh(X0), W0
    swapped = (W0 * (1.0 - t * t) + -(gd * d / X0)) + gd / X0
    assert not np.array_equal(swapped, want)
    assert np.array_equal(tape.grad(x), want)


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("fuse", [False, True])
def test_replays_follow_the_tapes_accumulation_order_bit_for_bit(backend, fuse):
    tape = tg.Tape()
    x, w, loss = fan_in(tape, exact=backend == "native")
    tape.backward(loss)
    prog = tg.capture(tape, loss, backend=backend, fuse=fuse)
    prog.forward()
    prog.backward()
    assert np.array_equal(prog.grad(x), tape.grad(x))
    assert np.array_equal(prog.grad(w), tape.grad(w))


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_a_kernel_node_reading_one_input_twice_accumulates_a_then_b(backend):
    """concat(x, x) is a non-elementwise (kernel) node: its a-side slice of g reaches x before its
    b-side slice, after x·x's contribution (visited first)."""
    tape = tg.Tape()
    x = tape.param(X0)
    g = RNG.standard_normal(128) * 10.0 ** RNG.integers(-3, 4, 128)
    c = tg.concat([x, x]) * tape.const(g)
    loss = (c.sum() + (x * x).sum())
    tape.backward(loss)
    want = (2.0 * X0 + g[:64]) + g[64:]
    assert not np.array_equal((2.0 * X0 + g[64:]) + g[:64], want)   # the order is observable
    assert np.array_equal(tape.grad(x), want)
    for fuse in (False, True):
        prog = tg.capture(tape, loss, backend=backend, fuse=fuse)
        prog.forward()
        prog.backward()
        assert np.array_equal(prog.grad(x), want), fuse


def test_fan_in_through_an_aliasing_op_leaves_the_consumers_gradient_alone():
    """h = 2p; y = h + h; loss = (3y).sum(): add passes g itself to both sides."""
    tape = tg.Tape()
    p = tape.param(np.array([1.0, -2.0, 0.5]))
    h = p * 2.0
    y = h + h
    z = y * 3.0
    loss = z.sum()
    assert tape.backward(loss)
    assert np.array_equal(tape.grad(z), np.ones(3))
    assert np.array_equal(tape.grad(y), np.full(3, 3.0))
    assert np.array_equal(tape.grad(h), np.full(3, 6.0))
    assert np.array_equal(tape.grad(p), np.full(3, 12.0))
    # the same through sub (a side aliases g) and reshape
    tape = tg.Tape()
    p = tape.param(np.array([1.0, -2.0, 0.5, 4.0]))
    h = p * 2.0
    y = (h - h * 0.5) + h.reshape((2, 2)).reshape((4,))
    loss = (y * 3.0).sum()
    tape.backward(loss)
    assert np.array_equal(tape.grad(y), np.full(4, 3.0))
    assert np.array_equal(tape.grad(h), np.full(4, 3.0 - 1.5 + 3.0))
    for backend in ("numpy", "native"):
        prog = tg.capture(tape, loss, backend=backend)
        prog.forward()
        prog.backward()
        for v in (y, h, p):
            assert np.array_equal(prog.grad(v), tape.grad(v)), backend


def test_an_op_node_recorded_before_the_mark_keeps_its_value_across_episodes():
    tape = tg.Tape()
    w = tape.param(np.arange(1.0, 7.0).reshape(2, 3))
    c = tape.const(np.full((2, 3), 0.5))
    h = (w * c).tanh()            # an op node before the mark: its value lives in the value arena
    h_before = np.array(tape.value(h))
    m = tape.mark()
    for step in range(3):
        x = tape.const(np.full((2, 3), float(step + 1)))
        q = (x * 7.0 + 1.0) * x   # values that land where a too-early rewind would put them
        loss = (h * q).sum()
        tape.backward(loss)
        assert np.array_equal(tape.value(h), h_before), step
        want_w = (np.array(tape.value(q)) * (1.0 - h_before * h_before)) * 0.5
        assert np.array_equal(tape.grad(w), want_w), step
        tape.reset_to(m)
    assert len(tape) == m
    assert np.array_equal(tape.value(h), h_before)
