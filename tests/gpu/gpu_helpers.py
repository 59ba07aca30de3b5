"""Helpers for the GPU tests: kernels, raw CuPy views of tx tensors, capsule flags.

Imported by the tests (``from gpu_helpers import ...``); nothing here runs CUDA at
import time.
"""

from __future__ import annotations

import ctypes
from typing import Any

from exchange import _dlpack_abi as abi

#: How long the spin kernels hold their stream, in nanoseconds of %globaltimer
#: (wall-clock time, whatever the SM clock is running at).
SPIN_NS = 300_000_000
#: The release tests' window: the host drops the last holder, runs a collection and
#: allocates again while a reader spins this long; every kernel the window uses is
#: compiled before it opens (the ``warm`` fixture), so about 1 s leaves a wide margin.
RELEASE_SPIN_NS = 1_000_000_000

#: CUDA C for the tests. Each kernel's thread 0 of every block spins first, then the
#: block works through the array with a grid-stride loop. Launch with a small grid
#: (e.g. 32 blocks of 256 threads) so all blocks spin at once.
KERNELS = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void spin(unsigned long long ns) {
    if (threadIdx.x == 0) {
        unsigned long long t0 = now_ns();
        while (now_ns() - t0 < ns) { }
    }
    __syncthreads();
}

// out[i] = base + i, after spinning for ns nanoseconds.
extern "C" __global__ void spin_then_fill(float* out, long long n, unsigned long long ns, float base) {
    spin(ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = base + (float)i;
    }
}

// out[i] = in[i], after spinning for ns nanoseconds.
extern "C" __global__ void spin_then_copy(const float* in, float* out, long long n, unsigned long long ns) {
    spin(ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = in[i];
    }
}

// out[i] = value: the canary that overwrites memory a premature reuse would hand out.
extern "C" __global__ void fill_f32(float* out, long long n, float value) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = value;
    }
}

// out[i] = in[i].
extern "C" __global__ void copy_f32(const float* in, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = in[i];
    }
}
"""

GRID = (32,)
BLOCK = (256,)


def cupy_stream(cp: Any, stream: Any) -> Any:
    """A CuPy stream over a tx CUDA stream (no ownership): CuPy 14's
    ``Stream.from_external`` (``ExternalStream`` is deprecated there)."""
    from exchange.frameworks.cupy_adapter import cupy_stream as make

    return make(cp, stream)


def tx_stream(stream: Any) -> Any:
    """Our CUDAStream over a PyTorch or CuPy stream object (it keeps the object)."""
    import exchange as tx
    from exchange.devices.base import get_backend

    return get_backend(tx.DeviceType.kDLCUDA).as_stream(stream, tx.Device.parse("cuda:0"))


def host_syncs() -> int:
    """The CUDA backend's count of its host-blocking calls so far (CUDABackend.host_syncs)."""
    import exchange as tx
    from exchange.devices.base import get_backend

    return get_backend(tx.DeviceType.kDLCUDA).host_syncs


def raw_view(cp: Any, tensor: Any, device_id: int = 0) -> Any:
    """A CuPy array over ``tensor``'s memory that bypasses DLPack (no handshake, no
    registry holder, no stream added): for tests that set up data behind the library's
    back. It keeps ``tensor`` alive while it lives."""
    itemsize = tensor.dtype.itemsize
    memory = cp.cuda.UnownedMemory(tensor.data_ptr, max(tensor.nbytes, 1), tensor, device_id)
    return cp.ndarray(tensor.shape, dtype=tensor.dtype.name, memptr=cp.cuda.MemoryPointer(memory, 0),
                      strides=tuple(s * itemsize for s in tensor.strides))


def capsule_info(capsule: Any) -> tuple[int, int, int]:
    """``(flags, device_type, device_id)`` of an unconsumed ``"dltensor_versioned"`` capsule."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor_versioned")
    managed = abi.DLManagedTensorVersioned.from_address(address)
    return int(managed.flags), int(managed.dl_tensor.device.device_type), int(managed.dl_tensor.device.device_id)


def busy(stream: Any) -> bool:
    """True while ``stream`` still has work queued before now."""
    return not stream.record().query()


def cuda_core_version() -> str:
    """The installed cuda-core's version (``?`` when its metadata is missing)."""
    from importlib import metadata

    try:
        return metadata.version("cuda-core")
    except metadata.PackageNotFoundError:
        return "?"


def strided_memory_view(cuda: Any) -> Any:
    """cuda.core's ``StridedMemoryView`` with its ``from_dlpack`` (cuda.core 0.5 and
    later: ``cuda.core.utils``), or skip naming the installed version (0.4.x keeps it
    under ``cuda.core.experimental.utils``, without ``from_dlpack``)."""
    import importlib

    import pytest

    try:
        utils = importlib.import_module(cuda._cc.__name__ + ".utils")
    except ImportError:
        utils = None
    view = getattr(utils, "StridedMemoryView", None)
    if view is None or not hasattr(view, "from_dlpack"):
        pytest.skip(f"cuda.core {cuda_core_version()} has no utils.StridedMemoryView.from_dlpack (0.5 and later have it)")
    return view



def nvtx_packages() -> dict:
    """The installed ``nvtx`` Python package's version and ``nvidia-nvtx``'s (NVTX's C
    library as a wheel, any ``-cuNN`` variant): None where absent. Reads metadata only."""
    from importlib import metadata

    found: dict = {"nvtx": None, "nvidia-nvtx": None}
    try:
        found["nvtx"] = metadata.version("nvtx")
    except metadata.PackageNotFoundError:
        pass
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name.startswith("nvidia-nvtx"):
            found["nvidia-nvtx"] = f"{dist.version} ({name})"
            break
    return found


def note_result(entry: dict) -> None:
    """Append ``{"event": "note", **entry}`` to EXCHANGE_GPU_RESULTS (the results file
    tests/gpu/conftest.py writes), for ci/check_gpu_results.py's table; nothing when
    that variable is unset."""
    import json
    import os

    path = os.environ.get("EXCHANGE_GPU_RESULTS")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"event": "note", **entry}) + "\n").encode())
    finally:
        os.close(fd)


def stop_worker(proc: Any, inbox: Any, outbox: Any, timeout: float) -> None:
    """End a spawned worker that reads ``("exit",)`` from ``inbox``: asked first, then
    killed if it is still alive after ``timeout`` s; its queues closed."""
    if proc.is_alive():
        try:
            inbox.put(("exit",))
            proc.join(timeout)
        except (OSError, ValueError):
            pass
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)
    for q in (inbox, outbox):
        q.close()
        q.join_thread()
