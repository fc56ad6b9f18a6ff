"""Native programs: reshapes as views (one buffer for a reshape and its input, bit for bit the copies; the
tiers against the tape are tests/test_native.py's, and the first run is verified as always), and small
products on one BLAS thread."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import runner

pytestmark = pytest.mark.matrix


def _tape_and_loss(shared_input):
    """h = x @ W (a computed node), reshaped twice and read by a product; with ``shared_input``, h also
    feeds a second consumer, so its gradient receives two contributions and must stay its own buffer."""
    rng = np.random.default_rng(3)
    tape = tg.Tape()
    W = tape.param(rng.standard_normal((6, 8)), name="W")
    V = tape.param(rng.standard_normal((4, 3)), name="V")
    x = tape.const(rng.standard_normal((5, 6)))
    h = x @ W
    r1 = h.reshape((10, 4))
    r = r1.reshape((2, 5, 4))
    z = (r.reshape((10, 4)) @ V).tanh().sum()
    if shared_input:
        z = z + (h * h).sum()
    w = W.reshape((48,))                      # a parameter's reshape: never a view (the step updates W)
    return tape, z + (w * w).sum(), (W, V, h, r1, r, w)


@pytest.mark.parametrize("shared_input", [False, True])
def test_reshape_views_share_buffers_and_run_as_the_copies_do_bit_for_bit(shared_input, monkeypatch):
    tape, loss, (W, V, h, r1, r, w) = _tape_and_loss(shared_input)
    tape.backward(loss)
    with monkeypatch.context() as m:           # the same program with every reshape a copy
        m.setattr(runner, "reshape_views", lambda p: {})
        copies = tg.capture(tape, loss, backend="native")
    assert copies.runner.views == {}
    copies.forward()
    copies.backward()
    want = {v: (copies.value(v).copy(), copies.grad(v).copy()) for v in (W, V, h, r1, r, w)}
    prog = tg.capture(tape, loss, backend="native")
    views = prog.runner.views
    assert views[("v", r.id)] == h.id and np.shares_memory(prog.value(r), prog.value(h))
    assert ("v", w.id) not in views and not np.shares_memory(prog.value(w), prog.value(W))
    # h's gradient is r1's alone only without the second consumer; r1's is always r's alone
    assert views[("g", r.id)] == (r1.id if shared_input else h.id)
    assert (("g", r1.id) in views) is (not shared_input)
    assert np.shares_memory(prog.grad(r), prog.grad(h)) is (not shared_input)
    for _ in range(2):
        prog.forward()
        prog.backward()
        for v, (val, grad) in want.items():
            assert np.array_equal(prog.value(v), val) and np.array_equal(prog.grad(v), grad), v.id


def test_a_reshape_views_source_has_no_copy_of_it():
    tape, loss, (W, V, h, r1, r, w) = _tape_and_loss(False)
    src = tg.capture(tape, loss, backend="native").runner.source
    program = src[src.index("void tg_forward(void *ctx)"):]   # the runtime before it is not the program's
    # a view's buffer is printed under its root's name: two restrict pointers never name one buffer
    for k in (r1.id, r.id):
        assert f"v{k}" not in program and f"g{k}" not in program
    assert program.count("memcpy(") == 1                      # only W's reshape copies


def test_small_products_run_on_one_blas_thread_and_leave_the_callers_count_as_it_was():
    """T[7] is the BLAS's thread-local count setter where it has one: a small product sets 1 and puts the
    caller's count back (read back through the same setter, which returns the count it replaces)."""
    import ctypes

    from tapegrad.blas import blas_pointers, blas_threads_local
    tape, loss, _ = _tape_and_loss(False)
    prog = tg.capture(tape, loss, backend="native")
    addr = blas_threads_local("float64")
    assert int(prog.runner.table[7]) == addr
    if not addr:
        pytest.skip(f"{blas_pointers('float64')[3]} has no openblas_set_num_threads_local (OpenBLAS < 0.3.27)")
    local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(addr)
    before = local(3)
    try:
        prog.forward()
        prog.backward()
        assert local(3) == 3
    finally:
        local(before)
