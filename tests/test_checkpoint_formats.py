"""Checkpoint reading at its edges, with whole messages naming the very file: a file of exactly the
8 length bytes, a header that ends exactly at the end of the file, tensors of zero elements, the legacy
npz reader's renaming, and an optimizer whose last-node parameter was reset away. No JAX."""
import errno
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import checkpoint as C


def refuses(cls, msg, fn):
    with pytest.raises(cls, match="^" + re.escape(msg) + "$"):
        fn()


def bad(path, why):
    return f"load: {path} is not a valid tapegrad checkpoint: {why}"


def write(path, blob):
    with open(path, "wb") as f:
        f.write(blob)
    return str(path)


def test_exactly_the_eight_length_bytes_is_a_header_of_zero_bytes(tmp_path):
    path = write(tmp_path / "eight", struct.pack("<Q", 0))
    refuses(tg.CheckpointError, bad(path, "its header is not JSON (Expecting value: line 1 column 1 (char 0))"),
            lambda: tg.load(path, tg.Tape()))
    path = write(tmp_path / "seven", b"\x00" * 7)
    refuses(tg.CheckpointError, bad(path, "7 bytes, shorter than a safetensors header"), lambda: tg.load(path, tg.Tape()))
    path = write(tmp_path / "claims-one", struct.pack("<Q", 1))
    refuses(tg.CheckpointError, bad(path, "header length 1 exceeds the file (8 bytes): truncated or not safetensors"),
            lambda: tg.load(path, tg.Tape()))


def test_a_header_that_ends_exactly_at_the_end_of_the_file_is_whole(tmp_path):
    path = str(tmp_path / "empty.safetensors")
    tg.save(path, tg.Tape())                      # no parameters: no data section at all
    with open(path, "rb") as f:
        blob = f.read()
    assert struct.unpack("<Q", blob[:8])[0] == len(blob) - 8
    meta, arrays = C.read(path)
    assert meta["params"] == [] and arrays == {}
    tg.load(path, tg.Tape())
    path2 = write(tmp_path / "short", blob[:-1])
    refuses(tg.CheckpointError, bad(path2, f"header length {len(blob) - 8} exceeds the file ({len(blob) - 1} bytes): "
                                           f"truncated or not safetensors"), lambda: tg.load(path2, tg.Tape()))


def test_tensors_with_zero_elements_round_trip(tmp_path):
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    tape.param(np.zeros((0, 3)))
    tape.param(np.array([1.5, -2.0]))
    tape.param(np.zeros((2, 0)))
    tg.save(path, tape)
    meta, arrays = C.read(path)
    assert meta["params"] == [[0, 3], [2], [2, 0]]
    assert arrays["params.0"].shape == (0, 3) and arrays["params.2"].shape == (2, 0)
    other = tg.Tape()
    ps = [other.param(np.zeros(s)) for s in ((0, 3), (2,), (2, 0))]
    tg.load(path, other)
    assert np.array_equal(other.value(ps[1]), [1.5, -2.0])


def resign(header):
    """The metadata's SHA-256 made to fit an edited ``tapegrad`` string: the file's one fault is the edit."""
    meta = header.get("__metadata__", {})
    if "sha256" in meta and isinstance(meta.get("tapegrad"), str):
        sums = json.loads(meta["sha256"])
        sums["tapegrad"] = hashlib.sha256(meta["tapegrad"].encode()).hexdigest()
        meta["sha256"] = json.dumps(sums)


def edit_header(path, fn):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    fn(header)
    resign(header)
    text = json.dumps(header).encode()
    write(path, struct.pack("<Q", len(text)) + text + blob[8 + n:])


def saved(tmp_path, opt=None):
    tape = tg.Tape()
    w = tape.param(np.array([[1.0, 2.0]]))
    b = tape.param(np.array([3.0]))
    if opt is not None:
        opt.add(tape, w)
        opt.add(tape, b)
    path = str(tmp_path / "ck.safetensors")
    tg.save(path, tape, opt)
    return path


