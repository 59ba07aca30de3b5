"""The CUDA backend's streams and events: ``CUDAStream`` (a ``cuda.core.Stream`` on one
device, the per-thread default stream's thread rules included), ``CUDAEvent`` (recorded
from a per-device pool, so hot paths create none once warm), ``_Current`` (a device's
primary context made current for a block) and the counters of host syncs and events
created. A helper of exchange/devices/cuda.py, which re-exports its public names; it
reaches the backend only through the object it is given.
"""

from __future__ import annotations

import collections
import importlib
import sys
import threading
from typing import Any

from exchange.device import Device

from . import cuda_driver as _driver

__all__ = ["CUDAEvent", "CUDAStream", "LEGACY_DEFAULT_STREAM", "PER_THREAD_DEFAULT_STREAM", "NO_SYNC",
           "HOST_SYNCS", "EVENTS_CREATED", "default_core_streams"]

#: DLPack's stream integers for CUDA (the python_spec's "stream" argument of __dlpack__).
LEGACY_DEFAULT_STREAM = 1
PER_THREAD_DEFAULT_STREAM = 2
NO_SYNC = -1


class _Counter:
    """A count kept from any thread: the host-blocking calls this module makes (stream,
    event and free-time synchronisations; ``CUDABackend.host_syncs``) and the CUDA
    events it creates (``CUDABackend.events_created``)."""

    __slots__ = ("count", "_lock")

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:  # += on an int is not atomic across threads
            self.count += 1


HOST_SYNCS = _Counter()
EVENTS_CREATED = _Counter()


# -- events and streams ------------------------------------------------------------------------
class CUDAEvent:
    """A CUDA event recorded on a stream (``core``: the ``cuda.core.Event``).

    ``query()`` is True once all work queued before it has finished (never blocks);
    ``synchronize()`` blocks the host until then.

    Events come from a pool of the device (``CUDAStream.record``): when the last
    reference to a CUDAEvent goes, its ``core`` goes back to be recorded again, unless
    something else still holds that ``core`` (then it is left to it, never reused)."""

    __slots__ = ("core", "device", "_pool")

    def __init__(self, core: Any, device: Device, pool: "collections.deque[Any] | None" = None) -> None:
        self.core = core
        self.device = device
        self._pool = pool

    def __del__(self) -> None:
        # Two references to ``core`` means ours and getrefcount's argument: nobody else
        # can see the event, so re-recording it cannot change what anyone waits for.
        # (A stream that waited on it needs nothing more of it: cuStreamWaitEvent takes
        # the work recorded at the time of the call.)
        pool = self._pool
        if pool is not None:
            try:
                if sys.getrefcount(self.core) <= 2:
                    pool.append(self.core)
            except Exception:  # interpreter shutdown: the event is simply destroyed
                pass

    def query(self) -> bool:
        return bool(self.core.is_done)

    def synchronize(self) -> None:
        HOST_SYNCS.add()
        try:
            self.core.sync()
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def __repr__(self) -> str:
        return f"CUDAEvent(device='{self.device}')"


class _Current:
    """Make device ``ordinal``'s primary context current for a ``with`` block, then put
    back what was current (nothing is changed when it already is)."""

    __slots__ = ("_backend", "_ordinal", "_previous")

    def __init__(self, backend: Any, ordinal: int) -> None:
        self._backend = backend
        self._ordinal = ordinal
        self._previous: Any = None

    def __enter__(self) -> None:
        self._previous = self._backend._make_current(self._ordinal)

    def __exit__(self, *exc: Any) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            self._backend._driver.cuCtxSetCurrent(previous)


