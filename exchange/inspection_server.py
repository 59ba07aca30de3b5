"""The serving side of inspection: this process's registry, served on request.

Owns: the listening socket and its clients, registered on the process's one background
thread (exchange/runtime.py); the notes of ``(time, created_total)`` that bound the
records' ages; the cached largest-records scan; the reply; ``serve_inspection``,
``stop_inspection`` and ``inspection_address``. What a client sends is parsed by
exchange/inspection_protocol.py; exchange/inspection.py says how it all works.
"""

from __future__ import annotations

import bisect
import collections
import errno
import heapq
import operator
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from typing import Any

from . import _core
from ._version import __version__
from .device import SLOT_DEVICES
from .inspection_protocol import (IDLE_S, MAX_CLIENTS, MAX_HOLDERS, MAX_LIST, MAX_NOTES, MAX_REQUEST, MAX_ROWS,
                                  NOTE_INTERVAL_S, SCAN_INTERVAL_S, SCHEMA, TOKEN_HEX, _printable, _text, address,
                                  parse_request)
from .registry import registry
from .runtime import INSPECTION, Lazy, loop
from .sharing import protocol

_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)  # the clock /proc/<pid>/stat's start time is on
_NBYTES = operator.attrgetter("nbytes")
_SLOT = operator.attrgetter("device._slot")


def _now() -> float:
    return time.clock_gettime(_CLOCK)


def _refusal(why: str, **more: Any) -> bytes:
    return protocol.encode({"schema": SCHEMA, "refused": why, **more})  # type: ignore[arg-type]


_FULL = _refusal(f"too many clients are connected (it serves {MAX_CLIENTS} at once, and drops one that sends "
                 f"no request for {IDLE_S:g} s): try again")
_IDLE = _refusal(f"no request for {IDLE_S:g} s: connection closed (connect again)", idle=True)



