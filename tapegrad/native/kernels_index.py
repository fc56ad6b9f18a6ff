"""The native C of the index family's ops: printers registered into ``kernels.FORWARD``/``BACKWARD``."""
