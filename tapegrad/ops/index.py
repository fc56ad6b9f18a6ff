"""Selection and indexing: where, take, gathers and scatters, dynamic slices.

Registry entries of this family (see ``tapegrad.ops.registry`` for what an entry holds). Indices and masks are
data inputs (``tape.const`` of an integer or bool array). Conventions, chosen once for every backend:

- An index outside ``[-n, n)`` is an error (on the tape at the op, in a program at ``set_input``);
  negative indices count from the end, as in NumPy. JAX instead clamps (gathers) or drops (scatters)
  out-of-range indices silently; clamp explicitly (``np.clip``) where that is what you mean.
- ``dynamic_slice`` and ``dynamic_update_slice`` read a negative start from the end and then clamp
  the starts so the window fits, as ``lax.dynamic_slice`` does (their documented meaning, no error).
- A scatter-add (the VJP of every gather, and ``index_add``) adds contributions in increasing index
  position, one element at a time (``numpy.add.at``'s order), so every replay sums in the same order.
- ``index_set`` with repeated indices keeps the last occurrence; the overwritten ones get no gradient.
"""
import builtins

import numpy as np

from .registry import Bad, op, real

_mask_rng = np.random.default_rng(11)


def _mask(*shape):
    return _mask_rng.random(shape) < 0.5


def _index(n, *shape):
    return _mask_rng.integers(-n, n, shape)


def _axis(shape, axis, what="axis"):
    if not isinstance(axis, int) or not 0 <= axis < builtins.max(len(shape), 1) or not shape:
        raise Bad(f"{what} {axis!r} is out of range for an input of shape {shape}")


def _in_range(idx, n, what="index"):
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = idx[(idx < -n) | (idx >= n)].ravel()[0]
        raise Bad(f"{what} {bad} is out of range for an axis of length {n} (expected -{n} <= index < {n}; "
                  f"JAX would clamp or drop it silently: clip it explicitly if that is what you mean)")


def _at(axis, idx):
    """The NumPy index that selects ``idx`` along ``axis``."""
    return (builtins.slice(None),) * axis + (idx,)


# ── where ────────────────────────────────────────────────────────────────────

def where_shape(a, b, s, c):
    try:
        return np.broadcast_shapes(a, b, c)
    except ValueError:
        raise Bad(f"shapes {a} (taken where the mask holds), {b} (elsewhere) and mask {c} do not "
                  f"broadcast") from None


def where_fwd(a, b, s, out, ws, c):
    np.copyto(out, b)
    np.copyto(out, a, where=c)


def where_da(g, out, a, b, s, ws, c):
    # g where the mask holds, exact zeros elsewhere: nothing of the branch not taken can leak in
    t = ws.take(g.shape)
    t.fill(0.0)
    np.copyto(t, g, where=c)
    return t


def where_db(g, out, a, b, s, ws, c):
    t = ws.take(g.shape)
    np.copyto(t, g)
    np.copyto(t, 0.0, where=c)
    return t


where = op("where", 3, where_shape, inputs="ffb", fwd=where_fwd, da=where_da, db=where_db,
           ref=lambda jnp, a, b, s, c: jnp.where(c, a, b),
           c_fwd="c ? a : b", c_da="c ? g : 0.0", c_db="c ? 0.0 : g", domain=(real, real, None),
           cases=(((3, 4), (3, 4), None, _mask(3, 4)), ((3, 4), (4,), None, _mask(3, 1)),
                  ((), (2, 3), None, _mask(2, 3)), ((2, 1), (1, 3), None, _mask(3))),
           doc="a where the bool mask c holds, else b (broadcasting); the untaken branch gets exact zeros")


# ── take: a gather along one axis ────────────────────────────────────────────

def take_shape(a, b, s):
    _axis(a, s)
    return a[:s] + b + a[s + 1:]


def take_check(a, b, s):
    _in_range(b, a.shape[s])


def take_fwd(a, b, s, out, ws):
    np.take(a, b, axis=s, out=out)


def take_da(g, out, a, b, s, ws):
    # the scatter-add of g back into the gathered rows, in increasing position (numpy.add.at's order)
    t = ws.take(a.shape)
    t.fill(0.0)
    np.add.at(t, _at(s, b), g)
    return t


