"""CUDA memory: device, pinned host and managed allocations; copies between the CPU and
CUDA (contiguous and strided, both ways) with ``dl_device`` and IS_COPIED."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import capsule_info, raw_view

CPU = (int(tx.DeviceType.kDLCPU), 0)


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "complex128", "float16"])
def test_device_memory(dtype):
    t = tx.empty((3, 5), dtype, device="cuda:0")
    assert t.__dlpack_device__() == (tx.DeviceType.kDLCUDA, 0)
    assert str(t.device) == "cuda:0" and t.data_ptr != 0
    assert t.nbytes == 15 * tx.dtype(dtype).itemsize
    assert tx.registry().stats()["live_bytes"]["cuda:0"] >= t.nbytes


def test_zero_size_and_zero_dim():
    z = tx.empty((0, 4), device="cuda:0")
    assert z.nbytes == 0
    host = tx.from_dlpack(z, device="cpu")
    assert host.shape == (0, 4)
    s = tx.from_dlpack(np.array(2.5), device="cuda:0")
    assert s.shape == () and tx.from_dlpack(s, device="cpu").numpy() == 2.5


def test_cpu_to_cuda_copy_and_back():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tx.from_dlpack(a, device="cuda:0")
    assert str(t.device) == "cuda:0" and not t.readonly
    capsule = t.__dlpack__(max_version=(1, 3), dl_device=CPU)
    flags, device_type, _ = capsule_info(capsule)
    assert flags & tx.DLPACK_FLAG_BITMASK_IS_COPIED
    assert device_type == tx.DeviceType.kDLCPU
    back = tx.from_dlpack(capsule)
    np.testing.assert_array_equal(back.numpy(), a)
    np.testing.assert_array_equal(np.from_dlpack(t, device="cpu"), a)


def test_copy_false_refuses_a_device_change():
    t = tx.empty((4,), device="cuda:0")
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=(1, 3), dl_device=CPU, copy=False)
    with pytest.raises(BufferError):
        tx.from_dlpack(np.zeros(4), device="cuda:0", copy=False)


def test_copy_true_on_device_is_a_real_copy(cp):
    x = cp.arange(10, dtype=cp.int32)
    t = tx.from_dlpack(x)
    c = tx.from_dlpack(t, copy=True)
    assert c.data_ptr != t.data_ptr and str(c.device) == "cuda:0"
    x[0] = 99
    cp.cuda.Stream.null.synchronize()
    assert tx.from_dlpack(c, device="cpu").numpy()[0] == 0


def test_strided_cuda_to_cpu(cp):
    x = cp.arange(24, dtype=cp.float32).reshape(2, 3, 4)
    for view in (x.transpose(2, 0, 1), x[:, ::-1, ::2], x[1]):
        t = tx.from_dlpack(view)
        assert t.data_ptr == view.data.ptr
        np.testing.assert_array_equal(tx.from_dlpack(t, device="cpu").numpy(), cp.asnumpy(view))


def test_strided_cpu_to_cuda(cp):
    a = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    for view in (a.T, a[::-1, 1:, ::2]):
        t = tx.from_dlpack(view, device="cuda:0")
        assert t.is_contiguous()
        np.testing.assert_array_equal(cp.asnumpy(cp.from_dlpack(t)), view)


def test_strided_device_copy_keeps_odd_itemsizes(cp):
    x = (cp.arange(30) + 1j * cp.arange(30)).astype(cp.complex128).reshape(5, 6)[:, ::-1]
    t = tx.from_dlpack(x)
    c = tx.from_dlpack(t, copy=True)
    assert c.is_contiguous()
    np.testing.assert_array_equal(cp.asnumpy(cp.from_dlpack(c)), cp.asnumpy(x))


def test_copy_on_a_stream(cp):
    s = tx.create_stream("cuda:0")
    a = np.arange(1 << 16, dtype=np.float64)
    t = tx.from_dlpack(a, device="cuda:0", stream=s)
    assert t.stream is s
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(raw_view(cp, t)), a)


def test_pinned_host_memory(cp):
    t = tx.empty((256,), "float32", device="cuda_host")
    assert t.__dlpack_device__() == (tx.DeviceType.kDLCUDAHost, 0)
    host = np.from_dlpack(t)  # host-accessible: no copy
    assert host.ctypes.data == t.data_ptr
    host[:] = np.arange(256, dtype=np.float32)
    capsule = t.__dlpack__(max_version=(1, 3), dl_device=CPU)
    flags, device_type, _ = capsule_info(capsule)
    assert device_type == tx.DeviceType.kDLCPU and not flags & tx.DLPACK_FLAG_BITMASK_IS_COPIED
    del capsule
    d = tx.from_dlpack(t, device="cuda:0")  # pinned -> device
    np.testing.assert_array_equal(cp.asnumpy(cp.from_dlpack(d)), host)
    back = tx.from_dlpack(d, device="cuda_host")  # device -> pinned, in stream order
    np.testing.assert_array_equal(np.from_dlpack(back, device="cpu"), host)  # dl_device=CPU: host-ready


def test_managed_memory(cp):
    t = tx.empty((1024,), "int32", device="cuda_managed")
    assert t.__dlpack_device__() == (tx.DeviceType.kDLCUDAManaged, 0)
    host = np.from_dlpack(t)
    host[:] = np.arange(1024, dtype=np.int32)
    arr = cp.from_dlpack(t)  # CuPy takes managed memory as device memory
    assert arr.data.ptr == t.data_ptr
    arr *= 2
    cp.cuda.Stream.null.synchronize()
    np.testing.assert_array_equal(host, np.arange(1024, dtype=np.int32) * 2)
    # a strided copy out of managed memory runs as a kernel
    v = tx.from_dlpack(arr[::-2])
    np.testing.assert_array_equal(tx.from_dlpack(v, device="cpu").numpy(), (np.arange(1024) * 2)[::-2])


def test_strided_numpy_view_of_pinned_memory_to_device(cp):
    t = tx.empty((8, 8), "float32", device="cuda_host")
    np.from_dlpack(t)[...] = np.arange(64, dtype=np.float32).reshape(8, 8)
    arr = np.from_dlpack(t)
    view = tx.from_dlpack(arr.T)  # CPU-typed view over pinned memory (NumPy says kDLCPU)
    d = tx.from_dlpack(view, device="cuda:0")
    np.testing.assert_array_equal(cp.asnumpy(cp.from_dlpack(d)), arr.T)


@pytest.mark.multi_gpu(2)
def test_copy_between_devices(cp):
    with cp.cuda.Device(1):
        x = cp.arange(100, dtype=cp.float32).reshape(10, 10)
        t = tx.from_dlpack(x)
        strided = tx.from_dlpack(x.T)
    assert str(t.device) == "cuda:1"
    y = tx.from_dlpack(t, device="cuda:0")
    assert str(y.device) == "cuda:0"
    np.testing.assert_array_equal(tx.from_dlpack(y, device="cpu").numpy(), cp.asnumpy(x))
    z = tx.from_dlpack(strided, device="cuda:0")  # strided, across devices
    np.testing.assert_array_equal(tx.from_dlpack(z, device="cpu").numpy(), cp.asnumpy(x.T))
