"""The public calls of sharing and the handle: ``tx.share``, ``tx.attach``,
``tx.ShareHandle``, and the reducer that lets ``multiprocessing`` carry a ``tx.Tensor``.

Owns: what may be shared as it is and what is copied first, the handle's lease as the
sending process sees it (ended by its first attach, ``close()``, or garbage collection
of a handle that never left the process), and which side an attach goes to: the
sending process itself (serving.py), or another process, through the memory channel
of the memory (exchange/channels/), on the connection to the sender (receiving.py).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ..channels import MemoryChannel, channel_for
from ..device import Device
from ..dtypes import dtype as as_dtype
from ..errors import LifetimeError
from ..runtime import SHARING, register
from ..tensor import Tensor, empty
from .._current_send import sending
from . import protocol, receiving, serving
from .protocol import FD_ERRNOS, HandleFields, out_of_fds

__all__ = ["ShareHandle", "share", "attach"]

_FORKS = 0  # forks of this process so far (see ShareHandle.__del__)


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
    def _make(cls, fields: HandleFields, sent: bool) -> "ShareHandle":
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
        return as_dtype(self._f.dtype)

    @property
    def device(self) -> Device:
        """The device of the memory in the sending process (CUDA ordinals may differ here)."""
        return Device.parse(self._f.device)

    @property
    def nbytes(self) -> int:
        return math.prod(self._f.shape) * as_dtype(self._f.dtype).itemsize

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
        elsewhere may still attach while the memory lives. Across processes it is one
        message, sent without waiting for an answer (nothing to do when the sender has
        exited); only a connection not yet open waits, at most
        ``exchange.sharing.settings.request_timeout``: ExchangeError then, and the handle
        stays open (close it again later)."""
        if self._closed:
            return
        f = self._f
        self._closed = True
        if f.kind == "empty":
            return
        if serving.is_local(f):
            serving.server().drop_lease(f.entry, f.secret, f.nonce)
            return
        try:
            client = receiving.connections().client(f, time.monotonic() + protocol.settings.request_timeout)
        except LifetimeError:
            return  # the sender has exited: its leases went with it
        except BaseException:
            self._closed = False
            raise
        client.notify(["close", f.entry, f.secret.hex(), f.nonce])

    def __copy__(self) -> "ShareHandle":
        return self  # a handle names one lease: a copy in this process is the same handle

    def __deepcopy__(self, memo: Any) -> "ShareHandle":
        return self

    def __reduce__(self) -> Any:
        # From now on only attach, close() or the sender's exit end the lease; in a send of
        # multiprocessing, once the send's pickle has succeeded (settle_send).
        send = sending()
        if send is None:
            self._sent = True
        else:
            send.append((self, False))
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
    return ShareHandle._make(protocol.check_fields(fields), sent=True)


