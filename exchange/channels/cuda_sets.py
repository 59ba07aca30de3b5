"""Sets on CUDA memory: a version's region is one allocation of the IPC-enabled pool of
its device (``CUDABackend.ipc_resource``), and IPC events order the publisher's writes
before every reader's use and every reader's use before the region is written again.

The faces ``exchange.sets.memory`` asks of a kind of memory (see its docstring): the
publisher's ``Region`` and the reader's ``map_region`` and ``check_part``. Nothing here
is named by the sets' own modules: they load it by the CUDA channel's ``sets`` name.

How a version travels (one message per version, ``exchange.sets.wire``; its CUDA part,
``[device type, GPU uuid, pool uuid, allocation descriptor (hex), allocation bytes,
ready event (hex)]``):

* publisher: the copy into the region (or a draft's writes, whose streams the region's
  stream waits for) is queued on the device's sharing stream (``CUDAIPC.order_stream``);
  at publish an IPC event is recorded there (``ready``), kept until the region is
  written again (by then every reader that got it let go, so it opened it). The pool's
  descriptor (a file descriptor) goes once per reader connection; after that, per
  version, only the allocation's descriptor: cuda.core's ``IPCBufferDescriptor``
  payload as bytes, never pickled.
* reader: the pool is mapped once per process (``CUDAIPC.map_pool``); its sharing
  stream waits on ``ready`` (no host block) and then imports the allocation, once per
  process however many subscriptions hold it (two imports of one allocation share a
  pointer that the first close unmaps); the tensors are ordered on that stream, so a
  consumer's stream waits for it by the usual handshake. On release the default stream
  waits for every stream that used the version, unmaps it on the last release here,
  and records the process's release event (one IPC event per device, recorded again
  each time, alive as long as the process), whose handle goes back with the release.
* publisher: the sharing stream waits on each release event before anything later is
  queued there: the next write into the region, and its free (CUDA wants an importer's
  free before the exporter's).
* a reader in the publisher's own process (same backend) takes the region's memory as
  it is, with no pool or allocation import (CUDA does not open a process's own IPC
  handles), and waits on the events themselves, found by their handles (``_LOCAL``).

Errors: DeviceError (a driver failure, a GPU this reader does not see, a pool not
mapped here and no descriptor for it); ValueError for a malformed part.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from ..device import Device, DeviceType
from ..devices import cuda as _cuda
from ..devices import cuda_driver as _driver
from ..errors import DeviceError
from ..registry import _warn
from ..tensor import _backend
from .cuda import _ipc_get, _IPC_HANDLE_BYTES, ipc

_CUDA_TYPE = DeviceType.kDLCUDA
# This process's regions, by (pool uuid, allocation descriptor), and the events recorded
# for sets here, by handle, each with the backend's sharing state: a reader in this
# process uses them as they are (see the module's docstring).
_OWN: dict[tuple[str, bytes], "Region"] = {}
_LOCAL: dict[bytes, tuple[Any, Any]] = {}
#: Longest allocation descriptor accepted, bytes (cuda.core's is CUmemPoolPtrExportData: 64).
MAX_DESCRIPTOR = 256
_UUID_CHARS = 64


class Region:
    """The publisher's region of a set on ``device`` (``cuda:N``): ``nbytes`` bytes of
    the device's IPC-enabled pool at ``address``, owned here until ``close()`` (a free
    in stream order, after every reader's release event). ``fd`` is -1: nothing goes
    with each version; the pool's descriptor goes once per reader (``part``)."""

    __slots__ = ("id", "device", "stream", "buffer", "state", "uuid", "pool", "pool_fd", "payload", "size",
                 "ready")

    fd = -1

    def __init__(self, rid: int, nbytes: int, device: Device) -> None:
        backend = _backend(device)
        self.id, self.device = rid, device
        self.state = state = ipc(backend)
        self.stream = state.order_stream(device.id)  # writes, release waits and the free are queued here
        self.buffer = backend.allocate(nbytes, device, self.stream, shared=True).owner
        self.ready: tuple[Any, bytes] | None = None  # (IPC event, its handle) of the version it holds
        try:
            with _cuda._Current(backend, device.id):
                mr = self.buffer.memory_resource
                payload, size = _ipc_get(self.buffer, "ipc_descriptor", "get_ipc_descriptor").__reduce__()[1]
                self.pool, self.pool_fd = str(mr.uuid), int(_ipc_get(mr, "allocation_handle", "get_allocation_handle"))
            self.payload, self.size = bytes(payload), int(size)
            self.uuid = state.device_uuid(device.id)
            _OWN[(self.pool, self.payload)] = self
        except BaseException as exc:
            self.close()
            if isinstance(exc, _driver.CUDA_ERRORS):
                raise _driver.device_error(exc) from exc
            raise

    @property
    def nbytes(self) -> int:
        return int(self.buffer.size)

    @property
    def address(self) -> int:
        return int(self.buffer.handle)

    def written(self, streams: list[Any]) -> None:
        """A version was written into the region (on ``stream``, and on ``streams``: a
        draft's): record the event readers wait on before any use."""
        for other in streams:
            if isinstance(other, _cuda.CUDAStream) and other.order_key() != self.stream.order_key():
                self.stream.wait(other.record())
        if self.ready is not None:
            _LOCAL.pop(self.ready[1], None)
        self.ready = self.state.record(self.stream)
        _LOCAL[self.ready[1]] = (self.state, self.ready[0])

    def part(self, sent: set) -> tuple[list, int]:
        """The CUDA part of a version's message to a reader, and the pool's descriptor
        when this reader's connection (``sent``: what went on it already) has not had it
        (-1 otherwise; the pool owns it, the socket sends a copy)."""
        assert self.ready is not None, "a CUDA region handed out before it was written"
        fd = -1
        if self.pool not in sent:
            sent.add(self.pool)
            fd = self.pool_fd
        return [int(_CUDA_TYPE), self.uuid, self.pool, self.payload.hex(), self.size, self.ready[1].hex()], fd

    def released(self, token: str, pid: int) -> None:
        """A reader (process ``pid``) let go, sending its release event (``token``, hex):
        the sharing stream waits on it, so nothing later written or freed here runs
        before that reader's work. A failure to open it (the reader died, its context
        and work gone with it) is warned about and ignored."""
        try:
            _wait(self.state, self.stream, bytes.fromhex(token))
        except Exception as exc:
            _warn(f"tx.publish: could not wait on the release event of process {pid} ({exc})")

    def close(self) -> None:
        """Free the allocation in stream order (after the release events waited on)."""
        if getattr(self, "ready", None) is not None:
            _LOCAL.pop(self.ready[1], None)
        if _OWN.get((getattr(self, "pool", None), getattr(self, "payload", None))) is self:
            del _OWN[(self.pool, self.payload)]
        buffer, self.buffer = getattr(self, "buffer", None), None
        if buffer is not None:
            try:
                with _cuda._Current(self.state.backend, self.device.id):
                    buffer.close(self.stream.core)
            except _driver.CUDA_ERRORS as exc:
                _warn(f"tx.publish: freeing a set's CUDA region failed ({_driver.device_error(exc)})")


