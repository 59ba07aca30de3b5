"""The serving side of sharing: this process's memory, offered to other processes.

Owns: the server socket (``SOCK_SEQPACKET`` in Linux's abstract namespace: no file to
leave behind), the shared memory entries (one per record shared, with its secret and
the leases of its handles in transit), the receivers connected (``Peer``: what each one
holds, counted as one holder ``process <pid>`` per record), and the answers to their
requests, and the fences ``drop_leases`` waits for. Which memory travels, and how, is
its memory channel's (exchange/channels/: what a handle carries of it, the descriptors
and events an attach is answered with, the waits on a receiver's release). Runs on the
loop's thread (loop.py), except ``new_handle``, ``drop_lease(s)`` and ``attach_local``,
which the public calls run.
"""

from __future__ import annotations

import collections
import errno
import hmac
import itertools
import os
import secrets
import selectors
import socket
import threading
import time
import weakref
from typing import Any

from ..channels import MemoryChannel, channel_for
from ..errors import LifetimeError
from ..registry import LIVE, Record, registry
from ..runtime import SHARING, Lazy
from ..tensor import Tensor
from . import protocol
from .loop import loop
from .protocol import FD_ERRNOS, PEERCRED, HandleFields, close_fds
from .receiving import view

_REG = registry()


class Entry:
    """One piece of shared memory of this process: its record (weakly: the entry goes
    with it), its secret, its memory channel and the leases of its handles in transit.
    ``readonly``: what this process decided from its own memory (memory sealed against
    writes), never from a handle; attaches are answered accordingly."""

    __slots__ = ("id", "secret", "leases", "readonly", "channel", "record")

    def __init__(self, eid: int, readonly: bool, channel: MemoryChannel, record: Any) -> None:
        self.id = eid
        self.secret = secrets.token_bytes(16)
        # handle nonce -> (holder token, time.monotonic() made, a receiver may take it without asking)
        self.leases: dict[int, tuple[int, float, bool]] = {}
        self.readonly = readonly
        self.channel = channel
        self.record = record  # weakref to the record

    def live(self) -> Record | None:
        """The entry's record while it is live, else None."""
        record = self.record()
        return record if record is not None and record.state == LIVE else None


#: How many recent attaches of a receiver an ``abandon`` can still undo (a receiver
#: abandons an attach right after it failed; other threads' attaches may come between).
RECENT_ATTACHES = 1024


class Fence:
    """What one ``drop_leases`` waits for: the receivers mapping an arena of this
    process that have not answered its fence yet; ``done`` is set when none is left."""

    __slots__ = ("id", "waiting", "done")

    def __init__(self, fid: int) -> None:
        self.id = fid
        self.waiting: set[Peer] = set()
        self.done = threading.Event()

    def answered(self, peer: "Peer") -> None:
        self.waiting.discard(peer)
        if not self.waiting:
            self.done.set()


class Peer:
    """A receiving process connected to this one (the server side of a connection)."""

    __slots__ = ("sock", "pid", "held", "events", "handled", "recent", "bytes", "mappings", "arenas", "fences")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        # entry id -> [ids of the mappings it holds (the attach requests that made them),
        # holder token, record]: one holder per process, released with its last mapping.
        self.held: dict[int, list] = {}
        # Kept with ``held`` (on the server's thread), so that inspection reads them in
        # O(1): the bytes of the records held, and the mappings (attaches) open.
        self.bytes = 0
        self.mappings = 0
        # attach request id -> (entry id, it made a mapping, nonce of the lease it ended):
        # what ``abandon`` undoes (the most recent RECENT_ATTACHES).
        self.recent: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.events: dict[int, Any] = {}  # request id -> IPC event sent with the reply, until "opened"
        self.handled = 0  # packets handled, told in every reply
        self.arenas = False  # it was sent an arena's descriptor: it may take hand-offs without asking
        self.fences: dict[int, Fence] = {}  # fence id -> the drop_leases waiting for its answer


