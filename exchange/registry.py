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
import itertools
import os
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Iterator

from .device import Device
from .errors import ExchangeWarning, LeakError, LifetimeError
from .release import Reaper

__all__ = ["Record", "Registry", "registry", "track"]

LIVE, RELEASING, RELEASED = "live", "releasing", "released"
_new_record = object.__new__
_CLAIM = 0  # holder key no real holder has (tokens start at 1): set by the releasing thread


class Record:
    """One piece of memory known to the registry.

    Attributes: ``id`` (int, increasing), ``device`` (Device), ``address`` (int, lowest
    byte), ``nbytes`` (bytes), ``origin`` (``"allocated"``, ``"imported from <producer>"``,
    ``"borrowed"``), ``label`` (str or None), ``holders`` (list of str describing who
    holds it), ``streams`` (list of streams that used it), ``state`` (``"live"``,
    ``"releasing"``, ``"released"``), ``where`` (creation stack with EXCHANGE_DEBUG=1).
    """

    __slots__ = ("id", "device", "address", "nbytes", "kind", "_origin", "_holders", "_release", "_owner",
                 "state", "__dict__", "__weakref__")

    # Set per record only when they change or are needed: class defaults keep the
    # import hot path to the stores above.
    label: str | None = None
    where: str | None = None
    _streams: dict[int, Any] | None = None  # id(stream) -> stream, made on the first add_stream
    _views: list | None = None  # borrowed records: weakrefs to views, closed with the scope

    def __init__(self, rid: int, device: Device, address: int, nbytes: int, origin: str, kind: str,
                 release: Any, owner: Any, label: str | None, holders: dict | None = None) -> None:
        self.id = rid
        self.device = device
        self.address = address
        self.nbytes = nbytes
        self._origin = origin  # for imports: the producer's type name
        self.kind = kind  # "allocated" | "imported" | "borrowed"
        self._holders: dict[int, Any] = {} if holders is None else holders
        self._release = release  # a callable, or (function, *args) to call once
        self._owner = owner
        self.state = LIVE
        if label is not None:
            self.label = label

    @property
    def origin(self) -> str:
        return f"imported from {self._origin}" if self.kind == "imported" else self._origin

    @property
    def holders(self) -> list[str]:
        return [_describe_holder(h) for t, h in list(self._holders.items()) if t != _CLAIM]

    @property
    def streams(self) -> list[Any]:
        return list(self._streams.values()) if self._streams else []

    def describe(self) -> str:
        text = f"record #{self.id}: {self.nbytes} bytes on {self.device}, {self.origin}"
        if self.label:
            text += f", label {self.label!r}"
        if self._holders:
            text += f", held by {', '.join(self.holders)}"
        if self.where:
            text += "\n  made at:\n" + self.where
        return text

    def __repr__(self) -> str:
        return (f"Record(id={self.id}, device='{self.device}', address=0x{self.address:x}, "
                f"nbytes={self.nbytes}, origin={self.origin!r}, state={self.state!r}, "
                f"holders={self.holders!r})")


