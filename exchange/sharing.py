"""Exchange across processes on one machine: ``tx.share``, ``tx.attach``, ``tx.ShareHandle``
and the reducers that let ``multiprocessing`` Queues and Pipes carry a ``tx.Tensor``.

How it works (docs/processes.md says it for users):

* CPU memory lives in anonymous shared memory (``exchange.devices.cpu.SharedMemory``: a sealed
  ``memfd``, never a named segment in /dev/shm). CUDA memory comes from an IPC-enabled
  cuda.core pool (``exchange.devices.cuda``). Other memory is copied into such memory first.
* A process that shares serves its memory from one Unix-domain socket (``SOCK_SEQPACKET``
  in Linux's abstract namespace: no file to leave behind) and one background thread,
  started by the first ``share`` and asleep in a selector while nothing happens. A
  receiver keeps one connection to each sender open: an attach asks over it and gets
  the memory's file descriptor back (``SCM_RIGHTS``), a release is one message on it.
* Ownership: a handle in transit holds its memory (a *lease*, a holder of the record)
  until its first attach, its ``close()`` or the sender's exit. Each attaching process
  is one holder of the sender's record (``process <pid>``, counted in
  ``stats()["remote_holders"]``) until it releases its last Tensor over the memory, or
  dies: the kernel then closes its connection and the sender drops its holds at once.
  A receiver watches each sender with a pidfd and closes its connection (and, for
  CUDA, its views) when the sender dies.
* CUDA release is stream-ordered across processes: the receiver unmaps on its stream,
  records an IPC event after that and sends it with the release; the sender's ordering
  stream waits on it, and the sender's free waits for that stream.

Nothing here imports a CUDA module at import time; the CUDA backend is asked only for
CUDA memory. Messages on the socket are JSON (never pickle: any local process can
connect to an abstract socket), and a connection from another user is refused.
"""

from __future__ import annotations

import collections
import errno
import hmac
import itertools
import json
import math
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

from .device import CPU, Device, DeviceType
from .dtypes import dtype as _as_dtype
from .errors import DeviceError, ExchangeError, LifetimeError
from .registry import LIVE, Record, _warn, registry
from .tensor import Tensor, _backend, copy_into, empty

__all__ = ["ShareHandle", "share", "attach"]

_REG = registry()
_CPU_TYPE = DeviceType.kDLCPU
_CUDA_TYPE = DeviceType.kDLCUDA

#: Version of the handle and of the messages on the socket.
PROTOCOL = 1
#: Seconds a request to a sender may take before the attach fails (the sender is alive
#: but not answering: stopped, or stuck).
REQUEST_TIMEOUT = 30.0
#: Seconds the serving thread waits to hand a reply to a receiver that is not reading.
REPLY_TIMEOUT = 5.0
#: Seconds the serving thread waits before accepting again when it had no descriptor free.
ACCEPT_RETRY_S = 0.1
_MAX_MESSAGE = 1 << 16
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)  # received descriptors are not inherited by exec


def _boot_id() -> str:
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
                _BOOT_ID = fh.read().strip()
        except FileNotFoundError:  # not Linux: no boot id, sharing cannot work there anyway
            _BOOT_ID = ""
        # Any other OSError (no file descriptor left, say) goes to the caller and is not
        # remembered: the next call reads the boot id again.
    return _BOOT_ID


_FD_ERRNOS = (errno.EMFILE, errno.ENFILE)


