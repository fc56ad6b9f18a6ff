"""Checkpoint reading at its edges, with whole messages naming the very file: a file of exactly the
8 length bytes, a header that ends exactly at the end of the file, tensors of zero elements, the legacy
npz reader's renaming, and an optimizer whose last-node parameter was reset away. No JAX."""
import json
import re
import struct

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


def edit_header(path, fn):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    fn(header)
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
    ("missing", lambda h: h.pop("params.1"), "tensor params.1 is missing"),
    ("negative dim", lambda h: h["params.1"].update(shape=[-1]),
     "tensor 'params.1' has a malformed entry {'dtype': 'F64', 'shape': [-1], 'data_offsets': [16, 24]} "
     "(shape (-1,) / offsets (16, 24) are not non-negative ints)"),
    ("offset short", lambda h: h["params.1"].update(data_offsets=[16, 23]),
     "tensor 'params.1' (F64 [1]) claims bytes [16, 23) of a 24-byte data section: truncated or corrupt"),
    ("past the end", lambda h: h["params.1"].update(data_offsets=[24, 32]),
     "tensor 'params.1' (F64 [1]) claims bytes [24, 32) of a 24-byte data section: truncated or corrupt"),
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
