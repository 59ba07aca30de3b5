"""CUDA memory across processes: cuda.core's IPC-enabled pools and IPC events.

Owns both sides of CUDA sharing: on the sending side, what a handle carries
(``export``: the GPU's UUID, the pool's UUID, the buffer's descriptor, after the
ordering stream waited for the data), what an attach gets back (``serve_attach``: an
IPC event on the ordering stream, the pool's descriptor on first need) and the waits on
the receivers' release events (``wait_releases``); on the receiving side the attach
(``attach_cuda``: the pool mapped once per process, the buffer, the stream waits) and
the stream-ordered release (``CUDAMapping``). Nothing here imports CUDA: the CUDA
backend is asked only for CUDA memory.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ..device import Device, DeviceType
from ..errors import DeviceError
from ..registry import Record, _warn, registry
from ..tensor import Tensor, _backend
from .protocol import Fields, close_fds
from .receiving import Attempt, Client, Connections, Mapping, view

_REG = registry()
_CUDA_TYPE = DeviceType.kDLCUDA


# -- the sending side ----------------------------------------------------------------------------
def export(record: Record, tensor: Tensor) -> tuple:
    """The CUDA part of a new handle: ``(device uuid, pool uuid, pickled buffer
    descriptor)``. Attaching processes wait for the work queued on the tensor's stream
    (or the default stream) before now: the ordering stream waits for it here."""
    backend = _backend(record.device)
    order = backend.ipc_stream(record.device.id)
    data_stream = tensor._stream or backend.default_stream(record.device)
    order.wait(data_stream.record())  # attachers wait for the work queued before now
    pool, descriptor, _ = backend.ipc_export(record._owner, record.device.id)
    return backend.device_uuid(record.device.id), pool, descriptor


def serve_attach(record: Record, send_pool: bool) -> tuple[Any, bytes, tuple[int, ...]]:
    """For the reply to an attach: an IPC event recorded on the ordering stream now
    (kept until the receiver says it opened it), its handle's bytes, and the pool's
    file descriptor when the receiver has not mapped the pool yet."""
    backend = _backend(record.device)
    event, handle = backend.ipc_record(backend.ipc_stream(record.device.id))
    fds = (backend.ipc_export(record._owner, record.device.id)[2],) if send_pool else ()
    return event, handle, fds


def wait_releases(record: Record, events: list[bytes], pid: int) -> None:
    """A receiver released: the ordering stream waits on its events (recorded after its
    unmap), and the record's free waits for the ordering stream."""
    backend = _backend(record.device)
    stream = backend.ipc_stream(record.device.id)
    for handle in events:
        try:
            backend.ipc_wait(stream, handle)
        except Exception as exc:  # the receiver died or its event is gone: its work is over
            _warn(f"tx.share: could not wait on the release event of process {pid} ({exc})")
    _REG.add_stream(record, stream)  # the free waits for the receiver's unmap


# -- the receiving side --------------------------------------------------------------------------
def _local_device(f: Fields, backend: Any) -> Device:
    backend = backend or _backend(Device(_CUDA_TYPE, 0))  # BackendUnavailableError without CUDA
    uuid = f.cuda[0]
    ordinal = backend.ordinal_of_uuid(uuid)
    if ordinal is None:
        raise DeviceError(
            f"the shared memory is on GPU {uuid} ({f.device} in process {f.pid}), which this process does not "
            f"see (it sees {backend.device_count} CUDA device(s); CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    return Device(_CUDA_TYPE, ordinal)


def attach_cuda(conns: Connections, f: Fields, stream: Any, deadline: float) -> Tensor:
    """Map the CUDA memory of handle ``f`` on this process's device with the same GPU
    UUID; ``stream`` (None: the device's default stream) waits for the sender's work.
    As for CPU memory, the attach is one ``Attempt``: undone as a whole if it fails."""
    from ..tensor import _resolve_stream

    backend = _backend(Device(_CUDA_TYPE, 0))
    device = _local_device(f, backend)
    st = _resolve_stream(stream, device)
    order = st or backend.default_stream(device)
    client = conns.client(f, deadline)
    # One mapping per allocation per process, whatever the handles say of read-only (on
    # CUDA a Tensor flag only): importing one allocation twice gives duplicate pointers
    # whose first close unmaps both (cuda-python#2783).
    key = (f.entry, True)
    _, pool_uuid, descriptor = f.cuda
    with Attempt(client, f.entry) as a:
        a.reused = client.reuse(key, f, st)
        want_pool = not backend.ipc_has_pool(pool_uuid)
        reply, a.fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, a.reused is None, want_pool,
                                       f.readonly, False], deadline, a)
        # Wait (on `order`, no host block) for the work the sender queued before the
        # reply, then tell it the event may go (an undo, ``abandon``, tells it too).
        backend.ipc_wait(order, bytes.fromhex(reply[4]))
        client.notify(["opened", a.rid])
        if a.reused is not None:
            return a.succeed(a.reused)
        a.mapping = CUDAMapping(client, f.entry, a.rid, key, None, device)
        a.mapping.memory = backend.ipc_import(device.id, pool_uuid, a.fds[0] if a.fds else None, descriptor, order)
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
            event, handle = _backend(self.device).ipc_close_import(self.memory, self.device, streams)
        except Exception as exc:
            if not client.dead:
                _warn(f"unmapping CUDA memory attached from process {client.pid} failed ({exc}); releasing it there anyway")
            client.notify(["release", self.entry, self.rid, []])
            return
        client.release_with_event(self.entry, self.rid, event, handle)
