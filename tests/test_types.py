"""The public modules type-check (mypy, configured in pyproject.toml) and ship their annotations (py.typed)."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ["tapegrad/__init__.py", "tapegrad/errors.py", "tapegrad/tape.py", "tapegrad/capture.py",
          "tapegrad/optim.py", "tapegrad/checkpoint.py", "tapegrad/functional.py", "tapegrad/gradcheck.py",
          "interop/__init__.py", "interop/program.py", "interop/function.py", "interop/dlpack.py",
          "interop/parity.py", "interop/oracle.py"]


def test_public_modules_type_check():
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", *PUBLIC], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_packages_are_marked_typed():
    for pkg in ("tapegrad", "interop"):
        assert (ROOT / pkg / "py.typed").exists()
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'tapegrad = ["py.typed"]' in toml and '"py.typed"]' in toml.split("interop =", 1)[1].split("\n", 1)[0]
