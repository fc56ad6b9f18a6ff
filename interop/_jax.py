"""The one place interop imports jax.

Importing interop changes no JAX setting. tapegrad computes in float64 by default, and with JAX's
x64 mode off JAX would truncate every float64 array crossing the bridge to float32, so the parts that
need 64-bit say so: the oracle runs inside a scoped ``jax.enable_x64(True)``; ``program_call`` /
``program_episode`` of a float64 program refuse to run with x64 off (enable it with
``jax.config.update("jax_enable_x64", True)`` or ``with jax.enable_x64(True):``, or capture with
``dtype="float32"``, which works either way).

interop supports jax and jaxlib 0.10.2 to 0.12.x (docs/install.md); what differs across that range is
decided here, from the installed jaxlib's version.
"""
import re

try:
    import jax
    import jax.numpy as jnp
    import jaxlib
except ModuleNotFoundError as e:   # interop is tapegrad's JAX extension: say how to install it
    raise ImportError(f"interop needs JAX, which is not installed ({e}): pip install \"tapegrad[jax]\" (jax, jaxlib, "
                      f"optax and chex at the versions interop is tested with); tapegrad itself works without it") from e

__all__ = ["jax", "jnp", "JAXLIB", "CPU_FUSION_EMITTERS_SWITCH", "scan_counts", "x64_enabled", "varying",
           "align_varying"]


def release(version):
    """``(major, minor, patch)`` of a version string: ``release("0.12.0.1") == (0, 12, 0)``."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a jax version: {version!r} (expected major.minor.patch, e.g. '0.12.0')")
    return tuple(int(p) for p in m.groups())


JAXLIB = release(jaxlib.__version__)
# XLA's compile option `xla_cpu_use_fusion_emitters` (False: its older, faster-to-compile CPU fusion
# emitters) exists up to jaxlib 0.11.0; later ones reject it ("No such compile option").
CPU_FUSION_EMITTERS_SWITCH = JAXLIB < (0, 11, 1)


def scan_counts(params):
    """``(consts, carry)``: how many of a ``scan`` equation's operands are each (the rest are scanned over).

    jax 0.10 states them (``num_consts``, ``num_carry``); jax 0.11 replaced both with ``ft_in``, the
    operands' flat trees (consts, carry, xs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def x64_enabled():
    """Whether JAX's 64-bit mode is on here (the global setting or a scoped ``jax.enable_x64``)."""
    return bool(jax.config.jax_enable_x64)


def varying(x):
    """The ``shard_map`` axes a value (or an abstract value) varies over (empty outside shard_map)."""
    m = getattr(x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x), "manual_axis_type", None)
    return frozenset(m.varying) if m is not None else frozenset()


def align_varying(xs):
    """Under ``shard_map``, cast every array operand to the union of the operands' varying axes (binding a
    primitive of per-shard and replicated values is otherwise a type error); Python scalars pass as they are."""
    arrays = [x for x in xs if not isinstance(x, (int, float, bool, complex))]
    axes = frozenset().union(*map(varying, arrays)) if arrays else frozenset()
    if not axes:
        return tuple(xs)
    return tuple(x if isinstance(x, (int, float, bool, complex)) or varying(x) == axes
                 else jax.lax.pcast(x, tuple(sorted(axes - varying(x))), to="varying") for x in xs)
