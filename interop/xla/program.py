"""Captured programs as XLA custom calls: ``program_call`` (differentiable loss) and ``program_episode``.

The native path is one small C file, ``tg_xla.c`` (next to this module, shipped as package data), written against ``xla/ffi/api/c_api.h``
only. Its source (with the header pasted in, so the header's version is part of the cache key) is
compiled by tapegrad's content-hashed build cache (``tapegrad.native.build``) and registered with XLA
after ``jax.devices()`` under target names carrying the source hash. A program is loaded into the
handler's native table under ``program.hash64``; the HLO carries only that hash (attribute ``prog``).

The handler runs the program on XLA's own buffers: it points a per-device copy of the program's
pointer table at the operands and results (no copies in or out), so the episode's parameters and
optimizer state are updated where XLA keeps them (in place when donated), and shards on different
host devices run at the same time on their own instances. Without a C compiler (or for a NumPy-backend
program) the same functions run the program through ``interop.xla.callback`` (zero-copy host callback),
which copies the operands into the program's slots, runs the program's own code and copies the
results out; both paths give the same bits.
"""
import contextlib
import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np

import tapegrad.native as native_pkg
from tapegrad.capture import Program
from tapegrad.errors import TapeError

from .._jax import align_varying, jax, jnp, varying, x64_enabled
from .callback import host_call
from .function import TransformError, first_order

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()
_LIB = {}
_PINNED = {}       # hash64 -> what the native table points into (kept alive for the process)
_LOADED = {}       # hash64 -> the programs loaded under it (captures of one function: any can serve the entry)
TARGETS = ("value", "value_and_grad", "episode", "episode_flat")


class ProgramError(TapeError, ValueError):
    """A program call with the wrong arguments (count, shape, dtype) or a program that cannot be used.

    Part of tapegrad's error family: ``except tapegrad.TapeError`` catches it too.
    """


# ── the native library ───────────────────────────────────────────────────────

def _read(paths):
    text = []
    for path in paths:
        with open(path) as f:
            text.append(f.read())
    return "\n".join(text)


def ffi_header():
    """The installed jaxlib's xla/ffi/api/c_api.h, then ffi_compat.h (the handlers' names on every jaxlib)."""
    return _read([os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h"),
                  os.path.join(_HERE, "ffi_compat.h")])


def _source():
    """The FFI header, Adam's step scalars (tapegrad's C, shared with the native runtime), tg_xla.c, tg_gpu.c."""
    return "\n".join([ffi_header(), _read([os.path.join(os.path.dirname(os.path.abspath(native_pkg.__file__)),
                                                         "step_scalars.c"),
                                            os.path.join(_HERE, "tg_xla.c"), os.path.join(_HERE, "tg_gpu.c")])])


