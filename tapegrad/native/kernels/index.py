"""The native C of the index family's ops: printers registered into ``registry.FORWARD``/``BACKWARD``.

Each mirrors its NumPy rule in ``tapegrad.ops.index``: gathers copy, every scatter-add runs over index
positions in increasing order as ``numpy.add.at`` does (``runtime_index.c``), so the index family is
exact: a program equals the tape bit for bit.
"""
import math

from .registry import BACKWARD, FORWARD, c_array as _arr, strides



def _split(shape, axis, nq):
    """(outer, n, nq, inner) of a gather along ``axis`` of ``shape`` with ``nq`` index positions."""
    return math.prod(shape[:axis]), shape[axis], nq, math.prod(shape[axis + 1:])


def _dims(n, idx_shape):
    o, m, q, i = _split(n.ash, n.s, math.prod(idx_shape))
    return f"{o}L, {m}L, {q}L, {i}L"


# ── take / take_along_axis ───────────────────────────────────────────────────

def take_fwd(n):
    return [f"tg_take({n.V}, {n.A}, {n.B}, {_dims(n, n.bsh)});"]


def take_da(n):
    return [f"tg_take_add({n.dst}, {n.G}, {n.B}, {_dims(n, n.bsh)}, 1);"], False


def along_dims(n):
    o, m, _, i = _split(n.ash, n.s, 0)
    return f"{o}L, {m}L, {n.bsh[n.s]}L, {i}L"


def along_fwd(n):
    return [f"tg_along({n.V}, {n.A}, {n.B}, {along_dims(n)});"]


def along_da(n):
    return [f"tg_along_add({n.dst}, {n.G}, {n.B}, {along_dims(n)});"], False


# ── index_add / index_set (a = x, b = values, c = indices) ───────────────────

def _copy(dst, src, shape):
    return f"memcpy({dst}, {src}, {math.prod(shape)}UL * sizeof(real));"


def index_add_fwd(n):
    return [_copy(n.V, n.A, n.ash), f"tg_take_add({n.V}, {n.B}, {n.C}, {_dims(n, n.csh)}, 0);"]


def index_add_d(n):
    if n.side == "a":
        return n.em.acc(n.j, n.G, n.first), True
    return [f"tg_take({n.dst}, {n.G}, {n.C}, {_dims(n, n.csh)});"], False


def index_set_fwd(n):
    return [_copy(n.V, n.A, n.ash), f"tg_take_set({n.V}, {n.B}, {n.C}, {_dims(n, n.csh)});"]


def index_set_d(n):
    if n.side == "a":
        return [_copy(n.dst, n.G, n.ash), f"tg_take_zero({n.dst}, {n.C}, {_dims(n, n.csh)});"], False
    return [f"tg_take_winners({n.dst}, {n.G}, {n.C}, {_dims(n, n.csh)}, S2);"], False


# ── dynamic slices ───────────────────────────────────────────────────────────

def _window(starts, shape, sizes, body):
    """A block where ``off`` is the clamped window offset into an array of ``shape``."""
    st = strides(shape)
    return [f"{{ static const long sh[] = {_arr(shape)}; static const long wz[] = {_arr(sizes)}; "
            f"static const long st[] = {_arr(st)};",
            f"  const long off = tg_window({starts}, {len(shape)}, sh, wz, st);"] + \
        ["  " + line for line in body] + ["}"]


def _fill(dst, sizes, shape):
    if not sizes:
        return [f"({dst})[0] = R(0.0);"]   # dst may be an offset expression (``S0 + off``)
    return [f"tg_window_fill({dst}, {len(sizes)}, wz, st, R(0.0));"]


def dslice_fwd(n):
    return _window(n.B, n.ash, n.osh, n.em.gather(n.V, f"{n.A} + off", n.osh, strides(n.ash)))


def dslice_da(n):
    return _window(n.B, n.ash, n.osh, [f"tg_fill({n.dst}, {math.prod(n.ash)}L, R(0.0));"] +
                   n.em.scatter(f"{n.dst} + off", strides(n.ash), n.G, n.osh, True)), False


def dus_fwd(n):
    return _window(n.C, n.ash, n.bsh, [_copy(n.V, n.A, n.ash)] +
                   n.em.scatter(f"{n.V} + off", strides(n.ash), n.B, n.bsh, True))


def dus_d(n):
    if n.side == "a":
        return _window(n.C, n.ash, n.bsh, [_copy(n.dst, n.G, n.ash)] + _fill(f"{n.dst} + off", n.bsh, n.ash)), False
    return _window(n.C, n.ash, n.bsh, n.em.gather(n.dst, f"{n.G} + off", n.bsh, strides(n.ash))), False


FORWARD.update({"take": take_fwd, "take_along_axis": along_fwd, "index_add": index_add_fwd,
                "index_set": index_set_fwd, "dynamic_slice": dslice_fwd, "dynamic_update_slice": dus_fwd})
BACKWARD.update({"take": take_da, "take_along_axis": along_da, "index_add": index_add_d,
                 "index_set": index_set_d, "dynamic_slice": dslice_da, "dynamic_update_slice": dus_d})
