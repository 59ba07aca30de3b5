"""Who is at the other end: a receiver's connection to a sender, and the proof that
the process answering is the one that made the handle.

Owns the connect (bounded by the attach's deadline), the pidfd that tells when the
sender dies, the check of the peer's identity (pid, start time, user: before anything
is sent to it) and the error that says the sender has exited. Knows nothing of which
memory travels (exchange/channels/) nor of the connection's packets (receiving.py).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from typing import Any

from ..errors import ExchangeError, LifetimeError
from . import protocol
from .protocol import FD_ERRNOS, HandleFields

__all__ = ["connect", "peer_pidfd", "same_sender", "sender_exited", "verify"]


def peer_pidfd(sock: socket.socket, pid: int, f: HandleFields) -> int:
    """A pidfd of the process at the other end of ``sock`` (the one that listened):
    SO_PEERPIDFD where the kernel has it (6.5), else pidfd_open of its pid; -1 without
    pidfds. LifetimeError when that process has gone."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, protocol.SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise
        if exc.errno == errno.ESRCH:
            raise sender_exited(f.pid) from None
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise sender_exited(f.pid) from None
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise
        return -1
    except AttributeError:
        return -1


def verify(f: HandleFields, pid: int, uid: int, pidfd: int) -> None:
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


def same_sender(client: Any, f: HandleFields) -> Any:
    # A connection is verified once, for the identity its first handle gave; another
    # handle with the same address must name the same process.
    if client.identity != (f.pid, f.start):
        raise ValueError(f"this tx.ShareHandle names process {f.pid} at the address of process {client.pid}: it is "
                         "forged or corrupted; make a new one with tx.share(tensor) in the sending process")
    return client


def sender_exited(pid: int, detail: str = "") -> LifetimeError:
    """LifetimeError: process ``pid``, which shared the memory, has exited. Its ``pid``
    attribute names that process (a Ray chain names the stage that died by it)."""
    exc = LifetimeError(f"process {pid} that shared this memory has exited{detail}")
    exc.pid = pid  # type: ignore[attr-defined]
    return exc


def connect(address: bytes, deadline: float) -> socket.socket:
    """A socket connected to ``address`` by ``deadline`` (``time.monotonic()``).
    LifetimeError when nothing listens there; ExchangeError when the sender does not
    take the connection in time (stopped, or its listen backlog is full: any local user
    can fill it). The kernel bounds the wait (SO_SNDTIMEO bounds a Unix socket's connect)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExchangeError(f"the process that shared this memory did not take the connection within "
                                f"{protocol.settings.request_timeout:g} s (stopped, or its backlog is full); try again")
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
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
            if sock is not None:  # (None: no descriptor for the socket itself)
                sock.close()
            if exc.errno == errno.ENOTCONN:
                continue
            raise
        except BaseException:
            if sock is not None:
                sock.close()
            raise


_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds
