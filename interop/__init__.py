"""interop: tapegrad inside JAX — every import of jax in the project lives here.

- ``to_jax`` / ``from_jax`` (and ``cupy_to_jax`` / ``jax_to_cupy``, stream-ordered): zero-copy DLPack bridges;
  ``preallocation_advice()`` says when JAX's GPU preallocation would starve CuPy.
- ``jax_function(build)``: a function recorded on a tape as a differentiable JAX function.
- ``program_call(program)`` / ``program_episode(program)``: a captured native program as an XLA FFI
  custom call inside ``jax.jit`` (differentiable, batchable, per-shard under ``shard_map``).
- ``capture_jax(fn, *args)`` / ``value_and_grad(fn, *args)`` / ``train_step(fn, params, *batch, optimizer=)``:
  a JAX (flax, equinox, optax) loss as a native program, and its faces inside ``jax.jit``; captures are
  shared across the process, as jit's compilations are (``clear_caches()`` forgets them).
- ``check_grads(f, *args, argnums=…, has_aux=…)`` / ``assert_grads``: the gradient oracle — replay a
  JAX function's jaxpr on a tape and compare with ``jax.grad`` (a report, or an AssertionError).
- ``optax_chain(opt)`` / ``compare_with_optax(...)``: tapegrad optimizers next to their optax twins.

Three rooms, each a subpackage with its own map: ``oracle`` (check_grads: the replay of a jaxpr on a tape,
its primitive table at the bottom), ``xla`` (JAX calls tapegrad: FFI custom calls, the host callback,
DLPack) and ``capture`` (JAX functions as programs, standing on the oracle's replay and calling through
``xla``). ``_jax`` is the one module that imports jax.

Importing interop changes no JAX setting (see ``interop._jax``): the oracle scopes its own 64-bit
mode, and float64 programs ask for it when it is off.

``interop`` is also the import name of Illumina's InterOp on PyPI: where both are installed, one replaces
the other's ``__init__.py``. ``tapegrad.interop_check()`` says which one ``import interop`` finds, and how to
repair it.
"""
from tapegrad import __version__ as __version__   # one version: interop ships inside tapegrad

# tapegrad.interop_check() (and `python -m tapegrad info`) look for this name in this file's text: it tells
# tapegrad's interop from another package installed under the same top-level name (Illumina's InterOp)
__tapegrad_interop__ = True

from ._jax import jax, jnp  # noqa: E402
from .xla import (CopyWarning, ProgramError, SGDState, TransformError, cupy_to_jax, episode_state, flatten_state,
                  from_jax, jax_function, jax_to_cupy, preallocation_advice, program_call, program_episode,
                  program_inputs, to_jax, unflatten_state)
from .oracle import (CheckGradsError, Divergence, GradientMismatchError, GradReport, Kink, Precision, TracingError,
                     UnsupportedPrimitiveError, assert_grads, check_grads)
from .capture import (CaptureError, Captured, ParityReport, TrainStep, ValueAndGrad, capture_jax, clear_caches,
                      compare_with_optax, optax_chain, train_step, value_and_grad)

__all__ = ["jax", "jnp", "CopyWarning", "to_jax", "from_jax", "cupy_to_jax", "jax_to_cupy", "preallocation_advice",
           "CaptureError", "Captured", "capture_jax", "value_and_grad", "train_step", "TrainStep", "ValueAndGrad",
           "clear_caches",
           "TransformError", "jax_function", "Divergence", "GradReport", "Kink", "Precision",
           "UnsupportedPrimitiveError", "TracingError", "GradientMismatchError", "CheckGradsError", "check_grads",
           "assert_grads",
           "ParityReport", "compare_with_optax", "optax_chain", "ProgramError", "SGDState", "episode_state",
           "flatten_state", "program_call", "program_episode", "program_inputs", "unflatten_state"]
