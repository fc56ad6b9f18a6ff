"""Every file ``tg.load`` cannot read raises ``CheckpointError``, small hostile files included, with memory
bounded by a small multiple of the file's size; and a legal file name of 252 bytes saves and loads.

Before: a deeply nested header, metadata or checksum table raised ``RecursionError``; a zero-size
tensor of huge dims or 100 dims NumPy's ``ValueError``; a file of a million empty tensors took about
20x its size in memory (a ``MemoryError`` under a limit); a 252-byte name failed with "File name too
long" (the temporary's name is longer)."""
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

import tapegrad as tg

W = np.arange(3.0)
META = {"dtype": "float64", "params": [[3]], "names": [None]}


def write(path, entries, data, meta=None, sums=None):
    """A safetensors file: ``entries`` ({name: entry}) after the metadata, then ``data``."""
    md = {"format": "tapegrad-checkpoint-2", "tapegrad": json.dumps(META) if meta is None else meta}
    if sums is not None:
        md["sha256"] = sums
    text = json.dumps({"__metadata__": md, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def raw(path, header_text, data=b""):
    text = header_text.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


PARAM = {"params.0": {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}}


def fresh():
    tape = tg.Tape()
    return tape, tape.param(np.full(3, 7.0))


def refused(path, why):
    tape, w = fresh()
    with pytest.raises(tg.CheckpointError, match=rf"^load: {re.escape(path)} is not a valid tapegrad checkpoint: {why}"):
        tg.load(path, tape)
    assert np.array_equal(tape.value(w), np.full(3, 7.0))


DEEP = 100_000


def test_a_deeply_nested_header_entry_or_metadata_is_a_checkpoint_error(tmp_path):
    nest = "[" * DEEP + "]" * DEEP
    meta = json.dumps(json.dumps(META))
    refused(raw(tmp_path / "entry.st", '{"__metadata__":{"format":"tapegrad-checkpoint-2","tapegrad":' + meta +
                '},"params.0":{"dtype":"F64","shape":' + nest + ',"data_offsets":[0,24]}}', W.tobytes()),
            r"its header nests too deeply to be a checkpoint's: corrupt or hostile$")
    refused(raw(tmp_path / "meta.st", '{"__metadata__":{"format":"tapegrad-checkpoint-2","x":' + nest + '}}'),
            r"its header nests too deeply")
    refused(write(tmp_path / "inner.st", PARAM, W.tobytes(), meta='{"params":' + nest + '}'),
            r"its 'tapegrad' metadata nests too deeply to be a checkpoint's: corrupt or hostile$")
    refused(write(tmp_path / "sums.st", PARAM, W.tobytes(), sums='{"tapegrad":' + nest + '}'),
            r"its 'sha256' metadata is not a SHA-256 per tensor and one for 'tapegrad': corrupt$")


def test_an_error_about_a_huge_entry_shows_a_bounded_part_of_it(tmp_path):
    entry = {"dtype": "F64", "shape": [[[[[[1]]]]]] + [3] * 100_000, "data_offsets": [0, 24]}
    path = write(tmp_path / "wide.st", {"params.0": entry}, W.tobytes())
    tape, _ = fresh()
    with pytest.raises(tg.CheckpointError, match=r"tensor 'params.0' has a malformed entry \{'dtype': 'F64', 'shape': "
                                                 r"\[\[\[\[...\]\]\], 3, 3, 3, 3, 3, 3, 3, 3, 3, ...\], 'data_offsets': "
                                                 r"\[0, 24\]\} \(shape ") as e:
        tg.load(path, tape)
    assert len(str(e.value)) < 800


@pytest.mark.parametrize("shape", [[0, 2 ** 62, 2 ** 62], [0] * 100, [0, 2 ** 63]],
                         ids=["huge dims", "100 dims", "a dim past int64"])
def test_a_zero_size_tensor_numpy_cannot_hold_is_a_checkpoint_error(tmp_path, shape):
    meta = json.dumps({**META, "params": [shape]})
    path = write(tmp_path / "z.st", {"params.0": {"dtype": "F64", "shape": shape, "data_offsets": [0, 0]}}, b"", meta)
    refused(path, r"tensor 'params.0' has shape \[0, .*\], which NumPy cannot hold \(.+\)$")


MAKE = r"""
import hashlib, json, struct, sys
import numpy as np
n, path, sums = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "sums"
meta = json.dumps({"dtype": "float64", "params": [[3]], "names": [None]})
md = {"format": "tapegrad-checkpoint-2", "tapegrad": meta}
if sums:
    table = {"tapegrad": hashlib.sha256(meta.encode()).hexdigest(),
             "params.0": hashlib.sha256(np.arange(3.0).tobytes()).hexdigest()}
    table.update((f"t{k}", hashlib.sha256(b"").hexdigest()) for k in range(n))
    md["sha256"] = json.dumps(table)
header = {"__metadata__": md}
header.update((f"t{k}", {"dtype": "F64", "shape": [0], "data_offsets": [0, 0]}) for k in range(n))
header["params.0"] = {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + np.arange(3.0).tobytes())
"""

LOAD = r"""
import os, resource, sys
import numpy as np, tapegrad as tg
tape = tg.Tape(); w = tape.param(np.zeros(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
tg.load(sys.argv[1], tape)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(tape.value(w).tolist(), os.path.getsize(sys.argv[1]), peak - before)
"""


@pytest.mark.parametrize("sums,n", [("no sums", 1_000_000), ("sums", 500_000)])   # (safetensors' 100 MB header)
def test_a_million_empty_tensors_load_in_a_small_multiple_of_the_files_size(tmp_path, sums, n):
    """(The file holds the tensors a tape has, and a million empty ones beside them: it loads.) The
    growth of the process's peak memory is measured in a fresh interpreter."""
    path, env = str(tmp_path / "m.st"), {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", MAKE, str(n), path, sums], check=True, timeout=600)
    r = subprocess.run([sys.executable, "-c", LOAD, path], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    values, rest = r.stdout.split("] ")
    size, grew = map(int, rest.split())
    assert values + "]" == "[0.0, 1.0, 2.0]"
    assert size > 30e6 and grew <= 6 * size, f"peak memory grew by {grew / size:.1f}x the file's {size} bytes"


def test_a_legal_252_byte_file_name_saves_and_loads(tmp_path):
    name = "c" * 240 + ".safetensors"
    assert len(name.encode()) == 252
    path = str(tmp_path / name)
    tape = tg.Tape()
    w = tape.param(W)
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    tg.save(path, tape, opt)
    tg.save(path, tape, opt)     # over the first: the temporary is renamed over it
    assert os.listdir(tmp_path) == [name]
    t2, w2 = fresh()
    tg.load(path, t2)
    assert np.array_equal(t2.value(w2), W)


def test_a_dead_writers_temporary_of_a_long_name_is_swept(tmp_path):
    from tapegrad._files import temporary_stem
    name = "d" * 252
    stem = temporary_stem(str(tmp_path), name)
    assert len(stem) + len(".tmp-4194304-abcdefgh") <= 255 and stem != temporary_stem(str(tmp_path), "e" * 252)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"{stem}.tmp-{dead}-abcdefgh").write_bytes(b"half")
    tape = tg.Tape()
    tape.param(W)
    tg.save(str(tmp_path / name), tape)
    assert os.listdir(tmp_path) == [name]
