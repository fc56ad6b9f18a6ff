"""What this installation is made of: the environment report (``tapegrad.info()``), the C core's state and
interop's identity.

Reading the report imports nothing optional: jax's version comes from its package metadata and its
64-bit mode from the live ``jax`` module only where the process has already imported it; CuPy is
imported only where it is installed, to count its devices.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import warnings
from typing import Optional, TextIO

# The marker interop/__init__.py holds: the proof that `import interop` finds tapegrad's package, read
# from the file's text so that checking it imports neither interop nor jax.
INTEROP_MARKER = "__tapegrad_interop__"
PURE_ENV = "TAPEGRAD_PURE"
_REINSTALL = "pip install --force-reinstall --no-deps tapegrad"
_OTHER = "Illumina's InterOp (PyPI `interop`)"


class CCoreWarning(RuntimeWarning):
    """The tape's C core (``tapegrad/_ctape.c``) is not built: the eager tape runs in Python, slower.

    Warned once, at ``import tapegrad``, unless ``TAPEGRAD_PURE=1`` chose the Python paths.
    """


def c_core() -> dict:
    """The C core's state: ``built`` (its extension imports), ``active`` (the tape uses it), ``pure``
    (``$TAPEGRAD_PURE`` chose the Python paths), ``path`` of the extension and ``error`` when it failed.

    >>> import tapegrad as tg
    >>> sorted(tg.environment.c_core())
    ['active', 'built', 'error', 'path', 'pure']
    """
    from .tape import Tape
    try:
        core = importlib.import_module("tapegrad._ctape")
        built, path, error = True, getattr(core, "__file__", None), None
    except ImportError as e:
        built, path, error = False, None, str(e)
    return {"built": built, "active": Tape._fast is not None, "pure": bool(os.environ.get(PURE_ENV)),
            "path": path, "error": error}


def not_built_message(error: Optional[str]) -> str:
    """What the import-time warning says: the cost and the fix."""
    return (f"tapegrad: the tape's C core (tapegrad._ctape) is not built ({error}), so the eager tape runs its "
            f"Python paths, about 1.6x slower. To build it, install Python's headers and a C compiler (e.g. "
            f"`apt-get install python3-dev gcc`) and reinstall tapegrad ({_REINSTALL}, or pip install -e . in a "
            f"checkout). Set {PURE_ENV}=1 to choose the Python paths on purpose and silence this warning.")


def warn_if_no_c_core() -> None:
    """Warn (``CCoreWarning``) when the C core could not be loaded and ``$TAPEGRAD_PURE`` did not ask for that.

    ``tapegrad/__init__`` calls it once, so a process warns once."""
    from .tape import Tape
    if Tape._fast is not None or os.environ.get(PURE_ENV):
        return
    warnings.warn(not_built_message(c_core()["error"]), CCoreWarning, stacklevel=3)


def interop_check() -> str:
    """The path of tapegrad's ``interop`` package, after checking that ``import interop`` finds it.

    ``interop`` is also the import name of another PyPI project (Illumina's InterOp). Installing it after
    tapegrad replaces ``interop/__init__.py``; uninstalling it then deletes that file, leaving a folder
    without ``check_grads``. Code inside the replaced file cannot notice, so the check lives here: it reads
    the file ``import interop`` would run (importing neither interop nor jax) and looks for interop's
    marker.

    Returns:
        The folder of tapegrad's ``interop`` package.

    Raises:
        ImportError: If the name ``interop`` is shadowed by another package, emptied or gone (the
            message names the other package and the fix).

    Examples:
        >>> import tapegrad as tg, os
        >>> os.path.basename(tg.interop_check())
        'interop'
    """
    spec = importlib.util.find_spec("interop")
    if spec is None:
        raise ImportError(f"tapegrad: no package `interop` can be imported, though tapegrad installs it beside "
                          f"itself; reinstall tapegrad: {_REINSTALL}")
    where = list(spec.submodule_search_locations or [])
    if spec.origin is None or spec.loader is None or not os.path.isfile(spec.origin):
        raise ImportError(f"tapegrad: `interop` ({', '.join(where) or '?'}) has no __init__.py, so it has no "
                          f"check_grads: uninstalling {_OTHER}, which installs the same top-level name, deletes "
                          f"the interop/__init__.py that tapegrad installed. Reinstall tapegrad: {_REINSTALL}")
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as f:
            ours = INTEROP_MARKER in f.read()
    except OSError as e:
        raise ImportError(f"tapegrad: cannot read {spec.origin} to check that it is tapegrad's interop: {e}") from None
    if not ours or os.path.basename(spec.origin) != "__init__.py":
        raise ImportError(f"tapegrad: `import interop` finds {spec.origin}, which is not tapegrad's interop: "
                          f"another package installed the same top-level name, most likely {_OTHER} "
                          f"(`pip show interop` names the one installed). Uninstall it (pip uninstall interop) and "
                          f"reinstall tapegrad ({_REINSTALL}), or keep the two in separate environments.")
    return os.path.dirname(spec.origin)


# ── the report ───────────────────────────────────────────────────────────────

def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def _c_core_line() -> str:
    s = c_core()
    if s["active"]:
        return f"built, in use ({s['path']})"
    if s["built"]:
        return f"built, not in use: {PURE_ENV}={os.environ.get(PURE_ENV)!r} chooses the Python paths"
    pure = f"; {PURE_ENV} is set, so on purpose" if s["pure"] else ""
    return f"NOT built ({s['error']}): the eager tape runs in Python, about 1.6x slower{pure}"


def _native_lines() -> list[str]:
    from .errors import BuildError
    from .native import build
    try:
        cc = build.find_compiler()
        who = _first_line(build.compiler_identity(cc, *build.cc_args()).split("\n", 1)[1])
        compiler = f"{' '.join([cc, *build.cc_args()])} ({who or 'no --version text'})"
    except BuildError as e:
        compiler = f"none: {e}"
    try:
        march = f"{build.march()}" + ("" if os.environ.get(build.MARCH_ENV) else f" (${build.MARCH_ENV} unset)")
        flags = " ".join(build.flags())
    except BuildError as e:
        march, flags = f"invalid: {e}", "?"
    return [f"compiler  {compiler}", f"-march    {march}", f"flags     {flags}"]


def _blas_lines() -> list[str]:
    from .errors import BuildError
    from .native import runner
    out = []
    try:
        from threadpoolctl import threadpool_info
        for d in threadpool_info():
            if d.get("user_api") == "blas":
                out.append(f"loaded    {d.get('internal_api')} {d.get('version')}, kernel "
                           f"{d.get('architecture') or '?'}, {d.get('num_threads')} threads ({d.get('filepath')})")
    except ImportError:   # NumPy's build configuration still names its BLAS, if not the kernel it runs
        out.append(f"numpy's   {_numpy_blas()} (NumPy's build configuration; threadpoolctl is not installed)")
    try:
        _, _, bits, path = runner.blas_pointers("float64")
        core = runner.blas_core("float64")
        out.append(f"programs  {path} ({bits}-bit integers{', kernel ' + core if core else ''})")
    except BuildError as e:
        out.append(f"programs  none: {e}")
    return out or ["loaded    none reported"]


def _numpy_blas() -> str:
    import numpy
    try:
        blas = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:   # NumPy before 1.26 prints its configuration only
        return "?"
    return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()


def _cache_line() -> str:
    from .errors import BuildError
    from .native import build
    try:
        c = build.cache_info()
    except BuildError as e:
        return f"unusable: {e}"
    return (f"{c['path']}: {c['entries']} libraries, {c['bytes'] / 2**20:.1f} MiB (limit "
            f"{c['limit_bytes'] / 2**20:.0f} MiB)")


def _cupy_line() -> str:
    if sys.modules.get("cupy") is None and importlib.util.find_spec("cupy") is None:
        return "not installed"
    try:
        import cupy   # only here: counting devices needs the module
        n = cupy.cuda.runtime.getDeviceCount()
        names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        devices = f"{n} device{'s' if n != 1 else ''}" + (f": {', '.join(names)}" if names else "")
    except Exception as e:   # a CUDA driver missing or broken is what this line is for
        return f"{getattr(sys.modules.get('cupy'), '__version__', '?')}, no usable device ({type(e).__name__}: {e})"
    return f"{cupy.__version__}, {devices}"


def _jax_line() -> str:
    v = _version("jax")
    if v is None:
        return "not installed (pip install 'tapegrad[jax]' for interop)"
    live = sys.modules.get("jax")
    if live is not None:
        x64 = f"x64 {'on' if live.config.jax_enable_x64 else 'off'}"
    else:
        env = os.environ.get("JAX_ENABLE_X64")
        given = "$JAX_ENABLE_X64 unset" if env is None else f"$JAX_ENABLE_X64={env!r}"
        x64 = f"x64 {'on' if env and env.lower() in ('1', 'true', 'yes', 'on') else 'off'} " \
              f"({given}; jax not imported in this process)"
    return f"{v} (jaxlib {_version('jaxlib') or 'missing'}), {x64}"


def _interop_line() -> str:
    # the other project's distribution is named `interop`; tapegrad's is `tapegrad`
    other = _version("interop")
    clash = "" if other is None else (f"; and {_OTHER} {other} is installed here too: the two share the folder, "
                                      f"and uninstalling either deletes the interop/__init__.py both rely on")
    try:
        found = interop_check()
    except ImportError as e:
        return f"PROBLEM: {e}"
    if _version("jax") is None:
        return f"unavailable: JAX is not installed (pip install \"tapegrad[jax]\"); the package is at {found}{clash}"
    return f"ok ({found}){clash}"


# the variables that change what tapegrad builds or runs
_ENV_PREFIXES, _ENV_NAMES = ("TAPEGRAD_", "OPENBLAS_"), ("CC", "OMP_NUM_THREADS", "JAX_ENABLE_X64")


def report() -> str:
    """The environment as text, one screen: what a bug report needs (``python -m tapegrad info`` prints it).

    >>> import tapegrad as tg
    >>> text = tg.environment.report()
    >>> text.splitlines()[0].startswith("tapegrad ")
    True
    """
    from ._version import __version__
    import numpy
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
    rows = [f"tapegrad  {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
            f"python    {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
            f"platform  {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs",
            f"numpy     {numpy.__version__}",
            f"scipy     {_version('scipy') or 'not installed'}",
            f"C core    {_c_core_line()}",
            "native backend:", *("  " + line for line in _native_lines()),
            "BLAS:", *("  " + line for line in _blas_lines()),
            f"cache     {_cache_line()}",
            f"cupy      {_cupy_line()}",
            f"jax       {_jax_line()}",
            f"interop   {_interop_line()}",
            f"env       {' '.join(env) if env else 'none of TAPEGRAD_*, OPENBLAS_*, CC, OMP_NUM_THREADS set'}"]
    return "\n".join(rows)


def info(file: Optional[TextIO] = None) -> None:
    """Print the environment report to ``file``: paste it into a bug report.

    The report (``tapegrad.environment.report()``; ``python -m tapegrad info`` prints it too) names
    the versions, the C core, the native backend's compiler and cache, the BLAS, CuPy, JAX, interop
    and the environment variables that change what tapegrad builds or runs.

    Args:
        file: A text stream; None: standard output.

    Examples:
        >>> import io, tapegrad as tg
        >>> out = io.StringIO(); tg.info(out)
        >>> out.getvalue().startswith("tapegrad ")
        True
    """
    print(report(), file=file if file is not None else sys.stdout)
