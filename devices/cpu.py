"""The CPU backend: 64-byte aligned host memory, host streams and host events.

``allocate(shared=True)`` takes a block of this process's shared-memory arenas, which
live with the host memory channel (exchange/channels/memfd.py); ``SharedMemory``,
``Block``, ``Arena``, ``Arenas``, ``ARENAS`` and ``arena_stats`` are still importable
from here, where they lived before.

DLPack has no CPU streams, but this library's stream-ordered release does: a host
stream is an ordered work queue run by one worker thread, with events, so async CPU
stages (and the tests) exercise the very release path CUDA uses.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from exchange import _core
from exchange.channels.memfd import ARENAS, Arena, Arenas, Block, SharedMemory, _libc, arena_stats  # noqa: F401
from exchange.device import CPU, Device, DeviceType
from exchange.errors import report_unraisable
from exchange.runtime import DEVICES, register

from .base import Allocation

__all__ = ["CPUBackend", "HostStream", "HostEvent", "SharedMemory", "Arena", "Block", "arena_stats", "ALIGNMENT",
           "numpy_view"]

#: Byte alignment of every CPU allocation (a cache line; AVX-512 loads).
ALIGNMENT = 64

_handles = itertools.count(1)


class HostEvent:
    """An event on a host stream: set when the stream's worker reaches it."""

    __slots__ = ("_done", "_callbacks", "_lock")

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self._callbacks: list[Callable[[], Any]] = []
        self._lock = threading.Lock()
        if done:
            self._done.set()

    def query(self) -> bool:
        """True once all work queued before this event has run. Never blocks."""
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the event is reached (``timeout`` in seconds; None waits forever)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"host event not reached within {timeout} s")

    def add_done_callback(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` once the event is reached, on the thread that reaches it (at once
        if it already has). The registry uses this to release memory without polling."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _set(self) -> None:
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback must not stop the stream's worker
                pass


class _QueueState:
    """A host stream's last recorded event, handed out again while nothing was queued
    after it (``last_seq``: the queue's ``seq`` when it was recorded)."""

    __slots__ = ("last_event", "last_seq")

    def __init__(self) -> None:
        self.last_event: HostEvent | None = None
        self.last_seq = -1


# A queue item (exchange._core.HostQueue, the compiled core's or its twin) is ``fn(*args)``
# with a tag: a posted task is put in its context with no tag, a submitted task is
# ``_run`` with its own Future (the tag), an event's ``_set`` (tag _EVENT), a wait's
# ``synchronize`` (tag _WAIT). The tag says how to drop the item (``_drop``).
_EVENT, _WAIT = "event", "wait"
_copy_context = contextvars.copy_context


def _run(fn: Callable[..., Any], args: tuple, future: Any, ctx: Any) -> None:
    """A submitted task: its outcome goes to its Future."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = ctx.run(fn, *args)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _unraisable(exc: BaseException, fn: Callable[..., Any]) -> None:
    # A task queued by HostStream.post: nobody waits on a Future for its error.
    report_unraisable(exc, "Exception in a task posted to a host stream", fn)


def _drop(fn: Callable[..., Any], tag: Any) -> None:
    """Skip a queued item: a task's future is cancelled, an event is reached (nothing
    queued before it will run any more), a wait or a posted task is skipped."""
    if tag is _EVENT:
        fn()
    elif tag is not None and tag is not _WAIT:
        tag.cancel()


class HostStream:
    """An ordered host work queue on the CPU, run by one worker thread.

    ``submit(fn, *args)`` queues ``fn(*args)`` and returns a ``concurrent.futures.Future``;
    the task runs in the submitter's ``contextvars`` context (so ``tx.track()`` counts
    what it makes). ``record()`` returns a HostEvent reached once everything queued
    before it has run (the same event again while nothing was queued after it);
    ``wait(event)`` makes later work wait for an event of any stream (the host is not
    blocked); ``synchronize()`` blocks the host until the queue so far has run.
    ``handle`` is a process-unique int (DLPack passes no stream for CPU data).
    The worker thread ends when the stream is closed or garbage-collected.

    At interpreter exit the work still queued runs (up to ``EXIT_TIMEOUT`` seconds for
    all streams together, from an exit hook that runs before threads are torn down);
    what is left then is dropped with one ExchangeWarning (futures cancelled), and work
    submitted after that (from a daemon thread) gets a cancelled future. In a
    forked child a stream made before the fork is closed: its queued work is the
    parent's and does not run there (events reached, futures cancelled).
    """

    def __init__(self, device: Device = CPU) -> None:
        self.device = device
        self.handle = next(_handles)
        self._queue = _core.HostQueue()
        self._lock = threading.Lock()  # record() and close(): a put is atomic by itself
        self._closed = False
        self._forked = False
        self._exiting = False  # closed by the exit hook
        self._drained = HostEvent()  # reached when the worker has run everything queued
        self._state = _QueueState()
        # The worker holds only the queue, never the stream, so a dropped stream can be
        # collected; its loop is the queue's own (in C with the compiled core: this is
        # the pipelined chain's hand-off, paid per stage and batch).
        self._thread = threading.Thread(
            target=self._queue.run, args=(self._drained._set, _unraisable, _drop), name=f"tx-host-stream-{self.handle}",
            daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.close)
        _watch(self)  # last: the exit hook may see the stream from another thread at once

    @property
    def pending(self) -> int:
        """Items queued and not yet finished."""
        return self._queue.pending

    def submit(self, fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
        """Queue ``fn(*args)``; RuntimeError after ``close()``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self._queue.put(_run, (fn, args, future, _copy_context()), future):
            if self._exiting:  # closed by the exit hook: work from a daemon thread is not run
                future.cancel()
                return future
            raise RuntimeError(self._closed_message())
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` with no Future, in a copy of the caller's context (as
        ``submit``): for callers that handle its outcome themselves (``fn`` must not
        raise: an exception it lets out is reported as unraisable and the stream goes
        on). RuntimeError after ``close()``; after the exit hook closed the stream, the
        call is dropped."""
        self.post_in(_copy_context(), fn, *args)

    def post_in(self, context: contextvars.Context, fn: Callable[..., Any], *args: Any) -> None:
        """``post``, run as ``context.run(fn, *args)``: what ``tx.Chain`` hands a batch
        to its next stage with (one context per stream and run, not a copy per batch;
        a Future costs more than the hand-off). ``context`` must not be entered
        elsewhere while the task runs (``Context.run`` refuses, and the refusal is
        reported as unraisable): give each stream its own."""
        if not self._queue.put_in(context, fn, *args) and not self._exiting:
            raise RuntimeError(self._closed_message())

    def poster(self) -> Callable[..., bool]:
        """``put(context, fn, *args) -> bool``: ``post_in`` as one call into the stream's
        queue, with no frame of its own, for a caller that posts per item (``tx.Chain``'s
        hand-off from stage to stage); False where ``post_in`` would raise or drop (the
        stream is closed, or was made before a fork): call ``post_in`` then to say why."""
        return self._queue.put_in

    def record(self) -> HostEvent:
        q = self._queue
        if q.seq == q.done:  # nothing queued or running: reached already
            return HostEvent(done=True)
        with self._lock:
            if self._closed:
                return self._drained  # reached once the work queued before close() has run
            state = self._state
            last = state.last_event
            if last is not None and state.last_seq == q.seq and not last.query():
                return last  # nothing queued since: the same point in the stream
            event = HostEvent()
            if not q.put(event._set, (), _EVENT):
                return self._drained
            state.last_event, state.last_seq = event, q.seq
            return event

    def wait(self, event: Any) -> None:
        if not event.query() and not self._queue.put(event.synchronize, (), _WAIT):
            raise RuntimeError(self._closed_message())

    def synchronize(self) -> None:
        """Block until the work queued so far has run. Called from the stream's own worker
        (inside a task) it returns at once: the work queued before that task has run."""
        if threading.current_thread() is self._thread:
            return
        self.record().synchronize()

    def close(self, timeout: float | None = None) -> None:
        """Run the work queued so far, then stop the worker thread (waiting up to
        ``timeout`` seconds for it; None: as long as it takes). Afterwards ``record()``
        gives an event reached when that work is done, and ``submit()`` raises
        RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _closed_message(self) -> str:
        if self._forked:
            return f"{self!r} was made before this process was forked; its worker is the parent's: create a new stream"
        return f"{self!r} is closed; create a new stream"

    def _after_fork_in_child(self) -> None:
        # Locks may be held by threads that do not exist here: new ones. The queued items
        # are the parent's work: dropped, never run twice.
        self._lock = threading.Lock()
        self._closed = self._forked = True
        for fn, _, tag in self._queue.after_fork():
            if tag is _EVENT:
                fn.__self__._lock = threading.Lock()
            _drop(fn, tag)
        self._drained._lock = threading.Lock()
        self._drained._set()

    def __repr__(self) -> str:
        return f"HostStream(handle={self.handle})"