def _cuda_platform():
    """Whether jax has a CUDA backend in this process (the GPU custom call is registered only then)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def native_library() -> Optional[tuple[ctypes.CDLL, dict[str, str]]]:
    """``(ctypes.CDLL, {kind: target name})`` of the registered FFI handlers, or None without a compiler.

    Built once per process through tapegrad's build cache; registered with XLA for the CPU platform
    only after the backend exists (``jax.devices()``), as docs/interop.md ("The FFI handler") explains.
    """
    with _LOCK:
        if "lib" in _LIB:
            return _LIB["lib"]
        try:
            from tapegrad.errors import BuildError
            from tapegrad.native import build
            src = _source()
            path = build.build(src, name="tg_xla")
        except (ImportError, BuildError, OSError) as e:
            _LIB["lib"], _LIB["why"] = None, f"{type(e).__name__}: {e}"
            logging.getLogger("tapegrad").info("interop: the native FFI handler is unavailable, programs run "
                                               "through the host callback instead (%s)", _LIB["why"])
            return None
        lib = ctypes.CDLL(path)
        lib.tg_load.argtypes, lib.tg_load.restype = [ctypes.c_void_p], ctypes.c_int
        lib.tg_unload.argtypes, lib.tg_unload.restype = [ctypes.c_int64], ctypes.c_int
        lib.tg_stats.argtypes, lib.tg_stats.restype = [ctypes.c_int64, ctypes.c_void_p], ctypes.c_int
        lib.tg_gpu_driver.argtypes, lib.tg_gpu_driver.restype = [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int
        jax.devices()
        h8 = hashlib.sha256(src.encode()).hexdigest()[:8]
        names = {}
        for kind in TARGETS:
            names[kind] = f"tapegrad_{kind}_{h8}"
            jax.ffi.register_ffi_target(names[kind], jax.ffi.pycapsule(getattr(lib, "tg_" + kind)), platform="cpu")
        names["gpu_episode"] = f"tapegrad_gpu_episode_{h8}"
        if _cuda_platform():
            jax.ffi.register_ffi_target(names["gpu_episode"], jax.ffi.pycapsule(lib.tg_gpu_episode), platform="CUDA")
        _LIB["lib"] = (lib, names)
        return _LIB["lib"]


def load(program: Program) -> int:
    """Put ``program`` into the native table under ``program.hash64`` (idempotent); returns the hash.

    The program and the buffers its ABI names are pinned for the life of the process: a jitted
    executable may call the hash at any later time.
    """
    lib = native_library()
    if lib is None:
        raise ProgramError(f"load: the native FFI handler is unavailable ({_LIB.get('why')})")
    abi = program.native_abi()
    h = program.hash64
    es = np.dtype(abi["dtype"]).itemsize
    desc = [_i64(h), abi["forward"], abi["backward"], abi["episode"], abi["ctx"], abi["sizes"], abi["table_len"],
            abi["loss_index"], es, len(abi["params"]), len(abi["inputs"]), len(abi["opt_state"])]
    desc += abi["param_index"] + abi["input_index"] + abi["grad_index"]
    get, set_ = _blas_threads(program)
    big = any(program.nodes[k][0].kind == "matmul" and _mnk(program, k) > OPENBLAS_THREADED for k in program.compute)
    desc += [get, set_, int(big), SPLIT_PRODUCTS, SPLIT_UPDATES]
    desc += [len(abi["data_index"])] + abi["data_index"] + [program.val[k].itemsize for k in program.data]
    arr = np.array(desc, np.int64)
    if lib[0].tg_load(arr.ctypes.data) != 0:
        raise MemoryError("load: tg_load could not allocate its table entry")
    _PINNED[h] = (program, program.opt, program.runner)
    if not any(p is program for p in _LOADED.setdefault(h, [])):
        _LOADED[h].append(program)
    program.__dict__.setdefault("_ffi_hashes", set()).add(h)
    hooks = program.__dict__.setdefault("_attach_hooks", [])
    if _reattached not in hooks:
        hooks.append(_reattached)
    return h


def _reattached(program):
    """``program.attach`` replaced the optimizer state buffers the native table points into.

    The entry under the program's hash is re-pointed at the new buffers (a jitted step keeps working,
    on the new state); entries under hashes the program no longer has (another optimizer config) are
    dropped, so executables traced for the old configuration fail with an error instead of running on
    stale state. An entry another program still serves under that hash (another capture of the same
    function, a ``value_and_grad`` beside a ``train_step``) is re-pointed at it instead.
    """
    now = program.hash64
    hashes = program.__dict__.get("_ffi_hashes", set())
    for h in sorted(hashes):
        if h != now:
            hashes.discard(h)
            others = [p for p in _LOADED.pop(h, []) if p is not program and p.hash64 == h]
            if others:
                _LOADED[h] = others
                load(others[-1])
            else:
                unload(h)
                _PINNED.pop(h, None)
    if now in hashes:
        load(program)


# Inside the handler, products of at least SPLIT_PRODUCTS multiply-adds are split by rows over XLA's
# intra-op thread pool, one single-threaded BLAS call per part (experiments/bench/bench_interop.py, medium and
# large). OpenBLAS starts its own threads from about 4·65536 multiply-adds (its GEMM_MULTITHREAD_THRESHOLD);
# programs with a product above OPENBLAS_THREADED run with OpenBLAS single-threaded during the call.
SPLIT_PRODUCTS = 1 << 20
# An optimizer update of at least SPLIT_UPDATES parameters is split into ranges of elements over the same
# pool (each element's arithmetic is unchanged, so the result is bit-identical to one thread's).
SPLIT_UPDATES = 1 << 14
OPENBLAS_THREADED = 1 << 16


def _mnk(program, k):
    _, a, b, _ = program.nodes[k]
    return int(np.prod(program.shapes[a])) * int(program.shapes[b][-1])


def _blas_threads(program):
    """Addresses of OpenBLAS's get/set thread-count functions in the BLAS the program calls (0, 0 if
    that BLAS is not an OpenBLAS exporting them)."""
    from tapegrad.native import runner
    path = runner.blas_pointers(program.dtype)[3]
    if not os.path.exists(path):
        return 0, 0
    lib = ctypes.CDLL(path)
    for suffix in ("64_", "_64_", ""):
        for pre in ("scipy_openblas", "openblas"):
            get = getattr(lib, f"{pre}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{pre}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                return (ctypes.cast(get, ctypes.c_void_p).value, ctypes.cast(set_, ctypes.c_void_p).value)
    return 0, 0


def unload(program_or_hash: Union[Program, int]) -> bool:
    """Drop a program from the native table: later calls to it fail with an XLA error (not a crash)."""
    h = program_or_hash if isinstance(program_or_hash, int) else program_or_hash.hash64
    lib = native_library()
    found = bool(lib and lib[0].tg_unload(_i64(h)))
    return found


def stats(program):
    """``{"instances": devices that ran ``program`` through the native handler (each has its own
    instance: a private pointer table and, beyond the first device, private buffers), "splits": products split
    over XLA's thread pool}``, or None when it is not loaded."""
    lib = native_library()
    out = np.zeros(2, np.int64)
    if lib is None or lib[0].tg_stats(_i64(program.hash64), out.ctypes.data) != 0:
        return None
    return {"instances": int(out[0]), "splits": int(out[1])}


def _i64(h):
    return h - (1 << 64) if h >= 1 << 63 else h


# ── signatures ───────────────────────────────────────────────────────────────

class _Sig:
    """The shapes of a program's slots (params, inputs, opt_state) and its dtype."""

    def __init__(self, program):
        self.program = program
        self.dtype = np.dtype(program.dtype)
        self.params = [tuple(program.shapes[k]) for k in program.params]
        self.inputs = [tuple(program.shapes[k]) for k in program.consts]
        self.data = [tuple(program.shapes[k]) for k in program.data]
        self.data_bool = [program.val[k].dtype.kind == "b" for k in program.data]
        opt = program.opt
        self.state = []
        if opt is not None:
            for k in opt.ids:
                self.state += [tuple(program.shapes[k])] * opt.moments

    def check(self, who, groups):
        if self.dtype == np.float64 and not x64_enabled():
            raise ProgramError(f"{who}: the program computes in float64 but JAX's 64-bit mode is off, so JAX would "
                               f"truncate its operands to float32; enable it (jax.config.update('jax_enable_x64', "
                               f"True), or run inside `with jax.enable_x64(True):`) or capture the program with "
                               f"dtype='float32'")
        for name, want, got in groups:
            if len(got) != len(want):
                raise ProgramError(f"{who}: expected {len(want)} {name} arrays {want}, got {len(got)}")
            for k, (s, x) in enumerate(zip(want, got)):
                aval = jax.typeof(x)
                label = f"{name}[{k}]" + (f" ({self.program.param_names[k]!r})" if name == "params" else "")
                if tuple(aval.shape) != s:
                    raise ProgramError(f"{who}: {label} must have shape {s} (the captured shape), got "
                                       f"{tuple(aval.shape)}")
                if name == "data":
                    kind = np.dtype(aval.dtype).kind
                    ok = kind == "b" if self.data_bool[k] else np.dtype(aval.dtype) in (np.int32, np.int64)  # tg_data_fits
                    if not ok:
                        want_kind = "bool" if self.data_bool[k] else "int32 or int64"
                        raise ProgramError(f"{who}: {label} must be {want_kind} (a data slot of the program), got "
                                           f"{aval.dtype}")
                    continue
                if np.dtype(aval.dtype) != self.dtype:
                    raise ProgramError(f"{who}: {label} must be {self.dtype} (the program's dtype), got "
                                       f"{aval.dtype}")


def _align_varying(xs):
    """Under ``shard_map``, cast every operand to the union of the operands' varying axes.

    The cast sits *outside* the custom_vjp, so its transpose sums the cotangent of a replicated
    parameter over the shards — the data-parallel gradient, with no explicit psum (docs/interop.md, "Sharding").
    """
    return align_varying(xs)


def _spec(args, shape, dtype):
    """A result type with the operands' shard_map typing (docs/interop.md, "Sharding")."""
    best = max(args, key=lambda x: len(varying(x)))
    return jax.typeof(best).update(shape=tuple(shape), dtype=dtype, weak_type=False)


# ── host (callback) implementations: the same copy-in/run/copy-out on the Program's Python API ──

def _lock(program):
    """The program's own lock: shards may run host callbacks concurrently, and a program has one set of
    slots (its Python methods take the same lock)."""
    return program._lock


def _locked(program, run):
    lock = _lock(program)

    def locked(outs, *xs):
        with lock:
            run(outs, *xs)
    return locked


def _host_value(program, grads):
    return _locked(program, _host_value_unlocked(program, grads))


def _host_value_unlocked(program, grads):
    def run(outs, *xs):
        np_, p = len(program.params), program
        for b in range(outs[0].size):
            for k, x in zip(p.params + p.consts + p.data, xs):
                n = p.val[k].size
                np.copyto(p.val[k].reshape(-1), x.reshape(-1)[b * n:(b + 1) * n], casting="unsafe")
            p.runner.forward()
            outs[0].reshape(-1)[b] = p.val[p.loss_id].reshape(-1)[0]
            if grads:
                p.runner.backward()
                for o, k in zip(outs[1:1 + np_], p.params):
                    g = p.grad_buf(k)
                    o.reshape(-1)[b * g.size:(b + 1) * g.size] = g.reshape(-1)
    return run


def _host_episode(program, flat=False, lr=False, steps=None):
    run = _host_episode_unlocked(program, flat, lr)
    return _locked(program, run if steps is None else _host_steps(program, run, steps))


def _host_steps(program, one, steps):
    """``one`` (the positional episode) run ``steps`` times, the state carried and the inputs,
    learning rate and data taken block by block, as the handler's ``steps`` attribute does."""
    nw = len(program.params) + len(program.opt.state_arrays()) + 1

    def run(outs, *xs):
        state, per_step = list(xs[:nw]), xs[nw:]
        for t in range(steps):
            res = [np.empty((), outs[0].dtype)] + [np.empty_like(np.asarray(x)) for x in state]
            one(res, *state, *(x[t] for x in per_step))
            outs[0][t] = res[0]
            state = res[1:]
        for out, x in zip(outs[1:], state):
            np.copyto(out, x)
    return run


def _host_episode_unlocked(program, flat=False, lr=False):
    def run(outs, *xs):
        if flat:  # unpack [params | state | count] into the separate layout, run, pack the results
            sizes = _flat_sizes(program)
            parts = np.split(xs[0], np.cumsum(sizes)[:-1])
            sig = _Sig(program)
            xs = tuple(a.reshape(sh) for a, sh in zip(parts, sig.params + sig.state + [()])) + tuple(xs[1:])
            res = [np.empty(sh, sig.dtype) for sh in [()] + sig.params + sig.state + [()]]
            _host_episode_unlocked(program, lr=lr)(res, *xs)
            outs[0][...] = res[0]
            np.concatenate([r.reshape(-1) for r in res[1:]], out=outs[1])
            return
        p, o = program, program.opt
        np_, ni = len(p.params), len(p.consts)
        state = o.state_arrays()
        ns = len(state)
        for k, x in zip(p.params, xs[:np_]):
            np.copyto(p.val[k], x)
        for s, x in zip(state, xs[np_:np_ + ns]):
            np.copyto(s, x)
        o.count = _count_host(xs[np_ + ns])
        p.runner.push_count()
        rest = xs[np_ + ns + 1:]
        for k, x in zip(p.consts, rest[:ni]):
            np.copyto(p.val[k], x)
        for k, x in zip(p.data, rest[ni + lr:]):
            np.copyto(p.val[k], x, casting="unsafe")
        with _step_lr(p, float(rest[ni]) if lr else None):
            p.runner.episode()
        p.runner.pull_count()
        outs[0][...] = p.val[p.loss_id].reshape(())
        for out, k in zip(outs[1:1 + np_], p.params):
            np.copyto(out, p.val[k])
        for out, s in zip(outs[1 + np_:1 + np_ + ns], state):
            np.copyto(out, s)
        _count_host(outs[-1], o.count)
    return run


@contextlib.contextmanager
def _step_lr(program, lr):
    """Run the program's step with learning rate ``lr`` (None: its own), as the FFI handler's ``lr`` operand."""
    if lr is None:
        yield
        return
    o = program.opt
    runner = getattr(program.runner, "sc", None)
    saved = o.lr, o.conf.lr
    o.lr = o.conf.lr = lr
    if runner is not None:
        runner[6], runner[7] = 1.0, lr
    try:
        yield
    finally:
        o.lr, o.conf.lr = saved
        if runner is not None:
            runner[6] = 0.0


# ── public API ───────────────────────────────────────────────────────────────

def _not_differentiable(who, why):
    """``fn(xs, *static)`` whose forward-mode derivative (what jax.grad, jax.checkpoint's rematerialised
    sweep and jvp ask of it) raises a ``TransformError`` saying ``why``, instead of JAX's advice to add a
    custom_jvp to our FFI call."""
    def wrap(fn):
        def run(xs, *static):
            g = jax.custom_jvp(lambda *xs_: fn(tuple(xs_), *static))

            def jvp(primals, tangents):
                raise TransformError(f"{who}: {why}")
            g.defjvp(jvp)
            return g(*xs)
        return run
    return wrap


def _first_order(who):
    return _not_differentiable(who, "forward-mode and higher-order differentiation (jvp, jacfwd, hessian, grad of "
                                    "grad, and jax.grad through jax.checkpoint of it) are not supported: its "
                                    "backward is tapegrad's reverse sweep, which is not itself differentiable; "
                                    "tapegrad gradients are first-order only: use jax.grad / vjp / jacrev")


def _mode(program, native, who):
    if program.backend == "cupy":
        # its buffers live on the device: a host call would read and write the host copies only
        raise ProgramError(f"{who}: the program was captured with backend='cupy'; inside jax.jit a CuPy program "
                           f"runs only as a whole training episode on the GPU (interop.program_episode_gpu, "
                           f"captured with ordered=True). Capture with backend='native' (or 'numpy') for "
                           f"{who}")
    if native is None:
        native = program.backend == "native" and native_library() is not None
    if native:
        if program.backend != "native":
            raise ProgramError("native=True needs a program captured with backend='native'")
        if native_library() is None:
            raise ProgramError(f"native=True: the FFI handler cannot be built ({_LIB.get('why')})")
        load(program)
    return native


def program_call(program: Program, *, native: Optional[bool] = None, data: bool = False) -> Callable[..., Any]:
    """A jittable, differentiable JAX function ``(*params, *inputs) -> loss`` running ``program``.

    ``params`` are the program's parameters and ``inputs`` its float constants, each in registration
    order, with the captured shapes and the program's dtype. Integer and bool data slots (index
    tables, masks) are not inputs: calls use the values they hold (captured, or last given with
    ``set_input``), unless ``data=True``. Under ``jax.grad`` one custom call runs forward + backward
    and returns the loss with the parameter gradients as residuals; the backward rule scales them by
    the loss cotangent. Under ``vmap`` every operand is broadcast to the batch and the handler loops
    over it; under ``shard_map`` each shard runs its own call.

    A call raises ``ProgramError`` for operands of the wrong count, shape or dtype, for a float64
    program with JAX's 64-bit mode off, and under differentiation with respect to an input
    (constants have no gradient on the tape); ``TransformError`` under forward-mode or second-order
    differentiation.

    Args:
        program: A captured tapegrad ``Program`` (backend "native" or "numpy").
        native: None (the default): the FFI handler when the program is native and a C compiler
            exists, else the zero-copy host callback; True or False forces one.
        data: The call is ``(*params, *inputs, *data)``, with one int32/int64 or bool array per
            data slot (``program.data``, in registration order), copied into the slot on every call
            (``interop.capture_jax`` programs are called so).

    Returns:
        The JAX function; its ``program`` and ``native`` attributes say what it runs and how.

    Raises:
        ProgramError: If the program was captured with backend "cupy", or ``native=True`` for a
            program that is not native or where the FFI handler cannot be built.

    Examples:
        >>> import numpy as np, jax, jax.numpy as jnp, tapegrad as tg, interop
        >>> tape = tg.Tape()
        >>> w, x = tape.param(np.ones(2)), tape.const(np.array([1.0, 2.0]))
        >>> prog = tg.capture(tape, ((w * x) ** 2).sum(), dtype="float32")
        >>> f = interop.program_call(prog)
        >>> w32, x32 = jnp.ones(2, jnp.float32), jnp.array([1.0, 2.0], jnp.float32)
        >>> loss, g = jax.value_and_grad(f)(w32, x32)
        >>> float(loss), g.tolist()
        (5.0, [2.0, 8.0])
    """
    native = _mode(program, native, "program_call")
    sig = _Sig(program)
    np_, ni = len(sig.params), len(sig.inputs)
    attrs = {"data": np.int64(1)} if data and sig.data else {}
    if native:
        names = native_library()[1]
        h = _i64(program.hash64)

    @_first_order("program_call")
    def call(xs, grads):
        specs = [_spec(xs, (), sig.dtype)]
        if grads:
            specs += [_spec(xs, s, sig.dtype) for s in sig.params]
        if native:
            kind = "value_and_grad" if grads else "value"
            return tuple(jax.ffi.ffi_call(names[kind], specs, vmap_method="broadcast_all")(*xs, prog=np.int64(h),
                                                                                         **attrs))
        return host_call(_host_value(program, grads), specs, *xs, vmap_method="sequential")

    def check(xs):
        groups = [("params", sig.params, xs[:np_]), ("inputs", sig.inputs, xs[np_:np_ + ni] if data else xs[np_:])]
        if data:
            groups.append(("data", sig.data, xs[np_ + ni:]))
        sig.check("program_call", groups)

    @jax.custom_vjp
    def f(*xs):
        return call(xs, False)[0]

    def fwd(*xs):
        loss, *g = call(tuple(x.value for x in xs), True)
        for k, x in enumerate(xs[np_:np_ + ni]):
            if x.perturbed:
                raise ProgramError(f"program_call: cannot differentiate with respect to inputs[{k}]: it is a "
                                   f"constant of the captured program (no gradient is recorded for it)")
        return loss, tuple(g)

    def bwd(g, ct):   # None: a zero cotangent
        return tuple(ct * gk for gk in g) + (None,) * (len(sig.inputs) + (len(sig.data) if data else 0))

    f.defvjp(fwd, bwd, symbolic_zeros=True)

    def run(*xs):
        xs = tuple(jnp.asarray(x) for x in xs)
        check(xs)
        return first_order(f, "program_call", _align_varying(xs))

    run.program, run.native = program, native
    return run


def program_episode(program: Program, *, flat: bool = False, native: Optional[bool] = None, data: bool = False,
                    lr: bool = False) -> Callable[..., Any]:
    """One XLA custom call doing forward + backward + the attached optimizer's step, state explicit.

    The state is named and shaped as optax's (see ``episode_state``): ``params`` a dict
    ``{name: array}`` of every parameter (``tape.param(..., name=)``, else ``param_<k>``),
    ``opt_state`` an ``optax.ScaleByAdamState(count, mu, nu)`` (Adam; ``mu``/``nu`` dicts keyed like
    ``params``) or an ``SGDState(count)`` (momentum SGD: ``SGDState(count, trace)``), ``count`` an
    int32 step counter; ``inputs`` is a tuple of the program's constants in registration order.
    Parameters and state alias their outputs (``input_output_aliases``): inside
    ``jax.jit(step, donate_argnums=(0, 1))`` they are updated in place. ``episode_state(program)``
    gives the initial ``(params, opt_state)``.

    A call raises ``ProgramError`` for a state or operands that do not fit the program, and
    ``TransformError`` under differentiation: a training episode is not differentiable
    (differentiate the loss: ``interop.value_and_grad``, ``program_call``).

    Args:
        program: A captured tapegrad ``Program`` (backend "native" or "numpy") with an optimizer
            attached (``program.attach(optimizer)``).
        flat: ``step(state, inputs) -> (loss, state)`` with the whole state in one vector
            ``[params | opt_state | count]`` (``episode_state(program, flat=True)``; name it with
            ``unflatten_state``). One donated operand instead of 2·#params+1 costs XLA less per
            call (``jax.jit(step, donate_argnums=0)``).
        native: None (the default): the FFI handler when the program is native and a C compiler
            exists, else the zero-copy host callback; True or False forces one.
        data: Every call also takes ``data=``, a tuple of one int32/int64 or bool array per data
            slot, as ``program_call(data=True)``.
        lr: Every call also takes ``lr=``, the learning rate of this step (a scalar in the
            program's dtype: an optax schedule's value), in place of the optimizer's.

    Returns:
        ``step(params, opt_state, inputs) -> (loss, params, opt_state)`` (with ``data``/``lr``:
        keyword arguments of the same names). ``step.positional(params, moments, count, inputs,
        data=(), lr=None, steps=None)`` is the same call on positional tuples (``moments``:
        ``[mu_0, nu_0, …]``); ``steps=K`` runs K steps in one call, inputs, data and lr holding one
        block per step on a leading axis, and returns K losses.

    Raises:
        ProgramError: If no optimizer is attached, the program was captured with backend "cupy",
            or ``native=True`` for a program that is not native or where the FFI handler cannot be
            built.

    Examples:
        >>> import numpy as np, jax, tapegrad as tg, interop
        >>> tape = tg.Tape(); w = tape.param(np.ones(2), name="w")
        >>> opt = tg.SGD(0.25); _ = opt.add(tape, w)
        >>> prog = tg.capture(tape, (w * w).sum(), dtype="float32")
        >>> prog.attach(opt)
        >>> step = jax.jit(interop.program_episode(prog), donate_argnums=(0, 1))
        >>> params, opt_state = interop.episode_state(prog)
        >>> inputs = interop.program_inputs(prog)
        >>> loss, params, opt_state = step(params, opt_state, inputs)
        >>> float(loss), params["w"].tolist(), int(opt_state.count)
        (2.0, [0.5, 0.5], 1)
    """
    if program.opt is None:
        raise ProgramError("program_episode: attach an optimizer first (program.attach(optimizer))")
    native = _mode(program, native, "program_episode")
    sig = _Sig(program)
    np_, ns = len(sig.params), len(sig.state)
    aliases = {k: k + 1 for k in range(np_ + ns + 1)}
    if native:
        names = native_library()[1]
        h = _i64(program.hash64)
    attrs = {"prog": np.int64(h)} if native else {}
    if data and sig.data:
        attrs["data"] = np.int64(1)
    if lr:
        attrs["lr"] = np.int64(1)

    def extra(inputs, data_, lr_, steps=None):
        """The inputs, then the learning rate and the data operands this episode takes, checked (with
        ``steps``: each holds one block per step on a leading axis, checked by its first block)."""
        inputs = tuple(jnp.asarray(x) for x in inputs)
        data_ = tuple(jnp.asarray(x) for x in data_) if data else ()
        if lr and lr_ is None:
            raise ProgramError("program_episode: this episode was built with lr=True: pass lr= (the step's "
                               "learning rate)")
        if not lr and lr_ is not None:
            raise ProgramError("program_episode: lr= is taken by an episode built with lr=True")
        rate = (jnp.asarray(lr_, sig.dtype).reshape(() if steps is None else (steps,)),) if lr else ()
        if steps is not None:
            for name, xs in (("inputs", inputs), ("data", data_)):
                for k, x in enumerate(xs):
                    if x.ndim == 0 or x.shape[0] != steps:
                        raise ProgramError(f"program_episode: steps={steps}: {name}[{k}] must hold one block per "
                                           f"step on its leading axis, got shape {tuple(x.shape)}")
        first = (lambda xs: xs) if steps is None else (lambda xs: tuple(x[0] for x in xs))
        groups = [("inputs", sig.inputs, first(inputs))] + ([("data", sig.data, first(data_))] if data else [])
        return inputs, rate, data_, groups

    if flat:
        total = sum(_flat_sizes(program))

        def flat_step(state, inputs, data=(), lr=None):
            state = jnp.asarray(state)
            inputs, rate, data_, groups = extra(inputs, data, lr)
            sig.check("program_episode", [("state", [(total,)], (state,))] + groups)
            xs = (state,) + inputs + rate + data_
            specs = [_spec(xs, (), sig.dtype), _spec(xs, (total,), sig.dtype)]
            if native:
                out = jax.ffi.ffi_call(names["episode_flat"], specs, input_output_aliases={0: 1},
                                       vmap_method="sequential")(*xs, **attrs)
            else:
                out = host_call(_host_episode(program, flat=True, lr=bool(rate)), specs, *xs,
                                vmap_method="sequential", input_output_aliases={0: 1})
            return out[0], out[1]

        flat_step.program, flat_step.native = program, native
        return flat_step

    def positional(params, opt_state, count, inputs, data=(), lr=None, steps=None):
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ProgramError(f"program_episode: steps must be a positive int (the number of steps in one "
                               f"call), got {steps!r}")
        params = tuple(jnp.asarray(x) for x in params)
        opt_state = tuple(jnp.asarray(x) for x in opt_state)
        inputs, rate, data_, groups = extra(inputs, data, lr, steps)
        if jnp.ndim(count) != 0:
            raise ProgramError(f"program_episode: the step count must be a scalar integer (optax's count is "
                               f"int32[]), got {jax.typeof(jnp.asarray(count)).str_short()}")
        count = count_operand(count, sig.dtype)
        sig.check("program_episode", [("params", sig.params, params), ("opt_state", sig.state, opt_state)] + groups)
        xs = params + opt_state + (count,) + inputs + rate + data_
        out = _episode_call(xs, steps, bool(rate))
        return out[0], tuple(out[1:1 + np_]), tuple(out[1 + np_:1 + np_ + ns]), count_result(out[-1], sig.dtype)

    @_not_differentiable("program_episode", "a training episode (forward, backward and the optimizer's update "
                         "in one call) is not differentiable: differentiate the loss (interop.value_and_grad, "
                         "program_call), not the step")
    def _episode_call(xs, steps, rate):
        specs = [_spec(xs, () if steps is None else (steps,), sig.dtype)]
        specs += [_spec(xs, s, sig.dtype) for s in sig.params + sig.state] + [_spec(xs, (), sig.dtype)]
        if native:
            more = {} if steps is None else {"steps": np.int64(steps)}
            return jax.ffi.ffi_call(names["episode"], specs, input_output_aliases=aliases,
                                    vmap_method="sequential")(*xs, **attrs, **more)
        run = _host_episode(program, lr=rate, steps=steps)
        return host_call(run, specs, *xs, vmap_method="sequential", input_output_aliases=aliases)

    def step(params, opt_state, inputs, data=(), lr=None):
        p, st, count = _positional(program, "program_episode", params, opt_state)
        loss, p, st, count = positional(p, st, count, inputs, data, lr)
        return (loss,) + _named(program, p, st, count)

    step.program, step.native = program, native
    # the same call on positional tuples: (params, [mu_0, nu_0, …], count (an integer), inputs[, data, lr]);
    # steps=K runs K steps in one call, inputs, data and lr holding one block per step (the loss: K values)
    step.positional = positional
    return step


def _flat_sizes(program):
    sig = _Sig(program)
    return [int(np.prod(sh)) for sh in sig.params + sig.state] + [1]


def count_operand(count, dtype):
    """The step counter as an episode operand of the program's dtype: a float64 holds it exactly; in
    float32 it travels as int32's bits (a float32 would stop counting at 2**24)."""
    count = jnp.asarray(count)
    if np.dtype(dtype) == np.float64:
        return count.astype(jnp.float64)
    return jax.lax.bitcast_convert_type(count.astype(jnp.int32), jnp.float32)


def count_result(x, dtype):
    """``count_operand``'s inverse: the int32 counter."""
    if np.dtype(dtype) == np.float64:
        return jnp.asarray(x).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)