class _Server:
    """The listening socket and its clients on the process's background thread
    (exchange/runtime.py), the notes and the cached scan. Its callbacks and timers run on
    that thread; ``stop`` hands the closing to it."""

    def __init__(self) -> None:
        self.loop = loop()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # Random, so that no other process can take it first (a name from the pid alone
        # could be bound by another user before this one serves); clients find it
        # (``addresses``) and check who answers.
        self.address = address(os.getpid(), secrets.token_hex(TOKEN_HEX // 2))
        self.clients: dict[int, socket.socket] = {}
        self.seen: dict[int, float] = {}  # per client: time.monotonic() of its connection or last request
        self.stopping = False
        self.ticking = False  # a tick is due on the thread (notes, idle clients)
        self.notes_t: list[float] = []
        self.notes_c: list[int] = []
        self.scan: dict[str, Any] | None = None
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
            self.note()
            self.loop.register(self.sock, selectors.EVENT_READ, self._accept)
        except BaseException:
            self.close()
            raise

    # -- on the thread
    def _tick(self) -> None:
        """While clients are connected: drop the idle ones and note ``(time, created_total)``
        once every NOTE_INTERVAL_S."""
        self.ticking = False
        if self.stopping or not self.clients:
            return
        left = self._drop_idle()
        if self.clients:
            self.note()
            self._tick_in(min(NOTE_INTERVAL_S, left))

    def _tick_in(self, seconds: float) -> None:
        if not self.ticking:
            self.ticking = True
            self.loop.call_at(time.monotonic() + seconds, self._tick)

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

    def _accept(self, server: socket.socket) -> None:
        try:
            sock, _ = server.accept()
        except OSError as exc:
            if exc.errno in protocol.FD_ERRNOS + (errno.ENOBUFS, errno.ENOMEM):
                # No descriptor for it: the connection waits in the backlog. Stop watching the
                # socket for a moment (as serving.py does); watching it now would wake this
                # thread again and again until a descriptor is free.
                self.loop.unregister(server)
                self.loop.call_at(time.monotonic() + protocol.ACCEPT_RETRY_S, self._resume)
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
        self.loop.register(sock, selectors.EVENT_READ, self._serve)
        self._tick_in(min(NOTE_INTERVAL_S, IDLE_S))

    def _resume(self) -> None:
        """Watch the listening socket again after a pause for want of descriptors."""
        if not self.stopping:
            try:
                self.loop.register(self.sock, selectors.EVENT_READ, self._accept)
            except (KeyError, ValueError, OSError):
                pass

    def _drop(self, sock: socket.socket, why: bytes | None = None) -> None:
        """Close a client's connection; ``why``: a refusal sent first (non-blocking: a client
        whose queue is full does not get it)."""
        fd = sock.fileno()
        self.clients.pop(fd, None)
        self.seen.pop(fd, None)
        self.loop.unregister(sock)
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
            **_sets(),
        }

    # -- ending
    def stop(self) -> None:
        """Stop serving: the socket and its connections are closed on the thread (waits up
        to 5 s for it), so that no callback of this server runs after."""
        self.stopping = True
        if self.loop.on_thread():
            self.close()
            return
        done = threading.Event()

        def close() -> None:
            try:
                self.close()
            finally:
                done.set()

        self.loop.post(close)
        if not done.wait(5.0):
            self.close()

    def close(self) -> None:
        for sock in [self.sock, *self.clients.values()]:
            self.loop.unregister(sock)
            try:
                sock.close()
            except OSError:
                pass
        self.clients = {}
        self.seen = {}

    def after_fork_in_child(self) -> None:
        # The parent's sockets are not the child's to serve on; the thread is gone (and
        # the runtime's loop, reset first, no longer watches them).
        self.stopping = True
        self.close()


def _records(reg: Any) -> list[Any]:
    """The records not yet released, in no particular order (the core's: no sort, which
    costs the pure path about 7 ms for 100,000 records)."""
    return _core.records_alive()


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
    srv = None if serving is None else serving._SERVER.peek()
    rows = []
    for peer in list(getattr(srv, "peers", {}).values()):
        records = len(peer.held)
        if records:
            rows.append({"pid": int(peer.pid), "records": records, "bytes": peer.bytes, "mappings": peer.mappings})
    rows.sort(key=lambda r: -r["bytes"])
    return {"remote_processes": rows[:MAX_LIST], "remote_processes_more": max(0, len(rows) - MAX_LIST)}


#: The fields of a set's row in a reply, from ``exchange.sets.stats()``: name -> int or str.
SET_FIELDS = {"name": str, "role": str, "version": int, "nbytes": int, "readers": int, "live_versions": int}


def _sets() -> dict[str, Any]:
    """The tensor sets this process publishes or reads (``exchange.sets.stats()``), only
    when the sets package is already loaded: serving inspection never imports it.
    ``readers`` and ``live_versions`` are counts (a list there is counted)."""
    sets = sys.modules.get("exchange.sets")
    if sets is None:
        return {}
    rows = []
    for row in sets.stats()[:MAX_LIST]:
        out = {}
        for key, kind in SET_FIELDS.items():
            value = row.get(key)
            if kind is int and isinstance(value, (list, tuple, set, dict)):
                value = len(value)
            out[key] = _text(value) if kind is str else int(value or 0)
        rows.append(out)
    return {"sets": rows}


_SERVER: Lazy[_Server] = Lazy(_Server, "inspection.server", INSPECTION)


def serve_inspection() -> str:
    """Serve this process's registry to ``tensor-exchange top PID`` / ``snapshot PID``.

    Listens on an abstract Unix socket named from this process's pid and a random token
    (no other process can take it first; clients find it from the pid, ``addresses``),
    watched by the process's one background thread (``tx-runtime``, exchange/runtime.py,
    started now if sharing has not started it); idempotent (a second call returns the
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
    return _printable(_SERVER.get().address)


def stop_inspection() -> bool:
    """Stop serving (tests, the bench): closes the socket and its connections on the
    background thread (waits up to 5 s for it; the thread goes on, for sharing). Returns
    True if it was serving."""
    srv = _SERVER.take()
    if srv is None:
        return False
    srv.stop()
    return True


def inspection_address() -> str | None:
    """The address this process serves inspection on, or None when it does not."""
    srv = _SERVER.peek()
    return None if srv is None else _printable(srv.address)


def _server() -> _Server | None:
    return _SERVER.peek()