# -- exit and fork -----------------------------------------------------------------------------
#: Seconds the exit hook gives the work still queued on all host streams together
#: (environment: EXCHANGE_EXIT_TIMEOUT).
EXIT_TIMEOUT = 5.0
_streams: "weakref.WeakSet[HostStream]" = weakref.WeakSet()


def _watch(stream: HostStream) -> None:
    _streams.add(stream)


def _exit_timeout() -> float:
    try:
        return max(0.0, float(os.environ.get("EXCHANGE_EXIT_TIMEOUT", EXIT_TIMEOUT)))
    except ValueError:
        return EXIT_TIMEOUT


def _drain_at_exit() -> None:
    """Let the queued work run until the deadline, drop the rest with one warning, stop
    every worker."""
    timeout = _exit_timeout()
    deadline = time.monotonic() + timeout
    streams = [s for s in list(_streams) if not s._closed]
    for s in streams:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            s.record().synchronize(left)
        except TimeoutError:
            break
    dropped = 0
    for s in streams:
        if s.pending:
            dropped += s.pending
            s._queue.dropping = True
    if dropped:
        import warnings

        from exchange.errors import ExchangeWarning

        warnings.warn(f"{dropped} host-stream item(s) were still queued at exit after {timeout:g} s and were dropped "
                      "(their futures cancelled); set EXCHANGE_EXIT_TIMEOUT (seconds) to wait longer",
                      ExchangeWarning, stacklevel=1)
    for s in streams:
        # A task already running finishes first: a framework torn down under it aborts.
        s._exiting = True
        s.close(timeout=max(1.0, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    for s in list(_streams):
        s._after_fork_in_child()


# The exit hook runs before the interpreter joins its threads (exchange/runtime.py): a
# worker still inside a framework call at teardown can abort the process.
register("at_exit", "devices.cpu.host_streams", _drain_at_exit, DEVICES)
register("after_fork_in_child", "devices.cpu.host_streams", _after_fork_in_child, DEVICES)


class DefaultHostStream:
    """The CPU's default stream: work runs at once, on the calling thread."""

    device = CPU
    handle = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def record(self) -> HostEvent:
        return HostEvent(done=True)

    def wait(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "HostStream(default)"


DEFAULT_STREAM = DefaultHostStream()


def numpy_view(address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
               dtype: Any = None) -> np.ndarray:
    """A NumPy array over host memory at ``address`` (element 0), ``strides`` in elements.
    With ``dtype`` None the elements are raw bytes (``V<itemsize>``), enough to copy."""
    npdt = np.dtype(dtype) if dtype is not None else np.dtype(f"V{itemsize}")
    if any(s == 0 for s in shape):
        return np.empty(shape, npdt)
    lo = sum(st * (n - 1) for st, n in zip(strides, shape) if st < 0)
    hi = sum(st * (n - 1) for st, n in zip(strides, shape) if st > 0)
    span = (hi - lo + 1) * itemsize
    base = address + lo * itemsize
    buf = (ctypes.c_char * span).from_address(base)
    return np.ndarray(shape, npdt, buffer=buf, offset=-lo * itemsize,
                      strides=tuple(s * itemsize for s in strides))


class CPUBackend:
    """Host memory (``kDLCPU``): NumPy-owned 64-byte-aligned blocks, host streams."""

    name = "cpu"
    device_types = (DeviceType.kDLCPU,)

    def allocate(self, nbytes: int, device: Device = CPU, stream: Any = None, shared: bool = False) -> Allocation:
        """``nbytes`` bytes, aligned to ALIGNMENT. The memory is ready at once (no stream
        work); it is freed when the registry releases the record (``free``).
        ``shared=True``: a block of this process's shared-memory arenas (``Arenas``),
        which ``tx.share`` hands to other processes without a copy (uninitialised, as
        NumPy's ``empty``: a reused block holds what this process last wrote there)."""
        if shared:
            block = ARENAS.allocate(nbytes)
            return Allocation(block.address, nbytes, CPU, owner=block)
        raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        start = raw.ctypes.data
        address = (start + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        return Allocation(address, nbytes, CPU, owner=raw)

    def free(self, allocation: Allocation, stream: Any = None) -> None:
        owner, allocation.owner = allocation.owner, None  # NumPy frees its block with its last reference
        if isinstance(owner, (Block, SharedMemory)):
            owner.close()

    def default_stream(self, device: Device = CPU) -> DefaultHostStream:
        return DEFAULT_STREAM

    def create_stream(self, device: Device = CPU) -> HostStream:
        return HostStream(CPU)

    def stream_from_dlpack(self, value: int | None, device: Device = CPU) -> None:
        if value is not None:
            raise ValueError(
                f"stream={value!r} given for CPU data; DLPack allows only stream=None for kDLCPU"
            )
        return None

    def to_dlpack_stream(self, stream: Any, device: Device = CPU) -> None:
        return None  # DLPack passes no stream for CPU data

    def as_stream(self, obj: Any, device: Device = CPU) -> Any:
        if isinstance(obj, (HostStream, DefaultHostStream)):
            return obj
        raise TypeError(f"expected a host stream (tx.create_stream('cpu')), got {obj!r}")

    def order_key(self, stream: Any) -> tuple[str, int]:
        """A host stream's queue is its own (``handle`` is unique in the process; the
        default stream, 0, runs work at once on the calling thread)."""
        return ("cpu", stream.handle)

    def copy(self, dst: Any, src: Any, stream: Any = None) -> Any:
        """Element-wise copy between host-accessible tensors of equal shape and dtype:
        at once (returns None), or queued on host stream ``stream`` (returns it: the
        caller adds it to both records' streams)."""

        def run() -> None:
            d = numpy_view(dst.data_ptr, dst.shape, dst.strides, dst.dtype.itemsize)
            s = numpy_view(src.data_ptr, src.shape, src.strides, src.dtype.itemsize)
            np.copyto(d, s)

        if stream is None or isinstance(stream, DefaultHostStream):
            run()
            return None
        stream.submit(run)
        return stream
