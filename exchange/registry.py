"""The process-wide ownership registry.

One record per piece of memory that crosses the library, whatever made it: allocated by
a backend, imported from a framework, or borrowed. A record holds its holders (our
Tensors and every capsule we exported that is not yet released) and the streams that
used the memory. When the last holder goes, the release is stream-ordered
(exchange/release.py): the memory is freed, or the producer's deleter called, exactly
once, after the work queued on those streams has finished.

Thread-safe: deleters arrive from any thread. Release actions run outside the lock,
because a producer's deleter may call back into this registry.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterator

from . import _core
from ._core.rules import run_release
from ._core.rules import warn as _warn
from .device import SLOT_DEVICES, Device, DeviceType
from .errors import ExchangeWarning, LeakError, LifetimeError
from .release import Reaper
from .runtime import CORE, register

__all__ = ["Record", "Registry", "registry", "track"]

LIVE, RELEASING, RELEASED = "live", "releasing", "released"


class _RecordViews:
    """One piece of memory known to the registry (made by the registry only).

    Attributes: ``id`` (int, increasing), ``device`` (Device), ``address`` (int, lowest
    byte), ``nbytes`` (bytes), ``kind`` (``"allocated"``, ``"imported"``, ``"borrowed"``),
    ``origin`` (``"allocated"``, ``"imported from <producer>"``, ``"borrowed"``),
    ``label`` (str or None), ``holders`` (list of str describing who holds it),
    ``streams`` (list of streams that used it), ``state`` (``"live"``, ``"releasing"``,
    ``"released"``), ``where`` (creation stack with EXCHANGE_DEBUG=1).

    The storage is the core's ``RecordBase`` (exchange/_core: the compiled core's, or
    its pure-Python twin's).
    """

    __slots__ = ()

    # Set per record only when they change or are needed (in its __dict__): class
    # defaults keep the import hot path to the storage's fields.
    label: str | None = None
    where: str | None = None
    immutable = False  # the producer never writes this memory (a JAX array): tensor.mutability
    sealed = False  # the kernel keeps this memory read-only here (a set's version): legacy exports allowed
    _views: list | None = None  # borrowed records: weakrefs to views, closed with the scope
    _streams: dict[int, Any] | None = None  # id(stream) -> stream, made on the first add_stream

    @property
    def origin(self) -> str:
        return f"imported from {self._origin}" if self.kind == "imported" else self._origin

    @property
    def holders(self) -> list[str]:
        return [_describe_holder(h) for _, h in self._holder_items()]

    @property
    def streams(self) -> list[Any]:
        streams = self._streams
        return list(streams.values()) if streams else []

    def describe(self) -> str:
        text = f"record #{self.id}: {self.nbytes} bytes on {self.device}, {self.origin}"
        if self.label:
            text += f", label {self.label!r}"
        holders = self.holders
        if holders:
            text += f", held by {', '.join(holders)}"
        if self.where:
            text += "\n  made at:\n" + self.where
        return text

    def __repr__(self) -> str:
        return (f"Record(id={self.id}, device='{self.device}', address=0x{self.address:x}, "
                f"nbytes={self.nbytes}, origin={self.origin!r}, state={self.state!r}, "
                f"holders={self.holders!r})")


Record = _core.make_record_type(_RecordViews)


class Registry:
    """The registry of one process (``tx.registry()``). See the module docstring."""

    def __init__(self) -> None:
        # Reentrant: a Tensor's __del__ (or one of our deleters) may run from a garbage
        # collection triggered by an allocation inside one of the sections below, on
        # the thread that already holds the lock; a plain Lock deadlocks there.
        self._lock = threading.RLock()
        # The pure twin's hot-path state (exchange/_core/_pure/records.py; the compiled
        # core keeps its own in C): ids and holder tokens, the live set, the exports.
        self._ids = itertools.count(1)
        self._tokens = itertools.count(1)
        self._live: dict[int, Record] = {}
        self._exports: dict[int, tuple[Record, int]] = {}
        self._remote_holders = 0
        self._leases = 0  # handles in transit holding a record (tx.share): stats()["leases_in_transit"]
        self._debug = os.environ.get("EXCHANGE_DEBUG", "") not in ("", "0")
        self.finalizing = False
        self._reaper = Reaper(self._finish, _pending_add)
        self._trackers = 0  # track() blocks open in any context: the hot path looks only then
        self._waiting: list[_Tracker] = []  # track() blocks waiting for their records' releases

    @property
    def debug(self) -> bool:
        """EXCHANGE_DEBUG=1: each record keeps where it was made (``Record.where``)."""
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = bool(value)
        _core.set_debug(self._debug)

    @property
    def created_total(self) -> int:
        """Records made since the process started."""
        return self._totals()["created_total"]

    @property
    def released_total(self) -> int:
        """Records released (or discarded) since the process started."""
        return self._totals()["released_total"]

    # -- records -----------------------------------------------------------------------
    # The hot paths (record creation, holders, a release with no stream) are the core's
    # (exchange/_core: the compiled core's in C, or the pure twin's): one call each.
    def new_record(self, device: Device, address: int, nbytes: int, *, origin: str, kind: str,
                   release: Callable[[], None] | None = None, owner: Any = None,
                   label: str | None = None) -> Record:
        """Register memory. ``release`` runs once, after the last holder is gone and
        every stream that used the memory has finished (None: nothing to free)."""
        return _core.new_record(device, address, nbytes, origin, kind, release, owner, label, None)[0]

    #: ``new_held_record(device, address, nbytes, origin, kind, release, owner, label,
    #: holder) -> (record, token)``: ``new_record`` and, when ``holder`` (a str) is
    #: given, its first holder (the import hot path); token 0 if none.
    new_held_record = staticmethod(_core.new_record)
    #: ``add_holder(record, description) -> token`` for ``remove_holder``. Holders are
    #: added only from a live holder (a Tensor); LifetimeError unless the record is live.
    add_holder = staticmethod(_core.add_holder)
    #: ``remove_holder(record, token)``: drop a holder; the last one starts the
    #: stream-ordered release (at once when no stream used the memory).
    remove_holder = staticmethod(_core.remove_holder)
    # The record leaves the live set and the counts (once).
    _gone = staticmethod(_core.record_gone)

    def discard(self, record: Record) -> None:
        """Forget a record without running its release (an import that failed before
        taking ownership: the producer's deleter stays in charge). It counts in
        ``released_total``, so created_total - released_total stays the live count."""
        with self._lock:
            record._release = None
            self._gone(record)

    #: live_records, created_total, released_total, imports_outstanding and
    #: exports_outstanding, as the hot paths keep them.
    _totals = staticmethod(_core.totals)

    def add_remote_holder(self, record: Record, pid: int) -> int:
        """Process ``pid`` attached this record's memory (``tx.attach``): a holder shown as
        ``process <pid>``, counted in ``stats()["remote_holders"]``, until that process
        releases its last Tensor over it or dies (exchange/sharing/). Returns the token
        for ``remove_remote_holder``; LifetimeError if the record is no longer live."""
        token = self.add_holder(record, f"process {pid}")
        with self._lock:
            self._remote_holders += 1
        if _TRACE is not None:
            _to_trace("remote_hold", record, pid, token)
        return token

    def remove_remote_holder(self, record: Record, token: int) -> None:
        """Drop a holder added by ``add_remote_holder``; the last holder starts the release."""
        with self._lock:
            self._remote_holders -= 1
        if _TRACE is not None:
            _to_trace("remote_drop", token)
        self.remove_holder(record, token)

    def add_lease(self, record: Record, nonce: int) -> int:
        """A handle to this record's memory is in transit (``tx.share``): a holder shown as
        ``tx.ShareHandle #<nonce> (in transit)``, counted in
        ``stats()["leases_in_transit"]``, until the handle's first attach, its close, or
        ``exchange.sharing.drop_leases()``. Returns the token for ``remove_lease``;
        LifetimeError if the record is no longer live."""
        token = self.add_holder(record, f"tx.ShareHandle #{nonce} (in transit)")
        with self._lock:
            self._leases += 1
        return token

    def remove_lease(self, record: Record, token: int) -> None:
        """Drop a holder added by ``add_lease``; the last holder starts the release."""
        with self._lock:
            self._leases -= 1
        self.remove_holder(record, token)

    def add_export(self, record: Record, ctx: int) -> None:
        """Count the capsule with export id ``ctx`` as a holder of ``record``."""
        if record.state != LIVE:
            raise LifetimeError(f"record #{record.id} is already {record.state}; it cannot be exported")
        token = next(self._tokens)
        record._holders[token] = ctx  # an int: described lazily as "DLPack export #ctx"
        self._exports[ctx] = (record, token)

    def export_released(self, ctx: int) -> None:
        """Called by our deleter (any thread): the consumer of export ``ctx`` is done.
        ``add_export`` and this are the pure twin's (the compiled core counts its
        exports in C)."""
        entry = self._exports.pop(ctx, None)
        if entry is not None:
            self.remove_holder(*entry)

    def add_stream(self, record: Record, stream: Any) -> None:
        """Work on ``stream`` uses this memory: its release waits for that work."""
        with self._lock:
            if record._streams is None:
                record._streams = {}
            record._streams.setdefault(id(stream), stream)

    # -- release -----------------------------------------------------------------------
    def _begin_release(self, record: Record, streams: list[Any]) -> None:
        # A backend that frees in stream order itself (CUDA pools: the free stream waits
        # on the other streams, then cuMemFreeAsync) needs no event and no reaper.
        if _TRACE is not None:
            _to_trace("release_begins", record, streams)
        if _NVTX is not None:
            _to_nvtx("release_begins", record, streams)
        free_after = getattr(record._release, "free_after", None)
        if free_after is not None and not self.finalizing:
            try:
                if free_after(streams):
                    record._release = None
                    self._finish(record)
                    return
            except Exception as exc:  # fall back to the reaper with host-side events
                _warn(f"stream-ordered free of record #{record.id} failed ({type(exc).__name__}: {exc}); "
                      "releasing it after its streams' events instead")
        events = []
        for stream in streams:
            try:
                events.append((stream, stream.record()))
            except Exception as exc:  # a dead stream orders nothing; say so, release anyway
                _warn(f"could not record an event on {stream!r} for record #{record.id}: {exc}")
        self._reaper.add(record, events)  # finishes at once if every event is reached

    def _finish(self, record: Record) -> None:
        release, record._release = record._release, None
        if release is not None and not self.finalizing:
            run_release(record, release)
        with self._lock:
            owner, record._owner = record._owner, None
            streams, record._streams = record._streams, None
            self._gone(record)
        if _TRACE is not None:
            _to_trace("release_ends", record)
        if _NVTX is not None:
            _to_nvtx("release_ends", record)
        for tracker in self._waiting:
            tracker.pending.discard(record.id)
        # Dropped outside the lock: the owner may be a producer's array whose last
        # reference releases one of our exports, and that deleter calls back in here.
        del owner, streams

    # -- inspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts now, read from maintained counters (O(1) in the records alive):
        ``live_records`` (live or releasing), ``live_bytes`` and ``pending_bytes``
        (bytes per device string: all live memory, and the part waiting for its
        stream-ordered release), ``exports_outstanding`` (capsules we made whose
        deleter has not run), ``imports_outstanding`` (imports whose producer deleter
        has not run), ``pending_releases`` (waiting on stream events),
        ``remote_holders`` (other processes holding our records, tx.share),
        ``leases_in_transit`` (handles sent and not yet attached or closed, holding our
        records: exchange.sharing.drop_leases() drops them),
        ``created_total``, ``released_total``.

        Exchanges on other threads take no lock, so while they run the counts are a
        moment's view: created_total may count records still being registered."""
        live, pending = _counts(len(SLOT_DEVICES))
        totals = self._totals()
        return {
            "live_records": totals["live_records"],
            "live_bytes": {str(SLOT_DEVICES[i]): n for i, n in enumerate(live) if n},
            "pending_bytes": {str(SLOT_DEVICES[i]): n for i, n in enumerate(pending) if n},
            "exports_outstanding": totals["exports_outstanding"],
            "imports_outstanding": totals["imports_outstanding"],
            "pending_releases": len(self._reaper),
            "remote_holders": self._remote_holders,
            "leases_in_transit": self._leases,
            "created_total": totals["created_total"],
            "released_total": totals["released_total"],
        }

    def pending_bytes(self, device: Device) -> int:
        """Bytes on ``device`` waiting for their stream-ordered release."""
        return _counts(len(SLOT_DEVICES))[1][device._slot]

    def peak_live_bytes(self) -> int:
        """Most bytes live at once (all devices) since ``reset_peak()``."""
        return _peak_value()

    def reset_peak(self) -> None:
        """Start measuring the peak of live bytes from the bytes live now, in O(1)
        (until ``end_peak()``; measurements may nest and share one process-wide peak)."""
        _peak_begin()

    def end_peak(self) -> int:
        """Stop one measurement started by ``reset_peak()``; returns the peak in bytes."""
        return _peak_end()

    def snapshot(self) -> list[Record]:
        """The records not yet released, oldest first."""
        return _core.live_records()

    def collect(self, timeout: float | None = None) -> bool:
        """Wait for pending releases to complete (``timeout`` in seconds; None waits as
        long as it takes). Returns True when none is left pending. This and ``track``
        are the only calls that wait; any number of threads may wait at once.
        TypeError / ValueError for a timeout that is not a number of seconds >= 0."""
        return self._reaper.collect(_seconds(timeout))

    def wait_for_device(self, device: Device, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for ``device``'s pending releases (an
        allocation that failed for lack of memory retries after this). Returns the bytes
        still pending on that device."""
        slot = device._slot
        self._reaper.wait(lambda: _counts(slot + 1)[1][slot] <= 0, timeout)
        return self.pending_bytes(device)

    @contextlib.contextmanager
    def track(self, strict: bool = True) -> Iterator["Registry"]:
        """See ``exchange.track``."""
        if _TRACKER.get() is not None:
            raise RuntimeError("tx.track() is already active in this context (nested); one track() block at a time")
        tracker = _Tracker()
        reset = _TRACKER.set(tracker)
        self._set_tracking(+1)
        try:
            yield self
            self._settle(tracker)
            alive = [r for r in tracker.records() if r.state != RELEASED]
            if alive:
                message = (f"{len(alive)} record(s) made inside tx.track() are still alive:\n"
                           + "\n".join("  " + r.describe() for r in alive))
                if strict:
                    raise LeakError(message)
                warnings.warn(message, ExchangeWarning, stacklevel=3)
        finally:
            _TRACKER.reset(reset)
            self._set_tracking(-1)

    def _set_tracking(self, delta: int) -> None:
        with self._lock:
            self._trackers += delta
            _core.set_tracking(self._trackers > 0)

    def _tracker_gone_after_fork(self) -> None:
        # A forked child's trace stops (exchange/tracing.py): one tracker less, with no
        # lock (a thread of the parent may have held it at the fork).
        self._trackers = max(0, self._trackers - 1)
        _core.set_tracking(self._trackers > 0)

    def _settle(self, tracker: "_Tracker") -> None:
        # Wait for the releases of the block's own records (not other threads' work).
        self._waiting.append(tracker)
        try:
            for record in tracker.records():
                if record.state == RELEASING:
                    tracker.pending.add(record.id)
            for record in tracker.records():  # finished meanwhile: _finish saw no entry
                if record.state == RELEASED:
                    tracker.pending.discard(record.id)
            self._reaper.wait(lambda: not tracker.pending)
        finally:
            self._waiting.remove(tracker)

    def _shutdown(self) -> None:
        # At interpreter exit (after host streams ran their queued work, devices/cpu.py):
        # complete what is ready, then release nothing more (a late deleter must not call
        # into a finalising interpreter); what still waits is leaked, with one warning.
        try:
            self._reaper.poll()
        except Exception:
            pass
        self.finalizing = True
        left = self._reaper.stop()
        if left:
            _warn(f"{left} stream-ordered release(s) were still pending at exit (their streams had not "
                  "finished); that memory was left to the operating system")

    def _after_fork_in_child(self) -> None:
        # The parent's other threads do not exist here: their locks may be held forever,
        # and no stream worker or reaper thread runs. Start the locks and counters afresh
        # (records and holders are the child's copies and stay valid) and settle the
        # releases that were pending: host memory is released now (nothing in this
        # process can use it through the parent's streams any more). Device memory
        # (CUDA, pinned, managed) is never released by the child, pending or live: CUDA
        # cannot be used in a forked child, so its release and owner are set aside.
        self._lock = threading.RLock()
        self._waiting = []
        pending = self._reaper.reset_after_fork()
        _reset_counts()
        for record in self.snapshot():
            _bytes_add(record.device._slot, record.nbytes)
            if record.device.type != DeviceType.kDLCPU:
                _FORK_KEPT.append((record._release, record._owner))
                record._release = record._owner = None
        for record in pending:
            self._finish(record)


# What a forked child inherited for device memory it must not release (see above).
_FORK_KEPT: list[Any] = []


def _describe_holder(holder: Any) -> str:
    return f"DLPack export #{holder}" if type(holder) is int else holder


_bytes_add = _core.bytes_add
_counts = _core.counts
_peak_begin, _peak_end, _peak_value = _core.peak_begin, _core.peak_end, _core.peak_value
_reset_counts = _core.reset_counts


def _pending_add(device: Device, delta: int) -> None:
    _core.pending_add(device._slot, delta)


class _Tracker:
    """One tx.track() block: weak references to the records made in its context, and the
    ids of those it waits for at its end."""

    __slots__ = ("refs", "pending")

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.pending: set[int] = set()

    def records(self) -> list[Record]:
        return [r for r in (ref() for ref in self.refs) if r is not None]


# The track() block of the current context (contextvars: per thread, per asyncio task,
# and carried into host-stream tasks and chain stages, which run in their submitter's).
_TRACKER: contextvars.ContextVar[_Tracker | None] = contextvars.ContextVar("tx_track", default=None)


def _note_tracked(record: Record) -> None:
    tracker = _TRACKER.get()
    if tracker is not None:
        tracker.refs.append(weakref.ref(record))
    trace = _TRACE
    if trace is not None:
        try:
            trace.created(record)
        except Exception:  # a trace never breaks an exchange
            pass


# The tx.trace() recording (exchange/tracing.py sets it while one records; None otherwise).
# The registry reports to it only off the hot paths: a record's creation through the
# note above (taken only while a track block or a trace is open), stream-ordered
# releases and other processes' holds.
_TRACE: Any = None


def set_note_gone(note: Any) -> None:
    """Give ``note(record)`` each record that leaves the live set (None: stop); the
    core's ``record_gone`` calls it."""
    _core.set_note_gone(note)