class Registry:
    """The registry of one process (``tx.registry()``). See the module docstring."""

    def __init__(self) -> None:
        # Reentrant: a Tensor's __del__ (or one of our deleters) may run from a garbage
        # collection triggered by an allocation inside one of the sections below, on
        # the thread that already holds the lock; a plain Lock deadlocks there.
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._released = itertools.count(1)  # next() once per record released or discarded
        self._tokens = itertools.count(1)
        self._live: dict[int, Record] = {}
        self._exports: dict[int, tuple[Record, int]] = {}
        self._live_bytes = 0  # kept only while a peak is measured (_peak_users > 0)
        self._peak_bytes = 0
        self._peak_users = 0
        self.debug = os.environ.get("EXCHANGE_DEBUG", "") not in ("", "0")
        self.finalizing = False
        self._reaper = Reaper(self._finish)
        self._tracking = False
        self._remote_holders = 0  # holders in other processes (exchange/share.py)

    @property
    def created_total(self) -> int:
        """Records made since the process started."""
        return _next_value(self._ids) - 1

    @property
    def released_total(self) -> int:
        """Records released (or discarded) since the process started."""
        return _next_value(self._released) - 1

    # -- records -----------------------------------------------------------------------
    # The hot paths (record creation, holders, exports, a release with no stream) take no
    # lock: each step that others may see is one atomic operation under the GIL (next()
    # on a counter, one dict store or pop), and the thread that releases a record is
    # elected by one dict.setdefault. Keeping them lock-free keeps threads from queueing
    # on a lock while another holds it across a GIL switch. Everything else locks.
    def new_record(self, device: Device, address: int, nbytes: int, *, origin: str, kind: str,
                   release: Callable[[], None] | None = None, owner: Any = None,
                   label: str | None = None) -> Record:
        """Register memory. ``release`` runs once, after the last holder is gone and
        every stream that used the memory has finished (None: nothing to free)."""
        return self.new_held_record(device, address, nbytes, origin, kind, release, owner, label, None)[0]

    def new_held_record(self, device: Device, address: int, nbytes: int, origin: str, kind: str,
                        release: Any, owner: Any, label: str | None,
                        holder: str | None) -> tuple[Record, int]:
        """``new_record`` and, when ``holder`` is given, its first holder (the import hot
        path). Returns the record and the holder's token (0 if none)."""
        if self._reaper._pending:
            self._reaper.poll()
        token = next(self._tokens) if holder is not None else 0
        record = _new_record(Record)  # Record.__init__'s stores, inline: this is the import hot path
        record.device = device
        record.address = address
        record.nbytes = nbytes
        record._origin = origin
        record.kind = kind
        record._holders = {token: holder} if holder is not None else {}
        record._release = release
        record._owner = owner
        record.state = LIVE
        if label is not None:
            record.label = label
        record.id = rid = next(self._ids)
        self._live[rid] = record
        if self._peak_users:
            self._count_bytes(nbytes)
        if self.debug:
            record.where = "".join(traceback.format_stack(limit=12)[:-2])
        return record, token

    def discard(self, record: Record) -> None:
        """Forget a record without running its release (an import that failed before
        taking ownership: the producer's deleter stays in charge). It counts in
        ``released_total``, so created_total - released_total stays the live count."""
        with self._lock:
            record.state = RELEASED
            record._release = None
            if self._live.pop(record.id, None) is not None:
                next(self._released)
                if self._peak_users:
                    self._count_bytes(-record.nbytes)

    # -- holders -----------------------------------------------------------------------
    def add_holder(self, record: Record, description: str) -> int:
        """Add a holder; returns its token for ``remove_holder``. Holders are added only
        from a live holder (a Tensor), so a record never gains one while releasing."""
        if record.state != LIVE:
            raise LifetimeError(f"record #{record.id} is already {record.state}; it cannot get a new holder")
        token = next(self._tokens)
        record._holders[token] = description
        return token

    def remove_holder(self, record: Record, token: int) -> None:
        """Drop a holder. The last one starts the stream-ordered release."""
        holders = record._holders
        if holders.pop(token, None) is None or holders:
            return
        # Seen empty: every thread that saw it so tries to claim it; one wins.
        if holders.setdefault(_CLAIM, token) != token or record.state != LIVE:
            return
        streams = record._streams
        if streams:
            record.state = RELEASING
            self._begin_release(record, list(streams.values()))
            return
        # No stream used it: nothing to wait for, release now (hot path).
        release, record._release = record._release, None
        owner, record._owner = record._owner, None
        record.state = RELEASED
        if self._live.pop(record.id, None) is not None:
            next(self._released)
            if self._peak_users:
                self._count_bytes(-record.nbytes)
        if release is not None and not self.finalizing:
            try:
                if type(release) is tuple:  # (function, *args): the import hot path
                    release[0](*release[1:])
                else:
                    release()
            except BaseException as exc:  # a release never raises into a deleter
                _warn(f"release of record #{record.id} failed ({type(exc).__name__}: {exc}); the memory may have leaked")
        del owner  # dropping a producer's object may release one of our exports

    def add_remote_holder(self, record: Record, pid: int) -> int:
        """Process ``pid`` attached this record's memory (``tx.attach``): a holder shown as
        ``process <pid>``, counted in ``stats()["remote_holders"]``, until that process
        releases its last Tensor over it or dies (exchange/share.py). Returns the token
        for ``remove_remote_holder``; LifetimeError if the record is no longer live."""
        token = self.add_holder(record, f"process {pid}")
        with self._lock:
            self._remote_holders += 1
        return token

    def remove_remote_holder(self, record: Record, token: int) -> None:
        """Drop a holder added by ``add_remote_holder``; the last holder starts the release."""
        with self._lock:
            self._remote_holders -= 1
        self.remove_holder(record, token)

    def add_export(self, record: Record, ctx: int) -> None:
        """Count the capsule with export id ``ctx`` as a holder of ``record``."""
        if record.state != LIVE:
            raise LifetimeError(f"record #{record.id} is already {record.state}; it cannot be exported")
        token = next(self._tokens)
        record._holders[token] = ctx  # an int: described lazily as "DLPack export #ctx"
        self._exports[ctx] = (record, token)

    def export_released(self, ctx: int) -> None:
        """Called by our deleter (any thread): the consumer of export ``ctx`` is done."""
        entry = self._exports.pop(ctx, None)
        if entry is not None:
            self.remove_holder(*entry)

    def _count_bytes(self, delta: int) -> None:
        # Only while someone measures a peak (reset_peak ... end_peak).
        # Approximate while other threads exchange: a record made or released as the
        # measurement starts may be counted once too often or too rarely (never below 0).
        with self._lock:
            live = self._live_bytes = max(0, self._live_bytes + delta)
            if live > self._peak_bytes:
                self._peak_bytes = live

    def add_stream(self, record: Record, stream: Any) -> None:
        """Work on ``stream`` uses this memory: its release waits for that work."""
        with self._lock:
            if record._streams is None:
                record._streams = {}
            record._streams.setdefault(id(stream), stream)

    # -- release -----------------------------------------------------------------------
    def _begin_release(self, record: Record, streams: list[Any]) -> None:
        events = []
        for stream in streams:
            try:
                events.append(stream.record())
            except Exception as exc:  # a dead stream orders nothing; say so, release anyway
                _warn(f"could not record an event on {stream!r} for record #{record.id}: {exc}")
        if events and not all(_query(e) for e in events):
            self._reaper.add(record, events)
            for event in events:  # host events say when they are reached: no poll delay
                notify = getattr(event, "add_done_callback", None)
                if notify is not None:
                    notify(self._reaper.poll)
        else:
            self._finish(record)

    def _finish(self, record: Record) -> None:
        release, record._release = record._release, None
        if release is not None and not self.finalizing:
            try:
                _call(release)
            except BaseException as exc:  # a release never raises into a deleter
                _warn(f"release of record #{record.id} failed ({type(exc).__name__}: {exc}); the memory may have leaked")
        with self._lock:
            owner, record._owner = record._owner, None
            streams, record._streams = record._streams, None
            self._forget(record)
        # Dropped outside the lock: the owner may be a producer's array whose last
        # reference releases one of our exports, and that deleter calls back in here.
        del owner, streams

    def _forget(self, record: Record) -> None:
        # Under the lock: the record leaves the live set.
        record.state = RELEASED
        if self._live.pop(record.id, None) is not None:
            next(self._released)
            if self._peak_users:
                self._live_bytes = max(0, self._live_bytes - record.nbytes)

    # -- inspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts now: ``live_records`` (live or releasing), ``live_bytes`` (bytes per
        device string), ``exports_outstanding`` (capsules we made whose deleter has not
        run), ``imports_outstanding`` (imports whose producer deleter has not run),
        ``pending_releases`` (waiting on stream events), ``created_total``,
        ``released_total``, ``remote_holders`` (holders in other processes: one per
        process attached to a record, see ``tx.share``)."""
        self._reaper.poll()
        with self._lock:
            # One snapshot for every count. Exchanges on other threads take no lock, so
            # while they run the counts are a moment's view: created_total may count
            # records still being registered (it is the ids handed out).
            live = list(self._live.values())
            released = _next_value(self._released) - 1
            created = _next_value(self._ids) - 1
        live_bytes: dict[str, int] = {}
        imports = 0
        for r in live:
            key = str(r.device)
            live_bytes[key] = live_bytes.get(key, 0) + r.nbytes
            imports += r.kind == "imported"
        return {
            "live_records": len(live),
            "live_bytes": live_bytes,
            "exports_outstanding": len(self._exports),
            "imports_outstanding": imports,
            "pending_releases": len(self._reaper),
            "created_total": created,
            "released_total": released,
            "remote_holders": self._remote_holders,
        }

    def peak_live_bytes(self) -> int:
        """Most bytes live at once (all devices) since ``reset_peak()``."""
        return self._peak_bytes

    def reset_peak(self) -> None:
        """Start measuring the peak of live bytes from the bytes live now (until
        ``end_peak()``; measurements may nest)."""
        with self._lock:
            self._peak_users += 1
            self._live_bytes = sum(r.nbytes for r in list(self._live.values()))
            self._peak_bytes = self._live_bytes

    def end_peak(self) -> int:
        """Stop one measurement started by ``reset_peak()``; returns the peak in bytes."""
        with self._lock:
            self._peak_users = max(0, self._peak_users - 1)
            return self._peak_bytes

    def snapshot(self) -> list[Record]:
        """The records not yet released, oldest first."""
        self._reaper.poll()
        with self._lock:
            records = list(self._live.values())
        return sorted(records, key=lambda r: r.id)

    def collect(self, timeout: float | None = None) -> bool:
        """Wait for pending releases to complete (``timeout`` in seconds; None waits as
        long as it takes). Returns True when none is left pending. This and ``track``
        are the only calls that wait. RuntimeError if another collect() is running."""
        return self._reaper.collect(timeout)

    @contextlib.contextmanager
    def track(self, strict: bool = True) -> Iterator["Registry"]:
        """See ``exchange.track``."""
        with self._lock:
            if self._tracking:
                raise RuntimeError("tx.track() is already active (nested, or in another thread); one track() block at a time")
            self._tracking = True
            first_id = _next_value(self._ids) - 1
        try:
            yield self
            self.collect()
            alive = [r for r in self.snapshot() if r.id > first_id]
            if alive:
                message = (f"{len(alive)} record(s) made inside tx.track() are still alive:\n"
                           + "\n".join("  " + r.describe() for r in alive))
                if strict:
                    raise LeakError(message)
                warnings.warn(message, ExchangeWarning, stacklevel=3)
        finally:
            self._tracking = False

    def _shutdown(self) -> None:
        # At interpreter exit: complete what is ready, then release nothing more (a late
        # deleter must not call into a finalising interpreter; a leak is acceptable).
        try:
            self._reaper.poll()
        except Exception:
            pass
        self.finalizing = True
        self._reaper.stop()


def _next_value(counter: "itertools.count[int]") -> int:
    """The value ``next(counter)`` would return, without taking it (repr is "count(N)")."""
    return int(repr(counter)[6:-1])


def _call(release: Any) -> None:
    if type(release) is tuple:
        release[0](*release[1:])
    else:
        release()


def _describe_holder(holder: Any) -> str:
    return f"DLPack export #{holder}" if type(holder) is int else holder


def _query(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:
        return True


def _warn(message: str) -> None:
    try:
        if sys.is_finalizing():
            return
        warnings.warn(message, ExchangeWarning, stacklevel=2)
    except Exception:
        pass


_REGISTRY = Registry()


def registry() -> Registry:
    """The process-wide Registry."""
    return _REGISTRY


def track(strict: bool = True) -> "contextlib.AbstractContextManager[Registry]":
    """Context manager: on exit, wait for pending releases, then raise ``tx.LeakError``
    naming every record made inside the block that is still alive (its origin, holders,
    and with EXCHANGE_DEBUG=1 where it was made). ``strict=False`` warns
    (``tx.ExchangeWarning``) instead. Nesting raises RuntimeError."""
    return _REGISTRY.track(strict)
