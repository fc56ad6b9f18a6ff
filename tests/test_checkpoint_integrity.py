"""Checkpoints are verified on load: a damaged file is a CheckpointError naming the file and the fault, or
(where the damage changes nothing a load reads) an exact load, never anything else; and ``load`` is one
step, complete or not at all, even when Ctrl-C comes in the middle.

- every single-bit flip of a whole file, every truncation and header edits (swapped, overlapping, gapped,
  out-of-range offsets, as the ``safetensors`` library rejects them; seeded random edits of every number
  in the header): a CheckpointError that changed nothing, or an exact load;
- a step count out of range (10**400), a device (``/dev/zero``), a pipe and a sparse 1 GiB file: refused
  from their first bytes, without reading the rest;
- a KeyboardInterrupt raised at every Python call inside ``load``, a SIGINT sent there (held back while
  the copies run, then delivered), and SIGALRM timers: the tape and optimizer end exactly as before or
  exactly as the checkpoint, and the interrupt always reaches the caller.
"""
import hashlib
import json
import os
import signal
import struct
import sys
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import checkpoint as C

from fault_util import profiler

SHAPES = ((3,), (2, 2))


def model(seed, steps=1):
    """A tape with two parameters and an Adam that has stepped (count, mu and nu all non-trivial)."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape()
    ps = [tape.param(rng.standard_normal(s)) for s in SHAPES]
    opt = tg.Adam(0.1)
    for p in ps:
        opt.add(tape, p)
    m = tape.mark()
    for _ in range(steps):
        tape.backward(sum((p * p * p).sum() for p in ps))
        opt.step()
        tape.reset_to(m)
    return tape, ps, opt


def state(tape, ps, opt):
    return ([np.array(tape.value(p)).tobytes() for p in ps], opt.count,
            [a.tobytes() for a in opt.mu + opt.nu])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the checkpoint's bytes, the state it holds)."""
    path = str(tmp_path_factory.mktemp("ck") / "ck.safetensors")
    tape, ps, opt = model(0)
    tg.save(path, tape, opt)
    with open(path, "rb") as f:
        return f.read(), state(tape, ps, opt)


@pytest.fixture
def target():
    """A tape and optimizer of the same layout with other values, and their state."""
    tape, ps, opt = model(1, steps=3)
    return tape, ps, opt, state(tape, ps, opt)


def write(path, blob):
    with open(path, "wb") as f:
        f.write(blob)
    return str(path)


def split(blob):
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def join(header, data):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def outcome(path, tape, ps, opt, before, saved_state):
    """"error" (a CheckpointError naming the file, nothing changed) or "exact" (the checkpoint's state
    restored bit for bit); anything else fails the test."""
    try:
        tg.load(path, tape, opt)
    except tg.CheckpointError as e:
        assert str(e).startswith(f"load: {path} is not a valid tapegrad checkpoint: "), str(e)
        assert state(tape, ps, opt) == before, f"a failed load changed the state ({e})"
        return "error"
    assert state(tape, ps, opt) == saved_state, "a damaged file loaded other numbers"
    return "exact"


def restore(tape, ps, opt, before):
    for p, b in zip(ps, before[0]):
        np.copyto(tape._val[p.id], np.frombuffer(b, tape.dtype).reshape(p.shape))
    opt.load_state_dict({"count": before[1], "mu": [np.frombuffer(b, tape.dtype).reshape(p.shape) for p, b in
                                                   zip(ps, before[2][:2])],
                         "nu": [np.frombuffer(b, tape.dtype).reshape(p.shape) for p, b in zip(ps, before[2][2:])]})
    assert state(tape, ps, opt) == before


def test_every_single_bit_flip_is_an_error_or_an_exact_load(tmp_path, saved, target):
    blob, want = saved
    tape, ps, opt, before = target
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    path = write(tmp_path / "flipped.safetensors", blob)
    seen = {"error": 0, "exact": 0}
    fd = os.open(path, os.O_WRONLY)
    try:
        for i in range(len(blob)):
            for bit in range(8):
                os.pwrite(fd, bytes([blob[i] ^ 1 << bit]), i)     # the one byte flipped in place
                got = outcome(path, tape, ps, opt, before, want)
                seen[got] += 1
                if got == "exact":
                    assert i < header_end, f"a flip of data byte {i - header_end} loaded"
                    restore(tape, ps, opt, before)
            os.pwrite(fd, blob[i:i + 1], i)
    finally:
        os.close(fd)
    assert seen["error"] >= 8 * (len(blob) - header_end)     # every data flip, and most header flips


