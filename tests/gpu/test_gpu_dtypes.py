"""Interop on the device, both ways, with NumPy-free data paths: every value check is a
comparison on the GPU (torch.equal, cupy ==, jnp.array_equal), never a copy to NumPy.
Peers: CuPy, PyTorch, JAX and cuda.core's StridedMemoryView; bfloat16 and float8_e4m3fn
where the peer supports them over DLPack (a peer that refuses is skipped with its own
words); the READ_ONLY and IS_COPIED flags; pinned host and managed memory."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import capsule_info, strided_memory_view

READ_ONLY = tx.DLPACK_FLAG_BITMASK_READ_ONLY
IS_COPIED = tx.DLPACK_FLAG_BITMASK_IS_COPIED


def _or_skip(peer: str, dtype: str, call):
    """Run ``call()``; a peer refusing the dtype over DLPack is a skip with its words."""
    try:
        return call()
    except (BufferError, TypeError, RuntimeError, NotImplementedError, ValueError) as exc:
        text = str(exc).lower()
        if any(word in text for word in ("float8", "bfloat16", "dtype", "not supported", "unsupported")):
            pytest.skip(f"{peer} does not support {dtype} over DLPack: {type(exc).__name__}: {exc}")
        raise


# -- bfloat16 ---------------------------------------------------------------------------------------
def test_bfloat16_torch_tx_torch_and_cupy(cp, torch_cuda):
    torch = torch_cuda
    h = torch.arange(256, device="cuda:0", dtype=torch.float32).to(torch.bfloat16)
    t = tx.from_dlpack(h)
    assert t.dtype.name == "bfloat16" and t.data_ptr == h.data_ptr() and str(t.device) == "cuda:0"
    back = torch.from_dlpack(t)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == h.data_ptr()
    assert torch.equal(back, h)
    c = _or_skip("CuPy", "bfloat16", lambda: cp.from_dlpack(t))
    assert c.data.ptr == t.data_ptr and c.dtype.itemsize == 2
    bits = cp.from_dlpack(h.view(torch.int16))  # the same values' bits, through torch's own export
    assert bool((c.view(cp.int16) == bits).all())


def test_bfloat16_tx_allocation_written_by_torch_read_by_jax(torch_cuda, jax_gpu):
    torch, jnp = torch_cuda, jax_gpu.numpy
    t = tx.empty((64,), "bfloat16", device="cuda:0")
    torch.from_dlpack(t).copy_(torch.arange(64, device="cuda:0", dtype=torch.float32).to(torch.bfloat16))
    torch.cuda.synchronize()
    j = _or_skip("JAX", "bfloat16", lambda: jnp.from_dlpack(t))
    assert j.dtype == jnp.bfloat16
    assert bool(jnp.array_equal(j.astype(jnp.float32), jnp.arange(64, dtype=jnp.float32)))


def test_bfloat16_jax_to_tx_to_torch(torch_cuda, jax_gpu):
    torch, jnp = torch_cuda, jax_gpu.numpy
    x = jnp.arange(32, dtype=jnp.bfloat16)
    t = tx.from_dlpack(x)  # JAX gives a legacy capsule: read-only
    assert t.dtype.name == "bfloat16" and t.readonly and str(t.device) == "cuda:0"
    y = torch.from_dlpack(tx.from_dlpack(t, copy=True))  # a writable copy on the device
    assert torch.equal(y.float(), torch.arange(32, dtype=torch.float32, device="cuda:0"))


# -- float8 -----------------------------------------------------------------------------------------
def test_float8_e4m3fn_torch_both_ways(torch_cuda):
    torch = torch_cuda
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip(f"PyTorch {torch.__version__} has no float8_e4m3fn")
    h = torch.linspace(-4, 4, 128, device="cuda:0").to(torch.float8_e4m3fn)
    t = _or_skip("PyTorch", "float8_e4m3fn", lambda: tx.from_dlpack(h))
    assert t.dtype.name == "float8_e4m3fn" and t.data_ptr == h.data_ptr()
    back = _or_skip("PyTorch", "float8_e4m3fn", lambda: torch.from_dlpack(t))
    assert back.dtype == torch.float8_e4m3fn and back.data_ptr() == h.data_ptr()
    assert torch.equal(back.view(torch.uint8), h.view(torch.uint8))
    own = tx.empty((16,), "float8_e4m3fn", device="cuda:0")
    w = torch.from_dlpack(own)
    w.copy_(h[:16])
    assert torch.equal(torch.from_dlpack(own).view(torch.uint8), h[:16].view(torch.uint8))


# -- flags ------------------------------------------------------------------------------------------
def test_read_only_flag_on_the_device(cuda, jax_gpu):
    """A read-only import (JAX's legacy capsule) exports with READ_ONLY set; a copy is
    writable and says IS_COPIED; cuda.core's StridedMemoryView reads both flags."""
    StridedMemoryView = strided_memory_view(cuda)
    jnp = jax_gpu.numpy
    t = tx.from_dlpack(jnp.arange(8, dtype=jnp.float32))
    assert t.readonly
    flags, device_type, device_id = capsule_info(t.__dlpack__(max_version=(1, 3)))
    assert flags & READ_ONLY and not flags & IS_COPIED
    assert (device_type, device_id) == (int(tx.DeviceType.kDLCUDA), 0)
    s = tx.create_stream("cuda:0")
    view = StridedMemoryView.from_dlpack(t, stream_ptr=s.handle)
    assert view.readonly and view.ptr == t.data_ptr and tuple(view.shape) == (8,)
    flags, device_type, _ = capsule_info(t.__dlpack__(max_version=(1, 3), copy=True))
    assert flags & IS_COPIED and not flags & READ_ONLY and device_type == int(tx.DeviceType.kDLCUDA)
    c = tx.from_dlpack(t, copy=True)
    assert not c.readonly and c.data_ptr != t.data_ptr
    copied = StridedMemoryView.from_dlpack(c, stream_ptr=s.handle)
    assert not copied.readonly


def test_strided_memory_view_both_ways(cuda, cp):
    StridedMemoryView = strided_memory_view(cuda)
    s = tx.create_stream("cuda:0")
    x = cp.arange(24, dtype=cp.int32).reshape(4, 6)
    t = tx.from_dlpack(x[:, ::2])  # strided
    view = StridedMemoryView.from_dlpack(t, stream_ptr=s.handle)
    assert view.ptr == t.data_ptr and tuple(view.shape) == (4, 3) and tuple(view.strides) == (6, 2)
    assert view.device_id == 0 and view.is_device_accessible
    back = tx.from_dlpack(view)  # cuda.core's view exports through DLPack too
    assert back.data_ptr == t.data_ptr and back.shape == (4, 3) and back.strides == (6, 2)
    again = cp.from_dlpack(back)
    assert bool((again == x[:, ::2]).all())


# -- pinned host and managed memory -----------------------------------------------------------------
def test_pinned_host_memory_with_torch_both_ways(torch_cuda):
    """A pinned torch tensor is recorded with the device its capsule says (torch 2.11:
    kDLCPU, though its __dlpack_device__ says kDLCUDAHost; docs/cuda.md, "Pinned host
    memory"). What a user relies on: no copy, the memory readable and writable from
    the host both ways, and a copy to the device that has read the source when it
    returns (the source is written at once after it), with the right values."""
    torch = torch_cuda
    p = torch.arange(64, dtype=torch.float32).pin_memory()
    _, capsule_type, _ = capsule_info(p.__dlpack__(max_version=(1, 3)))
    t = _or_skip("PyTorch", "pinned memory", lambda: tx.from_dlpack(p))
    assert t.data_ptr == p.data_ptr(), "a pinned tensor was copied on import"
    assert t.__dlpack_device__() == (capsule_type, 0), "the import did not record the capsule's device"
    host = np.from_dlpack(t)  # host-readable, zero copy, whichever of the two it says
    assert host.ctypes.data == p.data_ptr()
    host[:4] = -7.0
    assert p[:4].tolist() == [-7.0] * 4
    p[:4] = torch.arange(4, dtype=torch.float32)
    d = tx.from_dlpack(t, device="cuda:0")  # to the device; has read the source on return
    p.fill_(-1.0)  # the caller may write the source at once
    on_gpu = torch.from_dlpack(d)
    assert torch.equal(on_gpu, torch.arange(64, dtype=torch.float32, device="cuda:0")), \
        "the copy to the device read the source after the call returned"
    ours = tx.empty((64,), "float32", device="cuda_host")
    back = _or_skip("PyTorch", "pinned memory", lambda: torch.from_dlpack(ours))
    assert back.data_ptr() == ours.data_ptr


def test_pinned_host_memory_with_jax(jax_gpu):
    jax, jnp = jax_gpu, jax_gpu.numpy
    d = tx.from_dlpack(jnp.arange(16, dtype=jnp.float32))  # device memory (read-only: JAX's)
    pinned = tx.from_dlpack(d, device="cuda_host")  # device -> pinned copy, writable
    assert pinned.__dlpack_device__() == (tx.DeviceType.kDLCUDAHost, 0) and not pinned.readonly
    j = _or_skip("JAX", "pinned memory", lambda: jnp.from_dlpack(pinned))
    on_gpu = jax.device_put(j, jax.devices("gpu")[0])
    assert bool(jnp.array_equal(on_gpu, jnp.arange(16, dtype=jnp.float32)))


def test_managed_memory_with_cupy_and_torch(cp, torch_cuda):
    torch = torch_cuda
    t = tx.empty((1024,), "int32", device="cuda_managed")
    arr = cp.from_dlpack(t)  # CuPy takes managed memory as device memory
    assert arr.data.ptr == t.data_ptr
    arr[...] = cp.arange(1024, dtype=cp.int32)
    doubled = cp.from_dlpack(tx.from_dlpack(arr)) * 2  # CuPy -> tx -> CuPy, on the device
    assert bool((doubled == cp.arange(1024, dtype=cp.int32) * 2).all())
    y = _or_skip("PyTorch", "managed memory", lambda: torch.from_dlpack(t))
    assert y.data_ptr() == t.data_ptr
    assert torch.equal(y[:4].to("cuda:0"), torch.arange(4, dtype=torch.int32, device="cuda:0"))
