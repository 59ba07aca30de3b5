"""Stream-ordered release: the reaper.

A DLPack deleter takes no stream, so "nobody holds this any more" says nothing about
GPU (or host-stream) work still queued on the memory. When a record's last holder goes,
the registry records an event on every stream that used the memory and hands the
record here with those events. The reaper completes the release (backend free, or the
producer's deleter) once all of them have completed. It never blocks the host.

Cost. Events recorded on one stream complete in the order they were recorded, so each
stream gets one first-in-first-out queue of (event, pending release) and only its head
is ever queried: completing a release costs O(1) per event, and nothing scans all that
is pending. A release that waits on several streams completes when its last one does.

Waking. Nothing pending: the reaper's thread sleeps. Events that can say when they are
reached (host events, ``add_done_callback``) wake it for their own queue. Events that
can only be queried (CUDA) are polled at their queue heads with a backoff from
``POLL_MIN`` to ``POLL_MAX`` seconds, reset whenever a release is added or completes.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterable, Protocol

__all__ = ["Reaper", "Releasable", "POLL_MIN", "POLL_MAX"]


class Releasable(Protocol):
    """What the reaper reads of a record it holds (``exchange.registry.Record`` is one;
    the registry builds on this module, never the other way round)."""

    nbytes: int
    device: Any

#: Polling backoff (seconds) for queues whose events cannot wake the reaper (CUDA).
POLL_MIN = 0.0001
POLL_MAX = 0.004


class _Pending:
    """One release waiting for ``remaining`` events (one per stream queue)."""

    __slots__ = ("record", "remaining", "nbytes", "device")

    def __init__(self, record: Releasable, remaining: int) -> None:
        self.record = record
        self.remaining = remaining
        self.nbytes = record.nbytes
        self.device = record.device


class _Queue:
    """The pending events of one stream, oldest first."""

    __slots__ = ("entries", "wakes", "stream")

    def __init__(self, stream: Any, wakes: bool) -> None:
        self.entries: collections.deque[tuple[Any, _Pending]] = collections.deque()
        self.wakes = wakes  # its events call back when reached: no polling
        self.stream = stream  # kept alive while events on it are pending


def order_key(stream: Any) -> Any:
    """What names the ordered queue ``stream.record()`` lands on: events with one key
    complete in order. A stream may say (``stream.order_key()``: the per-thread default
    stream is a different stream on every thread); else its type, device and handle."""
    own = getattr(stream, "order_key", None)
    if own is not None:
        return own()
    return (type(stream), getattr(stream, "device", None), getattr(stream, "handle", id(stream)))


class Reaper:
    """Pending releases in per-stream FIFO queues, completed by one background thread.

    ``finish(record)`` is the registry's completion (it runs the release and forgets
    the record); it is called once per record, outside the reaper's lock.
    """

    def __init__(self, finish: Callable[[Releasable], None], on_count: Callable[[Any, int], None]) -> None:
        self._finish = finish
        self._on_count = on_count  # on_count(device, +-nbytes): pending bytes per device
        # Reentrant: a finaliser run by a garbage collection inside a locked section may
        # start a release that calls add().
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # pending count fell, or work arrived
        self._queues: dict[Any, _Queue] = {}
        self._signalled: list[Any] = []  # keys of queues whose events called back
        self._polled: set[Any] = set()  # keys of queues to query at a backoff
        self._count = 0  # releases not yet finished (queued or mid-release)
        self._backoff = POLL_MIN
        self._thread: threading.Thread | None = None
        self._stopped = False

    def __len__(self) -> int:
        return self._count

    def pending_by_stream(self) -> list[tuple[Any, int]]:
        """(stream, releases waiting on it) per stream with any, O(streams)."""
        with self._lock:
            return [(q.stream, len(q.entries)) for q in self._queues.values() if q.entries]

    # -- adding ---------------------------------------------------------------------------
    def add(self, record: Releasable, events: Iterable[tuple[Any, Any]]) -> None:
        """Wait for ``events`` (pairs of stream and the event just recorded on it) before
        finishing ``record``. Finishes it at once when every event has completed."""
        events = list(events)
        pending = _Pending(record, len(events))
        wake_on: list[tuple[Any, Any]] = []
        with self._lock:
            self._count += 1
            self._on_count(pending.device, pending.nbytes)
            for stream, event in events:
                key = order_key(stream)
                queue = self._queues.get(key)
                if queue is None and _done(event):
                    pending.remaining -= 1  # an empty queue and a reached event: nothing to wait for
                    continue
                if queue is None:
                    wakes = callable(getattr(event, "add_done_callback", None))
                    queue = self._queues[key] = _Queue(stream, wakes)
                    if not wakes:
                        self._polled.add(key)
                # One callback per event is enough: events a stream hands out again
                # (nothing queued since) are the tail already.
                if queue.wakes and (not queue.entries or queue.entries[-1][0] is not event):
                    wake_on.append((key, event))
                queue.entries.append((event, pending))
            if pending.remaining == 0:
                ready = [pending]
            else:
                ready = []
                self._backoff = POLL_MIN
                self._start_locked()
                if self._polled:
                    self._changed.notify_all()
        for key, event in wake_on:  # outside the lock: a reached event calls back at once
            event.add_done_callback(lambda key=key: self._signal(key))
        if ready:
            self._complete(ready)

    def _signal(self, key: Any) -> None:
        # Called by a host event when reached, on the thread that reached it.
        with self._lock:
            self._signalled.append(key)
            self._changed.notify_all()

    def _start_locked(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="tx-reaper", daemon=True)
            self._thread.start()

    # -- completing -----------------------------------------------------------------------
    def _drain_locked(self, key: Any, ready: list[_Pending]) -> None:
        """Pop the reached events at the head of one queue; releases whose last event
        that was go to ``ready``."""
        queue = self._queues.get(key)
        if queue is None:
            return
        entries = queue.entries
        while entries:
            event, pending = entries[0]
            if not _done(event):
                break
            entries.popleft()
            pending.remaining -= 1
            if pending.remaining == 0:
                ready.append(pending)
        if not entries:
            del self._queues[key]
            self._polled.discard(key)

    def _complete(self, ready: list[_Pending]) -> None:
        for pending in ready:
            try:
                self._finish(pending.record)
            except BaseException:  # finish() warns itself; the reaper survives anything
                pass
            with self._lock:
                self._count -= 1
                self._on_count(pending.device, -pending.nbytes)
                self._changed.notify_all()

    def poll(self) -> int:
        """Complete what is ready in every queue now (heads only); returns how many
        releases completed. Never blocks on an event."""
        ready: list[_Pending] = []
        with self._lock:
            for key in list(self._queues):
                self._drain_locked(key, ready)
            self._signalled.clear()
        self._complete(ready)
        return len(ready)

    def _run(self) -> None:
        while True:
            ready: list[_Pending] = []
            with self._lock:
                while not self._stopped and not self._signalled and not self._polled:
                    self._changed.wait()
                if self._stopped:
                    return
                if not self._signalled:  # only polled queues: back off between queries
                    self._changed.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, POLL_MAX)
                signalled, self._signalled = self._signalled, []
                for key in {*signalled, *self._polled}:
                    self._drain_locked(key, ready)
                if ready:
                    self._backoff = POLL_MIN
            self._complete(ready)

    # -- waiting --------------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``done()`` (read under the lock, re-read whenever a release
        completes) or ``timeout`` seconds pass; returns ``done()``. Where no background
        thread runs (stopped at exit), the waiting thread completes what is ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._thread is None or self._stopped:
                self.poll()
            with self._lock:
                if done():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(0.05 if left is None else min(left, 0.05))

    def collect(self, timeout: float | None = None) -> bool:
        """Wait until no release is pending (``timeout`` in seconds, None = no limit).
        Returns True when nothing is pending. Any number of threads may wait at once."""
        return self.wait(lambda: self._count == 0, timeout)

    # -- shutdown and fork ----------------------------------------------------------------
    def stop(self) -> int:
        """Stop the background thread; returns how many releases are still pending."""
        with self._lock:
            self._stopped = True
            self._changed.notify_all()
            return self._count

    def reset_after_fork(self) -> list[Releasable]:
        """In a forked child: the parent's threads are gone (no stream worker will reach
        an event recorded before the fork, no reaper thread runs) and the locks may be
        held by threads that no longer exist. Start afresh; returns the records whose
        release was pending, for the registry to settle."""
        records = {id(p): p.record for q in self._queues.values() for _, p in q.entries}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._queues, self._signalled, self._polled = {}, [], set()
        self._count, self._thread, self._backoff, self._stopped = 0, None, POLL_MIN, False
        return list(records.values())


def _done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:
        # An event that cannot be queried any more (its context is gone) orders nothing.
        return True
