"""Zero-copy exchange of CUDA data with the real peers: CuPy, PyTorch, JAX, cuda.core's
StridedMemoryView, tvm-ffi and ONNX Runtime's CUDA provider. Each missing peer is
skipped with the reason."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import cuda_core_version, strided_memory_view


def _host(t):
    return tx.from_dlpack(t, device="cpu").numpy()


# -- CuPy -------------------------------------------------------------------------------------------
def test_cupy_both_ways_zero_copy(cp):
    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    t = tx.from_dlpack(x)
    assert t.data_ptr == x.data.ptr and t.shape == (3, 4) and str(t.device) == "cuda:0"
    y = cp.from_dlpack(t)
    assert y.data.ptr == t.data_ptr
    del x
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(12, dtype=np.float32).reshape(3, 4))
    imports = tx.registry().stats()["imports_outstanding"]
    del y, t
    assert tx.registry().collect(timeout=10)
    assert tx.registry().stats()["imports_outstanding"] == imports - 1


def test_cupy_sees_our_allocation(cp):
    t = tx.empty((5, 2), "int64", device="cuda:0")
    y = cp.from_dlpack(t)
    y[...] = cp.arange(10).reshape(5, 2)
    cp.cuda.Stream.null.synchronize()
    np.testing.assert_array_equal(_host(t), np.arange(10).reshape(5, 2))


# -- PyTorch --------------------------------------------------------------------------------------------
def test_torch_both_ways_zero_copy(torch_cuda):
    torch = torch_cuda
    a = torch.arange(20, dtype=torch.float64, device="cuda:0").reshape(4, 5)
    t = tx.from_dlpack(a)
    assert t.data_ptr == a.data_ptr() and str(t.device) == "cuda:0"
    b = torch.from_dlpack(t)
    assert b.data_ptr() == a.data_ptr()
    b.add_(1)
    torch.cuda.synchronize()
    assert a[0, 0].item() == 1.0
    np.testing.assert_array_equal(_host(t), np.arange(20).reshape(4, 5) + 1)


def test_torch_stream_as_the_consumer_stream(torch_cuda):
    torch = torch_cuda
    ts = torch.cuda.Stream(device=0)
    with torch.cuda.stream(ts):
        a = torch.ones(1000, device="cuda:0") * 3
    t = tx.from_dlpack(a, stream=ts)  # a torch stream object, kept alive by our wrapper
    assert t.stream.handle == ts.cuda_stream
    ts.synchronize()
    assert float(_host(t)[999]) == 3.0


def test_torch_strided_and_bfloat16(torch_cuda):
    torch = torch_cuda
    a = torch.arange(24, device="cuda:0", dtype=torch.float32).reshape(4, 6).t()
    t = tx.from_dlpack(a)
    assert t.strides == (1, 6)
    np.testing.assert_array_equal(_host(t), a.cpu().numpy())
    h = torch.arange(8, device="cuda:0").to(torch.bfloat16)
    tb = tx.from_dlpack(h)
    assert tb.dtype.name == "bfloat16"
    assert torch.equal(torch.from_dlpack(tb), h)


# -- JAX ---------------------------------------------------------------------------------------------
def test_jax_both_ways(jax_gpu):
    jax = jax_gpu
    jnp = jax.numpy
    x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
    t = tx.from_dlpack(x)  # JAX answers with a legacy capsule: the import is read-only
    assert str(t.device) == "cuda:0" and t.readonly
    np.testing.assert_array_equal(_host(t), np.arange(16, dtype=np.float32).reshape(4, 4))
    src = tx.from_dlpack(np.array([1, 2, 3], dtype=np.float32), device="cuda:0")
    y = jnp.from_dlpack(src)  # JAX passes its own stream for the handshake
    np.testing.assert_array_equal(np.asarray(y), [1, 2, 3])


# -- cuda.core --------------------------------------------------------------------------------------
def test_cuda_core_strided_memory_view(cuda, cp):
    StridedMemoryView = strided_memory_view(cuda)
    s = tx.create_stream("cuda:0")
    t = tx.from_dlpack(cp.arange(6, dtype=cp.float32).reshape(2, 3))
    view = StridedMemoryView(t, stream_ptr=s.handle)
    assert view.ptr == t.data_ptr and tuple(view.shape) == (2, 3)
    assert view.device_id == 0 and view.is_device_accessible
    assert not view.readonly
    if hasattr(view, "__dlpack__"):
        back = tx.from_dlpack(view)
        assert back.data_ptr == t.data_ptr and back.shape == (2, 3)


def test_cuda_core_buffer_import(cuda):
    """A cuda.core Buffer exports a 1-D int8 byte view of device memory."""
    s = tx.create_stream("cuda:0")
    mr = cuda._cc.DeviceMemoryResource(0)
    buffer = mr.allocate(64, stream=s.core)
    if not hasattr(buffer, "__dlpack__"):
        buffer.close(s.core)
        pytest.skip(f"cuda.core {cuda_core_version()} has no Buffer.__dlpack__")
    s.synchronize()
    t = tx.from_dlpack(buffer)
    assert t.data_ptr == int(buffer.handle) and t.nbytes == 64
    del t
    assert tx.registry().collect(timeout=10)
    buffer.close(s.core)


# -- tvm-ffi ------------------------------------------------------------------------------------------
def test_tvm_ffi(cp):
    tvm_ffi = pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    t = tx.from_dlpack(cp.arange(8, dtype=cp.int32))
    f = tvm_ffi.from_dlpack(t)
    assert tuple(f.shape) == (8,)
    back = tx.from_dlpack(f)
    assert back.data_ptr == t.data_ptr
    np.testing.assert_array_equal(_host(back), np.arange(8))


# -- ONNX Runtime ---------------------------------------------------------------------------------------
def test_onnxruntime_cuda_provider():
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (a CPU build)")
    value = ort.OrtValue.ortvalue_from_numpy(np.arange(6, dtype=np.float32), "cuda", 0)
    producer = value if hasattr(value, "__dlpack__") else value._ortvalue
    t = tx.from_dlpack(producer)
    assert str(t.device) == "cuda:0" and t.data_ptr == value.data_ptr()
    np.testing.assert_array_equal(_host(t), np.arange(6, dtype=np.float32))
