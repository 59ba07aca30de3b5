"""The one background thread of sharing in a process (``tx-share``) and its selector.

Owns: the thread, started on first need (a share or a connection to a sender) and asleep
in a selector while nothing happens; the tasks other threads post to it; its timers.
The serving side (serving.py) and the receiving side (receiving.py) register their
sockets and pidfds here. A forked child gets none of it (``after_fork_in_child``).
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from typing import Any, Callable

from ..registry import _warn
from .protocol import close_fds


class Loop:
    """The thread and selector. ``post(task)`` runs ``task()`` on the thread soon;
    ``register`` watches a file object with a callback ``callback(fileobj)`` (``modify``,
    ``unregister``: from any thread);
    ``call_at(when, fn)`` runs ``fn()`` on the thread at monotonic time ``when``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.selector: selectors.BaseSelector | None = None
        self.thread: threading.Thread | None = None
        self.tasks: list[Callable[[], None]] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.wake_r = self.wake_w = -1

    def start(self) -> None:
        """Start the thread (once). All or nothing: a failure (no file descriptor left,
        say) closes what it made, so a later call starts afresh and nothing leaks."""
        with self.lock:
            if self.thread is not None:
                return
            selector = selectors.DefaultSelector()
            wake_r = wake_w = -1
            try:
                wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                selector.register(wake_r, selectors.EVENT_READ, self._woken)
                thread = threading.Thread(target=self._run, args=(selector,), name="tx-share", daemon=True)
                self.selector, self.wake_r, self.wake_w = selector, wake_r, wake_w
                thread.start()
            except BaseException:
                self.selector, self.wake_r, self.wake_w = None, -1, -1
                selector.close()
                close_fds([fd for fd in (wake_r, wake_w) if fd >= 0])
                raise
            self.thread = thread

    def _run(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                events = selector.select(self._due())
            except OSError:
                return  # closed after fork
            for key, _ in events:
                try:
                    key.data(key.fileobj)
                except Exception as exc:  # the thread must survive anything
                    _warn(f"tx.share serving thread: {type(exc).__name__}: {exc}")

    def _due(self) -> float | None:
        """Run the timers that are due; seconds the selector may sleep (None: until
        something happens)."""
        while True:
            with self.lock:
                if not self.timers:
                    return None
                self.timers.sort(key=lambda t: t[0])
                when, fn = self.timers[0]
                left = when - time.monotonic()
                if left > 0:
                    return left
                self.timers.pop(0)
            try:
                fn()
            except Exception as exc:
                _warn(f"tx.share serving thread: {type(exc).__name__}: {exc}")

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        with self.lock:
            self.timers.append((when, fn))
        self.wake()

    def post(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the thread soon."""
        with self.lock:
            self.start()
            self.tasks.append(task)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _woken(self, fd: int) -> None:
        try:
            os.read(fd, 4096)
        except OSError:
            pass
        with self.lock:
            tasks, self.tasks = self.tasks, []
        for task in tasks:
            try:
                task()
            except Exception as exc:
                _warn(f"tx.share serving thread: {type(exc).__name__}: {exc}")

    def register(self, fileobj: Any, events: int, callback: Callable[[Any], None]) -> None:
        self.start()
        self.selector.register(fileobj, events, callback)

    def modify(self, fileobj: Any, events: int, callback: Callable[[Any], None]) -> None:
        """Change what a registered file object is watched for (KeyError if it is not)."""
        self.selector.modify(fileobj, events, callback)

    def unregister(self, fileobj: Any) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError, OSError, AttributeError):
            pass

    def after_fork_in_child(self) -> None:
        # The selector and the wake-up pipe are the parent's; the thread did not survive.
        close_fds([fd for fd in (self.wake_r, self.wake_w) if fd >= 0])
        if self.selector is not None:
            try:
                self.selector.close()
            except OSError:
                pass


_LOOP: Loop | None = None
_LOOP_LOCK = threading.Lock()


def loop() -> Loop:
    """This process's Loop (made on first use; its thread starts on first need)."""
    global _LOOP
    current = _LOOP
    if current is None:
        with _LOOP_LOCK:
            if _LOOP is None:
                _LOOP = Loop()
            current = _LOOP
    return current


def _after_fork_in_child() -> None:
    global _LOOP, _LOOP_LOCK
    _LOOP_LOCK = threading.Lock()  # another thread may have held it at the fork
    old, _LOOP = _LOOP, None
    if old is not None:
        try:
            old.after_fork_in_child()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
