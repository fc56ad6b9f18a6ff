"""CuPy <-> JAX over DLPack: the stream each bridge orders on, the copy policy, the preallocation advice.

On the CPU a stand-in ``cupy`` module (arrays over aligned NumPy memory, streams that record which one
is current) checks that the bridges run DLPack's export/import inside the stream the caller names and
never copy what can be shared. With CuPy, a GPU and JAX's CUDA backend, the real bridges are checked for
pointer identity and for ordering after work queued on a non-default stream (skipped elsewhere).
"""
import sys
import types
import warnings

import numpy as np
import pytest

import interop
from interop import jax
from interop.xla.dlpack import preallocation_advice
from tapegrad import _arena


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log["current"].append(self.name)
        return self

    def __exit__(self, *exc):
        self.log["current"].pop()
        return False


class FakeArray:
    """A "device" array over 64-byte aligned host memory; notes the current stream at each export/copy."""

    def __init__(self, log, a):
        self.log, self.a = log, a
        self.flags, self.strides = a.flags, a.strides

    def _now(self):
        return self.log["current"][-1] if self.log["current"] else None

    def __dlpack__(self, **kw):
        self.log["events"].append(("export", self._now()))
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def copy(self):
        self.log["events"].append(("copy", self._now()))
        b = _arena.aligned_empty(self.a.shape, self.a.dtype)
        b[...] = self.a
        return FakeArray(self.log, b)


@pytest.fixture
def fake_cupy(monkeypatch):
    log = {"current": [], "events": []}
    mod = types.SimpleNamespace(
        ascontiguousarray=lambda x: x if x.flags.c_contiguous else FakeArray(log, _aligned(x.a)),
        from_dlpack=lambda x: FakeArray(log, np.from_dlpack(x)),
        asarray=lambda x: FakeArray(log, np.asarray(x)))
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return log


def _aligned(a):
    b = _arena.aligned_empty(a.shape, a.dtype)
    b[...] = a
    return b


def test_cupy_to_jax_exports_on_the_producers_stream_without_a_copy(fake_cupy):
    a = _aligned(np.arange(6.0).reshape(2, 3))
    src = FakeArray(fake_cupy, a)
    producer = FakeStream(fake_cupy, "producer")
    j = interop.cupy_to_jax(src, stream=producer)
    assert fake_cupy["events"] == [("export", "producer")] and fake_cupy["current"] == []
    assert j.unsafe_buffer_pointer() == a.ctypes.data and (np.asarray(j) == a).all()
    fake_cupy["events"].clear()
    interop.cupy_to_jax(src)   # no stream named: CuPy's current one
    assert fake_cupy["events"] == [("export", None)]


def test_cupy_to_jax_copies_on_the_producers_stream(fake_cupy):
    a = _aligned(np.arange(6.0).reshape(2, 3))
    src = FakeArray(fake_cupy, a)
    j = interop.cupy_to_jax(src, copy=True, stream=FakeStream(fake_cupy, "producer"))
    assert fake_cupy["events"] == [("copy", "producer"), ("export", "producer")]
    assert j.unsafe_buffer_pointer() != a.ctypes.data and (np.asarray(j) == a).all()
    strided = FakeArray(fake_cupy, _aligned(np.arange(12.0).reshape(3, 4))[:, ::2])
    with pytest.raises(ValueError, match="cupy_to_jax: cannot share without a copy: it is strided"):
        interop.cupy_to_jax(strided, copy=False)
    with pytest.warns(interop.CopyWarning, match="strided"):
        j = interop.cupy_to_jax(strided)
    assert (np.asarray(j) == strided.a).all()


def test_jax_to_cupy_of_a_host_array_copies_on_the_consumers_stream(fake_cupy):
    x = jax.numpy.arange(4.0)
    with pytest.raises(ValueError, match="not on a GPU"):
        interop.jax_to_cupy(x, copy=False)
    with pytest.warns(interop.CopyWarning, match="copying a host array to the GPU"):
        y = interop.jax_to_cupy(x, stream=FakeStream(fake_cupy, "consumer"))
    assert (y.a == np.arange(4.0)).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (interop.jax_to_cupy(x, copy=True).a == np.arange(4.0)).all()   # asked for: no warning


