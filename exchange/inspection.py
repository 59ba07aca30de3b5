"""Inspection: this process's registry, served on request to ``tensor-exchange top PID``
and ``tensor-exchange snapshot PID`` (docs/observability.md gives the reply's schema).

How it works:

* Nothing is served until asked: ``tx.serve_inspection()``, or ``EXCHANGE_INSPECT=1`` in
  the environment when ``exchange`` is imported. Then one daemon thread (``tx-inspect``)
  listens on an abstract Unix socket (``SOCK_SEQPACKET``, no file to leave behind) named
  from the pid and a random token, ``\\0tensor-exchange/inspect/<pid>/<32 hex digits>``
  (the sharing code's prefix), and sleeps in a selector: while nobody is connected it
  never wakes, and the library's hot paths do not know it exists. The token keeps another
  user from taking the name before the process serves (a name from the pid alone could be
  bound first: serving would then fail); a client finds the name from the pid
  (``addresses``: /proc/net/unix lists every abstract name) and checks who answers.
* Who may ask: the same check as sharing across processes (exchange/sharing/serving.py):
  the kernel's credentials of the connecting process (``SO_PEERCRED``), our own user or
  root; anyone else is disconnected unanswered. The client checks the other end too:
  the socket must belong to the pid it asked for (another user may bind names of the
  same form; they are passed over), whose process listens on it now (``_listener_is``:
  not one that had the pid before), of its own user or root; it tries names only until
  its timeout (another user may bind thousands).
* One request, one reply, JSON both ways (never pickle: any local process can connect to
  an abstract socket). A request is ``["inspect", SCHEMA, rows]``; the reply one JSON
  object. What a client sends is hostile until proven otherwise: a request over
  ``MAX_REQUEST`` bytes, one that is not JSON or not of that form, a client that does not
  read its replies, or one that sends no request for ``IDLE_S`` seconds, and the client is
  dropped; past ``MAX_CLIENTS`` at once a client is told so (``{"schema": 1, "refused":
  "too many clients are connected ..."}``) and dropped. The thread survives anything; the
  watched process never sees it.
* Strings in a reply (origins, labels, holders, streams) come from the watched process's
  users: every C0 and C1 control character, DEL, lone surrogate and invisible character
  that changes how text looks (bidirectional controls, zero-width characters) in them is
  written as a visible escape (``\\x1b``, ``\\u202e``) by the server (``safe_text``), and
  again by the client, which trusts no server: nothing a watched process sends reaches a
  terminal as an escape sequence.
* Cost to the watched process: the aggregates (``Registry.stats()``, the reaper's
  per-stream queue lengths, the counts the sharing server keeps per receiving process)
  are O(1) in the records alive and in those other processes hold; the largest-records
  table needs a scan of ``Registry.snapshot()``, done at most once every
  ``SCAN_INTERVAL_S`` seconds whoever asks, its result cached and its age given in
  every reply.
* Ages: the registry keeps no creation time per record (its hot path stays as it is), so
  the server notes ``(time, created_total)`` when it starts, at each request, and once a
  second while a client is connected; a record's age is bounded by the notes taken just
  before and after it was made (``age_s`` at least, ``age_max_s`` at most).
* A forked child does not serve (the thread is not inherited; the parent's sockets are
  closed in the child); it may call ``serve_inspection()`` itself.
"""

from __future__ import annotations

import bisect
import collections
import errno
import heapq
import math
import operator
import os
import re
import secrets
import socket
import sys
import threading
import time
from typing import Any

from . import _core
from ._version import __version__
from .device import SLOT_DEVICES
from .errors import ExchangeError
from .registry import registry
from .sharing import protocol

__all__ = ["serve_inspection", "stop_inspection", "inspection_address", "address", "addresses", "InspectionClient",
           "InspectionError", "query", "safe_text", "SCHEMA", "SCAN_INTERVAL_S", "MAX_ROWS", "IDLE_S",
           "MAX_TIMEOUT_S"]

