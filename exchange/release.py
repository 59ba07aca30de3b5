"""Stream-ordered release: the reaper.

A DLPack deleter takes no stream, so "nobody holds this any more" says nothing about
GPU (or host-stream) work still queued on the memory. When a record's last holder goes,
the registry records an event on every stream that used the memory and hands the
record here. The reaper completes the release (backend free, or the producer's
deleter) once all those events have completed. It never blocks the host to do so: it
polls on registry calls and from one background thread; ``collect()`` is the only wait.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .registry import Record

__all__ = ["Reaper"]

#: Seconds between polls of the background thread while releases are pending.
POLL_INTERVAL = 0.001


class Reaper:
    """Pending releases, each a record and the events it waits for."""

    def __init__(self, finish: Callable[["Record"], None]) -> None:
        self._finish = finish
        self._pending: list[tuple["Record", list[Any]]] = []
        self._finishing = 0  # taken off _pending by a poll, release still running
        # Reentrant for the same reason as the registry's lock: a finaliser run by a
        # garbage collection inside poll() may start a release that calls add().
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._collecting = False

    def __len__(self) -> int:
        return len(self._pending) + self._finishing

    def add(self, record: "Record", events: list[Any]) -> None:
        with self._lock:
            self._pending.append((record, events))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="tx-reaper", daemon=True)
                self._thread.start()
            self._wake.notify()

    def poll(self) -> int:
        """Complete every pending release whose events have all completed; returns how
        many completed. Never blocks on an event."""
        if not self._pending:
            return 0
        with self._lock:
            ready, waiting = [], []
            for item in self._pending:
                (ready if _all_done(item[1]) else waiting).append(item)
            self._pending = waiting
            self._finishing += len(ready)
        try:
            for record, _ in ready:
                self._finish(record)
        finally:
            with self._lock:
                self._finishing -= len(ready)
        return len(ready)

    def collect(self, timeout: float | None = None) -> bool:
        """Wait until no release is pending (``timeout`` in seconds, None = no limit).
        Returns True when nothing is pending. Raises RuntimeError if another collect()
        is already running."""
        with self._lock:
            if self._collecting:
                raise RuntimeError(
                    "collect() is already running in another thread; wait for it to return instead of calling it twice"
                )
            self._collecting = True
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                self.poll()
                with self._lock:  # both read at once: a poll moves items from one to the other
                    idle = not self._pending and not self._finishing  # none waiting, none mid-release
                if idle:
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(POLL_INTERVAL)
        finally:
            self._collecting = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                self.poll()
            except Exception:  # the reaper must survive anything; finish() already warns
                pass
            time.sleep(POLL_INTERVAL)


def _all_done(events: list[Any]) -> bool:
    for event in events:
        try:
            if not event.query():
                return False
        except Exception:
            # An event that cannot be queried any more (its context is gone) orders nothing.
            pass
    return True