def test_jax_to_cupy_refuses_a_copy_argument_it_does_not_know(fake_cupy):
    with pytest.raises(ValueError) as e:
        interop.jax_to_cupy(jax.numpy.arange(4.0), copy="yes")
    assert str(e.value) == "jax_to_cupy: copy must be None, True or False, got 'yes'"


def test_jax_to_cupy_of_a_host_array_says_so_whole(fake_cupy):
    x = jax.numpy.arange(4.0)
    with pytest.raises(ValueError) as e:
        interop.jax_to_cupy(x, copy=False)
    assert str(e.value) == "jax_to_cupy: the array is not on a GPU; CuPy cannot view host memory without a copy"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        interop.jax_to_cupy(x)
    assert [(str(m.message), m.category) for m in w] == [
        ("jax_to_cupy: copying a host array to the GPU", interop.CopyWarning)]


def test_jax_to_cupy_warns_at_the_callers_line(fake_cupy):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        interop.jax_to_cupy(jax.numpy.arange(4.0))
    assert [m.filename for m in w] == [__file__]


class FakeGpuJaxArray:
    """What jax_to_cupy reads of a JAX array on a GPU: its devices and its DLPack export (noting the stream
    current at the export)."""

    def __init__(self, log, a):
        self.log, self.a = log, a

    def devices(self):
        return [types.SimpleNamespace(platform="gpu")]   # (JAX returns a set of its Device objects)

    def __dlpack__(self, **kw):
        self.log["events"].append(("jax export", self.log["current"][-1] if self.log["current"] else None))
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.parametrize("copy", [None, False, True])
def test_jax_to_cupy_of_a_gpu_array_imports_on_the_consumers_stream(fake_cupy, copy):
    """A JAX GPU array is imported through DLPack inside the consumer's stream, memory shared; copy=True
    then copies on that stream. No warning either way."""
    a = _aligned(np.arange(6.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = interop.jax_to_cupy(FakeGpuJaxArray(fake_cupy, a), copy=copy, stream=FakeStream(fake_cupy, "consumer"))
    assert fake_cupy["events"] == [("jax export", "consumer")] + [("copy", "consumer")] * (copy is True)
    assert (y.a == a).all() and np.shares_memory(y.a, a) == (copy is not True)


@pytest.mark.parametrize("env,ok", [({}, False), ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, True),
                                    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, False),
                                    ({"XLA_CLIENT_MEM_FRACTION": ".5"}, True),
                                    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".3"}, True),
                                    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, True)])
def test_preallocation_advice(env, ok):
    why = preallocation_advice(env)
    assert (why is None) == ok
    if not ok:
        assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in why and "starves CuPy" in why


def test_the_bridges_warn_once_when_jax_would_starve_cupy(fake_cupy, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(interop.xla.dlpack, "_ADVISED", [])
    src = FakeArray(fake_cupy, _aligned(np.ones(3)))
    with pytest.warns(ResourceWarning, match="XLA_PYTHON_CLIENT_PREALLOCATE=false"):
        interop.cupy_to_jax(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        interop.cupy_to_jax(src)


# ── on a GPU ─────────────────────────────────────────────────────────────────

def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        jax.devices("cuda")
    except Exception as e:
        pytest.skip(f"needs a CUDA GPU with CuPy and JAX's CUDA backend ({type(e).__name__})")
    return cupy


def test_gpu_bridges_share_memory_and_order_on_streams():
    cp = _gpu()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.zeros(1 << 20)
        for _ in range(50):       # queued work the import must wait for
            a += 1.0
    j = interop.cupy_to_jax(a, stream=s)
    assert j.unsafe_buffer_pointer() == a.data.ptr
    assert float(jax.numpy.min(j)) == 50.0 and float(jax.numpy.max(j)) == 50.0
    x = jax.numpy.arange(1 << 20, dtype=jax.numpy.float32) * 2
    c = cp.cuda.Stream(non_blocking=True)
    y = interop.jax_to_cupy(x, stream=c)
    assert y.data.ptr == x.unsafe_buffer_pointer()
    with c:
        same = bool((y == 2 * cp.arange(1 << 20, dtype=cp.float32)).all())
    assert same
