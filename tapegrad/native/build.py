"""Build generated C into a shared library, once, in a content-addressed cache.

The key hashes the source, the flags, the compiler's identity (its path and ``--version``) and the CPU
(the code is built for it). The cache lives in ``$TAPEGRAD_CACHE``, else ``$XDG_CACHE_HOME/tapegrad``,
else ``~/.cache/tapegrad``. Builds compile into a temporary file and ``os.replace`` it into place
(atomic), under an exclusive ``flock`` per key, so concurrent processes build each library once and
never load a half-written one; a ``.sum`` file next to each library holds its SHA-256, and a library
whose bytes do not match (a corrupt or truncated artifact) is rebuilt.

The cache is trusted only as far as no one but the user can write it, because loading a library
(``dlopen``) runs its constructors before any of our code can look at it. So (docs/reliability.md):

- the cache folder must belong to the user and be writable by no one else, and every folder above it
  must belong to the user or root and be writable by no one else unless it is sticky (``/tmp``);
  otherwise ``BuildError`` says which folder, whose it is or who can write it, and what to do;
- a cached library is read from its bytes before it is ever mapped: it must be a regular file (not a
  symbolic link) of the user's (or root's) that no one else can write, match its ``.sum``, be a whole
  ELF shared library (every loaded segment inside the file: a truncated one is never mapped) and
  export the identity its name asks for; anything else is rebuilt;
- lock files are opened without following symbolic links and without truncating.

Every library says which build it is: ``build`` appends to the source an exported string
``tg_identity`` holding the file's name (``<name>-<key>``), the source's hash, the compiler and the
flags. A library whose identity is not the one its name asks for (another program's library copied
over it, a build for another ``-march``) is never loaded: ``build`` rebuilds it, and ``load`` raises
``BuildError`` naming the file, what it expected and what it found. The identity is read from the
file's bytes (``tapegrad.native.elf``); a freshly compiled library without it (a compiler that wrote
something else) is not cached.

``$CC`` is split as a shell would (``CC='ccache gcc'``, ``CC='gcc -O1'``): the first word is the
program, the rest lead its arguments. The cache folder is made absolute, so no path on the compiler's
command line starts with ``-`` (``TAPEGRAD_CACHE=-dcache`` would otherwise be read as an option).

Every failure — no compiler, a compiler that fails, crashes, hangs or writes nothing, a cache folder
that cannot be created, written or trusted — raises ``BuildError``. Every call of the compiler, its
``--version`` probe included, runs in a process group of its own and is killed with its children after
``$TAPEGRAD_CC_TIMEOUT`` seconds (default 300; the probe after at most 30); its output is read once it
exits, so a helper it leaves running with the output open holds nothing up. A compiler that crashes
(an internal compiler error, a signal, out of memory) is reported with the size of the generated source
and what to do instead (``backend="numpy"``, a smaller program). Temporaries carry the compiling
process's pid; those of dead processes (a ``kill -9`` mid-compile) are removed by the next build.
``$TAPEGRAD_CACHE_MAX_MB`` (default 1024) bounds the cache: after a build, the least recently used
libraries are removed until it fits. Compiler warnings are logged (logger ``tapegrad``) and fatal only
with ``TAPEGRAD_WERROR=1`` (the test suite and CI set it).
"""
import ctypes
import _ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time

from .._files import sweep_temporaries
from ..errors import BuildError
from . import elf

log = logging.getLogger("tapegrad")
log.addHandler(logging.NullHandler())   # silent unless the application configures logging

# -O3 -march=native rather than -O2: vectorised, unswitched loops on this CPU's vector width measured
# 1.3-1.6x faster episodes on the tiny/small MLPs (the Adam step 3-4x). Still IEEE: no -ffast-math, so
# GCC never reassociates a floating-point sum, and -ffp-contract=off forbids FMA contraction; the
# bit-exactness tests check it. -march=native makes the library CPU-specific: the CPU is in the key.
# $TAPEGRAD_MARCH replaces "native" (e.g. x86-64-v2, to build for a cluster's oldest CPU).
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=c11",
         "-Wall", "-Wextra")
ENV = "TAPEGRAD_CACHE"
TIMEOUT_ENV, MAX_ENV, WERROR_ENV = "TAPEGRAD_CC_TIMEOUT", "TAPEGRAD_CACHE_MAX_MB", "TAPEGRAD_WERROR"
MARCH_ENV = "TAPEGRAD_MARCH"