#: Version of the request and of the reply's schema (docs/observability.md).
SCHEMA = 1
#: The largest-records scan runs at most once per this many seconds, whoever asks.
SCAN_INTERVAL_S = 5.0
#: Most rows of the largest-records table a reply carries.
MAX_ROWS = 50
#: Bytes: a longer request drops its client. A reply is at most MAX_REPLY bytes.
MAX_REQUEST = 256
MAX_REPLY = 1 << 20
#: Clients connected at once; more are told so and disconnected.
MAX_CLIENTS = 8
#: Seconds a connected client may go without sending a request before it is dropped (its
#: slot freed). ``top`` asks at every refresh (1 s by default) and reconnects on its own
#: when its ``--interval`` is longer than half of this.
IDLE_S = 5.0
#: The longest ``timeout`` a client accepts, in seconds.
MAX_TIMEOUT_S = 3600.0
#: Rows of the per-stream and per-process lists a reply carries (the rest counted).
MAX_LIST = 64
#: Holders described per record in the largest-records table (the rest counted).
MAX_HOLDERS = 8
#: Characters of a string the reply carries (a stream's repr, an origin, a label).
MAX_TEXT = 200
#: Seconds between the server's notes of (time, created_total) while a client is connected.
NOTE_INTERVAL_S = 1.0
#: Most notes kept (older ones thinned: coarser ages for old records).
MAX_NOTES = 4096

_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)  # the clock /proc/<pid>/stat's start time is on
_NBYTES = operator.attrgetter("nbytes")
_SLOT = operator.attrgetter("device._slot")


class InspectionError(ExchangeError):
    """An inspection request failed: the process is not serving, did not answer, or sent
    something that is not a reply of this library. The message says which and what to do."""


def _now() -> float:
    return time.clock_gettime(_CLOCK)


#: Hex digits of the random part of an inspection address (128 bits).
TOKEN_HEX = 32


def address(pid: int, token: str) -> bytes:
    """The abstract socket name process ``pid`` serves inspection on with ``token`` (its
    random part, ``TOKEN_HEX`` hex digits): ``\0tensor-exchange/inspect/<pid>/<token>``."""
    if not re.fullmatch(f"[0-9a-f]{{{TOKEN_HEX}}}", token):
        raise ValueError(f"an inspection token is {TOKEN_HEX} lowercase hex digits, got {token!r}")
    return protocol.ADDRESS_PREFIX + f"inspect/{int(pid)}/{token}".encode()


def addresses(pid: int) -> list[bytes]:
    """The inspection addresses process ``pid`` may serve on, for a client to try (the
    one whose ``SO_PEERCRED`` is ``pid`` is its own): the abstract socket names of the
    form :func:`address` gives for ``pid``, from this network namespace's list of Unix
    sockets (/proc/net/unix, readable by every user). Where /proc/<pid>/fd can be read
    (its user and root), only those that are the process's own sockets are kept: another
    user may bind names of that form (it cannot take the process's own, random one), even
    one whose ``SO_PEERCRED`` names ``pid``, made by a process that had that pid before.
    OSError when /proc/net/unix cannot be read."""
    with open("/proc/net/unix", "rb") as fh:
        listing = fh.read()
    # "Num: RefCount Protocol Flags Type St Inode Path", an abstract name's NUL shown as "@"
    line = rb"^\S+: \S+ \S+ \S+ \S+ \S+ +(\d+) @(tensor-exchange/inspect/%d/[0-9a-f]{%d})$" % (int(pid), TOKEN_HEX)
    found: dict[bytes, set[int]] = {}  # name -> its inodes listed (the listener's, its connections')
    for m in re.finditer(line, listing, re.MULTILINE):
        found.setdefault(b"\0" + m.group(2), set()).add(int(m.group(1)))
    if found:
        own = _socket_inodes(pid)
        if own is not None:
            return [name for name, inodes in found.items() if inodes & own]
    return list(found)


