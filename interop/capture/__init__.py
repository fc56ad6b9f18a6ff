"""JAX functions as tapegrad programs: ``capture_jax`` (on the oracle's replay, following custom derivative
rules as ``jax.grad`` does: ``expand``), one capture per input signature (``signatures``), and the drop-ins
for ``jax.value_and_grad`` and a jitted optax training step (``train``, reading optax's optimizers:
``optax_native``); ``parity`` sets tapegrad's optimizers next to their optax twins."""
from .capture import CaptureError, Captured, capture_jax
from .parity import ParityReport, compare_with_optax, optax_chain
from .signatures import clear_caches
from .train import TrainStep, ValueAndGrad, train_step, value_and_grad

__all__ = ["CaptureError", "Captured", "capture_jax", "ValueAndGrad", "value_and_grad", "TrainStep", "train_step",
           "ParityReport", "compare_with_optax", "optax_chain", "clear_caches"]