def march() -> str:
    """The ``-march`` target: ``$TAPEGRAD_MARCH``, else ``native``; BuildError for a value that is not one word."""
    m = os.environ.get(MARCH_ENV) or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", m):
        raise BuildError(f"native backend: ${MARCH_ENV} must name one -march target (e.g. native, x86-64-v2, "
                         f"x86-64-v3, znver3), got {m!r}")
    return m


def flags() -> tuple:
    """The compiler flags: ``FLAGS`` with ``-march=$TAPEGRAD_MARCH``, plus ``-Werror`` when
    ``TAPEGRAD_WERROR=1`` (tests and CI)."""
    base = tuple(f"-march={march()}" if f == "-march=native" else f for f in FLAGS)
    return base + (("-Werror",) if os.environ.get(WERROR_ENV) == "1" else ())


def _env_number(name, default):
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise BuildError(f"native backend: ${name} must be a positive number, got {raw!r}")
    return v


def cache_dir():
    """The cache folder, as an absolute path with no symbolic links (created if needed, private to the
    user); BuildError if it cannot be created or is not trusted (``trusted_folder``).

    Absolute because its paths go on the compiler's command line: a relative ``-dcache`` would be
    read as an option (GCC's ``-d`` dumps), leaving no source file and an empty library."""
    d = os.environ.get(ENV)
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "tapegrad")
    d = os.path.abspath(d)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise BuildError(f"native backend: the build cache {d} exists but is not a folder; remove it or point "
                         f"${ENV} at a folder") from None
    except OSError as e:
        raise BuildError(f"native backend: cannot create the build cache {d}: {e.strerror or e}; point ${ENV} at "
                         f"a writable folder") from None
    d = os.path.realpath(d)
    trusted_folder(d)
    return d


def _writers(mode):
    return " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if mode & bit)


def trusted_folder(d):
    """BuildError unless no one but this user (and root) can change what the folder ``d`` holds: ``d``
    belongs to the user and only the user can write it; every folder above it belongs to the user or
    root, and one that others can write is sticky (as ``/tmp``: no one removes or renames another's
    entries there). A library planted in the cache would run inside this process when loaded."""
    uid = os.getuid()
    fix = f"use a folder only you can write (unset ${ENV} for ~/.cache/tapegrad, or point ${ENV} at one)"
    try:
        st = os.stat(d)
    except OSError as e:
        raise BuildError(f"native backend: cannot read the build cache {d}: {e.strerror or e}; {fix}") from None
    if st.st_uid != uid:
        raise BuildError(f"native backend: the build cache {d} belongs to uid {st.st_uid}, not to this user "
                         f"(uid {uid}): a library its owner put there would run inside this process; refused; {fix}")
    if st.st_mode & 0o022:
        raise BuildError(f"native backend: the build cache {d} can be written by {_writers(st.st_mode)} (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): a library another user put there would run inside this "
                         f"process; refused; make it private (chmod go-w {d}) or {fix}")
    up = d
    while os.path.dirname(up) != up:
        up = os.path.dirname(up)
        st = os.stat(up)
        if st.st_uid not in (uid, 0):
            raise BuildError(f"native backend: the folder {up} above the build cache {d} belongs to uid "
                             f"{st.st_uid}, who could replace the cache with a folder of planted libraries; "
                             f"refused; {fix}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise BuildError(f"native backend: the folder {up} above the build cache {d} can be written by "
                             f"{_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}, not sticky), who could "
                             f"replace the cache with a folder of planted libraries; refused; {fix}")


def _cc_words():
    """``$CC`` split as a shell would (``[]`` when unset or blank); BuildError for unbalanced quotes."""
    raw = os.environ.get("CC", "")
    try:
        return shlex.split(raw)
    except ValueError as e:
        raise BuildError(f"native backend: $CC={raw!r} cannot be split into words as a shell would ({e}); "
                         f"quote it as for sh, e.g. CC='ccache gcc'") from None


