"""The CUDA memory channel: CUDA memory across processes, by CUDA IPC.

cuda.core (>= 0.4) shares stream-ordered pool memory: an IPC-enabled pool
(``DeviceMemoryResourceOptions(ipc_enabled=True)``, which the CUDA backend allocates
``tx.empty(..., device="cuda:N", shared=True)`` from: ``CUDABackend.ipc_resource``)
gives each process that receives its allocation handle (a file descriptor, passed over
a Unix socket) a mapped pool, from which ``Buffer.from_ipc_descriptor`` maps one
allocation; IPC events order work across the processes. Where a release differs
between cuda.core versions (a property in 1.x, a get_ method before), both are tried.

Owns both levels of CUDA sharing:

* the memory (``CUDAIPC``, one per CUDA backend: ``ipc(backend)``): the ordering stream
  of each device, the pools of other processes mapped here, export and import of one
  allocation, IPC events recorded and waited on, the stream-ordered unmap;
* the channel (``CHANNEL``, ``exchange.channels.MemoryChannel``): on the sending side
  what a handle carries (the GPU's UUID, the pool's UUID, the buffer's descriptor, after
  the ordering stream waited for the data), what an attach gets back (an IPC event on
  the ordering stream, the pool's descriptor on first need) and the waits on the
  receivers' release events; on the receiving side the attach (the pool mapped once per
  process, the buffer, the stream waits) and the stream-ordered release
  (``CUDAMapping``).

Nothing here imports a CUDA package at import time: the CUDA backend does, on first use
of CUDA memory.
"""

from __future__ import annotations

import importlib
import os
import pickle
import weakref
from typing import Any

from ..device import Device, DeviceType
from ..devices import cuda as _cuda
from ..devices import cuda_driver as _driver
from ..errors import DeviceError
from ..registry import Record, _warn, registry
from ..tensor import Tensor, _backend
from ..sharing.protocol import close_fds
from ..sharing.receiving import Attempt, Client, Connections, Mapping, view
from . import Served

__all__ = ["CHANNEL", "CUDAChannel", "CUDAIPC", "CUDAMapping", "ipc"]

_REG = registry()
_CUDA_TYPE = DeviceType.kDLCUDA
_IPC_HANDLE_BYTES = 64  # sizeof(CUipcEventHandle)


