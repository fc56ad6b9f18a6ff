"""The environment report (`python -m tapegrad info`), the warning when the C core is missing, and the
check that `import interop` finds tapegrad's package (not another one of the same name)."""
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import subprocess
import sys
import types

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import environment
from tapegrad.native import build
from tapegrad.tape import Tape

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_CORE = "import sys; sys.modules['tapegrad._ctape'] = None\n"   # `from . import _ctape` then fails


def _python(code, env=None, cwd=ROOT, args=()):
    base = {k: v for k, v in os.environ.items() if k not in ("TAPEGRAD_PURE", "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={**base, **(env or {})}, timeout=120)


def _row(text, label):
    rows = [line for line in text.splitlines() if line.strip().startswith(label)]
    assert len(rows) == 1, (label, text)
    return rows[0].strip()[len(label):].strip()


# ── the report ───────────────────────────────────────────────────────────────

def test_report_names_each_part_as_the_libraries_themselves_report_it():
    text = environment.report()
    assert _row(text, "tapegrad").startswith(tg.__version__ + " (")
    assert _row(text, "python").startswith(platform.python_version() + " (")
    assert _row(text, "numpy") == np.__version__
    assert _row(text, "scipy") == importlib.metadata.version("scipy")
    cc = build.find_compiler()
    assert _row(text, "compiler").startswith(" ".join([cc, *build.cc_args()]) + " (")
    assert _row(text, "flags") == " ".join(build.flags())
    assert _row(text, "-march").split()[0] == build.march()
    cache = build.cache_info()
    assert _row(text, "cache").startswith(f"{cache['path']}: {cache['entries']} libraries, ")
    assert _row(text, "interop") == f"ok ({ROOT / 'interop'})"
    assert len(text.splitlines()) <= 30    # one screen


def test_report_names_the_blas_threadpoolctl_finds_and_the_one_programs_call():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from tapegrad.native import runner
    text = environment.report()
    blas = [d for d in threadpoolctl.threadpool_info() if d["user_api"] == "blas"]
    for d in blas:
        assert f"{d['internal_api']} {d['version']}, kernel {d.get('architecture') or '?'}" in text
        assert d["filepath"] in text
    assert _row(text, "programs").startswith(runner.blas_pointers("float64")[3] + " (")


def test_without_threadpoolctl_numpys_build_configuration_names_the_blas(monkeypatch):
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)     # `import threadpoolctl` now fails
    row = _row(environment.report(), "numpy's")
    assert row == f"{blas['name']} {blas['version']} (NumPy's build configuration; threadpoolctl is not installed)"


def _fake_cupy(count):
    def device_count():
        if isinstance(count, Exception):
            raise count
        return count
    props = lambda i: {"name": f"NVIDIA H{100 + i}".encode()}   # noqa: E731 - bytes, as CUDA's runtime gives
    runtime = types.SimpleNamespace(getDeviceCount=device_count, getDeviceProperties=props)
    return types.SimpleNamespace(__version__="13.6.0", cuda=types.SimpleNamespace(runtime=runtime))


def test_the_cupy_row_counts_and_names_the_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(2))
    assert _row(environment.report(), "cupy") == "13.6.0, 2 devices: NVIDIA H100, NVIDIA H101"
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorInsufficientDriver")))
    assert _row(environment.report(), "cupy") == \
        "13.6.0, no usable device (RuntimeError: cudaErrorInsufficientDriver)"
    monkeypatch.setitem(sys.modules, "cupy", None)
    if importlib.util.find_spec("cupy") is None:
        assert _row(environment.report(), "cupy") == "not installed"


def test_report_c_core_row_follows_the_tape():
    row = _row(environment.report(), "C core")
    if Tape._fast is not None:
        assert row.startswith("built, in use (") and row.endswith(".so)")
    else:
        assert "NOT built" in row or "not in use" in row


def test_march_from_the_environment(monkeypatch):
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v2")
    text = environment.report()
    assert _row(text, "-march") == "x86-64-v2"
    assert "-march=x86-64-v2" in _row(text, "flags") and "TAPEGRAD_MARCH=x86-64-v2" in _row(text, "env")
    monkeypatch.setenv(build.MARCH_ENV, "not one word")
    assert _row(environment.report(), "-march").startswith("invalid: native backend: $TAPEGRAD_MARCH must name")


def test_no_compiler_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc-for-the-report")
    assert _row(environment.report(), "compiler").startswith("none: native backend: no C compiler found")


