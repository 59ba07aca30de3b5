"""The publishing side of a set: its versions, their regions and the readers' holds.

Owns ``Publisher`` (one per set this process publishes: the name's lock, the listening
socket, the versions alive and the regions free for reuse), the public ``Version`` and
``Draft``. The socket and every reader's connection are served on the process
runtime's thread (``exchange.runtime.loop()``); ``publish`` and ``draft`` run on the
caller's thread. One lock (a condition) covers the state; sends never block (a reader
that does not read is dropped, its holds with it).

A version lives while it is the newest, while any reader holds it (a hold is counted
in the same step as the reply that hands the version out: no reuse can slip between;
a version handed to a reader's standing request is an offer, held all the same),
or while the publisher's own tensors over it live (a draft's). Then its region goes
back to the free list for the next version of a size it holds.

Device memory (the region's kind: exchange/sets/memory.py) is written on the region's
stream; ``commit`` has the region record what readers wait on, and a reader's release
token (its event) is handed to the region before the hold goes, so every later write
into the region, and its free, waits for that reader's work.
"""

from __future__ import annotations

import itertools
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Iterator

from .. import _core
from ..device import CPU
from ..dtypes import dtype as as_dtype
from ..errors import ExchangeError, LifetimeError
from ..registry import registry
from ..runtime import loop
from ..tensor import Tensor, copy_into, from_dlpack
from . import wire
from .memory import NewestCounter, Region, kind_for, plan, region_bytes
from .names import NameLock, check_name

_REG = registry()
#: Default bound on a set's live versions (the newest, those readers hold, drafts).
MAX_LIVE_VERSIONS = 8
#: Regions kept free for reuse, at most, beyond those in use.
FREE_REGIONS = 4
#: The environment setting for SPARE_IDLE_S (seconds, >= 0; read once, at import).
SPARE_IDLE_ENV = "EXCHANGE_SETS_SPARE_S"


def _spare_idle_s() -> float:
    text = os.environ.get(SPARE_IDLE_ENV, "")
    try:
        value = float(text) if text else 10.0
    except ValueError:
        value = -1.0
    if not value >= 0:  # (NaN too)
        from ..registry import _warn

        _warn(f"{SPARE_IDLE_ENV}={text!r} is not seconds >= 0: sets keep free regions 10 s")
        value = 10.0
    return value


#: Seconds a free region is kept for the next version (which then takes no fresh
#: pages) before it goes, in this process and in the readers' (an idle set holds only
#: its live versions' memory). 10 unless EXCHANGE_SETS_SPARE_S says otherwise: less
#: where memory is tight, more where versions come seldom and each must be fast.
SPARE_IDLE_S = _spare_idle_s()
#: Messages of each reader a publish acts on before choosing a region (the rest wait for
#: the runtime's thread: a flooding reader cannot hold a publish up).
DRAIN_AT_PUBLISH = 64
#: Takes one reader may have waiting for the next version (a subscription has one at a
#: time); past it the connection is dropped.
MAX_PENDING_TAKES = 16
#: Seconds the runtime's thread stops accepting readers after accept failed (no descriptor left).
ACCEPT_RETRY_S = 0.1
_WHEN_FULL = ("wait", "raise")
#: A forked child's copies of free device regions, set aside (as the registry does).
_FORK_KEPT: list = []


class _Conn:
    __slots__ = ("sock", "pid", "layout", "sent", "follow", "offered", "last_offered")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid = sock, pid
        self.layout = 0  # the layout id of the last version sent (its entries are not sent again)
        self.sent: set = set()  # what the regions sent this reader once (a device pool's descriptor)
        self.follow = 0  # the rid of the reader's standing request (0: it has none)
        self.offered = 0  # offers outstanding (neither taken nor declined)
        self.last_offered = 0  # the number of the newest version offered (or known to the reader)