# -- the memory ------------------------------------------------------------------------------------
class CUDAIPC:
    """What one CUDA backend keeps for sharing: the stream of each device that orders
    sharing, the pools of other processes mapped here, and how cuda.core rebuilds an
    IPC event descriptor. The IPC-enabled pools themselves are the backend's
    (``CUDABackend.ipc_resource``): it allocates shared memory from them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.streams: dict[int, Any] = {}
        self.pools: dict[str, Any] = {}
        self.event_rebuild: Any = None  # IPCEventDescriptor._init, found on first use

    def shareable(self, owner: Any) -> bool:
        """True for a Buffer of this process's IPC-enabled pools (not a mapped one)."""
        mr = getattr(owner, "memory_resource", None)
        return mr is not None and any(mr is r for r in self.backend._ipc_resources.values())

    def order_stream(self, ordinal: int) -> _cuda.CUDAStream:
        """The stream of device ``ordinal`` that orders sharing: a share makes it wait for
        the data's stream, attaching processes wait for it, and their releases make it
        wait for their work before this process frees."""
        st = self.streams.get(ordinal)
        if st is None:
            with self.backend._lock:
                st = self.streams.get(ordinal)
                if st is None:
                    st = self.streams[ordinal] = self.backend.create_stream(self.backend._devices[ordinal])
        return st

    def device_uuid(self, ordinal: int) -> str:
        """The UUID of CUDA device ``ordinal`` (the same GPU has the same UUID in every
        process, whatever CUDA_VISIBLE_DEVICES numbers it)."""
        return str(self.backend._cc.Device(ordinal).uuid)

    def ordinal_of_uuid(self, uuid: str) -> int | None:
        """This process's ordinal for the GPU with ``uuid``, None if it does not see it."""
        for i in range(self.backend.device_count):
            if self.device_uuid(i) == uuid:
                return i
        return None

    def export_buffer(self, owner: Any, ordinal: int) -> tuple[str, bytes, int]:
        """``(pool uuid, buffer descriptor, pool file descriptor)`` for a shareable
        Buffer of device ``ordinal``: the descriptor is cuda.core's IPCBufferDescriptor,
        pickled; the file descriptor stays owned by the pool (send a duplicate)."""
        try:
            with _cuda._Current(self.backend, ordinal):
                mr = owner.memory_resource
                descriptor = _ipc_get(owner, "ipc_descriptor", "get_ipc_descriptor")
                handle = _ipc_get(mr, "allocation_handle", "get_allocation_handle")
                return str(mr.uuid), pickle.dumps(descriptor), int(handle)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def has_pool(self, pool: str) -> bool:
        """True when this process has mapped the pool with uuid ``pool`` already."""
        return pool in self.pools

    def import_buffer(self, ordinal: int, pool: str, pool_fd: int | None, descriptor: bytes,
                      stream: _cuda.CUDAStream) -> Any:
        """Map one allocation of another process's pool on device ``ordinal``: the pool
        (mapped once per process, from ``pool_fd``, which the caller closes), then the
        buffer from its pickled descriptor. The Buffer's ``close(stream)`` unmaps it."""
        mr = self.map_pool(ordinal, pool, pool_fd)
        try:
            with _cuda._Current(self.backend, ordinal):
                return self.backend._cc.Buffer.from_ipc_descriptor(mr, pickle.loads(descriptor), stream=stream.core)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def map_pool(self, ordinal: int, pool: str, pool_fd: int | None) -> Any:
        """Another process's pool with uuid ``pool`` on device ``ordinal``, mapped once per
        process (from ``pool_fd``, which the caller closes; None when it has none to
        give). DeviceError when it is not mapped here and no descriptor came."""
        mr = self.pools.get(pool)
        if mr is not None:
            return mr
        if pool_fd is None:
            raise DeviceError(f"the memory pool {pool} is not mapped here and no handle for it came")
        try:
            with _cuda._Current(self.backend, ordinal):
                mr = self.backend._cc.DeviceMemoryResource.from_allocation_handle(ordinal, pool_fd)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        self.pools[pool] = mr
        return mr

    def record(self, stream: _cuda.CUDAStream) -> tuple[Any, bytes]:
        """Record an IPC-capable event on ``stream`` now; returns it (keep it alive until
        the other process has opened it) and its handle's bytes."""
        try:
            with _cuda._Current(self.backend, stream.device.id):
                event = stream.core.record(options=self.backend._cc.EventOptions(ipc_enabled=True))
                descriptor = _ipc_get(event, "ipc_descriptor", "get_ipc_descriptor")
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        # The descriptor pickles as (rebuild, (handle bytes, blocking_sync)): its bytes
        # are what travels; wait builds a descriptor from bytes (_event_descriptor),
        # never unpickling what a socket sent.
        args = descriptor.__reduce__()[1]
        return event, bytes(args[0])

    def wait(self, stream: _cuda.CUDAStream, handle: bytes) -> None:
        """Make ``stream`` wait for an event another process recorded (its handle's
        bytes, from ``record``); no host block, and no event of this process made
        for it. ValueError for a malformed handle; DeviceError when this cuda.core has
        no IPCEventDescriptor to open it with."""
        if not isinstance(handle, bytes) or len(handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC event handle is {_IPC_HANDLE_BYTES} bytes, got {len(handle)!r}")
        try:
            with _cuda._Current(self.backend, stream.device.id):
                event = self.backend._cc.Event.from_ipc_descriptor(self._event_descriptor(handle))
                stream.core.wait(event)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def _event_descriptor(self, handle: bytes) -> Any:
        """cuda.core's IPCEventDescriptor for an event handle's bytes, made as its own
        unpickling does (``IPCEventDescriptor._init(bytes, blocking_sync)``), with the
        flag ``record``'s events have: no blocking sync (it decides only how a host
        would wait on the event; this process only makes a stream wait on it)."""
        make = self.event_rebuild
        if make is None:
            module = importlib.import_module(self.backend._cc.Event.__module__)  # cuda.core._event, or .experimental's
            cls = getattr(self.backend._cc, "IPCEventDescriptor", None) or getattr(module, "IPCEventDescriptor", None)
            make = getattr(cls, "_init", None)
            if make is None:
                raise DeviceError(f"this cuda.core ({getattr(self.backend._cc, '__version__', '?')}) has no "
                                  "IPCEventDescriptor._init to open another process's CUDA event with")
            self.event_rebuild = make
        return make(handle, False)

    def close_import(self, buffer: Any, device: Device, streams: list[Any]) -> tuple[Any, bytes]:
        """Unmap an imported allocation in stream order: the default stream of ``device``
        waits for ``streams``, frees the mapping (cuMemFreeAsync), and an IPC event is
        recorded after the free, which the exporting process waits on before its own
        free (CUDA requires the importer's free to complete first). Returns the event
        and its handle's bytes (``record``)."""
        st = self.backend.default_stream(device)
        for other in streams:
            if isinstance(other, _cuda.CUDAStream) and other.order_key() != st.order_key():
                st.wait(other.record())
        try:
            with _cuda._Current(self.backend, device.id):
                buffer.close(st.core)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        return self.record(st)


def _ipc_get(obj: Any, prop: str, method: str) -> Any:
    """``obj.prop`` (cuda.core 1.x properties) or ``obj.method()`` (earlier releases)."""
    value = getattr(obj, prop, None)
    if value is not None and not callable(value):
        return value
    return getattr(obj, method)()


_IPC: "weakref.WeakKeyDictionary[Any, CUDAIPC]" = weakref.WeakKeyDictionary()


def ipc(backend: Any) -> CUDAIPC:
    """The sharing state of CUDA ``backend`` (made on first use)."""
    state = _IPC.get(backend)
    if state is None:
        with backend._lock:
            state = _IPC.get(backend)
            if state is None:
                state = _IPC[backend] = CUDAIPC(backend)
    return state


def _ipc_of(device: Device) -> CUDAIPC:
    return ipc(_backend(device))  # BackendUnavailableError without CUDA


# -- the channel -----------------------------------------------------------------------------------
class CUDAChannel:
    """CUDA device memory of IPC-enabled pools (see the module's docstring and
    ``exchange.channels.MemoryChannel``). A handle's part: ``(device uuid, pool uuid,
    pickled IPCBufferDescriptor)``."""

    kind = "cuda"
    label = "CUDA"
    takes_stream = True
    arenas = False
    #: The module here that holds a set's versions in this memory (exchange/sets/memory.py
    #: loads it by this name: ``cuda_sets``).
    sets = "cuda_sets"

    # -- the sending side
    def why_not_shareable(self, record: Record, readonly: bool, isolated: bool) -> str | None:
        if _ipc_of(record.device).shareable(record._owner):
            return None
        if record.kind == "imported" and str(record._origin).startswith("process "):
            return "it is CUDA memory attached from another process, which only its owner can share"
        return (f"its CUDA memory ({record.origin}) is not from an IPC-enabled pool; allocate it with "
                "tx.empty(..., device='cuda:N', shared=True) to share it without a copy")

    def shareable_copy(self, tensor: Tensor, readonly: bool, isolated: bool) -> Tensor:
        from ..tensor import copy_into, empty

        device = tensor._record.device
        out = empty(tensor._shape, tensor._dtype, device=device, stream=tensor._stream, shared=True)
        copy_into(out, tensor, tensor._stream, _backend(device))
        return out

    def sealed(self, record: Record) -> bool:
        return False  # read-only is the receiver's Tensor flag only

    def export(self, record: Record, tensor: Tensor) -> tuple[tuple, int, int]:
        """Attaching processes wait for the work queued on the tensor's stream (or the
        default stream) before now: the ordering stream waits for it here."""
        backend = _backend(record.device)
        state = ipc(backend)
        order = state.order_stream(record.device.id)
        data_stream = tensor._stream or backend.default_stream(record.device)
        order.wait(data_stream.record())  # attachers wait for the work queued before now
        pool, descriptor, _ = state.export_buffer(record._owner, record.device.id)
        return (state.device_uuid(record.device.id), pool, descriptor), 0, 0

    def check_part(self, f: Any) -> bool:
        part = f.channel
        return len(part) == 3 and all(isinstance(x, t) for x, t in zip(part, (str, str, bytes))) and not f.arena

    def serve_attach(self, record: Record, mapping: bool, want_pool: bool, want_fd: bool) -> Served:
        """An IPC event recorded on the ordering stream now (kept until the receiver says
        it opened it), its handle's bytes, and the pool's file descriptor when the
        receiver has not mapped the pool yet."""
        state = _ipc_of(record.device)
        event, handle = state.record(state.order_stream(record.device.id))
        fds = (state.export_buffer(record._owner, record.device.id)[2],) if mapping and want_pool else ()
        return Served([handle.hex()], fds, keep=event)

    def released(self, record: Record, events: list[bytes], pid: int) -> None:
        """The ordering stream waits on the receiver's events (recorded after its
        unmap), and the record's free waits for the ordering stream."""
        state = _ipc_of(record.device)
        stream = state.order_stream(record.device.id)
        for handle in events:
            try:
                state.wait(stream, handle)
            except Exception as exc:  # the receiver died or its event is gone: its work is over
                _warn(f"tx.share: could not wait on the release event of process {pid} ({exc})")
        _REG.add_stream(record, stream)  # the free waits for the receiver's unmap

    # -- the receiving side
    def attach(self, conns: Connections, f: Any, stream: Any, deadline: float) -> Tensor:
        """Map the CUDA memory of handle ``f`` on this process's device with the same GPU
        UUID; ``stream`` (None: the device's default stream) waits for the sender's work.
        As for CPU memory, the attach is one ``Attempt``: undone as a whole if it fails."""
        from ..tensor import _resolve_stream

        backend = _backend(Device(_CUDA_TYPE, 0))
        state = ipc(backend)
        device = _local_device(f, state)
        st = _resolve_stream(stream, device)
        order = st or backend.default_stream(device)
        client = conns.client(f, deadline)
        # One mapping per allocation per process, whatever the handles say of read-only (on
        # CUDA a Tensor flag only): importing one allocation twice gives duplicate pointers
        # whose first close unmaps both (cuda-python#2783).
        key = (f.entry, True)
        _, pool_uuid, descriptor = f.channel
        with Attempt(client, f.entry) as a:
            a.reused = client.reuse(key, f, st)
            want_pool = not state.has_pool(pool_uuid)
            reply, a.fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, a.reused is None, want_pool,
                                           f.readonly, False], deadline, a)
            # Wait (on `order`, no host block) for the work the sender queued before the
            # reply, then tell it the event may go (an undo, ``abandon``, tells it too).
            state.wait(order, bytes.fromhex(reply[4]))
            client.notify(["opened", a.rid])
            if a.reused is not None:
                return a.succeed(a.reused)
            a.mapping = CUDAMapping(client, f.entry, a.rid, key, None, device)
            a.mapping.memory = state.import_buffer(device.id, pool_uuid, a.fds[0] if a.fds else None, descriptor,
                                                   order)
            close_fds(a.fds)  # the pool, once mapped, keeps what it needs
            a.fds = []
            buffer = a.mapping.memory
            a.record = _REG.new_record(device, int(buffer.handle), int(buffer.size),
                                       origin=f"process {client.pid} (tx.attach)", kind="imported",
                                       release=a.mapping.release, owner=buffer)
            a.record._views = []  # closed if the sender dies (see Connections.sender_died)
            a.mapping.record = weakref.ref(a.record)
            client.remember(key, a.record)
            return a.succeed(view(a.record, f, st))


