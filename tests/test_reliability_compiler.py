"""The compiler under a bound: every call of it (the ``--version`` probe too) is killed with its children
after ``$TAPEGRAD_CC_TIMEOUT``; its output is read without waiting on helpers it leaves running; a crash
on a huge program says how big the program is and what to do instead. Compilers here are shell scripts
(as in tests/test_faults_build.py); each helper they start writes its pid, so the test can see whether
it still runs, and stops it."""
import os
import re
import signal
import stat
import time

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build

from fault_util import SRC, build_cache  # noqa: F401 (build_cache: the cache fixture)

REAL_CC = build.find_compiler()


def script(tmp_path, text, name="fakecc"):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def running(pid):
    """Whether ``pid`` runs (a zombie waiting for a parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def helper_pid(path, wait=5.0):
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().strip():
            return int(open(path).read())
        time.sleep(0.02)
    raise AssertionError(f"no pid in {path}")


def test_the_version_probe_is_bounded_by_the_timeout_and_killed_with_its_children(cache, tmp_path, monkeypatch):
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("CC", script(tmp_path, f'sleep 120 & echo $! > "{pidfile}"; wait'))   # hangs even on --version
    monkeypatch.setenv(build.TIMEOUT_ENV, "2")
    t0 = time.monotonic()
    with pytest.raises(tg.BuildError, match=r"^native backend: the C compiler \S+fakecc did not answer --version within "
                                            r"2 s \(\$TAPEGRAD_CC_TIMEOUT, at most 30 s for this probe\); it was killed "
                                            r"with its children; is it hung"):
        build.build(SRC, "probe")
    took = time.monotonic() - t0
    child = helper_pid(pidfile)
    try:
        assert took < 10, took
        deadline = time.monotonic() + 5
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the probe's child was left running"
    finally:
        stop(child)


def test_a_hung_compile_is_killed_with_its_children(cache, tmp_path, monkeypatch):
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("CC", script(tmp_path, 'if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi\n'
                                              f'sleep 120 & echo $! > "{pidfile}"; wait'))
    monkeypatch.setenv(build.TIMEOUT_ENV, "2")
    with pytest.raises(tg.BuildError, match=r"fakecc did not finish within 2 s \(\$TAPEGRAD_CC_TIMEOUT\); it was killed "
                                            r"with its children \(the generated source: \d+ lines, 0\.0 MB\)"):
        build.build(SRC, "probe")
    child = helper_pid(pidfile)
    try:
        deadline = time.monotonic() + 5
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child)
    finally:
        stop(child)


def test_a_detached_helper_holding_the_compilers_stderr_does_not_hold_up_the_build(cache, tmp_path, monkeypatch):
    """A compiler that exits at once but leaves a helper (a compile server, setsid'd out of its process
    group) with its stdout and stderr open: a pipe reaches end-of-file only when the helper exits."""
    pidfile = tmp_path / "helper.pid"
    real = f'{REAL_CC} {" ".join(build.quirks(REAL_CC))}'
    monkeypatch.setenv("CC", script(tmp_path, 'if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi\n'
                                              f'setsid sh -c \'echo $$ > "{pidfile}"; exec sleep 60\' &\n'
                                              f'exec {real} "$@"'))
    t0 = time.monotonic()
    try:
        path = build.build(SRC, "probe")
        took = time.monotonic() - t0
        assert build.load(path).tg_probe() == 42
        assert took < 30, f"the build waited {took:.1f} s for the helper"
        assert running(helper_pid(pidfile))   # the helper is the compiler's business: left alone
    finally:
        stop(helper_pid(pidfile))


ICE = ('echo "src.c: In function \'tg_backward\':" >&2\n'
       'echo "src.c:91234:1: internal compiler error: Segmentation fault" >&2\n'
       'echo "Please submit a full bug report, with preprocessed source." >&2\n')


@pytest.mark.parametrize("how", ["internal compiler error", "killed by a signal"])
def test_a_compiler_crash_on_a_big_program_says_its_size_and_what_to_do(cache, tmp_path, monkeypatch, how):
    body = ICE + "exit 4" if how == "internal compiler error" else "kill -SEGV $$"
    monkeypatch.setenv("CC", script(tmp_path, 'if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi\n' + body))
    t = tg.Tape()
    w = t.param(np.linspace(0.1, 1.0, 8))
    y = w
    for _ in range(2000):
        y = (y * 1.0001).tanh()
    loss = y.sum()
    status = "exit 4" if how == "internal compiler error" else "signal 11"
    with pytest.raises(tg.BuildError) as e:
        tg.capture(t, loss, backend="native")
    msg = str(e.value)
    assert re.match(rf"native backend: fakecc crashed \({status}\) on generated source \S+\.failed\.c \(the generated "
                    rf"source: [\d,]+ lines, \d+\.\d MB, a program of {len(t.nodes):,} nodes\)\. Compilers can crash or run out "
                    r"of memory on very large functions: capture with backend=\"numpy\" \(the same program, no "
                    r"compiler\), or capture a smaller program \(fewer steps or layers per episode\)\. ", msg), msg
    if how == "internal compiler error":
        assert msg.endswith("The compiler said:\nsrc.c: In function 'tg_backward':\nsrc.c:91234:1: internal compiler "
                            "error: Segmentation fault\nPlease submit a full bug report, with preprocessed source.\n")
    else:
        assert msg.endswith(" It said nothing.")
    p = tg.capture(t, loss, backend="numpy")    # what the message offers works
    assert np.isfinite(p.forward())
