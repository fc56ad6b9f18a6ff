"""The soak in quick mode (1/20 of the steps): resident memory and open file descriptors stay flat in every
loop a user repeats. The full figures come from ``python experiments/studies/soak.py`` (docs/reliability.md)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_soak_is_flat():
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "studies", "soak.py"), "--quick"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| loop")]
    assert len(rows) == 8
    assert "flat (growth ≤ 4 MB, no fd leaked): all loops" in r.stdout
