"""Host callbacks inside JAX computations — the one module that knows which mechanism is used.

tapegrad code runs on the host through ``jax.experimental.buffer_callback``: XLA hands the callback
its own input and output buffers (zero-copy on CPU), where ``jax.pure_callback`` copies every
argument twice and the result once, ≈0.2 ms per call (docs/interop.md, "The FFI handler"). Should
``buffer_callback`` change or go, this file is the only one to edit.

``host_call(fn, specs, *args)`` calls ``fn(outs, *args)`` with NumPy arrays: ``outs`` are XLA's
result buffers, to be filled in place; ``args`` are read-only views of XLA's operands.
"""
import numpy as np

from .._jax import jax, varying

MECHANISM = "buffer_callback"


def _view(buf, writable):
    a = np.asarray(buf)
    if not writable and a.flags.writeable:  # buffer_callback hands out writable views of inputs too
        a = a.view()
        a.flags.writeable = False
    return a


def host_call(fn, result_specs, *args, vmap_method="sequential", input_output_aliases=None):
    """Run ``fn(outs, *args)`` on the host, zero-copy, and return the filled ``outs`` as JAX arrays.

    ``result_specs``: a tuple of objects with ``shape`` and ``dtype`` (``jax.ShapeDtypeStruct``).
    ``vmap_method``: as for ``jax.pure_callback`` ("sequential" calls ``fn`` once per batch element,
    "broadcast_all" once with the batch axis leading on every operand).

    >>> import numpy as np, interop
    >>> from interop.xla.callback import host_call
    >>> def twice(outs, x): np.multiply(x, 2.0, out=outs[0])
    >>> spec = interop.jax.ShapeDtypeStruct((3,), np.float64)
    >>> interop.jax.jit(lambda x: host_call(twice, (spec,), x)[0])(interop.jnp.arange(3.0))
    Array([0., 2., 4.], dtype=float64)
    """
    from jax.experimental.buffer_callback import buffer_callback

    def cb(ctx, outs, *bufs):
        fn([_view(o, True) for o in outs], *(_view(b, False) for b in bufs))

    call = buffer_callback(cb, tuple(result_specs), vmap_method=vmap_method,
                           input_output_aliases=input_output_aliases)
    return tuple(_retype(o, s) for o, s in zip(call(*args), result_specs))


def _retype(out, spec):
    """buffer_callback types its results without shard_map's varying axes: restore the spec's."""
    missing = varying(spec) - varying(out)
    return jax.lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out


def copying_call(fn, result_specs, *args, vmap_method="sequential"):
    """The same contract through ``jax.pure_callback`` (copies in and out); for benchmarks only."""
    def cb(*arrays):
        outs = [np.empty(s.shape, s.dtype) for s in result_specs]
        fn(outs, *(np.asarray(a) for a in arrays))
        return tuple(outs)

    return tuple(jax.pure_callback(cb, tuple(result_specs), *args, vmap_method=vmap_method))
