"""The receiving side of sharing: memory of other processes, mapped here.

Owns: the connections to senders (``Client``: one per sending process, kept open, its
packets in order, its requests and their replies), the mappings made here (``Mapping``:
one release per mapping, told to its sender), and the attach of CPU memory. A pidfd per
sender tells when it dies (``Connections.sender_died``).
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Any

from ..device import CPU
from ..dtypes import dtype as as_dtype
from ..errors import DeviceError, ExchangeError, LifetimeError
from ..registry import LIVE, Record, registry
from ..tensor import Tensor
from . import protocol
from .loop import loop
from .protocol import FD_ERRNOS, PEERCRED, Fields, close_fds, out_of_fds

_REG = registry()


def view(record: Record, f: Fields, stream: Any = None, readonly: bool = False) -> Tensor:
    """A Tensor over ``record`` with the handle's layout, read-only when the handle or
    ``readonly`` says so (``Tensor._make`` adds the holder: LifetimeError if the record
    is no longer live)."""
    t = Tensor._make(record, record.address + f.offset, f.shape, f.strides, as_dtype(f.dtype),
                     f.readonly or readonly, stream)
    if stream is not None:
        _REG.add_stream(record, stream)  # the release waits for the work queued there
    if record._views is not None:  # attached CUDA memory: closed if the sender dies
        record._views.append(weakref.ref(t))
    return t


def attach_cpu(conns: "Connections", f: Fields, deadline: float) -> Tensor:
    """Map the CPU memory of handle ``f`` (or reuse this process's live mapping of it)."""
    from exchange.devices.cpu import SharedMemory

    client = conns.client(f, deadline)
    reused = client.reuse((f.entry, not f.readonly), f)
    reply, fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, reused is None, False, f.readonly],
                                deadline)
    if reused is not None:
        close_fds(fds or [])
        return reused
    if fds is None:  # its descriptor did not fit here
        client.notify(["release", f.entry, []])
        raise out_of_fds("tx.attach (receiving the shared memory)")
    if len(fds) != 1:
        close_fds(fds)
        client.notify(["release", f.entry, []])
        raise ExchangeError(f"process {f.pid} answered the attach without its memory; nothing was mapped")
    try:
        # Writable only when the handle, the sender (its reply) and the kernel (the
        # file's seals) all allow it.
        block = SharedMemory.from_fd(fds[0], f.span, writable=not (f.readonly or reply[3] is not False))
    except BaseException:
        client.notify(["release", f.entry, []])
        raise
    key = (f.entry, block.writable)
    mapping = Mapping(client, f.entry, key, block)
    try:
        record = _REG.new_record(CPU, block.address, block.nbytes, origin=f"process {client.pid} (tx.attach)",
                                 kind="imported", release=mapping.release, owner=block)
        client.remember(key, record)
        return view(record, f, readonly=not block.writable)
    except BaseException:
        mapping.release()
        raise


