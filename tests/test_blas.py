"""BLAS discovery for the native backend: NumPy's own library found through threadpoolctl, SciPy's as fallback."""
import ctypes
import os

import numpy as np
import pytest

from tapegrad import blas

threadpoolctl = pytest.importorskip("threadpoolctl")


def _ddot(addr, bits, x, y):
    """Call a Fortran ``ddot(n, x, incx, y, incy)`` at ``addr`` with ``bits``-wide integers."""
    i = ctypes.c_int64 if bits == 64 else ctypes.c_int32
    f = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.POINTER(i), ctypes.c_void_p, ctypes.POINTER(i),
                         ctypes.c_void_p, ctypes.POINTER(i))(addr)
    n, one = i(x.size), i(1)
    return f(ctypes.byref(n), x.ctypes.data, ctypes.byref(one), y.ctypes.data, ctypes.byref(one))


def test_numpy_blas_is_the_library_threadpoolctl_reports():
    reported = {d["filepath"] for d in threadpoolctl.threadpool_info() if d["user_api"] == "blas"}
    found = blas._numpy_blas("d")
    if found is None:
        assert not any("numpy" in p for p in reported), reported
        pytest.skip("this NumPy ships no BLAS of its own (linked against a system library)")
    gemm, dot, bits, path = found
    assert path in reported and "numpy" in path
    assert bits == (64 if "64" in os.path.basename(path) else 32)
    x, y = np.arange(1.0, 6.0), np.linspace(-1.0, 2.0, 5)
    assert _ddot(dot, bits, x, y) == float(np.dot(x, y))   # the address and the integer width are right


def test_scipy_pointers_when_threadpoolctl_reports_no_numpy_blas(monkeypatch):
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [])
    monkeypatch.setattr(blas, "_BLAS", {})
    assert blas._numpy_blas("d") is None
    gemm, dot, bits, where = blas.blas_pointers(np.float64)
    assert where == "scipy.linalg.cython_blas" and bits == 32
    x = np.arange(4.0)
    assert _ddot(dot, bits, x, x) == 14.0


def test_the_blas_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(blas, "_BLAS", {})
    with caplog.at_level("INFO", logger="tapegrad"):
        first = blas.blas_pointers(np.float64)
        assert blas.blas_pointers(np.float64) == first          # cached: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "tapegrad" and "BLAS for" in r.getMessage()]
    assert lines == [f"BLAS for float64 programs: {first[3]} ({first[2]}-bit integers)"
                     + ("" if "numpy" in first[3] else " (SciPy's: NumPy's BLAS was not found)")]