def test_the_reported_flip_names_the_tensor(tmp_path, target):
    tape = tg.Tape()
    tape.param(np.ones(3))
    path = str(tmp_path / "ones.safetensors")
    tg.save(path, tape)
    with open(path, "rb") as f:
        b = bytearray(f.read())
    b[-1] ^= 0x01                                          # was [1, 1, inf] when it loaded
    write(path, bytes(b))
    other = tg.Tape()
    w = other.param(np.zeros(3))
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, other)
    assert str(e.value) == (f"load: {path} is not a valid tapegrad checkpoint: tensor 'params.0': its 24 bytes do not "
                            f"match the SHA-256 saved with them: corrupt (a changed bit, or bytes moved)")
    assert other.value(w).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(tg.CheckpointError, match="tensor 'params.0': its 24 bytes do not match"):
        C.read(path)


def test_every_truncation_is_an_error(tmp_path, saved, target):
    blob, want = saved
    tape, ps, opt, before = target
    path = write(tmp_path / "short.safetensors", blob)
    for n in range(len(blob) - 1, -1, -1):
        os.truncate(path, n)
        assert outcome(path, tape, ps, opt, before, want) == "error", n


def offsets(header):
    return {k: e["data_offsets"] for k, e in header.items() if k != "__metadata__"}


def _set(header, name, lo, hi):
    header[name]["data_offsets"] = [lo, hi]


def swap(a, b):
    def f(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return f


# (name, edit of the header, what the message says, whether the safetensors library rejects it too)
EDITS = [
    ("swapped, same size", swap("params.0", "opt.mu.0"), "tensor 'params.0': its 24 bytes do not match the SHA-256", False),
    ("swapped, other sizes", swap("params.0", "params.1"), "claims bytes [24, 56) of a 168-byte data section: 32 bytes "
                                                           "where its dtype and shape take 24", True),
    ("overlapping", lambda h: _set(h, "params.1", 16, 48), "invalid offset: tensor 'params.1' starts at byte 16 and "
                                                           "overlaps the tensor before it (which ends at byte 24)", True),
    ("gap", lambda h: _set(h, "params.1", 32, 64), "invalid offset: tensor 'params.1' starts at byte 32 and leaves "
                                                   "bytes [24, 32) unclaimed", True),
    ("gap before the first", lambda h: [_set(h, k, lo + 8, hi + 8) for k, (lo, hi) in offsets(h).items()],
     "tensor 'opt.nu.1' (F64 [2, 2]) claims bytes [144, 176) of a 168-byte data section: past its end", True),
    ("all shifted, last cut", lambda h: [_set(h, k, lo + 8, hi + 8) for k, (lo, hi) in offsets(h).items()
                                         if k != "opt.nu.1"],
     "invalid offset: tensor 'params.0' starts at byte 8 and leaves bytes [0, 8) unclaimed", True),
    ("out of range", lambda h: _set(h, "opt.nu.1", 136, 2 ** 40),
     "claims bytes [136, 1099511627776) of a 168-byte data section: past its end", True),
    ("reversed", lambda h: _set(h, "params.0", 24, 0), "claims bytes [24, 0) of a 168-byte data section: -24 bytes", True),
    ("empty range", lambda h: _set(h, "params.0", 0, 0), "claims bytes [0, 0) of a 168-byte data section: 0 bytes where "
                                                         "its dtype and shape take 24", True),
    ("shape grown", lambda h: h["params.1"].update(shape=[2, 3]), "tensor 'params.1' (F64 [2, 3]) claims bytes [24, 56) "
                                                                  "of a 168-byte data section: 32 bytes where its dtype "
                                                                  "and shape take 48", True),
    ("a tensor dropped", lambda h: h.pop("opt.mu.0"), "invalid offset: tensor 'opt.mu.1' starts at byte 80 and leaves "
                                                      "bytes [56, 80) unclaimed", True),
    ("a tensor added", lambda h: h.update(extra={"dtype": "F64", "shape": [1], "data_offsets": [160, 168]}),
     "invalid offset: tensor 'extra' starts at byte 160 and overlaps the tensor before it (which ends at byte 168)",
     True),
]


@pytest.mark.parametrize("name, edit, why, library_rejects", EDITS, ids=[e[0] for e in EDITS])
def test_header_edits_are_refused_as_the_safetensors_library_refuses_them(tmp_path, saved, target, name, edit, why,
                                                                          library_rejects):
    blob, want = saved
    tape, ps, opt, before = target
    header, data = split(blob)
    assert offsets(header) == {"params.0": [0, 24], "params.1": [24, 56], "opt.mu.0": [56, 80],
                               "opt.mu.1": [80, 112], "opt.nu.0": [112, 136], "opt.nu.1": [136, 168]}
    edit(header)
    path = write(tmp_path / "edited.safetensors", join(header, data))
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, tape, opt)
    assert why in str(e.value), str(e.value)
    assert state(tape, ps, opt) == before
    st = pytest.importorskip("safetensors.numpy")
    if library_rejects:
        with pytest.raises(Exception):
            st.load_file(path)
    else:   # well-formed for the library: only the checksum tells the tensors apart
        st.load_file(path)