# NVTX ranges for stream-ordered releases (exchange/tracing.py sets it where the nvtx
# package is importable and a profiler listens, or EXCHANGE_NVTX=1; None otherwise).
_NVTX: Any = None


def _to_trace(what: str, *args: Any) -> None:
    _report(_TRACE, what, args)


def _to_nvtx(what: str, *args: Any) -> None:
    _report(_NVTX, what, args)


def _report(to: Any, what: str, args: tuple) -> None:
    if to is None:
        return
    try:
        getattr(to, what)(*args)
    except Exception:  # a trace never breaks an exchange, a release or a deleter
        pass


def _where() -> str:
    """Where a record is being made (EXCHANGE_DEBUG=1), without the library's frames."""
    frames = [f for f in traceback.extract_stack(limit=16) if not f.filename.startswith(_PACKAGE_DIR)]
    return "".join(traceback.format_list(frames[-10:]))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not timeout >= 0:  # also refuses NaN
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
    return float(timeout)


_REGISTRY = Registry()


def registry() -> Registry:
    """The process-wide Registry."""
    return _REGISTRY


def track(strict: bool = True) -> "contextlib.AbstractContextManager[Registry]":
    """Context manager: on exit, wait for the pending releases of the records made inside
    the block, then raise ``tx.LeakError`` naming every one of them still alive (its
    origin, holders, and with EXCHANGE_DEBUG=1 where it was made). ``strict=False``
    warns (``tx.ExchangeWarning``) instead.

    "Inside the block" means in its context (``contextvars``): this thread's code in the
    block, and the host-stream tasks and chain stages it starts, which run in the
    submitter's context; records other threads make meanwhile are not counted, and
    ``collect()`` in other threads is fine. Nesting in one context raises RuntimeError;
    blocks in different threads are independent."""
    return _REGISTRY.track(strict)


register("after_fork_in_child", "registry", _REGISTRY._after_fork_in_child, CORE)