def _out_of_fds(what: str, exc: OSError | None = None) -> OSError:
    """The OSError for ``what`` failing because this process has no file descriptor left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = exc.errno if exc is not None and exc.errno in _FD_ERRNOS else errno.EMFILE
    error = OSError(code, f"{what} needs a free file descriptor and this process has none left "
                         f"({os.strerror(code)}; RLIMIT_NOFILE {soft}/{hard}): close some files or raise the "
                         "limit, then try again (nothing was mapped or kept)")
    error.tx_out_of_fds = True  # said once: attach does not wrap it again
    return error


_BOOT_ID: str | None = None


# -- the handle ------------------------------------------------------------------------------
class _Fields(NamedTuple):
    version: int
    boot: str          # /proc/sys/kernel/random/boot_id of the sender's machine and boot
    pid: int           # the sender's pid, as it sees itself
    address: bytes     # the sender's socket name (abstract namespace)
    entry: int         # which shared memory of the sender
    secret: bytes      # random per shared memory; the sender checks it
    nonce: int         # this handle's lease
    kind: str          # "cpu", "cuda" or "empty" (no bytes: nothing to map)
    device: str        # the sender's device, e.g. "cpu", "cuda:1"
    dtype: str
    shape: tuple
    strides: tuple     # in elements
    offset: int        # bytes from the start of the memory to element 0
    span: int          # bytes of the shared memory
    readonly: bool
    cuda: tuple        # for "cuda": (device uuid, pool uuid, pickled IPCBufferDescriptor)


class ShareHandle:
    """A small picklable handle to a tensor's memory, for another process on this machine
    (``tx.share`` makes it, ``tx.attach`` opens it). Pickle it any way you like; it holds
    no memory pointer, only what the sender needs to find and check the memory.
    ``copy.copy`` and ``copy.deepcopy`` give the handle itself (one handle, one lease).

    ``shape``, ``strides`` (elements), ``dtype``, ``device`` (the sender's), ``nbytes``,
    ``readonly``, ``pid`` (the sender's).

    Ownership: until its first ``tx.attach`` (in any process), ``close()``, or the sender's
    exit, the handle holds the memory in the sender (a holder ``tx.ShareHandle #n (in
    transit)``), so a tensor dropped by the sender right after sharing is still there
    when the receiver attaches. A handle that was never pickled (nor alive at a fork: a
    forked child has a copy it may attach) and is garbage-collected in the process that
    made it lets go by itself. Any number of processes may attach a handle while the
    memory lives (the sender, or a process attached to it, holds it).
    """

    __slots__ = ("_f", "_sent", "_closed", "_forks", "__weakref__")

    def __init__(self) -> None:
        raise TypeError("tx.ShareHandle is not made directly: use tx.share(tensor)")

    @classmethod
    def _make(cls, fields: _Fields, sent: bool) -> "ShareHandle":
        self = object.__new__(cls)
        self._f = fields
        self._sent = sent
        self._closed = False
        self._forks = _FORKS  # a fork after this hands a copy to the child: sent, as by pickle
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self._f.shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        return self._f.strides

    @property
    def dtype(self) -> Any:
        return _as_dtype(self._f.dtype)

    @property
    def device(self) -> Device:
        """The device of the memory in the sending process (CUDA ordinals may differ here)."""
        return Device.parse(self._f.device)

    @property
    def nbytes(self) -> int:
        return math.prod(self._f.shape) * _as_dtype(self._f.dtype).itemsize

    @property
    def readonly(self) -> bool:
        return self._f.readonly

    @property
    def pid(self) -> int:
        """The sending process's id (as it sees itself)."""
        return self._f.pid

    def close(self) -> None:
        """Give up this handle's lease: the sender may free the memory once nothing else
        holds it. Attaching a closed handle object raises ValueError; copies of the handle
        elsewhere may still attach while the memory lives. Best effort across processes
        (nothing to do when the sender has exited); never blocks on the sender."""
        if self._closed:
            return
        self._closed = True
        f = self._f
        if f.kind == "empty":
            return
        hub = _hub()
        if f.pid == os.getpid() and f.address == hub.address:
            hub.drop_lease(f.entry, f.secret, f.nonce)
            return
        try:
            client = hub.client(f.address)
        except LifetimeError:
            return  # the sender has exited: its leases went with it
        client.notify(["close", f.entry, f.secret.hex(), f.nonce])

    def __copy__(self) -> "ShareHandle":
        return self  # a handle names one lease: a copy in this process is the same handle

    def __deepcopy__(self, memo: Any) -> "ShareHandle":
        return self

    def __reduce__(self) -> Any:
        self._sent = True  # from now on only attach, close() or the sender's exit end the lease
        return (_rebuild_handle, (tuple(self._f),))

    def __del__(self) -> None:
        # A handle that never left this process (never pickled, and no child forked while
        # it lived) cannot be attached by anyone else: let its lease go with it.
        try:
            if not self._sent and not self._closed and self._forks == _FORKS and self._f.pid == os.getpid():
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        f = self._f
        return (f"tx.ShareHandle(shape={f.shape}, dtype={f.dtype}, device='{f.device}', pid={f.pid}"
                f"{', readonly' if f.readonly else ''}{', closed' if self._closed else ''})")


def _rebuild_handle(fields: Any) -> ShareHandle:
    """Unpickling: a ShareHandle from its fields, checked. ValueError for a truncated or
    malformed handle (the check is of form; the sender checks the secret)."""
    return ShareHandle._make(_check_fields(fields), sent=True)


def _check_fields(fields: Any) -> _Fields:
    def bad(why: str) -> ValueError:
        return ValueError(f"not a valid tx.ShareHandle ({why}): truncated, corrupted or forged; "
                          "make a new one with tx.share(tensor) in the sending process")

    if not isinstance(fields, tuple) or len(fields) != len(_Fields._fields):
        raise bad(f"{len(fields) if isinstance(fields, tuple) else type(fields).__name__} fields, "
                  f"expected {len(_Fields._fields)}")
    f = _Fields(*fields)
    if f.version != PROTOCOL:
        raise bad(f"protocol version {f.version!r}, this library speaks {PROTOCOL}")
    types = (int, str, int, bytes, int, bytes, int, str, str, str, tuple, tuple, int, int, bool, tuple)
    for name, value, kind in zip(_Fields._fields, f, types):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"field {name} is {type(value).__name__}")
    if f.kind not in ("cpu", "cuda", "empty") or len(f.secret) != 16 or f.pid <= 0:
        raise bad("kind, secret or pid")
    try:
        dt = _as_dtype(f.dtype)
        Device.parse(f.device)
    except (TypeError, ValueError) as exc:
        raise bad(str(exc)) from None
    if len(f.strides) != len(f.shape) or not all(type(n) is int and n >= 0 for n in f.shape) \
            or not all(type(s) is int for s in f.strides):
        raise bad("shape or strides")
    if f.kind == "empty" and math.prod(f.shape) != 0:
        raise bad("an empty handle with elements")
    if f.kind != "empty":
        if math.prod(f.shape) == 0:
            raise bad("no elements")
        lo = sum(s * (n - 1) for s, n in zip(f.strides, f.shape) if s < 0) * dt.itemsize
        hi = (sum(s * (n - 1) for s, n in zip(f.strides, f.shape) if s > 0) + 1) * dt.itemsize
        if f.offset + lo < 0 or f.offset + hi > f.span:
            raise bad(f"the layout reaches outside the {f.span} shared bytes")
    if f.kind == "cuda" and (len(f.cuda) != 3 or not all(isinstance(x, t) for x, t in zip(f.cuda, (str, str, bytes)))):
        raise bad("CUDA part")
    return f


# -- the sending side ---------------------------------------------------------------------------
class _Entry:
    """One piece of shared memory of this process (kept on its record as ``_tx_share``)."""

    __slots__ = ("id", "secret", "leases")

    def __init__(self, eid: int) -> None:
        self.id = eid
        self.secret = secrets.token_bytes(16)
        self.leases: dict[int, int] = {}  # handle nonce -> holder token


