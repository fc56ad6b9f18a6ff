"""The one place interop imports jax and sets it up.

Importing ``interop`` turns on ``jax_enable_x64``: tapegrad computes in float64 by default, and with
x64 off JAX would silently truncate every float64 array crossing the bridge to float32. Code that
must stay in 32-bit mode should not import interop.
"""
import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

__all__ = ["jax", "jnp"]
