"""A program's data slots (integer indices, bool masks) through ``set_input`` and ``episode``: each kind
refused by its whole message, values converted to the slot's own dtype, every reader's range check
run on the new value, and a refused value leaves the program as it was. No JAX (these run in
mutation testing's forked children)."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import DTypeError, ShapeError

RANGE = ("{what} {bad} is out of range for an axis of length {n} (expected -{n} <= index < {n}; JAX would clamp or "
         "drop it silently: clip it explicitly if that is what you mean)")


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def model():
    """loss = Σ where(mask, Σ_row emb[ids], 0) + Σ index_add(z, ids, 1): ids (node 1) read by take (node 3)
    as its b input and by index_add (node 11) as its third input; mask (node 2) by where (node 7) as its third."""
    tape = tg.Tape()
    emb = tape.param(np.arange(10.0).reshape(5, 2))
    ids = tape.const(np.array([0, 3, 3]))
    mask = tape.const(np.array([True, False, True]))
    rows = tg.take(emb, ids).sum(axis=1)
    z = tape.param(np.array([1.0, 2.0, 4.0, 8.0]))
    loss = tg.where(mask, rows, 0.0).sum() + tg.index_add(z, ids, 1.0).sum()
    prog = tg.capture(tape, loss)
    return tape, prog, emb, ids, mask


def state(prog):
    return [np.array(v, copy=True) for v in prog.val]


def same(a, b):
    """Bit for bit (op buffers hold whatever memory had before a first forward, NaN bit patterns included)."""
    return len(a) == len(b) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_the_model_reads_its_data_where_the_docstring_says():
    tape, prog, emb, ids, mask = model()
    ops = [n[0].name for n in prog.nodes]
    assert ops[1:4] == ["data", "data", "take"] and prog.data == [1, 2]
    assert prog.readers == {1: [3, 11], 2: [7]} and ops[11] == "index_add" and ops[7] == "where"
    assert prog.nodes[3][2] == 1 and prog.third[11] == 1 and prog.third[7] == 2
    assert prog.value(ids).dtype == np.int64 and prog.value(mask).dtype == np.bool_
    assert float(prog.forward()) == (1.0 + 13.0) + (15.0 + 3.0)


@pytest.mark.parametrize("bad, got", [
    (np.array([0.0, 1.0, 2.0]), "float64"), (np.array([True, False, True]), "bool"),
    (np.array([1 + 0j, 0j, 0j]), "complex128"), (np.array(["a", "b", "c"]), "<U1")])
def test_an_integer_slot_takes_only_integers(bad, got):
    _, prog, _, ids, _ = model()
    before = state(prog)
    refuses(DTypeError, f"set_input (node 1): expected integer data for data node 1, got {got}",
            lambda: prog.set_input(ids, bad))
    assert same(state(prog), before)


@pytest.mark.parametrize("bad, got", [(np.array([1, 0, 1]), "int64"), (np.array([1.0, 0.0, 1.0]), "float64"),
                                      (np.array([1, 0, 1], np.uint8), "uint8")])
def test_a_bool_slot_takes_only_bools(bad, got):
    _, prog, _, _, mask = model()
    before = state(prog)
    refuses(DTypeError, f"set_input (node 2): expected bool data for data node 2, got {got}",
            lambda: prog.set_input(mask, bad))
    assert same(state(prog), before)


def test_shapes_are_static_for_data_too():
    _, prog, _, ids, mask = model()
    before = state(prog)
    for bad in (np.array([0, 1]), np.array([[0, 1, 2]]), np.array(0)):
        refuses(ShapeError, f"set_input (node 1): expected shape (3,) for data node 1, got {bad.shape}; a program is "
                            f"static: every episode has the captured shapes", lambda: prog.set_input(ids, bad))
    refuses(ShapeError, "set_input (node 2): expected shape (3,) for data node 2, got (1,); a program is static: "
                        "every episode has the captured shapes", lambda: prog.set_input(mask, np.array([True])))
    assert same(state(prog), before)


def test_unsigned_and_narrow_integers_are_converted_to_the_slots_int64():
    _, prog, _, ids, mask = model()
    for dt in (np.uint8, np.int32, np.uint64, np.int16):
        prog.set_input(ids, np.array([3, 1, 0], dt))
        assert prog.value(ids).dtype == np.int64 and prog.value(ids).tolist() == [3, 1, 0]
    prog.set_input(mask, np.array([False, True, True]))
    assert prog.value(mask).dtype == np.bool_ and prog.value(mask).tolist() == [False, True, True]
    # rows 3, 1, 0 sum to 13, 5, 1; the mask keeps the last two; z (sum 15) gets 1 three times
    assert float(prog.forward()) == (5.0 + 1.0) + (15.0 + 3.0)


def test_integers_that_do_not_fit_int64_are_refused_not_wrapped():
    _, prog, _, ids, _ = model()
    before = state(prog)
    big = np.array([0, 2 ** 63, 1], np.uint64)      # astype(int64) would wrap it to -2**63
    refuses(DTypeError, "set_input (node 1): integer data for node 1 does not fit int64",
            lambda: prog.set_input(ids, big))
    assert same(state(prog), before)
    prog.set_input(ids, np.array([0, 2, 1], np.uint64))
    assert prog.value(ids).tolist() == [0, 2, 1]


def test_every_reader_checks_the_new_indices_on_its_own_side():
    _, prog, _, ids, _ = model()
    before = state(prog)
    # 5 is out of range for take's emb (5 rows), read as take's b
    refuses(ShapeError, "set_input (node 1): data node 1 does not fit take (node 3): "
            + RANGE.format(what="index", bad=5, n=5), lambda: prog.set_input(ids, np.array([0, 5, 1])))
    refuses(ShapeError, "set_input (node 1): data node 1 does not fit take (node 3): "
            + RANGE.format(what="index", bad=-6, n=5), lambda: prog.set_input(ids, np.array([-6, 0, 1])))
    # 4 fits take's 5 rows but not index_add's z (4 entries), read as its third input
    refuses(ShapeError, "set_input (node 1): data node 1 does not fit index_add (node 11): "
            + RANGE.format(what="index", bad=4, n=4), lambda: prog.set_input(ids, np.array([0, 4, 1])))
    assert same(state(prog), before)
    prog.set_input(ids, np.array([-4, 0, 3]))   # -4: the lowest index z takes
    assert prog.value(ids).tolist() == [-4, 0, 3]


def test_an_episode_with_one_bad_data_input_writes_none_of_them():
    _, prog, emb, ids, mask = model()
    before = state(prog)
    refuses(ShapeError, "set_input (node 1): data node 1 does not fit index_add (node 11): "
            + RANGE.format(what="index", bad=4, n=4),
            lambda: prog.episode({mask: np.array([False, False, False]), ids: np.array([4, 4, 4])}))
    assert same(state(prog), before)
    assert prog.episode({mask: np.array([False, False, False]), ids: np.array([3, 3, 3])}) == 15.0 + 3.0
