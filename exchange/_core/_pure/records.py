"""The pure path's records: the twin of exchange/native/registry.c, same results.

It owns a record's storage (``RecordBase``), making records, their holders, and the
two release rules of the hot path, each written once here: the release with no
stream to wait for (``remove_holder`` on the last holder) and a record leaving the
live set (``record_gone``). The stream-ordered release is the registry's, on both
paths (exchange/registry.py, ``_begin_release`` and ``_finish``).

No lock on the hot paths: each step that others may see is one atomic operation under
the GIL (next() on a counter, one dict store or pop), and the thread that releases a
record is elected by one dict.setdefault. The registry's live set and export table
are the Registry's own (``_live``, ``_exports``); the running counts and bytes are the
counters' (exchange/_core/_pure/capsules.py).
"""

from __future__ import annotations

from typing import Any

from ...errors import LifetimeError
from ..rules import run_release
from .capsules import record_counts, record_left, record_made

LIVE, RELEASING, RELEASED = "live", "releasing", "released"
#: Holder key no real holder has (tokens start at 1): set by the thread that releases.
CLAIM = 0
_new = object.__new__

# Given by setup() (exchange._core.wire), as the compiled core's hooks.
_REG: Any = None
_Record: Any = None
_begin_release: Any = None
_note_tracked: Any = None
_where: Any = None
_DEBUG = False
_TRACKING = False
_NOTE_GONE: Any = None


class RecordBase:
    """A record's storage (the twin of the compiled core's ``RecordBase``)."""

    __slots__ = ("id", "device", "address", "nbytes", "kind", "_origin", "_holders", "_release", "_owner",
                 "state", "__dict__", "__weakref__")

    def _holder_items(self) -> list[tuple[int, Any]]:
        return [(t, h) for t, h in list(self._holders.items()) if t != CLAIM]


def make_record_type(*views: type) -> type:
    """The public Record class: ``views`` (Python attributes) over ``RecordBase``."""
    return type("Record", (*views, RecordBase), {"__slots__": (), "__doc__": views[0].__doc__,
                                                 "__module__": "exchange.registry", "__qualname__": "Record"})


def new_record(device: Any, address: int, nbytes: int, origin: str, kind: str, release: Any, owner: Any,
               label: str | None, holder: str | None) -> tuple[Any, int]:
    """A live record and, when ``holder`` is given, its first holder (the import hot
    path). Returns the record and the holder's token (0 if none)."""
    reg = _REG
    token = next(reg._tokens) if holder is not None else 0
    record = _new(_Record)  # no __init__: this is the import hot path
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
    record.id = rid = next(reg._ids)
    reg._live[rid] = record
    record_made(device._slot, nbytes, kind == "imported")
    if _TRACKING:
        _note_tracked(record)
    if _DEBUG:
        record.where = _where()
    return record, token


def add_holder(record: Any, description: Any) -> int:
    """Add a holder; returns its token for ``remove_holder``. LifetimeError unless the
    record is live (holders are added only from a live holder, a Tensor)."""
    if record.state != LIVE:
        raise LifetimeError(f"record #{record.id} is already {record.state}; it cannot get a new holder")
    token = next(_REG._tokens)
    record._holders[token] = description
    return token


def remove_holder(record: Any, token: int) -> None:
    """Drop a holder. The last one starts the release: stream-ordered (the registry's
    ``_begin_release``) when a stream used the memory, else here, at once."""
    holders = record._holders
    if holders.pop(token, None) is None or holders:
        return
    # Seen empty: every thread that saw it so tries to claim it; one wins.
    if holders.setdefault(CLAIM, token) != token or record.state != LIVE:
        return
    streams = record._streams
    if streams:
        record.state = RELEASING
        _begin_release(record, list(streams.values()))
        return
    # No stream used it: nothing to wait for. Released from here on, but counted until
    # its release ran: stats() never says memory is gone while it is still mapped.
    release, record._release = record._release, None
    owner, record._owner = record._owner, None
    record.state = RELEASED
    if release is not None and not _REG.finalizing:
        run_release(record, release)
    record_gone(record)
    del owner  # dropping a producer's object may release one of our exports


def record_gone(record: Any) -> None:
    """The record leaves the live set and the counts (once: the pop decides), and tx.trace
    hears of it."""
    record.state = RELEASED
    if _REG._live.pop(record.id, None) is not None:
        record_left(record.device._slot, record.nbytes, record.kind == "imported")
        note = _NOTE_GONE
        if note is not None and not _REG.finalizing:
            try:
                note(record)
            except Exception:  # a trace never breaks a release or a deleter
                pass


def totals() -> dict[str, int]:
    """live_records, created_total, released_total, imports_outstanding and
    exports_outstanding, as the hot paths keep them."""
    made, gone, imports = record_counts()
    return {"live_records": len(_REG._live), "created_total": made, "released_total": gone,
            "imports_outstanding": imports, "exports_outstanding": len(_REG._exports)}


def live_records() -> list[Any]:
    """The records not yet released, oldest first."""
    return sorted(records_alive(), key=lambda r: r.id)


def records_alive() -> list[Any]:
    """The records not yet released, in no particular order (no sort: 100,000 records
    cost the pure path about 7 ms to sort)."""
    with _REG._lock:
        return list(_REG._live.values())


def holder_count(records: list[Any]) -> int:
    """The holders of ``records``, all together."""
    return sum(len(r._holders) for r in records)


def set_debug(flag: bool) -> None:
    global _DEBUG
    _DEBUG = bool(flag)


def set_tracking(flag: bool) -> None:
    global _TRACKING
    _TRACKING = bool(flag)


def set_note_gone(note: Any) -> None:
    global _NOTE_GONE
    _NOTE_GONE = note


def setup(*, record_type: Any, registry: Any, begin_release: Any, note_tracked: Any, where: Any, debug: bool,
          **_: Any) -> None:
    """The hooks, as the compiled core's ``setup`` takes them (exchange._core.wire)."""
    global _Record, _REG, _begin_release, _note_tracked, _where
    _Record, _REG, _begin_release, _note_tracked, _where = record_type, registry, begin_release, note_tracked, where
    set_debug(debug)