def test_seeded_random_header_edits_are_errors_or_exact_loads(tmp_path, saved, target):
    """Every number of every tensor entry moved by a small amount, a power of two or to another entry's."""
    blob, want = saved
    tape, ps, opt, before = target
    header, data = split(blob)
    rng = np.random.default_rng(25)
    names = [k for k in header if k != "__metadata__"]
    path = str(tmp_path / "fuzz.safetensors")
    seen = {"error": 0, "exact": 0}
    for _ in range(400):
        h = json.loads(json.dumps(header))
        for _ in range(rng.integers(1, 3)):
            e = h[names[rng.integers(len(names))]]
            field = ("data_offsets", "shape")[rng.integers(2)]
            if not e[field]:
                continue
            k = rng.integers(len(e[field]))
            e[field][k] = int(max(0, e[field][k] + rng.choice([-8, -1, 1, 8, 16, 24, 2 ** 20])))
        got = outcome(write(path, join(h, data)), tape, ps, opt, before, want)
        seen[got] += 1
        if got == "exact":
            restore(tape, ps, opt, before)
    assert seen["error"] > 350


def test_a_file_without_checksums_loads_with_every_other_check(tmp_path, saved, target):
    """Files written before the checksums carry no ``sha256`` entry: they load; their structure is checked."""
    blob, want = saved
    tape, ps, opt, before = target
    header, data = split(blob)
    header["__metadata__"].pop("sha256")
    path = write(tmp_path / "old.safetensors", join(header, data))
    assert outcome(path, tape, ps, opt, before, want) == "exact"
    restore(tape, ps, opt, before)
    swap("params.0", "params.1")(header)
    path = write(tmp_path / "old-bad.safetensors", join(header, data))
    assert outcome(path, tape, ps, opt, before, want) == "error"


def test_garbled_checksums_are_refused(tmp_path, saved, target):
    blob, want = saved
    tape, ps, opt, before = target
    for garble in ('{"tapegrad": "00"}', "[]", "not json", json.dumps({"params.0": "0" * 64})):
        header, data = split(blob)
        header["__metadata__"]["sha256"] = garble
        path = write(tmp_path / "sums.safetensors", join(header, data))
        with pytest.raises(tg.CheckpointError, match="its 'sha256' metadata is not a SHA-256 per tensor and one for "
                                                     "'tapegrad': corrupt$"):
            tg.load(path, tape, opt)
    header, data = split(blob)
    sums = json.loads(header["__metadata__"]["sha256"])
    del sums["opt.nu.1"]
    header["__metadata__"]["sha256"] = json.dumps(sums)
    path = write(tmp_path / "sums.safetensors", join(header, data))
    with pytest.raises(tg.CheckpointError, match="tensor 'opt.nu.1' has no SHA-256 among the checksums"):
        tg.load(path, tape, opt)
    assert state(tape, ps, opt) == before


