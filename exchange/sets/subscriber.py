"""The reading side of a set: a subscription's connection, its mapped regions, snapshots.

Owns ``Subscription`` (``tx.subscribe``), ``Snapshot`` and what they stand on: a
``_Connection`` to one publisher (its socket, its pid as the kernel says it, the regions
mapped through it) and a ``_Hold`` per version taken, the release of that version's one
registry record here (the tensors of a snapshot are views of it): when the snapshot and
every tensor taken from it are gone, the record's release tells the publisher and lets
the region's mapping go. Requests run on the caller's thread; there is no thread here.

A connection lives while its subscription is open or any version taken through it is
held: closing it would tell the publisher (end of stream) that this process holds
nothing, and the publisher would reuse regions still being read.

Device memory (a version whose message has a memory part: exchange/sets/memory.py) is
mapped per version, never cached; its tensors are ordered on the mapping's stream, and
its release runs at once with the streams that used it (``free_after``), sending the
release token (an event) the publisher orders its later writes after.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Iterator

from ..device import CPU
from ..errors import ExchangeError, LifetimeError
from ..registry import _warn, registry
from ..tensor import Tensor
from . import memory, wire
from .names import check_name, socket_path

_REG = registry()
#: Regions no held version uses that a connection keeps mapped, at most (the next
#: version in one of them then needs no new mapping).
CACHED_REGIONS = 4
#: Seconds between tries to reach a publisher that is not there yet.
RETRY_S = (0.002, 0.05)


class _Region:
    __slots__ = ("id", "memory", "uses")

    def __init__(self, rid: int, memory: Any) -> None:
        self.id, self.memory, self.uses = rid, memory, 0


class _Connection:
    """This process's connection to a set's publisher (one per subscription)."""

    def __init__(self, name: str, sock: socket.socket, pid: int) -> None:
        self.name, self.sock, self.publisher = name, sock, pid
        self.owner = os.getpid()  # a forked child's copy tells the publisher nothing
        self.lock = threading.RLock()  # (re-entrant: a release can run inside a collection here)
        self.regions: dict[int, _Region] = {}
        self.holds = 0
        self.layout: tuple[int, int, list] = (0, 0, [])  # (id, nbytes, checked entries) of the last version
        self.open = True  # the subscription still uses it
        self.closed = False
        # Device memory: what a release sent that the publisher may not have opened yet
        # (its event), each with the last take's id then; a reply to a later take shows
        # the publisher read the release first. ``settle`` (the memory's) waits for them
        # if the connection closes before that.
        self.last_take = 0
        self.kept: list[tuple[int, Any]] = []
        self.settle: Any = None

    def send(self, message: list) -> None:
        wire.send(self.sock, message)

    def region(self, rid: int, nbytes: int, fds: list[int], kind: Any = memory, parsed: Any = None) -> _Region:
        if parsed is not None:  # device memory: mapped per version, never cached (see its module)
            try:
                r = _Region(rid, kind.map_region(fds, nbytes, parsed))
            finally:
                wire.close_fds(fds)
            self.settle = kind.settle
            return r
        with self.lock:
            r = self.regions.get(rid)
            if r is not None and r.memory.nbytes >= nbytes:
                wire.close_fds(fds)  # mapped already: one mapping per region, never per version
                return r
            if r is not None:
                self._unmap(r)
            r = self.regions[rid] = _Region(rid, memory.map_region(fds, nbytes))
            return r

    def hold(self, r: _Region) -> None:
        with self.lock:
            r.uses += 1
            self.holds += 1

    def let_go(self, r: _Region, number: int, streams: list[Any]) -> None:
        """A version held through this connection was let go (its record's release;
        ``streams``: those that used it, for device memory)."""
        with self.lock:
            self.holds -= 1
            r.uses -= 1
            if self.owner != os.getpid():
                return
            release = getattr(r.memory, "release", None)  # device memory: unmapped now, in stream order
            token = None
            if release is not None:
                try:
                    token, kept = release(streams)
                    if not self.closed:  # (closed: no one is left to open it)
                        self.kept.append((self.last_take, kept))
                except Exception as exc:
                    _warn(f"releasing version {number} of the set {self.name!r} failed ({exc}); the publisher is "
                          "told without an event")
            if not self.closed:
                try:
                    self.send(["release", number] if token is None else ["release", number, token])
                except OSError:
                    pass  # the publisher is gone: it holds nothing for us any more
            if release is None:
                idle = [x for x in self.regions.values() if x.uses == 0]
                if not r.uses and (len(idle) > CACHED_REGIONS or not self.open):
                    self._unmap(r)
            self._close_if_unused()

    def confirm(self, rid: int) -> None:
        """The publisher answered take ``rid``: it had read every release sent before it."""
        with self.lock:
            if self.kept:
                self.kept = [(stamp, k) for stamp, k in self.kept if stamp >= rid]

    def _unmap(self, r: _Region) -> None:
        self.regions.pop(r.id, None)
        r.memory.close()

    def _close_if_unused(self) -> None:
        if not self.open and not self.holds and not self.closed:
            self.closed = True
            for r in list(self.regions.values()):
                self._unmap(r)
            kept, self.kept = [k for _, k in self.kept], []
            if kept:
                self.settle(kept)  # the publisher may still open them after the close
            self.sock.close()

    def finish(self) -> None:
        """The subscription is done with it: it closes once nothing taken through it is held."""
        with self.lock:
            self.open = False
            for r in [x for x in self.regions.values() if x.uses == 0]:
                self._unmap(r)
            self._close_if_unused()

    def lost(self) -> None:
        """The publisher went (end of stream): held versions stay mapped and valid."""
        with self.lock:
            self.open = False
            self.kept = []  # no one is left to open them
            if not self.closed:
                self.closed = True
                self.sock.close()
            for r in [x for x in self.regions.values() if x.uses == 0]:
                self._unmap(r)

    def after_fork_in_child(self) -> None:
        with self.lock:
            self.open = False
            if not self.closed:
                self.closed = True
                self.sock.close()


class _Hold:
    """The release of one version's record here: tells the publisher, lets the region go.
    Runs once."""

    __slots__ = ("conn", "region", "number", "_calls", "trace")

    def __init__(self, conn: _Connection, region: _Region, number: int) -> None:
        self.conn, self.region, self.number = conn, region, number
        self._calls = itertools.count()
        self.trace: Any = None  # (the trace recording the take, its token), while one records

    def __call__(self, streams: Any = ()) -> None:
        if next(self._calls) == 0:
            if self.trace is not None:
                trace, token = self.trace
                trace.set_released(token)
            self.conn.let_go(self.region, self.number, streams)


class _DeviceHold(_Hold):
    """The release of a version in device memory: run at once with the streams that used
    it (the registry's ``free_after``), which the memory's release orders after."""

    __slots__ = ()

    def free_after(self, streams: list[Any]) -> bool:
        self(streams)
        return True


class Snapshot(Mapping):
    """One version of a set, all of it: a read-only Mapping of str to tx.Tensor (read-only
    tensors; host memory the kernel keeps read-only too: a write through any view of it
    faults. Device memory: the tensors' flag only, docs/processes.md, "Sets on CUDA memory").
    ``name``, ``version`` (its number). A ``with`` block or ``close()`` drops the
    snapshot's own hold; tensors taken from it keep their memory alive, as every
    tx.Tensor does, and the version with it. It stays valid after its Subscription is
    closed and after its publisher is gone. After ``close()`` its items raise
    LifetimeError."""

    def __init__(self, name: str, version: int, tensors: dict[str, Tensor]) -> None:
        self.name, self.version = name, version
        self._tensors: dict[str, Tensor] | None = tensors
        self._keys = tuple(tensors)

    def _live(self) -> dict[str, Tensor]:
        if self._tensors is None:
            raise LifetimeError(f"this snapshot of {self.name!r} (version {self.version}) is closed")
        return self._tensors

    def __getitem__(self, key: str) -> Tensor:
        return self._live()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        """Drop this snapshot's hold (once)."""
        self._tensors = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "" if self._tensors is not None else ", closed"
        return f"tx.Snapshot({self.name!r}, version={self.version}, {len(self._keys)} tensors{state})"


def _connect(name: str) -> tuple[socket.socket, int] | None:
    """A connection to the publisher of ``name``, proven this user's; None when none
    listens now."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.connect(socket_path(name))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as exc:
        sock.close()
        if exc.errno == errno.ENOENT:
            return None
        raise
    pid, uid = wire.peer(sock)
    if uid != os.getuid():
        sock.close()
        raise ExchangeError(f"the publisher of {name!r} (pid {pid}) runs as uid {uid}, not this user: refused")
    return sock, pid


class Subscription:
    """Following set ``name`` (``tx.subscribe``): ``latest()`` and ``next()`` take its
    versions. A context manager; ``close()`` ends it (snapshots taken stay valid). The
    publisher need not exist yet: the first take waits for one. Not for use by several
    threads at once (each takes its own lock: they run one after the other)."""

    def __init__(self, name: str) -> None:
        self.name = check_name(name)
        socket_path(name)  # the directory checked now: ExchangeError if it is not this user's alone
        self._conn: _Connection | None = None
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._last = 0
        self._nbytes = 0
        self._closed = False
        _register(self)

    def latest(self, timeout: float | None = None) -> Snapshot:
        """The newest version; waits up to ``timeout`` seconds (None: for ever) for a
        first one. TimeoutError; LifetimeError (naming the publisher) once the publisher
        that served this subscription unpublished the set or died: the call after that
        follows the name's next publisher."""
        return self._take(0, timeout)

    def next(self, timeout: float | None = None) -> Snapshot:
        """The newest version, once there is one newer than the last this subscription
        returned (versions in between are skipped). Errors as ``latest``."""
        return self._take(self._last, timeout)

    def _take(self, after: int, timeout: float | None) -> Snapshot:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                raise LifetimeError(f"this subscription to {self.name!r} is closed")
            conn = self._connection(deadline)
            rid = next(self._rids)
            conn.last_take = rid  # (before the send: a release racing it waits for a later reply)
            try:
                conn.send(["take", rid, after])
            except OSError:
                self._lost(conn, "")
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    try:  # its answer, if one is on its way, is let go at the next take or at close()
                        conn.send(["cancel", rid])
                    except OSError:
                        pass
                    raise TimeoutError(f"no {'new ' if after else ''}version of the set {self.name!r} within "
                                       f"{timeout} s (publisher: process {conn.publisher})")
                conn.sock.settimeout(left)
                try:
                    message, fds = wire.receive(conn.sock)
                except socket.timeout:
                    continue
                except (OSError, ValueError) as exc:
                    self._lost(conn, f" ({exc})")
                if message is None:
                    self._lost(conn, "")
                try:
                    m = wire.check_reply(message)
                except (ValueError, TypeError) as exc:
                    wire.close_fds(fds)
                    self._lost(conn, f" (it sent a malformed message: {exc})")
                if m[0] == "gone":
                    wire.close_fds(fds)
                    if m[1] == rid:
                        self._conn = None
                        conn.finish()
                        raise LifetimeError(m[2])
                    continue
                conn.confirm(m[1])
                snap = self._snapshot(conn, m, fds)
                if m[1] == rid:
                    self._last = max(self._last, snap.version) if after else snap.version
                    self._nbytes = m[5]
                    return snap
                del snap  # the answer to a take that timed out: let go at once

    def _connection(self, deadline: float | None) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        pause = RETRY_S[0]
        while True:
            found = _connect(self.name)
            if found is not None:
                self._conn = conn = _Connection(self.name, *found)
                self._last = 0  # a new publisher numbers from 1
                return conn
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no publisher of the set {self.name!r} within the timeout")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, RETRY_S[1])

    def _lost(self, conn: _Connection, detail: str) -> None:
        self._conn = None
        conn.lost()
        raise LifetimeError(f"the publisher of the set {self.name!r}, process {conn.publisher}, unpublished it or "
                            f"exited{detail}; snapshots taken stay valid")

    def _snapshot(self, conn: _Connection, m: list, fds: list[int]) -> Snapshot:
        _, _, number, rid, region_bytes, nbytes, layout, raw, *rest = m
        part = rest[0] if rest else None  # device memory's part (exchange/sets/memory.py)
        kind: Any = memory
        parsed = None
        if part is not None:
            try:
                kind = memory.kind_for(part[0])
                parsed = kind.check_part(part, region_bytes)
            except (ValueError, TypeError, BufferError) as exc:
                wire.close_fds(fds)
                self._lost(conn, f" (it sent a malformed version: {exc})")
        if len(fds) != 1 if part is None else len(fds) > 1:
            wire.close_fds(fds)
            self._lost(conn, " (a version came without its memory)")
        if raw is not None:
            try:
                conn.layout = (layout, nbytes, wire.check_entries(raw, nbytes))
            except ValueError as exc:
                wire.close_fds(fds)
                self._lost(conn, f" (it sent a malformed version: {exc})")
        elif conn.layout[:2] != (layout, nbytes):
            wire.close_fds(fds)
            self._lost(conn, " (it sent a version of a layout it never described)")
        entries = conn.layout[2]
        try:
            region = conn.region(rid, region_bytes, fds, kind, parsed)
        except (OSError, ValueError, ExchangeError, ImportError) as exc:
            try:
                conn.send(["release", number])
            except OSError:
                pass
            raise ExchangeError(f"cannot map version {number} of the set {self.name!r}: {exc}") from None
        conn.hold(region)
        mem = region.memory
        # (host memory's mapping names none of these: host, no stream, sealed by the kernel)
        device, stream = getattr(mem, "device", CPU), getattr(mem, "stream", None)
        hold = _Hold(conn, region, number) if parsed is None else _DeviceHold(conn, region, number)
        record = _REG.new_record(device, mem.address, max(nbytes, 1),
                                 origin=f"set {self.name!r} version {number} of process {conn.publisher}",
                                 kind="imported", release=hold, owner=mem)
        tracing = sys.modules.get("exchange.tracing")  # loaded only once a trace was asked for
        trace = None if tracing is None else tracing.active()
        if trace is not None:
            hold.trace = (trace, trace.set_taken(self.name, number, nbytes, conn.publisher))
        record.immutable = True  # the publisher never writes a version readers hold
        # Host: the kernel keeps it read-only here, so exports may go out as legacy
        # capsules. Device memory: read-only is the Tensor's flag alone (no exemption).
        record.sealed = getattr(mem, "sealed", True)
        base = mem.address
        make = Tensor._make
        tensors = {key: make(record, base + off, shape, strides, dt, True, stream)
                   for key, off, shape, strides, dt in entries}
        if not tensors:
            _REG.discard(record)
            hold()
        return Snapshot(self.name, number, tensors)

    def close(self) -> None:
        """End the subscription (once). Snapshots and tensors taken stay valid; the
        connection closes once they are all gone."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): the connection goes once nothing taken through it is held.
        conn = getattr(self, "_conn", None)
        if conn is not None and conn.owner == os.getpid():
            try:
                conn.finish()
            except Exception:
                pass

    def stats(self) -> dict[str, Any] | None:
        conn = self._conn
        if self._closed:
            return None
        return {"name": self.name, "role": "reader", "version": self._last, "nbytes": self._nbytes,
                "readers": 0, "live_versions": conn.holds if conn else 0,
                "publisher": conn.publisher if conn else 0}

    def __repr__(self) -> str:
        return f"tx.Subscription({self.name!r}, last version {self._last}{', closed' if self._closed else ''})"


def _register(sub: Subscription) -> None:
    from . import _state

    _state().subscriptions.add(sub)
