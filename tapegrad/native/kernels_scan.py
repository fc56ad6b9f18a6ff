"""The native C of the scan family's ops: printers registered into ``kernels.FORWARD``/``BACKWARD``."""
