"""A timeline trace of the registry and the chains: ``tx.trace(path)``.

The file is the Chrome trace event format (the JSON object form,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU),
which Perfetto (ui.perfetto.dev) and chrome://tracing open. What it holds, per process
(``pid``, named for the program):

* a track per chain stage (``thread_name`` "stage K: NAME (FRAMEWORK)"), a complete
  span (``ph: "X"``) per batch the stage ran, ``args.batch`` the batch's number in the
  trace (counted over every run the trace records, from 0: one run's batches are
  consecutive);
* an instant (``ph: "i"``) per hop on the receiving stage's track, named
  "hop FROM -> TO", its ``args`` the hop's report (bytes, shared, transport, and the
  reason when not shared), and a flow arrow (``ph: "s"`` / ``"f"``, category
  ``batch``) from the stage that produced a batch's tensor to the stage that read it;
* each record's life, from its creation to its release, as an async span (``ph:
  "b"`` / ``"e"``, category ``record``, one track per device, "records on DEVICE"),
  ``args`` its id, bytes, kind and origin; a record still alive when the trace ends is
  closed there with ``args.alive_at_end``;
* each stream-ordered release, from the last holder's drop to its completion, as an
  async span on the stream's track (category ``release``, "release on STREAM");
* counters (``ph: "C"``) "live bytes" and "pending bytes", one series per device,
  sampled after each stage span and each stream-ordered release;
* in cross-process runs, each other process's hold on a record (``tx.share`` /
  ``tx.attach``) as an async span "held by process PID" (category ``remote``);
* tensor sets (``tx.publish`` / ``tx.subscribe``): each publish as an instant "publish
  NAME" (category ``set``, ``args`` the version, its bytes and tensors, and ``copied``:
  False for a draft's), and each version a reader of this process takes, from the take
  to the release of its last tensor, as an async span "set NAME held" (category
  ``set``, ``args`` the version, its bytes and the publisher's pid);
* in a Ray run (``executor="ray"``), each actor's own events, as a process of its own
  (``Trace.add_foreign``, exchange/ray/executor.py), and flows between the actors.

Async spans carry process-local ids (``id2: {"local": ...}``), flows global ones.
The file holds no tensor's data, but it names the program, its stages, streams, the
records' sizes, kinds and origins, and the other processes that held them: a new file
is made readable by its owner only (:data:`FILE_MODE`, 0600), and the path is never
followed through another user's symbolic link (its last name through none) nor written
into another user's file (:func:`open_trace_file`).

Times are microseconds on the monotonic clock (``time.perf_counter_ns``, which on Linux
is CLOCK_MONOTONIC, the same clock in every process of the machine). What happens goes
to a ring of ``capacity`` entries (default :data:`DEFAULT_CAPACITY`): an entry is a
stage's run of one batch (its span, flows and hops), a record's creation or end, a
release's start or end, a hold, or a counter sample. When the ring is full the oldest
are dropped, and the file says how many (``otherData.dropped_entries``, and an instant
"N entries dropped" at the start). Entries are kept raw and formatted only when the
trace is written, so recording costs little (``trace_on_hop_us``).

Cost: while no trace is on, nothing is recorded and nothing is added to the exchange
hot paths: the record-creation note is the one ``tx.track()`` uses, taken only while a
track block or a trace is open, and the note of a record leaving the live set
(``registry.set_note_gone``) is set only while a trace records. Measured in ``tensor-exchange bench`` (section
"trace": ``trace_off_hop_ratio``, ``trace_on_hop_us``).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any

from .device import SLOT_DEVICES
from .chain_hops import hop_dict
from .errors import ExchangeWarning
from .registry import registry as _get_registry
from .runtime import TRACING, register

# The registry's module (``exchange.registry`` the name is the function tx.registry):
# its _TRACE and _NVTX are set from here, its _counts read.
_registry = sys.modules[_get_registry.__module__]

__all__ = ["Trace", "trace", "active", "DEFAULT_CAPACITY"]

#: Entries the ring holds by default (about 40 MB of memory when full); a 1,000-batch
#: run of a 4-stage chain makes 16,000 (27,000 events, a 3.7 MB file).
DEFAULT_CAPACITY = 200_000
#: The largest ring one may ask for (about 200 GB of memory when full).
MAX_CAPACITY = 1_000_000_000

_ACTIVE: "Trace | None" = None  # read by the chain (per run) and the registry's notes
_START_LOCK = threading.Lock()
_now = time.perf_counter_ns

# Synthetic thread ids for tracks that are not threads: stages and streams.
_STAGE_TIDS = 1_000_000
_RECORD_TID = 0


def active() -> "Trace | None":
    """The trace being recorded in this process, or None."""
    return _ACTIVE


class Trace:
    """One recording (see the module docstring). Made by :func:`trace`; ``events()``
    gives the Chrome trace events recorded so far, ``write(path)`` writes them,
    ``dropped`` says how many the ring dropped. Thread-safe: events come from every
    thread (stages on host streams, the reaper, deleters)."""

    def __init__(self, path: str | os.PathLike | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be an int from 1 to {MAX_CAPACITY:,} (entries), not {capacity!r}")
        self.path = None if path is None else os.fspath(path)
        self.capacity = capacity
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self._count = itertools.count()  # next() once per event: dropped = count - len(ring)
        self._reads, self._read_lock = 0, threading.Lock()  # reads of _count (dropped)
        self._pid = os.getpid()
        self._names: dict[int, str] = {}  # synthetic tid -> track name
        self._stage_tids: dict[Any, int] = {}  # a chain's stage plan -> its track
        self._chains: dict[int, int] = {}
        self._releases: dict[int, list[str]] = {}  # record id -> the stream tracks it waits on
        self._holds: dict[int, str] = {}  # remote holder token -> its track
        self._set_holds: dict[int, str] = {}  # a set version's take -> its track
        self._set_tokens = itertools.count(1)
        self._flows = itertools.count(1)
        self._foreign: list[dict[str, Any]] = []  # other processes' events (Ray actors)
        self._batches = itertools.count()
        self._started = self._stopped = 0
        self._fd = -1  # ``path`` opened by start(), written and closed by write(path)

    # -- the recording ----------------------------------------------------------------
    def __enter__(self) -> "Trace":
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.stop()
        if self.path is None or os.getpid() != self._pid:  # a forked child leaves the parent's file be
            return
        if exc is None:
            self.write(self.path)
            return
        try:  # the block raised: its trace is written (what led to the error), never instead of it
            self.write(self.path)
        except Exception as failed:
            why = failed.strerror if isinstance(failed, OSError) and failed.strerror else failed
            note = f"tx.trace: and the trace was not written: {why}"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10
                warnings.warn(note, ExchangeWarning, stacklevel=2)

    def start(self) -> None:
        """Start recording (RuntimeError if a trace is already on in this process)."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a tx.trace() is already recording in this process; one trace at a time")
        if self.path is not None and self._fd < 0:
            self._fd = open_trace_file(self.path)
        with _START_LOCK:
            if _ACTIVE is not None:
                self._close()
                raise RuntimeError("a tx.trace() is already recording in this process; one trace at a time")
            self._pid = os.getpid()
            self._started = _now()
            _ACTIVE = _registry._TRACE = self
        _registry.set_note_gone(self.gone)
        _get_registry()._set_tracking(+1)  # records' creation notes reach created()

    def stop(self) -> None:
        """Stop recording; the events stay (``events()``, ``write``)."""
        global _ACTIVE
        with _START_LOCK:
            if _ACTIVE is not self:
                return
            _ACTIVE = _registry._TRACE = None
            self._stopped = _now()
        _registry.set_note_gone(None)
        _get_registry()._set_tracking(-1)

    @property
    def dropped(self) -> int:
        """Entries the ring dropped (the oldest first) because it was full."""
        # _count is an itertools.count, whose next() is atomic: every event takes a number
        # from it without a lock. It has no public read, so a read takes a number too (one
        # read at a time, counted in _reads): the events so far are the number taken less
        # the reads before it.
        with self._read_lock:
            events = next(self._count) - self._reads
            self._reads += 1
        return max(0, events - len(self._ring))

    def _add(self, event: tuple) -> None:
        next(self._count)
        self._ring.append(event)

    # -- what the library reports ------------------------------------------------------
    def created(self, record: Any) -> None:
        """A record was made (the registry's creation note). Kept raw (the record's
        device, kind and origin as stored), formatted only when the trace is written."""
        next(self._count)
        self._ring.append(("b", record.device, "record", _now(), 0, _RECORD_TID, record.id,
                           (record.nbytes, record.kind, record._origin)))

    def gone(self, record: Any) -> None:
        """A record left the live set: released, or forgotten (the registry's note, on
        whichever thread released it)."""
        next(self._count)
        self._ring.append(("e", record.device, "record", _now(), 0, _RECORD_TID, record.id, None))

    def release_begins(self, record: Any, streams: list[Any]) -> None:
        """A record's last holder is gone; its release waits for ``streams``."""
        ts = _now()
        names = [_stream_name(s) for s in streams]
        self._releases[record.id] = names
        for name in names:
            self._add(("b", "release on " + name, "release", ts, 0, _RECORD_TID, record.id,
                       {"id": record.id, "bytes": record.nbytes}))
        self._counters(ts)

    def release_ends(self, record: Any) -> None:
        """A stream-ordered release completed (the memory was freed)."""
        names = self._releases.pop(record.id, None)
        if names is None:
            return
        ts = _now()
        for name in names:
            self._add(("e", "release on " + name, "release", ts, 0, _RECORD_TID, record.id, None))
        self._counters(ts)

    def remote_hold(self, record: Any, pid: int, token: int) -> None:
        """Process ``pid`` attached ``record``'s memory (its holder's ``token``)."""
        name = self._holds[token] = f"held by process {pid}"
        self._add(("b", name, "remote", _now(), 0, _RECORD_TID, token,
                   {"id": record.id, "bytes": record.nbytes, "pid": pid}))

    def remote_drop(self, token: int) -> None:
        """The hold ``token`` taken in :meth:`remote_hold` was dropped."""
        name = self._holds.pop(token, None)
        if name is not None:
            self._add(("e", name, "remote", _now(), 0, _RECORD_TID, token, None))

    def set_published(self, name: str, number: int, nbytes: int, tensors: int, copied: bool) -> None:
        """Version ``number`` of the set ``name`` was published by this process."""
        self._add(("i", f"publish {name}", "set", _now(), 0, _RECORD_TID, None,
                   {"version": number, "bytes": nbytes, "tensors": tensors, "copied": copied}))

    def set_taken(self, name: str, number: int, nbytes: int, publisher: int) -> int:
        """A reader of this process took version ``number`` of ``name``; the token to give
        :meth:`set_released`."""
        token = next(self._set_tokens)
        track = self._set_holds[token] = f"set {name} held"
        self._add(("b", track, "set", _now(), 0, _RECORD_TID, token,
                   {"version": number, "bytes": nbytes, "publisher": publisher}))
        return token

    def set_released(self, token: int) -> None:
        """The version taken as ``token`` was let go (its last tensor here went)."""
        track = self._set_holds.pop(token, None)
        if track is not None:
            self._add(("e", track, "set", _now(), 0, _RECORD_TID, token, None))

    def stage(self, chain: Any, plan: Any, batch: int, t0: int, t1: int,
              hops: list[dict[str, Any]] | None, first_hop: int, failed: bool) -> None:
        """Stage ``plan`` of ``chain`` ran batch ``batch`` from ``t0`` to ``t1``
        (perf_counter_ns); ``hops[first_hop:]`` are the hops it made. One ring entry,
        expanded into its span, flows and hop instants when the trace is written."""
        tid = self._stage_tids.get(plan) or self._stage_tid(chain, plan)
        end = len(hops) if hops is not None else 0
        next(self._count)
        self._ring.append(("S", plan.name, plan.index, t0, t1 - t0, tid, batch,
                           (plan.last, hops, first_hop, end, failed)))
        if plan.last or failed:  # memory counters once per batch, when it leaves the chain
            self._counters(t1)

    def next_batch(self) -> int:
        """A batch number unique within this trace (flows join a batch's stages by it)."""
        return next(self._batches)

    def _stage_tid(self, chain: Any, plan: Any) -> int:
        tid = self._stage_tids.get(plan)
        if tid is None:
            serial = self._chains.setdefault(id(chain), len(self._chains))
            tid = _STAGE_TIDS + serial * 1000 + plan.index
            self._stage_tids[plan] = tid
            label = f"chain {serial} " if serial else ""
            self._names[tid] = f"{label}stage {plan.index}: {plan.name} ({plan.framework})"
        return tid

    def _counters(self, ts: int) -> None:
        live, pending = _registry._counts(len(SLOT_DEVICES))
        self._add(("C", "live bytes", "memory", ts, 0, 0, None, live))
        self._add(("C", "pending bytes", "memory", ts, 0, 0, None, pending))

    def add_foreign(self, events: list[dict[str, Any]]) -> None:
        """Events another process recorded (Chrome trace form, its own pid: a Ray
        actor's, exchange/ray/executor.py), written with this trace's own."""
        self._foreign.extend(events)

    def new_flow_id(self) -> int:
        """A flow id no stage of this process uses (for flows between processes)."""
        return (1 << 40) + next(self._flows)

    # -- the file ----------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """The Chrome trace events: metadata first, then the recorded ones by time."""
        pid, devices = self._pid, [str(d) for d in SLOT_DEVICES]
        meta: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": _program()}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": _RECORD_TID, "args": {"name": "registry"}},
        ]
        for tid, name in sorted(self._names.items()):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        ring = sorted(list(self._ring), key=lambda e: e[3])
        body: list[dict[str, Any]] = []
        if self.dropped:
            first = ring[0][3] if ring else self._started
            body.append({"ph": "i", "name": f"{self.dropped} entries dropped (ring of {self.capacity})",
                         "cat": "trace", "ts": first / 1e3, "pid": pid, "tid": _RECORD_TID, "s": "p"})
        for ph, name, cat, ts, dur, tid, ident, args in ring:
            if cat == "record":  # kept raw by created(): the device, and (bytes, kind, origin)
                name = "records on " + str(name)
                if ph == "b":
                    nbytes, kind, origin = args
                    args = {"id": ident, "bytes": nbytes, "kind": kind,
                            "origin": f"imported from {origin}" if kind == "imported" else origin}
            elif ph == "S":
                body.extend(_stage_events(pid, name, cat, ts, dur, tid, ident, args))
                continue
            event: dict[str, Any] = {"ph": ph, "name": name, "cat": cat, "ts": ts / 1e3, "pid": pid, "tid": tid}
            if ph == "i":
                event["s"] = "t"
            if ident is not None:  # async spans: ids of this process only (Perfetto, Chrome)
                event["id2"] = {"local": ident}
            if ph == "C":
                args = {devices[i]: n for i, n in enumerate(args) if i < len(devices)}
            if args:
                event["args"] = dict(args)
            body.append(event)
        end = max(self._stopped or _now(), ring[-1][3] if ring else 0)
        body = _paired(body, pid, end / 1e3)
        if self._foreign:
            meta += [e for e in self._foreign if e["ph"] == "M"]
            body = sorted(body + [e for e in self._foreign if e["ph"] != "M"], key=lambda e: e["ts"])
        return meta + body

    def write(self, path: str | os.PathLike) -> None:
        """Write the trace to ``path`` (JSON object form: ``traceEvents``,
        ``displayTimeUnit``, ``otherData`` with ``dropped_entries`` and ``capacity``),
        replacing what the file held. The trace's own path is written through the file
        :meth:`start` opened; any other is opened as :func:`open_trace_file` says
        (OSError naming the path: a symbolic link, another user's file, ...)."""
        path = os.fspath(path)
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "otherData": {"producer": "tensor-exchange", "dropped_entries": self.dropped,
                             "capacity": self.capacity, "clock": "CLOCK_MONOTONIC, microseconds"}}
        if self._fd >= 0 and path == self.path:
            fd, self._fd = self._fd, -1
        else:
            fd = open_trace_file(path)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.truncate(0)
                json.dump(doc, fh, separators=(",", ":"))
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot write the trace to {path!r}: {exc.strerror} (the file holds "
                                       "part of it at most)") from None

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # at exit: nothing to say
            pass


