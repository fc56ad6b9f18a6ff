"""The one place interop imports jax.

Importing interop changes no JAX setting. tapegrad computes in float64 by default, and with JAX's
x64 mode off JAX would truncate every float64 array crossing the bridge to float32, so the parts that
need 64-bit say so: the oracle runs inside a scoped ``jax.enable_x64(True)``; ``program_call`` /
``program_episode`` of a float64 program refuse to run with x64 off (enable it with
``jax.config.update("jax_enable_x64", True)`` or ``with jax.enable_x64(True):``, or capture with
``dtype="float32"``, which works either way).
"""
import jax
import jax.numpy as jnp

__all__ = ["jax", "jnp", "x64_enabled"]


def x64_enabled():
    """Whether JAX's 64-bit mode is on here (the global setting or a scoped ``jax.enable_x64``)."""
    return bool(jax.config.jax_enable_x64)
