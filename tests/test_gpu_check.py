"""experiments/gpu_check.py --dry: the GPU check runs up to the launch here, and its PTX makes the point.

The dry run emits every oracle program in both dialects, generates the kernels, compiles them to PTX with
nvcc's default flags (--fmad=true) and runs the same source as host C++. This test reads the PTX on its own:
no exact-tier kernel of the cuda dialect holds an ``fma``, while the plain C body of ``fanout`` does.
"""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "gpu_check.py"


def kernels(ptx):
    """Kernel name -> PTX body (an entry ends at the first closing brace in column 0)."""
    return dict(re.findall(r"\.entry\s+k_(\w+)\((.*?)\n\}", ptx, re.S))


@pytest.mark.compilers
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the dry run cannot compile PTX here")
def test_dry_run_compiles_ptx_without_fma_in_the_cuda_dialect(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--n", "32", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "DRY RUN — no GPU was used" in run.stdout and "compiled them to PTX with nvcc" in run.stdout

    rows = json.loads((tmp_path / "results.json").read_text())
    exact = {"f_" + r["program"].replace("-", "_") for r in rows if r["tier"] == "exact"}
    assert {"f_fanout", "f_mul", "f_div", "f_sqrt"} <= exact
    cuda = kernels((tmp_path / "kernels_cuda.ptx").read_text())
    c = kernels((tmp_path / "kernels_c.ptx").read_text())
    assert exact <= cuda.keys() and exact <= c.keys()
    assert [k for k in sorted(exact) if "fma" in cuda[k]] == []
    assert "fma.rn.f64" in c["f_fanout"]
    # and the host build of the same source agreed with the tape
    assert all(r["exact"] == r["n"] for r in rows if r["tier"] == "exact")
    # the captured MLP program: the emulated ordered CUDA program == the ordered tape, fused == per-node,
    # the cuBLAS-mode program within its bound, 6 launches per fused episode, and the device executable builds
    report = (tmp_path / "report.md").read_text()
    row = re.search(r"^\| tiny \| (\S+) \| (\S+) \| (\S+) \| (\d+) / (\d+) \|", report, re.M)
    assert row and row.group(1) == "==" and row.group(2) == "==" and float(row.group(3)) < 1e-10, report[-2000:]
    assert int(row.group(4)) <= 6 < int(row.group(5))
    assert "nvcc built the device executable of the tiny ordered fused program: yes" in report
    # the GPU custom call's handler and its nvcc driver build here (run only on a GPU)
    assert "built handler.so and frame.so (gcc -Werror) and the nvcc driver" in report
    # the index and scan families', layout, reduction, softmax, special and pooling kernels, emulated: every
    # case's values and gradients == native
    fam = re.findall(r"^\| (\w+) \| (\d+) \| (\d+)/(\d+) \| (\d+)/(\d+) \| – \|$", report, re.M)
    assert len(fam) == 22 and all(c == v == n and g == m for _, c, v, n, g, m in fam), report[-3000:]
    # conv (tier "blas"): every case within the bound, its normwise difference printed
    conv = re.search(r"^\| conv \| (\d+) \| (\d+)/(\d+) \| (\d+)/(\d+) \| (\S+) \|$", report, re.M)
    assert conv and conv.group(1) == conv.group(2) == conv.group(3) and conv.group(4) == conv.group(5)
    assert 0 < float(conv.group(6)) < 1e-13, report[-3000:]
    # the linear-algebra family (tier "blas"): every case of every op within the bound
    la = re.findall(r"^\| (cholesky|triangular_solve|solve|logdet|logabsdet|det_sign) \| (\d+) \| (\d+)/(\d+) \| "
                    r"(\d+)/(\d+) \| (\S+) \|$", report, re.M)
    assert len(la) == 6 and all(c == v == n and g == m and float(d) < 1e-13 for _, c, v, n, g, m, d in la), report[-3000:]