def _count_host(buf, value=None):
    """Read (``value`` None) or write the counter in a host callback's operand or result ``buf``."""
    view = buf if buf.dtype == np.float64 else buf.view(np.int32)
    if value is None:
        return int(view.reshape(()))
    view[...] = value


class SGDState(NamedTuple):
    """The episode state of a program whose optimizer is SGD.

    Attributes:
        count: The step counter, an int32 0-d array.
        trace: With momentum, the trace: a dict keyed like ``params``; None without momentum.
    """
    count: Any
    trace: Any = None


class ScaleByAdamState(NamedTuple):
    """Field for field ``optax.ScaleByAdamState``; used only where optax is not installed."""
    count: Any
    mu: Any
    nu: Any


def _adam_state():
    try:
        import optax
    except ImportError:
        return ScaleByAdamState
    return optax.ScaleByAdamState


def _opt_names(program):
    """The names of the optimizer's parameters, in the optimizer's registration order."""
    by_id = dict(zip(program.params, program.param_names))
    return [by_id[i] for i in program.opt.ids]


def _named(program, params, state, count):
    """Positional ``(params, [mu_0, nu_0, …], count)`` → named ``(params, opt_state)`` (no copies)."""
    named = dict(zip(program.param_names, params))
    count = jnp.asarray(count).astype(jnp.int32)
    names = _opt_names(program)
    if program.opt.kind != "Adam":
        return named, SGDState(count, dict(zip(names, state)) if program.opt.moments else None)
    return named, _adam_state()(count=count, mu=dict(zip(names, state[0::2])), nu=dict(zip(names, state[1::2])))


