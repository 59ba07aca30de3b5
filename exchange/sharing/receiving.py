"""The receiving side of sharing: memory of other processes, mapped here.

Owns: the connections to senders (``Client``: one per sending process, kept open, its
packets in order, its requests and their replies, the fences the sender sends unasked),
the mappings made here (``Mapping``: one release per mapping, told to its sender; an
``Attempt``: one attach, undone whole if it fails), and the senders' arenas mapped here
(``ArenaMapping``, and the hand-offs taken from them without asking). A pidfd per
sender tells when it dies (``Connections.sender_died``). How a connection is made and
its peer proven to be the sender is peers.py's; how each kind of memory is mapped, its
memory channel's (exchange/channels/).
"""

from __future__ import annotations

import collections
import itertools
import os
import selectors
import socket
import threading
import time
import weakref
from typing import Any

from ..device import CPU
from ..dtypes import dtype as as_dtype
from ..errors import DeviceError, ExchangeError, LifetimeError
from ..registry import LIVE, Record, registry
from ..runtime import SHARING, Lazy, register
from ..tensor import Tensor
from . import protocol
from .loop import loop
from .peers import connect, peer_pidfd, same_sender, sender_exited, verify
from .protocol import PEERCRED, HandleFields, close_fds, out_of_fds

_REG = registry()


def view(record: Record, f: HandleFields, stream: Any = None, readonly: bool = False) -> Tensor:
    """A Tensor over ``record`` with the handle's layout, read-only when the handle or
    ``readonly`` says so (``Tensor._make`` adds the holder: LifetimeError if the record
    is no longer live). ValueError when the handle claims more bytes than ``record``
    holds (its layout lies inside what it claims: ``protocol.check_fields``): a forged
    handle over memory this process already maps, or its sender's own."""
    if f.span > record.nbytes:
        raise ValueError(f"not a valid tx.ShareHandle (it claims {f.span} shared bytes, the memory it names holds "
                         f"{record.nbytes}): truncated, corrupted or forged; make a new one with tx.share(tensor) "
                         "in the sending process")
    t = Tensor._make(record, record.address + f.offset, f.shape, f.strides, as_dtype(f.dtype),
                     f.readonly or readonly, stream)
    if stream is not None:
        _REG.add_stream(record, stream)  # the release waits for the work queued there
    if record._views is not None:  # attached CUDA memory: closed if the sender dies
        record._views.append(weakref.ref(t))
    return t


#: Seconds an arena of a sender stays mapped here, at least, after the last record over
#: it went (the next hand-off from it then needs no round trip); checked that often, so
#: at most twice as long.
ARENA_IDLE_S = 5.0


class ArenaMapping:
    """One arena of a sender, mapped here once (writable when the kernel lets it: not
    for an arena sealed read-only). ``uses``: the owners of records over its blocks
    (weak: a use no record took, in an interrupted attach, goes with its last
    reference); with none for ``ARENA_IDLE_S``, it is unmapped, or at once when its
    sender has gone."""

    __slots__ = ("client", "id", "memory", "uses", "idle_since")

    def __init__(self, client: "Client", aid: int, memory: Any) -> None:
        self.client, self.id, self.memory = client, aid, memory
        self.uses: weakref.WeakSet = weakref.WeakSet()
        self.idle_since = time.monotonic()

    def done(self, use: "ArenaUse") -> None:
        with self.client.send_lock:
            self.uses.discard(use)
            if self.uses:
                return
            self.idle_since = time.monotonic()
            dead = self.client.dead
        if dead:  # (else the client's idle watch unmaps it)
            self.client.unmap_arena(self)