class _Live:
    """A version as its publisher keeps it."""

    __slots__ = ("number", "region", "entries", "nbytes", "holds", "offers", "local", "layout")

    def __init__(self, number: int, region: Region, entries: list, nbytes: int, local: bool, layout: int) -> None:
        self.number, self.region, self.entries, self.nbytes, self.layout = number, region, entries, nbytes, layout
        self.holds: dict[_Conn, int] = {}  # every hold, offers included: none may be left for reuse
        self.offers: dict[_Conn, int] = {}  # holds handed to a reader's standing request, not yet taken
        self.local = local  # the publisher's own tensors over it live (a draft's)

    def taken(self) -> bool:
        """A reader took it (more holds than offers), or the publisher's own tensors live:
        it counts against the bound. Offers do not: a reader lets one go as soon as it
        hears of a newer version."""
        return self.local or any(n > self.offers.get(c, 0) for c, n in self.holds.items())


class Publisher:
    """One set this process publishes. ExchangeError when another live process of this
    user publishes the name."""

    def __init__(self, name: str, max_live_versions: int) -> None:
        self.name = name
        self.max_live = max_live_versions
        self.pid = os.getpid()
        self.cond = threading.Condition(threading.RLock())
        self.versions: dict[int, _Live] = {}
        self.current: _Live | None = None
        self.numbers = itertools.count(1)
        self.region_ids = itertools.count(1)
        self.free: list[Region] = []
        self.freed_at: dict[int, float] = {}  # region id -> when it went free (time.monotonic())
        self.trim_due = False  # a _trim is scheduled on the runtime's thread
        self.reserved = 0  # drafts made, not yet published or dropped
        self.conns: dict[socket.socket, _Conn] = {}
        self.pending: list[tuple[_Conn, int, int]] = []  # direct takes waiting: (reader, rid, after)
        self.last_entries: list | None = None  # the entries of the newest layout, and its id
        self.layout_id = 0
        self.unpublished = False
        self.device: Any = None  # the set's memory, fixed by its first publish or draft
        self.kind: Any = None  # its module (exchange.sets.memory.kind_for)
        self.lock = NameLock(name)
        try:
            self.counter = NewestCounter.create()
        except BaseException:
            self.lock.close()
            raise
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            path = self.lock.socket_path
            try:
                os.unlink(path)  # a dead publisher's (the lock is ours now)
            except FileNotFoundError:
                pass
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(64)
            loop().register(sock, selectors.EVENT_READ, self._accept)
        except BaseException:
            sock.close()
            self.counter.close()
            self.lock.close()
            raise
        self.sock = sock

    # -- the runtime's thread ---------------------------------------------------------------
    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors (or closed): stop watching for a moment, else the
                # listening socket, still readable, would spin the runtime's thread.
                loop().unregister(sock)
                if not self.unpublished:
                    loop().call_at(time.monotonic() + ACCEPT_RETRY_S, self._watch_again)
                return
            try:
                pid, uid = wire.peer(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():  # (the directory keeps others out; the kernel's word again here)
                conn.close()
                continue
            conn.setblocking(False)
            with self.cond:
                c = self.conns[conn] = _Conn(conn, pid)
                self._send(c, ["counter", self.counter.value], self.counter.fd)  # before any version
            if conn in self.conns:
                loop().register(conn, selectors.EVENT_READ, self._readable)

    def _watch_again(self) -> None:
        with self.cond:
            if not self.unpublished:
                loop().register(self.sock, selectors.EVENT_READ, self._accept)

    def _readable(self, sock: socket.socket) -> None:
        c = self.conns.get(sock)
        if c is None:
            loop().unregister(sock)
            return
        with self.cond:
            self._drain(c)

    def _drain(self, c: _Conn, most: int | None = None) -> None:
        """Receive and act on what reader ``c`` sent (``most`` messages at most), never
        waiting. Under the lock, so a reader's messages are acted on in their order
        whichever thread reads them (the runtime's, or a publish's: ``reserve``)."""
        while c.sock in self.conns and (most is None or most > 0):
            if most is not None:
                most -= 1
            try:
                message, fds = wire.receive(c.sock)
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError):
                self._drop(c)
                return
            wire.close_fds(fds)  # a reader sends none
            if message is None:
                self._drop(c)  # the reader closed or died: its holds go
                return
            try:
                m = wire.check_request(message)
            except ValueError:
                self._drop(c)
                return
            if m[0] in ("take", "follow"):
                self._take(c, m[1], m[2], m[0] == "follow")
            elif m[0] == "unfollow":
                c.follow = 0
            elif m[0] == "took":
                self._took(c, m[1])
            else:
                self._release(c, m[1], m[0] == "decline", m[2] if len(m) == 3 else None)

    def _take(self, c: _Conn, rid: int, after: int, follow: bool) -> None:
        with self.cond:
            if self.unpublished:
                self._send(c, ["gone", rid, self._unpublished_text()])
            elif follow:
                c.follow, c.last_offered = rid, max(c.last_offered, after)
                self._offer_to(c)
            elif self.current is not None and self.current.number > after:
                self._hand(c, rid, self.current, False)
            elif sum(p[0] is c for p in self.pending) >= MAX_PENDING_TAKES:
                self._drop(c)  # (a subscription has one take waiting at a time: this one floods)
            else:
                self.pending.append((c, rid, after))

    def _unpublished_text(self) -> str:
        return f"the set {self.name!r} was unpublished by its publisher, process {self.pid}"

    def _offer_to(self, c: _Conn) -> None:
        """Offer the newest version to reader ``c`` if it follows, has not had it, and has
        fewer than two offers outstanding (the one it keeps, and the one before while it
        lets that go): a reader that does not read is never handed more."""
        cur = self.current
        if c.follow and c.offered < 2 and cur is not None and cur.number > c.last_offered:
            c.offered += 1
            c.last_offered = cur.number
            self._hand(c, c.follow, cur, True)

    def _hand(self, c: _Conn, rid: int, v: _Live, offer: bool) -> None:
        # The hold first, then the reply: from this step on the region is the reader's too.
        v.holds[c] = v.holds.get(c, 0) + 1
        if offer:
            v.offers[c] = v.offers.get(c, 0) + 1
        # A version of the layout the reader got last comes without its entries (the
        # reader's checked copy serves): a reader's take costs no JSON of 256 entries.
        entries = None if c.layout == v.layout else v.entries
        c.layout = v.layout
        part, fd = v.region.part(c.sent)
        message = ["version", rid, v.number, v.region.id, v.region.nbytes, v.nbytes, v.layout, entries]
        self._send(c, message if part is None else [*message, part], fd)

    def _send(self, c: _Conn, message: list, fd: int = -1) -> None:
        try:
            wire.send(c.sock, message, fd, socket.MSG_DONTWAIT)
        except OSError:  # gone, or not reading: dropped, holds and all
            self._drop(c)

    def _took(self, c: _Conn, number: int) -> None:
        with self.cond:
            v = self.versions.get(number)
            if v is not None and _count_down(v.offers, c):
                c.offered -= 1
                self._offer_to(c)

    def _release(self, c: _Conn, number: int, offer: bool, token: str | None) -> None:
        with self.cond:
            v = self.versions.get(number)
            if v is None or not v.holds.get(c) or (offer and not v.offers.get(c)):
                return
            if token is not None:  # device memory: later work on the region waits for the reader's
                v.region.released(token, c.pid)
            _count_down(v.holds, c)
            if offer:
                _count_down(v.offers, c)
                c.offered -= 1
            self._retire(v)
            if offer:
                self._offer_to(c)

    def _drop(self, c: _Conn) -> None:
        loop().unregister(c.sock)
        with self.cond:
            if self.conns.pop(c.sock, None) is None:
                return
            self.pending = [p for p in self.pending if p[0] is not c]
            for v in list(self.versions.values()):
                v.offers.pop(c, None)
                if v.holds.pop(c, None):
                    self._retire(v)
        try:
            c.sock.close()
        except OSError:
            pass

    def _retire(self, v: _Live) -> None:
        # Under the lock: the version goes when nothing keeps it; its region is reused.
        if v is self.current or v.holds or v.local or self.versions.get(v.number) is not v:
            return
        del self.versions[v.number]
        self._put_back(v.region)
        self.cond.notify_all()

    def _put_back(self, region: Region) -> None:
        if self.unpublished or len(self.free) >= FREE_REGIONS:
            self._close_region(region)
        else:
            self.free.append(region)
            self.freed_at[region.id] = time.monotonic()
            if not self.trim_due:  # one timer at a time (each would wake the runtime's thread)
                self.trim_due = True
                loop().call_at(time.monotonic() + SPARE_IDLE_S, self._trim)

    def _close_region(self, region: Region) -> None:
        # Readers may keep a mapping of it (a region they no longer hold): told to let
        # it go, so that its memory goes back to the kernel.
        region.close()
        for c in list(self.conns.values()):
            self._send(c, ["drop", region.id])

    def _trim(self) -> None:
        """(The runtime's thread.) Close the free regions unused for SPARE_IDLE_S."""
        with self.cond:
            self.trim_due = False
            now = time.monotonic()
            for r in [r for r in self.free if now - self.freed_at.get(r.id, now) >= SPARE_IDLE_S - 0.01]:
                self.free.remove(r)
                self.freed_at.pop(r.id, None)
                self._close_region(r)
            if self.free and not self.unpublished:  # the rest when their time comes
                self.trim_due = True
                first = min(self.freed_at.get(r.id, now) for r in self.free)
                loop().call_at(first + SPARE_IDLE_S, self._trim)

    # -- the caller's thread ----------------------------------------------------------------
    def _live_count(self) -> int:
        # The newest, untaken, goes at the next publish; versions only offered go once
        # their readers hear of a newer one: neither counts.
        return sum(v.taken() for v in self.versions.values()) + self.reserved

    def reserve(self, nbytes: int, when_full: str, timeout: float | None, device: Any = CPU) -> Region:
        """A region of ``device`` memory for the next version (counted as live until
        published or dropped); waits or raises, as ``when_full`` says, while the set is at
        its bound. BufferError when the set's memory is another device's (its first
        publish or draft chose it) or sets cannot hold ``device`` memory."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            if self.device is None:
                self.kind, self.device = kind_for(device), device
            elif device != self.device:
                raise BufferError(f"the set {self.name!r} is in {self.device} memory, not {device}: publish tensors "
                                  f"of {self.device}, or unpublish it first")
            while True:
                self._check_open()
                # What readers let go before this publish counts now, not when the
                # runtime's thread comes to it: no fresh region for a version let go.
                for c in list(self.conns.values()):
                    self._drain(c, DRAIN_AT_PUBLISH)
                if self._live_count() < self.max_live:
                    break
                holders = sorted({c.pid for v in self.versions.values() for c, n in v.holds.items()
                                  if n > v.offers.get(c, 0)})
                full = (f"the set {self.name!r} has {self._live_count()} live versions, its bound "
                        f"(max_live_versions={self.max_live}); readers holding old ones: pids {holders}")
                if when_full == "raise":
                    raise ExchangeError(full + "; let them close their snapshots, or pass when_full='wait'")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(full + f"; waited {timeout} s")
                self.cond.wait(left)
            need = region_bytes(nbytes)
            fits = [r for r in self.free if r.nbytes >= need]
            region = min(fits, key=lambda r: r.nbytes) if fits else None
            if region is not None:
                self.free.remove(region)
                self.freed_at.pop(region.id, None)
            self.reserved += 1
        if region is None:
            try:
                region = self.kind.Region(next(self.region_ids), need, device)
            except BaseException:
                self.unreserve(None)
                raise
        return region

    def unreserve(self, region: Region | None) -> None:
        with self.cond:
            self.reserved -= 1
            if region is not None:
                self._put_back(region)
            self.cond.notify_all()

    def commit(self, region: Region, entries: list, nbytes: int, local: bool, streams: list | tuple = ()) -> _Live:
        """Make the reserved ``region`` the newest version and hand it to the readers
        waiting for one; device memory orders the readers after the work on ``streams``
        (the streams a draft's tensors were written on) and on the region's stream."""
        region.written(streams)
        with self.cond:
            if self.unpublished:  # (the caller gives the region back once nothing maps it here)
                raise self._gone_error()
            self.reserved -= 1
            if entries != self.last_entries:
                self.last_entries, self.layout_id = entries, self.layout_id + 1
            v = _Live(next(self.numbers), region, entries, nbytes, local, self.layout_id)
            self.versions[v.number] = v
            old, self.current = self.current, v
            self.counter.set(v.number)
            if old is not None:
                self._retire(old)
            waiting, self.pending = self.pending, []
            for c, rid, _ in waiting:
                if c.sock in self.conns:
                    self._hand(c, rid, v, False)
            for c in list(self.conns.values()):
                self._offer_to(c)
            return v

    def local_done(self, v: _Live) -> None:
        with self.cond:
            v.local = False
            self._retire(v)

    def readers(self, number: int) -> list[int]:
        with self.cond:
            v = self.versions.get(number)
            return sorted({c.pid for c in v.holds}) if v is not None else []

    def _gone_error(self) -> LifetimeError:
        return LifetimeError(f"the set {self.name!r} was unpublished by this process ({self.pid})")

    def _check_open(self) -> None:
        if self.unpublished:
            raise self._gone_error()

    def unpublish(self) -> None:
        """No new readers; the versions readers hold live until they let go."""
        with self.cond:
            if self.unpublished:
                return
            self.unpublished = True
            loop().unregister(self.sock)
            self.sock.close()
            self.lock.close()  # the socket file goes, then the name is free
            told = [(c, rid) for c, rid, _ in self.pending] + [(c, c.follow) for c in self.conns.values() if c.follow]
            for c, rid in told:
                self._send(c, ["gone", rid, self._unpublished_text()])
            self.pending = []
            old, self.current = self.current, None
            if old is not None:
                self._retire(old)
            for r in self.free:
                r.close()
            self.free = []
            self.counter.close()  # (readers keep their own mappings of it)
            self.cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self.cond:
            cur = self.current
            return {"name": self.name, "role": "publisher", "version": cur.number if cur else 0,
                    "nbytes": cur.nbytes if cur else 0,
                    "readers": len({c.pid for c in self.conns.values()}),
                    "live_versions": len(self.versions), "max_live_versions": self.max_live,
                    "live_bytes": sum(v.nbytes for v in self.versions.values()),
                    "regions": len({v.region.id for v in self.versions.values()}) + len(self.free)}

    def after_fork_in_child(self) -> None:
        # The child is no publisher: its copies of the descriptors go, nothing is unlinked
        # or told (the parent's lock, socket and readers stay the parent's).
        self.unpublished = True
        self.lock.forget()
        self.counter.close()  # this process's mapping and descriptor only
        for s in [self.sock, *self.conns]:
            try:
                s.close()
            except OSError:
                pass
        if any(r.stream is not None for r in self.free):
            _FORK_KEPT.append(self.free)  # device memory: never freed by a forked child (a device API cannot run in a forked child)
        self.conns, self.pending, self.free = {}, [], []


class Version:
    """A published version of a set, as its publisher sees it: ``name``, ``number`` (1,
    2, ...), ``nbytes`` (bytes of its tensors), ``keys()``, and ``readers``: the pids of
    the processes holding it now (their snapshots or tensors taken from them, or the
    version handed to their subscription and not taken yet, which a subscription lets
    go once a newer one reaches it; this process's own subscriptions included)."""

    __slots__ = ("name", "number", "nbytes", "_entries", "_publisher")

    def __init__(self, publisher: Publisher, live: _Live) -> None:
        self.name, self.number, self.nbytes = publisher.name, live.number, live.nbytes
        self._entries = live.entries  # (its keys made when asked: a publish need not pay for them)
        self._publisher = publisher

    def keys(self) -> tuple[str, ...]:
        return tuple(e[0] for e in self._entries)

    @property
    def readers(self) -> list[int]:
        return self._publisher.readers(self.number)

    def __repr__(self) -> str:
        return f"tx.Version({self.name!r}, number={self.number}, nbytes={self.nbytes}, keys={len(self._entries)})"


class _DraftState:
    """What a draft's record release needs: its region, and its version once published."""

    __slots__ = ("publisher", "region", "live", "published")

    def __init__(self, publisher: Publisher, region: Region) -> None:
        self.publisher, self.region = publisher, region
        self.live: _Live | None = None
        self.published = False

    def released(self) -> None:
        # The last of the draft's tensors went: its version may go (or, unpublished, its
        # region goes back).
        with self.publisher.cond:
            if self.live is not None:
                self.publisher.local_done(self.live)
            else:
                self.publisher.unreserve(self.region)


class Draft(Mapping):
    """The next version of a set, being written: a Mapping of writable tx.Tensors laid
    out in that version's region (``tx.draft``). ``publish()`` makes it the newest
    version without a copy.

    Once published, the tensors belong to the version: each becomes read-only
    (``readonly`` True; exports carry READ_ONLY), so nothing the library hands out from
    them writes. Views a framework already took (``torch.from_dlpack(draft["w"])``, a
    NumPy array) stay writable: the library cannot reach them. Writing through one
    after ``publish()`` changes the version readers are reading (a torn read): drop such
    views before publishing. The region is reused only once every reader and every one
    of these tensors has let go. A draft dropped unpublished gives its region back."""

    def __init__(self, publisher: Publisher, region: Region, entries: list, nbytes: int) -> None:
        self._publisher, self._entries, self._nbytes = publisher, entries, nbytes
        self._state = state = _DraftState(publisher, region)
        # The record's release holds the state, never the draft (the draft holds the
        # tensors, which hold the record: a Tensor is not seen by the cycle collector).
        self._record = record = _REG.new_record(region.device, region.address, max(nbytes, 1),
                                                origin=f"tx.draft ({publisher.name!r})", kind="allocated",
                                                release=state.released)
        # Device memory: the tensors are ordered on the region's stream, which waited for
        # the readers of the region's last version; a consumer's stream waits for it.
        self._tensors = {key: Tensor._make(record, region.address + off, tuple(shape), wire_strides(shape),
                                           as_dtype(dt), False, region.stream)
                         for key, dt, shape, off in entries}
        if not self._tensors:
            _REG.discard(record)
            state.released()

    @property
    def _published(self) -> bool:
        return self._state.published

    def __getitem__(self, key: str) -> Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def publish(self) -> Version:
        """Publish the draft as the set's next version (no copy). LifetimeError if the set
        was unpublished, ExchangeError if the draft was published already."""
        state = self._state
        with self._publisher.cond:
            if state.published:
                raise ExchangeError(f"this draft of {self._publisher.name!r} is published already")
            # (LifetimeError here: unpublished; the region goes back when the tensors go)
            state.live = live = self._publisher.commit(state.region, self._entries, self._nbytes, local=True,
                                                       streams=self._record.streams)
            state.published = True
            for t in self._tensors.values():
                t._readonly = True
        _trace_publish(self._publisher, live, copied=False)
        return Version(self._publisher, live)

    def __repr__(self) -> str:
        state = "published" if self._published else "unpublished"
        return f"tx.Draft({self._publisher.name!r}, {len(self._tensors)} tensors, {self._nbytes} bytes, {state})"


def _count_down(counts: dict, key: Any) -> bool:
    """One less of ``key`` in ``counts`` (gone at 0); False when it had none."""
    n = counts.get(key, 0)
    if not n:
        return False
    if n == 1:
        del counts[key]
    else:
        counts[key] = n - 1
    return True


def wire_strides(shape: list[int]) -> tuple[int, ...]:
    from ..layout import row_major_strides

    return row_major_strides(tuple(shape))


def copy_in(publisher: Publisher, tensors: Mapping, when_full: str, timeout: float | None) -> _Live:
    """Copy ``tensors`` (str -> DLPack producers, all on one device) into a region of
    that device's memory and publish. Host memory is copied on the host; device memory
    on the region's stream, after the tensors' streams (no host wait)."""
    items = []
    device = None
    for key, value in tensors.items():
        t = value if isinstance(value, Tensor) else from_dlpack(value)
        device = device or t.device
        if t.device != device:
            raise BufferError(f"tensor {key!r} is on {t.device}, another is on {device}; a set's tensors are all "
                              "on one device")
        items.append((key, t))
    device = device or CPU
    entries, nbytes = plan([(k, t.shape, t.dtype) for k, t in items])
    region = publisher.reserve(nbytes, when_full, timeout, device)
    record = None
    token = 0
    try:
        record, token = _REG.new_held_record(device, region.address, max(nbytes, 1),
                                             f"tx.publish ({publisher.name!r})", "allocated", None, None, None,
                                             "tx.publish (copying)")
        for (key, t), (_, _, shape, off) in zip(items, entries):
            if t.nbytes:
                if region.stream is not None:  # device memory: in stream order (_copy_on_stream)
                    _copy_on_stream(record, region, off, t, shape)
                    continue
                t._host_ready()
                _copy(record, region.address + off, t, shape)
    except BaseException:
        publisher.unreserve(region)
        raise
    finally:
        if token:
            _REG.remove_holder(record, token)
    try:
        live = publisher.commit(region, entries, nbytes, local=False)
        _trace_publish(publisher, live, copied=True)
        return live
    except LifetimeError:
        publisher.unreserve(region)  # unpublished meanwhile: nothing maps it here now
        raise


def _copy(record: Any, address: int, t: Tensor, shape: list[int]) -> None:
    """Copy host tensor ``t`` to ``address`` of the region of ``record`` (row-major).
    A contiguous one goes in one streaming copy: readers in other processes read the
    version, not this core's cache, and ordinary stores would read every destination
    line into the cache first (256 tensors of 4 MiB: 1.6 times one memcpy of 1 GiB)."""
    if t.is_contiguous():
        _core.copy_streaming(address, t.data_ptr, t.nbytes)
        return
    dst = Tensor._make(record, address, t.shape, wire_strides(shape), t.dtype, False)
    copy_into(dst, t)


def _copy_on_stream(record: Any, region: Region, offset: int, t: Tensor, shape: list[int]) -> None:
    """Copy device tensor ``t`` to ``offset`` bytes into device ``region`` (of ``record``),
    on the region's stream after the tensor's own (record-then-wait: the host never
    waits)."""
    dst = Tensor._make(record, region.address + offset, t.shape, wire_strides(shape), t.dtype, False, region.stream)
    copy_into(dst, t, region.stream)


def _trace_publish(publisher: Publisher, live: _Live, copied: bool) -> None:
    """Tell the trace being recorded, if any, of a publish (exchange/tracing.py; that
    module is loaded only once a trace was asked for)."""
    tracing = sys.modules.get("exchange.tracing")
    trace = None if tracing is None else tracing.active()
    if trace is not None:
        trace.set_published(publisher.name, live.number, live.nbytes, len(live.entries), copied)