def _keys(who, what, tree, want):
    if not isinstance(tree, Mapping):
        raise ProgramError(f"{who}: {what} must be a dict {{name: array}} with keys {want}, got "
                           f"{type(tree).__name__}")
    missing, extra = [n for n in want if n not in tree], [n for n in tree if n not in want]
    if missing or extra:
        raise ProgramError(f"{who}: {what} must have the keys {want}; missing {missing}, unexpected {extra}")


def _positional(program, who, params, opt_state):
    """Named ``(params, opt_state)`` → positional ``(params, [mu_0, nu_0, …], count)``, checked by name."""
    sig = _Sig(program)
    names = program.param_names
    shapes = dict(zip(names, sig.params))

    def check(what, tree, want):
        _keys(who, what, tree, want)
        for n in want:
            aval = jax.typeof(tree[n])
            if tuple(aval.shape) != shapes[n] or np.dtype(aval.dtype) != sig.dtype:
                raise ProgramError(f"{who}: {what}[{n!r}] must be {sig.dtype}{list(shapes[n])} (the captured "
                                   f"parameter's shape), got {aval.dtype}{list(aval.shape)}")
    check("params", params, names)
    count = getattr(opt_state, "count", None)
    if count is None or callable(count):   # a plain tuple's .count is a method
        raise ProgramError(f"{who}: opt_state must have a 'count' field (optax.ScaleByAdamState or SGDState), got "
                           f"{type(opt_state).__name__}")
    state = ()
    fields = ("mu", "nu") if program.opt.kind == "Adam" else ("trace",)[:program.opt.moments]
    if fields:
        onames = _opt_names(program)
        for what in fields:
            check(f"opt_state.{what}", getattr(opt_state, what, None), onames)
        state = tuple(getattr(opt_state, what)[n] for n in onames for what in fields)
    return tuple(params[n] for n in names), state, jnp.asarray(count).astype(jnp.int32)