def check_part(part: Any, region_bytes: int) -> tuple:
    """The CUDA part of a version's message, checked: ``(gpu uuid, pool uuid,
    descriptor bytes, allocation bytes, ready event handle)``. ValueError otherwise."""
    if not (isinstance(part, list) and len(part) == 6 and part[0] == int(_CUDA_TYPE)
            and all(type(x) is str and 0 < len(x) <= _UUID_CHARS for x in part[1:3])
            and type(part[3]) is str and type(part[4]) is int and type(part[5]) is str):
        raise ValueError("a malformed CUDA part")
    try:
        descriptor, event = bytes.fromhex(part[3]), bytes.fromhex(part[5])
    except ValueError:
        raise ValueError("a CUDA part that is not hex") from None
    if not 0 < len(descriptor) <= MAX_DESCRIPTOR or len(event) != _IPC_HANDLE_BYTES:
        raise ValueError("a CUDA descriptor or event of the wrong size")
    if part[4] != region_bytes:
        raise ValueError("a CUDA allocation of another size than its region")
    return part[1], part[2], descriptor, part[4], event


# One import per allocation per process, counted: two imports of one allocation would
# give one pointer, unmapped by the first close (cuda-python#2783).
_IMPORTS: dict[tuple[str, bytes], list] = {}
_IMPORTS_LOCK = threading.Lock()


