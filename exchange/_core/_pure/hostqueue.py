"""A host stream's ordered work queue and its worker's loop: the pure-Python twin of the
compiled core's ``HostQueue`` (exchange/native/hostqueue.c), the same API and behaviour.

An item is ``fn(*args)``, run in ``context`` when one was given (``put_in``). A put
checks, counts and queues under the queue's lock (the compiled one needs none: nothing
runs between those steps while it holds the GIL); one worker runs ``run``.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any, Callable

from ...errors import report_unraisable


class HostQueue:
    """``put(fn, args, tag)`` and ``put_in(context, fn, *args)`` queue work (False once
    closed); ``close()`` refuses further puts and stops the worker after what is queued;
    ``run(on_stop, on_error, drop)`` is the worker's loop; ``after_fork()`` takes the
    queued items out unrun in a forked child. ``seq`` (items put), ``done`` (items
    finished), ``pending``, ``closed``, ``dropping`` (settable)."""

    __slots__ = ("_items", "_lock", "seq", "done", "dropping", "closed")

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.seq = 0
        self.done = 0
        self.dropping = False
        self.closed = False

    @property
    def pending(self) -> int:
        """Items queued or running."""
        return self.seq - self.done

    def put(self, fn: Callable[..., Any], args: tuple, tag: Any) -> bool:
        if type(args) is not tuple or not callable(fn):
            raise TypeError("put(fn, args, tag) takes a callable, a tuple and a tag")
        return self._put((fn, args, tag, None))

    def put_in(self, context: Any, fn: Callable[..., Any], *args: Any) -> bool:
        if type(context) is not contextvars.Context or not callable(fn):
            raise TypeError("put_in(context, fn, *args) takes a contextvars.Context and a callable")
        return self._put((fn, args, None, context))

    def _put(self, item: tuple) -> bool:
        with self._lock:
            if self.closed:
                return False
            self.seq += 1
            self._items.put(item)
        return True

    def close(self) -> bool:
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            self._items.put(None)
        return True

    def run(self, on_stop: Callable[[], Any], on_error: Callable[[BaseException, Any], Any],
            drop: Callable[[Any, Any], Any]) -> None:
        get = self._items.get
        while True:
            item = get()
            if item is None:
                _quietly(on_stop)
                return
            fn, args, tag, context = item
            if self.dropping:
                _quietly(drop, fn, tag)
            else:
                try:
                    if context is None:
                        fn(*args)
                    else:
                        context.run(fn, *args)
                except BaseException as exc:
                    _quietly(on_error, exc, fn)
            # the task's arguments go now, not when the next item comes
            item = fn = args = tag = context = None
            self.done += 1

    def after_fork(self) -> list[tuple]:
        self._lock = threading.Lock()  # the old one may be held by a thread that is not here
        self.closed = self.dropping = True
        out = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                out.append(item[:3])
        self.done = self.seq
        return out


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """What the compiled core does with a hook that raises: report it, go on."""
    try:
        fn(*args)
    except BaseException as exc:
        report_unraisable(exc, "Exception ignored in", fn)  # PyErr_WriteUnraisable's words
