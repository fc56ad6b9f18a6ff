"""Zero-copy bridges between tapegrad memory (NumPy, CuPy) and JAX arrays, over DLPack.

Policy (docs/interop.md, "DLPack"): an array crosses without a copy when it is 64-byte aligned, compact
(C or Fortran order), non-empty, of a dtype DLPack carries, and its memory is writable (a read-only
*view* of writable memory, such as ``tape.value(v)``, counts: tapegrad hands out read-only views of
its own buffers). Otherwise ``copy=None`` copies and warns with ``CopyWarning``; ``copy=False``
raises ``ValueError`` saying why; ``copy=True`` always copies. ``jax.device_put`` is never used on
tape memory: on CPU it silently aliases aligned arrays (jax-ml/jax#37830).

A zero-copy JAX array *aliases* the tape's buffer: an optimizer step or a ``reset_to`` that reuses
the memory changes what the JAX array reads. Take ``copy=True`` for a snapshot.
"""
import warnings
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike

from tapegrad.errors import ArgumentError, DTypeError

from .._jax import jax, jnp

ALIGN = 64
_KINDS = "fiucb"  # float, int, uint, complex, bool: what NumPy exports over DLPack


class CopyWarning(UserWarning):
    """A bridge had to copy because zero-copy was impossible (the message says why)."""


def _address(a):
    return a.__array_interface__["data"][0]


def _why_not_zero_copy(a):
    """The reason ``a`` cannot be shared with JAX without a copy, or None if it can."""
    if a.dtype.kind not in _KINDS or a.dtype.itemsize > 16 or a.dtype.byteorder not in "=|":
        return f"dtype {a.dtype} cannot travel over NumPy's DLPack export"
    if a.size == 0:
        return "it is empty (size 0)"
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        return f"it is strided (strides {a.strides}); JAX only imports compact arrays"
    if _address(a) % ALIGN:
        return f"its data pointer is {_address(a) % ALIGN} bytes past a 64-byte boundary (JAX needs 64)"
    if not a.flags.writeable and _writable_alias(a) is None:
        return "its memory is read-only (NumPy refuses to export read-only arrays)"
    return None


def _writable_alias(a):
    """A writable view of ``a`` when its memory is writable underneath (tape views), else None."""
    if a.flags.writeable:
        return a
    v = a.view()
    try:
        v.flags.writeable = True
    except ValueError:
        return None
    return v


def to_jax(array: ArrayLike, copy: Optional[bool] = None) -> "jax.Array":
    """A JAX array (CPU) holding the same memory as the NumPy array ``array`` when possible.

    ``array`` is shared when it is 64-byte aligned, compact (C or Fortran order), non-empty, of a
    dtype DLPack carries, and its memory is writable (a read-only *view* of writable memory, such as
    ``tape.value(v)``, counts: tapegrad hands out read-only views of its own buffers); an array in
    non-native byte order is always copied. A shared JAX array *aliases* the tape's buffer: an
    optimizer step or a ``reset_to`` that reuses the memory changes what it reads; take
    ``copy=True`` for a snapshot. ``jax.device_put`` is never used on tape memory: on CPU it
    silently aliases aligned arrays. A copy made under ``copy=None`` warns with ``CopyWarning``,
    saying why.

    Args:
        array: The NumPy array (or anything ``np.asarray`` takes).
        copy: None: share when possible, else copy with a ``CopyWarning``; False: share or raise
            ``ValueError``; True: always an independent copy.

    Returns:
        A ``jax.Array`` on the CPU.

    Raises:
        ValueError: If ``copy`` is not None, True or False, or it is False and the array cannot be
            shared (the message says why).
        DTypeError: If JAX has no dtype for the array's (objects, strings, more than 16 bytes).

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> tape = tg.Tape(np.float32); w = tape.param(np.arange(4.0))
        >>> j = interop.to_jax(tape.value(w))
        >>> j.unsafe_buffer_pointer() == tape.value(w).ctypes.data
        True
    """
    if copy not in (None, True, False):
        raise ValueError(f"to_jax: copy must be None, True or False, got {copy!r}")
    a = np.asarray(array)
    if a.dtype.kind not in _KINDS or a.dtype.itemsize > 16:
        raise DTypeError(f"to_jax: JAX has no dtype for {a.dtype} arrays (kind {a.dtype.kind!r}); convert them "
                         f"first, e.g. .astype(np.float64)")
    if a.dtype.byteorder not in "=|":   # a big-endian file's array: JAX holds native byte order only
        a = a.astype(a.dtype.newbyteorder("="))
        if copy is False:
            raise ValueError(f"to_jax: cannot share a {np.asarray(array).dtype} (non-native byte order) array "
                             f"without a copy; "
                             f"pass copy=True (or None)")
        copy = True
    if copy is True:
        return jnp.array(a, copy=True)
    why = _why_not_zero_copy(a)
    if why is None:
        return jnp.from_dlpack(_writable_alias(a))
    if copy is False:
        raise ValueError(f"to_jax: cannot share this {a.dtype}{list(a.shape)} array without a copy: {why}; "
                         f"pass copy=True (or None) to copy, or allocate it 64-byte aligned and compact")
    warnings.warn(f"to_jax: copying a {a.dtype}{list(a.shape)} array: {why}", CopyWarning, stacklevel=2)
    return jnp.array(a, copy=True)


