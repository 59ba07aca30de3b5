"""The reading side of a set: a subscription's connection, its mapped regions, snapshots.

Owns ``Subscription`` (``tx.subscribe``), ``Snapshot`` and what they stand on: a
``_Connection`` to one publisher (its socket, its pid as the kernel says it, the regions
mapped through it) and a ``_Hold`` per version taken, the release of that version's one
registry record here (the tensors of a snapshot are views of it): when the snapshot and
every tensor taken from it are gone, the record's release tells the publisher and lets
the region's mapping go. New versions are received on the process runtime's thread
(``exchange.runtime.loop()``) as they are published; a take runs on the caller's thread
and needs no answer from the publisher once the version is here.

A connection lives while its subscription is open or any version taken through it is
held: closing it would tell the publisher (end of stream) that this process holds
nothing, and the publisher would reuse regions still being read.

Device memory (a version whose message has a memory part: exchange/sets/memory.py) is
mapped per version, never cached; its tensors are ordered on the mapping's stream, and
its release runs at once with the streams that used it (``free_after``), sending the
release token (an event's handle) the publisher orders its later writes after; an
offer declined untaken sends one too.
"""

from __future__ import annotations

import errno
import itertools
import os
import selectors
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Iterator

from .. import _core
from ..device import CPU
from ..errors import ExchangeError, LifetimeError
from ..registry import _warn, registry
from ..runtime import loop
from ..tensor import Tensor
from . import memory, wire
from .memory import NewestCounter
from .names import check_name, socket_path

_REG = registry()
#: Regions no held version uses that a connection keeps mapped, at most (the next
#: version in one of them then needs no new mapping).
CACHED_REGIONS = 4
#: Seconds a waiting take sleeps at most before looking at its socket itself.
WAIT_SLICE_S = 0.05
#: Seconds between tries to reach a publisher that is not there yet.
RETRY_S = (0.002, 0.05)


class _Region:
    __slots__ = ("id", "memory", "uses")

    def __init__(self, rid: int, memory: Any) -> None:
        self.id, self.memory, self.uses = rid, memory, 0


class _Offer:
    """A version the publisher handed this connection, mapped here, not yet taken by a
    ``latest()`` or ``next()``: its hold is counted at the publisher. ``offered``: it came
    for the standing request (the publisher counts it an offer until told ``took``), else
    for a direct ``take`` (a reader's hold at once)."""

    __slots__ = ("number", "region", "nbytes", "keys", "specs", "offered")

    def __init__(self, number: int, region: _Region, nbytes: int, keys: tuple, specs: list, offered: bool) -> None:
        self.number, self.region, self.nbytes, self.keys, self.specs = number, region, nbytes, keys, specs
        self.offered = offered