class CUDAStream:
    """A CUDA stream (``core``: the ``cuda.core.Stream``) on CUDA device ``device``.

    ``handle`` is the ``cudaStream_t`` as an int (1: legacy default stream, 2: per-thread
    default stream). ``record()`` returns a CUDAEvent; ``wait(event)`` makes later work
    on this stream wait for it (``cuStreamWaitEvent``, no host block);
    ``synchronize()`` blocks the host until the work queued so far is done. Implements
    ``__cuda_stream__``, so CuPy, PyTorch and cuda.core accept it.

    The per-thread default stream is a different stream on every thread, under one
    handle: its CUDAStream belongs to one thread (``thread``; None for every other
    stream). From another thread, which cannot name that stream, ``record()`` and
    ``synchronize()`` go to the legacy default stream instead, whose work begins only
    after all work queued before it on every blocking stream of the context, that
    thread's per-thread default stream included (CUDA's stream synchronisation rules).

    A stream wrapped from a foreign handle (an int) does not keep that stream alive; one
    wrapped from an object (a PyTorch or CuPy stream) keeps the object.
    """

    __slots__ = ("core", "device", "handle", "thread", "_backend", "_owner", "__weakref__")

    def __init__(self, backend: Any, core: Any, device: Device, handle: int, owner: Any = None,
                 thread: threading.Thread | None = None) -> None:
        self.core = core
        self.device = device
        self.handle = handle
        self.thread = thread
        self._backend = backend
        self._owner = owner

    def _here(self) -> "CUDAStream":
        """The stream that this one's work is ordered by from the calling thread: itself,
        but the legacy default stream for another thread's per-thread default stream."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return self
        return self._backend.default_stream(self.device)

    def record(self) -> CUDAEvent:
        """Record an event after the work queued so far (never blocks the host).

        The event is one of the device's pool, recorded again (``cuEventRecord``); a
        new one is created only when the pool is empty, so the hot paths (a hop's
        handshake, a release) create none once warm: creating events there can stall
        the host for milliseconds (sglang#39960)."""
        here = self._here()
        if here is not self:  # another thread's per-thread default stream
            return here.record()
        pool = self._backend._event_pools[self.device.id]
        try:
            reused = pool.pop()
        except IndexError:
            reused = None
        try:
            with _Current(self._backend, self.device.id):
                core = self.core.record(reused)  # None: cuda.core creates one
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc
        if reused is None:
            EVENTS_CREATED.add()
        return CUDAEvent(core, self.device, pool)

    def wait(self, event: Any) -> None:
        """Make later work on this stream wait for ``event`` (a CUDAEvent or a
        ``cuda.core.Event``; an event of another kind is accepted only once it has
        completed). Never blocks the host. TypeError for anything else."""
        if isinstance(event, CUDAEvent):
            self._wait_core(event.core)  # no local of ours keeps event.core: it may go back to the pool
        elif isinstance(event, self._backend._cc.Event):
            self._wait_core(event)
        elif callable(getattr(event, "query", None)) and event.query():
            return
        else:
            raise TypeError(
                f"a CUDA stream can wait only on a CUDA event (a CUDA stream's record()), got {event!r}; "
                "synchronize host work before handing data to a CUDA stream"
            )

    def _wait_core(self, core_event: Any) -> None:
        try:
            with _Current(self._backend, self.device.id):
                self.core.wait(core_event)
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream so far has finished."""
        if self._here() is not self:  # another thread's per-thread default stream: after all of it
            self.record().synchronize()
            return
        HOST_SYNCS.add()
        try:
            with _Current(self._backend, self.device.id):
                self.core.sync()
        except _driver.CUDA_ERRORS as exc:
            raise _driver.device_error(exc) from exc

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def order_key(self) -> tuple[Any, ...]:
        """What names the ordered queue ``record()`` lands on from the calling thread
        (exchange/release.py, and the handshake through ``CUDABackend.order_key``): the
        per-thread default stream is a different stream on every thread, and another
        thread's is reached through the legacy default stream."""
        here = self._here()
        if here is not self:
            return here.order_key()
        if self.thread is not None:
            return ("cuda", self.device.id, self.handle, self.thread)
        return ("cuda", self.device.id, self.handle)

    def __repr__(self) -> str:
        if self.handle == LEGACY_DEFAULT_STREAM:
            what = "legacy default"
        elif self.handle == PER_THREAD_DEFAULT_STREAM:
            what = "per-thread default"
        else:
            what = f"0x{self.handle:x}"
        return f"CUDAStream({what}, device='{self.device}')"


def default_core_streams(cc: Any) -> tuple[Any, Any]:
    """cuda.core's legacy and per-thread default stream objects."""
    legacy = getattr(cc, "LEGACY_DEFAULT_STREAM", None)
    per_thread = getattr(cc, "PER_THREAD_DEFAULT_STREAM", None)
    if legacy is None or per_thread is None:
        try:
            module = importlib.import_module(cc.__name__ + "._stream")
            if legacy is None:
                legacy = getattr(module, "LEGACY_DEFAULT_STREAM", None)
            if per_thread is None:
                per_thread = getattr(module, "PER_THREAD_DEFAULT_STREAM", None)
        except ImportError:
            pass
    if legacy is None:
        legacy = cc.Stream.from_handle(LEGACY_DEFAULT_STREAM)
    if per_thread is None:
        per_thread = cc.Stream.from_handle(PER_THREAD_DEFAULT_STREAM)
    return legacy, per_thread
