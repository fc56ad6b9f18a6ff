"""What the build cache serves is the build asked for: a library says which build it is, checked before
anything in it is called; cache folders and ``$CC`` that a shell would read differently are read the same.

A library of another program (or of this program built for another ``-march``) renamed to this
program's name, with a valid checksum, crashed the process it was loaded into (SIGSEGV: its pointer
table has another layout); the victims run in a subprocess, so a crash fails the test instead of
killing pytest."""
import os
import re
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build

from fault_util import SRC, build_cache, leftovers  # noqa: F401 (build_cache: the cache fixture)

REAL_CC = build.find_compiler()


def plant(src, dst):
    """``src``'s library and checksum under ``dst``'s name (new files renamed into place, as a copy tool
    that writes atomically would: the library a running process maps is never overwritten)."""
    for suffix in ("", ".sum"):
        shutil.copy(src + suffix, dst + suffix + ".planting")
        os.replace(dst + suffix + ".planting", dst + suffix)
    assert build._valid(dst, dst + ".sum")


# ── another build under this build's name ────────────────────────────────────

VICTIM = r"""
import logging, sys
import numpy as np, tapegrad as tg
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
n = int(sys.argv[1])
t = tg.Tape()
w = t.param(np.linspace(-1.0, 1.0, n))
x = t.const(np.arange(n) * 1.0)
p = tg.capture(t, (w.tanh() * x).sum() * 2.0, backend="native")
loss = float(p.forward())
p.backward()
print(p.runner.path)
print(repr(loss), repr(float(p.grad(w) @ np.arange(n))))
"""


def victim(cache, n, **env):
    r = subprocess.run([sys.executable, "-c", VICTIM, str(n)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, build.ENV: str(cache), "PYTHONPATH": os.getcwd(), **env})
    assert r.returncode == 0, f"the victim died (exit {r.returncode}):\n{r.stderr[-3000:]}"
    path, numbers = r.stdout.split("\n")[:2]
    w, x = np.linspace(-1.0, 1.0, n), np.arange(n) * 1.0
    want = (2.0 * np.sum(np.tanh(w) * x), float(2.0 * (1 - np.tanh(w) ** 2) * x @ x))
    got = tuple(float(v) for v in numbers.split())
    assert got == pytest.approx(want, rel=1e-12), (got, want)
    return path, r.stderr


@pytest.mark.parametrize("other", ["another program", "another -march"])
def test_another_build_under_this_programs_name_is_rebuilt_not_called(cache, other):
    mine, _ = victim(cache, 3)
    theirs, _ = victim(cache, 40) if other == "another program" else victim(cache, 3, TAPEGRAD_MARCH="x86-64-v2")
    assert theirs != mine
    planted = open(theirs, "rb").read()
    plant(theirs, mine)
    again, log = victim(cache, 3)        # a crash here was the defect
    assert again == mine
    assert re.search(rf"native build {re.escape(os.path.basename(mine))}: the cached library is another build "
                     rf"\(its identity: 'tapegrad {re.escape(os.path.basename(theirs)[:-3])}; "
                     rf"source sha256 [0-9a-f]{{16}};"
                     rf" cc .*; flags .*-march=\S+.*'\); it was not loaded; rebuilding it", log), log
    assert open(mine, "rb").read() != planted and build._valid(mine, mine + ".sum")
    victim(cache, 3)                      # and the rebuilt library is served from then on


def test_a_planted_library_is_rebuilt_in_this_process_too(cache):
    """The rejected library is unloaded before the rebuilt file is loaded (the loader would otherwise hand
    back the object it holds for the same path name)."""
    a = build.build(SRC, "probe")
    b = build.build(SRC.replace("42", "43"), "probe")
    plant(b, a)
    assert build.build(SRC, "probe") == a
    assert build.load(a).tg_probe() == 42


def test_load_refuses_a_library_that_is_not_the_build_its_name_says(cache):
    b = build.build(SRC.replace("42", "43"), "probe")
    fake = os.path.join(os.path.dirname(b), "probe-" + "0" * 32 + ".so")
    shutil.copy(b, fake)
    with pytest.raises(tg.BuildError, match=rf"native backend: {re.escape(fake)} is not the library its name says: "
                                            rf"expected an tg_identity starting 'tapegrad probe-0{{32}};', found "
                                            rf"'tapegrad {re.escape(os.path.basename(b)[:-3])}; source sha256 "):
        build.load(fake)


