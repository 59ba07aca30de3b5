"""What a device backend gives: the Backend, Stream and Event protocols, and the
registration of backends by DLPack device type (loaded lazily, on first use).

A backend that cannot load here (no driver, no package) raises
``exchange.BackendUnavailableError`` from ``get_backend``, with the reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from exchange.device import Device, DeviceType
from exchange.errors import BackendUnavailableError

__all__ = ["Event", "Stream", "Allocation", "Backend", "MemoryKind", "register_backend", "get_backend",
           "memory_kind"]


@dataclass(frozen=True)
class MemoryKind:
    """What the device-neutral core must know of one DLPack device type's memory, so that
    it never names a device kind itself. Declared when the backend registers
    (devices/__init__.py): asking never loads a backend.

    ``host_readable``: the host reads and writes it in place (CPU, pinned and managed
    memory). Export to ``(kDLCPU, 0)`` needs no copy; export with no consumer stream
    makes it host-ready, since the consumer may read it from the host (NumPy does).
    Memory that is not host-readable (a GPU's) is ordered on streams by a handshake.
    ``shared_by``: device types whose streams, on any ordinal, may order work on this
    memory besides its own device's (pinned and managed memory: every CUDA device's).
    ``producer_stream``: an import with no caller's stream still hands the producer the
    device's default stream as ``__dlpack__(stream=...)`` (device and managed memory);
    False where DLPack names no stream and producers treat it as host data (CPU, pinned:
    PyTorch asserts ``stream is None`` for kDLCUDAHost).
    ``channel``: the memory channel that carries this memory to other processes as it
    is (a module of ``exchange.channels``: ``"host"``, ``"cuda"``); None where none
    does (``tx.share`` refuses it: move it to memory that has one).
    """

    host_readable: bool
    shared_by: tuple[DeviceType, ...] = ()
    producer_stream: bool = False
    channel: str | None = None


@runtime_checkable
class Event(Protocol):
    """A point in a stream's work. ``query()`` is True once all work queued before it
    has finished (never blocks); ``synchronize()`` blocks the host until then."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@runtime_checkable
class Stream(Protocol):
    """An ordered queue of work on one device. ``handle`` is the integer a DLPack
    ``__dlpack__(stream=...)`` call carries (a ``cudaStream_t`` on CUDA)."""

    device: Device
    handle: int

    def record(self) -> Event:
        """Record an event after all work queued so far; never blocks the host."""
        ...

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; never blocks the host."""
        ...

    def synchronize(self) -> None:
        """Block the host until all work queued so far has finished."""
        ...


@dataclass
class Allocation:
    """Memory a backend allocated: ``address`` (int), ``nbytes`` (bytes), ``device``, and
    ``owner``, the backend's object that keeps it alive until ``Backend.free``."""

    address: int
    nbytes: int
    device: Device
    owner: Any = field(default=None, repr=False)


class Backend(Protocol):
    """One device backend (devices/cpu.py, devices/cuda.py).

    ``device_types`` lists the DLPack device types it serves. Sizes are in bytes;
    ``stream`` arguments order the operation (None: the device's default stream).
    """

    name: str
    device_types: tuple[DeviceType, ...]

    def allocate(self, nbytes: int, device: Device, stream: Stream | None = None) -> Allocation: ...

    def free(self, allocation: Allocation, stream: Stream | None = None) -> None: ...

    def default_stream(self, device: Device) -> Stream: ...

    def create_stream(self, device: Device) -> Stream: ...

    def stream_from_dlpack(self, value: int | None, device: Device) -> Stream | None:
        """The stream a DLPack ``stream`` integer names on ``device`` (None for -1:
        no synchronisation). Raises ValueError for a value the table forbids."""
        ...

    def to_dlpack_stream(self, stream: Stream | None, device: Device) -> int | None:
        """The integer to pass as ``__dlpack__(stream=...)`` for a consumer using
        ``stream`` (None: the default stream) on ``device``; None on the CPU."""
        ...

    def as_stream(self, obj: Any, device: Device) -> Stream:
        """Our Stream for a Stream of ours, an int handle, or a framework stream object."""
        ...

    def order_key(self, stream: Stream) -> Any:
        """A hashable naming the ordered queue ``stream``'s work lands on when queued from
        the calling thread: work queued on two streams with one key runs in the order it
        was queued, so the handshake between them needs no wait. (A handle alone cannot
        say: CUDA's per-thread default stream is handle 2 on every thread.)"""
        ...

    def copy(self, dst: Any, src: Any, stream: Stream | None = None) -> Stream | None:
        """Copy tensor ``src`` into tensor ``dst`` (same shape and dtype, any strides,
        either on this backend's devices or the CPU), ordered on ``stream``. Returns the
        stream the copy is queued on, for the caller to add to both tensors' records
        (a backend knows nothing of the registry), or None when it completed on return."""
        ...


_loaders: dict[DeviceType, Callable[[], Backend]] = {}
_loaded: dict[DeviceType, Backend] = {}
_kinds: dict[DeviceType, MemoryKind] = {}
_lock = threading.Lock()


def register_backend(device_types: tuple[DeviceType, ...], loader: Callable[[], Backend],
                     kinds: dict[DeviceType, MemoryKind] | None = None) -> None:
    """Register ``loader`` (called once, on first use) for these DLPack device types, and
    the MemoryKind of each (``kinds``; a type left out keeps the kind it had, or none)."""
    with _lock:
        for t in device_types:
            _loaders[DeviceType(t)] = loader
            _loaded.pop(DeviceType(t), None)
        for t, kind in (kinds or {}).items():
            _kinds[DeviceType(t)] = kind


def memory_kind(device_type: DeviceType | int) -> MemoryKind | None:
    """The MemoryKind its backend declared for ``device_type``; None where no backend
    serves it (the core refuses such memory). Never loads a backend."""
    try:
        return _kinds.get(DeviceType(device_type))
    except ValueError:
        return None


def get_backend(device_type: DeviceType | int) -> Backend:
    """The backend serving ``device_type``, loading it on first use.

    Raises BackendUnavailableError (an ImportError) when none is registered or it
    cannot load here; the message says why (missing package, no driver, no device).
    """
    t = DeviceType(device_type)
    backend = _loaded.get(t)
    if backend is not None:
        return backend
    with _lock:
        backend = _loaded.get(t)
        if backend is not None:
            return backend
        loader = _loaders.get(t)
        if loader is None:
            raise BackendUnavailableError(f"no tensor-exchange backend serves {t.name} memory")
        try:
            backend = loader()
        except BackendUnavailableError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(f"the backend for {t.name} could not load: {exc}") from exc
        for served in backend.device_types:
            _loaded[served] = backend
        return backend