def with_count(blob, count):
    """The checkpoint with another step count, its metadata checksum made to fit (a consistent file)."""
    header, data = split(blob)
    meta = header["__metadata__"]
    inner = json.loads(meta["tapegrad"])
    inner["optimizer"]["count"] = count
    meta["tapegrad"] = json.dumps(inner)
    sums = json.loads(meta["sha256"])
    sums["tapegrad"] = hashlib.sha256(meta["tapegrad"].encode()).hexdigest()
    meta["sha256"] = json.dumps(sums)
    return join(header, data)


@pytest.mark.parametrize("count, shown", [(10 ** 400, "of 401 digits"), (2 ** 53 + 1, str(2 ** 53 + 1))],
                         ids=["10**400", "2**53+1"])
def test_a_step_count_out_of_range_is_refused_at_load(tmp_path, saved, target, count, shown):
    blob, want = saved
    tape, ps, opt, before = target
    path = write(tmp_path / "count.safetensors", with_count(blob, count))
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, tape, opt)
    assert str(e.value) == (f"load: {path} is not a valid tapegrad checkpoint: optimizer count {shown} is out of "
                            f"range: at most 2**53 steps, the largest count a double (the native step counter) holds "
                            f"exactly")
    assert state(tape, ps, opt) == before


def test_the_largest_count_loads_and_steps(tmp_path, saved, target):
    blob, want = saved
    tape, ps, opt, before = target
    tg.load(write(tmp_path / "count.safetensors", with_count(blob, 2 ** 53)), tape, opt)
    assert opt.count == 2 ** 53
    tape.backward(sum((p * p).sum() for p in ps))
    opt.step()
    assert all(np.isfinite(tape.value(p)).all() for p in ps)


class Reads:
    """A spy on the bytes ``load`` reads from its file."""
    def __init__(self, monkeypatch):
        self.total = 0
        real = open

        def spy(path, mode="r", *a, **kw):
            f = real(path, mode, *a, **kw)
            read = f.read

            def counted(n=-1):
                out = read(n)
                self.total += len(out)
                return out
            f.read = counted
            return f
        monkeypatch.setattr(C, "open", spy, raising=False)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_is_refused_without_reading_it(monkeypatch):
    reads = Reads(monkeypatch)
    with pytest.raises(tg.CheckpointError, match=r"^load: /dev/zero is not a valid tapegrad checkpoint: it is a "
                                                 r"character device, not a file; save and load checkpoints as "
                                                 r"regular files$"):
        tg.load("/dev/zero", tg.Tape())
    assert reads.total == 0


def test_a_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    with pytest.raises(tg.CheckpointError, match=r"it is a pipe, not a file"):
        tg.load(path, tg.Tape())


@pytest.mark.parametrize("head, why", [
    (b"", r"its header is not JSON"),                                  # 8 zero bytes: a header of length 0
    (struct.pack("<Q", 200 << 20), r"header length 209715200 exceeds safetensors' limit of 104857600 bytes"),
    (struct.pack("<Q", 1 << 40), r"header length 1099511627776 exceeds the file \(1073741824 bytes\)"),
], ids=["zeros", "header over the limit", "header past the end"])
def test_a_huge_file_is_judged_by_its_first_bytes(tmp_path, monkeypatch, head, why):
    path = str(tmp_path / "huge")
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(1 << 30)                  # sparse: 1 GiB of zeros that take no disk
    reads = Reads(monkeypatch)
    with pytest.raises(tg.CheckpointError, match=why):
        tg.load(path, tg.Tape())
    assert reads.total <= 8


# ── interrupts ───────────────────────────────────────────────────────────────

def interrupted_load(path, tape, opt, k, action):
    """``tg.load`` with ``action`` at the k-th event: None if load returned, else the exception's type."""
    sys.setprofile(profiler(k, action))
    try:
        tg.load(path, tape, opt)
    except BaseException as e:
        return type(e)
    finally:
        sys.setprofile(None)
    return None


