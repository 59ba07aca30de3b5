"""The CUDA backend: device memory (``kDLCUDA``), pinned host memory (``kDLCUDAHost``)
and managed memory (``kDLCUDAManaged``), CUDA streams and events.

Built on NVIDIA cuda-python: ``cuda.core`` for devices, streams, events and memory
resources, ``cuda.bindings`` (the generated driver bindings) for the few calls
``cuda.core`` has no object for (raw-pointer ``cuMemcpyAsync``, ``cuMemsetD8Async``,
``cuMemAllocManaged``, the current context), and CuPy for the one kernel this backend
needs (strided copies). Nothing here is imported by ``import exchange``: this module
imports no CUDA package at import time, and ``load()`` (called by
``exchange.devices.base.get_backend`` on first use of a CUDA device) does the imports and the
probe.

Memory (sizes in bytes; addresses are ints in the unified address space):

- ``kDLCUDA``: ``cuda.core.DeviceMemoryResource`` of the device, i.e. the driver's
  stream-ordered pool (``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``). Allocation is
  ordered on the allocation stream: the memory may be used on that stream at once, and
  on other streams after they wait for it (``Tensor.__dlpack__`` does that wait).
  Devices without memory pools fall back to ``Device.memory_resource`` (synchronous).
- ``kDLCUDAHost``: ``cuda.core.LegacyPinnedMemoryResource`` (``cuMemAllocHost``):
  synchronous, so the memory is host-ready when ``allocate`` returns.
- ``kDLCUDAManaged``: ``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)`` through
  ``cuda.bindings``: synchronous, host-ready when ``allocate`` returns.

Ownership and release: ``allocate`` returns an ``Allocation`` whose ``owner`` (a
``cuda.core.Buffer``, or a managed block) keeps the memory; the registry calls
``free(allocation, stream)`` once the last holder is gone *and* the events it recorded
on every stream that used the memory have completed (exchange/release.py). ``free``
then returns device memory to its pool on ``stream`` (``Buffer.close(stream)``:
``cuMemFreeAsync``), and pinned / managed memory after synchronising ``stream`` (which
has no work left on the memory by then). With ``EXCHANGE_DEBUG_POISON=1`` it first
fills the memory with ``POISON_BYTE`` on that stream, so a reader that was not ordered
before the release sees the pattern instead of its data.

Streams: a ``CUDAStream`` wraps a ``cuda.core.Stream``; ``handle`` is the
``cudaStream_t`` as an int, 1 for the legacy default stream and 2 for the per-thread
default stream (DLPack's numbers). Every call that needs a context makes the stream's
device current (its primary context) for the call and restores what was current.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import threading
from typing import Any

from exchange.layout import is_c_contiguous
from exchange.device import Device, DeviceType
from exchange.errors import BackendUnavailableError, DeviceError

from . import cuda_driver as _driver
from .base import Allocation
from .cuda_driver import CUDAOutOfMemoryError, _cuda_major_of_driver, driver_cuda_major, install_hint  # noqa: F401
from .cuda_streams import (EVENTS_CREATED, HOST_SYNCS, LEGACY_DEFAULT_STREAM, NO_SYNC,  # noqa: F401
                           PER_THREAD_DEFAULT_STREAM, CUDAEvent, CUDAStream, _Current, default_core_streams)

__all__ = [
    "load",
    "CUDABackend",
    "CUDAStream",
    "CUDAEvent",
    "CUDAOutOfMemoryError",
    "POISON_ENV",
    "POISON_BYTE",
    "UNORDERED_FREE_ENV",
    "EVENT_POOL_SIZE",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "NO_SYNC",
    "driver_cuda_major",
    "install_hint",
]

#: ``EXCHANGE_DEBUG_POISON=1``: ``free`` fills memory with POISON_BYTE before releasing it.
POISON_ENV = "EXCHANGE_DEBUG_POISON"
#: The byte written by the poison-on-release debug option (float32 0xA5A5A5A5 is about -2.9e-16).
POISON_BYTE = 0xA5
#: Test-only: ``EXCHANGE_TEST_UNORDERED_FREE=1`` plants a premature free. ``free_after``
#: then frees device memory on the allocation stream without making it wait for the
#: other streams that used the memory, so a kernel still reading it on another stream
#: reads freed memory. ci/gpu-check.sh sets it in one process to show that
#: compute-sanitizer's memcheck catches such a free; never set it anywhere else.
UNORDERED_FREE_ENV = "EXCHANGE_TEST_UNORDERED_FREE"
#: Completed CUDA events kept per device for re-recording (see CUDAStream.record).
EVENT_POOL_SIZE = 1024

_CUDA = DeviceType.kDLCUDA
_PINNED = DeviceType.kDLCUDAHost
_MANAGED = DeviceType.kDLCUDAManaged
_CPU = DeviceType.kDLCPU

def _poison_enabled() -> bool:
    return os.environ.get(POISON_ENV, "") not in ("", "0")


_unordered_said: list[bool] = []


def _unordered_free() -> bool:
    """True when the test-only UNORDERED_FREE_ENV is set (said once on stderr)."""
    if os.environ.get(UNORDERED_FREE_ENV, "") in ("", "0"):
        return False
    if not _unordered_said:
        _unordered_said.append(True)
        sys.stderr.write(f"tensor-exchange: {UNORDERED_FREE_ENV} is set: device memory is freed WITHOUT waiting for "
                         "the streams that used it (a planted premature free, for compute-sanitizer)\n")
    return True


def load() -> "CUDABackend":
    """Import cuda-python, initialise the driver and count the devices
    (``cuda_driver.load_driver``); returns the backend (``exchange.devices.base.get_backend``
    registers it for ``kDLCUDA``, ``kDLCUDAHost`` and ``kDLCUDAManaged``). Raises
    ``BackendUnavailableError`` (an ImportError) saying why when this machine cannot run
    it: cuda-python missing, no NVIDIA driver, the driver refusing to initialise, or no
    visible device. CuPy is not needed to load; strided copies ask for it when used.
    """
    cc, driver, count = _driver.load_driver()
    return CUDABackend(cc, driver, count)



class _ManagedBlock:
    """Managed memory from ``cuMemAllocManaged``; ``close(stream)`` synchronises
    ``stream`` and frees it (``cuMemFree``). Not freed by garbage collection: the
    registry frees it (at interpreter exit a leak is preferred to a late driver call)."""

    __slots__ = ("address", "nbytes", "_driver")

    def __init__(self, driver: Any, address: int, nbytes: int) -> None:
        self._driver = driver
        self.address = address
        self.nbytes = nbytes

    def close(self, stream: Any = None) -> None:
        address, self.address = self.address, 0
        if not address:
            return
        if stream is not None:
            HOST_SYNCS.add()
            stream.sync()
        (err,) = self._driver.cuMemFree(address)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuMemFree(0x{address:x}) failed: {_error_text(self._driver, err)}")


_c_contiguous = is_c_contiguous


# -- the backend ---------------------------------------------------------------------------------
class CUDABackend:
    """CUDA device, pinned host and managed memory; CUDA streams and events.

    ``device_count`` is the number of visible CUDA devices (``cuda:0`` ...). Pinned and
    managed memory (device id 0 as DLPack fixes it) is used with the streams of any
    CUDA device; where no stream says which, the device current on the calling thread
    is used (device 0 when none is).
    """

    name = "cuda"
    device_types = (_CUDA, _PINNED, _MANAGED)

    def __init__(self, cc: Any, driver: Any, device_count: int) -> None:
        # No driver call here: load() has made sure the driver works.
        self._cc = cc
        self._driver = driver
        self.device_count = device_count
        self._success = driver.CUresult.CUDA_SUCCESS
        self._primary: dict[int, tuple[int, Any]] = {}  # ordinal -> (context address, CUcontext)
        self._lock = threading.Lock()
        self._devices = {i: Device(_CUDA, i) for i in range(device_count)}
        self._legacy, self._per_thread = default_core_streams(cc)
        self._defaults: dict[int, CUDAStream] = {}
        self._per_thread_defaults = threading.local()  # .streams: ordinal -> this thread's CUDAStream
        self._device_resources: dict[int, Any] = {}
        self._pooled: set[int] = set()  # ordinals whose device memory frees in stream order
        self._pinned_resource: Any = None
        # Events for re-recording, one pool per device (an event belongs to its context).
        self._event_pools: dict[int, collections.deque[Any]] = {
            i: collections.deque(maxlen=EVENT_POOL_SIZE) for i in range(device_count)}
        self._ipc_resources: dict[int, Any] = {}  # ordinal -> IPC-enabled pool (ipc_resource)

    def __repr__(self) -> str:
        return f"CUDABackend(devices={self.device_count})"

    @property
    def host_syncs(self) -> int:
        """How many host-blocking calls this backend has made so far, on any thread: every
        stream and event ``synchronize()``, and the synchronisation before freeing pinned
        or managed memory. Stream-ordered work (records, waits, device memory frees,
        copies between device memories) adds nothing; a copy into pageable host memory
        adds one."""
        return HOST_SYNCS.count

    @property
    def events_created(self) -> int:
        """How many CUDA events ``CUDAStream.record`` has created so far, on any thread
        (the others were re-recorded from the device's pool of up to EVENT_POOL_SIZE
        completed events). Flat once warm: hops and releases take events from the pool."""
        return EVENTS_CREATED.count

    def describe(self, ordinal: int) -> str:
        """One line about CUDA device ``ordinal``: its name, compute capability, memory in
        GiB and the CUDA version of the driver (``"NVIDIA H200, sm_90, 139.8 GiB, driver
        CUDA 13.0"``). ValueError for a device that does not exist."""
        if ordinal not in self._devices:
            raise ValueError(f"cuda:{ordinal} does not exist: this process sees {self.device_count} CUDA device(s)")
        core = self._cc.Device(ordinal)
        parts = [str(core.name)]
        with contextlib.suppress(Exception):
            cc = core.compute_capability
            parts.append(f"sm_{cc.major}{cc.minor}")
        with contextlib.suppress(Exception):
            err, total = self._driver.cuDeviceTotalMem(ordinal)
            if err == self._success:
                parts.append(f"{int(total) / (1 << 30):.1f} GiB")
        with contextlib.suppress(Exception):
            err, version = self._driver.cuDriverGetVersion()
            if err == self._success:
                parts.append(f"driver CUDA {int(version) // 1000}.{int(version) % 1000 // 10}")
        return ", ".join(parts)

    # -- devices and contexts ------------------------------------------------------------
    def _check(self, err: Any, what: str) -> None:
        if err != self._success:
            text = _error_text(self._driver, err)
            cls = CUDAOutOfMemoryError if "OUT_OF_MEMORY" in text else DeviceError
            raise cls(f"{what} failed: {text}")

    def _make_current(self, ordinal: int) -> Any:
        """Make ``ordinal``'s primary context current. Returns the context to restore
        afterwards: None when it already was current, or when no context was (the
        primary context then stays current, as CuPy and PyTorch leave it)."""
        driver = self._driver
        err, ctx = driver.cuCtxGetCurrent()
        current = int(ctx) if err == self._success else 0
        primary = self._primary.get(ordinal)
        if primary is not None and current == primary[0]:
            return None
        if primary is None:
            self._cc.Device(ordinal).set_current()
            err, now = driver.cuCtxGetCurrent()
            self._check(err, "cuCtxGetCurrent")
            self._primary[ordinal] = (int(now), now)
        else:
            (err,) = driver.cuCtxSetCurrent(primary[1])
            self._check(err, f"cuCtxSetCurrent(cuda:{ordinal})")
        return ctx if current else None

    def _current_ordinal(self) -> int:
        """The CUDA device current on this thread, 0 when none is."""
        try:
            err, dev = self._driver.cuCtxGetDevice()
        except Exception:
            return 0
        if err != self._success:
            return 0
        ordinal = int(dev)
        return ordinal if 0 <= ordinal < self.device_count else 0

    def _cuda_device(self, ordinal: int) -> Device:
        return self._devices[ordinal]

    def _ordinal(self, device: Any, stream: "CUDAStream | None" = None) -> int:
        """The CUDA device ordinal that serves ``device``: its id for ``kDLCUDA`` (which
        must exist), else the stream's device, else the current device."""
        device = Device.parse(device)
        if device.type == _CUDA:
            if device.id >= self.device_count:
                raise ValueError(
                    f"{device} does not exist: this process sees {self.device_count} CUDA device(s), "
                    f"cuda:0 to cuda:{self.device_count - 1}"
                )
            return device.id
        if device.type in (_PINNED, _MANAGED):
            return stream.device.id if stream is not None else self._current_ordinal()
        raise ValueError(f"the CUDA backend serves cuda, cuda_host and cuda_managed memory, not {device}")

    # -- streams ------------------------------------------------------------------------------
    def default_stream(self, device: Any) -> CUDAStream:
        """The legacy default stream (DLPack 1) of ``device``'s CUDA device."""
        ordinal = self._ordinal(device)
        stream = self._defaults.get(ordinal)
        if stream is None:
            stream = CUDAStream(self, self._legacy, self._devices[ordinal], LEGACY_DEFAULT_STREAM)
            self._defaults[ordinal] = stream
        return stream

    def per_thread_stream(self, device: Any) -> CUDAStream:
        """The calling thread's per-thread default stream (DLPack 2) of ``device``'s CUDA
        device: one CUDAStream per thread (``thread`` says which), since the handle names
        a different stream on each. Used from another thread (a release, a consumer's
        handshake), it records through the legacy default stream (see CUDAStream)."""
        ordinal = self._ordinal(device)
        mine = getattr(self._per_thread_defaults, "streams", None)
        if mine is None:
            mine = self._per_thread_defaults.streams = {}
        stream = mine.get(ordinal)
        if stream is None:
            stream = CUDAStream(self, self._per_thread, self._devices[ordinal], PER_THREAD_DEFAULT_STREAM,
                                thread=threading.current_thread())
            mine[ordinal] = stream
        return stream

    def order_key(self, stream: CUDAStream) -> tuple[Any, ...]:
        """What names the ordered queue ``stream``'s work lands on from the calling thread
        (``CUDAStream.order_key``): work queued on two streams with one key runs in the
        order it was queued, so a handshake between them needs no wait. The per-thread
        default stream has handle 2 on every thread but is a different stream on each:
        its key names the thread."""
        return stream.order_key()

    def create_stream(self, device: Any) -> CUDAStream:
        """A new non-blocking CUDA stream on ``device``'s CUDA device (it does not
        synchronise with the legacy default stream). Destroyed when the last reference
        goes (the registry keeps the streams that used live memory)."""
        ordinal = self._ordinal(device)
        try:
            with _Current(self, ordinal):
                core_device = self._cc.Device(ordinal)
                core_device.set_current()  # cuda.core's per-thread Device wants it on every thread
                core = core_device.create_stream()
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        return CUDAStream(self, core, self._devices[ordinal], int(core.handle))

    def _wrap_handle(self, handle: int, device: Any, owner: Any = None, ordinal: int | None = None,
                     core: Any = None) -> CUDAStream:
        if handle == 0 or handle == LEGACY_DEFAULT_STREAM:  # 0 from an object: the NULL (legacy) stream
            return self.default_stream(self._devices[ordinal] if ordinal is not None else device)
        if handle == PER_THREAD_DEFAULT_STREAM:
            return self.per_thread_stream(self._devices[ordinal] if ordinal is not None else device)
        if core is None:
            core = self._cc.Stream.from_handle(handle)
        if ordinal is None:
            device = Device.parse(device)
            if device.type == _CUDA:
                ordinal = self._ordinal(device)
            else:  # pinned or managed memory: the stream's own device
                try:
                    ordinal = int(core.device.device_id)
                except Exception:
                    ordinal = self._current_ordinal()
        return CUDAStream(self, core, self._devices[ordinal], handle, owner)

    def stream_from_dlpack(self, value: int | None, device: Any) -> CUDAStream | None:
        """The stream a DLPack ``__dlpack__(stream=value)`` names for data on ``device``:
        None or 1 the legacy default stream, 2 the per-thread default stream, > 2 that
        ``cudaStream_t`` (not kept alive: it must outlive the data's release), -1 None (no
        synchronisation). ValueError for 0 (ambiguous) and values below -1; TypeError
        for a non-int."""
        if value is None:
            return self.default_stream(device)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a CUDA stream for DLPack must be an int or None, got {value!r}")
        if value == NO_SYNC:
            return None
        if value == 0:
            raise ValueError(
                "stream=0 is ambiguous for CUDA data (it could mean the legacy default stream, 1, or the "
                "per-thread default stream, 2); pass 1, 2, a cudaStream_t (> 2), or -1 for no synchronisation"
            )
        if value < NO_SYNC:
            raise ValueError(f"stream={value} is not a CUDA stream; use None, -1, 1, 2 or a cudaStream_t (> 2)")
        if value == LEGACY_DEFAULT_STREAM:
            return self.default_stream(device)
        if value == PER_THREAD_DEFAULT_STREAM:
            return self.per_thread_stream(device)
        return self._wrap_handle(value, device)

    def to_dlpack_stream(self, stream: Any, device: Any) -> int:
        """The int to pass a producer's ``__dlpack__(stream=...)`` for a consumer working on
        ``stream``: its handle; 1 (the legacy default stream, said explicitly) for None."""
        if stream is None:
            return LEGACY_DEFAULT_STREAM
        if not isinstance(stream, CUDAStream):
            stream = self.as_stream(stream, device)
        return stream.handle

    def as_stream(self, obj: Any, device: Any) -> CUDAStream:
        """Our CUDAStream for: a CUDAStream; an int (DLPack's numbers: 1 legacy default,
        2 per-thread default, > 2 a ``cudaStream_t``); a ``cuda.core.Stream``; any object
        with ``__cuda_stream__`` (``torch.cuda.Stream``, CuPy streams, cuda.core), or a
        ``torch.cuda.Stream`` / CuPy stream of a version without it. Objects are kept
        alive by the wrapper; an int handle is not.

        ValueError for 0 (ambiguous), -1 (no stream: pass None) and a stream of another
        CUDA device than ``device``; TypeError for anything else.
        """
        device = Device.parse(device)
        if isinstance(obj, CUDAStream):
            stream = obj
        elif isinstance(obj, bool):
            raise TypeError(f"expected a CUDA stream, got {obj!r}")
        elif isinstance(obj, int):
            if obj == NO_SYNC:
                raise ValueError("stream=-1 (no synchronisation) names no stream here; pass a stream, or None")
            stream = self.stream_from_dlpack(obj, device)
            assert stream is not None
        else:
            handle = _foreign_handle(obj)
            if handle is None:
                raise TypeError(
                    f"expected a CUDA stream (tx.create_stream('cuda'), an int cudaStream_t, a cuda.core Stream, "
                    f"or an object with __cuda_stream__ such as torch.cuda.Stream), got {type(obj).__name__}"
                )
            core = obj if isinstance(obj, self._cc.Stream) else None
            stream = self._wrap_handle(handle, device, owner=obj, ordinal=_foreign_ordinal(obj, self.device_count),
                                       core=core)
        if device.type == _CUDA and stream.device.id != device.id:
            raise ValueError(f"{stream!r} belongs to {stream.device}, but the data is on {device}")
        return stream

    # -- memory ---------------------------------------------------------------------------------
    def _resource(self, kind: DeviceType, ordinal: int) -> Any:
        if kind == _CUDA:
            mr = self._device_resources.get(ordinal)
            if mr is None:
                with self._lock:
                    mr = self._device_resources.get(ordinal)
                    if mr is None:
                        core_device = self._cc.Device(ordinal)
                        if getattr(core_device.properties, "memory_pools_supported", True):
                            mr = self._cc.DeviceMemoryResource(ordinal)
                            self._pooled.add(ordinal)
                        else:  # no stream-ordered pools on this device: cuda.core's synchronous resource
                            core_device.set_current()
                            mr = core_device.memory_resource
                        self._device_resources[ordinal] = mr
            return mr
        if kind == _PINNED:
            if self._pinned_resource is None:
                self._pinned_resource = self._cc.LegacyPinnedMemoryResource()
            return self._pinned_resource
        raise ValueError(f"no memory resource for {kind!r}")

    def allocate(self, nbytes: int, device: Any, stream: Any = None, shared: bool = False) -> Allocation:
        """``nbytes`` bytes of ``device`` memory (``cuda:N``, ``cuda_host``, ``cuda_managed``).
        ``shared=True`` (``cuda:N`` only, else ValueError): from the device's IPC-enabled
        pool (``ipc_resource``), so other processes can map it (``tx.share``).

        Device memory is ordered on ``stream`` (None: the legacy default stream): usable
        there at once, elsewhere after waiting for it. Pinned and managed memory is
        host-ready on return. Zero bytes give address 0 and nothing to free.

        Ownership: the returned Allocation's ``owner`` holds the memory until
        ``free``. Raises ValueError for a device that does not exist or a stream of
        another device, CUDAOutOfMemoryError (a DeviceError and MemoryError) when the
        device is full, DeviceError for other driver failures.
        """
        device = Device.parse(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if shared and device.type != _CUDA:
            raise ValueError(f"shared=True is for cpu and cuda:N memory, not {device}; allocate on cuda:N to share it")
        st = None if stream is None else (stream if isinstance(stream, CUDAStream) else self.as_stream(stream, device))
        ordinal = self._ordinal(device, st)
        if st is not None and st.device.id != ordinal:
            raise ValueError(f"{st!r} belongs to {st.device}, but the memory is for {device}")
        if nbytes == 0:
            return Allocation(0, 0, device, owner=None)
        st = st or self.default_stream(self._devices[ordinal])
        try:
            with _Current(self, ordinal):
                if device.type == _MANAGED:
                    flags = int(self._driver.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
                    err, ptr = self._driver.cuMemAllocManaged(nbytes, flags)
                    self._check(err, f"cuMemAllocManaged({nbytes})")
                    block = _ManagedBlock(self._driver, int(ptr), nbytes)
                    return Allocation(block.address, nbytes, device, owner=block)
                resource = self.ipc_resource(ordinal) if shared else self._resource(device.type, ordinal)
                buffer = resource.allocate(nbytes, stream=st.core)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        return Allocation(int(buffer.handle), nbytes, device, owner=buffer)

    def free(self, allocation: Allocation, stream: Any = None) -> None:
        """Release ``allocation`` on ``stream`` (None: the legacy default stream).

        The registry calls this only after the work of every stream that used the memory
        has completed. Device memory returns to its pool ordered on ``stream``
        (``Buffer.close(stream)``); pinned and managed memory is freed after
        synchronising ``stream``. With EXCHANGE_DEBUG_POISON=1 the memory is first
        filled with POISON_BYTE on ``stream``. Freeing twice does nothing.
        """
        owner, allocation.owner = allocation.owner, None
        if owner is None:
            return
        device = allocation.device
        st = None if stream is None else (stream if isinstance(stream, CUDAStream) else self.as_stream(stream, device))
        ordinal = self._ordinal(device, st)
        st = (st or self.default_stream(self._devices[ordinal]))._here()
        try:
            with _Current(self, ordinal):
                if _poison_enabled() and allocation.nbytes:
                    (err,) = self._driver.cuMemsetD8Async(allocation.address, POISON_BYTE, allocation.nbytes,
                                                          st.handle)
                    self._check(err, "cuMemsetD8Async (poison on release)")
                if device.type == _PINNED:
                    HOST_SYNCS.add()  # LegacyPinnedMemoryResource synchronises the stream, then cuMemFreeHost
                owner.close(st.core)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def free_after(self, allocation: Allocation, stream: Any, streams: list[Any]) -> bool:
        """Free device memory in stream order on the device, after the work queued on
        ``streams`` (every stream that used it), with no host wait and no reaper: the
        free stream (``stream``, the allocation's; None: the legacy default stream)
        waits on an event recorded now on each other stream (``cuStreamWaitEvent``),
        then the memory goes back to its pool (``cuMemFreeAsync``), where only work
        ordered after that free can reuse it.

        Returns False, freeing nothing, where that cannot be done (pinned or managed
        memory, whose free the host must order: the registry's reaper frees it after
        the streams' events; a device without memory pools; a stream not of this
        backend). DeviceError if a driver call fails (the registry then falls back).
        With the test-only UNORDERED_FREE_ENV set the free stream waits for nothing.
        """
        device = allocation.device
        if (device.type != _CUDA or allocation.owner is None or device.id not in self._pooled
                or not all(isinstance(s, CUDAStream) for s in streams)):
            return False
        st = stream if isinstance(stream, CUDAStream) else (
            self.default_stream(device) if stream is None else self.as_stream(stream, device))
        st = st._here()  # the allocation's per-thread default stream, released on another thread: the legacy one
        if not _unordered_free():  # the test-only switch plants a premature free here
            seen = {st.order_key()}  # one wait per stream, however many wrappers name it
            for other in streams:
                key = other.order_key()
                if key not in seen:
                    seen.add(key)
                    st.wait(other.record())
        self.free(allocation, st)
        return True

    # -- memory other processes can map ---------------------------------------------------------
    # The CUDA memory channel (exchange/channels/cuda.py) exports it and maps other
    # processes' memory; the backend only allocates it, from an IPC-enabled pool.
    def ipc_resource(self, ordinal: int) -> Any:
        """The IPC-enabled memory pool of CUDA device ``ordinal`` (made on first use).
        DeviceError when the device cannot share pool memory."""
        mr = self._ipc_resources.get(ordinal)
        if mr is not None:
            return mr
        with self._lock:
            mr = self._ipc_resources.get(ordinal)
            if mr is None:
                core_device = self._cc.Device(ordinal)
                props = core_device.properties
                if not getattr(props, "memory_pools_supported", True):
                    raise DeviceError(f"cuda:{ordinal} has no stream-ordered memory pools, so it cannot share memory")
                types = getattr(props, "mempool_supported_handle_types", None)
                if types is not None and not int(types) & _POSIX_FD:
                    raise DeviceError(f"cuda:{ordinal} cannot export pool memory as a file descriptor (IPC)")
                with _Current(self, ordinal):
                    options = self._cc.DeviceMemoryResourceOptions(ipc_enabled=True)
                    mr = self._cc.DeviceMemoryResource(ordinal, options)
                self._ipc_resources[ordinal] = mr
                self._pooled.add(ordinal)  # a stream-ordered pool too: free_after frees it with no reaper
        return mr

    # -- copies ---------------------------------------------------------------------------------
    def _memcpy(self, dst: int, src: int, nbytes: int, stream: CUDAStream) -> None:
        (err,) = self._driver.cuMemcpyAsync(dst, src, nbytes, stream.handle)
        self._check(err, f"cuMemcpyAsync({nbytes} bytes)")

    def _stream_of(self, tensor: Any) -> CUDAStream | None:
        """The stream ``tensor``'s data is ordered on (None for CPU data)."""
        if tensor.device.type == _CPU:
            return None
        stream = tensor.stream
        if isinstance(stream, CUDAStream):
            return stream
        return self.default_stream(tensor.device)

    def copy(self, dst: Any, src: Any, stream: Any = None) -> CUDAStream | None:
        """Copy tensor ``src`` into tensor ``dst`` (equal shapes and itemsizes, any strides;
        CUDA device, pinned, managed or CPU memory), ordered on ``stream``; returns the
        stream the copy is ordered on (None for a copy between CPU tensors, complete on
        return).

        ``stream`` None: the legacy default stream of the CUDA side (``dst``'s device when
        both are CUDA devices). The copy stream first waits for the streams ``src`` and
        ``dst`` are ordered on (record-then-wait, no host block). The caller adds the
        returned stream to both records' streams (``exchange.tensor.copy_into`` does), so
        neither is released before the copy has run. Contiguous
        copies are one ``cuMemcpyAsync``; strided ones use a CuPy kernel, staging through
        contiguous buffers where one side is pageable host memory or another device.
        A copy into pageable host memory has completed when this returns, and a copy
        from ``kDLCPU`` memory has read its source when this returns (also where those
        pages are in fact page-locked, as a pinned PyTorch tensor's are: its capsule
        says kDLCPU, so the caller may write it at once; the copy stream is then
        synchronised, one host sync). Other copies complete in stream order.

        Raises ValueError for mismatched shapes or itemsizes, BackendUnavailableError when
        a strided copy needs CuPy and it is not installed, DeviceError for driver failures.
        """
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype.itemsize != src.dtype.itemsize:
            raise ValueError(
                f"copy needs equal shapes and itemsizes, got {dst.shape}/{dst.dtype.name} <- {src.shape}/{src.dtype.name}"
            )
        if dst.device.type == _CPU and src.device.type == _CPU:
            from .cpu import CPUBackend

            return CPUBackend().copy(dst, src, None)
        if stream is not None:
            side = dst if dst.device.type != _CPU else src
            st = stream if isinstance(stream, CUDAStream) else self.as_stream(stream, side.device)
        else:
            side = dst if dst.device.type == _CUDA else src if src.device.type == _CUDA else (
                dst if dst.device.type != _CPU else src)
            st = self.default_stream(side.device)
        for tensor in (src, dst):
            producer = self._stream_of(tensor)
            if producer is not None and (producer.handle != st.handle or producer.device != st.device):
                st.wait(producer.record())
        nbytes = math.prod(src.shape) * src.dtype.itemsize
        if nbytes == 0:
            return st
        try:
            with _Current(self, st.device.id):
                if _c_contiguous(src.shape, src.strides) and _c_contiguous(dst.shape, dst.strides):
                    self._memcpy(dst.data_ptr, src.data_ptr, nbytes, st)
                    if dst.device.type == _CPU or self._async_from_host(src):
                        st.synchronize()
                    return st
                self._strided_copy(dst, src, nbytes, st)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        return st

    def _async_from_host(self, src: Any) -> bool:
        """True when a cuMemcpyAsync from ``src``, CPU-typed memory, may still be reading
        it after the call returns: its pages are page-locked memory CUDA knows
        (``cuMemAllocHost``, ``cuMemHostRegister``), which the driver copies from
        asynchronously. From pageable memory the call returns once it has staged the
        source. Unknown (a failing query): True, so the caller synchronises."""
        if src.device.type != _CPU:
            return False
        driver = self._driver
        try:
            err, kind = driver.cuPointerGetAttribute(
                driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, src.data_ptr)
            if err != self._success:  # CUDA_ERROR_INVALID_VALUE: memory CUDA does not know, pageable
                return False
            return int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)
        except Exception:
            return True

    def _local(self, tensor: Any, ordinal: int) -> bool:
        """True when a kernel on device ``ordinal`` can read and write ``tensor``."""
        kind = tensor.device.type
        return kind in (_PINNED, _MANAGED) or (kind == _CUDA and tensor.device.id == ordinal)

    def _strided_copy(self, dst: Any, src: Any, nbytes: int, st: CUDAStream) -> None:
        import numpy as np

        from .cpu import numpy_view

        cp = _cupy()
        o = st.device.id
        src_local, dst_local = self._local(src, o), self._local(dst, o)
        with cp.cuda.Device(o), _cupy_stream(cp, st):
            if src_local and dst_local:
                _cupy_view(cp, dst, o)[...] = _cupy_view(cp, src, o)
                return
            keep: list[Any] = []
            # 1. the source as contiguous bytes that cuMemcpyAsync can read
            peer_src_stream = None
            read_on_return = False  # a CPU-typed source in page-locked memory: wait for the copy (copy())
            if _c_contiguous(src.shape, src.strides):
                src_ptr = src.data_ptr
                read_on_return = self._async_from_host(src)
            elif src_local:
                staged = cp.ascontiguousarray(_cupy_view(cp, src, o))  # on st
                keep.append(staged)
                src_ptr = staged.data.ptr
            elif src.device.type == _CPU:
                host = np.ascontiguousarray(numpy_view(src.data_ptr, src.shape, src.strides, src.dtype.itemsize))
                keep.append(host)
                src_ptr = host.ctypes.data
            else:  # strided, on another CUDA device: make it contiguous there, in its stream's order
                x = src.device.id
                peer_src_stream = self._stream_of(src)
                with _Current(self, x), cp.cuda.Device(x), _cupy_stream(cp, peer_src_stream):
                    staged = cp.ascontiguousarray(_cupy_view(cp, src, x))
                keep.append(staged)
                src_ptr = staged.data.ptr
                st.wait(peer_src_stream.record())
            # 2. into the destination
            if _c_contiguous(dst.shape, dst.strides):
                self._memcpy(dst.data_ptr, src_ptr, nbytes, st)
                if dst.device.type == _CPU:
                    st.synchronize()
            elif dst_local:
                staged_dst = _cupy_empty_like(cp, dst)  # on st
                self._memcpy(staged_dst.data.ptr, src_ptr, nbytes, st)
                _cupy_view(cp, dst, o)[...] = staged_dst
            elif dst.device.type == _CPU:
                host_dst = np.empty(dst.shape, dtype=f"V{dst.dtype.itemsize}")
                self._memcpy(host_dst.ctypes.data, src_ptr, nbytes, st)
                st.synchronize()
                np.copyto(numpy_view(dst.data_ptr, dst.shape, dst.strides, dst.dtype.itemsize), host_dst)
            else:  # strided, on another CUDA device: land contiguous there, then scatter in its stream's order
                y = dst.device.id
                peer_dst_stream = self._stream_of(dst)
                with _Current(self, y), cp.cuda.Device(y), _cupy_stream(cp, peer_dst_stream):
                    staged_dst = _cupy_empty_like(cp, dst)
                st.wait(peer_dst_stream.record())
                self._memcpy(staged_dst.data.ptr, src_ptr, nbytes, st)
                peer_dst_stream.wait(st.record())
                with _Current(self, y), cp.cuda.Device(y), _cupy_stream(cp, peer_dst_stream):
                    _cupy_view(cp, dst, y)[...] = staged_dst
                st.wait(peer_dst_stream.record())
            if peer_src_stream is not None:
                # CuPy may reuse the staging block for later work on that stream only after st read it.
                peer_src_stream.wait(st.record())
            if read_on_return:
                st.synchronize()


# -- IPC helpers -----------------------------------------------------------------------------------
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, a bit of mempool_supported_handle_types


# -- CuPy helpers (imported only when a strided copy needs a kernel) ------------------------------
_UNITS = {8: "uint64", 4: "uint32", 2: "uint16", 1: "uint8"}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"a strided CUDA copy needs CuPy, which cannot be imported ({exc}); "
            f"install {_cupy_package()}, or make the data contiguous first"
        ) from exc
    return cupy


def _cupy_stream(cp: Any, stream: CUDAStream) -> Any:
    """A CuPy stream object over ``stream`` (not owning it), for ``with``."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14 (ExternalStream is deprecated there)
        try:
            return from_external(stream)
        except (TypeError, ValueError, RuntimeError):
            pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(stream.handle, stream.device.id)


def _raw_layout(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Shape, byte strides and unsigned dtype viewing ``tensor``'s elements as raw words
    (a trailing axis when the itemsize is not 1, 2, 4 or 8 bytes)."""
    itemsize = tensor.dtype.itemsize
    unit = next(u for u in (8, 4, 2, 1) if itemsize % u == 0)
    shape = tuple(tensor.shape)
    strides = tuple(s * itemsize for s in tensor.strides)
    if unit != itemsize:
        shape += (itemsize // unit,)
        strides += (unit,)
    return shape, strides, _UNITS[unit]


def _cupy_view(cp: Any, tensor: Any, ordinal: int) -> Any:
    """A CuPy array over ``tensor``'s memory (raw words), keeping ``tensor`` alive."""
    itemsize = tensor.dtype.itemsize
    lo = sum(s * (n - 1) for s, n in zip(tensor.strides, tensor.shape) if s < 0)
    hi = sum(s * (n - 1) for s, n in zip(tensor.strides, tensor.shape) if s > 0)
    span = (hi - lo + 1) * itemsize
    memory = cp.cuda.UnownedMemory(tensor.data_ptr + lo * itemsize, span, tensor, ordinal)
    pointer = cp.cuda.MemoryPointer(memory, -lo * itemsize)
    shape, strides, unit = _raw_layout(tensor)
    return cp.ndarray(shape, dtype=unit, memptr=pointer, strides=strides)


def _cupy_empty_like(cp: Any, tensor: Any) -> Any:
    shape, _, unit = _raw_layout(tensor)
    return cp.empty(shape, dtype=unit)


def _foreign_handle(obj: Any) -> int | None:
    """The ``cudaStream_t`` of a stream object, or None when ``obj`` is not one."""
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if isinstance(value, tuple) and len(value) == 2:
            return int(value[1])
        raise TypeError(f"{type(obj).__name__}.__cuda_stream__ must give (version, handle), got {value!r}")
    handle = getattr(obj, "handle", None)  # cuda.core Stream of a release without __cuda_stream__
    if handle is not None and type(obj).__module__.startswith("cuda.core"):
        return int(handle)
    cuda_stream = getattr(obj, "cuda_stream", None)  # torch.cuda.Stream
    if isinstance(cuda_stream, int) and not isinstance(cuda_stream, bool):
        return cuda_stream
    ptr = getattr(obj, "ptr", None)  # CuPy streams
    if isinstance(ptr, int) and not isinstance(ptr, bool) and type(obj).__module__.startswith("cupy"):
        return ptr
    return None


def _foreign_ordinal(obj: Any, count: int) -> int | None:
    """The CUDA device of a framework stream object when it says so without a driver
    call (PyTorch: ``.device.index``; CuPy: ``.device_id``, -1 when unknown)."""
    module = type(obj).__module__
    if module.startswith("torch"):
        index = getattr(getattr(obj, "device", None), "index", None)
        if isinstance(index, int) and 0 <= index < count:
            return index
    elif module.startswith("cupy"):
        device_id = getattr(obj, "device_id", None)
        if isinstance(device_id, int) and 0 <= device_id < count:
            return device_id
    return None
