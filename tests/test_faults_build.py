"""Build-cache faults: missing, failing, hanging and silent compilers, unusable caches, corrupt artifacts,
kills mid-compile, contention, cache management and logging. Every failure is a ``BuildError``."""
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build

from fault_util import SRC, build_cache, leftovers, same, tape_state  # noqa: F401 (build_cache: the cache fixture)

REAL_CC = build.find_compiler()


def fake_cc(tmp_path, body, name="fakecc"):
    """A compiler script: answers --version, otherwise runs ``body`` (sh) with the real arguments."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{name} 1.0"; exit 0; fi\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def out_arg():
    return 'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done'


def test_compiler_missing(cache, monkeypatch):
    monkeypatch.setenv("CC", "/no/such/cc")
    with pytest.raises(tg.BuildError, match=r"native backend: no C compiler found \(looked for /no/such/cc on PATH="):
        build.build(SRC, "probe")


def test_compiler_not_executable(cache, monkeypatch, tmp_path):
    p = tmp_path / "cc-noexec"
    p.write_text("#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("CC", str(p))
    with pytest.raises(tg.BuildError, match=r"no C compiler found"):
        build.build(SRC, "probe")


def test_compiler_failing(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", fake_cc(tmp_path, 'echo "fake: error: expected ;" >&2; exit 3'))
    with pytest.raises(tg.BuildError, match=r"(?s)fakecc failed \(exit 3\) on generated source (/\S+\.failed\.c):\n.*"
                                            r"error: expected ;") as e:
        build.build(SRC, "probe")
    kept = e.value.args[0].split("generated source ")[1].split(":")[0]
    # what was compiled: the source and the identity build appends
    assert open(kept).read().startswith(SRC + "\n/* appended by tapegrad.native.build")
    assert leftovers(cache, ".tmp") == []


def test_compiler_writing_nothing(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", fake_cc(tmp_path, "exit 0"))
    with pytest.raises(tg.BuildError, match=r"fakecc exited 0 but wrote no library"):
        build.build(SRC, "probe")
    assert leftovers(cache, ".tmp", ".c", ".so") == []


def test_compiler_writing_garbage_is_not_cached_and_a_real_one_builds(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", fake_cc(tmp_path, f'{out_arg()}; echo "not an ELF file" > "$out"'))
    with pytest.raises(tg.BuildError, match=r"native backend: fakecc exited 0 but wrote a file that is not a loadable "
                                            r"library \(not an ELF file \(it starts b'not an E', 16 bytes\)\); nothing "
                                            r"was cached for probe-[0-9a-f]{32}\.so; check CC"):
        build.build(SRC, "probe")
    assert leftovers(cache, ".so", ".tmp") == []
    # the same key (the same compiler identity) with a working compiler behind it (and the flags that
    # compiler needs: build sees fakecc's --version, so it cannot know that clang is behind it)
    real = fake_cc(tmp_path, f'exec {REAL_CC} {" ".join(build.quirks(REAL_CC))} "$@"')
    os.replace(real, tmp_path / "fakecc")
    assert build.load(build.build(SRC, "probe")).tg_probe() == 42


def test_compiler_hanging_is_killed_after_the_timeout(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", fake_cc(tmp_path, "sleep 60"))
    monkeypatch.setenv(build.TIMEOUT_ENV, "1")
    t0 = time.monotonic()
    with pytest.raises(tg.BuildError, match=r"fakecc did not finish within 1 s \(\$TAPEGRAD_CC_TIMEOUT\); it was killed"):
        build.build(SRC, "probe")
    assert time.monotonic() - t0 < 10 and leftovers(cache, ".tmp", ".c") == []


def test_a_hung_compile_in_another_process_does_not_block_waiters_forever(cache, tmp_path):
    cc = fake_cc(tmp_path, "sleep 60")
    env = {**os.environ, "CC": cc, build.TIMEOUT_ENV: "1", build.ENV: str(cache), "PYTHONPATH": os.getcwd()}
    code = ("from tapegrad.native import build\ntry:\n    build.build('int tg_probe(void) { return 1; }\\n', 'hang')\n"
            "except build.BuildError as e:\n    print('BuildError', str(e)[:60])\n")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(o.startswith("BuildError native backend: fakecc did not finish within 1 s") for o in outs), outs
    assert time.monotonic() - t0 < 40


def test_bad_timeout_setting(cache, monkeypatch):
    monkeypatch.setenv(build.TIMEOUT_ENV, "soon")
    monkeypatch.setenv("CC", REAL_CC)
    with pytest.raises(tg.BuildError, match=r"\$TAPEGRAD_CC_TIMEOUT must be a positive number, got 'soon'"):
        build.build(SRC + "/* t */", "probe")


def test_cache_path_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv(build.ENV, str(f))
    with pytest.raises(tg.BuildError, match=r"the build cache .*afile exists but is not a folder"):
        build.build(SRC, "probe")


def test_cache_that_cannot_be_created(monkeypatch):
    monkeypatch.setenv(build.ENV, "/proc/tapegrad-cache-cannot-exist")
    with pytest.raises(tg.BuildError, match=r"cannot create the build cache /proc/tapegrad-cache-cannot-exist: .*point "
                                            r"\$TAPEGRAD_CACHE at a writable folder"):
        build.build(SRC, "probe")


def test_cache_that_cannot_be_written(cache):
    cache.mkdir()
    key = build.key_of(SRC, build.find_compiler())
    (cache / f"probe-{key}.lock").mkdir()        # the lock cannot be opened for writing
    with pytest.raises(tg.BuildError, match=r"cannot write the build cache .*: Is a directory"):
        build.build(SRC, "probe")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_cache(cache):
    cache.mkdir()
    cache.chmod(0o500)
    try:
        with pytest.raises(tg.BuildError, match=r"cannot write the build cache"):
            build.build(SRC, "probe")
    finally:
        cache.chmod(0o700)


def test_read_only_cache_still_serves_what_it_holds(cache, monkeypatch):
    path = build.build(SRC, "probe")

    def no_write(*a, **k):
        raise AssertionError("wrote to the cache")
    monkeypatch.setattr(build, "_compile", no_write)
    assert build.build(SRC, "probe") == path


@pytest.mark.parametrize("damage", ["truncate", "garbage same checksum", "checksum garbled", "checksum missing"])
def test_corrupt_artifacts_are_rebuilt(cache, damage):
    path = build.build(SRC, "probe")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(64)
    elif damage == "garbage same checksum":
        with open(path, "wb") as f:
            f.write(b"\x7fELF garbage")
        with open(path + ".sum", "w") as f:
            f.write(build._sha(path))
    elif damage == "checksum garbled":
        with open(path + ".sum", "w") as f:
            f.write("0" * 64)
    else:
        os.unlink(path + ".sum")
    fresh = build.build(SRC, "probe")
    assert fresh == path and build._valid(path, path + ".sum")
    out = subprocess.run([sys.executable, "-c", f"import ctypes; print(ctypes.CDLL({path!r}).tg_probe())"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "42"


def test_warnings_are_errors_only_under_tapegrad_werror(cache, monkeypatch, caplog):
    src = "int tg_probe(void) { int unused_here; return 5; }\n"
    monkeypatch.setenv(build.WERROR_ENV, "1")
    with pytest.raises(tg.BuildError, match=r"(?s)failed \(exit 1\).*unused_here"):
        build.build(src, "warn")
    monkeypatch.delenv(build.WERROR_ENV)
    with caplog.at_level(logging.WARNING, logger="tapegrad"):
        path = build.build(src, "warn")
    assert build.load(path).tg_probe() == 5
    (rec,) = [r for r in caplog.records if "compiler warnings" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "unused_here" in rec.getMessage()


def test_a_cold_compile_and_a_hit_each_log_one_info_line(cache, caplog):
    with caplog.at_level(logging.INFO, logger="tapegrad"):
        build.build(SRC, "probe")
        build.build(SRC, "probe")
    msgs = [r.getMessage() for r in caplog.records if r.name == "tapegrad"]
    assert len(msgs) == 2
    assert msgs[0].startswith("native build probe-") and "cache miss, compiled with" in msgs[0] and " s" in msgs[0]
    assert "cache hit" in msgs[1]


def test_tapegrad_is_silent_by_default(cache):
    code = ("import numpy as np, tapegrad as tg\nt = tg.Tape(); w = t.param(np.ones(3))\n"
            "p = tg.capture(t, (w * w).sum(), backend='native'); print(float(p.forward()))")
    env = {**os.environ, build.ENV: str(cache), "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "3.0" and r.stderr == ""


def test_clear_cache_empties_it_and_the_next_program_rebuilds(cache, caplog):
    t = tg.Tape()
    w = t.param(np.ones(3))
    loss = (w * w).sum()
    tg.capture(t, loss, backend="native")
    build.build(SRC, "probe")
    info = tg.native.cache_info()
    assert info["path"] == str(cache) and info["entries"] == 2 and info["bytes"] > 0
    assert tg.native.clear_cache() == 2
    assert tg.native.cache_info()["entries"] == 0 and leftovers(cache, ".so") == []
    with caplog.at_level(logging.INFO, logger="tapegrad"):
        p = tg.capture(t, loss, backend="native")
    assert float(p.forward()) == 3.0
    assert any("cache miss" in r.getMessage() for r in caplog.records)
    assert tg.native.cache_info()["entries"] == 1


def test_the_size_limit_evicts_the_least_recently_used(cache, monkeypatch):
    a = build.build(SRC, "a")
    os.utime(a, (1, 1))
    mb = 1.5 * os.path.getsize(a) / (1 << 20)
    monkeypatch.setenv(build.MAX_ENV, repr(mb))
    b = build.build(SRC.replace("42", "43"), "b")
    assert not os.path.exists(a) and not os.path.exists(a + ".sum") and os.path.exists(b)
    info = tg.native.cache_info()
    assert info["limit_bytes"] == int(mb * (1 << 20)) and info["entries"] == 1


KILLED = r"""
import sys
from tapegrad.native import build
src = "".join(f"double f{i}(double x) {{ return x * {i}.5 + f{i - 1 if i else 0}(x - 1.0); }}\n" for i in range(1, 600))
src = f"/* round {sys.argv[1]} */\ndouble f0(double x) {{ return x; }}\n" + src + "int tg_probe(void) { return 9; }\n"
print("go", flush=True)
build.build(src, "big")
"""


def test_kill_9_during_compiles_leaves_no_temporaries_after_the_next_build(cache):
    env = {**os.environ, build.ENV: str(cache), "PYTHONPATH": os.getcwd()}
    rng = np.random.default_rng(0)
    killed_mid_compile = 0
    for rnd in range(3):       # a new source each round: every round compiles (a new key)
        p = subprocess.Popen([sys.executable, "-c", KILLED, str(rnd)], env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        assert p.stdout.readline().strip() == "go"
        time.sleep(0.15 + 0.25 * rng.random())
        os.killpg(p.pid, signal.SIGKILL)     # the process and its compiler, as a terminal's kill would
        p.wait()
        p.stdout.close()
        assert [f for f in leftovers(cache, ".so") if not f.endswith(".so")] == []   # never a half library
        killed_mid_compile += bool(leftovers(cache, ".tmp-"))
    assert killed_mid_compile >= 1
    r = subprocess.run([sys.executable, "-c", KILLED + "print(build.load(build.build(src, 'big')).tg_probe())", "last"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.stdout.split()[-1] == "9", r.stderr
    assert leftovers(cache, ".tmp") == []      # the other keys' dead temporaries too


def test_eight_threads_build_the_same_library_once(cache, caplog):
    src = SRC.replace("42", "8")
    paths, errors = [], []

    def run():
        try:
            paths.append(build.build(src, "threads"))
        except Exception as e:   # noqa: BLE001 - collected and asserted below
            errors.append(e)
    with caplog.at_level(logging.INFO, logger="tapegrad"):
        ts = [threading.Thread(target=run) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors and len(set(paths)) == 1
    assert sum("cache miss" in r.getMessage() for r in caplog.records) == 1
    assert build.load(paths[0]).tg_probe() == 8 and leftovers(cache, ".tmp", ".c") == []


RUNNER = r"""
import numpy as np, tapegrad as tg
rng = np.random.default_rng(0)
tape = tg.Tape()
w = tape.param(rng.standard_normal((16, 8))); x = tape.const(rng.standard_normal((32, 16)))
loss = ((x @ w).tanh() * (x @ w)).mean()
opt = tg.Adam(0.01); opt.add(tape, w)
p = tg.capture(tape, loss, backend="native"); p.attach(opt)
print(repr([p.episode() for _ in range(20)]))
"""


def test_six_processes_capture_and_run_the_same_native_program(cache):
    env = {**os.environ, build.ENV: str(cache), "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert len(set(outs)) == 1 and outs[0].startswith("[")
    assert len(leftovers(cache, ".so.sum")) == 1 and leftovers(cache, ".tmp") == []


def test_a_failed_native_capture_leaves_the_tape_as_it_was(cache, monkeypatch, tmp_path):
    t = tg.Tape()
    w = t.param(np.ones(3))
    loss = (w * w).sum()
    before = tape_state(t)
    monkeypatch.setenv("CC", fake_cc(tmp_path, "exit 1"))
    with pytest.raises(tg.BuildError):
        tg.capture(t, loss, backend="native")
    assert same(tape_state(t), before)
    assert float(tg.capture(t, loss).forward()) == 3.0


@pytest.mark.parametrize("rank", [9, 10, 12])
def test_native_programs_of_any_rank_match_the_tape(cache, rank):
    rng = np.random.default_rng(rank)
    t = tg.Tape()
    w = t.param(rng.standard_normal((2,) * rank))
    b = t.param(rng.standard_normal((2,) + (1,) * (rank - 1)))
    y = ((w * b) * w).sum(axis=(1, 3)).transpose().sum()
    p = tg.capture(t, y, backend="native")
    t.backward(y)
    p.forward()
    p.backward()
    tol = 1e-13 * max(1.0, float(np.abs(t.value(y))))
    assert abs(float(p.loss().reshape(-1)[0]) - float(t.value(y))) <= tol
    assert np.max(np.abs(p.grad(w) - t.grad(w))) <= 1e-13 * max(1.0, np.max(np.abs(t.grad(w))))
    assert np.max(np.abs(p.grad(b) - t.grad(b))) <= 1e-13 * max(1.0, np.max(np.abs(t.grad(b))))