def find_compiler():
    """The C compiler program: the first word of ``$CC`` if set (``CC='ccache gcc'`` runs ccache), else the
    first of cc, gcc, clang on PATH; BuildError if none. ``cc_args()`` are the words after it."""
    words = _cc_words()
    cands = words[:1] or ["cc", "gcc", "clang"]
    for c in cands:
        path = shutil.which(c)
        if path:
            return path
    looked = f"{words[0]} (the first word of $CC={os.environ['CC']!r})" if len(words) > 1 else ", ".join(cands)
    raise BuildError(f"native backend: no C compiler found (looked for {looked} on PATH="
                     f"{os.environ.get('PATH', '')!r}); install one (e.g. `apt-get install gcc`) or set CC, "
                     f"or capture with backend='numpy'")


def cc_args():
    """The words of ``$CC`` after the program: they lead every call of it (``-O1`` of ``CC='gcc -O1'``,
    ``gcc`` of ``CC='ccache gcc'``)."""
    return tuple(_cc_words()[1:])


def _cc_name(cc):
    """The compiler as messages name it: its file name and the arguments ``$CC`` gives it."""
    return " ".join([os.path.basename(cc), *cc_args()])


@functools.lru_cache(maxsize=8)
def quirks(path, *args):
    """Flags one compiler needs beside ``flags()``. clang 19 on an Intel Xeon whose CPUID reports AVX10
    (a 2-core VM with AMX and AVX-512; GCC calls it rocketlake) reads the host's features as
    ``+avx10.1-256`` and warns that it promotes them to 512 bits
    (``-Winvalid-feature-combination``), which ``-Werror`` turns into a failed build of any source."""
    return ("-Wno-invalid-feature-combination",) if "clang" in compiler_identity(path, *args) else ()


def compiler_identity(path, *args):
    """The compiler's command (``path`` and the leading ``args`` from ``$CC``) and its ``--version`` text
    (through a wrapper such as ccache: the wrapped compiler's)."""
    timeout = min(_env_number(TIMEOUT_ENV, 300.0), 30.0)
    command = " ".join([path, *args])
    try:
        _, out, _ = run_compiler([path, *args, "--version"], timeout)
    except OSError as e:
        raise BuildError(f"native backend: the C compiler {command} cannot run: {e}") from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"native backend: the C compiler {command} did not answer --version within {timeout:g} s "
                         f"(${TIMEOUT_ENV}, at most 30 s for this probe); it was killed with its children; is it "
                         f"hung, or waiting on a license server or a network drive?") from None
    return f"{command}\n{out}"


OUTPUT_KEPT = 1 << 16   # the last bytes of a compiler's stdout and stderr that messages and logs read


