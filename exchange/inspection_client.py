"""The client side of inspection: one connection to a watched process and its replies.

Owns: ``InspectionClient`` (finds the process's socket from its pid, checks who answers,
asks, and checks every reply for size, form and numbers before making its strings safe)
and ``query`` (one reply). ``tensor-exchange top`` and ``snapshot`` use it
(exchange/cli/top.py, exchange/cli/snapshot.py).
"""

from __future__ import annotations

import math
import operator
import os
import socket
import time
from typing import Any

from .inspection_addresses import MAX_PID, _PF_EXITING, _listener_is, _owner, _proc_stat, _user, addresses
from .inspection_protocol import (MAX_REPLY, MAX_ROWS, MAX_TIMEOUT_S, SCHEMA, InspectionError, _text,
                                  safe_reply)
from .sharing import protocol


class _Dropped(InspectionError):
    """The server closed the connection (or turned it away as idle) while the process
    still runs: a new connection may be answered (``tensor-exchange top`` tries one)."""


def _check_rows(rows: Any) -> int:
    if isinstance(rows, bool) or not hasattr(type(rows), "__index__"):
        raise TypeError(f"rows must be an int in [0, {MAX_ROWS}], got {type(rows).__name__} {rows!r}")
    rows = operator.index(rows)
    if not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be in [0, {MAX_ROWS}], got {rows}")
    return rows


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    timeout = float(timeout)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {timeout!r}")
    return timeout