def test_load_refuses_a_library_without_an_identity(cache, tmp_path):
    """A library that is not tapegrad's at all (or was built before libraries carried their identity)."""
    src, lib = tmp_path / "x.c", tmp_path / "probe-0123.so"
    src.write_text(SRC)
    subprocess.run([REAL_CC, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(tg.BuildError, match=rf"{re.escape(str(lib))} is not the library its name says: expected an "
                                            rf"tg_identity starting 'tapegrad probe-0123;', found no tg_identity; it "
                                            rf"was not loaded or called"):
        build.load(str(lib))


def test_the_identity_names_the_file_the_source_the_compiler_and_the_flags(cache, monkeypatch):
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v2")
    lib = build.load(build.build(SRC, "probe"))
    ident = build._identity_in(lib)
    m = re.fullmatch(r"tapegrad probe-([0-9a-f]{32}); source sha256 ([0-9a-f]{16}); cc (.+?) \((.+)\); "
                     r"flags (.*)", ident)
    assert m, ident
    assert m[1] == build.key_of(SRC, REAL_CC) and m[3] == " ".join((REAL_CC,) + build.cc_args())
    assert "-march=x86-64-v2" in m[5].split()


def test_an_identity_with_quotes_backslashes_and_trigraphs_compiles_verbatim(cache, tmp_path, monkeypatch):
    """The identity holds the compiler's path, so every character survives the C string literal."""
    odd = tmp_path / 'a "q"\\ ??= é'
    odd.mkdir()
    os.symlink(REAL_CC, odd / "cc")
    monkeypatch.setenv("CC", f"'{odd / 'cc'}'")
    lib = build.load(build.build(SRC, "probe"))
    assert f"cc {odd / 'cc'} (" in build._identity_in(lib) and lib.tg_probe() == 42


# ── a cache folder that reads as an option ───────────────────────────────────

def test_a_relative_cache_folder_starting_with_a_dash_is_not_read_as_an_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(build.ENV, "-dcache")
    path = build.build(SRC, "probe")
    assert path.startswith(str(tmp_path / "-dcache") + os.sep)
    assert build.load(path).tg_probe() == 42
    assert tg.native.cache_info()["path"] == str(tmp_path / "-dcache")


def fake_cc(tmp_path, body, name="fakecc"):
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{name} 1.0"; exit 0; fi\n'
                    'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                    f'{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_library_without_the_source_in_it_is_never_cached(cache, monkeypatch, tmp_path):
    """What the -dcache build cached: the compiler read no source and linked an empty library."""
    monkeypatch.setenv("CC", fake_cc(tmp_path, f'exec {REAL_CC} -shared -fPIC -o "$out" -x c /dev/null'))
    with pytest.raises(tg.BuildError, match=r"native backend: fakecc exited 0 but its library for "
                                            r"probe-[0-9a-f]{32}\.so exports no tg_identity instead of "
                                            r"'tapegrad probe-[0-9a-f]{32}; source sha256 .*' \(was the source "
                                            r"compiled at all\?\); nothing was cached; check CC"):
        build.build(SRC, "probe")
    assert leftovers(cache, ".so", ".tmp") == []


# ── $CC with arguments ───────────────────────────────────────────────────────

def test_cc_with_arguments_passes_them_first(cache, monkeypatch):
    monkeypatch.setenv("CC", f"{REAL_CC} -DTG_ANSWER=7")
    assert build.find_compiler() == REAL_CC and build.cc_args() == ("-DTG_ANSWER=7",)
    assert build.load(build.build("int tg_probe(void) { return TG_ANSWER; }\n", "probe")).tg_probe() == 7


def test_cc_as_a_wrapper_with_a_compiler_runs_the_compiler_through_it(cache, monkeypatch, tmp_path):
    """CC='ccache gcc': the wrapper (here in a folder with a space, quoted as for sh) gets the compiler
    as its first argument; the key holds the wrapped compiler's version."""
    d = tmp_path / "wrap dir"
    d.mkdir()
    wrap = d / "ccache"
    wrap.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{d}/log"\nexec "$@"\n')
    wrap.chmod(0o755)
    monkeypatch.setenv("CC", f"'{wrap}' {REAL_CC}")
    assert build.load(build.build(SRC, "probe")).tg_probe() == 42
    calls = (d / "log").read_text().splitlines()
    assert calls[0] == f"{REAL_CC} --version"
    compile_ = [c for c in calls if " -o " in c]
    assert len(compile_) == 1 and compile_[0].startswith(f"{REAL_CC} -O3 ") and f" {cache}{os.sep}" in compile_[0]


def test_the_arguments_of_cc_are_part_of_the_key(cache, monkeypatch):
    monkeypatch.setenv("CC", REAL_CC)
    plain = build.key_of(SRC, REAL_CC)
    monkeypatch.setenv("CC", f"{REAL_CC} -O1")
    assert build.key_of(SRC, REAL_CC) != plain


def test_cc_whose_first_word_is_missing_says_so(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-ccache gcc")
    with pytest.raises(tg.BuildError, match=r"no C compiler found \(looked for no-such-ccache \(the first word of "
                                            r"\$CC='no-such-ccache gcc'\) on PATH="):
        build.build(SRC, "probe")


def test_cc_with_unbalanced_quotes_says_so(cache, monkeypatch):
    monkeypatch.setenv("CC", "'gcc")
    with pytest.raises(tg.BuildError, match=r"""\$CC="'gcc" cannot be split into words as a shell would \(No closing """
                                            r"quotation\); quote it as for sh"):
        build.build(SRC, "probe")