class ArenaUse:
    """The owner of a record over one block of a mapped arena: ``close()`` (once, or
    when it is collected) lets the arena go when nothing else here uses it. Shared
    onward as a copy (``readonly`` and ``writable`` say what the mapping allows)."""

    __slots__ = ("arena", "_calls", "__weakref__")

    def __init__(self, arena: ArenaMapping) -> None:
        self.arena = arena
        self._calls = itertools.count()

    @property
    def writable(self) -> bool:
        return self.arena.memory.writable

    @property
    def readonly(self) -> bool:
        return self.arena.memory.readonly

    def close(self) -> None:
        if next(self._calls) == 0:
            self.arena.done(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Attempt:
    """One attach on a connection, as a ``with`` block: what it was given so far (the
    request id, descriptors, the mapping, the local record), undone as a whole if the
    block raises, whatever it raises (KeyboardInterrupt included) and wherever. The
    undo is idempotent on both sides: the local mapping is released once (by its
    record, or here when no record took it), and the sender is told ``abandon``: it
    gives the handle its lease back, so attaching again works, and drops the hold it
    counted for this request unless a view made here still holds the mapping (a view
    the exception's traceback keeps: its release will drop the hold, after the unmap).
    A release names its mapping, so no release, sent twice or late, can take another
    mapping's hold."""

    __slots__ = ("client", "entry", "rid", "fds", "reused", "mapping", "record", "done")

    def __init__(self, client: "Client", entry: int) -> None:
        self.client = client
        self.entry = entry
        self.rid = 0  # set by Client.request before the request goes out
        self.fds: list[int] | None = []
        self.reused: Tensor | None = None
        self.mapping: Mapping | None = None
        self.record: Record | None = None
        self.done = False

    def __enter__(self) -> "Attempt":
        return self

    def succeed(self, tensor: Tensor) -> Tensor:
        close_fds(self.fds or [])
        self.fds = []
        self.done = True
        return tensor

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if kind is not None and not self.done:
            self.undo()
        return False

    def undo(self) -> None:
        close_fds(self.fds or [])
        self.fds = []
        record = self.record
        if record is not None and not record._holder_items() and record.state == LIVE:
            _REG.discard(record)  # no view took it: nothing here can reach the memory
            record = None
        kept = record is not None and record.state == LIVE  # a view holds it: its release tells the sender
        unmap = record is None and self.mapping is not None and self.mapping.memory is not None
        if self.rid:  # first: the lease comes back before the release below can free the memory
            self.client.notify(["abandon", self.rid, kept or unmap])
        if unmap:
            self.mapping.rid = self.rid  # (0: the request never went out, and counted nothing)
            self.mapping.release()


#: What a sender sends: the least length of each kind ([kind, id, packets handled, ...]).
_REPLY_LENGTHS = {"ok": 4, "err": 5, "fence": 4}
#: Releases (and local takes) go to their sender together: at most this many in a
#: packet, and at most RELEASE_DELAY_S seconds after the first of them.
RELEASE_BATCH = 256
RELEASE_DELAY_S = 0.002


class Mapping:
    """The release of one mapping made here: unmap, then tell the sender, naming the
    mapping (``rid``, the id of the attach request that made it). Runs once, however
    often it is called."""

    __slots__ = ("client", "entry", "rid", "key", "memory", "record", "_calls")

    def __init__(self, client: "Client", entry: int, rid: int, key: tuple | None, memory: Any) -> None:
        self.client = client
        self.entry = entry
        self.rid = rid
        self.key = key  # (entry, writable): where Client.mappings finds it
        self.memory = memory  # what the memory channel mapped (closed by release; a subclass per channel may differ)
        self.record: Any = None  # weakref to the local record, once made (CUDA)
        self._calls = itertools.count()

    def first_call(self) -> bool:
        return next(self._calls) == 0  # one atomic step: two threads never both see 0

    def release(self) -> None:
        if not self.first_call():
            return
        if self.key is not None:
            self.client.forget(self.key)
        self.memory.close()
        if self.rid:  # (0: never counted by the sender, nothing to tell)
            self.client.post_batched(["release", self.entry, self.rid, []])


class Client:
    """This process's connection to one sending process.

    Every packet goes out in order through ``_send`` and gets a sequence number; a packet
    that finds the socket full waits, in order, for the loop's thread to send it when
    the socket has room (a deleter never blocks on the sender). Requests (attach, sync)
    then wait for their reply under ``lock``, until a deadline; a reply says how many
    packets the sender has handled, which tells which release events it has opened (they
    must live until then). What the sender sends unasked (a fence of ``drop_leases``)
    is read by the request waiting then, else by the loop's thread (``_read_unasked``)."""

    def __init__(self, conns: "Connections", f: HandleFields, deadline: float) -> None:
        self.conns = conns
        self.address = f.address
        self.sock: socket.socket | None = None
        self.pid = 0  # as this process sees it (PID namespaces may differ from the handle's)
        self.identity = (f.pid, f.start)  # as the handles of this sender say it
        self.pidfd = -1  # watched for the sender's death (Connections._watch); -1 without pidfds
        self.lock = threading.Lock()  # one request at a time
        # Numbering and order of packets. Re-entrant: any allocation inside one of its
        # sections can start the cycle collector, which may release a mapping here (a
        # deleter: post_batched, ArenaMapping.done) on the same thread.
        self.send_lock = threading.RLock()
        self.sending = 0  # the thread whose _send is writing packets (under send_lock): a post it makes meanwhile waits for the next flush
        self.last = 0  # the number the last packet _send is writing will have
        self.sent = 0
        self.backlog: collections.deque[bytes] = collections.deque()
        self.ids = itertools.count(1)
        self.dead = False
        self.mappings: dict[tuple, Any] = {}  # (entry, writable) -> weakref to the local record
        self.arenas: dict[int, ArenaMapping] = {}  # the sender's arenas mapped here
        self.releases: list[list] = []  # releases (and takes) waiting to go out together (post_batched)
        self.requests = 0  # requests sent (attach, sync): a local take sends none
        # The highest nonce of a hand-off whose lease the sender may have dropped
        # (drop_leases): none at or below it is taken here without asking (take_local).
        self.watermark = 0
        self.watched = 0  # the selector events the loop's thread watches the socket for (_watch)
        self.idle_watch = False  # watch_idle is scheduled
        self.cuda_records: weakref.WeakSet = weakref.WeakSet()  # closed if the sender dies
        self.unconfirmed: list[tuple[int, Any]] = []  # (packet number, IPC event) of releases not yet handled
        self.sync_posted = False
        try:  # everything opened is opened in here, and closed if anything fails
            try:
                self.sock = connect(f.address, deadline)
            except LifetimeError as exc:
                exc.pid = f.pid  # type: ignore[attr-defined]  (the process that made the handle)
                raise
            self.pid, uid, _ = PEERCRED.unpack(self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                    PEERCRED.size))
            self.pidfd = peer_pidfd(self.sock, self.pid, f)
            verify(f, self.pid, uid, self.pidfd)  # before anything is sent
            self.sock.settimeout(protocol.settings.request_timeout)  # non-blocking descriptor, for _send
        except BaseException:
            if self.sock is not None:
                self.sock.close()
            close_fds([self.pidfd] if self.pidfd >= 0 else [])
            self.pidfd = -1
            raise

    # -- mappings this process holds
    def reuse(self, key: tuple, f: HandleFields, stream: Any = None) -> Tensor | None:
        """A new view over the live local record for ``key``, or None to map anew."""
        ref = self.mappings.get(key)
        record = ref() if ref is not None else None
        if record is None or record.state != LIVE:
            return None
        try:
            return view(record, f, stream, readonly=not key[1])
        except LifetimeError:  # released meanwhile on another thread
            return None

    def remember(self, key: tuple, record: Record) -> None:
        # ``key``: (entry, the mapping is writable)
        self.mappings[key] = weakref.ref(record)
        if record._views is not None:
            self.cuda_records.add(record)

    def forget(self, key: tuple) -> None:
        ref = self.mappings.get(key)
        if ref is not None and (ref() is None or ref().state != LIVE):
            self.mappings.pop(key, None)

    # -- arenas
    def use_arena(self, f: HandleFields, fds: list[int] | None = None) -> "ArenaUse | None":
        """What a record over the block of handle ``f`` owns: a use of the sender's arena
        ``f.arena`` mapped here (mapped first from its descriptor, taken from ``fds``:
        writable unless sealed against writes). None when it is not mapped and no
        descriptor came. ValueError when the block lies outside the arena (a forged or
        corrupted handle); OSError as ``SharedMemory.from_fd``."""
        memory = None
        if fds:
            from exchange.channels.memfd import SharedMemory

            memory = SharedMemory.from_fd(fds, 0, writable=True)
        watch = False
        try:
            with self.send_lock:
                arena = self.arenas.get(f.arena)
                if arena is None and memory is not None and not self.dead:
                    arena = self.arenas[f.arena] = ArenaMapping(self, f.arena, memory)
                    memory = None
                    watch, self.idle_watch = not self.idle_watch, True
                if arena is None:
                    return None
                if f.base + f.span > arena.memory.nbytes:
                    raise ValueError(f"not a valid tx.ShareHandle (its memory, {f.span} bytes at {f.base}, lies "
                                     f"outside the {arena.memory.nbytes}-byte arena it names): truncated, corrupted "
                                     "or forged; make a new one with tx.share(tensor) in the sending process")
                use = ArenaUse(arena)
                arena.uses.add(use)  # under the lock that the idle watch unmaps under
        finally:
            if memory is not None:
                memory.close()  # (another thread mapped it meanwhile)
        if watch:
            self.conns.loop.call_at(time.monotonic() + ARENA_IDLE_S, self.watch_idle)
        return use

    def take_local(self, f: HandleFields) -> Tensor | None:
        """Attach a handle made to be attached once, from an arena mapped here, without
        a round trip; None when the arena is not mapped here, or the handle's lease may
        have been dropped (ask the sender then: only it can tell).

        The sender keeps the block (the handle's lease) until it reads this process's
        ``take``, which goes out with the next batch (``post_batched``: within
        ``RELEASE_DELAY_S``); the take makes this process a holder in the lease's place,
        and this process's release of the block goes after it on the same connection.
        Only ``drop_leases`` in the sender ends such a lease otherwise, and only after
        this process has answered its fence (``_fenced``): the takes posted before the
        answer go out ahead of it, and none at or below the fence's watermark is made
        after it (checked under ``send_lock``, with the post; an attach that maps an
        arena learns the watermark first). So the sender never frees the block while
        this process may use it. If this process dies after the take went out, the
        sender drops its holds when the connection closes; if it dies before, the lease
        stays until ``tx.drop_leases`` or the sender's exit, as for a handle that never
        arrived. A take that matches no lease because another take ended it first (the
        same pickle attached twice: multiprocessing never does) counts nothing at the
        sender: the block may be reused under the second Tensor."""
        reused = self.reuse((f.entry, not f.readonly), f)
        if reused is not None:  # a live record here holds the block already: the lease just ends
            self.post_batched(["close", f.entry, f.secret.hex(), f.nonce])
            return reused
        if f.nonce <= self.watermark:  # (checked again with the take's post)
            return None
        use = self.use_arena(f)
        if use is None:
            return None
        record = None
        try:
            tid = next(self.ids)
            mapping = Mapping(self, f.entry, tid, None, use)
            writable = not f.readonly and use.writable
            mapping.key = key = (f.entry, writable)
            record = _REG.new_record(CPU, use.arena.memory.address + f.base, f.span,
                                     origin=f"process {self.pid} (tx.attach)", kind="imported",
                                     release=mapping.release, owner=use)
            if not self.post_batched(["take", tid, f.entry, f.secret.hex(), f.nonce], f.nonce):
                _REG.discard(record)  # a fence came between: nothing was told, nothing to release
                use.close()
                return None
            self.remember(key, record)
            return view(record, f, readonly=not writable)
        except BaseException:
            if record is None:
                use.close()
            elif not record._holder_items() and record.state == LIVE:
                _REG.discard(record)
            raise

    def watch_idle(self) -> None:
        # On the loop's thread, every ARENA_IDLE_S while arenas are mapped (one timer per
        # sender, whatever the traffic): unmap those nothing here has used for as long.
        now = time.monotonic()
        with self.send_lock:
            for arena in self.arenas.values():
                if arena.uses:
                    arena.idle_since = now
            idle = [a for a in self.arenas.values() if now - a.idle_since >= ARENA_IDLE_S]
        for arena in idle:
            self.unmap_arena(arena)
        with self.send_lock:
            self.idle_watch = bool(self.arenas) and not self.dead
            again = self.idle_watch
        if again:
            self.conns.loop.call_at(now + ARENA_IDLE_S, self.watch_idle)

    def unmap_arena(self, arena: ArenaMapping) -> None:
        """Unmap ``arena`` if nothing here uses it (once)."""
        with self.send_lock:
            if arena.uses or self.arenas.get(arena.id) is not arena:
                return
            del self.arenas[arena.id]
        arena.memory.close()

    def post_batched(self, message: list, take: int = 0) -> bool:
        """A release or a take, sent with others, in order: at once when
        ``RELEASE_BATCH`` are waiting, else within ``RELEASE_DELAY_S`` (by the loop's
        thread), and before any other packet. Never blocks (a deleter calls it).
        ``take``: the nonce of the hand-off a take ends, posted only if it is above the
        watermark (see ``take_local``). False when nothing was posted (that, or the
        sender has gone)."""
        with self.send_lock:
            if self.dead or (take and take <= self.watermark):
                return False
            self.releases.append(message)
            n = len(self.releases)
            nested = self.sending == threading.get_ident()  # (a collection inside _send on this thread: packets stay in order)
        if n >= RELEASE_BATCH and not nested:
            self.flush_batched()
        elif n == 1 or nested:
            self.conns.loop.call_at(time.monotonic() + RELEASE_DELAY_S, self.flush_batched)
        return True

    def learn_watermark(self, watermark: int) -> None:
        """The sender may have dropped the leases of hand-offs up to nonce
        ``watermark``: take none of them without asking from now on."""
        with self.send_lock:
            if watermark > self.watermark:
                self.watermark = watermark

    def _fenced(self, fid: int, watermark: int) -> None:
        # The sender's fence `fid` (drop_leases): it ends the leases of hand-offs up to
        # `watermark` once it has the answer. The takes posted before go out first (in
        # order, by _send), and none of those is taken here after (post_batched checks).
        self.learn_watermark(watermark)
        self._send(["fenced", fid])

    def flush_batched(self) -> None:
        """Send what ``post_batched`` holds now (taken and sent under one lock, so two
        flushes never reorder: a take always reaches the sender before its release)."""
        self._send(None)

    # -- packets
    def _send(self, message: list | None) -> int:
        """Send one packet in order, never blocking, after the releases and takes posted
        before it (``post_batched``; ``message`` None: only those); returns the number of
        the last packet sent (0: the sender is gone). The releases go in packets of at
        most ``RELEASE_BATCH`` (a packet holds at most ``protocol.MAX_MESSAGE`` bytes).
        Re-entered on this thread (a release the cycle collector ran inside it), it
        queues ``message`` for the loop's next flush and returns the number its packet
        will have at most: packets never go out of order."""
        with self.send_lock:
            if self.dead:
                return 0
            if self.sending == threading.get_ident():
                if message is not None:
                    self.releases.append(message)
                self.conns.loop.call_at(time.monotonic(), self.flush_batched)
                return self.last + -(-len(self.releases) // RELEASE_BATCH)
            # (A thread id, not a flag: an interrupt that left it set makes this thread's
            # next send go by the loop's flush, which writes it and clears it.)
            self.sending = threading.get_ident()
            try:
                seq, failed, first = self._write(message)
            finally:
                self.sending = 0
        if failed:
            self.conns.sender_died(self)
            return 0
        if first:
            self.conns.loop.post(self._watch_writable)
        return seq

    def _write(self, message: list | None) -> tuple[int, bool, bool]:
        # (_send, under send_lock.) The packets, written or queued in the backlog: the
        # last one's number, whether the socket failed, whether the backlog was started.
        failed = first = False
        ops, self.releases = self.releases, []
        packets = [["batch", ops[i:i + RELEASE_BATCH]] for i in range(0, len(ops), RELEASE_BATCH)]
        if message is not None:
            packets.append(message)
        self.last = self.sent + len(packets)
        for packet in packets:
            data = protocol.encode(packet)
            self.sent += 1
            if not self.backlog:
                try:
                    os.write(self.sock.fileno(), data)
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    failed = True
                    break
            self.backlog.append(data)
            first = first or len(self.backlog) == 1
        return self.sent, failed, first

    def _watch(self) -> None:
        # (Under send_lock.) Have the loop's thread watch the socket for what the sender
        # sends unasked, unless a request holds `lock` (it reads the socket itself: its
        # reply then wakes no other thread), and for room while a backlog waits. Called
        # again whenever that changes (never by the loop's thread while it holds `lock`).
        events = 0
        if not self.dead:
            events = ((0 if self.lock.locked() else selectors.EVENT_READ)
                      | (selectors.EVENT_WRITE if self.backlog else 0))
        if events == self.watched:
            return
        loop = self.conns.loop
        try:
            if not events:
                loop.unregister(self.sock)
            elif self.watched:
                loop.modify(self.sock, events, self._ready)
            else:
                loop.register(self.sock, events, self._ready)
            self.watched = events
        except (KeyError, ValueError, OSError):  # closed meanwhile
            loop.unregister(self.sock)
            self.watched = 0

    def _ready(self, _sock: Any) -> None:
        # On the loop's thread: the socket has room, or something to read.
        if self.backlog:
            self._flush()
        self._read_unasked()

    def _watch_writable(self) -> None:
        # On the loop's thread: flush the backlog whenever the socket has room. Never a
        # blocking wait there: a stopped sender must not delay anything else.
        with self.send_lock:
            self._watch()
        self._flush()

    def _flush(self) -> None:
        # On the loop's thread: send the backlog in order while the socket takes it.
        failed = False
        with self.send_lock:
            while not self.dead and self.backlog:
                try:
                    os.write(self.sock.fileno(), self.backlog[0])
                    self.backlog.popleft()
                except BlockingIOError:
                    return  # the loop calls again when there is room
                except OSError:
                    self.backlog.clear()
                    failed = True
                    break
            self._watch()
        if failed:
            self.conns.sender_died(self)

    def _read_unasked(self) -> None:
        # On the loop's thread, while no request reads the socket: what the sender sent
        # unasked (a fence), or too late (the answer to a request that gave up). Never a
        # wait: the socket is read without blocking.
        if not self.lock.acquire(blocking=False):
            return  # a request has the socket: it reads what comes
        gone = False
        try:
            while not self.dead:
                try:
                    self.sock.settimeout(0.0)  # (a request sets its own wait)
                    data, fds, _, _ = socket.recv_fds(self.sock, protocol.MAX_MESSAGE, 4, protocol.CLOEXEC)
                except (BlockingIOError, InterruptedError, socket.timeout):
                    break
                except OSError:
                    data, fds = b"", []
                close_fds(fds)
                if not data:
                    gone = True  # the sender closed the connection, or died
                    break
                self._unasked(data)
        finally:
            self.lock.release()
        if gone:
            self.conns.sender_died(self)

    def _unasked(self, data: bytes) -> None:
        # A packet no request waits for: a fence is answered, a late reply tells how many
        # packets the sender has handled; anything else is ignored.
        try:
            message = protocol.decode(data)
        except ValueError:
            return
        if not (isinstance(message, list) and len(message) >= 4 and type(message[1]) is int
                and type(message[2]) is int):
            return
        if message[0] == "fence" and type(message[3]) is int:
            self._fenced(message[1], message[3])
        elif message[0] in ("ok", "err"):
            self._confirm(message[2])

    def notify(self, message: list) -> None:
        """One packet that needs no answer (release, close, opened)."""
        self._send(message)

    def request(self, message: list, deadline: float, attempt: Attempt | None = None) -> tuple[list, list[int] | None]:
        """Send ``[op, *args]`` with a request id and wait for its reply
        ``[status, id, handled, *payload]`` until ``deadline`` (``time.monotonic()``);
        an "ok" payload starts with whether the memory is read-only. ``attempt`` learns
        the request id before the request goes out (it undoes the request if anything
        fails, here or later).
        Raises the error the sender answered, LifetimeError when the sender has gone,
        ExchangeError when it does not answer in time or answers nonsense, OSError
        (out_of_fds) when a descriptor it sent did not fit in this process. The
        descriptors received are returned, owned by ``attempt``.

        One request at a time per connection: waiting for ``lock`` is bounded by the
        deadline of the request holding it (a ``with`` block, so that no interrupt can
        leave the lock taken). A fence the sender sends meanwhile is answered here:
        the loop's thread reads the socket only while no request holds ``lock``."""
        try:
            with self.lock:
                with self.send_lock:
                    self._watch()  # not for reading while the lock is held
                return self._request(message, deadline, attempt)
        finally:
            with self.send_lock:
                self._watch()  # (what comes after the reply is the loop's thread's to read)

    def _request(self, message: list, deadline: float, attempt: Attempt | None) -> tuple[list, list[int] | None]:
        # (Under self.lock.)
        if time.monotonic() >= deadline:
            raise ExchangeError(f"process {self.pid} did not answer within "
                                f"{protocol.settings.request_timeout:g} s (stopped or busy: another request to "
                                "it was still waiting); try again")
        rid = next(self.ids)
        self.requests += 1
        if attempt is not None:
            attempt.rid = rid
        if not self._send([message[0], rid, *message[1:]]):
            raise sender_exited(self.pid)
        fds: list[int] = []  # descriptors received and not handed on: closed on the way out
        try:
            return self._reply(rid, deadline, attempt, fds)
        except socket.timeout:
            # The sender may still handle the request later (it is stopped, or busy):
            # the attempt has it undo what it would do then (count a mapping, end the lease).
            raise ExchangeError(f"process {self.pid} did not answer within {protocol.settings.request_timeout:g} s "
                                "(stopped or busy); try again") from None
        except OSError as exc:
            if getattr(exc, "tx_out_of_fds", False):
                raise
            self.conns.sender_died(self)
            raise sender_exited(self.pid, f" ({exc})") from None
        finally:
            close_fds(fds)

    def _reply(self, rid: int, deadline: float, attempt: Attempt | None, fds: list[int]) -> tuple[list, list[int] | None]:
        # The wait for reply `rid` (under self.lock). Received descriptors go into `fds`
        # at once (the caller closes what is left there) and leave it only for `attempt`.
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout
            self.sock.settimeout(left)
            data, fds[:], flags, _ = socket.recv_fds(self.sock, protocol.MAX_MESSAGE, 4, protocol.CLOEXEC)
            if not data:
                raise ConnectionResetError("connection closed")
            try:
                reply = protocol.decode(data)
                ok = (isinstance(reply, list) and len(reply) >= 3 and type(reply[1]) is int
                      and type(reply[2]) is int and len(reply) >= _REPLY_LENGTHS.get(reply[0], 1 << 30))
            except (ValueError, TypeError):  # (TypeError: a kind that is no key, say a list)
                ok = False
            if not ok or (reply[0] == "fence" and type(reply[3]) is not int):
                raise ExchangeError(f"process {self.pid} sent a malformed reply (not a tensor-exchange "
                                    f"sender of protocol {protocol.PROTOCOL}?): {bytes(data[:80])!r}")
            if reply[0] == "fence":  # unasked: answered at once
                close_fds(fds)
                fds.clear()
                self._fenced(reply[1], reply[3])
                continue
            if reply[1] == rid:
                break
            close_fds(fds)  # the late answer to a request that timed out (and was abandoned)
            fds.clear()
        self._confirm(reply[2])
        if reply[0] != "ok":
            code, text = reply[3], reply[4]
            error = {"released": LifetimeError, "forged": ValueError}.get(code, DeviceError)
            raise error(f"process {self.pid} refused: {text}")
        if flags & socket.MSG_CTRUNC:
            # The kernel had no descriptor free for what the sender sent: nothing kept
            # (the attempt undoes the request), try again later.
            raise out_of_fds("tx.attach (receiving the memory's descriptor)")
        if attempt is None:
            return reply, []
        fds[:], attempt.fds = [], list(fds)  # the attempt owns them now (never both: no double close)
        return reply, attempt.fds

    # -- CUDA release events
    def release_with_event(self, entry: int, rid: int, event: Any, handle: bytes) -> None:
        # The event must live until the sender has opened it, which a later reply shows.
        seq = self._send(["release", entry, rid, [handle.hex()]])
        if not seq:
            return
        with self.send_lock:
            self.unconfirmed.append((seq, event))
            start = not self.sync_posted
            self.sync_posted = True
        if start:  # a request waits: never on the loop's thread, which serves everyone
            threading.Thread(target=self._sync, name="tx-share-sync", daemon=True).start()

    def _confirm(self, handled: int) -> None:
        with self.send_lock:
            if self.unconfirmed:
                self.unconfirmed = [(s, e) for s, e in self.unconfirmed if s > handled]

    def _sync(self) -> None:
        self.sync_posted = False
        if self.unconfirmed and not self.dead:
            try:
                self.request(["sync"], time.monotonic() + protocol.settings.request_timeout)
            except Exception:
                pass

    def close(self) -> None:
        """Close the connection and the pidfd (once; later packets are dropped)."""
        with self.send_lock:
            self.dead = True
            self.backlog.clear()
            self.unconfirmed.clear()
            self.releases = []
            self.conns.loop.unregister(self.sock)
            self.watched = 0
            pidfd, self.pidfd = self.pidfd, -1
            idle = [a for a in self.arenas.values() if not a.uses]
        for arena in idle:  # the others go with the last record over them (ArenaMapping.done)
            self.unmap_arena(arena)
        if pidfd >= 0:
            self.conns.loop.unregister(pidfd)
            close_fds([pidfd])
        try:
            self.sock.close()
        except OSError:
            pass


class Connections:
    """This process's connections to senders, one per sender's address."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # held only for moments: never across a connect or a request
        self.loop = loop()
        self.clients: dict[bytes, Client] = {}
        self.gates: dict[bytes, threading.Lock] = {}  # one connect at a time per sender

    def client(self, f: HandleFields, deadline: float) -> Client:
        """The connection to the sender of handle ``f``, made (and its peer verified) on
        first use by one thread while others wanting the same sender wait for it (until
        ``deadline``, a ``time.monotonic()``); attaches to other senders are not held up."""
        address = f.address
        client = self.clients.get(address)
        if client is not None and not client.dead:
            return same_sender(client, f)
        with self.lock:
            gate = self.gates.setdefault(address, threading.Lock())
        # One connect at a time per sender: the wait is bounded by the connecting thread's
        # deadline (a ``with`` block: no interrupt can leave the gate taken).
        with gate:
            if time.monotonic() >= deadline:
                raise ExchangeError(f"the connection to the process that shared this memory was not made within "
                                    f"{protocol.settings.request_timeout:g} s (stopped, or its backlog is full); "
                                    "try again")
            client = self.clients.get(address)
            if client is not None and not client.dead:
                return same_sender(client, f)
            client = None
            try:
                client = Client(self, f, deadline)
                self.loop.start()
                self._watch(client)
                with self.lock:
                    self.clients[address] = client
                return client
            except BaseException:
                if client is not None and self.clients.get(address) is not client:
                    client.close()
                raise

    def _watch(self, client: Client) -> None:
        # Its pidfd tells when the sender dies (its CUDA memory is then closed here);
        # without pidfds (old kernels) the next message notices instead, or the
        # connection's end, which the loop's thread reads as it reads what the sender
        # sends unasked (fences).
        with client.send_lock:
            client._watch()
        if client.pidfd >= 0:
            self.loop.register(client.pidfd, selectors.EVENT_READ, lambda _fd, c=client: self.sender_died(c))

    def sender_died(self, client: Client) -> None:
        """The sender of ``client`` has gone: close the connection; views of its CUDA
        memory are closed (their next use raises LifetimeError). CPU memory stays mapped."""
        with self.lock:
            if self.clients.get(client.address) is client:
                del self.clients[client.address]
                self.gates.pop(client.address, None)
        first = not client.dead
        client.close()
        if not first:
            return
        reason = (f"process {client.pid}, which shared this CUDA memory, has exited: the memory may be freed, "
                  "so this tensor cannot be used any more")
        for record in list(client.cuda_records):
            record.closed_reason = reason
            for v in [r() for r in list(record._views or ())]:
                if v is not None:
                    v._closed = True

    def after_fork_in_child(self) -> None:
        # Connections to senders: the parent's. Mark them dead with new locks (a parent's
        # thread may have held theirs at the fork), so a release of memory the child
        # inherited unmaps here and says nothing to the sender; close the child's copies
        # of their sockets and pidfds.
        for client in self.clients.values():
            client.lock, client.send_lock = threading.Lock(), threading.RLock()
            client.dead = True
            client.backlog.clear()
            client.unconfirmed.clear()
            try:
                client.sock.close()
            except OSError:
                pass
            if client.pidfd >= 0:
                close_fds([client.pidfd])


_CONNECTIONS: Lazy[Connections] = Lazy(Connections, "sharing.connections", SHARING + 20)


def connections() -> Connections:
    """This process's Connections (made on first use)."""
    return _CONNECTIONS.get()


def _flush_at_exit() -> None:
    # Takes and releases still waiting for their batch go out before the interpreter
    # exits (the sender would otherwise keep a lease for each take lost here).
    current = _CONNECTIONS.peek()
    if current is None:
        return
    for client in list(current.clients.values()):
        try:
            client.flush_batched()
        except Exception:
            pass


# At a normal exit and at the end of a multiprocessing child (exchange/runtime.py).
register("at_exit", "sharing.flush", _flush_at_exit, SHARING + 20)