# -- sharing --------------------------------------------------------------------------------------
def share(tensor: Tensor, *, copy: bool | None = None, isolated: bool = False) -> ShareHandle:
    """A picklable handle to ``tensor``'s memory for another process on this machine;
    ``tx.attach(handle)`` there gives a Tensor over the same memory.

    Memory that can be shared as it is (``tx.empty(..., shared=True)``, memory attached
    from another process's isolated memory on the CPU) is shared without a copy: both
    sides read and write the same bytes. Other memory (a NumPy array's heap memory, a
    CUDA allocation outside an IPC-enabled pool, an imported producer's memory,
    borrowed memory, memory attached from another process's arena, CUDA memory
    attached from another process) is first copied into shareable memory, unless
    ``copy=False``: then BufferError saying why. ``copy=True`` always copies. A copy is
    C-contiguous; it keeps the tensor's read-only flag.

    Arenas (CPU): shareable memory is carved from a few large shared arenas of this
    process (``exchange.channels.memfd.Arenas``), and a receiver maps a whole arena once:
    it can then read every block in it, and write every block of a writable one.
    ``isolated=True`` shares the tensor from memory of its own instead (a copy, unless
    it is such memory already), which a receiver maps alone: for a tensor no receiver
    of other tensors of this process may see. Ignored on CUDA, where every allocation
    is mapped alone.

    Read-only (CPU): a read-only tensor is shared from memory sealed against writes
    (``F_SEAL_FUTURE_WRITE``): no other process can write it, whatever it does with the
    handle or the descriptor. So a read-only tensor over writable memory
    (``tx.empty(..., shared=True)`` memory, a NumPy array) goes as a copy in a sealed
    arena (or sealed memory of its own), made at each share; memory sealed already
    goes as it is. On CUDA read-only is the receiver's Tensor flag only
    (docs/processes.md).

    CUDA: the handle's data is what the tensor's stream (or the default stream) holds at
    this call: attaching processes wait for that work on their stream, without a host
    block. Only ``cpu`` and ``cuda:N`` memory can be shared (BufferError for pinned and
    managed memory: move it first).

    Ownership: the handle holds the memory (a lease, a holder of the record) until its
    first attach, ``close()`` or this process's exit; each attaching process then holds
    it (``process <pid>``) until it releases its last Tensor over it or dies. A block
    goes back to its arena once every holder in every process has let go.
    See docs/processes.md.

    Raises TypeError for a non-Tensor or a bad ``copy`` or ``isolated``, BufferError as
    above, LifetimeError for a closed borrowed view, OSError when the system refuses
    shared memory.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tx.share expects a tx.Tensor, got {type(tensor).__name__}; take it in with tx.from_dlpack first")
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    if not isinstance(isolated, bool):
        raise TypeError(f"isolated must be True or False, got {isolated!r}")
    return _share(tensor, copy, isolated)


def _share(tensor: Tensor, copy: bool | None, isolated: bool, once: bool = False) -> ShareHandle:
    tensor._check()
    readonly = bool(tensor._readonly)
    device = tensor._record.device
    channel = channel_for(device.type)
    if channel is None:
        raise BufferError(f"sharing {device} memory is not supported (no memory channel carries it to another "
                          "process); move it first, e.g. to the CPU (tx.from_dlpack(tensor, device='cpu'))")
    if math.prod(tensor._shape) == 0:
        return _empty_handle(tensor)
    isolated = isolated and channel.arenas  # (memory of its own is the only kind elsewhere)
    why = _unshareable(tensor, channel, readonly, isolated)
    if copy or why is not None:
        if copy is False:
            raise BufferError(f"this tensor cannot be shared without a copy: {why}; pass copy=None or True to share a copy")
        tensor = channel.shareable_copy(tensor, readonly, isolated)
    return ShareHandle._make(serving.server().new_handle(tensor, readonly, channel, once), sent=False)


def _unshareable(tensor: Tensor, channel: MemoryChannel, readonly: bool, isolated: bool) -> str | None:
    """Why this tensor's memory cannot be handed over as it is (None: it can)."""
    record = tensor._record
    if record.kind == "borrowed":
        return "it is borrowed memory (tx.borrow), which its owner may free when the scope ends"
    return channel.why_not_shareable(record, readonly, isolated)


def _empty_handle(tensor: Tensor) -> ShareHandle:
    f = HandleFields(protocol.PROTOCOL, protocol.boot_id(), os.getpid(), protocol.own_start(), b"", 0, bytes(16), 0,
                     "empty", str(tensor.device), tensor._dtype.name, tensor._shape, tensor._strides, 0, 0,
                     tensor._readonly, (), 0, 0, False)
    return ShareHandle._make(f, sent=False)


