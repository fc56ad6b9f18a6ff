"""Test-session setup. interop changes no JAX setting on import; the suite runs JAX in 64-bit mode
(float64 programs need it), as JAX's own tests do with JAX_ENABLE_X64. Tests of the 32-bit mode run
in subprocesses or inside ``jax.enable_x64(False)``."""
import os

os.environ.setdefault("JAX_ENABLE_X64", "1")
