"""A captured program's training episode as a CUDA custom call, and one jitted step for either platform.

``program_episode_gpu(program)`` has ``interop.program_episode``'s signature, ``step(params, opt_state,
inputs) -> (loss, params, opt_state)`` with optax-shaped state aliased to the outputs (and ``.positional``
on flat tuples), and lowers on the CUDA platform to ``stablehlo.custom_call @tapegrad_gpu_episode_<hash>``,
run by the C handler ``tg_gpu_episode`` (``tg_gpu.c``, built with the CPU handlers and registered for the
CUDA platform when jax has one). Its attributes:

- ``graph``: the ``cudaGraphExec_t`` of the program's episode (forward + backward + optimizer), captured
  once by CuPy (``capture(..., backend="cupy")``, ordered mode: no cuBLAS inside the graph);
- ``settab``: the ``CUfunction`` of the program's ``settab`` kernel, ``table``/``table_len`` its pointer
  table: before replaying the graph the handler launches ``settab`` on XLA's stream with ``slots`` (the
  table entry of every operand, in operand order) and XLA's buffer addresses, so the captured kernels
  read and update XLA's buffers in place (the graph itself never changes); after the replay it points
  the entries back at their own buffers (``home``, ``loss_home``), so the CuPy program stays usable;
- ``ctl``: the device address of the control buffer. The handler reads ``count`` (one small copy and a
  synchronisation), computes the optimizer's step scalars (``opt``, ``hat``, ``lr``, ``b1``, ``b2``) with
  the same C code and libm ``pow`` as the native backend, and uploads them before the replay: the GPU
  episode stays bit-exact with the CPU tape in ordered mode;
- ``device``: the CUDA device the program lives on (a call on another device is an error).

The handler needs no CUDA headers and no nvcc: it opens the driver at its first call (``libcuda.so.1``,
or ``$TAPEGRAD_LIBCUDA``) and resolves every entry point with ``cuGetProcAddress``; without a driver the
call fails with an error saying so. Lowering needs no GPU: ``jax.jit(step).trace(...).lower(
lowering_platforms=("cuda",))`` works on a CPU-only machine (tested). ``platform_episode(program)`` puts
the CPU custom call and the CUDA one behind ``lax.platform_dependent``.

JAX preallocates 75% of GPU memory, which starves CuPy's pool: run with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller ``XLA_CLIENT_MEM_FRACTION``) beside CuPy.
"""
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np

from tapegrad.capture import Program

from .._jax import jax, jnp
from .program import (ProgramError, _LIB, _named, _positional, _Sig, count_operand, count_result, native_library,
                      program_episode)

TARGET = "tapegrad_gpu_episode"   # the registered name is this plus the handler source's hash


def target():
    """The registered name of the GPU episode handler (built here; a ProgramError without a C compiler)."""
    lib = native_library()
    if lib is None:
        raise ProgramError(f"program_episode_gpu: the FFI handlers cannot be built here ({_LIB.get('why')})")
    return lib[1]["gpu_episode"]


def _cuda_program(program):
    """The program's CudaProgram: its runner's when it has one (the table layout the graph uses)."""
    from tapegrad.gpu.runner import LaunchRunner
    from tapegrad.gpu.source import CudaProgram
    return program.runner.cp if isinstance(program.runner, LaunchRunner) else CudaProgram(program, fuse=True)


def _handles(program, handles, cp):
    """The handler's attributes that name device objects: from a CuPy program's runner, or given
    (``graph``, ``settab``, ``table``, ``ctl``; optional ``table_len``, ``device`` and ``vt``, the table's
    own entries, from which ``home`` comes)."""
    if handles is None:
        if program.backend != "cupy":
            raise ProgramError(f"program_episode_gpu: a program captured with backend='cupy' is needed (this one "
                               f"is {program.backend!r}); pass handles=... only to inspect the lowering")
        handles = program.runner.handles()
    h = {"table_len": len(cp.buffers), "device": 0, "vt": None, **handles}
    table_slots, loss_slot = slots(program, cp)
    vt = np.zeros(max(h["table_len"], 1), np.int64) if h["vt"] is None else np.asarray(h["vt"], np.int64)
    home = np.array([vt[s] if s >= 0 else 0 for s in table_slots], np.int64)
    out = {k: np.int64(h[k]) for k in ("graph", "settab", "table", "table_len", "ctl", "device")}
    return dict(out, slots=table_slots, loss_slot=np.int64(loss_slot), home=home, loss_home=np.int64(vt[loss_slot]))


def _optimizer(program):
    """``opt`` (1 SGD, 2 Adam), ``hat`` and ``lr``/``b1``/``b2``: what the handler's step scalars need."""
    c = program.opt.conf
    adam = program.opt.kind == "Adam"
    return dict(opt=np.int64(2 if adam else 1), hat=np.int64(adam and c.eps_mode == "hat"),
                lr=np.float64(c.lr), b1=np.float64(c.b1 if adam else 0.0), b2=np.float64(c.b2 if adam else 0.0))


def slots(program, cp=None):
    """The pointer-table entry of every operand (params, Adam moments, -1 for count, inputs) and the loss's."""
    table_slots, loss_slot = (cp or _cuda_program(program)).operand_slots()
    return np.array(table_slots, np.int64), int(loss_slot)