def from_jax(x: "jax.Array", copy: Optional[bool] = None) -> np.ndarray:
    """A read-only NumPy view of a JAX CPU array's memory (zero-copy), or a copy where it must be.

    A JAX array on a device other than the host (a GPU), sharded over several devices, empty, or of
    a dtype NumPy cannot import over DLPack (bfloat16, float8) cannot be viewed from NumPy: under
    ``copy=None`` it is copied (read-only) with a ``CopyWarning`` saying why.

    Args:
        x: The JAX array.
        copy: None: a view when possible, else a copy with a ``CopyWarning``; False: a view or a
            ``ValueError``; True: a fresh writable copy.

    Returns:
        A NumPy array: a read-only view of ``x``'s memory, or a copy (writable only under
        ``copy=True``).

    Raises:
        ValueError: If ``copy`` is not None, True or False, or it is False and ``x`` cannot be
            viewed (the message says why).
        ArgumentError: If ``x`` is a traced value (inside ``jit``, ``grad`` or ``vmap``: it has no
            memory to view) or not a ``jax.Array``.

    Examples:
        >>> import jax.numpy as jnp, interop
        >>> j = jnp.arange(3.0)
        >>> v = interop.from_jax(j)
        >>> v.flags.writeable, v.ctypes.data == j.unsafe_buffer_pointer()
        (False, True)
    """
    if copy not in (None, True, False):
        raise ValueError(f"from_jax: copy must be None, True or False, got {copy!r}")
    if isinstance(x, jax.core.Tracer):
        raise ArgumentError(f"from_jax: got a traced {x.dtype}{list(x.shape)} value (inside jit, grad or vmap), "
                            f"which has no memory to view; call from_jax on concrete arrays outside the "
                            f"transformation, or use interop.xla.callback / jax_function to run host code inside it")
    if not isinstance(x, jax.Array):
        raise ArgumentError(f"from_jax: expected a jax.Array, got {type(x).__name__}")
    if copy is True:
        return np.array(x, copy=True)
    devices = x.devices()
    platforms = {d.platform for d in devices}
    dlpack_ok = x.dtype.kind in _KINDS and x.dtype.name not in ("bfloat16",) and not x.dtype.name.startswith("float8")
    if platforms == {"cpu"} and x.size and len(devices) == 1 and dlpack_ok:
        v = np.from_dlpack(x)
        if v.flags.writeable:  # never hand out a writable window onto an immutable jax.Array
            v = v.view()
            v.flags.writeable = False
        return v
    if platforms != {"cpu"}:
        why = f"it lives on {sorted(platforms)}"
    elif len(devices) > 1:
        why = f"it is sharded over {len(devices)} devices (no single buffer to view)"
    elif not dlpack_ok:
        why = f"NumPy cannot import dtype {x.dtype} over DLPack"
    else:
        why = "it is empty"
    if copy is False:
        raise ValueError(f"from_jax: cannot view a {x.dtype}{list(x.shape)} array from NumPy without a copy: "
                         f"{why}; pass copy=True (or None)")
    warnings.warn(f"from_jax: copying a {x.dtype}{list(x.shape)} array: {why}", CopyWarning, stacklevel=2)
    v = np.array(x, copy=True)
    v.flags.writeable = False
    return v


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ImportError("interop: the CuPy bridges need CuPy (pip install 'tapegrad[gpu]') and a CUDA GPU") from e
    return cupy


PREALLOCATION = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR")


