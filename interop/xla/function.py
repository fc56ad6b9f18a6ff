"""``jax_function``: a computation recorded on a tapegrad tape, as a differentiable JAX function."""
import functools
from typing import Any, Callable, Literal

import numpy as np

import tapegrad as tg

from .._jax import jax
from .callback import host_call


class TransformError(tg.TapeError, TypeError):
    """Raised for a JAX transformation that a tape-backed function cannot support (forward mode, grad of grad).

    ``jax_function``'s functions, ``program_call`` and ``program_episode`` raise it: tapegrad's backward
    is not itself recorded on a tape, so its gradients are first-order only. Part of tapegrad's error
    family: ``except tapegrad.TapeError`` catches it too.
    """


def jax_function(build: Callable[..., tg.Var], *,
                 vmap_method: Literal["sequential", "broadcast_all"] = "sequential") -> Callable[..., Any]:
    """Turn ``build(tape, *vars) -> Var`` into a JAX function of arrays with tapegrad's backward.

    Each call registers the arrays as parameters on a fresh tape, runs ``build`` and returns the
    value of the Var it returns. Under ``jax.grad``/``jax.vjp`` the backward rule re-records the tape
    from the saved inputs and runs ``tape.backward`` with the incoming cotangent as seed (the
    residuals are the inputs, so forward and backward calls never share mutable state). The host
    code runs through ``interop.xla.callback`` (zero-copy). It composes with ``jit``, ``grad``,
    ``vmap``, ``vmap(grad)``, ``grad(vmap)`` and ``jacrev``. The tape's dtype is the inputs' common
    float dtype (float32 or float64).

    A call raises ``TransformError`` under forward mode (``jvp``, ``jacfwd``) and for second
    derivatives (tapegrad's backward is not itself recorded on a tape), ``DTypeError`` for arguments
    that are not float32 or float64 arrays, and ``ArgumentError`` where ``build`` returns no Var.

    Args:
        build: Records the computation: ``build(tape, *vars)`` gets a fresh tape and one Var per
            array argument, and returns the result's Var.
        vmap_method: Under ``vmap``: "sequential" runs ``build`` per batch element;
            "broadcast_all" passes the batch axis to ``build``, for functions that are row-wise.

    Returns:
        The JAX function ``f(*arrays)``, differentiable in reverse mode.

    Examples:
        >>> import jax, jax.numpy as jnp, interop
        >>> f = interop.jax_function(lambda tape, x: (x * x).sum())
        >>> float(jax.grad(f)(jnp.array([1.0, 2.0]))[1])
        4.0
    """
    shapes = {}

    def result_spec(xs):
        key = tuple((x.shape, np.dtype(x.dtype)) for x in xs)
        if key not in shapes:
            dtype = _dtype(key, build)
            tape = tg.Tape(dtype)
            y = build(tape, *(tape.const_lazy(s, dtype) for s, _ in key))
            if not isinstance(y, tg.Var):
                raise tg.ArgumentError(f"jax_function({_name(build)}): build must return a Var, got "
                                       f"{type(y).__name__}")
            shapes[key] = (jax.ShapeDtypeStruct(y.shape, dtype), dtype)
        return shapes[key]

    def record(dtype, arrays):
        tape = tg.Tape(dtype)
        xs = [tape.param(a) for a in arrays]
        return tape, xs, build(tape, *xs)

    def forward(outs, *arrays):
        tape, _, y = record(outs[0].dtype, arrays)
        np.copyto(outs[0], tape.value(y))

    def backward(outs, *arrays):
        *arrays, ct = arrays
        tape, xs, y = record(ct.dtype, arrays)
        tape.backward(y, seed=ct)
        for o, x in zip(outs, xs):
            np.copyto(o, tape.grad(x), casting="same_kind")

    def call(*xs):
        spec, _ = result_spec(xs)
        return host_call(forward, (spec,), *xs, vmap_method=vmap_method)[0]

    def call_bwd(xs, ct):
        specs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs)
        return host_call(backward, specs, *xs, ct, vmap_method=vmap_method)

    # Second derivatives would differentiate the host calls themselves: say so plainly (custom_jvp
    # rules that raise) instead of JAX's "Buffer callbacks do not support JVP".
    primal = _no_jvp(call, build, "forward")
    cotangent = _no_jvp(call_bwd, build, "backward")

    @jax.custom_vjp
    def f(*xs):
        return primal(*xs)

    def fwd(*xs):
        return primal(*xs), xs

    def bwd(xs, ct):
        return tuple(cotangent(xs, ct))

    f.defvjp(fwd, bwd)

    @functools.wraps(build)
    def wrapped(*xs):
        xs = tuple(jax.numpy.asarray(x) for x in xs)
        return first_order(f, f"jax_function({_name(build)})", xs)

    return wrapped


def first_order(f, who, xs):
    """``f(*xs)``, with JAX's errors for forward-mode or second-order differentiation of a custom_vjp or
    host callback (``can't apply forward-mode autodiff``, ``Buffer callbacks do not support JVP … use
    jax.custom_jvp``, which suggests the wrong fix) replaced by a ``TransformError`` saying what is
    supported."""
    try:
        return f(*xs)
    except TransformError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        if "forward-mode" in msg or "jvp" in msg.lower():
            raise TransformError(f"{who}: forward-mode and higher-order differentiation (jvp, jacfwd, hessian, "
                                 f"grad of grad) are not supported: the function's custom_vjp is tapegrad's "
                                 f"reverse sweep, which is not itself differentiable; tapegrad gradients are "
                                 f"first-order only: use jax.grad / vjp / jacrev") from e
        raise


def _no_jvp(fn, build, what):
    g = jax.custom_jvp(fn)

    def jvp(primals, tangents):
        raise TransformError(f"jax_function({_name(build)}): cannot differentiate tapegrad's {what} call "
                             f"in forward mode: grad of grad, hessian, jvp and jacfwd are not supported "
                             f"(tapegrad's backward is not itself recorded on a tape); use first-order "
                             f"jax.grad / vjp / jacrev")

    g.defjvp(jvp)
    return g


def _dtype(key, build):
    dts = {d for _, d in key}
    if not dts or any(d.kind != "f" or d not in (np.float32, np.float64) for d in dts):
        raise tg.DTypeError(f"jax_function({_name(build)}): arguments must be float32/float64 arrays, got "
                        f"{sorted(map(str, dts))}")
    return np.result_type(*dts)


def _name(build):
    return getattr(build, "__name__", "build")
