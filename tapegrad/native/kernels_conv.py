"""The native C of the conv family's ops: printers registered into ``kernels.FORWARD``/``BACKWARD``."""
