"""The GPU backend: a captured program as CUDA source (``source``), its host emulation (``host``) and the
CuPy runner (``runner``). Nothing here imports CuPy until a program is captured with ``backend="cupy"``."""