take = op("take", 2, take_shape, inputs="fi", check=take_check, fwd=take_fwd, da=take_da,
          ref=lambda jnp, a, b, s: jnp.take(a, b, axis=s), kind="index", domain=(real, None),
          cases=(((5, 3), _index(5, 4), 0), ((2, 6), _index(6, 2, 3), 1), ((4,), _index(4, 7), 0),
                 ((3, 4, 2), np.array([1, 1, 2, -1]), 1)),
          doc="a gathered along axis s at integer indices b (an embedding lookup); VJP a scatter-add")


# ── take_along_axis ──────────────────────────────────────────────────────────

def along_shape(a, b, s):
    _axis(a, s)
    if len(b) != len(a) or any(x != y for k, (x, y) in enumerate(zip(a, b)) if k != s):
        raise Bad(f"indices of shape {b} must match the input's shape {a} on every axis but {s}")
    return b


def along_check(a, b, s):
    _in_range(b, a.shape[s])


def along_index(b, s):
    grid = list(np.ix_(*[np.arange(n) for n in b.shape]))
    grid[s] = b
    return tuple(grid)


def along_fwd(a, b, s, out, ws):
    np.copyto(out, np.take_along_axis(a, b, axis=s))


def along_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    t.fill(0.0)
    np.add.at(t, along_index(b, s), g)
    return t


take_along_axis = op("take_along_axis", 2, along_shape, inputs="fi", check=along_check, fwd=along_fwd,
                     da=along_da, ref=lambda jnp, a, b, s: jnp.take_along_axis(a, b, axis=s), kind="index",
                     domain=(real, None),
                     cases=(((4, 3), _index(3, 4, 1), 1), ((4, 3), _index(4, 2, 3), 0),
                            ((2, 3, 4), _index(4, 2, 3, 5), 2)),
                     doc="a[…, b, …] along axis s with b shaped like a (integer labels: pick one logit per row)")


# ── scatters ─────────────────────────────────────────────────────────────────

def scatter_shape(a, b, s, c):
    _axis(a, s)
    want = a[:s] + c + a[s + 1:]
    if b != want:
        raise Bad(f"updates must have shape {want} (input {a} with axis {s} replaced by the indices' shape "
                  f"{c}), got {b}")
    return a


def scatter_check(a, b, s, c):
    _in_range(c, a.shape[s])


def index_add_fwd(a, b, s, out, ws, c):
    np.copyto(out, a)
    np.add.at(out, _at(s, c), b)


def index_add_db(g, out, a, b, s, ws, c):
    return np.take(g, c, axis=s, out=ws.take(b.shape))


index_add = op("index_add", 3, scatter_shape, inputs="ffi", check=scatter_check, fwd=index_add_fwd,
               da=lambda g, out, a, b, s, ws, c: g, db=index_add_db, aliases=True,
               ref=lambda jnp, a, b, s, c: a.at[(slice(None),) * s + (c,)].add(b), kind="index",
               domain=(real, real, None),
               cases=(((5, 3), (4, 3), 0, _index(5, 4)), ((2, 4), (2, 2, 3), 1, _index(4, 2, 3)),
                      ((3,), (5,), 0, np.array([0, 2, 0, -1, 0]))),
               doc="a with b added at indices c along axis s (x.at[c].add(b)); repeated indices accumulate")


def winners(c, n):
    """Positions (in c's flat order) of the last occurrence of each index: the writes that survive."""
    j = np.where(c < 0, c + n, c).ravel()
    _, first = np.unique(j[::-1], return_index=True)
    keep = np.zeros(j.shape, bool)
    keep[j.size - 1 - first] = True
    return keep.reshape(c.shape)


def index_set_fwd(a, b, s, out, ws, c):
    np.copyto(out, a)
    w = winners(c, a.shape[s])
    out[_at(s, c[w])] = np.compress(w.ravel(), b.reshape(b.shape[:s] + (-1,) + b.shape[s + c.ndim:]), axis=s)


def index_set_da(g, out, a, b, s, ws, c):
    t = ws.take(g.shape)
    np.copyto(t, g)
    t[_at(s, c)] = 0.0
    return t


def index_set_db(g, out, a, b, s, ws, c):
    t = np.take(g, c, axis=s, out=ws.take(b.shape))
    lost = ~winners(c, g.shape[s])
    t[_at(s, lost)] = 0.0
    return t


