"""A captured program's training episode as a CUDA custom call, and one jitted step for either platform.

``program_episode_gpu(program)`` has ``interop.program_episode``'s signature, ``step(params, opt_state,
inputs) -> (loss, params, opt_state)`` with optax-shaped state aliased to the outputs (and ``.positional``
on flat tuples), and lowers on the CUDA platform to ``stablehlo.custom_call @tg_gpu_episode`` with attributes

- ``graph``: the ``cudaGraphExec_t`` of the program's episode (forward + backward + optimizer), captured
  once by CuPy (``capture(..., backend="cupy")``, ordered mode: no cuBLAS inside the graph);
- ``settab``: the ``CUfunction`` of the program's ``settab`` kernel and ``table`` the device address of its
  pointer table: before replaying the graph the handler launches ``settab`` on XLA's stream with
  ``slots`` (the table entries of every operand, in operand order) and XLA's buffer addresses, so the
  captured kernels read and update XLA's buffers in place (the graph itself never changes);
- ``ctl``: the device address of the control buffer. The handler reads ``count`` (one 8-byte copy),
  computes the optimizer's step scalars with the C library's ``pow`` as every CPU backend does, and
  uploads them before the replay: the GPU episode stays bit-exact with the CPU tape in ordered mode.

The handler is C against ``xla/ffi/api/c_api.h`` only, resolving the driver with ``cuGetProcAddress``
(no CUDA headers, no nvcc); it needs a GPU to run and is not part of this module. Lowering needs no GPU:
``jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))`` works on a CPU-only machine (tested).
``platform_episode(program)`` puts the CPU custom call and the CUDA one behind ``lax.platform_dependent``.

JAX preallocates 75% of GPU memory, which starves CuPy's pool: run with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller ``XLA_CLIENT_MEM_FRACTION``) beside CuPy.
"""
import numpy as np

from ._jax import jax, jnp
from .program import ProgramError, _named, _positional, _Sig, program_episode

TARGET = "tg_gpu_episode"


def _handles(program, handles):
    """(graph, settab, table, ctl) integers: from a CuPy program's runner, or given (lowering only)."""
    if handles is not None:
        return tuple(int(handles[k]) for k in ("graph", "settab", "table", "ctl"))
    if program.backend != "cupy":
        raise ProgramError(f"program_episode_gpu: a program captured with backend='cupy' is needed (this one is "
                           f"{program.backend!r}); pass handles=... only to inspect the lowering")
    r = program.runner
    if r.graph is None:
        r.episode()   # the first episode captures the CUDA graph
    return (int(r.graph.graphExec if hasattr(r.graph, "graphExec") else 0),
            int(r.module.get_function(r.cp.settab).ptr), int(r.vt.data.ptr), int(r.ctl.data.ptr))


def slots(program, cp=None):
    """The pointer-table entry of every operand (params, Adam moments, -1 for count, inputs) and the loss's."""
    from tapegrad.gpu.source import CudaProgram
    cp = cp or CudaProgram(program, fuse=True)
    o = program.opt
    out = [cp.index.get(("v", k), -1) for k in program.params]
    if o.kind == "Adam":
        for j in range(len(o.ids)):
            out += [cp.index.get(("M", j), -1), cp.index.get(("N", j), -1)]
    out.append(-1)   # count: read by the handler, never by a kernel
    out += [cp.index.get(("v", k), -1) for k in program.consts]
    return np.array(out, np.int64), int(cp.index[("v", program.loss_id)])


def program_episode_gpu(program, *, handles=None):
    """The CUDA custom call of one training episode (see the module docstring)."""
    if program.opt is None:
        raise ProgramError("program_episode_gpu: attach an optimizer first (program.attach(optimizer))")
    if not program.ordered:
        raise ProgramError("program_episode_gpu: capture in ordered mode (capture(..., ordered=True)): a CUDA "
                           "graph cannot hold the default mode's cuBLAS calls")
    graph, settab, table, ctl = _handles(program, handles)
    table_slots, loss_slot = slots(program)
    sig = _Sig(program)
    np_, ns = len(sig.params), len(sig.state)
    aliases = {k: k + 1 for k in range(np_ + ns + 1)}

    def positional(params, opt_state, count, inputs):
        params = tuple(jnp.asarray(x) for x in params)
        opt_state = tuple(jnp.asarray(x) for x in opt_state)
        inputs = tuple(jnp.asarray(x) for x in inputs)
        count = jnp.asarray(count, sig.dtype)
        sig.check("program_episode_gpu", [("params", sig.params, params), ("opt_state", sig.state, opt_state),
                                          ("inputs", sig.inputs, inputs)])
        xs = params + opt_state + (count,) + inputs
        specs = [jax.ShapeDtypeStruct((), sig.dtype)] + [jax.ShapeDtypeStruct(s, sig.dtype)
                                                         for s in sig.params + sig.state]
        specs.append(jax.ShapeDtypeStruct((), sig.dtype))
        out = jax.ffi.ffi_call(TARGET, specs, input_output_aliases=aliases, vmap_method="sequential")(
            *xs, graph=np.int64(graph), settab=np.int64(settab), table=np.int64(table), ctl=np.int64(ctl),
            slots=table_slots, loss_slot=np.int64(loss_slot))
        return out[0], tuple(out[1:1 + np_]), tuple(out[1 + np_:1 + np_ + ns]), out[-1]

    def step(params, opt_state, inputs):
        p, st, count = _positional(program, "program_episode_gpu", params, opt_state)
        loss, p, st, count = positional(p, st, count, inputs)
        return (loss,) + _named(program, p, st, count)

    step.program, step.positional = program, positional
    return step


def platform_episode(cpu_program, gpu_program=None, *, handles=None):
    """One ``step`` for either platform: the CPU custom call (``program_episode(cpu_program)``) on "cpu",
    the CUDA one on "cuda" (``gpu_program``, default ``cpu_program`` itself, with ``handles`` for lowering)."""
    cpu = program_episode(cpu_program)
    gpu = program_episode_gpu(gpu_program if gpu_program is not None else cpu_program, handles=handles)

    def step(params, opt_state, inputs):
        return jax.lax.platform_dependent(params, opt_state, tuple(inputs), cpu=cpu, cuda=gpu)

    return step