def program_episode_gpu(program: Program, *, handles: Optional[Mapping[str, Any]] = None) -> Callable[..., Any]:
    """One training episode of a CuPy program as a CUDA custom call: ``interop.program_episode``'s step.

    The step lowers on the CUDA platform to ``stablehlo.custom_call @tapegrad_gpu_episode_<hash>``,
    run by the C handler ``tg_gpu_episode``, which replays the program's CUDA graph on XLA's buffers
    (updated in place) and computes the optimizer's step scalars with the same C code and libm
    ``pow`` as the native backend: the episode stays bit-exact with the CPU tape in ordered mode.
    The handler needs no CUDA headers and no nvcc: it opens the driver at its first call
    (``libcuda.so.1``, or ``$TAPEGRAD_LIBCUDA``); without one the call fails with an error saying
    so. Lowering needs no GPU: ``jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))``
    works on a CPU-only machine, given ``handles``. A call raises ``ProgramError`` for a state or
    inputs that do not fit the program.

    Args:
        program: A program captured with ``backend="cupy"`` and ``ordered=True``, its optimizer
            attached.
        handles: The device objects the handler names, only to inspect the lowering: ``graph``,
            ``settab``, ``table`` and ``ctl`` (optional: ``table_len``, ``device`` and ``vt``, the
            table's own entries). None (the default): from the CuPy program's runner.

    Returns:
        ``step(params, opt_state, inputs) -> (loss, params, opt_state)``, state named and shaped as
        ``program_episode``'s and aliased to the outputs; ``step.positional(params, moments, count,
        inputs)`` is the same call on positional tuples.

    Raises:
        ProgramError: If no optimizer is attached, the program was not captured in ordered mode (a
            CUDA graph cannot hold the default mode's cuBLAS calls), or not with backend "cupy"
            where ``handles`` is None, or the FFI handlers cannot be built here (no C compiler).
    """
    if program.opt is None:
        raise ProgramError("program_episode_gpu: attach an optimizer first (program.attach(optimizer))")
    if not program.ordered:
        raise ProgramError("program_episode_gpu: capture in ordered mode (capture(..., ordered=True)): a CUDA "
                           "graph cannot hold the default mode's cuBLAS calls")
    cp = _cuda_program(program)
    attrs = dict(_handles(program, handles, cp), **_optimizer(program))
    name = target()
    sig = _Sig(program)
    np_, ns = len(sig.params), len(sig.state)
    aliases = {k: k + 1 for k in range(np_ + ns + 1)}

    def positional(params, opt_state, count, inputs):
        params = tuple(jnp.asarray(x) for x in params)
        opt_state = tuple(jnp.asarray(x) for x in opt_state)
        inputs = tuple(jnp.asarray(x) for x in inputs)
        count = count_operand(count, sig.dtype)
        sig.check("program_episode_gpu", [("params", sig.params, params), ("opt_state", sig.state, opt_state),
                                          ("inputs", sig.inputs, inputs)])
        xs = params + opt_state + (count,) + inputs
        specs = [jax.ShapeDtypeStruct((), sig.dtype)] + [jax.ShapeDtypeStruct(s, sig.dtype)
                                                         for s in sig.params + sig.state]
        specs.append(jax.ShapeDtypeStruct((), sig.dtype))
        out = jax.ffi.ffi_call(name, specs, input_output_aliases=aliases, vmap_method="sequential")(*xs, **attrs)
        return out[0], tuple(out[1:1 + np_]), tuple(out[1 + np_:1 + np_ + ns]), count_result(out[-1], sig.dtype)

    def step(params, opt_state, inputs):
        p, st, count = _positional(program, "program_episode_gpu", params, opt_state)
        loss, p, st, count = positional(p, st, count, inputs)
        return (loss,) + _named(program, p, st, count)

    step.program, step.positional = program, positional
    return step


def platform_episode(cpu_program: Program, gpu_program: Optional[Program] = None, *,
                     handles: Optional[Mapping[str, Any]] = None) -> Callable[..., Any]:
    """One training ``step`` for either platform, chosen by ``lax.platform_dependent``.

    Args:
        cpu_program: The program of the CPU custom call (``program_episode(cpu_program)``), run on
            "cpu".
        gpu_program: The program of the CUDA custom call (``program_episode_gpu``), run on
            "cuda"; None (the default): ``cpu_program`` itself, with ``handles`` for lowering.
        handles: The device objects of the CUDA call, as for ``program_episode_gpu``.

    Returns:
        ``step(params, opt_state, inputs) -> (loss, params, opt_state)``, as
        ``program_episode``'s.

    Raises:
        ProgramError: If either program cannot make its episode (see ``program_episode`` and
            ``program_episode_gpu``).
    """
    cpu = program_episode(cpu_program)
    gpu = program_episode_gpu(gpu_program if gpu_program is not None else cpu_program, handles=handles)

    def step(params, opt_state, inputs):
        return jax.lax.platform_dependent(params, opt_state, tuple(inputs), cpu=cpu, cuda=gpu)

    return step