class InspectionClient:
    """A connection to process ``pid``'s inspection server (``tensor-exchange top`` keeps
    one open and asks once a second). ``timeout``: seconds to wait for the connection and
    for each reply, more than 0 and at most ``MAX_TIMEOUT_S`` (3600).

    It finds the socket from the pid alone (:func:`addresses`) and, before trusting
    anything, checks who is at the other end (``SO_PEERCRED``): the process ``pid``
    itself (a socket of another process bearing a name of that pid's form is passed
    over), of this user or root (root may inspect any user's process).
    Every reply is checked for size (``MAX_REPLY``) and form, and every string in it made
    safe for a terminal (``safe_text``: control characters escaped), whatever the server
    sent. The server drops a connection that sends no request for ``IDLE_S`` (5) seconds.

    Raises (from the constructor and ``request``)
    ------
    ValueError
        ``pid`` is not a positive int; ``timeout`` or ``rows`` out of range (TypeError:
        not a number, not an int).
    ProcessLookupError
        No process ``pid`` (a ``pid`` above any the kernel gives included).
    PermissionError
        The process belongs to another user (it refuses, or this side does).
    InspectionError
        The process does not serve inspection (the message says how to make it), does not
        accept the connection or answer within ``timeout`` (its socket not found within it
        among the names another user bound, too), turned this client away (too
        many clients are connected), ended, closed the connection, or answered something
        that is not a reply of this library (not JSON, not of the schema, or a number
        none of its replies holds: an int of ``MAX_NUMBER`` or more, a float not finite).
    """

    def __init__(self, pid: int, timeout: float = 5.0) -> None:
        if type(pid) is not int or pid <= 0:
            raise ValueError(f"a pid is a positive int, got {pid!r}")
        self.pid, self.timeout = pid, _check_timeout(timeout)
        if pid > MAX_PID:
            raise ProcessLookupError(f"no process with pid {pid}")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise ProcessLookupError(f"no process with pid {pid}") from None
        except PermissionError:
            pass  # it exists, of another user: its server (if any) decides
        stat = _proc_stat(pid)
        #: The process's start time (clock ticks after boot), to tell it from a later one
        #: given the same pid; None where /proc cannot say.
        self.process_start = None if stat is None else stat[2]
        self.sock, peer_uid = self._connect()
        me = os.getuid()
        if peer_uid not in (me, 0) and me != 0:
            self.sock.close()
            raise PermissionError(f"process {pid} belongs to {_user(peer_uid)}: only that user and root may "
                                  "inspect it")

    def _connect(self) -> tuple[socket.socket, int]:
        """A connection to process ``pid``'s own inspection socket, and the uid it runs as.
        Each name of ``addresses(pid)`` is tried: one answered by another process
        (``SO_PEERCRED`` and ``_listener_is``: a name of that form bound by someone else)
        is closed and passed over; one whose queue of connections is full (EAGAIN, at once
        on a Unix socket) is tried again until the timeout; one of another user (of this
        pid: the process, or a socket made by an earlier process with its pid where the
        kernel cannot tell them apart) only if no other answers. Within the timeout, all
        told: another user may bind many names of that form, a connection each."""
        pid = self.pid
        deadline = time.monotonic() + self.timeout
        try:
            names = addresses(pid)
        except OSError as exc:
            raise InspectionError(f"cannot find process {pid}'s inspection socket: /proc/net/unix cannot be read "
                                  f"({exc.strerror})") from None
        listed, me = len(names), os.getuid()
        foreign: tuple[socket.socket, int] | None = None  # of this pid, another user's

        def late(tried: int) -> InspectionError:
            return InspectionError(
                f"process {pid} did not answer within {self.timeout:g} s: {listed:,} inspection sockets are listed "
                f"for it, {tried:,} of them tried, none its own (another user may bind names of that form; where "
                f"/proc/{pid}/fd can be read, as by root, they are told apart at once): try a longer timeout")

        def full() -> InspectionError:
            return InspectionError(f"process {pid} did not accept the connection within {self.timeout:g} s "
                                   "(stopped, or too many clients)")

        first = True  # the first pass tries every name; the next ones, those whose queue was full
        try:
            while True:
                busy = []
                for tried, name in enumerate(names):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if foreign is not None:
                            break
                        raise late(tried) if first else full()
                    found = self._try(name, left)
                    if found is None:
                        continue
                    if found == "busy":
                        busy.append(name)
                    elif found[1] in (me, 0) or me == 0:
                        return found
                    elif foreign is None:
                        foreign = found
                    else:
                        found[0].close()
                left = deadline - time.monotonic()
                if foreign is not None and (not busy or left <= 0):
                    found, foreign = foreign, None  # the caller says whose it is
                    return found
                if not busy:
                    if self._ended(0.0):
                        raise InspectionError(f"process {pid} ended")
                    raise InspectionError(f"process {pid} is not serving inspection: start it with "
                                          "EXCHANGE_INSPECT=1 in its environment, or call tx.serve_inspection() in it")
                if left <= 0:
                    raise full()
                names, first = busy, False
                time.sleep(min(0.05, left))
        finally:
            if foreign is not None:
                foreign[0].close()

    def _try(self, name: bytes, timeout: float) -> tuple[socket.socket, int] | str | None:
        """(a connection to ``name``, the uid there) when process ``pid`` listens on it;
        "busy" when its queue is full; None when it is gone or another process's."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(name)
            peer_pid, peer_uid, _ = protocol.PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, protocol.PEERCRED.size))
        except (ConnectionRefusedError, FileNotFoundError):  # closed since it was listed
            sock.close()
            return None
        except (BlockingIOError, socket.timeout):
            sock.close()
            return "busy"
        except BaseException:
            sock.close()
            raise
        if peer_pid == self.pid and _listener_is(sock, self.pid) is not False:
            sock.settimeout(self.timeout)
            return sock, peer_uid
        sock.close()  # not the process asked for: never trusted, never asked
        return None

    def _ended(self, wait: float) -> bool:
        """Whether process ``pid`` is gone, dead but not yet reaped, on its way out, or
        another process with its pid; watched for up to ``wait`` seconds (a process that is
        ending closes its sockets a moment before it is gone)."""
        deadline = time.monotonic() + wait
        while True:
            stat = _proc_stat(self.pid)
            if (stat is None or stat[0] in ("Z", "X", "x") or stat[1] & _PF_EXITING
                    or (self.process_start is not None and stat[2] != self.process_start)):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.05, left))

    def request(self, rows: int = 0) -> dict[str, Any]:
        """One reply (a dict, the schema in docs/observability.md): the aggregates, and
        the largest ``rows`` records from the scan (an int, 0 <= rows <= MAX_ROWS)."""
        rows = _check_rows(rows)
        pid = self.pid
        try:
            try:
                self.sock.send(protocol.encode(["inspect", SCHEMA, rows]))
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
                pass  # closed on its side: read what it said before closing, if anything
            data, _, flags, _ = self.sock.recvmsg(MAX_REPLY)
        except socket.timeout:
            if self._ended(0.0):
                raise InspectionError(f"process {pid} ended") from None
            raise InspectionError(f"process {pid} did not answer within {self.timeout:g} s: it may be stopped "
                                  "(SIGSTOP) or very busy") from None
        except (BrokenPipeError, ConnectionResetError):
            # It closed with our request unread (ECONNRESET comes before what it sent us
            # before closing, a refusal say): read that, if anything.
            try:
                data, _, flags, _ = self.sock.recvmsg(MAX_REPLY, 0, socket.MSG_DONTWAIT)
            except OSError:
                data, flags = b"", 0
        if not data:
            owner, me = _owner(pid), os.getuid()
            if owner is not None and owner != me and me != 0 and not self._ended(0.0):
                raise PermissionError(f"process {pid} belongs to {_user(owner)} and refused: only that user and "
                                      "root may inspect it")
            if self._ended(min(1.0, self.timeout)):
                raise InspectionError(f"process {pid} ended")
            raise _Dropped(f"process {pid} closed the connection without answering (it stopped serving, "
                           "or refused this request)")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise InspectionError(f"process {pid} sent a reply over {MAX_REPLY} bytes: not one of this library's")
        try:
            reply = safe_reply(protocol.decode(data))
        except ValueError as exc:  # not JSON, or a number out of range
            raise InspectionError(f"process {pid} sent a reply that is not one of this library's "
                                  f"({_text(exc)})") from None
        if not isinstance(reply, dict) or reply.get("schema") != SCHEMA:
            raise InspectionError(f"process {pid} sent a reply that is not one of this library's (schema "
                                  f"{_text(reply.get('schema')) if isinstance(reply, dict) else None}, "
                                  f"expected {SCHEMA})")
        if "refused" in reply:
            why = _text(reply["refused"])
            if reply.get("idle") is True:  # dropped as idle: a new connection is welcome
                raise _Dropped(f"process {pid} closed this connection: {why}")
            raise InspectionError(f"process {pid} turned this client away: {why}")
        if "error" in reply:
            raise InspectionError(f"process {pid} could not answer: {_text(reply['error'])}")
        for key, kind in (("stats", dict), ("devices", list), ("holders", dict), ("pending_streams", list),
                          ("remote_processes", list)):
            if not isinstance(reply.get(key), kind):
                raise InspectionError(f"process {pid} sent a reply without {key!r}: not one of this library's")
        if "sets" in reply:
            _check_sets(pid, reply["sets"])
        return reply

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "InspectionClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_sets(pid: int, sets: Any) -> None:
    """``sets`` (a reply's tensor sets, present only where the process loaded them) is a
    list of objects; InspectionError else. What a row holds is read where it is shown
    (``tensor-exchange top``), as for the other lists of a reply."""
    if not isinstance(sets, list) or not all(isinstance(row, dict) for row in sets):
        raise InspectionError(f"process {pid} sent a reply whose 'sets' is not a list of objects: not one of "
                              "this library's")


def query(pid: int, rows: int = 20, timeout: float = 5.0) -> dict[str, Any]:
    """One reply from process ``pid`` (see ``InspectionClient``, which says what it raises)."""
    rows = _check_rows(rows)
    with InspectionClient(pid, timeout) as client:
        return client.request(rows)