@pytest.mark.parametrize("name, damage, why", [
    ("missing", lambda h: h.pop("params.1"),
     "invalid offsets: the tensors cover bytes [0, 16) of a 24-byte data section; the rest belongs to none: corrupt "
     "or appended to"),
    ("negative dim", lambda h: h["params.1"].update(shape=[-1]),
     "tensor 'params.1' has a malformed entry {'dtype': 'F64', 'shape': [-1], 'data_offsets': [16, 24]} "
     "(shape (-1,) / offsets (16, 24) are not non-negative ints)"),
    ("offset short", lambda h: h["params.1"].update(data_offsets=[16, 23]),
     "tensor 'params.1' (F64 [1]) claims bytes [16, 23) of a 24-byte data section: 7 bytes where its dtype and "
     "shape take 8; truncated or corrupt"),
    ("past the end", lambda h: h["params.1"].update(data_offsets=[24, 32]),
     "tensor 'params.1' (F64 [1]) claims bytes [24, 32) of a 24-byte data section: past its end; truncated or "
     "corrupt"),
    ("bool in a dim", lambda h: h["params.0"].update(shape=[1.0, 2]),
     "tensor 'params.0' has a malformed entry {'dtype': 'F64', 'shape': [1.0, 2], 'data_offsets': [0, 16]} "
     "(shape (1.0, 2) / offsets (0, 16) are not non-negative ints)"),
])
def test_a_malformed_tensor_entry_is_named_with_the_file(tmp_path, name, damage, why):
    path = saved(tmp_path)
    edit_header(path, damage)
    tape = tg.Tape()
    w, b = tape.param(np.zeros((1, 2))), tape.param(np.zeros(1))
    refuses(tg.CheckpointError, bad(path, why), lambda: tg.load(path, tape))
    assert np.array_equal(tape.value(w), np.zeros((1, 2))) and np.array_equal(tape.value(b), np.zeros(1))


def test_the_last_entry_may_end_exactly_at_the_end_of_the_data(tmp_path):
    path = saved(tmp_path)
    header_end = []
    edit_header(path, lambda h: header_end.append(h["params.1"]["data_offsets"]))
    assert header_end == [[16, 24]]
    tape = tg.Tape()
    tape.param(np.zeros((1, 2)))
    b = tape.param(np.zeros(1))
    tg.load(path, tape)
    assert tape.value(b).tolist() == [3.0]


def test_metadata_with_an_optimizer_entry_must_say_kind_count_and_nodes(tmp_path):
    path = saved(tmp_path, tg.SGD(0.1))

    def garble(key, value):
        def fn(h):
            inner = json.loads(h["__metadata__"]["tapegrad"])
            inner["optimizer"][key] = value
            h["__metadata__"]["tapegrad"] = json.dumps(inner)
        return fn
    for key, value in (("kind", 3), ("count", 1.0), ("param_nodes", "0,1"), ("count", None)):
        p = str(tmp_path / f"{key}-{value}.safetensors")
        with open(path, "rb") as f:
            write(p, f.read())
        edit_header(p, garble(key, value))
        refuses(tg.CheckpointError, bad(p, "its metadata lacks or garbles dtype / params / optimizer"),
                lambda: tg.load(p, tg.Tape()))
    p = str(tmp_path / "opt-list.safetensors")
    with open(path, "rb") as f:
        write(p, f.read())
    edit_header(p, lambda h: h["__metadata__"].update(tapegrad=json.dumps({"dtype": "float64", "params": [[1, 2], [1]],
                                                                          "optimizer": ["SGD"]})))
    refuses(tg.CheckpointError, bad(p, "its metadata lacks or garbles dtype / params / optimizer"),
            lambda: tg.load(p, tg.Tape()))


def legacy(path, arrays, meta):
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return str(path)


def test_the_legacy_reader_renames_every_tensor_and_checks_the_meta(tmp_path):
    meta = {"format": "tapegrad-checkpoint-1", "dtype": "float64", "params": [[2], [1]],
            "optimizer": {"kind": "Adam", "lr": 0.1, "count": 4, "param_nodes": [0, 1]}}
    arrays = {"param_0": np.array([1.0, 2.0]), "param_1": np.array([3.0]), "mu_0": np.array([0.5, 0.5]),
              "mu_1": np.array([0.25]), "nu_0": np.array([1.0, 1.0]), "nu_1": np.array([2.0])}
    path = legacy(tmp_path / "old.npz", arrays, meta)
    got_meta, got = C.read(path)
    assert got_meta == meta
    assert sorted(got) == ["opt.mu.0", "opt.mu.1", "opt.nu.0", "opt.nu.1", "params.0", "params.1"]
    assert all(np.array_equal(got[f"params.{k}"], arrays[f"param_{k}"]) for k in (0, 1))
    assert np.array_equal(got["opt.nu.1"], [2.0]) and np.array_equal(got["opt.mu.0"], [0.5, 0.5])
    tape = tg.Tape()
    a, b = tape.param(np.zeros(2)), tape.param(np.zeros(1))
    opt = tg.Adam(0.1)
    opt.add(tape, a)
    opt.add(tape, b)
    tg.load(path, tape, opt)
    assert tape.value(a).tolist() == [1.0, 2.0] and opt.count == 4 and opt.nu[1].tolist() == [2.0]
    for m, why in (({**meta, "format": "tapegrad-checkpoint-2"}, "ValueError: format 'tapegrad-checkpoint-2'"),
                   (["tapegrad-checkpoint-1"], "ValueError: format None")):
        p = legacy(tmp_path / "bad.npz", arrays, m)
        refuses(tg.CheckpointError, bad(p, f"an unreadable npz ({why})"), lambda: tg.load(p, tape, opt))
    p = legacy(tmp_path / "garbled.npz", arrays, {**meta, "params": [[2], [-1]]})
    refuses(tg.CheckpointError, bad(p, "its metadata lacks or garbles dtype / params / optimizer"),
            lambda: tg.load(p, tape, opt))
    p = legacy(tmp_path / "short.npz", {k: v for k, v in arrays.items() if k != "nu_1"}, meta)
    refuses(tg.CheckpointError, bad(p, "tensor opt.nu.1 is missing"), lambda: tg.load(p, tape, opt))
    assert tape.value(a).tolist() == [1.0, 2.0] and opt.count == 4


