"""Allocation and streams: ``tx.empty`` and ``tx.create_stream``, and the helpers every
way in shares to reach a device's backend (``_backend``), to take a ``stream=``
argument (``_resolve_stream``), to copy between tensors (``copy_into``), to make a
Tensor over a record (``_make``) and to ask what memory a device type holds
(``_memory``, the backends' MemoryKind: no device kind is named here).

It owns memory the library allocates: the release of a backend's allocation
(``_Free``), and the retry of an allocation that found no memory while releases were
pending.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Sequence

from . import _core
from .device import Device
from .dtypes import DType
from .dtypes import dtype as _as_dtype
from .layout import check_shape
from .registry import Record, registry

if TYPE_CHECKING:
    from .devices.base import MemoryKind
    from .tensor_type import Tensor

__all__ = ["empty", "create_stream"]

_REG = registry()


def _backend(device: Device) -> Any:
    from .devices.base import get_backend

    return get_backend(device.type)


def _memory(device_type: int) -> "MemoryKind | None":
    """What its backend declared of ``device_type``'s memory (None: no backend serves it);
    never loads a backend."""
    from .devices.base import memory_kind

    return memory_kind(device_type)


def _host_readable(device: Device) -> bool:
    """True when the host reads ``device``'s memory in place (CPU, pinned, managed)."""
    kind = _memory(device.type)
    return kind is not None and kind.host_readable


def copy_into(dst: "Tensor", src: "Tensor", stream: Any = None, backend: Any = None) -> None:
    """Copy ``src`` into ``dst`` (equal shapes and itemsizes) with ``backend`` (default:
    ``src``'s device's), ordered on ``stream``; the stream the copy is queued on joins
    both records' streams, so neither is released before the copy has run."""
    used = (backend or _backend(src.device)).copy(dst, src, stream)
    if used is not None:
        _REG.add_stream(src._record, used)
        _REG.add_stream(dst._record, used)


def _make(record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: DType,
          readonly: Any, stream: Any = None, holder: str = "tx.Tensor") -> "Tensor":
    """A new Tensor over ``record``, a new holder of it (``Tensor._make``)."""
    token = _REG.add_holder(record, holder)
    try:
        return _core.new_tensor(record, token, data_ptr, shape, strides, dtype, readonly, stream)
    except BaseException:
        _REG.remove_holder(record, token)
        raise


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    if hasattr(shape, "__index__") and not isinstance(shape, bool):
        shape = (shape,)
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    dims = []
    for n in items:
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"shape must hold ints, got {shape!r}")
        dims.append(operator.index(n))
    return tuple(dims)  # its values are checked by exchange.layout.check_shape


def _resolve_stream(stream: Any, device: Device) -> Any:
    """Our Stream object for a ``stream=`` argument on ``device`` (None stays None)."""
    if stream is None:
        return None
    stream_device = getattr(stream, "device", None)
    if isinstance(stream_device, Device) and _compatible(stream_device, device) is False:
        raise ValueError(f"stream {stream!r} belongs to {stream_device}, but the data is on {device}")
    return _backend(device).as_stream(stream, device)


def _compatible(stream_device: Device, device: Device) -> bool:
    if stream_device == device:
        return True
    # Memory other devices' streams may order (pinned and managed memory: any CUDA
    # device's), as its backend declared.
    kind = _memory(device.type)
    return kind is not None and stream_device.type in kind.shared_by


#: Seconds an allocation that found no memory waits for its device's pending releases
#: before its one retry.
OOM_WAIT = 0.1


class _Free:
    """The release of memory a backend allocated: ``backend.free(allocation, stream)``.
    ``free_after(streams)`` asks a backend that frees in stream order itself to do so
    after the work of ``streams`` (True when it did; the registry then needs no event)."""

    __slots__ = ("backend", "allocation", "stream")

    def __init__(self, backend: Any, allocation: Any, stream: Any) -> None:
        self.backend, self.allocation, self.stream = backend, allocation, stream

    def __call__(self) -> None:
        self.backend.free(self.allocation, self.stream)

    def free_after(self, streams: list[Any]) -> bool:
        ordered = getattr(self.backend, "free_after", None)
        return bool(ordered is not None and ordered(self.allocation, self.stream, streams))