def unflatten_state(program: Program, state: Any) -> tuple[dict[str, Any], Any]:
    """Name a flat episode state ``[params | opt_state | count]``, as ``episode_state`` names it.

    Args:
        program: The program whose ``program_episode(flat=True)`` the state is of.
        state: The flat state vector.

    Returns:
        ``(params, opt_state)``, as ``episode_state(program)`` gives them.

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> tape = tg.Tape(); w = tape.param(np.ones(2), name="w")
        >>> opt = tg.SGD(0.1); _ = opt.add(tape, w)
        >>> prog = tg.capture(tape, (w * w).sum(), dtype="float32")
        >>> prog.attach(opt)
        >>> flat = interop.episode_state(prog, flat=True)
        >>> params, opt_state = interop.unflatten_state(prog, flat)
        >>> params["w"].tolist(), int(opt_state.count)
        ([1.0, 1.0], 0)
    """
    sig = _Sig(program)
    parts = jnp.split(jnp.asarray(state), np.cumsum(_flat_sizes(program))[:-1].tolist())
    arrays = [a.reshape(sh) for a, sh in zip(parts, sig.params + sig.state + [()])]
    n = len(sig.params)
    return _named(program, arrays[:n], arrays[n:-1], count_result(arrays[-1], sig.dtype))


