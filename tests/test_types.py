"""The public modules type-check (mypy, configured in pyproject.toml) and ship their annotations (py.typed)."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ["tapegrad/__init__.py", "tapegrad/errors.py", "tapegrad/tape.py", "tapegrad/capture.py",
          "tapegrad/optim.py", "tapegrad/checkpoint.py", "tapegrad/functional.py", "tapegrad/gradcheck.py",
          "interop/__init__.py", "interop/xla/program.py", "interop/xla/function.py", "interop/xla/dlpack.py",
          "interop/capture/parity.py", "interop/oracle/check.py"]


def test_public_modules_type_check():
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", *PUBLIC], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


USER_CODE = """
import numpy as np
import tapegrad as tg

tape = tg.Tape()
w = tape.param(np.ones((2, 2)), name="W")
x = tape.const(np.ones((3, 2)))
loss = (x @ w + 1.0).relu().sum() * 2.0 - w.T.mean()
ok: bool = tape.backward(loss)
g: np.ndarray = tape.grad(w)
program = tg.capture(tape, loss)
v: np.ndarray = program.value("W")
opt = tg.Adam(1e-2, clip=1.0)
opt.add(tape, w)
mark: str = tape.mark()   # the one deliberate error: mark() returns an int
"""


def test_user_code_type_checks_against_the_annotations(tmp_path):
    """Operators on Vars (installed at import) are known to the checker; a wrong type is caught."""
    pytest.importorskip("mypy")
    (tmp_path / "user.py").write_text(USER_CODE)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                        str(tmp_path / "user.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "MYPYPATH": str(ROOT)})
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:15:" in errors[0] and '"int", variable has type "str"' in errors[0], r.stdout


def test_packages_are_marked_typed():
    for pkg in ("tapegrad", "interop"):
        assert (ROOT / pkg / "py.typed").exists()
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'tapegrad = ["py.typed"]' in toml and '"py.typed"]' in toml.split("interop =", 1)[1].split("\n", 1)[0]
