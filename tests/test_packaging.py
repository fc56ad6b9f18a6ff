"""Packaging as a library: the exports, the metadata, setup.py's build of the C core, and an sdist whose
tests pass after unpacking it."""
import builtins
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

import tapegrad as tg
from tapegrad import functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILTIN_NAMES = ("abs", "max", "min", "sum")


# ── the exports ──────────────────────────────────────────────────────────────

def test_every_exported_name_exists_once():
    assert len(tg.__all__) == len(set(tg.__all__))
    assert [n for n in tg.__all__ if not hasattr(tg, n)] == []


def test_import_star_leaves_pythons_builtins_alone():
    namespace: dict = {}
    exec("from tapegrad import *\nresult = sum([1, 2, 3]), max(1, 5), min(4, 2), abs(-3)", namespace)
    assert namespace["result"] == (6, 5, 2, 3)
    assert "Tape" in namespace and "softmax_cross_entropy" in namespace
    assert not set(BUILTIN_NAMES) & set(tg.__all__)
    assert all(getattr(tg, n) is getattr(F, n) for n in BUILTIN_NAMES)   # tg.sum is still the op
    assert all(hasattr(builtins, n) for n in BUILTIN_NAMES)


def test_every_public_function_of_functional_is_exported():
    public = {n for n, v in vars(F).items() if not n.startswith("_") and (inspect.isfunction(v) or callable(v))
              and getattr(v, "__module__", None) == F.__name__ and not inspect.isclass(v)}
    public -= {"getitem"}   # x[key]; not a function users call by name
    assert public - set(tg.__all__) - set(BUILTIN_NAMES) == set()


def test_interop_exports_and_version():
    pytest.importorskip("jax")
    import interop
    assert [n for n in interop.__all__ if not hasattr(interop, n)] == []
    assert interop.__version__ == tg.__version__


# ── the metadata ─────────────────────────────────────────────────────────────

def test_one_version_everywhere():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    citation = re.search(r'^version: "([^"]+)"$', (ROOT / "CITATION.cff").read_text(), re.M).group(1)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert meta["version"] == tg.__version__ == citation
    assert f"## [{tg.__version__}]" in changelog and "## Deprecation policy" in changelog