def run_compiler(argv, timeout):
    """``(exit status, stdout, stderr)`` of ``argv``, run in a process group of its own.

    Its output goes to unnamed files, read once the command exits: a helper it leaves running with the
    output open (a detached server) holds nothing up, where a pipe would be read until that helper
    closed it. Past ``timeout`` seconds, or if this call is interrupted, the whole group (a driver and
    its cc1/as/ld) is killed, then ``subprocess.TimeoutExpired`` (or the interruption) raised.
    OSError if it cannot start."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            if p.returncode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        return p.returncode, _tail(out), _tail(err)


def _tail(f):
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - OUTPUT_KEPT))
    return f.read().decode("utf-8", "replace")


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
    """The cache key of ``source`` built by the compiler ``cc`` (with ``cc_args()``), ``flags()``, on this CPU."""
    return _key(source, compiler_identity(cc, *cc_args()))


def _key(source, who):
    h = hashlib.sha256()
    for part in (source, " ".join(flags()), who, cpu_identity()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


# ── what a library says it is ────────────────────────────────────────────────

IDENTITY = "tg_identity"


def identity(lib, source, cc, who):
    """The identity the library file ``lib`` must export: ``tapegrad <its file name>; source sha256 …;
    cc <command> (<version>); flags …``. The file name carries the key, which hashes all the rest."""
    version = (who.splitlines()[1:2] or ["?"])[0].strip()
    return (f"tapegrad {os.path.basename(lib)[:-3]}; source sha256 {hashlib.sha256(source.encode()).hexdigest()[:16]}; "
            f"cc {' '.join([cc, *cc_args()])} ({version}); flags {' '.join(flags() + quirks(cc, *cc_args()))}")


def stamp(ident):
    """C text exporting ``ident`` as ``tg_identity`` (appended to every source ``build`` compiles)."""
    text = "".join(c if " " <= c <= "~" and c not in '"\\?' else "".join(f"\\{b:03o}" for b in c.encode())
                   for c in ident)     # '?' escaped too: -std=c11 reads trigraphs
    return (f"\n/* appended by tapegrad.native.build: which build this library is (read before any call) */\n"
            f"extern const char {IDENTITY}[];\nconst char {IDENTITY}[] = \"{text}\";\n")


def _identity_in(handle):
    """The identity a loaded library exports, or None (its data, read after loading: tests use it)."""
    try:
        return ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(handle, IDENTITY))).decode("utf-8", "replace")
    except ValueError:    # no such symbol
        return None


def _close(handle):
    """Unload a library that will not be used (a fresh build checked by the loader: its temporary name is
    never loaded again)."""
    _ctypes.dlclose(handle._handle)


class Untrusted(Exception):
    """A library file that must not be mapped; the message says why."""


def read_library(path):
    """The bytes of the library file ``path``, read without mapping it: a regular file (a symbolic link is
    not followed) that belongs to this user or root and that no one else can write; ``Untrusted`` otherwise
    (OSError if it cannot be read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("not a regular file")
        if st.st_uid not in (os.getuid(), 0):
            raise Untrusted(f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_mode & 0o022:
            raise Untrusted(f"writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})")
        return f.read()


def _image_identity(data):
    """The identity the library bytes ``data`` export (None if none); elf.NotLibrary if they are not a
    whole ELF shared library (a truncated file: the loader would map pages past its end)."""
    return elf.Image(data).string(IDENTITY)


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


def _usable(lib, summ, want, warn=True):
    """Whether the cached ``lib`` can be served, judged from its bytes (nothing is mapped or run): a file
    only this user can write, matching its checksum, a whole ELF library exporting the identity ``want``
    (another program's library renamed to this one does not)."""
    try:
        with open(summ) as f:
            digest = f.read().strip()
        data = read_library(lib)
    except OSError:
        return False
    except Untrusted as e:
        why = f"a file this process does not trust ({e})"
    else:
        if hashlib.sha256(data).hexdigest() != digest:
            return False   # corrupt, or a build interrupted between the library and its checksum: rebuilt quietly
        try:
            found = _image_identity(data)
        except elf.NotLibrary as e:
            why = f"not a whole shared library ({e})"
        else:
            if found == want:
                return True
            why = f"another build ({f'its identity: {found!r}' if found else f'it exports no {IDENTITY}'})"
    if warn:
        log.warning("native build %s: the cached library is %s; it was not loaded; rebuilding it",
                    os.path.basename(lib), why)
    return False


def build(source: str, name: str = "tg", what: str = "") -> str:
    """Path to the shared library for ``source`` (compiled now unless a valid cached copy exists).
    ``what``: the program it is, in words (``"a program of 100,000 nodes"``), for a compiler crash's message."""
    t0 = time.perf_counter()
    cc = find_compiler()
    who = compiler_identity(cc, *cc_args())
    key = _key(source, who)
    d = cache_dir()
    lib = os.path.join(d, f"{name}-{key}.so")
    summ = lib + ".sum"
    want = identity(lib, source, cc, who)
    if _usable(lib, summ, want):
        _touch(lib)
        log.info("native build %s: cache hit (%s)", os.path.basename(lib), d)
        return lib
    with _open_lock(os.path.join(d, f"{name}-{key}.lock"), d) as lock:
        _acquire(lock, lib)
        try:
            if _usable(lib, summ, want, warn=False):      # another process built it while we waited
                log.info("native build %s: built by another process while waiting", os.path.basename(lib))
                return lib
            sweep_temporaries(d, None, marker=".tmp-")   # every key's: dead builders' folders
            _compile(cc, source, lib, summ, d, f"{name}-{key}.tmp-{os.getpid()}-", want, what)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    log.info("native build %s: cache miss, compiled with %s in %.2f s", os.path.basename(lib),
             _cc_name(cc), time.perf_counter() - t0)
    _evict(d, keep=lib)
    return lib


def _open_lock(path, d):
    """The per-key lock file, opened for ``flock`` without following a symbolic link and without truncating
    (a link planted at ``path`` would otherwise have its target emptied)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0),
                     0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BuildError(f"native backend: the lock file {path} is a symbolic link; refused (it is not "
                             f"followed); remove it (the build cache {d} should hold only tapegrad's files)") from None
        raise BuildError(f"native backend: cannot write the build cache {d}: {e.strerror or e}; point ${ENV} at "
                         f"a writable folder") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise BuildError(f"native backend: the lock file {path} is not a regular file; refused; remove it (the "
                         f"build cache {d} should hold only tapegrad's files)")
    return f


def _acquire(lock, lib):
    """Take the per-key lock; a holder that keeps it past the compile timeout (plus a margin) is an error."""
    deadline = time.monotonic() + _env_number(TIMEOUT_ENV, 300.0) + 30.0
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BuildError(f"native backend: another process has been building {os.path.basename(lib)} "
                                 f"for longer than ${TIMEOUT_ENV} allows; is its compiler hung?") from None
            time.sleep(0.05)


CRASHED = re.compile(r"internal compiler error|Segmentation fault|[Oo]ut of memory|virtual memory exhausted|"
                     r"[Cc]annot allocate memory|Killed signal terminated|terminated by signal")


def _compile(cc, source, lib, summ, d, prefix, want, what=""):
    """Compile ``source`` with the identity ``want`` appended in a private temporary folder
    (``<prefix>XXXX/``), check that the library exports it, then rename the library into place.

    A compiler orphaned by a ``kill -9`` of this process may still write its output later: into a
    folder that the next build has removed, so it leaves nothing behind. Every path on the command
    line is absolute (``cache_dir``), so none can be read as an option.
    """
    try:
        work = tempfile.mkdtemp(dir=d, prefix=prefix)
    except OSError as e:
        raise BuildError(f"native backend: cannot write the build cache {d}: {e.strerror or e}; point ${ENV} at "
                         f"a writable folder") from None
    src, tmp = os.path.join(work, "src.c"), os.path.join(work, "lib.so")
    timeout = _env_number(TIMEOUT_ENV, 300.0)
    name = _cc_name(cc)
    try:
        with open(src, "w") as f:
            f.write(source + stamp(want))
        try:
            code, _, err = run_compiler([cc, *cc_args(), *flags(), *quirks(cc, *cc_args()), "-o", tmp, src, "-lm"],
                                        timeout)
        except OSError as e:
            raise BuildError(f"native backend: the C compiler {cc} cannot run: {e}") from None
        except subprocess.TimeoutExpired:
            raise BuildError(f"native backend: {name} did not finish within {timeout:g} s "
                             f"(${TIMEOUT_ENV}); it was killed with its children{_size_note(source, what)}") from None
        if code != 0:
            kept = lib[:-3] + ".failed.c"     # one per key, kept for a bug report
            os.replace(src, kept)
            status = f"signal {-code}" if code < 0 else f"exit {code}"
            if code < 0 or CRASHED.search(err):
                raise BuildError(f"native backend: {name} crashed ({status}) on generated source {kept}"
                                 f"{_size_note(source, what)}. Compilers can crash or run out of memory on very "
                                 f"large functions: capture with backend=\"numpy\" (the same program, no compiler), "
                                 f"or capture a smaller program (fewer steps or layers per episode). "
                                 f"{f'The compiler said:{chr(10)}{err[-4000:]}' if err.strip() else 'It said nothing.'}")
            raise BuildError(f"native backend: {name} failed ({status}) on generated source {kept}:\n{err[-4000:]}")
        if not os.path.isfile(tmp) or os.path.getsize(tmp) == 0:
            raise BuildError(f"native backend: {name} exited 0 but wrote no library; check CC")
        os.chmod(tmp, 0o700)   # the cache serves only files no one else can write, whatever the umask
        data = _check_built(tmp, want, name, lib)
        if err.strip():
            log.warning("native build %s: compiler warnings (set %s=1 to make them errors):\n%s",
                        os.path.basename(lib), WERROR_ENV, err[-4000:])
        os.replace(tmp, lib)
        stmp = os.path.join(work, "sum")
        with open(stmp, "w") as f:
            f.write(hashlib.sha256(data).hexdigest())
        os.replace(stmp, summ)
    except OSError as e:
        raise BuildError(f"native backend: cannot write the build cache {d}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _size_note(source, what):
    """`` (the generated source: N lines, M MB, <what>)``: how big the program a compiler choked on is."""
    lines = source.count("\n") + 1
    return f" (the generated source: {lines:,} lines, {len(source) / 1e6:.1f} MB{', ' + what if what else ''})"


def _check_built(tmp, want, name, lib):
    """A compiled library goes into the cache only if its bytes are a whole ELF library exporting ``want``,
    and then the loader accepts it (it is our own compiler's output, in our own private folder); its bytes."""
    try:
        data = read_library(tmp)
        found = _image_identity(data)
    except (elf.NotLibrary, Untrusted) as e:
        raise BuildError(f"native backend: {name} exited 0 but wrote a file that is not a loadable library ({e}); "
                         f"nothing was cached for {os.path.basename(lib)}; check CC") from None
    if found != want:
        raise BuildError(f"native backend: {name} exited 0 but its library for {os.path.basename(lib)} "
                         f"{f'exports the identity {found!r}' if found else f'exports no {IDENTITY}'} instead of "
                         f"{want!r} (was the source compiled at all?); nothing was cached; check CC")
    try:
        handle = ctypes.CDLL(tmp)
    except OSError as e:
        raise BuildError(f"native backend: {name} exited 0 but wrote a library the loader rejects ({e}); "
                         f"nothing was cached for {os.path.basename(lib)}; check CC") from None
    _close(handle)
    return data


def load(path):
    """Load a library ``build`` returned, after checking from its bytes, before it is mapped, that it is a
    file only this user can write, a whole ELF library, and the build its file name says (its
    ``tg_identity`` names that file); BuildError otherwise, and nothing of it ran."""
    want = f"tapegrad {os.path.basename(path)[:-3]};"
    try:
        found = _image_identity(read_library(path))
    except OSError as e:
        raise BuildError(f"native backend: cannot load {path}: {e}") from None
    except (Untrusted, elf.NotLibrary) as e:
        raise BuildError(f"native backend: {path} is not a library this process loads: {e}; it was not loaded "
                         f"(the next build of this program replaces it)") from None
    if found is None or not found.startswith(want):
        raise BuildError(f"native backend: {path} is not the library its name says: expected an {IDENTITY} "
                         f"starting {want!r}, found {repr(found) if found else f'no {IDENTITY}'}; it was not "
                         f"loaded or called (the next build of this program replaces it)")
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise BuildError(f"native backend: cannot load {path}: {e}") from None


# ── cache management ─────────────────────────────────────────────────────────

def _touch(lib):
    try:
        os.utime(lib)
    except OSError:
        pass


def _entries(d):
    """[(mtime, bytes, library path)] of the cached libraries in ``d`` (a library counts with its .sum)."""
    out = []
    for f in os.listdir(d):
        if f.endswith(".so"):
            p = os.path.join(d, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size + _size(p + ".sum"), p))
    return sorted(out)


def _size(p):
    try:
        return os.path.getsize(p)
    except OSError:
        return 0


def _remove(lib):
    for p in (lib, lib + ".sum", lib[:-3] + ".lock"):
        try:
            os.unlink(p)
        except OSError:
            pass


def _evict(d, keep):
    limit = _env_number(MAX_ENV, 1024.0) * (1 << 20)
    entries = _entries(d)
    total = sum(n for _, n, _ in entries)
    for _, n, p in entries:
        if total <= limit:
            break
        if p != keep:
            _remove(p)
            total -= n
            log.info("native build cache: evicted %s (over $%s)", os.path.basename(p), MAX_ENV)


def cache_info() -> dict:
    """The build cache: its folder, how many libraries it holds, their bytes, and the size limit.

    >>> from tapegrad import native
    >>> sorted(native.cache_info())
    ['bytes', 'entries', 'limit_bytes', 'path']
    """
    d = cache_dir()
    entries = _entries(d)
    return {"path": d, "entries": len(entries), "bytes": sum(n for _, n, _ in entries),
            "limit_bytes": int(_env_number(MAX_ENV, 1024.0) * (1 << 20))}


def clear_cache() -> int:
    """Remove every cached library (and stale temporaries); returns how many libraries were removed.

    Programs already loaded keep running (the loader holds their code); the next capture rebuilds.
    """
    d = cache_dir()
    entries = _entries(d)
    for _, _, p in entries:
        _remove(p)
    sweep_temporaries(d, None, marker=".tmp-")
    for f in os.listdir(d):
        if f.endswith(".failed.c"):
            _remove(os.path.join(d, f[:-len(".failed.c")] + ".so"))
            os.unlink(os.path.join(d, f))
    log.info("native build cache: cleared %d libraries from %s", len(entries), d)
    return len(entries)
