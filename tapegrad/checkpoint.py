"""Checkpoints of tape parameters and optimizer state: safetensors files, validated, written atomically.

The file is a plain `safetensors <https://github.com/huggingface/safetensors>`_ file (an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the
raw little-endian data), written here with NumPy alone, so any safetensors reader opens it by name:
``params.<k>``, ``opt.mu.<k>``, ``opt.nu.<k>`` (k: registration order; parameters' names, where
``tape.param(..., name=)`` gave them, are in the metadata and checked on load); the
header's ``__metadata__`` holds ``{"format": "tapegrad-checkpoint-2", "tapegrad": <JSON>}`` with the
dtype, the parameter shapes and the optimizer's configuration and step count. Nothing is ever
unpickled. Checkpoints of the previous format (``.npz`` with a JSON ``meta`` entry) still load.

``save`` writes a temporary file in the target folder, fsyncs it, renames it over the target and
fsyncs the folder: a reader (or a crash) sees the old file or the new one, never a mix. Temporaries
carry the writer's pid; a later ``save`` into the same folder removes those of dead writers (a
``kill -9`` mid-save leaves nothing behind for long). ``load`` reads and checks everything — the
file's structure, every array present, float, of the exact shape in the metadata and on the tape, the
optimizer's kind and parameters — before it writes anything: parameters and optimizer state are
restored together or not at all. Every unreadable file raises ``CheckpointError``.
"""
import json
import math
import os
import struct
import tempfile
import zipfile
from typing import TYPE_CHECKING, Optional

import numpy as np

from ._files import fsync_dir, sweep_temporaries
from .errors import CheckpointError, ForeignVarError, TapeError

if TYPE_CHECKING:
    from .optim import Optimizer
    from .tape import Tape

FORMAT = "tapegrad-checkpoint-2"
LEGACY = "tapegrad-checkpoint-1"     # the npz format of version 0.1 (loaded, never written)
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4")}
_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32"}
_MAX_HEADER = 100 << 20              # safetensors' own limit on the JSON header


def _params(tape):
    return [i for i, n in enumerate(tape._nodes) if n.op.name == "param"]


def _check_opt(who, tape, opt):
    """The optimizer serves ``tape`` and none of its parameters was dropped by ``reset_to``."""
    if opt.tape is not None and opt.tape is not tape:
        raise ForeignVarError(f"{who}: the optimizer serves another tape than the one given; pass the tape "
                              f"its parameters were registered on")
    for k, v in enumerate(opt.params):
        n = len(tape._nodes)
        if v.id >= n or tape._nodes[v.id].epoch != v.epoch:
            raise ForeignVarError(f"{who}: the optimizer's parameter {k} (node {v.id}) was dropped by reset_to; "
                                  f"register parameters before the mark, or build a new optimizer")


# ── writing ──────────────────────────────────────────────────────────────────

def save(path: "str | os.PathLike[str]", tape: "Tape", opt: "Optional[Optimizer]" = None) -> None:
    """Write every parameter of ``tape`` and ``opt``'s state to ``path`` (safetensors), atomically.

    The file appears complete or not at all (a temporary file in the same folder, fsync, rename,
    fsync of the folder).

    >>> import numpy as np, tapegrad as tg, tempfile, os
    >>> tape = tg.Tape(); w = tape.param(np.arange(3.0))
    >>> path = os.path.join(tempfile.mkdtemp(), "ck.safetensors")
    >>> tg.save(path, tape)
    >>> tape2 = tg.Tape(); w2 = tape2.param(np.zeros(3)); tg.load(path, tape2); tape2.value(w2)
    array([0., 1., 2.])
    """
    if opt is not None:
        _check_opt("save", tape, opt)
    ids = _params(tape)
    tensors = [(f"params.{k}", tape._val[i]) for k, i in enumerate(ids)]
    meta = {"dtype": tape.dtype.name, "params": [list(tape._nodes[i].shape) for i in ids],
            "names": [_name(tape, i) for i in ids]}
    if opt is not None:
        state = opt.state_dict()
        meta["optimizer"] = {**opt.config(), "count": state["count"], "param_nodes": [v.id for v in opt.params]}
        for key in ("mu", "nu"):
            tensors += [(f"opt.{key}.{k}", a) for k, a in enumerate(state.get(key, []))]
    blob = encode(tensors, {"format": FORMAT, "tapegrad": json.dumps(meta)})
    write_atomic(path, blob)