def _socket_inodes(pid: int) -> set[int] | None:
    """The inodes of process ``pid``'s sockets (/proc/<pid>/fd), or None when they cannot
    be read (another user's process, or one that is not dumpable)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


#: SO_PEERPIDFD (Linux 6.5): a pidfd of the process that made the listening socket. Python
#: names it from 3.13; its number elsewhere is that of the generic socket options, which
#: these machines use (others number their options otherwise: not asked there).
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", None)
if _SO_PEERPIDFD is None and sys.platform == "linux" and os.uname().machine in (
        "x86_64", "i686", "i386", "aarch64", "riscv64", "s390x", "ppc64le", "ppc64", "loongarch64"):
    _SO_PEERPIDFD = 77


def _listener_is(sock: socket.socket, pid: int) -> bool | None:
    """Whether the process that listens on the socket ``sock`` is connected to is process
    ``pid`` now. ``SO_PEERCRED`` gives the pid that process had when it listened: once it
    ended, a later process may be given that pid, and the socket, kept open by another
    process, then names the later one. A pidfd of the listener (``SO_PEERPIDFD``) says
    whether it still runs and its pid; None where the kernel cannot say (before 6.5)."""
    if _SO_PEERPIDFD is None:
        return None
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError as exc:
        return False if exc.errno in (errno.ESRCH, errno.EINVAL) else None  # 6.5 to 6.8: none for one that ended
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as fh:
            found = re.search(rb"^Pid:\s*(-?\d+)\s*$", fh.read(), re.MULTILINE)  # -1: it ended
    except OSError:
        return None
    finally:
        os.close(pidfd)
    return None if found is None else int(found.group(1)) == pid


def _printable(name: bytes) -> str:
    return "@" + name[1:].decode()


#: What never reaches a terminal raw: C0 controls, DEL, C1 controls (ESC, CSI, OSC, BEL and
#: the rest), lone surrogates (which no terminal encoding can write), and the invisible
#: characters that change what text around them looks like: bidirectional controls
#: (U+061C, U+200E/F, U+202A-E, U+2066-9: "\u202e" shows what follows right to left, so
#: a label can pass for another), zero-width ones (U+200B-D, U+2060-4, U+FEFF, soft
#: hyphen U+00AD), line and paragraph separators (U+2028/9), interlinear annotations
#: (U+FFF9-B) and tags (U+E0000-7F, invisible text).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\xad\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069"
                      "\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")


def _escape(match: re.Match) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"


def safe_text(value: Any) -> str:
    """``value`` as a string a terminal can show as it is: every C0 and C1 control
    character, DEL, lone surrogate, and invisible character that changes how the text
    around it looks (bidirectional controls, zero-width characters, line separators:
    ``_CONTROL``) written as a visible escape (``"\\x1b"``, four characters, for ESC;
    ``"\\u202e"`` for RIGHT-TO-LEFT OVERRIDE). What the watched process sends goes
    through this on both sides."""
    s = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(_escape, s)


#: Numbers a reply may hold: an int is a count, bytes, a pid or an id (int64 at most),
#: a float is seconds or milliseconds (finite). Anything else is no reply of this library.
MAX_NUMBER = 2**63


def safe_reply(value: Any, depth: int = 0) -> Any:
    """``value`` (a decoded reply) with every string in it, keys included, made safe
    (``safe_text``); ValueError for a number no reply of this library has (an int of
    ``MAX_NUMBER`` or more, either sign; a float not finite) and past a nesting none has."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, int) and not -MAX_NUMBER < value < MAX_NUMBER:
        raise ValueError(f"an int out of range ({value.bit_length()} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a number out of range ({value})")
    if depth > 16:
        raise ValueError("nested too deep")
    if isinstance(value, dict):
        return {safe_text(k): safe_reply(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [safe_reply(v, depth + 1) for v in value]
    return value


def _text(value: Any) -> str:
    s = safe_text(value)
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 3] + "..."


def _refusal(why: str, **more: Any) -> bytes:
    return protocol.encode({"schema": SCHEMA, "refused": why, **more})  # type: ignore[arg-type]


_FULL = _refusal(f"too many clients are connected (it serves {MAX_CLIENTS} at once, and drops one that sends "
                 f"no request for {IDLE_S:g} s): try again")
_IDLE = _refusal(f"no request for {IDLE_S:g} s: connection closed (connect again)", idle=True)


# -- the serving side ---------------------------------------------------------------------------
class _Server:
    """The listening socket, its thread and clients, the notes and the cached scan."""

    def __init__(self) -> None:
        import selectors

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # Random, so that no other process can take it first (a name from the pid alone
        # could be bound by another user before this one serves); clients find it
        # (``addresses``) and check who answers.
        self.address = address(os.getpid(), secrets.token_hex(TOKEN_HEX // 2))
        self.selector = selectors.DefaultSelector()
        self.wake_r = self.wake_w = -1
        self.clients: dict[int, socket.socket] = {}
        self.seen: dict[int, float] = {}  # per client: time.monotonic() of its connection or last request
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.notes_t: list[float] = []
        self.notes_c: list[int] = []
        self.scan: dict[str, Any] | None = None
        self.resume_at: float | None = None  # accepting paused until then (no descriptor was free)
        self.scan_lock = threading.Lock()
        self.started = _now()
        self.process_start = self.started
        try:  # the process's start, for the age of records made before serving (at most the uptime)
            self.process_start = protocol.own_start() / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            pass
        try:
            self.sock.bind(self.address)
            self.sock.listen(8)
            self.sock.setblocking(False)
            self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self.selector.register(self.sock, selectors.EVENT_READ, self._accept)
            self.selector.register(self.wake_r, selectors.EVENT_READ, self._woken)
            self.note()
            self.thread = threading.Thread(target=self._run, name="tx-inspect", daemon=True)
            self.thread.start()
        except BaseException:
            self.close()
            raise

    # -- the thread
    def _run(self) -> None:
        import selectors

        while not self.stopping:
            timeout = None
            if self.clients:
                left = self._drop_idle()
                if self.clients:
                    timeout = min(NOTE_INTERVAL_S, left)
            if self.resume_at is not None:
                left = self.resume_at - time.monotonic()
                if left <= 0:
                    self.resume_at = None
                    try:
                        self.selector.register(self.sock, selectors.EVENT_READ, self._accept)
                    except (KeyError, ValueError, OSError):
                        pass
                else:
                    timeout = left if timeout is None else min(timeout, left)
            try:
                events = self.selector.select(timeout)
            except (OSError, ValueError):
                return  # closed (stop, or after fork)
            if self.clients and not events:
                try:
                    self.note()
                except Exception:
                    pass
            for key, _ in events:
                try:
                    key.data(key.fileobj)
                except Exception:  # the thread survives anything; a bad client is dropped by its handler
                    pass

    def _drop_idle(self) -> float:
        """Drop the clients that sent no request for IDLE_S seconds (telling them why,
        if they read); returns the seconds until the next of the others would be."""
        now = time.monotonic()
        left = IDLE_S
        for fd, sock in list(self.clients.items()):
            idle = now - self.seen.get(fd, now)
            if idle >= IDLE_S:
                self._drop(sock, _IDLE)
            else:
                left = min(left, IDLE_S - idle)
        return max(0.0, left)

    def _woken(self, fd: int) -> None:
        try:
            os.read(fd, 64)
        except OSError:
            pass

    def _accept(self, server: socket.socket) -> None:
        import selectors

        try:
            sock, _ = server.accept()
        except OSError as exc:
            if exc.errno in protocol.FD_ERRNOS + (errno.ENOBUFS, errno.ENOMEM):
                # No descriptor for it: the connection waits in the backlog. Stop watching the
                # socket for a moment (as serving.py does); watching it now would wake this
                # thread again and again until a descriptor is free.
                try:
                    self.selector.unregister(server)
                except (KeyError, ValueError, OSError):
                    pass
                self.resume_at = time.monotonic() + protocol.ACCEPT_RETRY_S
            return
        try:  # who connected: the kernel's word, as exchange/sharing/serving.py checks it
            _, uid, _ = protocol.PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 protocol.PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.getuid() and uid != 0:
            sock.close()  # another user's process: nothing for it, not even why
            return
        sock.setblocking(False)
        if len(self.clients) >= MAX_CLIENTS:
            self._drop(sock, _FULL)  # too many at once: told so, for its message
            return
        self.clients[sock.fileno()] = sock
        self.seen[sock.fileno()] = time.monotonic()
        self.selector.register(sock, selectors.EVENT_READ, self._serve)

    def _drop(self, sock: socket.socket, why: bytes | None = None) -> None:
        """Close a client's connection; ``why``: a refusal sent first (non-blocking: a client
        whose queue is full does not get it)."""
        fd = sock.fileno()
        self.clients.pop(fd, None)
        self.seen.pop(fd, None)
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        if why is not None:
            try:
                sock.send(why)
            except OSError:
                pass
        sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            data, _, flags, _ = sock.recvmsg(MAX_REQUEST)  # one packet; descriptors sent with it are closed
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, flags = b"", 0
        if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self._drop(sock)  # closed, or not one of ours
            return
        try:
            rows = parse_request(data)
        except (ValueError, TypeError):
            self._drop(sock)  # not one of ours: no more conversation
            return
        self.seen[sock.fileno()] = time.monotonic()
        try:
            payload = self.reply(rows)
        except Exception as exc:  # our own failure: say it, keep serving
            payload = protocol.encode({"schema": SCHEMA, "error": _text(f"{type(exc).__name__}: {exc}")})
        try:
            sock.send(payload)  # non-blocking: a client that does not read its replies is dropped
        except OSError:
            self._drop(sock)

    # -- what is served
    def note(self, now: float | None = None, created: int | None = None) -> None:
        """Note ``(time, created_total)`` (for the records' ages)."""
        now = _now() if now is None else now
        created = registry().created_total if created is None else created
        t, c = self.notes_t, self.notes_c
        if len(c) >= 2 and c[-1] == c[-2] == created:
            t[-1] = now  # a run of one count keeps its first and last time
            return
        t.append(now)
        c.append(created)
        if len(c) > MAX_NOTES:  # thin the older half: coarser ages for old records
            half = len(c) // 2
            del t[1:half:2], c[1:half:2]

    def age(self, rid: int, now: float) -> tuple[float, float]:
        """(at least, at most) seconds since record ``rid`` was made."""
        i = bisect.bisect_left(self.notes_c, rid)  # the first note that counted it
        low = max(0.0, now - self.notes_t[i]) if i < len(self.notes_c) else 0.0
        high = now - self.notes_t[i - 1] if i > 0 else now - self.process_start
        return low, max(low, high)

    def scan_now(self) -> dict[str, Any]:
        """Scan the live records (the largest-records table and the holder count); the
        caller decides how often (``reply`` does it at most once per SCAN_INTERVAL_S)."""
        t0 = time.perf_counter()
        reg = registry()
        records = _records(reg)
        self.note()  # after the snapshot: every record in it is counted by this note
        stats = reg.stats()
        largest = heapq.nlargest(MAX_ROWS, records, key=_NBYTES)
        holders = _core.holder_count(records)
        devices = set(stats["live_bytes"]) | set(stats["pending_bytes"])
        if len(devices) == 1:  # one device holds all the bytes: no pass needed to count by device
            by_device = {devices.pop(): len(records)}
        else:
            by_device = {str(SLOT_DEVICES[s]): n for s, n in sorted(collections.Counter(map(_SLOT, records)).items())}
        rows = []
        for r in largest:
            items = r.holders
            rows.append({"id": r.id, "device": str(r.device), "nbytes": r.nbytes, "kind": r.kind,
                         "origin": _text(r.origin), "label": None if r.label is None else _text(r.label),
                         "state": r.state, "holders": [_text(h) for h in items[:MAX_HOLDERS]],
                         "holders_count": len(items)})
        took = (time.perf_counter() - t0) * 1e3
        others = stats["exports_outstanding"] + stats["remote_holders"] + stats["leases_in_transit"]
        return {"at": _now(), "took_ms": took, "records": len(records), "holders": holders,
                "tensors": max(0, holders - others),
                "records_by_device": by_device,
                "largest": rows}

    def reply(self, rows: int) -> bytes:
        """The encoded reply to a request for ``rows`` largest records (0: the
        aggregates and the cached scan, if any, with no new scan)."""
        t0 = time.perf_counter()
        if rows:
            with self.scan_lock:
                if self.scan is None or _now() - self.scan["at"] >= SCAN_INTERVAL_S:
                    self.scan = self.scan_now()
        body = self.aggregates()
        scan = self.scan
        now = body.pop("_now")
        if scan is None:
            body["scan"] = None
        else:
            largest = []
            for row in scan["largest"][:rows]:
                low, high = self.age(row["id"], now)
                largest.append({**row, "age_s": round(low, 3), "age_max_s": round(high, 3)})
            body["scan"] = {"age_s": round(now - scan["at"], 3), "took_ms": round(scan["took_ms"], 3),
                            "interval_s": SCAN_INTERVAL_S, "records": scan["records"],
                            "records_by_device": scan["records_by_device"], "holders": scan["holders"],
                            "largest": largest}
            body["holders"]["tensors"] = scan["tensors"]
        body["reply_ms"] = round((time.perf_counter() - t0) * 1e3, 4)
        return protocol.encode(body)

    def aggregates(self) -> dict[str, Any]:
        reg = registry()
        stats = reg.stats()
        now = _now()
        self.note(now, stats["created_total"])
        devices = sorted(set(stats["live_bytes"]) | set(stats["pending_bytes"]))
        return {
            "schema": SCHEMA, "pid": os.getpid(), "time": time.time(), "_now": now,
            "uptime_s": round(now - self.process_start, 3), "serving_s": round(now - self.started, 3),
            "version": __version__, "path": "compiled" if _core.compiled() else "pure-Python",
            "stats": stats,
            "devices": [{"device": d, "live_bytes": stats["live_bytes"].get(d, 0),
                         "pending_bytes": stats["pending_bytes"].get(d, 0)} for d in devices],
            "holders": {"exports": stats["exports_outstanding"], "remote_processes": stats["remote_holders"],
                        "leases": stats["leases_in_transit"], "tensors": None},
            **_pending_streams(reg),
            **_remote_processes(),
        }

    # -- ending
    def stop(self) -> None:
        self.stopping = True
        if self.wake_w >= 0:
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        self.close()

    def close(self) -> None:
        for sock in [self.sock, *self.clients.values()]:
            try:
                sock.close()
            except OSError:
                pass
        self.clients = {}
        self.seen = {}
        try:
            self.selector.close()
        except OSError:
            pass
        protocol.close_fds([fd for fd in (self.wake_r, self.wake_w) if fd >= 0])
        self.wake_r = self.wake_w = -1


def _records(reg: Any) -> list[Any]:
    """The records not yet released, in no particular order (the core's: no sort, which
    costs the pure path about 7 ms for 100,000 records)."""
    return _core.records_alive()


def parse_request(data: bytes) -> int:
    """The rows a request asks for; ValueError (or TypeError) for anything else."""
    message = protocol.decode(data)
    if not isinstance(message, list) or len(message) != 3 or message[0] != "inspect":
        raise ValueError("not an inspection request")
    if message[1] != SCHEMA:
        raise ValueError(f"schema {message[1]!r}, this library speaks {SCHEMA}")
    rows = message[2]
    if type(rows) is not int or not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [0, {MAX_ROWS}]")
    return rows


def _pending_streams(reg: Any) -> dict[str, Any]:
    """Releases waiting per stream (the reaper's queues, exchange/release.py): O(streams)."""
    items = sorted(reg._reaper.pending_by_stream(), key=lambda x: -x[1])
    rows = [{"stream": _text(repr(stream)), "device": _text(getattr(stream, "device", "") or ""), "releases": n}
            for stream, n in items[:MAX_LIST]]
    return {"pending_streams": rows, "pending_streams_more": max(0, len(items) - MAX_LIST)}


def _remote_processes() -> dict[str, Any]:
    """Other processes holding this one's records, from the sharing server's receivers
    (exchange/sharing/serving.py), if this process ever shared: their counts, kept by
    that server as holds come and go, so O(processes), not O(records held)."""
    serving = sys.modules.get("exchange.sharing.serving")
    srv = getattr(serving, "_SERVER", None)
    rows = []
    for peer in list(getattr(srv, "peers", {}).values()):
        records = len(peer.held)
        if records:
            rows.append({"pid": int(peer.pid), "records": records, "bytes": peer.bytes, "mappings": peer.mappings})
    rows.sort(key=lambda r: -r["bytes"])
    return {"remote_processes": rows[:MAX_LIST], "remote_processes_more": max(0, len(rows) - MAX_LIST)}


_SERVER: _Server | None = None
_LOCK = threading.Lock()


def serve_inspection() -> str:
    """Serve this process's registry to ``tensor-exchange top PID`` / ``snapshot PID``.

    Starts one daemon thread (``tx-inspect``) listening on an abstract Unix socket named
    from this process's pid and a random token (no other process can take it first;
    clients find it from the pid, ``addresses``); idempotent (a second call returns the
    same address). Only
    processes of this user and root are answered (the kernel's ``SO_PEERCRED``). While no
    client is connected the thread sleeps and costs nothing; at 100,000 live records a
    refresh of the aggregates costs this process about 0.02 ms, the largest-records scan
    (at most once per ``SCAN_INTERVAL_S`` = 5 s, whoever asks) about 12 to 16 ms
    (``tensor-exchange bench``, section "top").
    ``EXCHANGE_INSPECT=1`` in the environment does the same when ``exchange`` is imported.

    Returns the address in the usual notation of abstract sockets (``ss -x`` shows it
    so): ``"@tensor-exchange/inspect/<pid>/<32 hex digits>"``.

    Ownership: the server holds no record and no holder; it reads the registry's
    counters and, for the scan, a snapshot of its records that it drops at once.

    Raises
    ------
    OSError
        The socket cannot be made: no file descriptor is left.

    A forked child does not inherit the server; it may call this again.
    """
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.stopping:
            _SERVER = _Server()
        return _printable(_SERVER.address)


def stop_inspection() -> bool:
    """Stop serving (tests, the bench): closes the socket and its connections and ends
    the thread (waits up to 5 s for it). Returns True if it was serving."""
    global _SERVER
    with _LOCK:
        srv, _SERVER = _SERVER, None
    if srv is None:
        return False
    srv.stop()
    return True


def inspection_address() -> str | None:
    """The address this process serves inspection on, or None when it does not."""
    srv = _SERVER
    return None if srv is None else _printable(srv.address)


def _server() -> _Server | None:
    return _SERVER


def _after_fork_in_child() -> None:
    global _SERVER, _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    old, _SERVER = _SERVER, None
    if old is not None:  # the parent's sockets are not the child's to serve on; the thread is gone
        old.stopping = True
        try:
            old.close()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the client side ----------------------------------------------------------------------------
#: The largest pid a kernel can give (PID_MAX_LIMIT is 2**22; pid_t is 32 bits).
MAX_PID = 2**31 - 1
_PF_EXITING = 0x4  # /proc/<pid>/stat's flags (field 9): the process is on its way out


class _Dropped(InspectionError):
    """The server closed the connection (or turned it away as idle) while the process
    still runs: a new connection may be answered (``tensor-exchange top`` tries one)."""


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _owner(pid: int) -> int | None:
    """The uid owning process ``pid`` (/proc), or None when it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, flags, start time)`` of process ``pid`` from /proc/<pid>/stat (fields 3, 9
    and 22), or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read()
        # The name (field 2) may hold spaces and parentheses: the fields after its last ")".
        fields = text.rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[6]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


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
        return reply

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "InspectionClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def query(pid: int, rows: int = 20, timeout: float = 5.0) -> dict[str, Any]:
    """One reply from process ``pid`` (see ``InspectionClient``, which says what it raises)."""
    rows = _check_rows(rows)
    with InspectionClient(pid, timeout) as client:
        return client.request(rows)