def flatten_state(program: Program, params: Mapping[str, Any], opt_state: Any) -> Any:
    """The flat vector ``[params | opt_state | count]`` of a named state (``unflatten_state``'s inverse).

    Args:
        program: The program, its optimizer attached.
        params: The parameters by name, as ``episode_state`` gives them.
        opt_state: The optimizer state, as ``episode_state`` gives it.

    Returns:
        A JAX vector in the program's dtype (a float32 program's count travels as int32's bits).

    Raises:
        ProgramError: If ``params`` or the state's moments lack a name or have one too many, or an
            array's shape or dtype is not the program's, or ``opt_state`` has no ``count`` field.

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> tape = tg.Tape(); w = tape.param(np.ones(2), name="w")
        >>> opt = tg.Adam(0.1); _ = opt.add(tape, w)
        >>> prog = tg.capture(tape, (w * w).sum(), dtype="float32")
        >>> prog.attach(opt)
        >>> interop.flatten_state(prog, *interop.episode_state(prog)).shape
        (7,)
    """
    p, st, count = _positional(program, "flatten_state", params, opt_state)
    return jnp.concatenate([jnp.ravel(jnp.asarray(a, program.dtype)) for a in p + st]
                           + [jnp.reshape(count_operand(count, np.dtype(program.dtype)), (1,))])