def encode(tensors, metadata):
    """The bytes of a safetensors file holding ``tensors`` ([(name, float array)]) and ``metadata``."""
    header, offset, chunks = {"__metadata__": metadata}, 0, []
    for name, a in tensors:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        header[name] = {"dtype": _CODES[np.dtype(a.dtype.name)], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        chunks.append(a.tobytes())
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)     # the data section starts 8-byte aligned (allowed padding)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def write_atomic(path, blob):
    """Write ``blob`` to ``path`` through a fsynced temporary and a rename; CheckpointError on failure."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"save: cannot write {path}: the folder {folder} does not exist; create it first")
    base = os.path.basename(path)
    sweep_temporaries(folder, f".{base}.tmp-")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.tmp-{os.getpid()}-")
    except OSError as e:
        raise CheckpointError(f"save: cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"save: cannot write {path}: {e.strerror or e}") from None
        raise
    fsync_dir(folder)


# ── reading ──────────────────────────────────────────────────────────────────

def _bad(path, why):
    return CheckpointError(f"load: {path} is not a valid tapegrad checkpoint: {why}")


def read(path):
    """``(meta, {name: array})`` of a checkpoint file, structure checked; CheckpointError otherwise."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise CheckpointError(f"load: cannot read {path}: {e.strerror or e}") from None
    if blob[:4] == b"PK\x03\x04":
        return _read_npz(path)
    return _read_safetensors(path, blob)


def _read_safetensors(path, blob):
    if len(blob) < 8:
        raise _bad(path, f"{len(blob)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise _bad(path, f"header length {n} exceeds the file ({len(blob)} bytes): truncated or not safetensors")
    try:
        header = json.loads(blob[8:8 + n].decode())
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"its header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise _bad(path, f"expected metadata format {FORMAT!r}, got {got!r}")
    try:
        meta = json.loads(meta["tapegrad"])
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"its 'tapegrad' metadata is missing or not JSON ({e!r})") from None
    data = memoryview(blob)[8 + n:]
    arrays = {}
    for name, entry in header.items():
        try:
            dt = _DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            lo, hi = entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape + (lo, hi)):
                raise ValueError(f"shape {shape} / offsets {lo, hi} are not non-negative ints")
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"tensor {name!r} has a malformed entry {entry!r} ({e})") from None
        if hi - lo != math.prod(shape) * dt.itemsize or hi > len(data):
            raise _bad(path, f"tensor {name!r} ({entry['dtype']} {list(shape)}) claims bytes [{lo}, {hi}) of a "
                             f"{len(data)}-byte data section: truncated or corrupt")
        arrays[name] = np.frombuffer(data[lo:hi], dt).reshape(shape)
    return _checked_meta(path, meta), arrays


