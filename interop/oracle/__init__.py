"""The gradient oracle: ``check_grads`` replays a JAX function's jaxpr on a tapegrad tape and compares its
gradients with ``jax.grad``'s.

``table`` (the primitive table, at the bottom: it imports nothing of the package) ← ``replay`` (a jaxpr
flattened into steps, JAX's values of them, the walk that records them) ← ``rules`` (one rule per
primitive), ``loops`` (scan, while, cond, custom_linear_solve) and ``trust`` (trusted custom rules), which
register into the table ← ``check`` (``check_grads`` and its report). The capture (``interop.capture``)
stands on the same replay.
"""
from . import loops, replay, rules, table, trust  # noqa: F401  (rules, loops, trust register into the table)
from .check import (CheckGradsError, Divergence, GradientMismatchError, GradReport, Kink, Precision, TracingError,
                    assert_grads, check_grads)
from .table import UnsupportedPrimitiveError, primitive_table

assert set(replay.CONTROL) <= set(table.CONTROL_RULES)

__all__ = ["check_grads", "assert_grads", "GradReport", "Divergence", "Kink", "Precision", "UnsupportedPrimitiveError",
           "TracingError", "GradientMismatchError", "CheckGradsError", "primitive_table"]
