"""JAX calls tapegrad: captured programs as XLA FFI custom calls (``program``, ``tg_xla.c``; the episode on
the GPU: ``gpu_call``, ``tg_gpu.c``), the host callback they fall back on (``callback``), a function
recorded on a tape as a differentiable JAX function (``function``), and zero-copy DLPack bridges
(``dlpack``)."""
from .dlpack import CopyWarning, cupy_to_jax, from_jax, jax_to_cupy, preallocation_advice, to_jax
from .function import TransformError, jax_function
from .program import (ProgramError, SGDState, episode_state, flatten_state, program_call, program_episode,
                      program_inputs, unflatten_state)

__all__ = ["CopyWarning", "to_jax", "from_jax", "cupy_to_jax", "jax_to_cupy", "preallocation_advice",
           "TransformError", "jax_function", "ProgramError", "SGDState", "episode_state", "flatten_state",
           "program_call", "program_episode", "program_inputs", "unflatten_state"]
