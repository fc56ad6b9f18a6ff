"""The native backend of a captured program: generated C, built once, called once per episode.

``expr`` parses and prints the registry's scalar C expressions (C and CUDA dialects), ``kernels`` prints
the non-elementwise ops, ``fuse`` plans fused elementwise loops, ``codegen`` prints a whole program
(fixed ABI), ``build`` compiles it into the content-hashed cache, ``runner`` owns the buffer table and
calls the library (and answers ``Program.native_abi()``); ``runtime.c`` holds the generic kernels.
"""
from .build import cache_info, clear_cache  # noqa: E402,F401  (the build cache, see build.py)
