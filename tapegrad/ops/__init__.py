"""The op registry and its families: every op defined once, read by the tape, backward, replay, emitters and tests.

``registry`` holds the ``Op`` record and the ``OPS`` table (what an entry holds is in its docstring) and
imports no family; ``core`` the ops every model uses and the shape rules the others reuse; ``special``,
``scan``, ``index``, ``conv``, ``linalg`` and ``route`` one family each. Importing the package registers them all, in
this order (docs/ops.md's op table and every registry-parametrized test follow it). ``tapegrad.ops.X`` is
the registry's or the core's ``X``; a family's own names are reached through its module
(``tapegrad.ops.conv.geometry``).
"""
from .registry import *  # noqa: F401,F403
from .core import *  # noqa: F401,F403
from . import special, scan, index, conv, linalg, route  # noqa: E402,F401