def test_the_tensor_checks_name_the_file(tmp_path):
    path = saved(tmp_path)
    edit_header(path, lambda h: h["params.1"].update(dtype="F32", shape=[2]))
    tape = tg.Tape()
    tape.param(np.zeros((1, 2)))
    tape.param(np.zeros(1))
    refuses(tg.CheckpointError, bad(path, "tensor params.1 is float32, the metadata says float64"),
            lambda: tg.load(path, tape))
    path = saved(tmp_path)
    edit_header(path, lambda h: h["params.0"].update(shape=[2, 1]))
    refuses(tg.CheckpointError, bad(path, "tensor params.0 has shape (2, 1), the metadata says (1, 2)"),
            lambda: tg.load(path, tape))


@pytest.mark.parametrize("who", ["save", "load"])
def test_an_optimizer_whose_last_node_parameter_was_reset_away(tmp_path, who):
    tape = tg.Tape()
    tape.param(np.ones(2))
    m = tape.mark()
    w = tape.param(np.ones(3))          # the tape's last node: after the reset its id == len(tape)
    opt = tg.SGD(0.1)
    opt.add(tape, w)
    tape.reset_to(m)
    assert w.id == len(tape)
    path = str(tmp_path / "ck.safetensors")
    tg.save(path, tape)                 # the surviving parameter, no optimizer
    fn = (lambda: tg.save(path, tape, opt)) if who == "save" else (lambda: tg.load(path, tape, opt))
    refuses(tg.ForeignVarError, f"{who}: the optimizer's parameter 0 (node 1) was dropped by reset_to; register "
                                f"parameters before the mark, or build a new optimizer", fn)


def test_a_length_with_the_top_bit_set_is_read_unsigned(tmp_path):
    path = write(tmp_path / "huge", b"\xff" * 8 + b"{}")
    refuses(tg.CheckpointError, bad(path, f"header length {2 ** 64 - 1} exceeds the file (10 bytes): truncated or not "
                                          f"safetensors"), lambda: tg.load(path, tg.Tape()))


@pytest.mark.parametrize("shapes", [[(1,)], [(3,), (2, 2)], [(5,), (1,), (7,)], []])
def test_the_data_section_starts_8_byte_aligned(tmp_path, shapes):
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    for k, s in enumerate(shapes):
        tape.param(np.ones(s), name="n" * (k + 3))       # header lengths of every residue mod 8
    tg.save(path, tape)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n % 8 == 0


def test_encode_writes_little_endian_data_whatever_the_arrays_byte_order():
    big = np.array([1.0, -2.5, 3.0], dtype=">f8")
    blob = C.encode([("x", big), ("y", np.array([0.5], dtype="<f4"))], {"k": "v"})
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    assert header["x"] == {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}
    assert header["y"] == {"dtype": "F32", "shape": [1], "data_offsets": [24, 28]}
    assert header["__metadata__"] == {"k": "v"}
    data = blob[8 + n:]
    assert data[:24] == np.array([1.0, -2.5, 3.0], "<f8").tobytes() and data[24:] == np.array([0.5], "<f4").tobytes()