def preallocation_advice(environ: Optional[Any] = None) -> Optional[str]:
    """None when JAX leaves a GPU room for CuPy, else what to set (before JAX starts on the GPU).

    JAX preallocates 75% of a GPU's memory at its first operation; CuPy's memory pool (a program
    captured with ``backend="cupy"``, or arrays shared over DLPack) then runs out. Any of
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (allocate on demand), ``XLA_CLIENT_MEM_FRACTION=.XX``
    (preallocate less; ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is its older name) or
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` leaves room.

    Args:
        environ: The environment variables to read, a mapping of names to values; None (the
            default): ``os.environ``.

    Returns:
        None when one of the settings above leaves room, else a sentence saying what to set.

    Examples:
        >>> import interop
        >>> env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        >>> interop.preallocation_advice(env) is None
        True
        >>> interop.preallocation_advice({}).startswith("JAX preallocates 75%")
        True
    """
    import os
    env = os.environ if environ is None else environ
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0"):
        return None
    if env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
        return None
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        return None
    return ("JAX preallocates 75% of GPU memory at its first operation, which starves CuPy: set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_CLIENT_MEM_FRACTION=.50) in the environment before "
            "JAX starts")


_ADVISED = []


def _advise_once():
    why = preallocation_advice()
    if why and not _ADVISED:
        _ADVISED.append(why)
        warnings.warn(f"interop: {why}", ResourceWarning, stacklevel=3)


class _Current:
    """No stream switch: CuPy's current stream stays what it is."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def cupy_to_jax(array: Any, copy: Optional[bool] = None, stream: Any = None) -> "jax.Array":
    """A JAX GPU array sharing a CuPy array's memory, ordered after the work that wrote it.

    DLPack orders JAX after the given stream: CuPy records an event on it and JAX's stream waits for
    it, so writes queued on another stream would race. A program captured with ``backend="cupy"``
    runs on its own stream, ``program.runner.stream``: pass it. A strided array is copied with a
    ``CopyWarning`` under ``copy=None``. Warns once (``ResourceWarning``) when JAX's preallocation
    would starve CuPy (``preallocation_advice``).

    Args:
        array: The CuPy array.
        copy: None: share, copying a strided array with a ``CopyWarning``; False: share or raise
            ``ValueError``; True: copy on the device first (on ``stream``, so after the writes;
            never DLPack's own ``copy=True``, which CuPy refuses for device arrays).
        stream: The CuPy stream whose work wrote ``array``; None (the default): CuPy's current
            stream.

    Returns:
        A ``jax.Array`` on the GPU.

    Raises:
        ImportError: If CuPy is not installed.
        ValueError: If ``copy`` is not None, True or False, or it is False and ``array`` is
            strided.
    """
    cp = _cupy()
    if copy not in (None, True, False):
        raise ValueError(f"cupy_to_jax: copy must be None, True or False, got {copy!r}")
    _advise_once()
    with stream if stream is not None else _Current():
        if copy is True:
            return jnp.from_dlpack(cp.ascontiguousarray(array).copy())
        if not (array.flags.c_contiguous or array.flags.f_contiguous):
            why = f"it is strided (strides {array.strides}); JAX only imports compact arrays"
            if copy is False:
                raise ValueError(f"cupy_to_jax: cannot share without a copy: {why}")
            warnings.warn(f"cupy_to_jax: copying: {why}", CopyWarning, stacklevel=2)
            array = cp.ascontiguousarray(array)
        return jnp.from_dlpack(array)


def jax_to_cupy(x: "jax.Array", copy: Optional[bool] = None, stream: Any = None) -> Any:
    """A CuPy array sharing a JAX GPU array's memory, ready for use on ``stream``.

    CuPy hands ``stream`` to JAX's ``__dlpack__``, and JAX makes it wait for the computation that
    produces ``x``; work on another stream is not ordered. Treat the result as read-only: JAX arrays
    are immutable and CuPy cannot mark memory read-only. Warns once (``ResourceWarning``) when JAX's
    preallocation would starve CuPy (``preallocation_advice``).

    Args:
        x: The JAX array.
        copy: None: share a GPU array; a host array is copied to the GPU with a ``CopyWarning``.
            False: share or raise ``ValueError``. True: an independent CuPy array (copied on
            ``stream``).
        stream: The CuPy stream that will use the array; None (the default): CuPy's current stream.

    Returns:
        A CuPy array.

    Raises:
        ImportError: If CuPy is not installed.
        ValueError: If ``copy`` is not None, True or False, or it is False and ``x`` is not on a
            GPU.
    """
    cp = _cupy()
    if copy not in (None, True, False):
        raise ValueError(f"jax_to_cupy: copy must be None, True or False, got {copy!r}")
    on_gpu = {d.platform for d in x.devices()} == {"gpu"}
    if on_gpu:
        _advise_once()
    with stream if stream is not None else _Current():
        if not on_gpu:
            if copy is False:
                raise ValueError("jax_to_cupy: the array is not on a GPU; CuPy cannot view host memory without a copy")
            if copy is None:
                warnings.warn("jax_to_cupy: copying a host array to the GPU", CopyWarning, stacklevel=2)
            return cp.asarray(np.asarray(x))
        y = cp.from_dlpack(x)
        return y.copy() if copy is True else y