# -- attaching ------------------------------------------------------------------------------------
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
    stream order on CUDA), or until it dies. An attach that fails, whatever fails in it
    (KeyboardInterrupt included), keeps nothing here or in the sender, and the handle
    keeps its lease: attach again. Every mapping is released exactly once.

    Raises TypeError for a non-handle; ValueError for a handle that is closed, malformed,
    of another machine or boot, or refused by the sender (wrong secret: forged), and for
    a ``stream`` with CPU memory (in the sending process too);
    LifetimeError when the sender has exited or the memory was released there;
    BackendUnavailableError / DeviceError for CUDA memory this process cannot map (no
    CUDA here, or not that GPU); ExchangeError when the sender does not take the
    connection and answer within ``exchange.sharing.settings.request_timeout`` seconds
    (stopped, stuck, or its backlog full: the handle keeps its lease, try again; other
    senders are not held up) or answers nonsense; OSError naming the descriptor limit when this process has no file
    descriptor left for the connection or the memory (nothing is kept; try again later).
    """
    if not isinstance(handle, ShareHandle):
        raise TypeError(f"tx.attach expects a tx.ShareHandle (from tx.share), got {type(handle).__name__}")
    if handle._closed:
        sender = "this process" if handle._f.pid == os.getpid() else f"the sending process (pid {handle._f.pid})"
        raise ValueError(f"this tx.ShareHandle was closed (its close() gave up its lease), so it cannot be attached; "
                         f"for a new handle, call tx.share(tensor) again in {sender}")
    try:
        return _attach(handle._f, stream)
    except OSError as exc:
        if exc.errno in FD_ERRNOS and not getattr(exc, "tx_out_of_fds", False):
            raise out_of_fds("tx.attach", exc) from exc
        raise


def _attach(f: HandleFields, stream: Any) -> Tensor:
    if f.boot != protocol.boot_id():
        raise ValueError(f"this tx.ShareHandle comes from another machine or boot (boot id {f.boot or 'unknown'}, "
                         f"here {protocol.boot_id() or 'unknown'}); shared memory reaches only processes of one machine")
    if f.kind == "empty":  # no bytes: nothing to map, nothing to own
        return empty(f.shape, f.dtype, device=f.device, stream=stream)
    channel = protocol.channel_of(f)  # (checked when the handle was made or unpickled)
    if stream is not None and not channel.takes_stream:  # here as in any other process
        raise ValueError(f"stream={stream!r} given for {channel.label} memory; {channel.label} tensors take no stream "
                         "here: attach without it (tx.from_dlpack(tensor, stream=s) gives a view ordered on a "
                         "stream)")
    if serving.is_local(f):
        return serving.server().attach_local(f, stream)
    deadline = time.monotonic() + protocol.settings.request_timeout  # connection and answer together
    return channel.attach(receiving.connections(), f, stream, deadline)


def drop_leases(older_than: float = 0.0) -> int:
    """End the leases of this process's handles still in transit (sent, never attached
    nor closed) made at least ``older_than`` seconds ago; returns how many. For what no
    mechanism can see: a handle whose bytes were sent and lost, or whose receiver died
    before attaching, holds its memory until then (``stats()["leases_in_transit"]``
    counts them, ``snapshot()`` shows their records, held by ``tx.ShareHandle #n (in
    transit)``). A handle dropped this way cannot be attached any more where the memory
    has no other holder (LifetimeError there), a multiprocessing hand-off's included,
    which a receiver mapping its arena would take without asking: such leases end only
    once every receiver that maps an arena of this process has answered a fence
    (docs/processes.md, "Arenas: mapped once, attached locally, released in batches"), a
    round trip each, in parallel. If one does not answer within
    ``exchange.sharing.settings.request_timeout`` (it is stopped, say), the call returns
    after that long and ends none of those: they stay in transit, a later call tries
    again (leases of ``tx.share`` handles end at once whatever the receivers do). TypeError / ValueError for an ``older_than`` that is not
    a number of seconds >= 0."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
        raise TypeError(f"older_than is a number of seconds, got {older_than!r}")
    if not older_than >= 0:
        raise ValueError(f"older_than must be >= 0 seconds, got {older_than!r}")
    return serving.server().drop_leases(float(older_than))


# -- multiprocessing ------------------------------------------------------------------------------
def reduce_tensor(tensor: Tensor) -> Any:
    """multiprocessing's reducer for tx.Tensor (registered by exchange._multiprocessing):
    share it (a copy where its memory is private) and attach it on the other side. The
    handle counts as sent once the send's whole pickle has succeeded; if it fails, the
    handle is closed (settle_send)."""
    handle = _share(tensor, None, False, once=True)
    send = sending()
    if send is None:
        handle._sent = True
    else:
        send.append((handle, True))
    return (_rebuild_tensor, (handle,))


def settle_send(handles: list, pickled: bool) -> None:
    """The end of a send of multiprocessing (exchange._multiprocessing): its handles are
    sent when it ``pickled`` them all; else those the reducer made are closed (their
    copies freed) and the user's stay unsent. Never raises: the send's own error goes on."""
    for handle, made_here in handles:
        try:
            if pickled:
                handle._sent = True
            elif made_here:
                handle.close()
        except Exception:
            pass


def _rebuild_tensor(handle: ShareHandle) -> Tensor:
    """Unpickling a Tensor sent by multiprocessing: attach its handle."""
    return attach(handle)


# Pickles name the two rebuilders by the package (exchange.sharing), so an unpickle imports
# the package first, as every other way in does. Importing a submodule first holds that
# submodule's import lock while the package loads; if another thread is loading the package
# at that moment (the reducer, on a multiprocessing Queue's feeder thread), Python's deadlock
# check hands one of them a half-initialized module ("cannot import name ...").
_rebuild_handle.__module__ = _rebuild_tensor.__module__ = __package__


def _before_fork() -> None:
    global _FORKS
    _FORKS += 1


register("before_fork", "sharing.handle", _before_fork, SHARING)