def test_the_temporary_carries_the_target_name_and_the_writers_pid(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.safetensors")
    seen = []
    fsync = os.fsync

    def spy(fd):
        seen.append(sorted(os.listdir(tmp_path)))
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", spy)
    tape = tg.Tape()
    tape.param(np.ones(2))
    tg.save(path, tape)
    tmps = [n for n in seen[0] if n != "ck.safetensors"]
    assert len(tmps) == 1 and tmps[0].startswith(f".ck.safetensors.tmp-{os.getpid()}-")


def test_a_dead_writers_temporary_is_swept_by_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".ck.safetensors.tmp-{dead}-abc"
    other = tmp_path / f".other.tmp-{dead}-abc"
    stale.write_bytes(b"half a checkpoint")
    other.write_bytes(b"another file's temporary")
    tape = tg.Tape()
    tape.param(np.ones(2))
    tg.save(str(tmp_path / "ck.safetensors"), tape)
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-" + f"{dead}-abc", "ck.safetensors"]


def test_a_temporary_that_cannot_be_created_is_named_by_its_reason(tmp_path, monkeypatch):
    def refuse(**kw):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    tape.param(np.ones(2))
    refuses(tg.CheckpointError, f"save: cannot write {path}: Permission denied", lambda: tg.save(path, tape))
    assert os.listdir(tmp_path) == []


def test_an_extra_array_in_a_legacy_file_is_ignored(tmp_path):
    meta = {"format": "tapegrad-checkpoint-1", "dtype": "float64", "params": [[2]]}
    path = legacy(tmp_path / "old.npz", {"param_0": np.array([1.0, 2.0]), "extra_0": np.ones(3),
                                         "notes": np.ones(1)}, meta)
    _, got = C.read(path)
    assert sorted(got) == [".notes", "extra.0", "params.0"]
    tape = tg.Tape()
    a = tape.param(np.zeros(2))
    tg.load(path, tape)
    assert tape.value(a).tolist() == [1.0, 2.0]


def test_an_optimizer_that_never_stepped_round_trips(tmp_path):
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    w = tape.param(np.array([1.0, 2.0]))
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    tg.save(path, tape, opt)
    opt.count = 5
    opt.mu[0][...] = 1.0
    tg.load(path, tape, opt)
    assert opt.count == 0 and opt.mu[0].tolist() == [0.0, 0.0]


def test_names_are_checked_only_where_both_sides_have_one(tmp_path):
    path = str(tmp_path / "ck.safetensors")
    tape = tg.Tape()
    tape.param(np.ones(2), name="W")
    tape.param(np.full(3, 2.0))
    tape.param(np.full(1, 3.0), name="c")
    tg.save(path, tape)
    assert C.read(path)[0]["names"] == ["W", None, "c"]

    def target(*names):
        t = tg.Tape()
        ps = [t.param(np.zeros(s), **({"name": n} if n else {})) for s, n in zip(((2,), (3,), (1,)), names)]
        return t, ps
    for names in ((None, None, None), ("W", "b", None), ("W", "b", "c"), (None, "x", "c")):
        t, ps = target(*names)
        tg.load(path, t)
        assert [t.value(p).tolist() for p in ps] == [[1.0, 1.0], [2.0, 2.0, 2.0], [3.0]]
    t, ps = target("W", None, "d")
    refuses(tg.TapeError, "load: parameter 2 (node 2) is named 'd' on the tape, 'c' in the checkpoint",
            lambda: tg.load(path, t))
    assert [t.value(p).tolist() for p in ps] == [[0.0, 0.0], [0.0, 0.0, 0.0], [0.0]]


def test_metadata_errors_name_the_file(tmp_path):
    path = saved(tmp_path, tg.SGD(0.1))
    tape = tg.Tape()
    tape.param(np.zeros((1, 2)))
    tape.param(np.zeros(1))
    edit_header(path, lambda h: h["__metadata__"].update(format="tapegrad-checkpoint-9"))
    refuses(tg.CheckpointError, bad(path, "expected metadata format 'tapegrad-checkpoint-2', got "
                                          "'tapegrad-checkpoint-9'"), lambda: tg.load(path, tape))
    path = saved(tmp_path, tg.SGD(0.1))
    edit_header(path, lambda h: h["__metadata__"].pop("tapegrad"))
    refuses(tg.CheckpointError, bad(path, "its 'tapegrad' metadata is missing or not JSON (KeyError('tapegrad'))"),
            lambda: tg.load(path, tape))


def test_a_negative_optimizer_count_names_the_file(tmp_path):
    tape = tg.Tape()
    w = tape.param(np.array([[1.0, 2.0]]))
    b = tape.param(np.array([3.0]))
    opt = tg.SGD(0.1)
    opt.add(tape, w)
    opt.add(tape, b)
    path = str(tmp_path / "ck.safetensors")
    tg.save(path, tape, opt)

    def negative(h):
        inner = json.loads(h["__metadata__"]["tapegrad"])
        inner["optimizer"]["count"] = -2
        h["__metadata__"]["tapegrad"] = json.dumps(inner)
    edit_header(path, negative)
    refuses(tg.CheckpointError, bad(path, "optimizer count -2 is negative"), lambda: tg.load(path, tape, opt))
    assert opt.count == 0 and tape.value(b).tolist() == [3.0]
