"""The CPU backend: 64-byte aligned host memory, host streams and host events, and
shared memory other processes can map (``SharedMemory``; ``Arenas`` carve shared
tensors from a few large ones, for ``tx.share``).

DLPack has no CPU streams, but this library's stream-ordered release does: a host
stream is an ordered work queue run by one worker thread, with events, so async CPU
stages (and the tests) exercise the very release path CUDA uses.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import ctypes
import errno
import itertools
import mmap
import os
import queue
import stat
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable

import numpy as np

from exchange.device import CPU, Device, DeviceType
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
    """What a host stream's queue holds, shared with its worker: ``seq``, the items put
    (counted under the stream's lock), ``done``, the items the worker has finished
    (written by the worker alone, so it takes no lock per item: ``seq - done`` are
    queued or running), the last event recorded (handed out again while nothing was
    queued after it), and whether queued tasks are being dropped."""

    __slots__ = ("seq", "done", "last_event", "last_seq", "dropping")

    def __init__(self) -> None:
        self.seq = 0
        self.done = 0
        self.last_event: HostEvent | None = None
        self.last_seq = -1
        self.dropping = False  # at exit past the deadline, or in a forked child

    @property
    def pending(self) -> int:
        """Items queued and not yet finished."""
        return self.seq - self.done


# A queue item is ``(fn, args, tag)``, run as ``fn(*args)``: a posted task is its
# context's ``run`` with ``(task, *task_args)`` (tag None), a submitted task ``_run`` with
# its own Future (the tag), an event's ``_set`` (tag _EVENT), a wait's ``synchronize``
# (tag _WAIT). The tag says how to drop the item (``_drop``).
_EVENT, _WAIT = "event", "wait"
_copy_context = contextvars.copy_context


def _worker(q: "queue.SimpleQueue[Any]", drained: HostEvent, state: _QueueState) -> None:
    # Holds only the queue, never the stream, so a dropped stream can be collected. Every
    # item is one call with no frame between (this loop is the pipelined chain's
    # hand-off, and every step in it counts there); only a posted task can raise.
    get = q.get
    while True:
        item = get()
        if item is None:
            drained._set()
            return
        if state.dropping:
            _drop(item)
        else:
            fn, args, tag = item
            try:
                fn(*args)
            except BaseException as exc:
                _unraisable(exc, args[0])
            fn = args = tag = None
        item = None  # drop the task's arguments now, not when the next task arrives
        state.done += 1


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
    sys.unraisablehook(types.SimpleNamespace(  # the fields UnraisableHookArgs has
        exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__,
        err_msg="Exception in a task posted to a host stream", object=fn))


def _drop(item: tuple) -> None:
    """Skip a queued item: a task's future is cancelled, an event is reached (nothing
    queued before it will run any more), a wait or a posted task is skipped."""
    fn, _, tag = item
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
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._forked = False
        self._exiting = False  # closed by the exit hook
        self._drained = HostEvent()  # reached when the worker has run everything queued
        self._state = _QueueState()
        self._thread = threading.Thread(
            target=_worker, args=(self._queue, self._drained, self._state), name=f"tx-host-stream-{self.handle}", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        _watch(self)  # last: the exit hook may see the stream from another thread at once

    def _put(self, item: Any) -> bool:
        with self._lock:
            return self._put_locked(item)

    def _put_locked(self, item: Any) -> bool:
        if self._closed:
            return False
        self._state.seq += 1
        self._queue.put(item)
        return True

    def submit(self, fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
        """Queue ``fn(*args)``; RuntimeError after ``close()``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self._put((_run, (fn, args, future, _copy_context()), future)):
            if self._exiting:  # closed by the exit hook: work from a daemon thread is not run
                future.cancel()
                return future
            raise RuntimeError(self._closed_message())
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` with no Future: for callers that handle its outcome
        themselves (``fn`` must not raise: an exception it lets out is reported as
        unraisable and the stream goes on). What ``tx.Chain`` hands a batch to its next
        stage with (a Future costs more than the hand-off). RuntimeError after
        ``close()``; after the exit hook closed the stream, the call is dropped."""
        with self._lock:  # _put written out: this is the pipelined chain's hand-off
            if not self._closed:
                self._state.seq += 1
                self._queue.put((_copy_context().run, (fn, *args), None))
                return
        if not self._exiting:
            raise RuntimeError(self._closed_message())

    def record(self) -> HostEvent:
        state = self._state
        if state.seq == state.done:  # nothing queued or running: reached already
            return HostEvent(done=True)
        with self._lock:
            if self._closed:
                return self._drained  # reached once the work queued before close() has run
            last = state.last_event
            if last is not None and state.last_seq == state.seq and not last.query():
                return last  # nothing queued since: the same point in the stream
            event = HostEvent()
            self._put_locked((event._set, (), _EVENT))
            state.last_event, state.last_seq = event, state.seq
            return event

    def wait(self, event: Any) -> None:
        if not event.query() and not self._put((event.synchronize, (), _WAIT)):
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
        state = self._state
        state.dropping = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                if item[2] is _EVENT:
                    item[0].__self__._lock = threading.Lock()
                _drop(item)
        state.done = state.seq
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
        if s._state.pending:
            dropped += s._state.pending
            s._state.dropping = True
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


_MAP_FAILED = ctypes.c_void_p(-1).value
_fd_limit_raised = False
_LIBC: Any = None


def _libc() -> Any:
    # libc's mmap/munmap: a mapping at an address of our choosing to unmap when the
    # registry says so (Python's mmap objects refuse to close while buffers exist).
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mprotect.restype = ctypes.c_int
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


#: F_SEAL_FUTURE_WRITE (Linux 5.1; Python's fcntl has no name for it): no new writable
#: mapping (EPERM), no write(), no hole punched, no mprotect to writable (EACCES), for
#: every descriptor of the file, a reopened /proc/self/fd/N included; mappings made
#: writable before it keep working.
F_SEAL_FUTURE_WRITE = 0x10


class SharedMemory:
    """Host memory other processes can map (exchange/sharing/): an anonymous memory file
    (``memfd_create``, Linux), sealed against shrinking and growing, mapped shared.

    ``fd`` (the file, owned), ``address`` (int, page-aligned), ``nbytes`` (the mapped
    bytes, at least 1: an mmap cannot be empty), ``writable`` (this mapping),
    ``readonly`` (the file is sealed against writes: no process can map it writable or
    write it, whatever descriptor it holds). The memory exists while any process maps it
    or holds its file: it has no name (nothing in /dev/shm), and the kernel removes it
    when the last mapping and descriptor go, SIGKILL included. ``close()`` unmaps and
    closes the file (once; the registry calls it through ``CPUBackend.free`` after the
    last holder). Sizes in bytes.

    The seals are planned at creation: memory made writable (``create``) is sealed
    against new seals too, so no process it is shared with can seal it against its
    owner; memory made to be read-only (``create(readonly=True)``) waits for
    ``seal_readonly()`` once it is filled.
    """

    __slots__ = ("fd", "address", "nbytes", "writable", "readonly", "__weakref__")

    def __init__(self, fds: list[int], nbytes: int, writable: bool, readonly: bool = False) -> None:
        # Takes the one descriptor of ``fds`` (the caller's list owns it until then: no
        # moment where nobody or both own it, whatever interrupts) and maps it. OSError
        # (the file is closed) if mapping fails; any exception here (KeyboardInterrupt
        # included) leaves nothing mapped or open.
        self.fd, self.address, self.nbytes, self.writable, self.readonly = -1, 0, nbytes, writable, readonly
        try:
            self.fd = fds.pop()
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.address = _libc().mmap(None, nbytes, prot, mmap.MAP_SHARED, self.fd, 0) or 0
            if self.address == _MAP_FAILED:
                self.address = 0
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {nbytes} shared bytes failed: {os.strerror(err)}")
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, nbytes: int, readonly: bool = False) -> "SharedMemory":
        """New zero-filled shared memory of ``nbytes`` bytes (1 if 0), mapped writable
        here. ``readonly=True``: to be sealed read-only by ``seal_readonly()`` once
        filled. OSError when the system refuses (no memory, too many open files)."""
        if not hasattr(os, "memfd_create"):
            raise OSError(errno.ENOSYS, "shared memory (tx.empty(shared=True), tx.share) needs Linux's memfd_create")
        import fcntl

        if not hasattr(fcntl, "F_ADD_SEALS"):
            seals = 0
        elif readonly:
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # F_SEAL_FUTURE_WRITE and F_SEAL_SEAL come once filled
        else:
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        if readonly and not seals:
            raise OSError(errno.ENOSYS, "read-only shared memory needs file seals (Linux memfd, F_ADD_SEALS)")
        _raise_fd_limit()
        size = max(1, nbytes)
        fds: list[int] = []
        try:
            fds.append(os.memfd_create("tensor-exchange", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals else 0)))
            os.ftruncate(fds[0], size)
            if seals:  # no process can resize it under another's mapping (that would SIGBUS)
                fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, seals)
            return cls(fds, size, True)
        except BaseException:
            _close_all(fds)  # (nothing left there once the mapping took it)
            raise

    def seal_readonly(self) -> None:
        """Seal memory made by ``create(readonly=True)`` against writes, for good: no
        process can write it any more, this one included (its mapping is made read-only
        too). OSError when the kernel lacks F_SEAL_FUTURE_WRITE (Linux 5.1)."""
        import fcntl

        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            raise OSError(exc.errno, f"sealing shared memory read-only failed ({os.strerror(exc.errno)}): sharing "
                                     "read-only memory needs Linux 5.1's F_SEAL_FUTURE_WRITE") from None
        if _libc().mprotect(ctypes.c_void_p(self.address), self.nbytes, mmap.PROT_READ) == 0:
            self.writable = False
        self.readonly = True

    def seal_future_writes(self) -> None:
        """Seal memory made by ``create(readonly=True)`` against writes by any mapping made
        from now on (``F_SEAL_FUTURE_WRITE``): other processes can only map it read-only;
        this process's own mapping, made before, stays writable. OSError as
        ``seal_readonly``."""
        import fcntl

        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            raise OSError(exc.errno, f"sealing shared memory read-only failed ({os.strerror(exc.errno)}): sharing "
                                     "read-only memory needs Linux 5.1's F_SEAL_FUTURE_WRITE") from None
        self.readonly = True

    @classmethod
    def from_fd(cls, fds: list[int], need: int, writable: bool) -> "SharedMemory":
        """Map a shared-memory file received from another process: the one descriptor
        of the list ``fds``, taken from it (closed if anything fails). Writable when asked
        and the file is not sealed against writes, else read-only. ValueError when the
        file is smaller than ``need`` bytes, is not a regular file, or is not sealed
        against shrinking (``F_SEAL_SHRINK``, which this library's memory always has): a
        file its sender could still truncate would make this mapping fault (SIGBUS) when
        read past the new end."""
        try:
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size < max(1, need):
                raise ValueError(f"the shared memory file holds {st.st_size} bytes, the handle needs {need}")
            if not _sealed_against_shrinking(fds[0]):
                raise ValueError("the shared memory file is not sealed against shrinking (F_SEAL_SHRINK), as this "
                                 "library's always is: its sender could truncate it under this mapping; refused")
            readonly = _sealed_against_writes(fds[0])
            _raise_fd_limit()
            return cls(fds, st.st_size, writable and not readonly, readonly)
        except BaseException:
            _close_all(fds)  # (nothing left there once the mapping took it)
            raise

    def close(self) -> None:
        """Unmap and close the file; nothing if already closed. Never raises."""
        address, self.address = self.address, 0
        fd, self.fd = self.fd, -1
        if address:
            _libc().munmap(address, self.nbytes)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (f"SharedMemory(fd={self.fd}, nbytes={self.nbytes}, {'writable' if self.writable else 'read-only'}"
                f"{', sealed read-only' if self.readonly else ''})")


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _sealed_against_shrinking(fd: int) -> bool:
    import fcntl

    if not hasattr(fcntl, "F_GET_SEALS"):  # no seals on this system: its senders cannot seal either
        return True
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # not a memfd
        return False


def _sealed_against_writes(fd: int) -> bool:
    import fcntl

    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except (OSError, AttributeError):  # not a memfd, or no seals here
        return False
    return bool(seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE))


def _raise_fd_limit() -> None:
    # Every shared allocation holds one open file: lift the soft limit on open files to
    # the hard limit once (the usual soft limit, 1024, would cap live shared tensors).
    global _fd_limit_raised
    if _fd_limit_raised:
        return
    _fd_limit_raised = True
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


class Block:
    """A block of an Arena: ``nbytes`` bytes at ``offset`` in ``arena`` (``address`` here).
    What a shared CPU record owns (``Allocation.owner``); it goes back to its arena when
    the registry frees the record, after its last holder in any process."""

    __slots__ = ("arena", "offset", "nbytes", "address", "size_class")

    def __init__(self, arena: "Arena", offset: int, nbytes: int, size_class: int) -> None:
        self.arena, self.offset, self.nbytes, self.size_class = arena, offset, nbytes, size_class
        self.address = arena.memory.address + offset

    @property
    def readonly(self) -> bool:
        return self.arena.readonly

    def close(self) -> None:
        """Give the block back to its arena (once; never raises)."""
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.put_back(self)

    def __repr__(self) -> str:
        return f"Block(arena #{self.arena.id if self.arena else '-'}, offset={self.offset}, nbytes={self.nbytes})"


class Arena:
    """A large SharedMemory of this process that shared CPU tensors are carved from
    (``tx.empty(..., shared=True)``, the copies ``tx.share`` and the multiprocessing
    reducer make). A receiver maps a whole arena once (exchange/sharing/) and keeps it;
    it can then read every block in it, and write every block of a writable arena.

    ``readonly``: an arena of read-only blocks, sealed against writes
    (``F_SEAL_FUTURE_WRITE``) right after this process mapped it writable: no other
    process can map it writable, and this process fills a block before handing it on.
    Blocks of size class ``c`` (a power of two, bytes) are carved at offsets that are
    multiples of ``c`` (page-aligned from 4 KiB up); a freed block waits in its class's
    free list for the next allocation of that class (the memory stays touched: no
    first-touch cost again). An arena of one large block (``dedicated``) holds one
    allocation above ``Arenas.SMALL_MAX`` and is kept for a later one of its size class."""

    __slots__ = ("id", "memory", "readonly", "pid", "top", "dedicated", "in_use", "__weakref__")

    def __init__(self, aid: int, nbytes: int, readonly: bool, dedicated: bool) -> None:
        self.memory = SharedMemory.create(nbytes, readonly=readonly)  # sealed against shrinking and growing
        if readonly:
            try:  # this mapping stays writable: this process fills each block before it goes out
                self.memory.seal_future_writes()
            except BaseException:
                self.memory.close()
                raise
        self.id, self.readonly, self.dedicated = aid, readonly, dedicated
        self.pid = os.getpid()  # a forked child's copy is not its to carve
        self.top = 0  # bytes carved so far
        self.in_use = 0  # blocks out

    def put_back(self, block: Block) -> None:
        ARENAS.put_back(self, block)


def _size_class(nbytes: int) -> int:
    return 1 << max(6, (max(1, nbytes) - 1).bit_length())  # at least 64 bytes (ALIGNMENT)


class Arenas:
    """This process's arenas and their free blocks (one lock; allocation and free are
    O(1): a free list per size class, and a bump in the newest arena of its kind).

    ``ARENA_BYTES`` (64 MiB): an arena of small blocks (address space: pages are touched
    as blocks are written). ``SMALL_MAX`` (4 MiB): larger allocations get a dedicated
    arena, rounded up to a power of two too (address space: pages beyond what is written
    cost nothing); up to ``CACHE_BYTES`` (1 GiB) of dedicated arenas freed here wait for
    an allocation of the same size class, the oldest closed beyond that. Freed blocks of
    small arenas stay in their size class for reuse (never split nor merged, nor given
    back to the system while the process lives): ``stats()`` says how much there is."""

    ARENA_BYTES = 64 << 20
    SMALL_MAX = 4 << 20
    CACHE_BYTES = 1 << 30

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.by_id: dict[int, Arena] = {}
        self.free: dict[tuple[int, bool], list[tuple[Arena, int]]] = {}  # (size class, readonly) -> (arena, offset)
        self.current: dict[bool, Arena] = {}  # readonly -> the small arena being carved
        self.cached: "collections.OrderedDict[tuple[int, bool], list[Arena]]" = collections.OrderedDict()
        self.cached_bytes = 0

    def allocate(self, nbytes: int, readonly: bool = False) -> Block:
        """A block of at least ``nbytes`` bytes (uninitialised: zero in a new arena, the
        last contents in a reused block). OSError when the system refuses memory."""
        size = _size_class(nbytes)
        if size > self.SMALL_MAX:
            return self._dedicated(nbytes, size, readonly)
        with self.lock:
            free = self.free.get((size, readonly))
            if free:
                arena, offset = free.pop()
                arena.in_use += 1
                return Block(arena, offset, nbytes, size)  # a new object: an old one's close() does nothing
            arena = self.current.get(readonly)
            if arena is None or arena.top + size > arena.memory.nbytes:
                arena = self._new(self.ARENA_BYTES, readonly, False)
                self.current[readonly] = arena
            offset = (arena.top + size - 1) // size * size
            arena.top = offset + size
            arena.in_use += 1
            return Block(arena, offset, nbytes, size)

    def _dedicated(self, nbytes: int, size: int, readonly: bool) -> Block:
        # An arena of the whole size class (a power of two, past SMALL_MAX: whole pages),
        # so that a freed one serves any later request of its class, not only one of
        # exactly its page count.
        with self.lock:
            kept = self.cached.get((size, readonly))
            if kept:
                arena = kept.pop()
                if not kept:
                    del self.cached[(size, readonly)]
                self.cached_bytes -= size
            else:
                arena = self._new(size, readonly, True)
            arena.in_use = 1
            return Block(arena, 0, nbytes, size)

    def _new(self, nbytes: int, readonly: bool, dedicated: bool) -> Arena:
        arena = Arena(next(self.ids), nbytes, readonly, dedicated)
        self.by_id[arena.id] = arena
        return arena

    def put_back(self, arena: Arena, block: Block) -> None:
        """A freed block goes back to its arena (the registry's free, on any thread,
        at any time: never raises). A forked child's blocks of its parent's arenas are
        dropped: those arenas are the parent's to carve."""
        try:
            if arena.pid != os.getpid():
                return
            with self.lock:
                arena.in_use -= 1
                if not arena.dedicated:  # ready to hand out again
                    self.free.setdefault((block.size_class, arena.readonly), []).append((arena, block.offset))
                    return
                key = (block.size_class, arena.readonly)
                self.cached.setdefault(key, []).append(arena)
                self.cached.move_to_end(key)
                self.cached_bytes += block.size_class
                while self.cached_bytes > self.CACHE_BYTES and self.cached:  # the oldest go
                    old_key, kept = next(iter(self.cached.items()))
                    oldest = kept.pop(0)
                    if not kept:
                        del self.cached[old_key]
                    self.cached_bytes -= oldest.memory.nbytes
                    del self.by_id[oldest.id]
                    oldest.memory.close()  # (receivers unmap it once idle)
        except Exception:
            pass

    def stats(self) -> dict[str, int]:
        """``arenas`` (this process's), ``bytes`` (their size), ``blocks_in_use`` (blocks
        handed out and not yet freed, in any process), ``cached_bytes`` (dedicated arenas
        waiting for reuse)."""
        with self.lock:
            mine = [a for a in self.by_id.values() if a.pid == os.getpid()]
            return {"arenas": len(mine), "bytes": sum(a.memory.nbytes for a in mine),
                    "blocks_in_use": sum(a.in_use for a in mine), "cached_bytes": self.cached_bytes}

    def after_fork_in_child(self) -> None:
        # The parent's arenas stay mapped here for the records the child inherited; new
        # blocks come from the child's own arenas (two processes carving one arena would
        # hand out the same bytes twice).
        self.lock = threading.Lock()
        self.free, self.current, self.cached, self.cached_bytes = {}, {}, collections.OrderedDict(), 0


ARENAS = Arenas()
os.register_at_fork(after_in_child=lambda: ARENAS.after_fork_in_child())


def arena_stats() -> dict[str, int]:
    """This process's shared-memory arenas (``Arenas.stats``)."""
    return ARENAS.stats()


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