def _local_device(f: Any, state: CUDAIPC) -> Device:
    uuid = f.channel[0]
    ordinal = state.ordinal_of_uuid(uuid)
    if ordinal is None:
        raise DeviceError(
            f"the shared memory is on GPU {uuid} ({f.device} in process {f.pid}), which this process does not "
            f"see (it sees {state.backend.device_count} CUDA device(s); CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    return Device(_CUDA_TYPE, ordinal)


class CUDAMapping(Mapping):
    """The release of attached CUDA memory: unmap on the stream that used it, record an
    IPC event after the unmap and send it with the release (the sender's free waits on
    it: CUDA requires an importer's free to complete before the exporter's). Once."""

    __slots__ = ("device",)

    def __init__(self, client: Client, entry: int, rid: int, key: tuple, memory: Any, device: Device) -> None:
        super().__init__(client, entry, rid, key, memory)
        self.device = device

    def release(self) -> None:
        if not self.first_call():
            return
        client = self.client
        client.forget(self.key)
        record = self.record() if self.record is not None else None
        streams = record.streams if record is not None else []
        try:
            event, handle = ipc(_backend(self.device)).close_import(self.memory, self.device, streams)
        except Exception as exc:
            if not client.dead:
                _warn(f"unmapping CUDA memory attached from process {client.pid} failed ({exc}); releasing it there "
                      "anyway")
            client.notify(["release", self.entry, self.rid, []])
            return
        client.release_with_event(self.entry, self.rid, event, handle)


#: The CUDA channel (``exchange.channels.channel_for`` hands it out).
CHANNEL = CUDAChannel()
