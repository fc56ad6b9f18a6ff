"""The BLAS and LAPACK this process calls: their function addresses, found once per dtype.

The tape's linear algebra (``tapegrad.ops.linalg``) and a native program's table (``ctx[5]`` of
``tapegrad.native.codegen``) take their LAPACK from here, so both run the very same code; native programs
call the GEMM and dot found here too. Nothing here builds or compiles: it only looks up symbols.
"""
import ctypes
import logging
import os

import numpy as np

log = logging.getLogger("tapegrad")

_BLAS = {}
# Fortran BLAS symbols, most specific first, with their integer width (ILP64 builds take 64-bit ints).
_SYMBOLS = (("scipy_{}_64_", 64), ("{}_64_", 64), ("scipy_{}_", 32), ("{}_", 32))


def blas_pointers(dtype):
    """(gemm address, dot address, BLAS integer bits, where from) for ``dtype``.

    First choice: the BLAS NumPy itself is linked against (threadpoolctl reports the loaded BLAS
    libraries and their paths; NumPy's is the one shipped with NumPy), so one process runs one BLAS
    thread pool and a program's GEMMs are the very kernels the tape's ``np.matmul`` calls. Two
    OpenBLAS pools on two cores (NumPy's and SciPy's builds) were measured slowing each other down
    10-200x. Fallback, or with ``TAPEGRAD_BLAS=scipy``: the function pointers SciPy exports for
    Cython (``scipy.linalg.cython_blas``).
    """
    key = np.dtype(dtype).name
    if key not in _BLAS:
        pre = "s" if key == "float32" else "d"
        found = None if os.environ.get("TAPEGRAD_BLAS") == "scipy" else _numpy_blas(pre)
        _BLAS[key] = found or _scipy_blas(pre)
        log.info("BLAS for %s programs: %s (%d-bit integers)%s", key, _BLAS[key][3], _BLAS[key][2],
                 "" if found else " (SciPy's, as TAPEGRAD_BLAS asks)" if os.environ.get("TAPEGRAD_BLAS")
                 == "scipy" else " (SciPy's: NumPy's BLAS was not found)")
    return _BLAS[key]


def blas_core(dtype):
    """OpenBLAS's kernel family (e.g. "Haswell", "SkylakeX") of the BLAS a program calls, or ""."""
    path = blas_pointers(dtype)[3]
    if not os.path.exists(path):
        return ""
    lib = ctypes.CDLL(path)
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                 "openblas_get_corename"):
        f = getattr(lib, name, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            return (f() or b"").decode()
    return ""


def loaded_blas():
    """Paths of the BLAS libraries loaded in this process, as threadpoolctl reports them."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:   # a dependency; without it the SciPy pointers still work
        return []
    return sorted({d["filepath"] for d in threadpool_info() if d.get("user_api") == "blas" and d.get("filepath")})


def _numpy_blas(pre):
    for path in loaded_blas():
        if "numpy" not in path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for pattern, bits in _SYMBOLS:
            if bits == 32 and "64" in os.path.basename(path):
                continue   # an ILP64 build may export unsuffixed names too; its ints would not match
            try:
                gemm = getattr(lib, pattern.format(pre + "gemm"))
                dot = getattr(lib, pattern.format(pre + "dot"))
            except AttributeError:
                continue
            addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value   # noqa: E731
            return addr(gemm), addr(dot), bits, path
    return None


def _scipy_blas(pre):
    try:
        from scipy.linalg import cython_blas
    except ImportError as e:   # pragma: no cover - scipy is a dependency of the native extra
        from .errors import BuildError
        raise BuildError(f"native backend: no BLAS: NumPy's OpenBLAS was not found in this process and scipy "
                         f"(for scipy.linalg.cython_blas) is missing: {e}; pip install scipy") from None
    caps = cython_blas.__pyx_capi__
    gemm, dot = (_capsule(caps[pre + f]) for f in ("gemm", "dot"))
    return gemm, dot, 32, "scipy.linalg.cython_blas"


def blas_threads_local(dtype):
    """The address of ``openblas_set_num_threads_local`` (OpenBLAS 0.3.27+) in the library of
    ``blas_pointers(dtype)``, else 0: a program runs its small products on one BLAS thread with it
    (``tg_mm``), setting the calling thread's count only, so NumPy's and other threads' are untouched."""
    path = blas_pointers(dtype)[3]
    if not os.path.exists(path):
        return 0
    f = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
    return 0 if f is None else ctypes.cast(f, ctypes.c_void_p).value


_LAPACK = {}
# The routines the linalg ops call, in the order of the table at ctx[5] (``tapegrad.ops.linalg`` calls
# the same addresses on the tape, so a program and the tape run the very same LAPACK code).
LAPACK_ROUTINES = ("potrf", "getrf", "gesv", "trsm", "trmm", "gemm")


def lapack_pointers(dtype):
    """(table, integer bits, where from): a uint64 array of the addresses of ``LAPACK_ROUTINES`` for ``dtype``.

    From the same library as ``blas_pointers`` (so LAPACK's integers have the BLAS integer's width): the
    OpenBLAS NumPy is linked against, whose LAPACK symbols sit beside its BLAS ones, else SciPy's Cython
    exports (``scipy.linalg.cython_lapack``, 32-bit integers). Not SciPy's LAPACK first: alternating
    NumPy's GEMM with SciPy's ``dpotrf`` at n = 200 was measured 24x slower than either alone (two
    OpenBLAS thread pools spinning against each other on two cores); with NumPy's own ``dpotrf`` it was
    not slower at all.
    """
    key = np.dtype(dtype).name
    if key not in _LAPACK:
        pre = "s" if key == "float32" else "d"
        _, _, bits, where = blas_pointers(dtype)
        found = None if where == "scipy.linalg.cython_blas" else _lib_lapack(where, pre, bits)
        if found is None and bits != 32:
            from .errors import BuildError
            raise BuildError(f"linalg: the BLAS in use ({where}, {bits}-bit integers) exports no LAPACK "
                             f"routines {LAPACK_ROUTINES}; set TAPEGRAD_BLAS=scipy to use SciPy's BLAS and LAPACK")
        _LAPACK[key] = found or _scipy_lapack(pre)
    return _LAPACK[key]


def _lib_lapack(path, pre, bits):
    lib = ctypes.CDLL(path)
    for pattern, b in _SYMBOLS:
        if b != bits:
            continue
        try:
            fns = [getattr(lib, pattern.format(pre + r)) for r in LAPACK_ROUTINES]
        except AttributeError:
            continue
        return np.array([ctypes.cast(f, ctypes.c_void_p).value for f in fns], np.uint64), bits, path
    return None


def _scipy_lapack(pre):
    from scipy.linalg import cython_blas, cython_lapack
    addrs = []
    for r in LAPACK_ROUTINES:
        caps = (cython_blas if r in ("trsm", "trmm", "gemm") else cython_lapack).__pyx_capi__
        addrs.append(_capsule(caps[pre + r]))
    return np.array(addrs, np.uint64), 32, "scipy.linalg.cython_lapack"


def _capsule(cap):
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_ptr(cap, get_name(cap))