def _read_npz(path):
    """A version-0.1 checkpoint (``param_k``, ``mu_k``, ``nu_k`` and a JSON ``meta`` in an npz)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
        meta = json.loads(str(data.pop("meta")))
        if not isinstance(meta, dict) or meta.get("format") != LEGACY:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}")
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise _bad(path, f"an unreadable npz ({type(e).__name__}: {e})") from None
    renamed = {}
    for key, a in data.items():
        kind, _, k = key.rpartition("_")
        renamed[{"param": "params", "mu": "opt.mu", "nu": "opt.nu"}.get(kind, kind) + "." + k] = a
    return _checked_meta(path, meta), renamed


def _name(tape, i):
    """The name ``tape.param(..., name=)`` gave node ``i``, or None."""
    return next((n for n, v in tape._names.items() if v.id == i and tape._live(v)), None)


def _checked_meta(path, meta):
    try:
        ok = (isinstance(meta, dict) and meta["dtype"] in ("float64", "float32")
              and all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in meta["params"]))
        opt = meta.get("optimizer")
        ok = ok and (opt is None or (isinstance(opt.get("kind"), str) and isinstance(opt.get("count"), int)
                                     and isinstance(opt.get("param_nodes"), list)))
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise _bad(path, "its metadata lacks or garbles dtype / params / optimizer")
    return meta


def _array(path, arrays, name, shape, dtype):
    a = arrays.get(name)
    if a is None:
        raise _bad(path, f"tensor {name} is missing")
    if a.dtype.kind != "f" or a.dtype.name != dtype:
        raise _bad(path, f"tensor {name} is {a.dtype}, the metadata says {dtype}")
    if a.shape != tuple(shape):
        raise _bad(path, f"tensor {name} has shape {a.shape}, the metadata says {tuple(shape)}")
    return a


def load(path: "str | os.PathLike[str]", tape: "Tape", opt: "Optional[Optimizer]" = None) -> None:
    """Restore a ``save``d checkpoint into ``tape`` (and ``opt``); checks everything before writing.

    A file that is not a readable checkpoint raises ``CheckpointError``; one that does not fit the
    tape (count, shapes or dtype of parameters, optimizer kind or parameters) raises ``TapeError``
    naming the mismatch. In every failing case the tape and optimizer are left untouched.
    """
    meta, arrays = read(path)
    dtype = meta["dtype"]
    params = [_array(path, arrays, f"params.{k}", s, dtype) for k, s in enumerate(meta["params"])]
    ids = _params(tape)
    if len(ids) != len(params):
        raise TapeError(f"load: the checkpoint holds {len(params)} parameters, the tape has {len(ids)}")
    names = meta.get("names") if isinstance(meta.get("names"), list) else [None] * len(ids)
    for k, (i, a, saved) in enumerate(zip(ids, params, names)):
        have = _name(tape, i)
        if saved is not None and have is not None and saved != have:
            raise TapeError(f"load: parameter {k} (node {i}) is named {have!r} on the tape, {saved!r} in the "
                            f"checkpoint")
        if a.shape != tape._nodes[i].shape:
            raise TapeError(f"load: parameter {k} (node {i}) has shape {tape._nodes[i].shape}, the checkpoint "
                            f"{a.shape}")
    if dtype != tape.dtype.name:
        raise TapeError(f"load: the checkpoint is {dtype}, the tape {tape.dtype.name}")
    state = None
    if opt is not None:
        _check_opt("load", tape, opt)
        saved = meta.get("optimizer")
        if saved is None or saved["kind"] != opt.kind:
            raise TapeError(f"load: expected {opt.kind} state in the checkpoint, got "
                            f"{None if saved is None else saved['kind']}")
        if saved["param_nodes"] != [v.id for v in opt.params]:
            raise TapeError(f"load: the optimizer's parameters are nodes {[v.id for v in opt.params]}, the "
                            f"checkpoint's {saved['param_nodes']}")
        if saved["count"] < 0:
            raise _bad(path, f"optimizer count {saved['count']} is negative")
        state = {"count": saved["count"]}
        for key in ("mu", "nu")[:opt.moments]:
            state[key] = [_array(path, arrays, f"opt.{key}.{k}", tape._nodes[v.id].shape, dtype)
                          for k, v in enumerate(opt.params)]
    # Everything is checked: from here on nothing can fail half-way.
    if opt is not None and state is not None:
        opt.load_state_dict(state)
    for i, a in zip(ids, params):
        np.copyto(tape._val[i], a)