def raise_ctrl_c():
    raise KeyboardInterrupt


@pytest.fixture
def default_sigint():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def ctrl_c_still_interrupts():
    """A SIGINT now raises KeyboardInterrupt, and leaves Python's own handler installed."""
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):
            pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def every_interrupt(path, want, action, after_each=None):
    """Load ``path`` with ``action`` at the k-th event, k = 1, 2, … until a load runs past the last one:
    each interrupted load must raise KeyboardInterrupt and leave the model as before or as the
    checkpoint. Returns how often each; ``after_each(tape, ps, opt)`` runs after every interruption."""
    k, outcomes = 0, {"nothing": 0, "all": 0}
    while True:
        k += 1
        tape, ps, opt = model(1, steps=3)
        before = state(tape, ps, opt)
        got = interrupted_load(path, tape, opt, k, action)
        if got is None:          # past the last event: the load finished before the interrupt
            assert state(tape, ps, opt) == want
            return outcomes
        assert got is KeyboardInterrupt, got
        now = state(tape, ps, opt)
        assert now in (before, want), f"an interrupt at event {k} left a half-restored model"
        outcomes["nothing" if now == before else "all"] += 1    # all: raised after the copies were done
        if after_each is not None:
            after_each(tape, ps, opt)


def test_an_interrupt_anywhere_in_load_leaves_all_or_nothing(tmp_path, saved, default_sigint):
    blob, want = saved
    path = write(tmp_path / "ck.safetensors", blob)

    def then(tape, ps, opt):
        ctrl_c_still_interrupts()
        tg.load(path, tape, opt)                                    # and the next load works
        assert state(tape, ps, opt) == want
    outcomes = every_interrupt(path, want, raise_ctrl_c, then)
    assert outcomes["nothing"] > 100, outcomes


def test_ctrl_c_during_the_copies_is_held_back_and_then_delivered(tmp_path, saved, default_sigint):
    """A real SIGINT at every event: before the copies it interrupts the load (nothing changed), during
    them it waits until they are done; either way it reaches the caller, never lost."""
    blob, want = saved
    path = write(tmp_path / "ck.safetensors", blob)
    outcomes = every_interrupt(path, want, lambda: signal.raise_signal(signal.SIGINT))
    assert outcomes["nothing"] > 50 and outcomes["all"] > 5, outcomes
    ctrl_c_still_interrupts()


def test_an_alarm_during_load_leaves_all_or_nothing(tmp_path, default_sigint):
    """The reported probe: SIGALRM raising KeyboardInterrupt at random moments of loading a checkpoint of
    ten parameters (then an interrupt at the second copy gave the checkpoint's count with old values)."""
    rng = np.random.default_rng(7)
    tape = tg.Tape()
    ps = [tape.param(rng.standard_normal(20_000)) for _ in range(10)]
    opt = tg.Adam(0.1)
    for p in ps:
        opt.add(tape, p)
    tape.backward(sum((p * p).sum() for p in ps))
    opt.step()
    path = str(tmp_path / "ten.safetensors")
    tg.save(path, tape, opt)
    want = state(tape, ps, opt)

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        for _ in range(20):
            opt.count = 0
            for p in ps:
                np.copyto(tape._val[p.id], 0.0)
            for a in opt.mu + opt.nu:
                a[...] = 0.0
            before = state(tape, ps, opt)
            done = False
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 3e-3))
            try:
                tg.load(path, tape, opt)
                done = True
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                pass
            assert state(tape, ps, opt) in ((want,) if done else (before, want))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_load_on_another_thread_restores_everything(tmp_path, saved):
    """Off the main thread Ctrl-C cannot be held back (Python delivers it to the main thread anyway)."""
    blob, want = saved
    path = write(tmp_path / "ck.safetensors", blob)
    tape, ps, opt = model(1, steps=3)
    errors = []
    t = threading.Thread(target=lambda: errors.append(None) if tg.load(path, tape, opt) is None else None)
    t.start()
    t.join()
    assert errors == [None] and state(tape, ps, opt) == want
