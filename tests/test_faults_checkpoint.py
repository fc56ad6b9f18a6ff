"""Checkpoint faults: corrupt, truncated, foreign and mismatched files, kills mid-save, old npz files.

Every unreadable file raises ``CheckpointError`` ("not a valid tapegrad checkpoint"); every file that
does not fit raises a ``TapeError`` naming the mismatch; in both cases the tape and the optimizer are
bit-for-bit unchanged. Nothing is ever unpickled.
"""
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import checkpoint as C

from fault_util import file_digest, leftovers, opt_state, raises_cleanly, tape_state

BAD = r"load: .* is not a valid tapegrad checkpoint: .*"


def model(dtype=np.float64, shapes=((3, 2), (2,))):
    rng = np.random.default_rng(0)
    tape = tg.Tape(dtype)
    ps = [tape.param(rng.standard_normal(s)) for s in shapes]
    opt = tg.Adam(0.1)
    for p in ps:
        opt.add(tape, p)
    m = tape.mark()
    loss = sum((p * p).sum() for p in ps)
    tape.backward(loss)
    opt.step()
    tape.reset_to(m)
    return tape, ps, opt


def snapshots(tape, opt):
    return (lambda: tape_state(tape)), (lambda: opt_state(opt))


def header_and_data(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def rewrite(path, header, data):
    """Write ``header`` and ``data`` as a file; the metadata's SHA-256 follows an edited ``tapegrad`` string,
    so the file's one fault is the edit."""
    meta = header.get("__metadata__", {})
    if "sha256" in meta and isinstance(meta.get("tapegrad"), str):
        sums = json.loads(meta["sha256"])
        sums["tapegrad"] = hashlib.sha256(meta["tapegrad"].encode()).hexdigest()
        meta["sha256"] = json.dumps(sums)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture
def saved(tmp_path):
    tape, ps, opt = model()
    path = str(tmp_path / "ck.safetensors")
    tg.save(path, tape, opt)
    return path


# ── the format ───────────────────────────────────────────────────────────────

def test_the_file_is_safetensors_with_named_tensors_and_json_metadata(saved):
    header, data = header_and_data(saved)
    meta = header.pop("__metadata__")
    assert meta["format"] == "tapegrad-checkpoint-2"
    inner = json.loads(meta["tapegrad"])
    assert inner["params"] == [[3, 2], [2]] and inner["optimizer"]["kind"] == "Adam" and inner["optimizer"]["count"] == 1
    assert sorted(header) == ["opt.mu.0", "opt.mu.1", "opt.nu.0", "opt.nu.1", "params.0", "params.1"]
    e = header["params.0"]
    assert e["dtype"] == "F64" and e["shape"] == [3, 2]
    tape, ps, _ = model()
    lo, hi = e["data_offsets"]
    assert np.frombuffer(data[lo:hi], "<f8").reshape(3, 2).tobytes() == np.asarray(tape.value(ps[0])).tobytes()
    with open(saved, "rb") as f:
        assert b"pickle" not in f.read()


def test_safetensors_package_reads_it_by_name(saved):
    st = pytest.importorskip("safetensors.numpy")
    tensors = st.load_file(saved)
    tape, ps, opt = model()
    assert np.array_equal(tensors["params.0"], tape.value(ps[0]))
    assert np.array_equal(tensors["opt.nu.1"], opt.nu[1])


def test_a_file_written_by_the_safetensors_package_loads(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tape, ps, opt = model()
    meta = {"dtype": "float64", "params": [[3, 2], [2]]}
    path = str(tmp_path / "ref.safetensors")
    st.save_file({"params.0": np.full((3, 2), 2.5), "params.1": np.array([1.0, -1.0])}, path,
                 metadata={"format": "tapegrad-checkpoint-2", "tapegrad": json.dumps(meta)})
    tg.load(path, tape)
    assert np.array_equal(tape.value(ps[0]), np.full((3, 2), 2.5)) and np.array_equal(tape.value(ps[1]), [1.0, -1.0])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_round_trip_restores_parameters_and_state_bit_for_bit(tmp_path, dtype):
    tape, ps, opt = model(dtype)
    path = str(tmp_path / "ck")
    tg.save(path, tape, opt)
    t2, p2, o2 = model(dtype, shapes=((3, 2), (2,)))
    for p in p2:
        np.copyto(t2._val[p.id], 0.0)
    tg.load(path, t2, o2)
    for a, b in zip(ps, p2):
        assert np.asarray(tape.value(a)).tobytes() == np.asarray(t2.value(b)).tobytes()
    assert o2.count == opt.count and all(np.array_equal(x, y) for x, y in zip(o2.nu, opt.nu))


def legacy_save(path, tape, opt):
    """The version-0.1 writer, verbatim in effect: npz of param_k / mu_k / nu_k plus JSON meta."""
    ids = [i for i, n in enumerate(tape._nodes) if n.op.name == "param"]
    arrays = {f"param_{k}": tape._val[i] for k, i in enumerate(ids)}
    meta = {"format": "tapegrad-checkpoint-1", "dtype": tape.dtype.name,
            "params": [list(tape._nodes[i].shape) for i in ids]}
    state = opt.state_dict()
    meta["optimizer"] = {**opt.config(), "count": state["count"], "param_nodes": [v.id for v in opt.params]}
    for key in ("mu", "nu"):
        for k, a in enumerate(state[key]):
            arrays[f"{key}_{k}"] = a
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)


def test_old_npz_checkpoints_still_load(tmp_path):
    tape, ps, opt = model()
    path = str(tmp_path / "old.npz")
    legacy_save(path, tape, opt)
    t2, p2, o2 = model(shapes=((3, 2), (2,)))
    for p in p2:
        np.copyto(t2._val[p.id], 0.0)
    o2.count = 0
    tg.load(path, t2, o2)
    assert all(np.array_equal(t2.value(b), tape.value(a)) for a, b in zip(ps, p2))
    assert o2.count == 1 and np.array_equal(o2.mu[0], opt.mu[0])


# ── unreadable files: CheckpointError, nothing changed ──────────────────────

def _truncate(n):
    def f(path):
        with open(path, "r+b") as fh:
            size = fh.seek(0, 2)
            fh.truncate(n if n >= 0 else size + n)
    return f


def _bytes(blob):
    def f(path):
        with open(path, "wb") as fh:
            fh.write(blob)
    return f


def _edit(fn):
    def f(path):
        header, data = header_and_data(path)
        fn(header)
        rewrite(path, header, data)
    return f


def _meta(fn):
    def g(header):
        inner = json.loads(header["__metadata__"]["tapegrad"])
        fn(inner)
        header["__metadata__"]["tapegrad"] = json.dumps(inner)
    return _edit(g)


def _relaid(fn):
    """``fn({name: [entry, bytes]})`` edits tensors (drops, retypes, shortens them); the file is then laid
    out again, contiguous, so that it stays a valid safetensors file and only the edit is wrong."""
    def f(path):
        header, data = header_and_data(path)
        meta = header.pop("__metadata__")
        tensors = {k: [e, data[e["data_offsets"][0]:e["data_offsets"][1]]] for k, e in header.items()}
        fn(tensors)
        header, chunks, off = {"__metadata__": meta}, [], 0
        for k, (e, b) in sorted(tensors.items(), key=lambda kv: kv[1][0]["data_offsets"]):
            header[k] = {**e, "data_offsets": [off, off + len(b)]}
            chunks.append(b)
            off += len(b)
        rewrite(path, header, b"".join(chunks))
    return f


def _retype(tensors, name, dtype, shape):
    """A tensor of 8 bytes: valid, of another dtype or shape than the metadata's."""
    entry, b = tensors[name]
    tensors[name] = [{**entry, "dtype": dtype, "shape": shape}, b[:8]]


CORRUPT = [
    ("empty", _bytes(b""), r"0 bytes, shorter than a safetensors header"),
    ("seven bytes", _bytes(b"\x01" * 7), r"7 bytes"),
    ("random bytes", _bytes(np.random.default_rng(1).bytes(4096)), r"header length \d+ exceeds the file|not JSON"),
    ("random bytes 2", _bytes(np.random.default_rng(2).bytes(100)), r"header length \d+ exceeds the file|not JSON"),
    ("text file", _bytes(b"hello world, not a checkpoint\n" * 10), r"header length \d+ exceeds the file"),
    ("truncated in the header", _truncate(20), r"header length \d+ exceeds the file"),
    ("truncated in the data", _truncate(-9), r"claims bytes .* truncated or corrupt"),
    ("last byte missing", _truncate(-1), r"truncated or corrupt"),
    ("header not JSON", _bytes(struct.pack("<Q", 4) + b"{{{{"), r"its header is not JSON"),
    ("header a list", _bytes(struct.pack("<Q", 2) + b"[]"), r"its header is not JSON \(not a JSON object\)"),
    ("header not utf-8", _bytes(struct.pack("<Q", 2) + b"\xff\xfe"), r"its header is not JSON"),
    ("no metadata", _edit(lambda h: h.pop("__metadata__")), r"expected metadata format 'tapegrad-checkpoint-2', got None"),
    ("another format", _edit(lambda h: h["__metadata__"].update(format="pt")), r"got 'pt'"),
    ("tapegrad meta missing", _edit(lambda h: h["__metadata__"].pop("tapegrad")), r"'tapegrad' metadata is missing or not JSON"),
    ("tapegrad meta garbled", _edit(lambda h: h["__metadata__"].update(tapegrad="{x")), r"'tapegrad' metadata is missing or not JSON"),
    ("meta without params", _meta(lambda m: m.pop("params")), r"metadata lacks or garbles"),
    ("meta with int16 dtype", _meta(lambda m: m.update(dtype="int16")), r"metadata lacks or garbles"),
    ("meta negative dim", _meta(lambda m: m.update(params=[[3, -2], [2]])), r"metadata lacks or garbles"),
    ("meta count a string", _meta(lambda m: m["optimizer"].update(count="3")), r"metadata lacks or garbles"),
    ("tensor missing", _relaid(lambda t: t.pop("params.1")), r"tensor params.1 is missing"),
    ("tensor int dtype", _edit(lambda h: h["params.1"].update(dtype="I64")), r"tensor 'params.1' has a malformed entry"),
    ("tensor F32 in a float64 file", _relaid(lambda t: _retype(t, "params.1", dtype="F32", shape=[2])),
     r"tensor params.1 is float32, the metadata says float64"),
    ("tensor shape differs from meta", _relaid(lambda t: _retype(t, "params.1", dtype="F64", shape=[1])),
     r"tensor params.1 has shape \(1,\), the metadata says \(2,\)"),
    ("offsets past the end", _edit(lambda h: h["params.0"].update(data_offsets=[10 ** 6, 10 ** 6 + 48])), r"claims bytes \[1000000"),
    ("offsets not ints", _edit(lambda h: h["params.0"].update(data_offsets=["a", 2])), r"malformed entry"),
    ("shape not a list", _edit(lambda h: h["params.0"].update(shape=3)), r"malformed entry"),
    ("optimizer state missing", _relaid(lambda t: t.pop("opt.nu.0")), r"tensor opt.nu.0 is missing"),
    ("negative count", _meta(lambda m: m["optimizer"].update(count=-1)), r"optimizer count -1 is negative"),
]


@pytest.mark.parametrize("case", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_an_unreadable_checkpoint_is_one_clear_error_and_changes_nothing(saved, case):
    _, damage, match = case
    damage(saved)
    tape, _, opt = model()
    raises_cleanly(tg.CheckpointError, BAD + match, lambda: tg.load(saved, tape, opt), *snapshots(tape, opt))


def _npz(tmp_path, **arrays):
    path = str(tmp_path / "x.npz")
    np.savez(path, **arrays)
    return path


NPZ = [
    ("truncated npz", lambda p: _truncate(-30)(p), r"an unreadable npz \((BadZipFile|EOFError|ValueError|OSError)"),
    ("pickled object inside", lambda p: np.savez(p, meta=np.array([{"a": 1}], dtype=object)),
     r"an unreadable npz \(ValueError: Object arrays cannot be loaded when allow_pickle=False"),
    ("meta not JSON", lambda p: np.savez(p, meta=np.array("{x")), r"an unreadable npz \(JSONDecodeError"),
    ("no meta", lambda p: np.savez(p, param_0=np.ones(2)), r"an unreadable npz \(KeyError"),
    ("wrong legacy format", lambda p: np.savez(p, meta=np.array(json.dumps({"format": "x"}))), r"an unreadable npz \(ValueError: format 'x'"),
]


@pytest.mark.parametrize("case", NPZ, ids=[c[0] for c in NPZ])
def test_an_unreadable_npz_is_one_clear_error_and_is_never_unpickled(tmp_path, case):
    _, make, match = case
    tape, ps, opt = model()
    path = str(tmp_path / "old.npz")
    legacy_save(path, tape, opt)
    make(path)
    raises_cleanly(tg.CheckpointError, BAD + match, lambda: tg.load(path, tape, opt), *snapshots(tape, opt))


def test_a_missing_file_or_a_folder_is_a_checkpoint_error(tmp_path):
    tape, _, opt = model()
    raises_cleanly(tg.CheckpointError, r"load: cannot read .*nope: No such file", lambda: tg.load(str(tmp_path / "nope"), tape),
                   *snapshots(tape, opt))
    raises_cleanly(tg.CheckpointError, r"load: cannot read .*: Is a directory", lambda: tg.load(str(tmp_path), tape),
                   *snapshots(tape, opt))


# ── files that do not fit the tape: TapeError, nothing changed ──────────────

def test_a_checkpoint_that_does_not_fit_changes_nothing(saved):
    t, _, opt = model(shapes=((3, 2), (3,)))
    raises_cleanly(tg.TapeError, r"load: parameter 1 \(node 1\) has shape \(3,\), the checkpoint \(2,\)",
                   lambda: tg.load(saved, t, opt), *snapshots(t, opt))
    t, _, opt = model(shapes=((3, 2),))
    raises_cleanly(tg.TapeError, r"load: the checkpoint holds 2 parameters, the tape has 1", lambda: tg.load(saved, t, opt),
                   *snapshots(t, opt))
    t, _, opt = model(np.float32)
    raises_cleanly(tg.TapeError, r"load: the checkpoint is float64, the tape float32", lambda: tg.load(saved, t, opt),
                   *snapshots(t, opt))
    t, ps, _ = model()
    sgd = tg.SGD(0.1)
    sgd.add(t, ps[0])
    raises_cleanly(tg.TapeError, r"load: expected SGD state in the checkpoint, got Adam", lambda: tg.load(saved, t, sgd),
                   *snapshots(t, sgd))
    t, ps, _ = model()
    half = tg.Adam(0.1)
    half.add(t, ps[1])
    raises_cleanly(tg.TapeError, r"load: the optimizer's parameters are nodes \[1\], the checkpoint's \[0, 1\]",
                   lambda: tg.load(saved, t, half), *snapshots(t, half))


def test_a_broadcastable_wrong_shape_is_refused_not_broadcast(tmp_path):
    t1 = tg.Tape()
    t1.param(np.array([7.0]))
    path = str(tmp_path / "one")
    tg.save(path, t1)
    t2 = tg.Tape()
    w = t2.param(np.zeros(2))
    raises_cleanly(tg.TapeError, r"load: parameter 0 \(node 0\) has shape \(2,\), the checkpoint \(1,\)",
                   lambda: tg.load(path, t2), lambda: tape_state(t2))
    assert np.array_equal(t2.value(w), [0.0, 0.0])


def test_state_saved_without_an_optimizer_is_refused_for_one(tmp_path):
    tape, ps, opt = model()
    path = str(tmp_path / "noopt")
    tg.save(path, tape)
    raises_cleanly(tg.TapeError, r"load: expected Adam state in the checkpoint, got None", lambda: tg.load(path, tape, opt),
                   *snapshots(tape, opt))


def test_saving_one_tape_with_another_tapes_optimizer_is_refused(tmp_path):
    ta, _, _ = model()
    _, _, opt_b = model()
    path = str(tmp_path / "ck")
    with pytest.raises(tg.ForeignVarError, match=r"save: the optimizer serves another tape than the one given"):
        tg.save(path, ta, opt_b)
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    with pytest.raises(tg.ForeignVarError, match=r"load: the optimizer serves another tape"):
        tg.save(path, ta)
        tg.load(path, ta, opt_b)


def test_an_optimizer_whose_parameters_were_reset_away_cannot_save_or_load(tmp_path):
    tape = tg.Tape()
    m = tape.mark()
    w = tape.param(np.ones(2))
    opt = tg.SGD(0.1)
    opt.add(tape, w)
    tape.reset_to(m)
    tape.param(np.zeros(3))          # another parameter in the dropped one's slot
    path = str(tmp_path / "ck")
    with pytest.raises(tg.ForeignVarError, match=r"save: the optimizer's parameter 0 \(node 0\) was dropped by reset_to"):
        tg.save(path, tape, opt)
    assert not os.path.exists(path)


def test_saving_into_a_missing_folder_names_the_path_not_a_temporary(tmp_path):
    tape, _, opt = model()
    target = str(tmp_path / "no" / "such" / "ck")
    with pytest.raises(tg.CheckpointError, match=r"save: cannot write .*/no/such/ck: the folder .* does not exist") as e:
        tg.save(target, tape, opt)
    assert ".tmp" not in str(e.value)


def test_a_failed_save_keeps_the_previous_file(saved, monkeypatch):
    before = file_digest(saved)
    tape, _, opt = model()
    tape._val[0][0, 0] = 123.0

    def full(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(C.os, "replace", full)
    with pytest.raises(tg.CheckpointError, match=r"save: cannot write .*ck.safetensors: No space left on device"):
        tg.save(saved, tape, opt)
    assert file_digest(saved) == before and leftovers(os.path.dirname(saved), ".tmp") == []


# ── kill -9 in the middle of saves ───────────────────────────────────────────

WRITER = r"""
import sys, numpy as np, tapegrad as tg
path = sys.argv[1]
tape = tg.Tape()
ps = [tape.param(np.zeros(200_000)) for _ in range(3)]
opt = tg.Adam(0.1)
for p in ps:
    opt.add(tape, p)
k = int(sys.argv[2])
while True:
    k += 1
    for p in ps:
        tape._val[p.id][...] = k
    opt.count = k
    tg.save(path, tape, opt)
    print("saved", flush=True)
"""


def test_kill_9_during_saves_always_leaves_a_loadable_checkpoint_and_no_temporaries(tmp_path):
    path = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    rng = np.random.default_rng(0)
    start = 0
    seen = set()
    for rnd in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(start)], env=env, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "saved"     # one new checkpoint at least, then saves go on
        time.sleep(rng.random() * 0.25)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        tape = tg.Tape()
        ps = [tape.param(np.full(200_000, -1.0)) for _ in range(3)]
        opt = tg.Adam(0.1)
        for p in ps:
            opt.add(tape, p)
        tg.load(path, tape, opt)       # the previous complete checkpoint, never a mix
        k = opt.count
        assert all(np.all(tape.value(p) == k) for p in ps) and k > start
        seen.add(k)
        start = k
        assert len(leftovers(tmp_path, ".tmp-")) <= 1   # each save sweeps its dead predecessors' temporaries
    assert len(seen) == 6
    tape = tg.Tape()
    tape.param(np.zeros(1))
    tg.save(str(tmp_path / "other"), tape)
    tg.save(path, tape)
    assert leftovers(tmp_path, ".tmp-") == []


def test_saving_over_a_folder_is_a_checkpoint_error_and_leaves_nothing(tmp_path):
    tape, _, opt = model()
    target = tmp_path / "ck"
    target.mkdir()
    with pytest.raises(tg.CheckpointError, match=r"save: cannot write .*ck: Is a directory"):
        tg.save(str(target), tape, opt)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and os.listdir(target) == []
