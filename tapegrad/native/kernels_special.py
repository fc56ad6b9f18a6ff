"""The native C of the special family's ops: printers registered into ``kernels.FORWARD``/``BACKWARD``."""