class _Connection:
    """This process's connection to a set's publisher (one per subscription).

    It keeps one request standing at the publisher (``follow``, sent once): each new
    version is offered as it is published (while fewer than two offers are outstanding),
    and the process runtime's thread receives it, maps its region (once per region) and
    keeps it as the connection's offer, letting the offer before it go at once.
    ``latest()`` and ``next()`` then take the offer without asking the publisher and
    waiting for its answer. A subscription holds at most the newest version offered to
    it (and, until the runtime's thread hears of a newer one, the one before): the
    publisher does not count offers against its bound on live versions (``Version.readers``
    names the processes holding a version, offers included).

    Nothing sent here is lost or blocks: what the socket cannot take now waits in
    ``outbox``, in order, until the runtime's thread finds it writable. The connection
    stays watched until its socket closes (after close(), offers still arriving are let
    go at once), or until the publisher has closed its end."""

    def __init__(self, name: str, sock: socket.socket, pid: int) -> None:
        self.name, self.sock, self.publisher = name, sock, pid
        self.owner = os.getpid()  # a forked child's copy tells the publisher nothing
        self.lock = threading.RLock()  # (re-entrant: a release can run inside a collection here)
        self.cond = threading.Condition(self.lock)
        self.regions: dict[int, _Region] = {}
        self.holds = 0
        # (id, nbytes, keys, (offset, shape, strides, dtype) per key) of the last version's layout
        self.layout: tuple[int, int, tuple, list] = (0, 0, (), [])
        self.offer: _Offer | None = None
        self.newest = 0  # the newest version number handed here
        self.following = 0  # the id of the standing request (sent once, by start())
        self.rids = itertools.count(1)
        self.failure: str | None = None  # why the publisher serves this connection no more
        self.counter: NewestCounter | None = None  # the publisher's newest version number, read here
        self.error: Exception | None = None  # for the next take (a version that could not be mapped)
        self.open = True  # the subscription still uses it
        self.closed = False
        self.watched = False
        self.outbox: deque[list] = deque()  # messages the socket could not take yet, in order

    def start(self) -> None:
        """Ask for every new version and let the runtime's thread receive them."""
        self.sock.setblocking(False)
        with self.lock:
            self._follow()
            loop().register(self.sock, selectors.EVENT_READ, self._ready)
            self.watched = True

    def send(self, message: list) -> None:
        """Send ``message``, never waiting: behind what waits already, or kept to be sent
        when the socket can take it. OSError when the publisher is gone."""
        if not self.outbox:
            try:
                wire.send(self.sock, message, -1, socket.MSG_DONTWAIT)
                return
            except (BlockingIOError, InterruptedError):
                pass
        self.outbox.append(message)
        self._watch(selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _flush(self) -> None:
        while self.outbox:
            try:
                wire.send(self.sock, self.outbox[0], -1, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.outbox.clear()  # the publisher is gone: it holds nothing for us any more
                break
            self.outbox.popleft()
        self._watch(selectors.EVENT_READ)

    def _watch(self, events: int) -> None:
        if self.watched:
            loop().modify(self.sock, events, self._ready)

    # -- receiving (the runtime's thread, or a take's) ----------------------------------------
    def _ready(self, sock: socket.socket) -> None:
        with self.lock:
            if self.watched:
                if self.outbox:
                    self._flush()
                self.pump()

    def pump(self) -> None:
        """Receive what the publisher sent (never waits). Under the lock. Once the
        publisher serves no more, what still comes is let go; at its end of the socket
        the connection stops being watched."""
        while self.watched:
            try:
                message, fds = wire.receive(self.sock)
            except (BlockingIOError, InterruptedError):
                break
            except (OSError, ValueError) as exc:
                self._fail(self._lost_text(f" ({exc})"), ended=isinstance(exc, OSError))
                break
            if message is None:
                self._fail(self._lost_text(""), ended=True)
                break
            if self.failure is not None:
                wire.close_fds(fds)  # (after "gone": nothing more is expected)
                continue
            try:
                m = wire.check_reply(message)
            except (ValueError, TypeError) as exc:
                wire.close_fds(fds)
                self._fail(self._lost_text(f" (it sent a malformed message: {exc})"))
                break
            if m[0] == "gone":
                wire.close_fds(fds)
                self._fail(m[2])
                break
            if m[0] == "drop":
                wire.close_fds(fds)
                r = self.regions.get(m[1])
                if r is not None and not r.uses:
                    self._unmap(r)
                continue
            if m[0] == "counter":
                if self.counter is not None or len(fds) != 1:
                    wire.close_fds(fds)
                    self._fail(self._lost_text(" (it sent a second counter, or one without its memory)"))
                    break
                try:
                    self.counter = NewestCounter.map(fds)
                except (OSError, ValueError) as exc:
                    self._fail(self._lost_text(f" (its counter cannot be mapped: {exc})"))
                    break
                continue
            self._offered(m, fds)
        self.cond.notify_all()

    def _lost_text(self, detail: str) -> str:
        return (f"the publisher of the set {self.name!r}, process {self.publisher}, unpublished it or exited"
                f"{detail}; snapshots taken stay valid")

    def _offered(self, m: list, fds: list[int]) -> None:
        _, rid, number, region_id, region_bytes, nbytes, layout, raw, *rest = m
        offered = rid == self.following
        held = self.regions.get(region_id)
        if held is not None and held.uses and held.memory.nbytes < region_bytes:
            wire.close_fds(fds)
            return self._fail(self._lost_text(f" (it resized region {region_id}, which this process holds a "
                                              "version in)"))
        part = rest[0] if rest else None  # device memory's part (exchange/sets/memory.py)
        kind: Any = memory
        parsed = None
        if part is not None:
            try:
                kind = memory.kind_for(part[0])
                parsed = kind.check_part(part, region_bytes)
            except (ValueError, TypeError, BufferError) as exc:
                wire.close_fds(fds)
                return self._fail(self._lost_text(f" (it sent a malformed version: {exc})"))
        if len(fds) != 1 if part is None else len(fds) > 1:
            wire.close_fds(fds)
            return self._fail(self._lost_text(" (a version came without its memory)"))
        if raw is not None:
            try:
                entries = wire.check_entries(raw, nbytes)
            except ValueError as exc:
                wire.close_fds(fds)
                return self._fail(self._lost_text(f" (it sent a malformed version: {exc})"))
            # (kept as the keys and what new_tensors takes: made once per layout, not per take)
            self.layout = (layout, nbytes, tuple(e[0] for e in entries), [e[1:] for e in entries])
        elif self.layout[:2] != (layout, nbytes):
            wire.close_fds(fds)
            return self._fail(self._lost_text(" (it sent a version of a layout it never described)"))
        try:
            region = self.region(region_id, region_bytes, fds, kind, parsed)
        except (OSError, ValueError, ExchangeError, ImportError) as exc:
            self._tell("decline" if offered else "release", number)
            self.newest = max(self.newest, number)  # (a latest() then asks for it again)
            self.error = ExchangeError(f"cannot map version {number} of the set {self.name!r}: {exc}")
            return None
        self.hold(region)
        new = _Offer(number, region, nbytes, self.layout[2], self.layout[3], offered)
        old, self.offer = self.offer, new
        self.newest = max(self.newest, number)
        if old is not None:
            self._drop_offer(old)
        if not self.open:  # closed meanwhile: nothing will take it
            self.offer = None
            self._drop_offer(new)
        return None

    def _follow(self) -> None:
        # Once per connection: the publisher offers each new version from then on.
        rid = next(self.rids)
        try:
            self.send(["follow", rid, self.newest])
        except OSError as exc:
            self._fail(self._lost_text(f" ({exc})"))
            return
        self.following = rid

    def _fail(self, why: str, ended: bool = False) -> None:
        # The publisher serves this connection no more: the next take raises ``why``.
        # ``ended``: its end of the socket is closed (nothing more to send or receive).
        if self.failure is None:
            self.failure = why
        if ended:
            self._unwatch()
            self.outbox.clear()
        old, self.offer = self.offer, None
        if old is not None:
            self._drop_offer(old)
        for r in [x for x in self.regions.values() if x.uses == 0]:
            self._unmap(r)  # nothing will be handed in them again
        self.cond.notify_all()

    def _unwatch(self) -> None:
        if self.watched:
            self.watched = False
            loop().unregister(self.sock)

    def _drop_offer(self, offer: _Offer) -> None:
        self.let_go(offer.region, offer.number, "decline" if offer.offered else "release")

    def _tell(self, what: str, number: int, token: str | None = None) -> None:
        if self.closed or self.owner != os.getpid():
            return
        try:
            self.send([what, number] if token is None else [what, number, token])
        except OSError:
            pass  # the publisher is gone (it holds nothing for us any more), or not reading

    # -- taking (the caller's thread) -----------------------------------------------------------
    def take(self, after: int, deadline: float | None) -> _Offer | None:
        """The offer once it is newer than ``after`` (0: any; then, with none here, the
        publisher is asked for its newest again); None once the publisher serves no more
        (``failure`` says why) or the subscription was closed meanwhile. TimeoutError
        past ``deadline`` (``time.monotonic()``)."""
        asked = False
        with self.lock:
            while True:
                if not self.open:
                    return None
                if self.watched:
                    self.pump()  # what the publisher sent before this call is seen by it
                if self.error is not None:
                    error, self.error = self.error, None
                    raise error
                offer = self.offer
                # (an offer older than the publisher's newest waits for the newer one, on its way)
                published = self.counter.value if self.counter is not None else 0
                if offer is not None and offer.number >= published and (not after or offer.number > after):
                    self.offer = None
                    if offer.offered:
                        self._tell("took", offer.number)
                    return offer
                if self.failure is not None:
                    return None
                if not after and not asked and offer is None and self.newest and self.newest >= published:
                    asked = True  # the newest was taken already: a hold on it again
                    try:
                        self.send(["take", next(self.rids), 0])
                    except OSError as exc:
                        self._fail(self._lost_text(f" ({exc})"))
                        continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                # The runtime's thread wakes this wait when a version comes; the slice lets
                # the take receive it itself should that thread be held up.
                self.cond.wait(WAIT_SLICE_S if left is None else min(left, WAIT_SLICE_S))

    # -- regions and holds ------------------------------------------------------------------
    def region(self, rid: int, nbytes: int, fds: list[int], kind: Any = memory, parsed: Any = None) -> _Region:
        if parsed is not None:  # device memory: mapped per version, never cached (see its module)
            try:
                return _Region(rid, kind.map_region(fds, nbytes, parsed))
            finally:
                wire.close_fds(fds)
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

    def let_go(self, r: _Region, number: int, what: str = "release", streams: Any = ()) -> None:
        """A version held through this connection was let go (its record's release, or
        an offer never taken: ``what`` "decline"; ``streams``: those that used it, for
        device memory)."""
        with self.lock:
            self.holds -= 1
            r.uses -= 1
            if self.owner != os.getpid():
                return
            release = getattr(r.memory, "release", None)  # device memory: unmapped now, in stream order
            if release is None:
                self._tell(what, number)
                idle = [x for x in self.regions.values() if x.uses == 0]
                if not r.uses and (len(idle) > CACHED_REGIONS or not self.open):
                    self._unmap(r)
            else:
                token = None
                try:
                    token = release(streams)
                except Exception as exc:
                    _warn(f"releasing version {number} of the set {self.name!r} failed ({exc}); the publisher is "
                          "told without an event")
                self._tell(what, number, token)
            self._close_if_unused()

    def _unmap(self, r: _Region) -> None:
        self.regions.pop(r.id, None)
        r.memory.close()

    def _close_if_unused(self) -> None:
        if not self.open and not self.holds and not self.closed:
            self._unwatch()
            self.closed = True
            if self.counter is not None:
                self.counter.close()
                self.counter = None
            for r in list(self.regions.values()):
                self._unmap(r)
            self.sock.close()

    def finish(self) -> None:
        """The subscription is done with it: no more offers; it closes once nothing taken
        through it is held. Wakes a take waiting on it (which then returns None)."""
        with self.lock:
            if not self.open:
                return
            self.open = False
            if self.failure is None and not self.closed and self.following:
                try:
                    self.send(["unfollow", self.following])
                except OSError:
                    pass
            self.cond.notify_all()
            old, self.offer = self.offer, None
            if old is not None:
                self._drop_offer(old)
            for r in [x for x in self.regions.values() if x.uses == 0]:
                self._unmap(r)
            self._close_if_unused()

    def after_fork_in_child(self) -> None:
        # No lock taken: a thread of the parent's may have held it at the fork, and that
        # thread is not in the child. The child has only this thread now.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.open = False
        self.watched = False  # (the parent's runtime watched it; the child's has nothing)
        self.offer = None
        self.outbox.clear()
        if not self.closed:
            self.closed = True
            self.sock.close()
        if self.counter is not None:
            self.counter.close()
            self.counter = None


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
            self.conn.let_go(self.region, self.number, "release", streams)


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
    faults. Device memory: the tensors' flag only, docs/processes.md, sets on device memory).
    ``name``, ``version`` (its number). A ``with`` block or ``close()`` drops the
    snapshot's own hold; tensors taken from it keep their memory alive, as every
    tx.Tensor does, and the version with it. It stays valid after its Subscription is
    closed and after its publisher is gone. After ``close()`` its items raise
    LifetimeError."""

    def __init__(self, name: str, version: int, tensors: dict[str, Tensor]) -> None:
        self.name, self.version = name, version
        self._tensors: dict[str, Tensor] | None = tensors
        self._keys = tuple(tensors)

    def _closed_error(self) -> LifetimeError:
        return LifetimeError(f"this snapshot of {self.name!r} (version {self.version}) is closed")

    def __getitem__(self, key: str) -> Tensor:
        tensors = self._tensors  # (one call per item: a reader takes hundreds)
        if tensors is None:
            raise self._closed_error()
        return tensors[key]

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
        if timeout is not None and not timeout >= 0:  # (NaN too)
            raise ValueError(f"timeout is None or seconds >= 0, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                raise LifetimeError(f"this subscription to {self.name!r} is closed")
            conn = self._connection(deadline)
            try:
                offer = conn.take(after, deadline)
            except TimeoutError:
                raise TimeoutError(f"no {'new ' if after else ''}version of the set {self.name!r} within "
                                   f"{timeout} s (publisher: process {conn.publisher})") from None
            if offer is None:
                if conn.failure is None:  # close() ran meanwhile, on another thread
                    raise LifetimeError(f"this subscription to {self.name!r} was closed while it waited")
                self._conn = None  # unpublished or gone: the next call follows the name's next publisher
                conn.finish()
                raise LifetimeError(conn.failure)
            snap = self._snapshot(conn, offer)
            self._last = max(self._last, snap.version) if after else snap.version
            self._nbytes = offer.nbytes
            return snap

    def _connection(self, deadline: float | None) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        pause = RETRY_S[0]
        while True:
            found = _connect(self.name)
            if found is not None:
                self._conn = conn = _Connection(self.name, *found)
                conn.start()
                self._last = 0  # a new publisher numbers from 1
                return conn
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no publisher of the set {self.name!r} within the timeout")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, RETRY_S[1])

    def _snapshot(self, conn: _Connection, offer: _Offer) -> Snapshot:
        """The snapshot of ``offer``, taken: one record over its version (its release lets
        the version go here and at the publisher), a tensor per key."""
        number, region = offer.number, offer.region
        mem = region.memory
        # (host memory's mapping names none of these: host, no stream, sealed by the kernel)
        device, stream = getattr(mem, "device", CPU), getattr(mem, "stream", None)
        hold = _Hold(conn, region, number) if stream is None else _DeviceHold(conn, region, number)
        record = _REG.new_record(device, mem.address, max(offer.nbytes, 1),
                                 origin=f"set {self.name!r} version {number} of process {conn.publisher}",
                                 kind="imported", release=hold, owner=mem)
        tracing = sys.modules.get("exchange.tracing")  # loaded only once a trace was asked for
        trace = None if tracing is None else tracing.active()
        if trace is not None:
            hold.trace = (trace, trace.set_taken(self.name, number, offer.nbytes, conn.publisher))
        record.immutable = True  # the publisher never writes a version readers hold
        # Host: the kernel keeps it read-only here, so exports may go out as legacy
        # capsules. Device memory: read-only is the Tensor's flag alone (no exemption).
        record.sealed = getattr(mem, "sealed", True)
        if stream is None:
            tensors = dict(zip(offer.keys, _core.new_tensors(record, mem.address, offer.specs, True)))
        else:  # ordered on the mapping's stream, which waited for the publisher's writes
            tensors = {key: Tensor._make(record, mem.address + off, shape, strides, dt, True, stream)
                       for key, (off, shape, strides, dt) in zip(offer.keys, offer.specs)}
        if not tensors:
            _REG.discard(record)
            hold()
        return Snapshot(self.name, number, tensors)

    def close(self) -> None:
        """End the subscription (once). Snapshots and tensors taken stay valid; the
        connection closes once they are all gone. A take waiting on another thread
        raises LifetimeError at once (close() does not wait for it)."""
        self._closed = True
        conn = self._conn  # (not under the takes' lock: one may be waiting, holding it)
        if conn is not None:
            conn.finish()
        with self._lock:
            self._conn = None

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
                "readers": 0, "live_versions": (conn.holds - (conn.offer is not None)) if conn else 0,
                "publisher": conn.publisher if conn else 0}

    def __repr__(self) -> str:
        return f"tx.Subscription({self.name!r}, last version {self._last}{', closed' if self._closed else ''})"


def _register(sub: Subscription) -> None:
    from . import _state

    _state().subscriptions.add(sub)