def _peer_pidfd(sock: socket.socket, pid: int, f: Fields) -> int:
    """A pidfd of the process at the other end of ``sock`` (the one that listened):
    SO_PEERPIDFD where the kernel has it (6.5), else pidfd_open of its pid; -1 without
    pidfds. LifetimeError when that process has gone."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, protocol.SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise
        if exc.errno == errno.ESRCH:
            raise LifetimeError(f"process {f.pid} that shared this memory has exited") from None
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise LifetimeError(f"process {f.pid} that shared this memory has exited") from None
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise
        return -1
    except AttributeError:
        return -1


def _verify(f: Fields, pid: int, uid: int, pidfd: int) -> None:
    """Check that the process at the other end (``pid`` and ``uid`` as the kernel says:
    SO_PEERCRED) is the one that made handle ``f``, by its pid as it sees itself and
    its start time (the boot was checked before connecting), and that it will serve
    this user; before anything is sent to it. LifetimeError when it is not (the sender
    exited and another process took its address, or its pid), PermissionError when it
    is another user's or cannot be checked from here."""
    who = f"process {f.pid} that shared this memory"
    if pid <= 0:
        raise PermissionError(f"{who} cannot be verified from here: the process at its address is outside this "
                              "process's PID namespace; attach from a process that sees the sender's")
    try:
        start, pids = protocol.identity(pid)
    except ProcessLookupError:
        raise LifetimeError(f"{who} has exited") from None
    except PermissionError:
        raise PermissionError(f"{who} cannot be verified from here: /proc hides process {pid} (hidepid), which "
                              "answers at its address") from None
    if pidfd >= 0 and select.select([pidfd], [], [], 0)[0]:
        raise LifetimeError(f"{who} has exited")  # (and its pid may be another's since the reads above)
    if start != f.start or pids[-1] != f.pid or pids[0] != pid:
        raise LifetimeError(f"{who} has exited: process {pid} (uid {uid}) now answers at its address and is not it "
                            "(another process took the name, or its pid); nothing was sent to it")
    if uid != os.getuid() and os.getuid() != 0:
        raise PermissionError(f"{who} is alive (pid {pid} here) but runs as uid {uid}: it shares only with its own "
                              f"user (and root), and this process runs as uid {os.getuid()}")


def _same_sender(client: "Client", f: Fields) -> "Client":
    # A connection is verified once, for the identity its first handle gave; another
    # handle with the same address must name the same process.
    if client.identity != (f.pid, f.start):
        raise ValueError(f"this tx.ShareHandle names process {f.pid} at the address of process {client.pid}: it is "
                         "forged or corrupted; make a new one with tx.share(tensor) in the sending process")
    return client


