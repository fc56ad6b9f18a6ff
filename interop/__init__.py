"""interop: tapegrad inside JAX — every import of jax in the project lives here.

- ``to_jax`` / ``from_jax`` (and ``cupy_to_jax`` / ``jax_to_cupy``): zero-copy DLPack bridges.
- ``jax_function(build)``: a function recorded on a tape as a differentiable JAX function.
- ``program_call(program)`` / ``program_episode(program)``: a captured native program as an XLA FFI
  custom call inside ``jax.jit`` (differentiable, batchable, per-shard under ``shard_map``).
- ``check_grads(f, *args)``: the gradient oracle — replay a ``jax.numpy`` function's jaxpr on a tape
  and compare with ``jax.grad``.
- ``optax_chain(opt)`` / ``compare_with_optax(...)``: tapegrad optimizers next to their optax twins.

Module map: ``dlpack`` (bridges), ``callback`` (the one place that picks the host-callback
mechanism), ``function`` (jax_function), ``program`` + ``tg_xla.c`` (FFI custom calls and their
fallback), ``oracle`` (check_grads), ``parity`` (optax).

Importing interop enables ``jax_enable_x64`` (see ``interop._jax``).
"""
from ._jax import jax, jnp
from .dlpack import CopyWarning, cupy_to_jax, from_jax, jax_to_cupy, to_jax
from .function import TransformError, jax_function
from .oracle import Divergence, GradReport, UnsupportedPrimitiveError, check_grads
from .parity import ParityReport, compare_with_optax, optax_chain
from .program import (ProgramError, SGDState, episode_state, flatten_state, program_call, program_episode,
                      program_inputs, unflatten_state)

__all__ = ["jax", "jnp", "CopyWarning", "to_jax", "from_jax", "cupy_to_jax", "jax_to_cupy",
           "TransformError", "jax_function", "Divergence", "GradReport", "UnsupportedPrimitiveError",
           "check_grads", "ParityReport", "compare_with_optax", "optax_chain", "ProgramError",
           "SGDState", "episode_state", "flatten_state", "program_call", "program_episode", "program_inputs",
           "unflatten_state"]
