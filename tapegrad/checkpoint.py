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
``kill -9`` mid-save leaves nothing behind for long). The metadata also holds ``"sha256"``: the SHA-256
of every tensor's bytes and of the ``tapegrad`` metadata string, so a flipped bit anywhere is found.

``load`` reads the 8-byte length first and checks it against the file's size before reading more
(a device or a huge foreign file is refused without reading it), then validates the header as the
safetensors library does (every tensor's byte range inside the file, of the size its dtype and shape
take, the ranges in order without gaps or overlaps and covering the data section exactly), the
metadata (a step count within 0..2**53), every array present, float, of the exact shape in the
metadata and on the tape, the optimizer's kind and parameters, and last the checksums — all before it
writes anything. The writes (parameters and optimizer state) then happen with signals held back (on
the main thread: Ctrl-C, a timeout's alarm) and are undone if anything interrupts them anyway: restored completely or not at all.
Files written before the checksums (and version-0.1 npz files) load with every check but the
checksums. Every unreadable file raises ``CheckpointError``: JSON nested too deeply for Python, a
zero-size tensor of a shape NumPy cannot hold (100 dimensions, dimensions past int64) included. The
header is read one tensor entry at a time into a compact table, and an array is made only for a tensor
the tape asks for, so a small file of a million empty tensors costs a few times its size in memory.

``save`` names its temporary ``.<name>.tmp-<pid>-XXXXXXXX``; for a name too long for that (a legal name
of 252 bytes) the temporary keeps the head of the name and a hash of all of it.
"""
import array
import errno
import hashlib
import itertools
import json
import math
import os
import re
import reprlib
import stat
import struct
import tempfile
import zipfile
from typing import TYPE_CHECKING, Optional

import numpy as np

from ._files import fsync_dir, sweep_temporaries, temporary_stem
from ._interrupts import signals_held
from .errors import CheckpointError, ForeignVarError, TapeError

if TYPE_CHECKING:
    from .optim import Optimizer
    from .tape import Tape

FORMAT = "tapegrad-checkpoint-2"
LEGACY = "tapegrad-checkpoint-1"     # the npz format of version 0.1 (loaded, never written)
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4")}
_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32"}
_CODE_OF = {np.dtype("<f8"): 0, np.dtype("<f4"): 1}   # an entry's dtype in one byte (_Entries)
_DT_OF = {0: np.dtype("<f8"), 1: np.dtype("<f4")}
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_MAX_HEADER = 100 << 20              # safetensors' own limit on the JSON header
_MAX_COUNT = 2 ** 53                 # the largest step count every backend holds exactly (a double counts to it)
_SUMS = "sha256"                     # the __metadata__ entry with the checksums


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
    fsync of the folder). Any safetensors reader opens it: ``params.<k>``, ``opt.mu.<k>``,
    ``opt.nu.<k>`` in registration order, the rest in its metadata.

    Args:
        path: The file to write (replaced if it exists).
        tape: The tape whose parameters to save, with their names.
        opt: An optimizer serving ``tape``, whose configuration, step count and moments are saved
            too; None: parameters only.

    Raises:
        ForeignVarError: If ``opt`` serves another tape or one of its parameters was dropped by
            ``reset_to``.
        CheckpointError: If the file cannot be written (its folder missing, no permission, a full disk).

    Examples:
        >>> import numpy as np, tapegrad as tg, tempfile, os
        >>> tape = tg.Tape(); w = tape.param(np.arange(3.0))
        >>> path = os.path.join(tempfile.mkdtemp(), "ck.safetensors")
        >>> tg.save(path, tape)
        >>> tape2 = tg.Tape(); w2 = tape2.param(np.zeros(3))
        >>> tg.load(path, tape2); tape2.value(w2)
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
    blob = encode(tensors, {"format": FORMAT, "tapegrad": json.dumps(meta)}, checksums=True)
    write_atomic(path, blob)


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def encode(tensors, metadata, checksums=False):
    """The bytes of a safetensors file holding ``tensors`` ([(name, float array)]) and ``metadata``; with
    ``checksums``, ``metadata["sha256"]`` is the SHA-256 of every tensor's bytes and of the ``tapegrad``
    metadata string, as JSON."""
    header, offset, chunks = {"__metadata__": dict(metadata)}, 0, []
    sums = {"tapegrad": _sha(metadata["tapegrad"].encode())} if checksums else None
    for name, a in tensors:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        header[name] = {"dtype": _CODES[np.dtype(a.dtype.name)], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        chunks.append(a.tobytes())
        if sums is not None:
            sums[name] = _sha(chunks[-1])
        offset += a.nbytes
    if sums is not None:
        header["__metadata__"][_SUMS] = json.dumps(sums)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)     # the data section starts 8-byte aligned (allowed padding)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def write_atomic(path, blob):
    """Write ``blob`` to ``path`` through a fsynced temporary and a rename; CheckpointError on failure."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"save: cannot write {path}: the folder {folder} does not exist; create it first")
    stem = temporary_stem(folder, os.path.basename(path))
    sweep_temporaries(folder, f"{stem}.tmp-")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{stem}.tmp-{os.getpid()}-")
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
    """``(meta, {name: array})`` of a checkpoint file, structure and checksums checked; CheckpointError
    otherwise."""
    meta, arrays, sums = _read(path)
    _verify(path, arrays, sums)
    return meta, dict(arrays.items())


def _read(path):
    """``(meta, arrays, checksums or None)``: the file read, its structure and metadata checked, the tensors'
    checksums not yet (``load`` checks them last, after the checks that name a more specific fault)."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(st.st_mode):   # /dev/zero, a pipe: no size to check a header against
            kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
                    else "a pipe" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "not a regular file")
            raise _bad(path, f"it is {kind}, not a file; save and load checkpoints as regular files")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if head[:4] == b"PK\x03\x04":
                meta, arrays = _read_npz(path)
                return meta, _Arrays.of(arrays), None
            return _read_safetensors(path, f, head, size)
    except OSError as e:
        raise CheckpointError(f"load: cannot read {path}: {e.strerror or e}") from None


def _cut(text, width=200):
    return text if len(text) <= width else text[:width] + "..."


class _Repr(reprlib.Repr):
    """``repr`` of what a header holds, a few levels and items deep (a hostile header nests deeply and
    holds a million items), dicts in their own order."""

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in itertools.islice(x.items(),
                                                                                                      self.maxdict)]
        return "{" + ", ".join(items + ["..."] * (len(x) > self.maxdict)) + "}"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 4, 80, 80, 10, 6


def _shown(x):
    return _cut(_REPR.repr(x))


def _read_safetensors(path, f, head, size):
    """The header first (its length checked against the file's size), validated, then the data section."""
    if len(head) < 8:
        raise _bad(path, f"{len(head)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise _bad(path, f"header length {n} exceeds the file ({size} bytes): truncated or not safetensors")
    if n > _MAX_HEADER:
        raise _bad(path, f"header length {n} exceeds safetensors' limit of {_MAX_HEADER} bytes: not safetensors")
    try:
        text = f.read(n).decode()
    except UnicodeDecodeError as e:
        raise _bad(path, f"its header is not JSON ({e})") from None
    meta, entries = _header(path, text, size - 8 - n)
    del text
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise _bad(path, f"expected metadata format {FORMAT!r}, got {_shown(got)}")
    try:
        text = meta["tapegrad"]
        inner = json.loads(text)
    except RecursionError:
        raise _bad(path, "its 'tapegrad' metadata nests too deeply to be a checkpoint's: corrupt or hostile") from None
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"its 'tapegrad' metadata is missing or not JSON ({_cut(repr(e))})") from None
    sums = _checksums(path, meta)
    if sums is not None and _sha(text.encode()) != sums["tapegrad"]:
        raise _bad(path, "its 'tapegrad' metadata does not match the SHA-256 saved with it: corrupt")
    meta = _checked_meta(path, inner)
    data = f.read(size - 8 - n)
    if len(data) != size - 8 - n or f.read(1):
        raise _bad(path, f"the file changed size while it was read ({size} bytes at first)")
    return meta, _Arrays(path, entries, memoryview(data)), sums


class _Entries:
    """The tensor entries of a header, compactly (a hostile header holds a million): per entry its name
    (in ``index``), dtype code, byte range, and where its JSON value starts in the header text (its shape
    is read again from there when its array is made)."""

    def __init__(self):
        self.index = {}
        self.dts = bytearray()
        self.lo, self.hi, self.at = array.array("q"), array.array("q"), array.array("q")
        self.text = ""

    def name(self, k):
        return next(nm for nm, j in self.index.items() if j == k)


def _members(text):
    """``(name, value, start)`` of each member of the JSON object ``text``, one at a time (ValueError or
    RecursionError where it is not JSON or nests too deeply)."""
    ws, decode, scan = _WS.match, _DECODER.raw_decode, json.decoder.scanstring
    i = ws(text, 0).end()
    if text[i:i + 1] != "{":
        json.loads(text)   # JSON's own words for what is wrong; else, JSON but no object:
        raise ValueError("not a JSON object")
    i = ws(text, i + 1).end()
    if text[i:i + 1] != "}":
        while True:
            if text[i:i + 1] != '"':
                raise ValueError(f"expected a name in double quotes at char {i}")
            name, i = scan(text, i + 1)
            i = ws(text, i).end()
            if text[i:i + 1] != ":":
                raise ValueError(f"expected ':' at char {i}")
            start = ws(text, i + 1).end()
            value, i = decode(text, start)
            yield name, value, start
            i = ws(text, i).end()
            if text[i:i + 1] == "}":
                break
            if text[i:i + 1] != ",":
                raise ValueError(f"expected ',' or '}}' at char {i}")
            i = ws(text, i + 1).end()
    if ws(text, i + 1).end() != len(text):
        raise ValueError(f"extra data after the header's object at char {i + 1}")


def _header(path, text, size):
    """``(__metadata__, _Entries)`` of the header ``text``: each tensor entry checked as the safetensors
    library checks them — a known dtype, a shape of non-negative ints, ``hi - lo`` = the bytes dtype ×
    shape take, and the byte ranges, in order, contiguous from 0 to the end of the ``size``-byte data
    section (no gap, no overlap, nothing after the last), each name once."""
    meta, out = None, _Entries()
    try:
        for name, entry, start in _members(text):
            if name == "__metadata__":
                meta = entry
                continue
            if name in out.index:
                raise _bad(path, f"tensor {_shown(name)} appears twice in the header: corrupt")
            dt, shape, lo, hi = _entry(path, name, entry)
            nbytes = math.prod(shape) * dt.itemsize
            claim = (f"tensor {_shown(name)} ({entry['dtype']} {_shown(list(shape))}) claims bytes [{lo}, {hi}) of a "
                     f"{size}-byte data section")
            if hi > size:
                raise _bad(path, f"{claim}: past its end; truncated or corrupt")
            if hi - lo != nbytes:
                raise _bad(path, f"{claim}: {hi - lo} bytes where its dtype and shape take {nbytes}; truncated or "
                                 f"corrupt")
            out.index[name] = len(out.dts)
            out.dts.append(_CODE_OF[dt])
            out.lo.append(lo)
            out.hi.append(hi)
            out.at.append(start)
    except RecursionError:
        raise _bad(path, "its header nests too deeply to be a checkpoint's: corrupt or hostile") from None
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise _bad(path, f"its header is not JSON ({e})") from None
    _contiguous(path, out, size)
    out.text = text
    return meta, out


def _entry(path, name, entry):
    try:
        dt = _DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        lo, hi = entry["data_offsets"]
        if not all(type(d) is int and d >= 0 for d in shape + (lo, hi)):   # (not true / false either)
            raise ValueError(f"shape {_shown(shape)} / offsets {_shown((lo, hi))} are not non-negative ints")
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"tensor {_shown(name)} has a malformed entry {_shown(entry)} ({_cut(str(e))})") from None
    return dt, shape, lo, hi


def _contiguous(path, out, size):
    """The byte ranges, sorted by start, cover the data section exactly (one vectorised pass)."""
    lo, hi = np.frombuffer(out.lo, np.int64), np.frombuffer(out.hi, np.int64)
    order = np.lexsort((hi, lo))
    lo, hi = lo[order], hi[order]
    ends = np.concatenate(([0], hi[:-1]))
    bad = np.flatnonzero(lo != ends)
    if bad.size:
        k, end = int(bad[0]), int(ends[bad[0]])
        start = int(lo[k])
        how = f"overlaps the tensor before it (which ends at byte {end})" if start < end else \
            f"leaves bytes [{end}, {start}) unclaimed"
        raise _bad(path, f"invalid offset: tensor {_shown(out.name(int(order[k])))} starts at byte {start} and {how}; "
                         f"the tensors must cover the data section in order, without gaps or overlaps: corrupt header")
    end = int(hi[-1]) if hi.size else 0
    if end != size:
        raise _bad(path, f"invalid offsets: the tensors cover bytes [0, {end}) of a {size}-byte data section; the "
                         f"rest belongs to none: corrupt or appended to")


class _Arrays:
    """``{name: array}`` of a file's tensors, each array made from the data when it is first asked for (a
    file of a million empty tensors makes none it does not use); ``bytes_of`` for the checksums."""

    def __init__(self, path, entries, data):
        self.path, self.e, self.data = path, entries, data
        self.made = {}

    @classmethod
    def of(cls, arrays):
        out = cls(None, None, None)
        out.made = dict(arrays)
        return out

    def names(self):
        return list(self.e.index) if self.e is not None else list(self.made)

    def get(self, name):
        if name in self.made or self.e is None or name not in self.e.index:
            return self.made.get(name)
        k = self.e.index[name]
        shape = tuple(_DECODER.raw_decode(self.e.text, self.e.at[k])[0]["shape"])
        dt = _DT_OF[self.e.dts[k]]
        try:
            a = np.frombuffer(self.data[self.e.lo[k]:self.e.hi[k]], dt).reshape(shape)
        except ValueError as err:
            raise _bad(self.path, f"tensor {_shown(name)} has shape {_shown(list(shape))}, which NumPy cannot hold "
                                  f"({err})") from None
        self.made[name] = a
        return a

    def items(self):
        return [(name, self.get(name)) for name in self.names()]

    def bytes_of(self, name):
        if self.e is None:
            return self.made[name].data
        k = self.e.index[name]
        return self.data[self.e.lo[k]:self.e.hi[k]]


def _checksums(path, meta):
    """The ``sha256`` metadata ({"tapegrad": hex, tensor name: hex}) checked for form; None in files written
    before checksums (they load unverified)."""
    if _SUMS not in meta:
        return None
    try:
        sums = json.loads(meta[_SUMS])
        ok = isinstance(sums, dict) and "tapegrad" in sums and all(
            isinstance(h, str) and len(h) == 64 and set(h) <= set("0123456789abcdef") for h in sums.values())
    except (TypeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise _bad(path, f"its {_SUMS!r} metadata is not a SHA-256 per tensor and one for 'tapegrad': corrupt")
    return sums


def _verify(path, arrays, sums):
    """Every tensor's bytes against the SHA-256 saved with them (the metadata's was checked on reading)."""
    if sums is None:
        return
    for name in arrays.names():
        if name not in sums:
            raise _bad(path, f"tensor {_shown(name)} has no SHA-256 among the checksums saved with the file: corrupt")
        data = arrays.bytes_of(name)
        if _sha(data) != sums[name]:
            raise _bad(path, f"tensor {_shown(name)}: its {data.nbytes} bytes do not match the SHA-256 saved with "
                             f"them: corrupt (a changed bit, or bytes moved)")


def _read_npz(path):
    """A version-0.1 checkpoint (``param_k``, ``mu_k``, ``nu_k`` and a JSON ``meta`` in an npz)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
        meta = json.loads(str(data.pop("meta")))
        if not isinstance(meta, dict) or meta.get("format") != LEGACY:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}")
    except RecursionError:
        raise _bad(path, "an unreadable npz (its meta nests too deeply to be a checkpoint's: corrupt or hostile)") \
            from None
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

    In every failing case the tape and optimizer are left untouched; once the checks pass, the
    writes happen with signals held back and are restored completely or not at all.

    Args:
        path: A file written by ``save`` (or a version-0.1 ``.npz`` checkpoint).
        tape: The tape to restore the parameters into: the same number, shapes, names and dtype.
        opt: An optimizer of the saved kind over the same parameters, whose count and moments are
            restored too; None: parameters only.

    Raises:
        CheckpointError: If the file is missing, truncated, corrupt (checksums included) or not a
            checkpoint.
        TapeError: If the checkpoint does not fit the tape or the optimizer (the message names the
            mismatch).
        ForeignVarError: If ``opt`` serves another tape or one of its parameters was dropped by
            ``reset_to``.
    """
    meta, arrays, sums = _read(path)
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
        count = saved["count"]
        if count < 0:
            raise _bad(path, f"optimizer count {count} is negative")
        if count > _MAX_COUNT:
            shown = count if count < 10 ** 20 else f"of {len(str(count))} digits"
            raise _bad(path, f"optimizer count {shown} is out of range: at most 2**53 steps, the largest count a "
                             f"double (the native step counter) holds exactly")
        state = {"count": count}
        for key in ("mu", "nu")[:opt.moments]:
            state[key] = [_array(path, arrays, f"opt.{key}.{k}", tape._nodes[v.id].shape, dtype)
                          for k, v in enumerate(opt.params)]
    _verify(path, arrays, sums)
    # Everything is checked: from here on nothing can fail half-way.
    _commit(tape, ids, params, opt, state)


def _commit(tape, ids, params, opt, state):
    """Write the checked parameters (and optimizer state) into the tape (and ``opt``) as one step: signals
    with Python handlers (Ctrl-C, an alarm) are held back meanwhile and delivered after, and anything that
    interrupts the copies anyway (a MemoryError) finds the old values written back before it propagates."""
    old = [np.array(tape._val[i]) for i in ids]
    old_state = opt.state_dict() if state is not None else None

    def copies():
        try:
            if state is not None:
                opt.load_state_dict(state)
            for i, a in zip(ids, params):
                np.copyto(tape._val[i], a)
        except BaseException:
            if old_state is not None:
                opt.load_state_dict(old_state)
            for i, a in zip(ids, old):
                np.copyto(tape._val[i], a)
            raise
    signals_held(copies)