def _allocate(backend: Any, nbytes: int, device: Device, stream: Any, shared: bool = False) -> Any:
    def attempt() -> Any:
        if shared:  # only backends that can share take the keyword
            return backend.allocate(nbytes, device, stream, shared=True)
        return backend.allocate(nbytes, device, stream)

    try:
        return attempt()
    except MemoryError as exc:
        if not _REG.pending_bytes(device):
            raise _out_of_memory(exc, nbytes, device, 0) from exc
    # Outside the handler (its traceback would keep this frame's objects alive): the
    # memory waiting for its stream-ordered release is still in use; give it a moment.
    _REG.wait_for_device(device, OOM_WAIT)
    try:
        return attempt()
    except MemoryError as exc:
        raise _out_of_memory(exc, nbytes, device, _REG.pending_bytes(device)) from exc


def _out_of_memory(exc: MemoryError, nbytes: int, device: Device, pending: int) -> MemoryError:
    from .errors import ExchangeError

    message = f"cannot allocate {nbytes} bytes on {device} ({exc})"
    if pending:
        message += (f"; {pending} bytes there are still waiting for their stream-ordered release after "
                    f"{OOM_WAIT * 1e3:g} ms: finish or synchronize the streams that use them, or call "
                    "tx.registry().collect(), then retry")
    cls = type(exc) if issubclass(type(exc), ExchangeError) else MemoryError
    return cls(message)


# -- public functions -----------------------------------------------------------------------
def empty(shape: int | Sequence[int], dtype: Any = "float32", *, device: Any = "cpu",
          stream: Any = None, shared: bool = False) -> Tensor:
    """A new, uninitialised, C-contiguous tensor.

    ``shape``: int or sequence of int (extents >= 0); ``dtype``: a tx.DType, a name
    such as ``"float32"``, or a NumPy, PyTorch or JAX dtype (all that ``tx.dtype``
    takes); ``device``: ``"cpu"``, ``"cuda:0"``,
    ``"cuda_host"``, ``"cuda_managed"`` or a tx.Device; ``stream``: the stream the
    allocation is ordered on and the data will be written on (None: the default).
    ``shared=True``: memory other processes can map, so ``tx.share`` hands it over
    without a copy: on the CPU a block of this process's shared arenas (anonymous
    shared memory, 64-byte aligned, page-aligned above 4 MiB; a freed block is handed
    out again, with what it held), on CUDA an IPC-enabled cuda.core memory pool
    (``cpu`` and ``cuda:N`` only, else ValueError). See docs/processes.md.

    Ownership: the library allocates (CPU: 64-byte aligned) and frees; the free runs
    once the last holder is gone and the streams that used the memory have finished
    (for shared memory: in every process that attached it).
    CUDA device memory is freed in stream order on the device (its free stream waits on
    the other streams that used it, then ``cuMemFreeAsync``): the host never waits.

    Memory still waiting for its stream-ordered release is in use: when the backend
    finds no memory, this completes what is ready, waits up to ``OOM_WAIT`` seconds for
    that device's pending releases, and retries once.

    Raises TypeError / ValueError for a bad shape or dtype (ValueError, from the one layout
    check in exchange/layout.py: more than 1024 dimensions, a negative extent, 2**63
    elements or bytes or more, a row-major stride beyond int64 even with zero elements,
    as for ``(0, 2**40, 2**40)``), BackendUnavailableError
    when the device's backend cannot load here (for CUDA: the reason, e.g. no driver),
    MemoryError (for CUDA its subclass CUDAOutOfMemoryError) when the retry fails too,
    naming the bytes still pending release on that device.
    """
    dims = _shape_tuple(shape)
    dt = _as_dtype("float32" if dtype is None else dtype)
    what = f"tx.empty: shape {dims} of {dt.name}" if len(dims) <= 8 else f"tx.empty of {dt.name}"
    strides, _, nbytes = check_shape(dims, None, dt.itemsize, what)  # ValueError (exchange/layout.py)
    dev = Device.parse(device)
    backend = _backend(dev)
    st = _resolve_stream(stream, dev)
    alloc = _allocate(backend, nbytes, dev, st, shared)
    record = _REG.new_record(dev, alloc.address, nbytes, origin="allocated", kind="allocated",
                             release=_Free(backend, alloc, st), owner=alloc.owner)
    tensor = _make(record, alloc.address, dims, strides, dt, False, st)
    if st is not None:
        _REG.add_stream(record, st)
    return tensor


def create_stream(device: Any = "cpu") -> Any:
    """A new stream on ``device``: a host stream (ordered work queue with a worker thread)
    on the CPU, a CUDA stream on CUDA. Raises BackendUnavailableError if the device's
    backend cannot load."""
    dev = Device.parse(device)
    return _backend(dev).create_stream(dev)
