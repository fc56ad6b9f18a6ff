"""tapegrad never imports jax: only interop/ may."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_importing_every_tapegrad_module_loads_no_jax():
    code = ("import importlib, pkgutil, sys, tapegrad\n"
            "for m in pkgutil.walk_packages(tapegrad.__path__, 'tapegrad.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(k for k in sys.modules if k == 'jax' or k.startswith(('jax.', 'jaxlib')))\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_source_file_in_tapegrad_mentions_a_jax_import():
    pattern = re.compile(r"^\s*(import\s+jax|from\s+jax)", re.M)
    offenders = [str(p) for p in (ROOT / "tapegrad").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