def trace(path: str | os.PathLike | None = None, *, capacity: int = DEFAULT_CAPACITY) -> Trace:
    """Record a timeline of this process's exchanges while the ``with`` block runs, and
    write it to ``path`` (Chrome trace event JSON, for Perfetto or chrome://tracing) when
    the block ends; ``path=None`` keeps it in memory (``Trace.events()``,
    ``Trace.write``). ``capacity``: the ring's size in entries (module docstring; the
    oldest are dropped first).

    The file is opened when the block starts, before any work runs
    (:func:`open_trace_file`: made with mode 0600 if it is not there; OSError naming the
    path for a directory, a symbolic link, a FIFO or device, another user's file, a file
    with other hard links, a folder on the way that is another user's symbolic link, or a
    folder that does not exist or cannot be written), and written when the block ends,
    also when it raises (a failure to write it is then added to the block's error as a
    note, a warning on Python 3.10, not raised instead of it); RuntimeError if a trace is
    already recording in this process. Module docstring: what the trace holds. Use::

        with tx.trace("run.json"):
            chain.run(batches)
    """
    return Trace(path, capacity)


#: The mode a new trace file is made with (before the umask): read and write for its
#: owner only. A trace names the program, its stages, streams and records (module
#: docstring); it is this user's to share.
FILE_MODE = 0o600


