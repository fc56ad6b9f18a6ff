"""The printer tables every family of native kernels registers into, the ``Node`` they print, and the
row-major index arithmetic they share.

A printer mirrors its op's NumPy rule in ``tapegrad.ops`` step by step (one rounding per NumPy call,
NumPy's reduction order).

A forward printer takes a ``Node`` and returns C lines; a backward printer returns ``(lines, done)``:
lines that write the contribution to ``n.dst`` (the gradient itself for a first contribution, else
scratch S0 that the emitter then adds), or, with ``done``, lines that already accumulated it. An op
missing here has no native form: the emitter raises naming it.

``SCRATCH[name](p, k)`` (optional) is how many elements each of the three scratch buffers S0..S2 must
hold for node ``k`` of program ``p``, when that is more than the largest node shape (im2col, say).
"""
import math
from typing import NamedTuple


class Node(NamedTuple):
    em: object          # the Emitter (reduce/gather/scatter/acc/unbroadcast printers)
    name: str
    k: int
    a: int
    b: int
    s: object
    A: str              # value buffer names of a, b, the node, and the node's gradient
    B: str
    V: str
    G: str
    ash: tuple
    bsh: tuple
    osh: tuple
    side: str           # backward: "a" or "b"
    j: int              # backward: the input receiving the contribution
    dst: str            # backward: where the contribution goes
    first: bool
    d: object           # the dialect (literals)
    C: str = None       # the third (data) input's value buffer and shape, if the op has one
    csh: tuple = None


def c_array(vals):
    """A C initialiser for a ``static const long`` table (``{0}`` for an empty one)."""
    return "{" + ", ".join(str(int(v)) for v in vals) + "}" if vals else "{0}"


def strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def bstrides(xs, os_):
    """Element strides of an operand of shape xs read over out shape os_ (0 on broadcast axes)."""
    lead = len(os_) - len(xs)
    st = strides(xs)
    return tuple(0 if k < lead or xs[k - lead] == 1 else st[k - lead] for k in range(len(os_)))


def red_mask(shape, axes):
    axes = range(len(shape)) if axes is None else axes
    return tuple(1 if k in axes else 0 for k in range(len(shape)))


def keep(shape, s):
    axes = range(len(shape)) if s[0] is None else s[0]
    return tuple(1 if k in axes else n for k, n in enumerate(shape))


def axis3(shape, s):
    return math.prod(shape[:s]), shape[s], math.prod(shape[s + 1:])


def _loop(n, body):
    return f"for (long i = 0; i < {n}L; i++) {body}"


FORWARD = {}
BACKWARD = {}
SCRATCH = {}