def _connect(address: bytes, deadline: float) -> socket.socket:
    """A socket connected to ``address`` by ``deadline`` (``time.monotonic()``).
    LifetimeError when nothing listens there; ExchangeError when the sender does not
    take the connection in time (stopped, or its listen backlog is full: any local user
    can fill it). The kernel bounds the wait (SO_SNDTIMEO bounds a Unix socket's connect)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExchangeError(f"the process that shared this memory did not take the connection within "
                                f"{protocol.settings.request_timeout:g} s (stopped, or its backlog is full); try again")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            seconds = int(left)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6))))
            sock.connect(address)
            sock.getpeername()  # a signal during connect() can leave it unconnected: then try again
            return sock
        except BlockingIOError:  # SO_SNDTIMEO ran out
            sock.close()
            continue
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            raise LifetimeError("the process that shared this memory has exited (its share socket is gone); "
                                "its memory cannot be attached any more") from None
        except OSError as exc:
            sock.close()
            if exc.errno == errno.ENOTCONN:
                continue
            raise
        except BaseException:
            sock.close()
            raise


_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class Mapping:
    """The release of one mapping made here: unmap, then tell the sender."""

    __slots__ = ("client", "entry", "key", "memory", "record")

    def __init__(self, client: "Client", entry: int, key: tuple, memory: Any) -> None:
        self.client = client
        self.entry = entry
        self.key = key
        self.memory = memory  # SharedMemory, or the imported cuda.core Buffer (cuda_ipc.CUDAMapping)
        self.record: Any = None  # weakref to the local record, once made

    def release(self) -> None:
        self.client.forget(self.key)
        self.memory.close()
        self.client.notify(["release", self.entry, []])


class Client:
    """This process's connection to one sending process.

    Every packet goes out in order through ``_send`` and gets a sequence number; a packet
    that finds the socket full waits, in order, for the loop's thread to send it when
    the socket has room (a deleter never blocks on the sender). Requests (attach, sync)
    then wait for their reply under ``lock``, until a deadline; a reply says how many
    packets the sender has handled, which tells which release events it has opened (they
    must live until then)."""

    def __init__(self, conns: "Connections", f: Fields, deadline: float) -> None:
        sock = _connect(f.address, deadline)
        pidfd = -1
        try:
            pid, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            pidfd = _peer_pidfd(sock, pid, f)
            _verify(f, pid, uid, pidfd)  # before anything is sent
            sock.settimeout(protocol.settings.request_timeout)  # non-blocking descriptor, for _send
        except BaseException:
            sock.close()
            close_fds([pidfd] if pidfd >= 0 else [])
            raise
        self.conns = conns
        self.address = f.address
        self.sock = sock
        self.pid = pid  # as this process sees it (PID namespaces may differ from the handle's)
        self.identity = (f.pid, f.start)  # as the handles of this sender say it
        self.pidfd = pidfd  # watched for the sender's death (Connections._watch); -1 without pidfds
        self.lock = threading.Lock()  # one request at a time
        self.send_lock = threading.Lock()  # numbering and order of packets
        self.sent = 0
        self.backlog: collections.deque[bytes] = collections.deque()
        self.ids = itertools.count(1)
        self.dead = False
        self.mappings: dict[tuple, Any] = {}  # (entry, writable) -> weakref to the local record
        self.cuda_records: weakref.WeakSet = weakref.WeakSet()  # closed if the sender dies
        self.unconfirmed: list[tuple[int, Any]] = []  # (packet number, IPC event) of releases not yet handled
        self.sync_posted = False

    # -- mappings this process holds
    def reuse(self, key: tuple, f: Fields, stream: Any = None) -> Tensor | None:
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

    # -- packets
    def _send(self, message: list) -> int:
        """Send one packet in order, never blocking; returns its number (0: the sender is gone)."""
        data = protocol.encode(message)
        failed = False
        with self.send_lock:
            if self.dead:
                return 0
            self.sent += 1
            seq = self.sent
            if not self.backlog:
                try:
                    os.write(self.sock.fileno(), data)
                    return seq
                except BlockingIOError:
                    pass
                except OSError:
                    failed = True
            if not failed:
                self.backlog.append(data)
                first = len(self.backlog) == 1
        if failed:
            self.conns.sender_died(self)
            return 0
        if first:
            self.conns.loop.post(self._watch_writable)
        return seq

    def _watch_writable(self) -> None:
        # On the loop's thread: flush the backlog whenever the socket has room. Never a
        # blocking wait there: a stopped sender must not delay anything else.
        if not self.dead:
            try:
                self.conns.loop.register(self.sock, selectors.EVENT_WRITE, self._flush)
            except (KeyError, ValueError, OSError):  # watched already, or closed meanwhile
                pass
            self._flush(self.sock)

    def _flush(self, _sock: Any) -> None:
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
            self.conns.loop.unregister(self.sock)
        if failed:
            self.conns.sender_died(self)

    def notify(self, message: list) -> None:
        """One packet that needs no answer (release, close, opened)."""
        self._send(message)

    def request(self, message: list, deadline: float) -> tuple[list, list[int] | None]:
        """Send ``[op, *args]`` with a request id and wait for its reply
        ``[status, id, handled, *payload]`` until ``deadline`` (``time.monotonic()``);
        an "ok" payload starts with whether the memory is read-only.
        Raises the error the sender answered, LifetimeError when the sender has gone,
        ExchangeError when it does not answer in time (the sender is then told to undo
        the request, ``abandon``) or answers nonsense. Returns None for the descriptors
        when one it sent did not fit in this process (the caller answers the reply, then
        raises out_of_fds)."""
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ExchangeError(f"process {self.pid} did not answer within {protocol.settings.request_timeout:g} s "
                                "(stopped or busy: another request to it is still waiting); try again")
        try:
            rid = next(self.ids)
            if not self._send([message[0], rid, *message[1:]]):
                raise LifetimeError(f"process {self.pid} that shared this memory has exited")
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout
                    self.sock.settimeout(left)
                    data, fds, flags, _ = socket.recv_fds(self.sock, protocol.MAX_MESSAGE, 4, protocol.CLOEXEC)
                    if not data:
                        raise ConnectionResetError("connection closed")
                    try:
                        reply = protocol.decode(data)
                        ok = (isinstance(reply, list) and len(reply) >= 3 and reply[0] in ("ok", "err")
                              and type(reply[1]) is int and type(reply[2]) is int
                              and len(reply) >= (4 if reply[0] == "ok" else 5))
                    except ValueError:
                        ok = False
                    if not ok:
                        close_fds(fds)
                        raise ExchangeError(f"process {self.pid} sent a malformed reply (not a tensor-exchange "
                                            f"sender of protocol {protocol.PROTOCOL}?): {bytes(data[:80])!r}")
                    if reply[1] == rid:
                        break
                    close_fds(fds)  # the late answer to a request that timed out (and was abandoned)
            except socket.timeout:
                # The sender may still handle the request later (it is stopped, or busy):
                # have it undo what it would do (count a mapping, end the lease) then.
                self._send(["abandon", rid])
                raise ExchangeError(f"process {self.pid} did not answer within {protocol.settings.request_timeout:g} s "
                                    "(stopped or busy); try again") from None
            except OSError as exc:
                self.conns.sender_died(self)
                raise LifetimeError(f"process {self.pid} that shared this memory has exited ({exc})") from None
        finally:
            self.lock.release()
        self._confirm(reply[2])
        if reply[0] == "ok":
            if flags & socket.MSG_CTRUNC:
                # The kernel had no descriptor free for what the sender sent: the caller
                # answers the reply (release), then raises out_of_fds.
                close_fds(fds)
                return reply, None
            return reply, fds
        close_fds(fds)
        code, text = reply[3], reply[4]
        error = {"released": LifetimeError, "forged": ValueError}.get(code, DeviceError)
        raise error(f"process {self.pid} refused: {text}")

    # -- CUDA release events
    def release_with_event(self, entry: int, event: Any, handle: bytes) -> None:
        # The event must live until the sender has opened it, which a later reply shows.
        seq = self._send(["release", entry, [handle.hex()]])
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
            self.conns.loop.unregister(self.sock)
            pidfd, self.pidfd = self.pidfd, -1
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

    def client(self, f: Fields, deadline: float) -> Client:
        """The connection to the sender of handle ``f``, made (and its peer verified) on
        first use by one thread while others wanting the same sender wait for it (until
        ``deadline``, a ``time.monotonic()``); attaches to other senders are not held up."""
        address = f.address
        client = self.clients.get(address)
        if client is not None and not client.dead:
            return _same_sender(client, f)
        with self.lock:
            gate = self.gates.setdefault(address, threading.Lock())
        if not gate.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ExchangeError(f"the connection to the process that shared this memory was not made within "
                                f"{protocol.settings.request_timeout:g} s (stopped, or its backlog is full); try again")
        try:
            client = self.clients.get(address)
            if client is not None and not client.dead:
                return _same_sender(client, f)
            client = Client(self, f, deadline)
            try:
                self.loop.start()
                self._watch(client)
            except BaseException:
                client.close()
                raise
            with self.lock:
                self.clients[address] = client
            return client
        finally:
            gate.release()

    def _watch(self, client: Client) -> None:
        # Its pidfd tells when the sender dies (its CUDA memory is then closed here);
        # without pidfds (old kernels) the next message notices instead.
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
            client.lock, client.send_lock = threading.Lock(), threading.Lock()
            client.dead = True
            client.backlog.clear()
            client.unconfirmed.clear()
            try:
                client.sock.close()
            except OSError:
                pass
            if client.pidfd >= 0:
                close_fds([client.pidfd])


_CONNECTIONS: Connections | None = None
_CONNECTIONS_LOCK = threading.Lock()


def connections() -> Connections:
    """This process's Connections (made on first use)."""
    global _CONNECTIONS
    current = _CONNECTIONS
    if current is None:
        with _CONNECTIONS_LOCK:
            if _CONNECTIONS is None:
                _CONNECTIONS = Connections()
            current = _CONNECTIONS
    return current


def _after_fork_in_child() -> None:
    global _CONNECTIONS, _CONNECTIONS_LOCK
    _CONNECTIONS_LOCK = threading.Lock()
    old, _CONNECTIONS = _CONNECTIONS, None
    if old is not None:
        try:
            old.after_fork_in_child()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