def share(tensor: Tensor, *, copy: bool | None = None) -> ShareHandle:
    """A picklable handle to ``tensor``'s memory for another process on this machine;
    ``tx.attach(handle)`` there gives a Tensor over the same memory.

    Memory that can be shared as it is (``tx.empty(..., shared=True)``, memory attached
    from another process on the CPU) is shared without a copy: both sides read and write
    the same bytes. Other memory (a NumPy array's heap memory, a CUDA allocation outside
    an IPC-enabled pool, an imported producer's memory, borrowed memory, CUDA memory
    attached from another process) is first copied into shareable memory, unless
    ``copy=False``: then BufferError saying why. ``copy=True`` always copies. A copy is
    C-contiguous; it keeps the tensor's read-only flag.

    CUDA: the handle's data is what the tensor's stream (or the default stream) holds at
    this call: attaching processes wait for that work on their stream, without a host
    block. Only ``cpu`` and ``cuda:N`` memory can be shared (BufferError for pinned and
    managed memory: move it first).

    Ownership: the handle holds the memory (a lease, a holder of the record) until its
    first attach, ``close()`` or this process's exit; each attaching process then holds
    it (``process <pid>``) until it releases its last Tensor over it or dies.
    See docs/processes.md.

    Raises TypeError for a non-Tensor or a bad ``copy``, BufferError as above,
    LifetimeError for a closed borrowed view, OSError when the system refuses shared
    memory.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tx.share expects a tx.Tensor, got {type(tensor).__name__}; take it in with tx.from_dlpack first")
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    tensor._check()
    readonly = tensor._readonly
    device = tensor._record.device
    if device.type not in (_CPU_TYPE, _CUDA_TYPE):
        raise BufferError(f"sharing {device} memory is not supported; move it to 'cpu' or 'cuda:N' first "
                          "(tx.from_dlpack(tensor, device='cpu'))")
    if math.prod(tensor._shape) == 0:
        return _empty_handle(tensor)
    why = _unshareable(tensor)
    if copy or why is not None:
        if copy is False:
            raise BufferError(f"this tensor cannot be shared without a copy: {why}; pass copy=None or True to share a copy")
        tensor = _shareable_copy(tensor)
    return _hub().new_handle(tensor, readonly)


def _unshareable(tensor: Tensor) -> str | None:
    """Why this tensor's memory cannot be handed over as it is (None: it can)."""
    record = tensor._record
    if record.kind == "borrowed":
        return "it is borrowed memory (tx.borrow), which its owner may free when the scope ends"
    owner = record._owner
    if record.device.type == _CPU_TYPE:
        from exchange.devices.cpu import SharedMemory

        if isinstance(owner, SharedMemory):
            return None
        return (f"its memory ({record.origin}) is private to this process; allocate it with "
                "tx.empty(..., shared=True) to share it without a copy")
    backend = _backend(record.device)
    if backend.ipc_shareable(owner):
        return None
    if record.kind == "imported" and str(record._origin).startswith("process "):
        return "it is CUDA memory attached from another process, which only its owner can share"
    return (f"its CUDA memory ({record.origin}) is not from an IPC-enabled pool; allocate it with "
            "tx.empty(..., device='cuda:N', shared=True) to share it without a copy")


def _shareable_copy(tensor: Tensor) -> Tensor:
    device = tensor._record.device
    stream = tensor._stream if device.type == _CUDA_TYPE else None
    out = empty(tensor._shape, tensor._dtype, device=device, stream=stream, shared=True)
    if device.type == _CPU_TYPE:
        tensor._host_ready()
    copy_into(out, tensor, stream, _backend(device))
    return out


def _empty_handle(tensor: Tensor) -> ShareHandle:
    f = _Fields(PROTOCOL, _boot_id(), os.getpid(), b"", 0, bytes(16), 0, "empty", str(tensor.device),
                tensor._dtype.name, tensor._shape, tensor._strides, 0, 0, tensor._readonly, ())
    return ShareHandle._make(f, sent=False)


# -- the receiving side ---------------------------------------------------------------------------
def attach(handle: ShareHandle, *, stream: Any = None) -> Tensor:
    """The Tensor over the memory ``handle`` names (from ``tx.share`` in another process
    on this machine): zero-copy, read-only when the sender's tensor is. Any framework
    takes it through DLPack as usual. In the process that made the handle: a view of
    the same record. Attaching a handle again (here or in other processes) gives more
    views of the same memory; this process counts once in the sender's holders.

    CUDA: the memory is mapped on this process's device with the same GPU UUID, and
    ``stream`` (a stream of that device; None: its default stream) waits for the work the
    sender queued on the data before sharing, without a host block; the Tensor is
    ordered on that stream.

    Ownership: the first attach ends the handle's lease; this process holds the memory
    until its last Tensor over it is released (then its release goes to the sender, in
    stream order on CUDA), or until it dies.

    Raises TypeError for a non-handle; ValueError for a handle that is closed, malformed,
    of another machine or boot, or refused by the sender (wrong secret: forged), and for
    a ``stream`` with CPU memory (in the sending process too);
    LifetimeError when the sender has exited or the memory was released there;
    BackendUnavailableError / DeviceError for CUDA memory this process cannot map (no
    CUDA here, or not that GPU); ExchangeError when the sender does not answer within
    ``REQUEST_TIMEOUT`` seconds (the handle keeps its lease: try again) or answers
    nonsense; OSError naming the descriptor limit when this process has no file
    descriptor left for the connection or the memory (nothing is kept; try again later).
    """
    if not isinstance(handle, ShareHandle):
        raise TypeError(f"tx.attach expects a tx.ShareHandle (from tx.share), got {type(handle).__name__}")
    if handle._closed:
        raise ValueError("this tx.ShareHandle was closed; attach another copy of it, or share the tensor again")
    try:
        return _attach(handle._f, stream)
    except OSError as exc:
        if exc.errno in _FD_ERRNOS and not getattr(exc, "tx_out_of_fds", False):
            raise _out_of_fds("tx.attach", exc) from exc
        raise


def _attach(f: _Fields, stream: Any) -> Tensor:
    if f.boot != _boot_id():
        raise ValueError(f"this tx.ShareHandle comes from another machine or boot (boot id {f.boot or 'unknown'}, "
                         f"here {_boot_id() or 'unknown'}); shared memory reaches only processes of one machine")
    if f.kind == "empty":  # no bytes: nothing to map, nothing to own
        return empty(f.shape, f.dtype, device=f.device, stream=stream)
    if f.kind == "cpu" and stream is not None:  # here as in any other process
        raise ValueError(f"stream={stream!r} given for CPU memory; CPU tensors take no stream here: attach "
                         "without it (tx.from_dlpack(tensor, stream=s) gives a view ordered on a host stream)")
    hub = _hub()
    if f.pid == os.getpid() and f.address == hub.address:
        return hub.attach_local(f, stream)
    if f.kind == "cuda":
        return _attach_cuda(hub, f, stream)
    return _attach_cpu(hub.client(f.address), f)