index_set = op("index_set", 3, scatter_shape, inputs="ffi", check=scatter_check, fwd=index_set_fwd,
               da=index_set_da, db=index_set_db, kind="index", domain=(real, real, None),
               ref=lambda jnp, a, b, s, c: _ref_set(jnp, a, b, s, c),
               cases=(((5, 3), (4, 3), 0, np.array([3, 0, -1, 1])), ((2, 4), (2, 3), 1, np.array([1, 3, 0])),
                      ((4,), (5,), 0, np.array([0, 2, 0, 3, 2]))),
               doc="a with b written at indices c along axis s (x.at[c].set(b)); a repeated index keeps the last")


def _ref_set(jnp, a, b, s, c):
    # JAX leaves the winner among repeated indices unspecified: give it only the last occurrences
    w = winners(np.asarray(c), a.shape[s])
    keep = np.flatnonzero(w.ravel())
    b = jnp.take(b.reshape(b.shape[:s] + (-1,) + b.shape[s + c.ndim:]), keep, axis=s)
    return a.at[(slice(None),) * s + (np.asarray(c).ravel()[keep],)].set(b)


# ── dynamic slices: data-dependent starts, clamped as lax.dynamic_slice does ───

def starts_of(c, shape, sizes):
    """lax's rule: a negative start counts from the end, then the window is clamped to fit."""
    return tuple(builtins.min(builtins.max(int(x) + n if x < 0 else int(x), 0), n - m)
                 for x, n, m in zip(c, shape, sizes))


def window(starts, sizes):
    return tuple(builtins.slice(x, x + m) for x, m in zip(starts, sizes))


def dslice_shape(a, b, s):
    if b != (len(a),):
        raise Bad(f"starts must be one integer per axis of {a}: shape ({len(a)},), got {b}")
    if len(s) != len(a) or any(not 0 <= m <= n for m, n in zip(s, a)):
        raise Bad(f"sizes {s} must give one size per axis of {a}, each at most the axis' length")
    return tuple(s)


def dslice_fwd(a, b, s, out, ws):
    np.copyto(out, a[window(starts_of(b, a.shape, s), s)])


def dslice_da(g, out, a, b, s, ws):
    t = ws.take(a.shape)
    t.fill(0.0)
    t[window(starts_of(b, a.shape, s), s)] = g
    return t


dynamic_slice = op("dynamic_slice", 2, dslice_shape, inputs="fi", fwd=dslice_fwd, da=dslice_da, kind="index",
                   ref=lambda jnp, a, b, s: jnp.lax.dynamic_slice(a, tuple(b), s), domain=(real, None),
                   cases=(((5, 4), np.array([1, 2]), (3, 2)), ((6,), np.array([4]), (3,)),
                          ((3, 4), np.array([-2, 9]), (2, 2))),
                   doc="a window of sizes s at data-dependent starts b (clamped so the window fits, as in lax)")


def dus_shape(a, b, s, c):
    if c != (len(a),):
        raise Bad(f"starts must be one integer per axis of {a}: shape ({len(a)},), got {c}")
    if len(b) != len(a) or any(m > n for m, n in zip(b, a)):
        raise Bad(f"the update {b} must have the input's rank and fit inside it ({a})")
    return a


def dus_fwd(a, b, s, out, ws, c):
    np.copyto(out, a)
    out[window(starts_of(c, a.shape, b.shape), b.shape)] = b


def dus_da(g, out, a, b, s, ws, c):
    t = ws.take(g.shape)
    np.copyto(t, g)
    t[window(starts_of(c, a.shape, b.shape), b.shape)] = 0.0
    return t


def dus_db(g, out, a, b, s, ws, c):
    t = ws.take(b.shape)
    np.copyto(t, g[window(starts_of(c, a.shape, b.shape), b.shape)])
    return t


dynamic_update_slice = op("dynamic_update_slice", 3, dus_shape, inputs="ffi", fwd=dus_fwd, da=dus_da, db=dus_db,
                          kind="index", ref=lambda jnp, a, b, s, c: jnp.lax.dynamic_update_slice(a, b, tuple(c)),
                          domain=(real, real, None),
                          cases=(((5, 4), (2, 3), None, np.array([1, 1])), ((6,), (2,), None, np.array([5])),
                                 ((3, 3), (1, 3), None, np.array([-1, 0]))),
                          doc="a with the window at data-dependent starts c overwritten by b (clamped, as in lax)")
