"""The native C of the ops that are not elementwise: one forward and one backward printer per op name.

``registry`` holds the tables (``FORWARD``, ``BACKWARD``, ``SCRATCH``), the ``Node`` a printer takes and
the index arithmetic the printers share, and imports no family; ``core`` prints the core ops; ``scan``,
``index``, ``conv``, ``linalg`` one op family each (as in ``tapegrad.ops``; the special family is all
elementwise, its C is the registry's expressions), ``ordered`` the ordered-mode dots and sums. Importing
the package registers them all. ``tapegrad.native.kernels.X`` is the registry's ``X``.
"""
from .registry import *  # noqa: F401,F403
from . import core, scan, index, conv, linalg, ordered  # noqa: E402,F401