def _view(record: Record, f: _Fields, stream: Any = None) -> Tensor:
    # Tensor._make adds the holder: LifetimeError if the record is no longer live.
    t = Tensor._make(record, record.address + f.offset, f.shape, f.strides, _as_dtype(f.dtype), f.readonly, stream)
    if stream is not None:
        _REG.add_stream(record, stream)  # the release waits for the work queued there
    if record._views is not None:  # attached CUDA memory: closed if the sender dies
        record._views.append(weakref.ref(t))
    return t


def _attach_cpu(client: "_Client", f: _Fields) -> Tensor:
    from exchange.devices.cpu import SharedMemory

    key = (f.entry, not f.readonly)
    view = client.reuse(key, f)
    reply, fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, view is None, False])
    if view is not None:
        _close_fds(fds or [])
        return view
    if fds is None:  # its descriptor did not fit here
        client.notify(["release", f.entry, []])
        raise _out_of_fds("tx.attach (receiving the shared memory)")
    if len(fds) != 1:
        _close_fds(fds)
        client.notify(["release", f.entry, []])
        raise ExchangeError(f"process {f.pid} answered the attach without its memory; nothing was mapped")
    try:
        block = SharedMemory.from_fd(fds[0], f.span, writable=not f.readonly)
    except BaseException:
        client.notify(["release", f.entry, []])
        raise
    mapping = _Mapping(client, f.entry, key, block, None)
    try:
        record = _REG.new_record(CPU, block.address, block.nbytes, origin=f"process {f.pid} (tx.attach)",
                                 kind="imported", release=mapping.release, owner=block)
        client.remember(key, record)
        return _view(record, f)
    except BaseException:
        mapping.release()
        raise


def _local_cuda_device(f: _Fields, backend: Any) -> Device:
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


def _attach_cuda(hub: "_Hub", f: _Fields, stream: Any) -> Tensor:
    from .tensor import _resolve_stream

    backend = _backend(Device(_CUDA_TYPE, 0))
    device = _local_cuda_device(f, backend)
    st = _resolve_stream(stream, device)
    order = st or backend.default_stream(device)
    client = hub.client(f.address)
    key = (f.entry, not f.readonly)
    view = client.reuse(key, f, st)
    _, pool_uuid, descriptor = f.cuda
    want_pool = not backend.ipc_has_pool(pool_uuid)
    reply, fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, view is None, want_pool])
    if fds is None:  # the pool's descriptor did not fit here
        client.notify(["opened", reply[1]])
        if view is None:
            client.notify(["release", f.entry, []])
        raise _out_of_fds("tx.attach (receiving the CUDA memory pool)")
    try:
        # Wait (on `order`, no host block) for the work the sender queued before the
        # reply, then tell it the event may go.
        backend.ipc_wait(order, bytes.fromhex(reply[3]))
    except BaseException:
        _close_fds(fds)
        if view is None:
            client.notify(["release", f.entry, []])
        raise
    finally:
        client.notify(["opened", reply[1]])
    if view is not None:
        _close_fds(fds)
        return view
    try:
        buffer = backend.ipc_import(device.id, pool_uuid, fds[0] if fds else None, descriptor, order)
    except BaseException:
        client.notify(["release", f.entry, []])
        raise
    finally:
        _close_fds(fds)
    mapping = _Mapping(client, f.entry, key, buffer, device)
    try:
        record = _REG.new_record(device, int(buffer.handle), int(buffer.size), origin=f"process {f.pid} (tx.attach)",
                                 kind="imported", release=mapping.release, owner=buffer)
        record._views = []  # closed if the sender dies (see _Hub.sender_died)
        mapping.record = weakref.ref(record)
        client.remember(key, record)
        return _view(record, f, st)
    except BaseException:
        mapping.release()
        raise


class _Mapping:
    """The release of one attached mapping: unmap, then tell the sender (on CUDA with an
    IPC event recorded after the unmap, which the sender's free waits on)."""

    __slots__ = ("client", "entry", "key", "memory", "device", "record")

    def __init__(self, client: "_Client", entry: int, key: tuple, memory: Any, device: Device | None) -> None:
        self.client = client
        self.entry = entry
        self.key = key
        self.memory = memory  # SharedMemory, or the imported cuda.core Buffer
        self.device = device  # None for CPU memory
        self.record: Any = None  # weakref to the local record, once made

    def release(self) -> None:
        client = self.client
        client.forget(self.key)
        if self.device is None:
            self.memory.close()
            client.notify(["release", self.entry, []])
            return
        record = self.record() if self.record is not None else None
        streams = record.streams if record is not None else []
        try:
            event, handle = _backend(self.device).ipc_close_import(self.memory, self.device, streams)
        except Exception as exc:
            if not client.dead:
                _warn(f"unmapping CUDA memory attached from process {client.pid} failed ({exc}); releasing it there anyway")
            client.notify(["release", self.entry, []])
            return
        client.release_with_event(self.entry, event, handle)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- the per-process hub: socket server, connections, one thread ------------------------------
class _Peer:
    """A receiving process connected to this one (the server side of a connection)."""

    __slots__ = ("sock", "pid", "held", "events", "handled", "last_attach")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.last_attach: tuple | None = None  # (request id, entry, mapped, nonce of the lease ended)
        self.held: dict[int, list] = {}  # entry id -> [mappings it holds, holder token, record]
        self.events: dict[int, Any] = {}  # request id -> IPC event sent with the reply, until "opened"
        self.handled = 0  # packets handled, told in every reply