def open_trace_file(path: str | os.PathLike) -> int:
    """A descriptor open for writing on ``path``, for a trace: ``path`` is made if it is
    not there (mode :data:`FILE_MODE`, 0600), an existing file is kept as it is (nothing
    written, its mode kept) until the trace is written. OSError naming ``path`` and why
    when it is a directory, a symbolic link (never followed: in a world-writable folder
    such as /tmp it may be another user's), not a regular file (a FIFO, a device), a
    file of another user, a file with other hard links, or cannot be made or opened; and
    when a folder on the way to it is a symbolic link of another user (:func:`_open_folder`).

    The folders are opened one by one and the file in the last of them with ``O_NOFOLLOW``,
    then checked on the descriptor (``fstat``), so what is checked is what is written; a
    FIFO is opened non-blocking and refused."""
    path = os.fspath(path)
    if not path:
        raise _unwritable(path, OSError(errno.ENOENT, os.strerror(errno.ENOENT)))
    folder, name = _open_folder(path)
    try:
        if name in ("", ".", ".."):
            raise _is_dir(path)
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise _unwritable(path, exc) from None
        if st is not None:  # refused before opening: opening a device or a FIFO may do something
            _check_file(path, st)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        try:
            fd = os.open(name, flags, FILE_MODE, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link put there after the check above
                raise _refused(path, errno.ELOOP, "it is a symbolic link") from None
            if exc.errno == errno.EISDIR:
                raise _is_dir(path) from None
            raise _unwritable(path, exc) from None
    finally:
        os.close(folder)
    try:
        _check_file(path, os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: Flags of a folder opened on the way to a trace file: O_PATH where there is one (only the
#: right to search it is needed, as for any path), never following a link.
_FOLDER = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Symbolic links followed on the way, at most (the kernel's own limit, MAXSYMLINKS).
_MAX_LINKS = 40


def _open_folder(path: str) -> tuple[int, str]:
    """(a descriptor of the folder ``path``'s file is in, the file's name). The folders are
    opened one by one, each in the one before (from / or the working directory), without
    following a symbolic link; a link of this user or of root is followed, its target
    opened the same way, and a link of another user is refused (PermissionError). The
    kernel's ``O_NOFOLLOW`` covers only the last name: with ``/tmp/traces`` another user's
    link to /etc, ``/tmp/traces/run.json`` would otherwise be written in /etc
    (``fs.protected_symlinks`` guards only links in sticky folders such as /tmp, and may be
    off). Opened in turn, no folder can be swapped for a link between a check and its use."""
    folder, name = os.path.split(path)
    try:
        fd = os.open(os.sep if path.startswith(os.sep) else ".", _FOLDER)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    return _walk(fd, folder, path, [0]), name


def _walk(fd: int, folder: str, path: str, links: list[int]) -> int:
    """``folder`` opened from the folder ``fd``, as :func:`_open_folder` says: its
    descriptor is returned, ``fd`` closed (also when it raises). ``links`` counts the links
    followed so far."""
    try:
        for part in folder.split(os.sep):
            if part not in ("", "."):
                step = _step(fd, part, path, links)
                os.close(fd)
                fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(fd: int, part: str, path: str, links: list[int]) -> int:
    """The folder ``part`` of the folder ``fd`` opened: a folder, or a link of this user or
    root to one (its target walked as the path is)."""
    try:
        return os.open(part, _FOLDER, dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):  # ENOTDIR: a link, or not a folder
            raise _unwritable(path, exc) from None
        refused = exc
    try:
        st = os.lstat(part, dir_fd=fd)
        if not stat.S_ISLNK(st.st_mode):
            raise refused
        target = os.readlink(part, dir_fd=fd)
        same = os.lstat(part, dir_fd=fd)  # the link read is the one checked
    except OSError as exc:
        raise _unwritable(path, exc) from None
    if st.st_uid not in (os.geteuid(), 0) or (same.st_ino, same.st_uid) != (st.st_ino, st.st_uid):
        raise _refused(path, errno.EPERM, f"the folder {part!r} on its way is a symbolic link of "
                                          f"{_user(st.st_uid)}, who could point it anywhere",
                       "give the path without it (its target, if you trust it)")
    links[0] += 1
    if links[0] > _MAX_LINKS:
        raise _unwritable(path, OSError(errno.ELOOP, os.strerror(errno.ELOOP)))
    try:
        start = os.open(os.sep, _FOLDER) if target.startswith(os.sep) else os.dup(fd)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    return _walk(start, target, path, links)


def _check_file(path: str, st: os.stat_result) -> None:
    """OSError unless ``st`` (lstat of ``path``, or fstat of it opened) is a regular file
    of this process's user with one link."""
    if stat.S_ISDIR(st.st_mode):
        raise _is_dir(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refused(path, errno.ELOOP, "it is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _refused(path, errno.EINVAL, "not a regular file (a FIFO, socket or device)",
                       "give the path of a regular file, or of a new one")
    if st.st_uid != os.geteuid():
        raise _refused(path, errno.EPERM, f"the file belongs to {_user(st.st_uid)}, not to this process's user")
    if st.st_nlink != 1:
        raise _refused(path, errno.EPERM, f"the file has {st.st_nlink} hard links (another name of it would be "
                                          "written too)")


def _refused(path: str, err: int, why: str, fix: str = "remove it, or give a new path") -> OSError:
    cls = PermissionError if err in (errno.EPERM, errno.EACCES) else OSError
    return cls(err, f"cannot write the trace to {path!r}: {why}; a trace never writes through a link nor into "
                    f"another user's file: {fix}")


def _is_dir(path: str) -> OSError:
    return IsADirectoryError(errno.EISDIR, f"cannot write the trace to {path!r}: it is a directory; give a file name")


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _after_fork_in_child() -> None:
    # A forked child does not record into the parent's trace (its events would carry
    # the parent's pid) nor write the parent's file: the trace stops here, in the child.
    global _ACTIVE
    recording = _ACTIVE
    if recording is None:
        return
    _ACTIVE = _registry._TRACE = None
    _registry.set_note_gone(None)
    _get_registry()._tracker_gone_after_fork()


register("after_fork_in_child", "tracing", _after_fork_in_child, TRACING)


def _unwritable(path: str, exc: OSError) -> OSError:
    return type(exc)(exc.errno, f"cannot write the trace to {path!r}: {exc.strerror}; "
                                "give a path in a directory that exists and you can write")


def _stage_events(pid: int, name: str, index: int, t0: int, dur: int, tid: int, batch: int,
                  more: tuple) -> list[dict[str, Any]]:
    """One stage entry of the ring as trace events: its span, the flows in (from the
    stage before, which made this batch's input) and out (to the next stage), and an
    instant per hop it made."""
    last, hops, first, end, failed = more
    ts = t0 / 1e3
    args: dict[str, Any] = {"batch": batch}
    if failed:
        args["failed"] = True
    out = [{"ph": "X", "name": name, "cat": "stage", "ts": ts, "dur": dur / 1e3, "pid": pid, "tid": tid,
            "args": args}]
    if index:
        out.append({"ph": "f", "name": "batch", "cat": "batch", "ts": ts, "pid": pid, "tid": tid, "bp": "e",
                    "id": (batch << 12) | index})
    if not last and not failed:
        out.append({"ph": "s", "name": "batch", "cat": "batch", "ts": ts, "pid": pid, "tid": tid,
                    "id": (batch << 12) | (index + 1)})
    for hop in (hops[first:end] if hops is not None else ()):
        hop = hop_dict(hop)  # a run still going may have its compact form (exchange/chain_hops.py)
        out.append({"ph": "i", "name": f"hop {hop['from']} -> {hop['to']}", "cat": "hop", "ts": ts, "s": "t",
                    "pid": pid, "tid": tid, "args": dict(hop)})
    return out


# What an async span still open when the trace ended says, by category.
_OPEN_AT_END = {"record": "alive_at_end", "release": "pending_at_end", "remote": "held_at_end", "set": "held_at_end"}


def _paired(body: list[dict[str, Any]], pid: int, end: float) -> list[dict[str, Any]]:
    """The events with every async span and flow whole: an end whose begin is not here
    (it came before the trace started, or the ring dropped it) is left out, a span still
    open is closed at ``end`` saying so (``args.alive_at_end`` for a record, and so on),
    and a flow missing one of its two ends is left out."""
    open_spans: dict[tuple, dict[str, Any]] = {}
    flows: dict[Any, set] = {}
    kept = []
    for e in body:
        ph = e["ph"]
        if ph == "b":
            open_spans[(e["cat"], e["name"], e["id2"]["local"])] = e
        elif ph == "e":
            if open_spans.pop((e["cat"], e["name"], e["id2"]["local"]), None) is None:
                continue
        elif ph in ("s", "f"):
            flows.setdefault(e["id"], set()).add(ph)
        kept.append(e)
    kept = [e for e in kept if e["ph"] not in ("s", "f") or len(flows[e["id"]]) == 2]
    for (cat, name, ident), _begin in open_spans.items():
        kept.append({"ph": "e", "name": name, "cat": cat, "ts": end, "pid": pid, "tid": _RECORD_TID,
                     "id2": {"local": ident}, "args": {_OPEN_AT_END.get(cat, "open_at_end"): True}})
    return kept


def _stream_name(stream: Any) -> str:
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) and name else repr(stream)


def _program() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"{argv0} (pid {os.getpid()})"


# -- NVTX (Nsight Systems) ---------------------------------------------------------------
_NVTX_DOMAIN = "tensor-exchange"
_nvtx_checked = False
_nvtx: Any = None


def nvtx_module() -> Any:
    """The ``nvtx`` package when it is importable and its ranges go somewhere: a tool
    such as Nsight Systems is attached (it names its NVTX library in
    ``NVTX_INJECTION64_PATH``), or ``EXCHANGE_NVTX=1`` asks for them anyway; else None,
    and nothing NVTX runs. (``nvtx.enabled()`` cannot say: it is True unless
    ``NVTX_DISABLE`` is set.) Looked up once per process; while it is None no stage or
    release pays anything for it."""
    global _nvtx_checked, _nvtx
    if not _nvtx_checked:
        _nvtx_checked = True
        forced = os.environ.get("EXCHANGE_NVTX", "") not in ("", "0")
        attached = bool(os.environ.get("NVTX_INJECTION64_PATH"))
        if forced or attached:
            import importlib.util

            if importlib.util.find_spec("nvtx") is not None:
                try:
                    import nvtx

                    _nvtx = nvtx
                    _registry._NVTX = _NvtxReleases(nvtx)
                except Exception:  # a broken install: no ranges, never an error
                    _nvtx = None
    return _nvtx


class _NvtxReleases:
    """Stream-ordered releases as process-wide NVTX ranges ("release #ID on STREAM"),
    from the last holder's drop to the completed free (they end on the reaper's thread,
    so ranges started and ended by id, not pushed)."""

    def __init__(self, nvtx: Any) -> None:
        self._nvtx = nvtx
        self._open: dict[int, Any] = {}

    def release_begins(self, record: Any, streams: list[Any]) -> None:
        names = ", ".join(_stream_name(s) for s in streams)
        self._open[record.id] = self._nvtx.start_range(f"release #{record.id} on {names}", domain=_NVTX_DOMAIN)

    def release_ends(self, record: Any) -> None:
        rng = self._open.pop(record.id, None)
        if rng is not None:
            self._nvtx.end_range(rng)


class StageWatch:
    """What a chain run reports per stage while a trace records or NVTX is on (one per
    ``Chain.run``): the stage's NVTX range, pushed and popped on the thread that runs
    it, and its span, hops and flow in the trace."""

    __slots__ = ("trace", "nvtx")

    def __init__(self, trace: "Trace | None", nvtx: Any) -> None:
        self.trace, self.nvtx = trace, nvtx

    def next_batch(self) -> int:
        return self.trace.next_batch() if self.trace is not None else 0

    def push(self, plan: Any) -> None:
        """The stage's NVTX range begins (on the thread that runs it)."""
        try:
            self.nvtx.push_range(f"stage {plan.index}: {plan.name}", domain=_NVTX_DOMAIN)
        except Exception:  # NVTX never breaks a run
            pass

    def pop(self) -> None:
        try:
            self.nvtx.pop_range(domain=_NVTX_DOMAIN)
        except Exception:
            pass


def number_next_batch(number: int) -> None:
    """The next batch the recording trace numbers gets ``number`` (a Ray actor's trace
    takes the driver's numbers, so one batch has one number in every process)."""
    trace = _ACTIVE
    if trace is not None:
        trace._batches = itertools.count(number)


def stage_watch(nvtx: Any) -> StageWatch | None:
    """The watch for one chain run (None: neither a trace nor NVTX is on)."""
    trace = _ACTIVE
    if trace is None and nvtx is None:
        return None
    return StageWatch(trace, nvtx)