def test_project_metadata_a_registry_shows():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT" and meta["authors"] and {"Homepage", "Changelog", "Issues"} <= set(meta["urls"])
    lowest = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", meta["requires-python"]).groups())
    pythons = [tuple(int(x) for x in c.rsplit(" ", 1)[1].split(".")) for c in meta["classifiers"]
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert pythons and min(pythons) == lowest
    assert "Typing :: Typed" in meta["classifiers"]
    assert not any(c.startswith("License ::") for c in meta["classifiers"])   # PEP 639: the expression says it
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "ext-modules" not in build     # setuptools calls that table experimental: setup.py builds the core


# ── setup.py: the C core, or a warning that says what it costs ────────────────

BUILD = """
import runpy, sys, warnings
from setuptools import Distribution
setup = runpy.run_path({setup!r}, run_name="tapegrad_setup")
dist = Distribution({{"name": "tapegrad", "ext_modules": [setup["CORE"]],
                     "cmdclass": {{"build_ext": setup["BuildCore"]}}}})
cmd = dist.get_command_obj("build_ext")
cmd.build_lib, cmd.build_temp = {out!r}, {tmp!r}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    dist.run_command("build_ext")
print(len(w))
for x in w:
    print(x.message)
"""


def _build(tmp_path, cc):
    out, tmp = tmp_path / "lib", tmp_path / "tmp"
    code = BUILD.format(setup=str(ROOT / "setup.py"), out=str(out), tmp=str(tmp))
    env = {**os.environ, "CC": cc}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines(), sorted(p.name for p in out.rglob("_ctape*.so"))


def test_a_failed_build_of_the_core_is_a_warning_with_the_cost_and_the_fix(tmp_path):
    lines, built = _build(tmp_path, "false")    # a compiler that always fails
    assert built == [] and lines[0] == "1"
    message = lines[1]
    assert message.startswith("tapegrad: the tape's C core (tapegrad/_ctape.c) could not be built (")
    assert "about 1.6x slower" in message and "apt-get install python3-dev gcc" in message
    assert "reinstall tapegrad" in message and "TAPEGRAD_PURE=1" in message


def test_with_a_compiler_setup_py_builds_the_core_silently(tmp_path):
    from tapegrad.native import build
    try:
        cc = build.find_compiler()
    except tg.BuildError as e:
        pytest.skip(str(e))
    lines, built = _build(tmp_path, cc)
    assert lines == ["0"] and len(built) == 1 and built[0].startswith("_ctape.")


# ── the sdist ────────────────────────────────────────────────────────────────

def _tracked(*folders):
    try:
        r = subprocess.run(["git", "ls-files", *folders], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return set(r.stdout.split()) if r.returncode == 0 and r.stdout else None


HOOK = "from setuptools import build_meta; import sys; print(getattr(build_meta, sys.argv[1])(sys.argv[2]))"


def _hook(name, out, cwd):
    """setuptools' PEP 517 hook ``name`` run in a subprocess in ``cwd``, as pip's build calls it; the file's name."""
    pytest.importorskip("setuptools.build_meta")
    r = subprocess.run([sys.executable, "-c", HOOK, name, str(out)], cwd=cwd, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split()[-1]


def _unpacked_sdist(tmp_path):
    name = _hook("build_sdist", tmp_path / "dist", cwd=ROOT)
    with tarfile.open(tmp_path / "dist" / name) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    return tmp_path / "unpacked" / name.removesuffix(".tar.gz")


def test_the_sdist_holds_what_the_tests_read_and_they_pass_unpacked(tmp_path):
    """The sdist is built by setuptools' own hook, unpacked, its C core built by its setup.py, and a few tests
    that read docs/ and experiments/ run there."""
    tree = _unpacked_sdist(tmp_path)
    held = {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}
    tracked = _tracked("docs", "experiments", "tests", "tools", "tapegrad", "interop", ".ci")
    if tracked is not None:
        assert tracked - held == set()
    assert not [f for f in held if f.endswith((".so", ".pyc")) or f.startswith(("site/", "experiments/out/"))]

    run = lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=tree, capture_output=True, text=True,  # noqa: E731
                                      timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    r = run("setup.py", "-q", "build_ext", "--inplace")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run("-c", "import tapegrad; print(tapegrad.__file__, tapegrad.Tape._fast is not None)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(tree / "tapegrad" / "__init__.py"), "True"]   # the unpacked tree's, its core built
    r = run("-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-x", "-q", "tests/test_docs.py",
            "tests/test_tape.py")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", r.stdout) and " failed" not in r.stdout, r.stdout[-2000:]


WHEEL_HOLDS = ["tapegrad/py.typed", "interop/py.typed", "tapegrad/environment.py", "tapegrad/__main__.py",
               "tapegrad/ops/__init__.py", "tapegrad/native/runtime.c", "interop/xla/tg_xla.c", "interop/xla/tg_gpu.c"]


def test_the_wheel_built_from_the_sdist_holds_the_package(tmp_path):
    """What pip does with an sdist: setuptools' hooks build a wheel from the unpacked tree."""
    tree = _unpacked_sdist(tmp_path)
    with zipfile.ZipFile(tmp_path / "wheel" / _hook("build_wheel", tmp_path / "wheel", cwd=tree)) as whl:
        names = set(whl.namelist())
    assert [f for f in WHEEL_HOLDS if f not in names] == []
    assert [f for f in names if re.fullmatch(r"tapegrad/_ctape\..*\.so", f)], sorted(names)   # the core, built
    assert not [f for f in names if f.startswith(("tests/", "docs/", "experiments/"))]
