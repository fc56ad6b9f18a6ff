"""Helpers of the bad-input and fault suites: snapshots that prove a failing call changed nothing."""
import hashlib
import os
import re
import sys

import numpy as np
import pytest


def tape_state(tape):
    """Everything observable about a tape: nodes (without source lines), values, gradients, flags."""
    nodes = [(n.op.name, n.a, n.b, repr(n.s), n.req, n.epoch, n.lazy, n.shape) for n in tape._nodes]
    vals = [None if v is None else np.array(v) for v in tape._val]
    grads = [None if g is None else np.array(g) for g in tape._grad]
    return (nodes, vals, grads, list(tape._gpass), tape._pass, tape._epoch, tape.ok)


def same(a, b):
    """Deep equality of snapshots (arrays bit for bit, NaN == NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def program_state(prog):
    st = [np.array(v) for v in prog.val] + [None if g is None else np.array(g) for g in prog.grads]
    if prog.opt is not None:
        st += [np.array(m) for m in prog.opt.mu + prog.opt.nu] + [prog.opt.count]
    return st + [sorted(prog.missing)]


def opt_state(opt):
    return [opt.count] + [np.array(a) for key in ("mu", "nu")[:opt.moments] for a in opt._state(key)] \
        if opt.params else [opt.count]


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def raises_cleanly(exc, match, fn, *snapshots):
    """``fn()`` raises ``exc`` whose message matches ``match``, and every ``(take, before)`` snapshot is
    unchanged afterwards. Returns the message."""
    befores = [take() for take in snapshots]
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert re.search(match, msg), f"message {msg!r} does not match {match!r}"
    for take, before in zip(snapshots, befores):
        assert same(take(), before), f"state changed by a failing call ({msg})"
    return msg


def leftovers(folder, *patterns):
    return sorted(f for f in os.listdir(folder) if any(p in f for p in patterns))


def profiler(k, action):
    """A profiler running ``action()`` at the k-th Python call or return inside the profiled call (then
    removing itself); the profiled call's own return excepted (raised there, the call has done its work)."""
    seen, top = [0], []

    def prof(frame, event, arg):
        if not top and event == "call":
            top.append(frame)
        if event == "call" or event == "return" and frame is not top[0]:
            seen[0] += 1
            if seen[0] == k:
                sys.setprofile(None)
                action()
    return prof


# ── the build cache (tests/test_faults_build.py, tests/test_cache_identity.py) ──

SRC = "int tg_probe(void) { return 42; }\n"   # a library with one probe symbol


@pytest.fixture(name="cache")
def build_cache(tmp_path, monkeypatch):
    """An empty build cache of the test's own (``$TAPEGRAD_CACHE``), as a path."""
    from tapegrad.native import build
    d = tmp_path / "cache"
    monkeypatch.setenv(build.ENV, str(d))
    return d