class Server:
    """This process's server socket, its entries and the receivers connected to it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.loop = loop()
        self.address: bytes | None = None
        self.sock: socket.socket | None = None
        self.peers: dict[int, Peer] = {}
        self.entries: dict[int, Entry] = {}  # entry id -> the entry (dropped when its record goes)
        self.by_record: weakref.WeakKeyDictionary[Record, Entry] = weakref.WeakKeyDictionary()
        self.ids = itertools.count(1)
        self.nonces = itertools.count(1)
        self.refused_takes = 0  # takes that matched no lease (stats)
        # The highest nonce of a hand-off lease drop_leases may have ended: told to the
        # receivers that map an arena (fences, and every CPU attach's answer), which take
        # no hand-off at or below it without asking.
        self.watermark = 0
        self.fence_ids = itertools.count(1)

    def ensure(self) -> bytes:
        """The server's address; the server is made and watched on first use."""
        with self.lock:
            if self.sock is None:
                self.loop.start()
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                address = protocol.ADDRESS_PREFIX + f"{os.getpid()}/{secrets.token_hex(8)}".encode()
                sock.bind(address)
                sock.listen(64)
                sock.setblocking(False)
                self.loop.register(sock, selectors.EVENT_READ, self._accept)
                self.sock, self.address = sock, address
            return self.address

    # -- connections
    def _accept(self, server: socket.socket) -> None:
        try:
            sock, _ = server.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in FD_ERRNOS + (errno.ENOBUFS, errno.ENOMEM):
                # No descriptor for the connection: it waits in the backlog. Stop watching
                # the server for a moment; watching it now would wake this thread at once,
                # again and again (a busy loop) until a descriptor is free.
                self.loop.unregister(server)
                self.loop.call_at(time.monotonic() + protocol.ACCEPT_RETRY_S, self._watch_again)
            return
        try:
            pid, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.getuid() and uid != 0:
            sock.close()  # another user's process: nothing of ours for it
            return
        sock.setblocking(False)  # replies wait at most settings.reply_timeout (_reply)
        peer = Peer(sock, pid)
        self.peers[sock.fileno()] = peer
        self.loop.register(sock, selectors.EVENT_READ, lambda _s, peer=peer: self._serve(peer))

    def _watch_again(self) -> None:
        if self.sock is not None:
            self.loop.register(self.sock, selectors.EVENT_READ, self._accept)

    def _serve(self, peer: Peer) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(peer.sock, protocol.MAX_MESSAGE, 4, protocol.CLOEXEC)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            data, fds = b"", []
        close_fds(fds)  # receivers send no descriptors
        if not data:
            self._drop_peer(peer)  # the receiver closed the connection, or died
            return
        peer.handled += 1
        try:
            message = protocol.decode(data)
            if message[0] == "batch":  # releases (and takes) a receiver sent together, in order
                for one in message[1][:protocol.MAX_BATCH]:
                    self._handle(peer, one)
            else:
                self._handle(peer, message)
        except (ValueError, TypeError, IndexError, KeyError, OverflowError):  # (int(1e400): OverflowError)
            self._drop_peer(peer)  # not one of ours: no more conversation

    def _handle(self, peer: Peer, message: list) -> None:
        op = message[0]
        if op == "attach":
            rid, entry_id, secret, nonce, mapping, want_pool, readonly, want_fd = message[1:9]
            self._on_attach(peer, int(rid), int(entry_id), bytes.fromhex(secret), int(nonce), bool(mapping),
                            bool(want_pool), bool(readonly), bool(want_fd))
        elif op == "take":
            self._on_take(peer, int(message[1]), int(message[2]), bytes.fromhex(message[3]), int(message[4]))
        elif op == "release":
            self._on_release(peer, int(message[1]), int(message[2]), [bytes.fromhex(h) for h in message[3]])
        elif op == "close":
            self.drop_lease(int(message[1]), bytes.fromhex(message[2]), int(message[3]))
        elif op == "opened":
            peer.events.pop(int(message[1]), None)
        elif op == "abandon":
            self._on_abandon(peer, int(message[1]), bool(message[2]))
        elif op == "sync":
            self._reply(peer, ["ok", int(message[1]), None])
        elif op == "fenced":
            fence = peer.fences.pop(int(message[1]), None)
            if fence is not None:
                fence.answered(peer)
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _reply(self, peer: Peer, message: list, fds: tuple[int, ...] = ()) -> None:
        message.insert(2, peer.handled)  # [status, request id, packets handled, ...]
        try:
            peer.sock.settimeout(protocol.settings.reply_timeout)  # read now: a change applies at once
            socket.send_fds(peer.sock, [protocol.encode(message)], list(fds))
        except OSError:
            self._drop_peer(peer)

    # -- requests
    def _on_attach(self, peer: Peer, rid: int, entry_id: int, secret: bytes, nonce: int,
                   mapping: bool, want_pool: bool, readonly: bool, want_fd: bool) -> None:
        entry = self.entries.get(entry_id)
        record = entry.live() if entry is not None else None
        if record is None:
            self._reply(peer, ["err", rid, "released",
                               f"no shared memory #{entry_id} is live: it was released (or the handle is forged)"])
            return
        if not hmac.compare_digest(secret, entry.secret):
            self._reply(peer, ["err", rid, "forged", f"the handle's secret does not match shared memory #{entry_id}: "
                                                     "it is forged or corrupted"])
            return
        if entry.readonly and not readonly:
            self._reply(peer, ["err", rid, "forged", f"shared memory #{entry_id} is read-only and the handle says it "
                                                     "is writable: it is forged or corrupted"])
            return
        try:
            if mapping:  # the receiver maps it anew: one more mapping of this process, named by rid
                self._hold(peer, entry_id, rid, record)
        except LifetimeError:
            self._reply(peer, ["err", rid, "released", f"shared memory #{entry_id} is being released"])
            return
        lease = self._end_lease(entry_id, entry.secret, nonce)  # the first attach ends the lease
        reply: list = ["ok", rid, entry.readonly]  # the receiver maps read-only when told so
        channel = entry.channel
        try:
            served = channel.serve_attach(record, mapping, want_pool, want_fd)
        except Exception as exc:
            if mapping:
                self._on_release(peer, entry_id, rid, [])
            self._reply(peer, ["err", rid, channel.kind, f"could not share the {channel.label} memory: {exc}"])
            return
        reply += served.reply
        fds = served.fds
        if served.keep is not None:
            peer.events[rid] = served.keep  # until the receiver says it opened the answer
        peer.arenas = peer.arenas or served.arena  # fenced by drop_leases from now on
        if channel.arenas:
            reply.append(self.watermark)  # before it maps an arena, the receiver knows what not to take
        peer.recent[rid] = (entry_id, mapping, (nonce, lease[2]) if lease else None)  # undone if abandoned
        if len(peer.recent) > RECENT_ATTACHES:
            peer.recent.popitem(last=False)
        self._reply(peer, reply, fds)

    def _on_take(self, peer: Peer, tid: int, entry_id: int, secret: bytes, nonce: int) -> None:
        # A receiver that maps the arena has attached a handle made to be attached once
        # (multiprocessing's reducer) without asking: its hold (``tid``) replaces the
        # handle's lease, which kept the block until now (drop_leases ends such a lease
        # only after this receiver has sent the takes it made: see _start_fence).
        # Nothing is answered. A take that does not match a lease (forged, or the same
        # pickle attached twice) counts nothing, and its release changes nothing.
        entry = self.entries.get(entry_id)
        record = entry.live() if entry is not None else None
        if record is None:
            return
        if not hmac.compare_digest(secret, entry.secret) or nonce not in entry.leases:
            self.refused_takes += 1
            return
        try:
            self._hold(peer, entry_id, tid, record)
        except LifetimeError:
            return
        self.drop_lease(entry_id, entry.secret, nonce)

    @staticmethod
    def _hold(peer: Peer, entry_id: int, mid: int, record: Record) -> None:
        # Mapping (or take) `mid` of the receiver holds the record: the receiver is one
        # holder of it however many it has. LifetimeError if the record is being released.
        held = peer.held.get(entry_id)
        if held is None:
            peer.held[entry_id] = [{mid}, _REG.add_remote_holder(record, peer.pid), record]
            peer.bytes += record.nbytes
            peer.mappings += 1
        elif mid not in held[0]:
            held[0].add(mid)
            peer.mappings += 1

    def _on_abandon(self, peer: Peer, rid: int, kept: bool) -> None:
        # The receiver's attach `rid` failed, or it gave up waiting for the answer (this
        # process was stopped or busy). Undo it, once: the lease it ended (the handle keeps
        # its lease, for a retry) and the mapping it counted, unless the receiver `kept`
        # it (a view there still holds it; its release comes when that view goes). An
        # abandon of a request not handled (yet) does nothing.
        peer.events.pop(rid, None)
        attach = peer.recent.pop(rid, None)
        if attach is None:
            return
        entry_id, mapping, lease = attach
        held = peer.held.get(entry_id)
        entry = self.entries.get(entry_id)
        record = held[2] if held is not None else (entry.live() if entry is not None else None)
        if lease is not None and entry is not None and record is not None and record.state == LIVE:
            nonce, once = lease
            try:
                entry.leases[nonce] = (_REG.add_lease(record, nonce), time.monotonic(), once)
            except LifetimeError:
                pass
        if mapping and not kept:
            self._on_release(peer, entry_id, rid, [])

    def _on_release(self, peer: Peer, entry_id: int, rid: int, events: list[bytes]) -> None:
        # Mapping `rid` of entry `entry_id` is gone in the receiver: drop it (once; a
        # mapping not held, released already or never made, changes nothing).
        held = peer.held.get(entry_id)
        if held is None or rid not in held[0]:
            return
        record = held[2]
        if events:
            entry = self.entries.get(entry_id)
            channel = entry.channel if entry is not None else channel_for(record.device.type)
            if channel is not None:
                channel.released(record, events, peer.pid)
        held[0].discard(rid)
        peer.mappings -= 1
        if not held[0]:
            del peer.held[entry_id]
            peer.bytes -= record.nbytes
            _REG.remove_remote_holder(record, held[1])

    def _drop_peer(self, peer: Peer) -> None:
        if self.peers.pop(peer.sock.fileno(), None) is None:
            return
        self.loop.unregister(peer.sock)
        peer.sock.close()
        held, peer.held = peer.held, {}
        peer.bytes = peer.mappings = 0
        peer.events.clear()
        fences, peer.fences = peer.fences, {}
        for fence in fences.values():  # it takes nothing any more
            fence.answered(peer)
        for _, token, record in held.values():
            _REG.remove_remote_holder(record, token)

    # -- handles (called by the public calls)
    def new_handle(self, tensor: Tensor, readonly: bool, channel: MemoryChannel, once: bool = False) -> HandleFields:
        """The fields of a new handle to ``tensor`` (memory ``channel`` shares as it is:
        a read-only tensor's is sealed where the channel seals), with its lease. The
        handle says read-only when the tensor is, or its memory (whatever ``readonly``
        says)."""
        address = self.ensure()
        record = tensor._record
        entry = self.by_record.get(record)
        if entry is None:
            with self.lock:
                entry = self.by_record.get(record)
                if entry is None:
                    eid = next(self.ids)
                    ref = weakref.ref(record, lambda _r, eid=eid: self.entries.pop(eid, None))
                    entry = Entry(eid, channel.sealed(record), channel, ref)
                    self.entries[eid] = self.by_record[record] = entry
        readonly = readonly or entry.readonly
        nonce = next(self.nonces)
        part, arena, base = channel.export(record, tensor)
        once = once and arena != 0  # taken without asking where its arena is mapped
        entry.leases[nonce] = (_REG.add_lease(record, nonce), time.monotonic(), once)
        return HandleFields(protocol.PROTOCOL, protocol.boot_id(), os.getpid(), protocol.own_start(), address,
                            entry.id, entry.secret, nonce,
                            channel.kind, str(record.device), tensor._dtype.name, tensor._shape, tensor._strides,
                            tensor._data_ptr - record.address, record.nbytes, readonly, part, arena, base, once)

    def drop_lease(self, entry_id: int, secret: bytes, nonce: int) -> bool:
        """End the lease of handle ``nonce``; True if it still had one."""
        return self._end_lease(entry_id, secret, nonce) is not None

    def _end_lease(self, entry_id: int, secret: bytes, nonce: int) -> tuple | None:
        # The lease ended (its entry in Entry.leases), or None when it had none.
        entry = self.entries.get(entry_id)
        record = entry.record() if entry is not None else None
        if record is None or not hmac.compare_digest(secret, entry.secret):
            return None
        lease = entry.leases.pop(nonce, None)
        if lease is not None:
            _REG.remove_lease(record, lease[0])
        return lease

    def drop_leases(self, older_than: float) -> int:
        """End every lease of this process's handles in transit made at least
        ``older_than`` seconds ago; returns how many.

        A multiprocessing hand-off (a lease a receiver may take without asking, its take
        reaching this process up to ``RELEASE_DELAY_S`` later) ends only after every
        receiver that maps an arena of this process has answered a fence (``_fence``):
        by then it has sent the takes it made, and it takes none of these any more
        without asking (this process then answers LifetimeError). If one of them does not
        answer within ``settings.request_timeout`` (stopped), none of those leases ends:
        they stay in transit for a later call. Other leases end at once."""
        now = time.monotonic()
        plain: list[tuple] = []
        once: list[tuple] = []
        for entry in list(self.entries.values()):
            for nonce, (_, made, taken) in list(entry.leases.items()):
                if now - made >= older_than:
                    (once if taken else plain).append((entry.id, entry.secret, nonce))
        dropped = sum(self.drop_lease(*lease) for lease in plain)
        if once and self._fence(max(nonce for _, _, nonce in once)):
            dropped += sum(self.drop_lease(*lease) for lease in once)
        return dropped

    def _fence(self, watermark: int) -> bool:
        """Tell every receiver that maps an arena of this process that hand-offs up to
        nonce ``watermark`` may lose their lease, and wait until each has answered
        (True), or ``settings.request_timeout`` (False). Any thread but the loop's."""
        fence = Fence(next(self.fence_ids))
        self.loop.post(lambda: self._start_fence(fence, watermark))
        if fence.done.wait(protocol.settings.request_timeout):
            return True
        self.loop.post(lambda: [peer.fences.pop(fence.id, None) for peer in list(fence.waiting)])
        return False

    def _start_fence(self, fence: Fence, watermark: int) -> None:
        # On the loop's thread, as every attach: a receiver sent an arena's descriptor
        # before this is fenced here; one sent it after learns the new watermark in that
        # same answer. A receiver answers a fence after the takes it posted before, and
        # takes none at or below the watermark after it: so every take of a lease this
        # drop ends either arrived (and made a hold) before the answer, or is never made.
        self.watermark = max(self.watermark, watermark)
        fence.waiting = {peer for peer in self.peers.values() if peer.arenas}
        for peer in list(fence.waiting):
            peer.fences[fence.id] = fence
            self._reply(peer, ["fence", fence.id, self.watermark])  # (a peer it cannot reach is dropped)
        if not fence.waiting:
            fence.done.set()

    def attach_local(self, f: HandleFields, stream: Any) -> Tensor:
        """``tx.attach`` in the process that made the handle: a view of the same record."""
        entry = self.entries.get(f.entry)
        record = entry.live() if entry is not None else None
        if record is None:
            raise LifetimeError(f"the shared memory of this handle (#{f.entry}) was released in this process")
        if not hmac.compare_digest(f.secret, entry.secret):
            raise ValueError("the handle's secret does not match: it is forged or corrupted")
        if entry.readonly and not f.readonly:
            raise ValueError(f"the shared memory of this handle (#{f.entry}) is read-only and the handle says it is "
                             "writable: it is forged or corrupted")
        st = None
        if stream is not None:
            from ..tensor import _resolve_stream

            st = _resolve_stream(stream, record.device)
        t = view(record, f, st)
        self.drop_lease(f.entry, f.secret, f.nonce)
        return t

    def after_fork_in_child(self) -> None:
        # The child has copies of the parent's records of what the parent shares, with the
        # parent's leases and its receivers' holds on them: those are the parent's to end
        # (the parent's receivers talk to the parent), and in the child nobody ever would,
        # so the child would keep the memory as long as it lives. Drop them here, and the
        # records' share entries with them (this Server goes: the child's has none):
        # sharing such a tensor again in the child makes a new entry, served by the
        # child's own socket. (The registry's own fork handler ran first: its locks are new.)
        for entry in list(self.entries.values()):
            record = entry.record()
            if record is None:
                continue
            for token, *_ in entry.leases.values():
                _REG.remove_lease(record, token)
            entry.leases.clear()
        for peer in self.peers.values():
            for _, token, record in peer.held.values():
                _REG.remove_remote_holder(record, token)
            peer.held.clear()
            peer.bytes = peer.mappings = 0
        # The child has copies of the parent's sockets; they are not its own to serve on
        # (and holding them would keep the parent's receivers from noticing its death).
        for sock in [self.sock, *(p.sock for p in self.peers.values())]:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass


_SERVER: Lazy[Server] = Lazy(Server, "sharing.server", SHARING + 10)


def server() -> Server:
    """This process's Server (made on first use; its socket on the first share)."""
    return _SERVER.get()


def is_local(f: HandleFields) -> bool:
    """The handle was made by this process (not by a parent before a fork)."""
    current = _SERVER.peek()
    return f.pid == os.getpid() and current is not None and f.address == current.address
