"""The native runtime's math functions (exp, tanh, digamma, trigamma), the same C compiled for the GPU.

``tapegrad/native/runtime_special.c`` is written over ``real`` in plain C (double arithmetic, libm's
``log``/``tan``/``sin``/``floor``/``nearbyint``); a CUDA program whose kernels call ``tg_digamma`` or
``tg_trigamma`` gets that file verbatim with ``TG_FN`` as a static device function. Built with
``--fmad=false`` (as the runner and the nvcc tests do) nothing is contracted, so the only difference
from the native program is the device's libm (CUDA's ``log``, ``tan``, ``sin``: within 1-2 ulp of
glibc's); the host emulation calls glibc, so there it gives the native program's bits.
"""
import os
import re

from ..native.expr import RUNTIME_FUNCS

_NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")
_PATH = os.path.join(_NATIVE, "runtime_special.c")
_VMATH = os.path.join(_NATIVE, "runtime_vmath.c")   # exp, tanh, log, erf (VECTOR_MATH32), device functions there
DEVICE_FUNCS = frozenset({"tg_digamma", "tg_trigamma"})   # the runtime helpers a CUDA program can call
assert DEVICE_FUNCS <= RUNTIME_FUNCS


def needed(kernels):
    """Whether any kernel text calls one of the special runtime functions (or the runtime's exp, tanh, log, erf)."""
    return any(re.search(r"\btg_((di|tri)gamma|exp|tanh|log|erf)\(", k) for k in kernels)


def source():
    """Lines defining tg_exp/tg_tanh, tg_digamma/tg_trigamma (and tg_digamma_root) as device functions."""
    with open(_VMATH) as f:
        vmath = f.read()
    with open(_PATH) as f:
        text = f.read()
    return ["/* tapegrad/native/runtime_vmath.c, compiled for the device */", vmath.rstrip(),
            "/* tapegrad/native/runtime_special.c, compiled for the device */",
            "#define TG_FN static __device__ __attribute__((unused))",
            text.rstrip(), "#undef TG_FN", ""]