def test_python_m_tapegrad_info_prints_it_without_importing_jax():
    r = _python("import runpy, sys; sys.argv = ['tapegrad', 'info']\n"
                "try:\n    runpy.run_module('tapegrad', run_name='__main__')\n"
                "except SystemExit as e:\n    assert e.code == 0, e.code\n"
                "print('JAX IMPORTED' if 'jax' in sys.modules else 'no jax')", env={"JAX_ENABLE_X64": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"tapegrad  {tg.__version__}")
    assert r.stdout.splitlines()[-1] == "no jax"
    jax_version = importlib.metadata.version("jax")
    assert f"jax       {jax_version} (jaxlib " in r.stdout
    assert "x64 on ($JAX_ENABLE_X64='1'; jax not imported in this process)" in r.stdout


def test_x64_mode_read_from_jax_where_the_process_imported_it():
    pytest.importorskip("jax")
    r = _python("import jax; jax.config.update('jax_enable_x64', False)\n"
                "import tapegrad as tg; tg.info()", env={"JAX_ENABLE_X64": "1"})
    assert r.returncode == 0, r.stderr
    assert "), x64 off" in r.stdout and "not imported" not in r.stdout


def test_python_m_tapegrad_without_a_command_prints_its_usage():
    r = subprocess.run([sys.executable, "-m", "tapegrad"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("usage: python -m tapegrad info")


# ── the C core's warning ─────────────────────────────────────────────────────

def test_a_missing_c_core_warns_once_with_the_cost_and_the_fix():
    r = _python(NO_CORE + "import warnings\n"
                "with warnings.catch_warnings(record=True) as w:\n"
                "    warnings.simplefilter('always')\n"
                "    import tapegrad as tg\n"
                "    import tapegrad\n"
                "    import numpy as np\n"
                "    tape = tg.Tape(); x = tape.param(np.array([3.0]))\n"
                "    tape.backward((x * x).sum())\n"
                "print(len(w), w[0].category.__name__, issubclass(w[0].category, RuntimeWarning))\n"
                "print(tg.Tape._fast is None, tape.grad(x).tolist())\n"
                "print(w[0].message)")
    assert r.returncode == 0, r.stderr
    count, works, message = r.stdout.splitlines()
    assert count == "1 CCoreWarning True"
    assert works == "True [6.0]"                       # the Python paths serve
    assert "C core (tapegrad._ctape) is not built (import of tapegrad._ctape halted" in message
    assert "about 1.6x slower" in message and "apt-get install python3-dev gcc" in message
    assert "reinstall tapegrad" in message and "Set TAPEGRAD_PURE=1" in message


def test_the_warning_shows_under_pythons_default_filters():
    r = _python(NO_CORE + "import tapegrad")
    assert r.returncode == 0 and "CCoreWarning: tapegrad: the tape's C core" in r.stderr, r.stderr


def test_tapegrad_pure_chooses_the_python_paths_silently():
    for setup in ("", NO_CORE):
        r = _python(setup + "import warnings; warnings.simplefilter('error')\n"
                    "import tapegrad as tg; print(tg.Tape._fast is None)\n"
                    "print([l for l in tg.environment.report().splitlines() if l.startswith('C core')][0])",
                    env={"TAPEGRAD_PURE": "1"})
        assert r.returncode == 0, r.stderr
        fast_none, row = r.stdout.splitlines()
        assert fast_none == "True"
        if setup:
            assert row.startswith("C core    NOT built") and row.endswith("TAPEGRAD_PURE is set, so on purpose")
        elif Tape._fast is not None:   # built here: the report says it is there and not used
            assert row == "C core    built, not in use: TAPEGRAD_PURE='1' chooses the Python paths"


# ── interop: ours, or another package of the same name ────────────────────────

ILLUMINA_INIT = ('"""Illumina InterOp: reads binary InterOp files of sequencing runs."""\n'
                 'from .py_interop_run import *\n')


def _site(tmp_path, interop_files):
    """A site folder holding tapegrad (a link to this tree's) and an `interop` folder with ``interop_files``."""
    site = tmp_path / "site"
    (site / "interop").mkdir(parents=True)
    (site / "tapegrad").symlink_to(ROOT / "tapegrad", target_is_directory=True)
    for name, text in interop_files.items():
        (site / "interop" / name).write_text(text)
    return site


def _isolated(site, code):
    """``code`` in a python without site's .pth hooks (no editable finder), ``site`` first on its path."""
    others = [p for p in sys.path if p and pathlib.Path(p).resolve() != ROOT]   # this tree holds an interop
    return _python(f"import sys; sys.path[:] = {[str(site), *others]!r}\n" + code, args=("-S",), cwd=site)


def test_a_foreign_interop_is_named_with_the_fix(tmp_path):
    site = _site(tmp_path, {"__init__.py": ILLUMINA_INIT, "py_interop_run.py": "run_info = None\n"})
    r = _isolated(site, "import interop, tapegrad\n"
                        "print(interop.__file__)\n"
                        "try:\n    tapegrad.interop_check()\nexcept ImportError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr
    where, message = r.stdout.splitlines()
    assert where == str(site / "interop" / "__init__.py")
    assert message.startswith(f"tapegrad: `import interop` finds {where}, which is not tapegrad's interop")
    assert "Illumina's InterOp (PyPI `interop`)" in message
    assert "pip uninstall interop" in message and "pip install --force-reinstall --no-deps tapegrad" in message


def test_an_emptied_interop_is_named_with_the_fix(tmp_path):
    # what uninstalling the other package leaves: tapegrad's modules, no __init__.py
    files = {p.name: p.read_text() for p in (ROOT / "interop").glob("*.py") if p.name != "__init__.py"}
    site = _site(tmp_path, files)
    r = _isolated(site, "import interop, tapegrad\n"
                        "print(getattr(interop, '__file__', None), hasattr(interop, 'check_grads'))\n"
                        "try:\n    tapegrad.interop_check()\nexcept ImportError as e:\n    print(e)\n"
                        "print([l for l in tapegrad.environment.report().splitlines() if l.startswith('interop')][0])")
    if r.returncode == 0 and not r.stdout.startswith("None False"):
        pytest.skip(f"another interop on the path takes precedence here: {r.stdout.splitlines()[0]}")
    assert r.returncode == 0, r.stderr
    _, message, row = r.stdout.splitlines()
    assert message.startswith(f"tapegrad: `interop` ({site / 'interop'}) has no __init__.py, so it has no check_grads")
    assert "uninstalling Illumina's InterOp" in message
    assert "pip install --force-reinstall --no-deps tapegrad" in message
    assert row == f"interop   PROBLEM: {message}"


def test_the_other_package_installed_beside_ours_is_reported(tmp_path):
    # tapegrad installed after the other project: our __init__.py won, its dist-info still lists the folder
    files = {p.name: p.read_text() for p in (ROOT / "interop").glob("*.py")}
    site = _site(tmp_path, files)
    info = site / "interop-1.3.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: interop\nVersion: 1.3.2\n")
    r = _isolated(site, "import tapegrad\n"
                        "print([l for l in tapegrad.environment.report().splitlines() if l.startswith('interop')][0])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"interop   ok ({site / 'interop'}); and Illumina's InterOp (PyPI `interop`) 1.3.2 is "
                                f"installed here too: the two share the folder, and uninstalling either deletes the "
                                f"interop/__init__.py both rely on")


def test_ours_passes_the_check_and_carries_the_marker_and_version():
    pytest.importorskip("jax")
    import interop
    assert tg.interop_check() == os.path.dirname(interop.__file__)
    assert interop.__tapegrad_interop__ is True and interop.__version__ == tg.__version__
    # the marker is read from the file's text: a copy without it is foreign
    assert environment.INTEROP_MARKER in (ROOT / "interop" / "__init__.py").read_text()
    assert environment.INTEROP_MARKER not in ILLUMINA_INIT


def test_no_interop_at_all(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "tapegrad").symlink_to(ROOT / "tapegrad", target_is_directory=True)
    r = _isolated(site, "import tapegrad\ntry:\n    tapegrad.interop_check()\nexcept ImportError as e:\n    print(e)\n")
    if "finds" in r.stdout or r.stdout.startswith("tapegrad: `interop` ("):
        pytest.skip("another interop on the path")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("tapegrad: no package `interop` can be imported, though tapegrad installs it beside "
                                "itself; reinstall tapegrad: pip install --force-reinstall --no-deps tapegrad")


def test_import_interop_without_jax_names_the_install_command():
    code = ("import sys\nsys.modules['jax'] = None   # as where JAX is not installed\ntry:\n    import interop\n"
            "except ImportError as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ImportError interop needs JAX, which is not installed")
    assert 'pip install "tapegrad[jax]"' in r.stdout


def test_info_reports_interop_unavailable_without_jax(monkeypatch):
    real = tg.environment._version
    monkeypatch.setattr(tg.environment, "_version", lambda dist: None if dist == "jax" else real(dist))
    line = tg.environment._interop_line()
    assert line.startswith('unavailable: JAX is not installed (pip install "tapegrad[jax]")'), line
