"""One reading of the registry's test cases for every harness: inputs per kind, recorded on a tape.

A case is ``(a, b, s)`` or, for an op with a third input, ``(a, b, s, c)``; a float input is given by
its shape (values drawn from the op's domain), a data input (indices, a mask) by the array itself. A
float input that passes no gradient ("n", ``stop_gradient``'s) is recorded like a float one.
"""
import numpy as np


def parts(op, case):
    """(the per-input entries of ``case``, the static operand s)."""
    if op.arity == 3:
        a, b, s, c = case
        return (a, b, c), s
    a, b, s = case
    return (a, b)[:op.arity], s


def make(op, case, rng):
    """(one array per input, s): floats drawn from the op's domain, data as the case gives it."""
    entries, s = parts(op, case)
    arrays = [np.asarray(x) if kind not in "fn" else dom(rng, tuple(x))
              for kind, x, dom in zip(op.inputs, entries, op.domain)]
    return arrays, s


def record(tape, op, arrays, s, leaf="param"):
    """Leaves for ``arrays`` (floats as ``leaf``, data as constants) and the op applied: (vars, y)."""
    vs = [getattr(tape, leaf)(x) if kind in "fn" else tape.const(x) for kind, x in zip(op.inputs, arrays)]
    a, b, c = (vs + [None, None])[:3]
    return vs, tape.apply(op, a, b, s, c)


def floats(op, xs):
    """The entries of ``xs`` (one per input) that belong to float (differentiable) inputs."""
    return [x for kind, x in zip(op.inputs, xs) if kind == "f"]


def call(op, fn, xs, s):
    """``fn(a, b, s[, c])`` for a rule with the registry's argument order, given one x per input."""
    a, b, c = (list(xs) + [None, None])[:3]
    return fn(a, b, s, c) if op.arity == 3 else fn(a, b, s)