def episode_state(program: Program, flat: bool = False) -> Any:
    """The program's current episode state as JAX arrays (copies), named and shaped as optax's.

    With ``optax.adam`` over all parameters, ``(opt_state, optax.EmptyState())`` is optax's own
    state.

    Args:
        program: The program, its optimizer attached.
        flat: Return one vector ``[params | opt_state | count]``, for
            ``program_episode(flat=True)``.

    Returns:
        ``(params, opt_state)``: ``params`` is ``{name: array}`` over every parameter (names from
        ``tape.param(..., name=)``, else ``param_<k>``); for Adam ``opt_state`` is an
        ``optax.ScaleByAdamState(count, mu, nu)`` whose ``mu``/``nu`` are dicts keyed by the
        optimizer's parameter names, for SGD an ``SGDState(count)``; ``count`` is an int32 0-d
        array. With ``flat``: the flat vector.

    Raises:
        ProgramError: If no optimizer is attached.

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> tape = tg.Tape(); w = tape.param(np.ones(2), name="w")
        >>> opt = tg.Adam(0.1); _ = opt.add(tape, w)
        >>> prog = tg.capture(tape, (w * w).sum()); prog.attach(opt)
        >>> params, opt_state = interop.episode_state(prog)
        >>> list(params), list(opt_state.mu), opt_state.count.dtype
        (['w'], ['w'], dtype('int32'))
    """
    if program.opt is None:
        raise ProgramError("episode_state: attach an optimizer first (program.attach(optimizer))")
    o = program.opt
    if program.backend == "native":
        program.runner.pull_count()
    params = tuple(jnp.array(program.val[k]) for k in program.params)
    state = tuple(jnp.array(a) for a in o.state_arrays())
    named = _named(program, params, state, o.count)
    return flatten_state(program, *named) if flat else named


def program_inputs(program: Program) -> tuple[Any, ...]:
    """The program's current constant values (copies), in registration order: ``inputs`` for a call.

    Args:
        program: The program.

    Returns:
        A tuple of JAX arrays, one per constant of the program.

    Examples:
        >>> import numpy as np, tapegrad as tg, interop
        >>> tape = tg.Tape(); w = tape.param(np.ones(2))
        >>> x = tape.const(np.array([3.0, 4.0]))
        >>> prog = tg.capture(tape, (w * x).sum())
        >>> [a.tolist() for a in interop.program_inputs(prog)]
        [[3.0, 4.0]]
    """
    return tuple(jnp.array(program.val[k]) for k in program.consts)
