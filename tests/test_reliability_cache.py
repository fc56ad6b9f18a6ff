"""The build cache serves nothing another user could have planted, and reads a library before mapping it.

``dlopen`` runs a library's ELF constructors before any of our code can look at it, so a library that
is planted in a cache others can write runs inside the victim's process, whatever its identity. The
cache refuses folders that are not the user's or that others can write (or that sit below a folder
others can write, not sticky); a library's identity, checksum and wholeness are read from its bytes
before it is mapped (a truncated library with a matching checksum was mapped and died with SIGBUS);
lock files are opened without following links or truncating. Planted libraries here carry a
constructor that writes a marker file: the marker must never appear.
"""
import os
import re
import stat
import subprocess
import sys

import pytest

import tapegrad as tg
from tapegrad.native import build, elf

from fault_util import SRC, build_cache  # noqa: F401 (build_cache: the cache fixture)

REAL_CC = build.find_compiler()
ROOT = os.geteuid() == 0
OTHER_UID = 65534   # nobody


def planted(tmp_path, ident, name="planted"):
    """A library answering tg_probe() with 666, exporting ``ident``, whose constructor writes a marker."""
    marker = tmp_path / f"{name}.ran"
    src = tmp_path / f"{name}.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                   f'    FILE *f = fopen("{marker}", "w");\n    if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n'
                   "int tg_probe(void) { return 666; }\n" + build.stamp(ident))
    lib = tmp_path / f"{name}.so"
    subprocess.run([REAL_CC, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib), marker


def expected(cache):
    """The path the cache would serve SRC from, and the identity it would expect there."""
    cc = REAL_CC
    lib = os.path.join(os.path.realpath(cache), f"probe-{build.key_of(SRC, cc)}.so")
    return lib, build.identity(lib, SRC, cc, build.compiler_identity(cc, *build.cc_args()))


def plant(lib_from, lib_to, mode=0o755):
    with open(lib_from, "rb") as f:
        data = f.read()
    with open(lib_to, "wb") as f:
        f.write(data)
    os.chmod(lib_to, mode)
    with open(lib_to + ".sum", "w") as f:
        f.write(build._sha(lib_to))


def test_a_new_cache_folder_is_private(cache):
    build.build(SRC, "probe")
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_a_cache_others_can_write_is_refused_and_its_planted_library_never_runs(cache, tmp_path):
    cache.mkdir()
    os.chmod(cache, 0o777)   # as a shared /tmp/cache a team set up
    lib, want = expected(cache)
    evil, marker = planted(tmp_path, want)    # the very identity the cache expects, and a matching .sum
    plant(evil, lib)
    with pytest.raises(tg.BuildError, match=rf"^native backend: the build cache {re.escape(str(cache))} can be written "
                                            r"by its group and every user \(mode 0777\): a library another user put "
                                            r"there would run inside this process; refused; make it private \(chmod "
                                            r"go-w .*\) or use a folder only you can write \(unset \$TAPEGRAD_CACHE"):
        build.build(SRC, "probe")
    os.chmod(cache, 0o770)
    with pytest.raises(tg.BuildError, match=r"can be written by its group \(mode 0770\)"):
        tg.native.cache_info()
    assert not marker.exists()


def test_a_cache_folder_of_another_user_is_refused(cache, tmp_path, monkeypatch):
    if ROOT:
        cache.mkdir()
        os.chown(cache, OTHER_UID, OTHER_UID)
        owner = OTHER_UID
    else:
        cache = "/usr"   # root's
        owner = 0
    monkeypatch.setenv(build.ENV, str(cache))
    with pytest.raises(tg.BuildError, match=rf"^native backend: the build cache {re.escape(str(cache))} belongs to uid "
                                            rf"{owner}, not to this user \(uid {os.getuid()}\): a library its owner "
                                            r"put there would run inside this process; refused"):
        build.build(SRC, "probe")


def test_a_cache_below_a_folder_others_can_write_is_refused_unless_it_is_sticky(cache, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv(build.ENV, str(shared / "mine"))
    with pytest.raises(tg.BuildError, match=rf"^native backend: the folder {re.escape(str(shared))} above the build "
                                            rf"cache {re.escape(str(shared / 'mine'))} can be written by its group and "
                                            r"every user \(mode 0777, not sticky\), who could replace the cache with a "
                                            r"folder of planted libraries; refused"):
        build.build(SRC, "probe")
    os.chmod(shared, 0o1777)   # sticky, as /tmp: no one renames another's folder
    assert build.load(build.build(SRC, "probe")).tg_probe() == 42


def test_a_planted_library_of_another_build_is_rebuilt_without_running_its_constructor(cache, tmp_path, caplog):
    lib, want = expected(cache)
    build.build(SRC.replace("42", "41"), "other")    # the folder exists and is the user's
    evil, marker = planted(tmp_path, want.replace("tapegrad probe-", "tapegrad other-"))
    plant(evil, lib)
    assert build.build(SRC, "probe") == lib
    assert not marker.exists()                       # ctypes.CDLL ran it before the identity was read
    assert build.load(lib).tg_probe() == 42
    assert any("the cached library is another build" in r.getMessage() and "it was not loaded; rebuilding it"
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["writable by others", "owned by another user", "a symbolic link"])
def test_a_library_with_the_expected_identity_that_others_could_write_is_not_served(cache, tmp_path, how):
    lib, want = expected(cache)
    build.build(SRC.replace("42", "41"), "other")
    evil, marker = planted(tmp_path, want)
    if how == "a symbolic link":
        plant(evil, str(tmp_path / "elsewhere.so"))
        os.symlink(tmp_path / "elsewhere.so", lib)
        os.replace(str(tmp_path / "elsewhere.so.sum"), lib + ".sum")
    elif how == "owned by another user":
        if not ROOT:
            pytest.skip("only root can give a file away")
        plant(evil, lib)
        os.chown(lib, OTHER_UID, OTHER_UID)
    else:
        plant(evil, lib, 0o777)
    assert build.build(SRC, "probe") == lib
    assert not os.path.islink(lib) and not marker.exists()
    assert build.load(lib).tg_probe() == 42
    assert stat.S_IMODE(os.stat(lib).st_mode) & 0o022 == 0


def test_load_refuses_a_planted_library_before_mapping_it(cache, tmp_path):
    lib, want = expected(cache)
    build.build(SRC.replace("42", "41"), "other")
    evil, marker = planted(tmp_path, want)
    plant(evil, lib, 0o666 | stat.S_IXUSR)
    with pytest.raises(tg.BuildError, match=rf"^native backend: {re.escape(lib)} is not a library this process loads: "
                                            r"writable by its group and every user \(mode 0766\); it was not loaded"):
        build.load(lib)
    assert not marker.exists()


def test_a_symbolic_link_at_the_lock_is_not_followed_and_its_target_keeps_its_bytes(cache, tmp_path):
    lib, _ = expected(cache)
    build.build(SRC.replace("42", "41"), "other")
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's work")
    os.symlink(victim, lib[:-3] + ".lock")
    with pytest.raises(tg.BuildError, match=rf"^native backend: the lock file {re.escape(lib[:-3])}\.lock is a symbolic "
                                            r"link; refused \(it is not followed\); remove it"):
        build.build(SRC, "probe")
    assert victim.read_text() == "the user's work"
    os.unlink(lib[:-3] + ".lock")
    assert build.load(build.build(SRC, "probe")).tg_probe() == 42


def test_an_existing_lock_file_is_not_truncated(cache):
    lib, _ = expected(cache)
    build.build(SRC.replace("42", "41"), "other")
    with open(lib[:-3] + ".lock", "w") as f:
        f.write("held by tapegrad")
    build.build(SRC, "probe")
    with open(lib[:-3] + ".lock") as f:
        assert f.read() == "held by tapegrad"


TRUNCATED = r"""
import os, sys
from tapegrad.native import build, elf
src = sys.argv[1]
p = build.build(src, "probe")
n = os.path.getsize(p)
with open(p, "r+b") as f:
    f.truncate(n // 2)
with open(p + ".sum", "w") as f:
    f.write(build._sha(p))          # a checksum that matches the truncated bytes
try:
    build.load(p)
except build.BuildError as e:
    print("load:", e)
print("probe:", build.load(build.build(src, "probe")).tg_probe())
"""


def test_a_truncated_library_with_a_matching_checksum_is_never_mapped(cache):
    r = subprocess.run([sys.executable, "-c", TRUNCATED, SRC], capture_output=True, text=True, timeout=120,
                       env={**os.environ, build.ENV: str(cache), "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, f"died (exit {r.returncode}; SIGBUS is -7):\n{r.stderr[-2000:]}"
    load, probe = r.stdout.strip().split("\n")
    assert re.fullmatch(r"load: native backend: \S+probe-[0-9a-f]{32}\.so is not a library this process loads: "
                        r"truncated: (section \d+|loaded segment \d+|the section header table) ends at byte \d+, the file has \d+; it was not "
                        r"loaded \(the next build of this program replaces it\)", load), load
    assert probe == "probe: 42"


def test_the_identity_read_from_the_bytes_is_the_loaded_one_and_every_truncation_is_seen(cache):
    lib = build.build(SRC, "probe")
    with open(lib, "rb") as f:
        data = f.read()
    assert build._image_identity(data) == build._identity_in(build.load(lib)) is not None
    for n in list(range(0, len(data), 61)) + [len(data) - 1]:
        with pytest.raises(elf.NotLibrary, match=r"^(truncated: |not an ELF file)"):
            elf.Image(data[:n])