class _Client:
    """This process's connection to one sending process: its lease.

    Every packet goes out in order through ``_send`` and gets a sequence number; a packet
    that finds the socket full waits, in order, for the hub's thread to send it (a
    deleter never blocks on the sender). Requests (attach, sync) then wait for their
    reply under ``lock``; a reply says how many packets the sender has handled, which
    tells which release events it has opened (they must live until then)."""

    def __init__(self, hub: "_Hub", address: bytes) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(address)  # blocking: a full backlog waits instead of failing
            pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            sock.settimeout(REQUEST_TIMEOUT)  # also makes the descriptor non-blocking, for _send
        except OSError:
            sock.close()
            raise
        self.hub = hub
        self.address = address
        self.sock = sock
        self.pid = pid  # as this process sees it (PID namespaces may differ from the handle's)
        self.lock = threading.Lock()  # one request at a time
        self.send_lock = threading.Lock()  # numbering and order of packets
        self.sent = 0
        self.backlog: collections.deque[bytes] = collections.deque()
        self.ids = itertools.count(1)
        self.dead = False
        self.mappings: dict[tuple, Any] = {}  # (entry, writable) -> weakref to the local record
        self.cuda_records: weakref.WeakSet = weakref.WeakSet()  # closed if the sender dies
        self.unconfirmed: list[tuple[int, Any]] = []  # (packet number, IPC event) of releases not yet handled
        self.sync_posted = False
        self.pidfd = -1

    # -- mappings this process holds
    def reuse(self, key: tuple, f: _Fields, stream: Any = None) -> Tensor | None:
        """A new view over the live local record for ``key``, or None to map anew."""
        ref = self.mappings.get(key)
        record = ref() if ref is not None else None
        if record is None or record.state != LIVE:
            return None
        try:
            return _view(record, f, stream)
        except LifetimeError:  # released meanwhile on another thread
            return None

    def remember(self, key: tuple, record: Record) -> None:
        self.mappings[key] = weakref.ref(record)
        if record._views is not None:
            self.cuda_records.add(record)

    def forget(self, key: tuple) -> None:
        ref = self.mappings.get(key)
        if ref is not None and (ref() is None or ref().state != LIVE):
            self.mappings.pop(key, None)

    # -- packets
    def _send(self, message: list) -> int:
        """Send one packet in order, never blocking; returns its number (0: the sender is gone)."""
        data = json.dumps(message).encode()
        failed = False
        with self.send_lock:
            if self.dead:
                return 0
            self.sent += 1
            seq = self.sent
            if not self.backlog:
                try:
                    os.write(self.sock.fileno(), data)
                    return seq
                except BlockingIOError:
                    pass
                except OSError:
                    failed = True
            if not failed:
                self.backlog.append(data)
                first = len(self.backlog) == 1
        if failed:
            self.hub.sender_died(self)
            return 0
        if first:
            self.hub.post(self._flush)
        return seq

    def _flush(self) -> None:
        # On the hub's thread: send the backlog in order, waiting for room.
        while True:
            failed = False
            with self.send_lock:
                if self.dead or not self.backlog:
                    return
                try:
                    os.write(self.sock.fileno(), self.backlog[0])
                    self.backlog.popleft()
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.backlog.clear()
                    failed = True
            if failed:
                self.hub.sender_died(self)
                return
            try:
                select.select([], [self.sock], [], 1.0)
            except (OSError, ValueError):  # closed meanwhile
                return

    def notify(self, message: list) -> None:
        """One packet that needs no answer (release, close, opened)."""
        self._send(message)

    def request(self, message: list) -> tuple[list, list[int]]:
        """Send ``[op, *args]`` with a request id and wait for its reply
        ``[status, id, handled, *payload]``. Raises the error the sender answered,
        LifetimeError when the sender has gone, ExchangeError when it does not answer
        within the socket's timeout (``REQUEST_TIMEOUT``; the sender is then told to undo
        the request, ``abandon``) or answers nonsense, OSError when a descriptor it sent
        did not fit in this process (the reply is answered, then the error raised)."""
        with self.lock:
            rid = next(self.ids)
            if not self._send([message[0], rid, *message[1:]]):
                raise LifetimeError(f"process {self.pid} that shared this memory has exited")
            try:
                while True:
                    data, fds, flags, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, 4, _CLOEXEC)
                    if not data:
                        raise ConnectionResetError("connection closed")
                    try:
                        reply = json.loads(data)
                        ok = (isinstance(reply, list) and len(reply) >= 3 and reply[0] in ("ok", "err")
                              and type(reply[1]) is int and type(reply[2]) is int
                              and (reply[0] == "ok" or len(reply) >= 5))
                    except ValueError:
                        ok = False
                    if not ok:
                        _close_fds(fds)
                        raise ExchangeError(f"process {self.pid} sent a malformed reply (not a tensor-exchange "
                                            f"sender of protocol {PROTOCOL}?): {bytes(data[:80])!r}")
                    if reply[1] == rid:
                        break
                    _close_fds(fds)  # the late answer to a request that timed out (and was abandoned)
            except socket.timeout:
                # The sender may still handle the request later (it is stopped, or busy):
                # have it undo what it would do (count a mapping, end the lease) then.
                self._send(["abandon", rid])
                raise ExchangeError(f"process {self.pid} did not answer within {REQUEST_TIMEOUT:g} s "
                                    "(stopped or busy); try again") from None
            except OSError as exc:
                self.hub.sender_died(self)
                raise LifetimeError(f"process {self.pid} that shared this memory has exited ({exc})") from None
        self._confirm(reply[2])
        if reply[0] == "ok":
            if flags & socket.MSG_CTRUNC:
                # The kernel had no descriptor free for what the sender sent: the caller
                # answers the reply (release), then raises _out_of_fds.
                _close_fds(fds)
                return reply, None
            return reply, fds
        _close_fds(fds)
        code, text = reply[3], reply[4]
        error = {"released": LifetimeError, "forged": ValueError}.get(code, DeviceError)
        raise error(f"process {self.pid} refused: {text}")

    # -- CUDA release events
    def release_with_event(self, entry: int, event: Any, handle: bytes) -> None:
        # The event must live until the sender has opened it, which a later reply shows.
        seq = self._send(["release", entry, [handle.hex()]])
        if not seq:
            return
        with self.send_lock:
            self.unconfirmed.append((seq, event))
            post = not self.sync_posted
            self.sync_posted = True
        if post:
            self.hub.post(self._sync)

    def _confirm(self, handled: int) -> None:
        with self.send_lock:
            if self.unconfirmed:
                self.unconfirmed = [(s, e) for s, e in self.unconfirmed if s > handled]

    def _sync(self) -> None:
        self.sync_posted = False
        if self.unconfirmed and not self.dead:
            try:
                self.request(["sync"])
            except Exception:
                pass

    def close(self) -> None:
        with self.send_lock:
            self.dead = True
            self.backlog.clear()
            self.unconfirmed.clear()
        try:
            self.sock.close()
        except OSError:
            pass


