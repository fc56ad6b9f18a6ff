"""Build generated C into a shared library, once, in a content-addressed cache.

The key hashes the source, the flags, the compiler's identity (its path and ``--version``) and the CPU
(the code is built for it). The
cache lives in ``$TAPEGRAD_CACHE``, else ``$XDG_CACHE_HOME/tapegrad``, else ``~/.cache/tapegrad``.
Builds compile into a temporary file and ``os.replace`` it into place (atomic), under an exclusive
``flock`` per key, so concurrent processes build each library once and never load a half-written one;
a ``.sum`` file next to each library holds its SHA-256, and a library whose bytes do not match (a
corrupt or truncated artifact) is rebuilt.
"""
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

from ..errors import BuildError

# -O3 -march=native rather than -O2: vectorised, unswitched loops on this CPU's vector width measured
# 1.3-1.6x faster episodes on the tiny/small MLPs (the Adam step 3-4x). Still IEEE: no -ffast-math, so
# GCC never reassociates a floating-point sum, and -ffp-contract=off forbids FMA contraction; the
# bit-exactness tests check it. -march=native makes the library CPU-specific: the CPU is in the key.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=c11",
         "-Wall", "-Wextra", "-Werror")
ENV = "TAPEGRAD_CACHE"


def cache_dir():
    d = os.environ.get(ENV)
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "tapegrad")
    os.makedirs(d, exist_ok=True)
    return d


def find_compiler():
    """The C compiler: ``$CC`` if set, else the first of cc, gcc, clang on PATH; BuildError if none."""
    cands = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for c in cands:
        path = shutil.which(c)
        if path:
            return path
    raise BuildError(f"native backend: no C compiler found (looked for {', '.join(cands)} on PATH="
                     f"{os.environ.get('PATH', '')!r}); install one (e.g. `apt-get install gcc`) or set CC, "
                     f"or capture with backend='numpy'")


@functools.lru_cache(maxsize=8)
def compiler_identity(path):
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        raise BuildError(f"native backend: the C compiler {path} cannot run: {e}") from None
    return f"{path}\n{r.stdout}"


@functools.lru_cache(maxsize=1)
def cpu_identity():
    """The machine and CPU model/feature flags (``-march=native`` code is only valid on such a CPU)."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    lines.append(line.strip())
                if len(lines) >= 2:
                    break
    except OSError:
        pass
    return f"{platform.machine()}\n{platform.processor()}\n" + "\n".join(lines)


def key_of(source, cc):
    h = hashlib.sha256()
    for part in (source, " ".join(FLAGS), compiler_identity(cc), cpu_identity()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _valid(lib, summ):
    try:
        with open(summ) as f:
            return f.read().strip() == _sha(lib)
    except OSError:
        return False


def build(source, name="tg"):
    """Path to the shared library for ``source`` (compiled now unless a valid cached copy exists)."""
    cc = find_compiler()
    key = key_of(source, cc)
    d = cache_dir()
    lib = os.path.join(d, f"{name}-{key}.so")
    summ = lib + ".sum"
    if _valid(lib, summ):
        return lib
    with open(os.path.join(d, f"{name}-{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _valid(lib, summ):          # another process built it while we waited
                return lib
            _compile(cc, source, lib, summ, d)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return lib


def _compile(cc, source, lib, summ, d):
    fd, src = tempfile.mkstemp(suffix=".c", dir=d)
    tmp = src[:-2] + ".so.tmp"
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        r = subprocess.run([cc, *FLAGS, "-o", tmp, src, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"native backend: {os.path.basename(cc)} failed (exit {r.returncode}) on generated "
                             f"source {src}:\n{r.stderr[-4000:]}")
        digest = _sha(tmp)
        os.replace(tmp, lib)
        stmp = summ + ".tmp"
        with open(stmp, "w") as f:
            f.write(digest)
        os.replace(stmp, summ)
        os.unlink(src)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path):
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise BuildError(f"native backend: cannot load {path}: {e}") from None