class Mapping:
    """A reader's import of one version's allocation (one per version taken: never
    cached, since the publisher frees only after the last importer unmapped).
    ``address``, ``nbytes``, ``device`` (this process's ordinal of the GPU), ``stream``
    (the sharing stream, which waited on the publisher's ready event: the tensors are
    ordered on it), ``sealed`` False (read-only is the Tensor's flag only)."""

    __slots__ = ("device", "stream", "state", "key", "buffer", "address", "nbytes")

    sealed = False
    per_version = True

    def __init__(self, fds: list[int], parsed: tuple) -> None:
        uuid, pool, descriptor, size, event = parsed
        self.state = state = ipc(_reader_backend())
        ordinal = state.ordinal_of_uuid(uuid)
        if ordinal is None:
            raise DeviceError(f"the set's memory is on GPU {uuid}, which this process does not see")
        self.device = Device(_CUDA_TYPE, ordinal)
        self.stream = state.order_stream(ordinal)
        self.key = (pool, descriptor)
        own = _OWN.get(self.key)
        if own is not None and own.state is state and own.buffer is not None:  # the publisher is this process
            _wait(state, self.stream, event)
            self.buffer = None
            self.address, self.nbytes = own.address, own.nbytes
            return
        mr = state.map_pool(ordinal, pool, fds[0] if fds else None)
        _wait(state, self.stream, event)  # the publisher's writes, before any use here
        with _IMPORTS_LOCK:
            entry = _IMPORTS.get(self.key)
            if entry is None:
                entry = _IMPORTS[self.key] = [_import(state, mr, ordinal, descriptor, size, self.stream), 0]
            entry[1] += 1
        self.buffer = entry[0]
        self.address, self.nbytes = int(self.buffer.handle), int(self.buffer.size)

    def release(self, streams: list[Any]) -> str:
        """Let go of the version: the device's default stream waits for ``streams``
        (those that used it), unmaps the allocation if this was its last import here,
        and records the release event (``_release_event``). Returns its handle (hex,
        for the publisher)."""
        st = self.state.backend.default_stream(self.device)
        for other in [self.stream, *streams]:
            if isinstance(other, _cuda.CUDAStream) and other.order_key() != st.order_key():
                st.wait(other.record())
        with _IMPORTS_LOCK:
            entry = _IMPORTS.get(self.key)
            last = entry is not None and entry[0] is self.buffer and entry[1] == 1
            if entry is not None and entry[0] is self.buffer:
                entry[1] -= 1
                if last:
                    del _IMPORTS[self.key]
        if self.buffer is None:  # the publisher's own region: nothing was imported
            return _release_event(self.state, st).hex()
        if last:
            try:
                with _cuda._Current(self.state.backend, self.device.id):
                    self.buffer.close(st.core)
            except _driver.CUDA_ERRORS as exc:
                raise _driver.device_error(exc) from exc
        return _release_event(self.state, st).hex()

    def close(self) -> None:
        """(Nothing: ``release`` unmapped it.)"""


def _reader_backend() -> Any:
    """The CUDA backend a reader maps with: this process's (BackendUnavailableError
    without CUDA). Versions may be mapped on the runtime's thread."""
    return _backend(Device(_CUDA_TYPE, 0))


def _wait(state: Any, stream: Any, handle: bytes) -> None:
    """``stream`` waits on the event with ``handle``: this process's own (recorded for a
    set with this backend) as it is, another process's through CUDA IPC."""
    local = _LOCAL.get(handle)
    if local is not None and local[0] is state:
        stream.wait(local[1])
    else:
        state.wait(stream, handle)


def _import(state: Any, mr: Any, ordinal: int, descriptor: bytes, size: int, stream: Any) -> Any:
    cc = state.backend._cc
    try:
        with _cuda._Current(state.backend, ordinal):
            return cc.Buffer.from_ipc_descriptor(mr, _buffer_descriptor(cc)(descriptor, size), stream=stream.core)
    except _driver.CUDA_ERRORS as exc:
        raise _driver.device_error(exc) from exc


def _buffer_descriptor(cc: Any) -> Any:
    """cuda.core's ``IPCBufferDescriptor._init(payload, size)``: how its own unpickling
    rebuilds one (bytes from a socket are never unpickled here)."""
    cls = getattr(cc, "IPCBufferDescriptor", None)
    if cls is None:
        module = importlib.import_module(cc.Buffer.__module__)
        cls = getattr(module, "IPCBufferDescriptor", None)
        if cls is None:
            try:
                cls = getattr(importlib.import_module(module.__name__.rpartition(".")[0] + "._ipc"),
                              "IPCBufferDescriptor", None)
            except ImportError:
                cls = None
    make = getattr(cls, "_init", None)
    if make is None:
        raise DeviceError(f"this cuda.core ({getattr(cc, '__version__', '?')}) has no IPCBufferDescriptor._init to "
                          "map another process's allocation with")
    return make


def map_region(fds: list[int], nbytes: int, parsed: tuple) -> Mapping:
    """A reader's mapping of one version (``parsed``: ``check_part``'s), ordered after the
    publisher's writes; ``fds`` (the pool's descriptor, when it came) stay the caller's
    to close."""
    return Mapping(fds, parsed)


def _release_event(state: Any, st: Any) -> bytes:
    """Record this process's release event of ``st``'s device on ``st`` (the default
    stream) and return its handle. One IPC event per backend and device, recorded again
    for each release: it lives as long as the process, so the publisher can open it
    whenever it reads the release (CUDA leaves an IPC event opened after its exporter
    destroyed it undefined), and opened late it marks a later point of the same stream,
    which orders the publisher after more work, never less."""
    key = (id(state), st.device.id)
    with _RELEASE_LOCK:
        found = _RELEASE.get(key)
        if found is None:
            event, handle = state.record(st)
            _RELEASE[key] = (state, event, handle)
            _LOCAL[handle] = (state, event)
            return handle
        _, event, handle = found
        try:
            with _cuda._Current(state.backend, st.device.id):
                st.core.record(event)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        return handle


_RELEASE: dict[tuple[int, int], tuple[Any, Any, bytes]] = {}  # (sharing state id, ordinal) -> (state, event, handle)
_RELEASE_LOCK = threading.Lock()
