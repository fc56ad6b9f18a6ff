"""The native C of the linalg family's ops: printers registered into ``kernels.FORWARD``/``BACKWARD``."""