class _Hub:
    """Everything this process keeps for sharing: its server socket and the receivers
    connected to it, its connections to senders, its shared memory, and one daemon
    thread serving them (started on first need; asleep in a selector otherwise)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self.address: bytes | None = None
        self.server: socket.socket | None = None
        self.peers: dict[int, _Peer] = {}
        self.clients: dict[bytes, _Client] = {}
        self.entries: dict[int, Any] = {}  # entry id -> weakref to its record
        self.ids = itertools.count(1)
        self.nonces = itertools.count(1)
        self.selector: selectors.BaseSelector | None = None
        self.thread: threading.Thread | None = None
        self.tasks: list[Callable[[], None]] = []
        self.wake_r = self.wake_w = -1
        self.accept_paused: float | None = None  # monotonic time to watch the server again

    # -- the thread
    def _start(self) -> None:
        # Under self.lock. All or nothing: a failure (no file descriptor left, say) closes
        # what it made, so a later call starts afresh and nothing leaks.
        if self.thread is not None:
            return
        selector = selectors.DefaultSelector()
        wake_r = wake_w = -1
        try:
            wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            selector.register(wake_r, selectors.EVENT_READ, self._woken)
            thread = threading.Thread(target=self._run, args=(selector,), name="tx-share", daemon=True)
            self.selector, self.wake_r, self.wake_w = selector, wake_r, wake_w
            thread.start()
        except BaseException:
            self.selector, self.wake_r, self.wake_w = None, -1, -1
            selector.close()
            _close_fds([fd for fd in (wake_r, wake_w) if fd >= 0])
            raise
        self.thread = thread

    def _run(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                events = selector.select(self._resume_accepting())
            except OSError:
                return  # closed after fork
            for key, _ in events:
                try:
                    key.data(key.fileobj)
                except Exception as exc:  # the server must survive anything
                    _warn(f"tx.share serving thread: {type(exc).__name__}: {exc}")

    def _resume_accepting(self) -> float | None:
        """Seconds the selector may sleep: None (until something happens), or until the
        server is watched again after running out of descriptors (``_accept``)."""
        if self.accept_paused is None:
            return None
        left = self.accept_paused - time.monotonic()
        if left > 0:
            return left
        self.accept_paused = None
        self.selector.register(self.server, selectors.EVENT_READ, self._accept)
        return None

    def post(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the hub's thread soon."""
        with self.lock:
            self._start()
            self.tasks.append(task)
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _woken(self, fd: int) -> None:
        try:
            os.read(fd, 4096)
        except OSError:
            pass
        with self.lock:
            tasks, self.tasks = self.tasks, []
        for task in tasks:
            try:
                task()
            except Exception as exc:
                _warn(f"tx.share serving thread: {type(exc).__name__}: {exc}")

    # -- serving
    def ensure_server(self) -> bytes:
        with self.lock:
            if self.server is None:
                self._start()
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                address = b"\0tensor-exchange/" + f"{os.getpid()}/{secrets.token_hex(8)}".encode()
                sock.bind(address)
                sock.listen(64)
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ, self._accept)
                self.server, self.address = sock, address
            return self.address

    def _accept(self, server: socket.socket) -> None:
        try:
            sock, _ = server.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in _FD_ERRNOS + (errno.ENOBUFS, errno.ENOMEM):
                # No descriptor for the connection: it waits in the backlog. Stop watching
                # the server for a moment; watching it now would wake this thread at once,
                # again and again (a busy loop) until a descriptor is free.
                self.selector.unregister(server)
                self.accept_paused = time.monotonic() + ACCEPT_RETRY_S
            return
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.getuid() and uid != 0:
            sock.close()  # another user's process: nothing of ours for it
            return
        sock.settimeout(REPLY_TIMEOUT)
        peer = _Peer(sock, pid)
        self.peers[sock.fileno()] = peer
        self.selector.register(sock, selectors.EVENT_READ, lambda _s, peer=peer: self._serve(peer))

    def _serve(self, peer: _Peer) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(peer.sock, _MAX_MESSAGE, 4, _CLOEXEC)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            data, fds = b"", []
        _close_fds(fds)  # receivers send no descriptors
        if not data:
            self._drop_peer(peer)  # the receiver closed the connection, or died
            return
        peer.handled += 1
        try:
            message = json.loads(data)
            op = message[0]
            if op == "attach":
                rid, entry_id, secret, nonce, mapping, want_pool = message[1:7]
                self._on_attach(peer, int(rid), int(entry_id), bytes.fromhex(secret), int(nonce), bool(mapping),
                                bool(want_pool))
            elif op == "release":
                self._on_release(peer, int(message[1]), [bytes.fromhex(h) for h in message[2]])
            elif op == "close":
                self.drop_lease(int(message[1]), bytes.fromhex(message[2]), int(message[3]))
            elif op == "opened":
                peer.events.pop(int(message[1]), None)
            elif op == "abandon":
                self._on_abandon(peer, int(message[1]))
            elif op == "sync":
                self._reply(peer, ["ok", int(message[1])])
            else:
                raise ValueError(f"unknown operation {op!r}")
        except (ValueError, TypeError, IndexError, KeyError):
            self._drop_peer(peer)  # not one of ours: no more conversation

    def _reply(self, peer: _Peer, message: list, fds: tuple[int, ...] = ()) -> None:
        message.insert(2, peer.handled)  # [status, request id, packets handled, ...]
        try:
            socket.send_fds(peer.sock, [json.dumps(message).encode()], list(fds))
        except OSError:
            self._drop_peer(peer)

    def _on_attach(self, peer: _Peer, rid: int, entry_id: int, secret: bytes, nonce: int,
                   mapping: bool, want_pool: bool) -> None:
        record = self._record(entry_id)
        if record is None:
            self._reply(peer, ["err", rid, "released",
                               f"no shared memory #{entry_id} is live: it was released (or the handle is forged)"])
            return
        entry = record._tx_share
        if not hmac.compare_digest(secret, entry.secret):
            self._reply(peer, ["err", rid, "forged", f"the handle's secret does not match shared memory #{entry_id}: "
                                                     "it is forged or corrupted"])
            return
        try:
            if mapping:  # the receiver maps it anew: one more mapping of this process
                held = peer.held.get(entry_id)
                if held is None:
                    peer.held[entry_id] = [1, _REG.add_remote_holder(record, peer.pid), record]
                else:
                    held[0] += 1
        except LifetimeError:
            self._reply(peer, ["err", rid, "released", f"shared memory #{entry_id} is being released"])
            return
        lease = self.drop_lease(entry_id, entry.secret, nonce)  # the first attach ends the lease
        fds: tuple[int, ...] = ()
        reply: list = ["ok", rid]
        if record.device.type == _CUDA_TYPE:
            backend = _backend(record.device)
            try:
                event, handle = backend.ipc_record(backend.ipc_stream(record.device.id))
                peer.events[rid] = event
                reply.append(handle.hex())
                if mapping and want_pool:
                    fds = (backend.ipc_export(record._owner, record.device.id)[2],)
            except Exception as exc:
                self._undo(peer, entry_id, mapping)
                self._reply(peer, ["err", rid, "cuda", f"could not share the CUDA memory: {exc}"])
                return
        elif mapping:
            fds = (record._owner.fd,)
        peer.last_attach = (rid, entry_id, mapping, nonce if lease else None)  # undone if abandoned
        self._reply(peer, reply, fds)

    def _undo(self, peer: _Peer, entry_id: int, mapping: bool) -> None:
        if mapping:
            self._on_release(peer, entry_id, [])

    def _on_abandon(self, peer: _Peer, rid: int) -> None:
        # The receiver gave up waiting for request `rid` (this process was stopped or
        # busy) and will never use its reply: undo the attach, if it was the last one
        # handled (a receiver has one request out at a time, so it is or it never came).
        last, peer.last_attach = peer.last_attach, None
        peer.events.pop(rid, None)
        if last is None or last[0] != rid:
            return
        _, entry_id, mapping, nonce = last
        held = peer.held.get(entry_id)
        record = held[2] if held is not None else self._record(entry_id)
        if nonce is not None and record is not None:  # the handle keeps its lease, for a retry
            try:
                record._tx_share.leases[nonce] = _REG.add_holder(record, f"tx.ShareHandle #{nonce} (in transit)")
            except LifetimeError:
                pass
        if mapping:
            self._on_release(peer, entry_id, [])

    def _on_release(self, peer: _Peer, entry_id: int, events: list[bytes]) -> None:
        held = peer.held.get(entry_id)
        if held is None:
            return
        record = held[2]
        if events and record.device.type == _CUDA_TYPE:
            backend = _backend(record.device)
            stream = backend.ipc_stream(record.device.id)
            for handle in events:
                try:
                    backend.ipc_wait(stream, handle)
                except Exception as exc:  # the receiver died or its event is gone: its work is over
                    _warn(f"tx.share: could not wait on the release event of process {peer.pid} ({exc})")
            _REG.add_stream(record, stream)  # the free waits for the receiver's unmap
        held[0] -= 1
        if held[0] <= 0:
            del peer.held[entry_id]
            _REG.remove_remote_holder(record, held[1])

    def _drop_peer(self, peer: _Peer) -> None:
        if self.peers.pop(peer.sock.fileno(), None) is None:
            return
        try:
            self.selector.unregister(peer.sock)
        except (KeyError, ValueError, OSError):
            pass
        peer.sock.close()
        held, peer.held = peer.held, {}
        peer.events.clear()
        for _, token, record in held.values():
            _REG.remove_remote_holder(record, token)

    def _record(self, entry_id: int) -> Record | None:
        ref = self.entries.get(entry_id)
        record = ref() if ref is not None else None
        if record is None or record.state != LIVE:
            return None
        return record

    # -- handles
    def new_handle(self, tensor: Tensor, readonly: bool) -> ShareHandle:
        address = self.ensure_server()
        record = tensor._record
        entry = record.__dict__.get("_tx_share")
        if entry is None:
            with self.lock:
                entry = record.__dict__.get("_tx_share")
                if entry is None:
                    entry = _Entry(next(self.ids))
                    record._tx_share = entry
                    self.entries[entry.id] = weakref.ref(record, lambda _r, eid=entry.id: self.entries.pop(eid, None))
        nonce = next(self.nonces)
        cuda: tuple = ()
        if record.device.type == _CUDA_TYPE:
            backend = _backend(record.device)
            order = backend.ipc_stream(record.device.id)
            data_stream = tensor._stream or backend.default_stream(record.device)
            order.wait(data_stream.record())  # attachers wait for the work queued before now
            pool, descriptor, _ = backend.ipc_export(record._owner, record.device.id)
            cuda = (backend.device_uuid(record.device.id), pool, descriptor)
        entry.leases[nonce] = _REG.add_holder(record, f"tx.ShareHandle #{nonce} (in transit)")
        kind = "cpu" if record.device.type == _CPU_TYPE else "cuda"
        f = _Fields(PROTOCOL, _boot_id(), os.getpid(), address, entry.id, entry.secret, nonce, kind, str(record.device),
                    tensor._dtype.name, tensor._shape, tensor._strides, tensor._data_ptr - record.address,
                    record.nbytes, readonly, cuda)
        return ShareHandle._make(f, sent=False)

    def drop_lease(self, entry_id: int, secret: bytes, nonce: int) -> bool:
        """End the lease of handle ``nonce``; True if it still had one."""
        ref = self.entries.get(entry_id)
        record = ref() if ref is not None else None
        entry = record.__dict__.get("_tx_share") if record is not None else None
        if entry is None or not hmac.compare_digest(secret, entry.secret):
            return False
        token = entry.leases.pop(nonce, None)
        if token is None:
            return False
        _REG.remove_holder(record, token)
        return True

    def attach_local(self, f: _Fields, stream: Any) -> Tensor:
        record = self._record(f.entry)
        if record is None:
            raise LifetimeError(f"the shared memory of this handle (#{f.entry}) was released in this process")
        if not hmac.compare_digest(f.secret, record._tx_share.secret):
            raise ValueError("the handle's secret does not match: it is forged or corrupted")
        st = None
        if stream is not None:
            from .tensor import _resolve_stream

            st = _resolve_stream(stream, record.device)
        t = _view(record, f, st)
        self.drop_lease(f.entry, f.secret, f.nonce)
        return t

    # -- connections to senders
    def client(self, address: bytes) -> _Client:
        """The connection to the sender at ``address`` (made on first use)."""
        client = self.clients.get(address)
        if client is not None and not client.dead:
            return client
        with self.lock:
            client = self.clients.get(address)
            if client is not None and not client.dead:
                return client
            try:
                client = _Client(self, address)
            except (ConnectionRefusedError, FileNotFoundError):
                raise LifetimeError("the process that shared this memory has exited (its share socket is gone); "
                                    "its memory cannot be attached any more") from None
            try:
                self._start()
            except BaseException:
                client.close()
                raise
            try:
                client.pidfd = os.pidfd_open(client.pid)
                self.selector.register(client.pidfd, selectors.EVENT_READ, lambda _fd, c=client: self.sender_died(c))
            except OSError as exc:
                if exc.errno in _FD_ERRNOS:  # watch every sender, or do not connect
                    client.close()
                    raise
                client.pidfd = -1  # no pidfd (old kernel): noticed on the next message instead
            except AttributeError:
                client.pidfd = -1
            self.clients[address] = client
            return client

    def sender_died(self, client: _Client) -> None:
        """The sender of ``client`` has gone: close the connection; views of its CUDA
        memory are closed (their next use raises LifetimeError). CPU memory stays mapped."""
        with self.lock:
            if self.clients.get(client.address) is client:
                del self.clients[client.address]
            if client.pidfd >= 0:
                try:
                    self.selector.unregister(client.pidfd)
                except (KeyError, ValueError):
                    pass
                os.close(client.pidfd)
                client.pidfd = -1
        if client.dead:
            return
        client.close()
        reason = (f"process {client.pid}, which shared this CUDA memory, has exited: the memory may be freed, "
                  "so this tensor cannot be used any more")
        for record in list(client.cuda_records):
            record.closed_reason = reason
            for view in [v() for v in list(record._views or ())]:
                if view is not None:
                    view._closed = True

    def after_fork_in_child(self) -> None:
        # The child has copies of the parent's records of what the parent shares, with the
        # parent's leases and its receivers' holds on them: those are the parent's to end
        # (the parent's receivers talk to the parent), and in the child nobody ever would,
        # so the child would keep the memory as long as it lives. Drop them here, and the
        # records' share entries with them: sharing such a tensor again in the child makes
        # a new entry, served by the child's own socket. (The registry's own fork handler
        # ran first: its locks are new.)
        for ref in list(self.entries.values()):
            record = ref()
            entry = record.__dict__.pop("_tx_share", None) if record is not None else None
            if entry is None:
                continue
            for token in entry.leases.values():
                _REG.remove_holder(record, token)
            entry.leases.clear()
        for peer in self.peers.values():
            for _, token, record in peer.held.values():
                _REG.remove_remote_holder(record, token)
            peer.held.clear()
        # Connections to senders: the parent's. Mark them dead with new locks (a parent's
        # thread may have held theirs at the fork), so a release of memory the child
        # inherited unmaps here and says nothing to the sender.
        for client in self.clients.values():
            client.lock, client.send_lock = threading.Lock(), threading.Lock()
            client.dead = True
            client.backlog.clear()
            client.unconfirmed.clear()
        # The child has copies of the parent's sockets; they are not its own to serve on
        # (and holding them would keep the parent's receivers from noticing its death).
        for sock in [self.server, *(p.sock for p in self.peers.values()), *(c.sock for c in self.clients.values())]:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        for fd in [self.wake_r, self.wake_w, *(c.pidfd for c in self.clients.values())]:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.selector is not None:
            try:
                self.selector.close()
            except OSError:
                pass


_HUB: _Hub | None = None
_HUB_LOCK = threading.Lock()
_FORKS = 0  # forks of this process so far (see ShareHandle.__del__)


def _hub() -> _Hub:
    global _HUB
    hub = _HUB
    if hub is None:
        with _HUB_LOCK:
            if _HUB is None:
                _HUB = _Hub()
            hub = _HUB
    return hub


def _after_fork_in_child() -> None:
    global _HUB, _HUB_LOCK
    _HUB_LOCK = threading.Lock()  # another thread may have held it at the fork
    hub, _HUB = _HUB, None
    if hub is not None:
        try:
            hub.after_fork_in_child()
        except Exception:
            pass


def _before_fork() -> None:
    global _FORKS
    _FORKS += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


# -- multiprocessing ------------------------------------------------------------------------------
def reduce_tensor(tensor: Tensor) -> Any:
    """multiprocessing's reducer for tx.Tensor (registered by exchange._multiprocessing):
    share it (a copy where its memory is private) and attach it on the other side."""
    handle = share(tensor)
    handle._sent = True
    return (_rebuild_tensor, (handle,))


def _rebuild_tensor(handle: ShareHandle) -> Tensor:
    return attach(handle)
