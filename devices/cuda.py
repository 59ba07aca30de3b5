"""The CUDA backend: device memory (``kDLCUDA``), pinned host memory (``kDLCUDAHost``)
and managed memory (``kDLCUDAManaged``), CUDA streams and events.

Built on NVIDIA cuda-python: ``cuda.core`` for devices, streams, events and memory
resources, ``cuda.bindings`` (the generated driver bindings) for the few calls
``cuda.core`` has no object for (raw-pointer ``cuMemcpyAsync``, ``cuMemsetD8Async``,
``cuMemAllocManaged``, the current context), and CuPy for the one kernel this backend
needs (strided copies). Nothing here is imported by ``import exchange``: this module
imports no CUDA package at import time, and ``load()`` (called by
``exchange.devices.base.get_backend`` on first use of a CUDA device) does the imports and the
probe.

Memory (sizes in bytes; addresses are ints in the unified address space):

- ``kDLCUDA``: ``cuda.core.DeviceMemoryResource`` of the device, i.e. the driver's
  stream-ordered pool (``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``). Allocation is
  ordered on the allocation stream: the memory may be used on that stream at once, and
  on other streams after they wait for it (``Tensor.__dlpack__`` does that wait).
  Devices without memory pools fall back to ``Device.memory_resource`` (synchronous).
- ``kDLCUDAHost``: ``cuda.core.LegacyPinnedMemoryResource`` (``cuMemAllocHost``):
  synchronous, so the memory is host-ready when ``allocate`` returns.
- ``kDLCUDAManaged``: ``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)`` through
  ``cuda.bindings``: synchronous, host-ready when ``allocate`` returns.

Ownership and release: ``allocate`` returns an ``Allocation`` whose ``owner`` (a
``cuda.core.Buffer``, or a managed block) keeps the memory; the registry calls
``free(allocation, stream)`` once the last holder is gone *and* the events it recorded
on every stream that used the memory have completed (exchange/release.py). ``free``
then returns device memory to its pool on ``stream`` (``Buffer.close(stream)``:
``cuMemFreeAsync``), and pinned / managed memory after synchronising ``stream`` (which
has no work left on the memory by then). With ``EXCHANGE_DEBUG_POISON=1`` it first
fills the memory with ``POISON_BYTE`` on that stream, so a reader that was not ordered
before the release sees the pattern instead of its data.

Streams: a ``CUDAStream`` wraps a ``cuda.core.Stream``; ``handle`` is the
``cudaStream_t`` as an int, 1 for the legacy default stream and 2 for the per-thread
default stream (DLPack's numbers). Every call that needs a context makes the stream's
device current (its primary context) for the call and restores what was current.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import math
import os
import re
import pickle
import sys
import threading
from typing import Any

from exchange.layout import is_c_contiguous
from exchange.device import Device, DeviceType
from exchange.errors import BackendUnavailableError, DeviceError

from .base import Allocation

__all__ = [
    "load",
    "CUDABackend",
    "CUDAStream",
    "CUDAEvent",
    "CUDAOutOfMemoryError",
    "POISON_ENV",
    "POISON_BYTE",
    "UNORDERED_FREE_ENV",
    "EVENT_POOL_SIZE",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "NO_SYNC",
    "driver_cuda_major",
    "install_hint",
]

#: ``EXCHANGE_DEBUG_POISON=1``: ``free`` fills memory with POISON_BYTE before releasing it.
POISON_ENV = "EXCHANGE_DEBUG_POISON"
#: The byte written by the poison-on-release debug option (float32 0xA5A5A5A5 is about -2.9e-16).
POISON_BYTE = 0xA5
#: Test-only: ``EXCHANGE_TEST_UNORDERED_FREE=1`` plants a premature free. ``free_after``
#: then frees device memory on the allocation stream without making it wait for the
#: other streams that used the memory, so a kernel still reading it on another stream
#: reads freed memory. ci/gpu-check.sh sets it in one process to show that
#: compute-sanitizer's memcheck catches such a free; never set it anywhere else.
UNORDERED_FREE_ENV = "EXCHANGE_TEST_UNORDERED_FREE"
#: Completed CUDA events kept per device for re-recording (see CUDAStream.record).
EVENT_POOL_SIZE = 1024
#: DLPack's stream integers for CUDA (dlpack.md section 5.1).
LEGACY_DEFAULT_STREAM = 1
PER_THREAD_DEFAULT_STREAM = 2
NO_SYNC = -1

_CUDA = DeviceType.kDLCUDA
_PINNED = DeviceType.kDLCUDAHost
_MANAGED = DeviceType.kDLCUDAManaged
_CPU = DeviceType.kDLCPU

# cuda.core's exception class(es), set by load(); ``except ()`` catches nothing until then.
_CUDA_ERRORS: tuple[type[BaseException], ...] = ()


class CUDAOutOfMemoryError(DeviceError, MemoryError):
    """A CUDA allocation failed for want of memory (also a MemoryError)."""


def _device_error(exc: BaseException) -> DeviceError:
    text = str(exc)
    cls = CUDAOutOfMemoryError if "OUT_OF_MEMORY" in text or "out of memory" in text else DeviceError
    return cls(f"CUDA call failed: {text}")


def _poison_enabled() -> bool:
    return os.environ.get(POISON_ENV, "") not in ("", "0")


_unordered_said: list[bool] = []


def _unordered_free() -> bool:
    """True when the test-only UNORDERED_FREE_ENV is set (said once on stderr)."""
    if os.environ.get(UNORDERED_FREE_ENV, "") in ("", "0"):
        return False
    if not _unordered_said:
        _unordered_said.append(True)
        sys.stderr.write(f"tensor-exchange: {UNORDERED_FREE_ENV} is set: device memory is freed WITHOUT waiting for "
                         "the streams that used it (a planted premature free, for compute-sanitizer)\n")
    return True


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


_HOST_SYNCS = _Counter()
_EVENTS_CREATED = _Counter()


# -- which CUDA the driver speaks (install hints) ------------------------------------------
def driver_cuda_major() -> int | None:
    """The CUDA major version the installed NVIDIA driver supports (13 for the R580
    drivers and later, 12 for R525 to R575), or None where no NVIDIA driver is installed.

    Asks ``cuDriverGetVersion`` through cuda.bindings when it imports (that call needs no
    ``cuInit``), else reads the kernel module's version from ``/proc/driver/nvidia/version``
    (NVIDIA's driver branches: R525 brought CUDA 12.0, R580 CUDA 13.0). Never raises."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS and int(version) > 0:
            return int(version) // 1000  # 13000 is CUDA 13.0
    except Exception:  # cuda-python missing, or no libcuda to load
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as fh:
            return _cuda_major_of_driver(fh.readline())
    except OSError:
        return None


def _cuda_major_of_driver(line: str) -> int | None:
    """The CUDA major of the driver named in ``/proc/driver/nvidia/version``'s first line
    (``NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ...``), None if none is."""
    found = re.search(r"\s(\d{3,4})\.\d+(?:\.\d+)?\s", line + " ")
    if found is None:
        return None
    branch = int(found.group(1))
    return 13 if branch >= 580 else 12 if branch >= 525 else 11


def install_hint() -> str | None:
    """What to install for CUDA support on this machine, in one line, naming the extra
    that matches the driver (``tensor-exchange[cuda13]`` on a CUDA 13 driver), or None
    where no NVIDIA driver is installed (there is nothing to install then)."""
    major = driver_cuda_major()
    if major is None:
        return None
    if major < 12:
        return (f"the NVIDIA driver here supports CUDA {major}; the CUDA backend needs a CUDA 12 or 13 driver "
                "(R525 or later)")
    cuda = min(major, 13)
    return (f"this driver speaks CUDA {major}: pip install 'tensor-exchange[cuda{cuda}]' "
            f"(cuda-python and cupy-cuda{cuda}x); for the GPU peers a CUDA build of torch and 'jax[cuda{cuda}]'")


def _cupy_package() -> str:
    major = driver_cuda_major()
    return f"cupy-cuda{min(major, 13)}x" if major and major >= 12 else "cupy-cuda13x (or cupy-cuda12x)"


# -- loading ---------------------------------------------------------------------------------
def _import_core() -> Any:
    """``cuda.core`` (>= 0.5 puts everything at top level; older releases under
    ``cuda.core.experimental``)."""
    try:
        import cuda.core as cc
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the CUDA backend needs NVIDIA cuda-python's cuda.core, which cannot be imported ({exc})"
        ) from exc
    if hasattr(cc, "Device"):
        return cc
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            experimental = importlib.import_module("cuda.core.experimental")
    except ImportError as exc:
        raise BackendUnavailableError(f"cuda.core is installed but has no Device ({exc}); upgrade cuda-core") from exc
    return experimental


def _core_errors(cc: Any) -> tuple[type[BaseException], ...]:
    for name in (cc.__name__ + "._utils.cuda_utils", "cuda.core._utils.cuda_utils"):
        try:
            return (importlib.import_module(name).CUDAError,)
        except (ImportError, AttributeError):
            continue
    return ()


def _error_text(driver: Any, err: Any) -> str:
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{name}: {text}"
    except Exception:  # an unknown code: say what we have
        return str(err)


def load() -> "CUDABackend":
    """Import cuda-python, initialise the driver and count the devices.

    Returns the backend (``exchange.devices.base.get_backend`` registers it for ``kDLCUDA``,
    ``kDLCUDAHost`` and ``kDLCUDAManaged``). Raises ``BackendUnavailableError`` (an
    ImportError) saying why when this machine cannot run it: cuda-python missing, no
    NVIDIA driver (libcuda cannot be loaded), the driver refusing to initialise, or no
    visible device. CuPy is not needed to load; strided copies ask for it when used.
    """
    global _CUDA_ERRORS
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the CUDA backend needs NVIDIA cuda-python (cuda.bindings), which cannot be imported ({exc})"
        ) from exc
    cc = _import_core()
    try:
        (err,) = driver.cuInit(0)
    except (RuntimeError, OSError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError, "Failed to dlopen libcuda"
        raise BackendUnavailableError(f"no NVIDIA driver, so no CUDA: libcuda cannot be loaded ({exc})") from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        hint = ""
        if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
            hint = f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s})"
        raise BackendUnavailableError(f"the NVIDIA driver did not initialise: {_error_text(driver, err)}{hint}")
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendUnavailableError(f"cannot count CUDA devices: {_error_text(driver, err)}")
    if count < 1:
        raise BackendUnavailableError("the NVIDIA driver sees no CUDA device")
    _CUDA_ERRORS = _core_errors(cc)
    return CUDABackend(cc, driver, int(count))


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
        _HOST_SYNCS.add()
        try:
            self.core.sync()
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def __repr__(self) -> str:
        return f"CUDAEvent(device='{self.device}')"


class _Current:
    """Make device ``ordinal``'s primary context current for a ``with`` block, then put
    back what was current (nothing is changed when it already is)."""

    __slots__ = ("_backend", "_ordinal", "_previous")

    def __init__(self, backend: "CUDABackend", ordinal: int) -> None:
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

    def __init__(self, backend: "CUDABackend", core: Any, device: Device, handle: int, owner: Any = None,
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
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        if reused is None:
            _EVENTS_CREATED.add()
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
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream so far has finished."""
        if self._here() is not self:  # another thread's per-thread default stream: after all of it
            self.record().synchronize()
            return
        _HOST_SYNCS.add()
        try:
            with _Current(self._backend, self.device.id):
                self.core.sync()
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

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


def _default_core_streams(cc: Any) -> tuple[Any, Any]:
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


class _ManagedBlock:
    """Managed memory from ``cuMemAllocManaged``; ``close(stream)`` synchronises
    ``stream`` and frees it (``cuMemFree``). Not freed by garbage collection: the
    registry frees it (at interpreter exit a leak is preferred to a late driver call)."""

    __slots__ = ("address", "nbytes", "_driver")

    def __init__(self, driver: Any, address: int, nbytes: int) -> None:
        self._driver = driver
        self.address = address
        self.nbytes = nbytes

    def close(self, stream: Any = None) -> None:
        address, self.address = self.address, 0
        if not address:
            return
        if stream is not None:
            _HOST_SYNCS.add()
            stream.sync()
        (err,) = self._driver.cuMemFree(address)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuMemFree(0x{address:x}) failed: {_error_text(self._driver, err)}")


_c_contiguous = is_c_contiguous


# -- the backend ---------------------------------------------------------------------------------
class CUDABackend:
    """CUDA device, pinned host and managed memory; CUDA streams and events.

    ``device_count`` is the number of visible CUDA devices (``cuda:0`` ...). Pinned and
    managed memory (device id 0 as DLPack fixes it) is used with the streams of any
    CUDA device; where no stream says which, the device current on the calling thread
    is used (device 0 when none is).
    """

    name = "cuda"
    device_types = (_CUDA, _PINNED, _MANAGED)

    def __init__(self, cc: Any, driver: Any, device_count: int) -> None:
        # No driver call here: load() has made sure the driver works.
        self._cc = cc
        self._driver = driver
        self.device_count = device_count
        self._success = driver.CUresult.CUDA_SUCCESS
        self._primary: dict[int, tuple[int, Any]] = {}  # ordinal -> (context address, CUcontext)
        self._lock = threading.Lock()
        self._devices = {i: Device(_CUDA, i) for i in range(device_count)}
        self._legacy, self._per_thread = _default_core_streams(cc)
        self._defaults: dict[int, CUDAStream] = {}
        self._per_thread_defaults = threading.local()  # .streams: ordinal -> this thread's CUDAStream
        self._device_resources: dict[int, Any] = {}
        self._pooled: set[int] = set()  # ordinals whose device memory frees in stream order
        self._pinned_resource: Any = None
        # Events for re-recording, one pool per device (an event belongs to its context).
        self._event_pools: dict[int, collections.deque[Any]] = {
            i: collections.deque(maxlen=EVENT_POOL_SIZE) for i in range(device_count)}
        self._ipc = _IPCState()  # sharing across processes (exchange/sharing/)

    def __repr__(self) -> str:
        return f"CUDABackend(devices={self.device_count})"

    @property
    def host_syncs(self) -> int:
        """How many host-blocking calls this backend has made so far, on any thread: every
        stream and event ``synchronize()``, and the synchronisation before freeing pinned
        or managed memory. Stream-ordered work (records, waits, device memory frees,
        copies between device memories) adds nothing; a copy into pageable host memory
        adds one."""
        return _HOST_SYNCS.count

    @property
    def events_created(self) -> int:
        """How many CUDA events ``CUDAStream.record`` has created so far, on any thread
        (the others were re-recorded from the device's pool of up to EVENT_POOL_SIZE
        completed events). Flat once warm: hops and releases take events from the pool."""
        return _EVENTS_CREATED.count

    def describe(self, ordinal: int) -> str:
        """One line about CUDA device ``ordinal``: its name, compute capability, memory in
        GiB and the CUDA version of the driver (``"NVIDIA H200, sm_90, 139.8 GiB, driver
        CUDA 13.0"``). ValueError for a device that does not exist."""
        if ordinal not in self._devices:
            raise ValueError(f"cuda:{ordinal} does not exist: this process sees {self.device_count} CUDA device(s)")
        core = self._cc.Device(ordinal)
        parts = [str(core.name)]
        with contextlib.suppress(Exception):
            cc = core.compute_capability
            parts.append(f"sm_{cc.major}{cc.minor}")
        with contextlib.suppress(Exception):
            err, total = self._driver.cuDeviceTotalMem(ordinal)
            if err == self._success:
                parts.append(f"{int(total) / (1 << 30):.1f} GiB")
        with contextlib.suppress(Exception):
            err, version = self._driver.cuDriverGetVersion()
            if err == self._success:
                parts.append(f"driver CUDA {int(version) // 1000}.{int(version) % 1000 // 10}")
        return ", ".join(parts)

    # -- devices and contexts ------------------------------------------------------------
    def _check(self, err: Any, what: str) -> None:
        if err != self._success:
            text = _error_text(self._driver, err)
            cls = CUDAOutOfMemoryError if "OUT_OF_MEMORY" in text else DeviceError
            raise cls(f"{what} failed: {text}")

    def _make_current(self, ordinal: int) -> Any:
        """Make ``ordinal``'s primary context current. Returns the context to restore
        afterwards: None when it already was current, or when no context was (the
        primary context then stays current, as CuPy and PyTorch leave it)."""
        driver = self._driver
        err, ctx = driver.cuCtxGetCurrent()
        current = int(ctx) if err == self._success else 0
        primary = self._primary.get(ordinal)
        if primary is not None and current == primary[0]:
            return None
        if primary is None:
            self._cc.Device(ordinal).set_current()
            err, now = driver.cuCtxGetCurrent()
            self._check(err, "cuCtxGetCurrent")
            self._primary[ordinal] = (int(now), now)
        else:
            (err,) = driver.cuCtxSetCurrent(primary[1])
            self._check(err, f"cuCtxSetCurrent(cuda:{ordinal})")
        return ctx if current else None

    def _current_ordinal(self) -> int:
        """The CUDA device current on this thread, 0 when none is."""
        try:
            err, dev = self._driver.cuCtxGetDevice()
        except Exception:
            return 0
        if err != self._success:
            return 0
        ordinal = int(dev)
        return ordinal if 0 <= ordinal < self.device_count else 0

    def _cuda_device(self, ordinal: int) -> Device:
        return self._devices[ordinal]

    def _ordinal(self, device: Any, stream: "CUDAStream | None" = None) -> int:
        """The CUDA device ordinal that serves ``device``: its id for ``kDLCUDA`` (which
        must exist), else the stream's device, else the current device."""
        device = Device.parse(device)
        if device.type == _CUDA:
            if device.id >= self.device_count:
                raise ValueError(
                    f"{device} does not exist: this process sees {self.device_count} CUDA device(s), "
                    f"cuda:0 to cuda:{self.device_count - 1}"
                )
            return device.id
        if device.type in (_PINNED, _MANAGED):
            return stream.device.id if stream is not None else self._current_ordinal()
        raise ValueError(f"the CUDA backend serves cuda, cuda_host and cuda_managed memory, not {device}")

    # -- streams ------------------------------------------------------------------------------
    def default_stream(self, device: Any) -> CUDAStream:
        """The legacy default stream (DLPack 1) of ``device``'s CUDA device."""
        ordinal = self._ordinal(device)
        stream = self._defaults.get(ordinal)
        if stream is None:
            stream = CUDAStream(self, self._legacy, self._devices[ordinal], LEGACY_DEFAULT_STREAM)
            self._defaults[ordinal] = stream
        return stream

    def per_thread_stream(self, device: Any) -> CUDAStream:
        """The calling thread's per-thread default stream (DLPack 2) of ``device``'s CUDA
        device: one CUDAStream per thread (``thread`` says which), since the handle names
        a different stream on each. Used from another thread (a release, a consumer's
        handshake), it records through the legacy default stream (see CUDAStream)."""
        ordinal = self._ordinal(device)
        mine = getattr(self._per_thread_defaults, "streams", None)
        if mine is None:
            mine = self._per_thread_defaults.streams = {}
        stream = mine.get(ordinal)
        if stream is None:
            stream = CUDAStream(self, self._per_thread, self._devices[ordinal], PER_THREAD_DEFAULT_STREAM,
                                thread=threading.current_thread())
            mine[ordinal] = stream
        return stream

    def order_key(self, stream: CUDAStream) -> tuple[Any, ...]:
        """What names the ordered queue ``stream``'s work lands on from the calling thread
        (``CUDAStream.order_key``): work queued on two streams with one key runs in the
        order it was queued, so a handshake between them needs no wait. The per-thread
        default stream has handle 2 on every thread but is a different stream on each:
        its key names the thread."""
        return stream.order_key()

    def create_stream(self, device: Any) -> CUDAStream:
        """A new non-blocking CUDA stream on ``device``'s CUDA device (it does not
        synchronise with the legacy default stream). Destroyed when the last reference
        goes (the registry keeps the streams that used live memory)."""
        ordinal = self._ordinal(device)
        try:
            with _Current(self, ordinal):
                core_device = self._cc.Device(ordinal)
                core_device.set_current()  # cuda.core's per-thread Device wants it on every thread
                core = core_device.create_stream()
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        return CUDAStream(self, core, self._devices[ordinal], int(core.handle))

    def _wrap_handle(self, handle: int, device: Any, owner: Any = None, ordinal: int | None = None,
                     core: Any = None) -> CUDAStream:
        if handle == 0 or handle == LEGACY_DEFAULT_STREAM:  # 0 from an object: the NULL (legacy) stream
            return self.default_stream(self._devices[ordinal] if ordinal is not None else device)
        if handle == PER_THREAD_DEFAULT_STREAM:
            return self.per_thread_stream(self._devices[ordinal] if ordinal is not None else device)
        if core is None:
            core = self._cc.Stream.from_handle(handle)
        if ordinal is None:
            device = Device.parse(device)
            if device.type == _CUDA:
                ordinal = self._ordinal(device)
            else:  # pinned or managed memory: the stream's own device
                try:
                    ordinal = int(core.device.device_id)
                except Exception:
                    ordinal = self._current_ordinal()
        return CUDAStream(self, core, self._devices[ordinal], handle, owner)

    def stream_from_dlpack(self, value: int | None, device: Any) -> CUDAStream | None:
        """The stream a DLPack ``__dlpack__(stream=value)`` names for data on ``device``:
        None or 1 the legacy default stream, 2 the per-thread default stream, > 2 that
        ``cudaStream_t`` (not kept alive: it must outlive the data's release), -1 None (no
        synchronisation). ValueError for 0 (ambiguous) and values below -1; TypeError
        for a non-int."""
        if value is None:
            return self.default_stream(device)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a CUDA stream for DLPack must be an int or None, got {value!r}")
        if value == NO_SYNC:
            return None
        if value == 0:
            raise ValueError(
                "stream=0 is ambiguous for CUDA data (it could mean the legacy default stream, 1, or the "
                "per-thread default stream, 2); pass 1, 2, a cudaStream_t (> 2), or -1 for no synchronisation"
            )
        if value < NO_SYNC:
            raise ValueError(f"stream={value} is not a CUDA stream; use None, -1, 1, 2 or a cudaStream_t (> 2)")
        if value == LEGACY_DEFAULT_STREAM:
            return self.default_stream(device)
        if value == PER_THREAD_DEFAULT_STREAM:
            return self.per_thread_stream(device)
        return self._wrap_handle(value, device)

    def to_dlpack_stream(self, stream: Any, device: Any) -> int:
        """The int to pass a producer's ``__dlpack__(stream=...)`` for a consumer working on
        ``stream``: its handle; 1 (the legacy default stream, said explicitly) for None."""
        if stream is None:
            return LEGACY_DEFAULT_STREAM
        if not isinstance(stream, CUDAStream):
            stream = self.as_stream(stream, device)
        return stream.handle

    def as_stream(self, obj: Any, device: Any) -> CUDAStream:
        """Our CUDAStream for: a CUDAStream; an int (DLPack's numbers: 1 legacy default,
        2 per-thread default, > 2 a ``cudaStream_t``); a ``cuda.core.Stream``; any object
        with ``__cuda_stream__`` (``torch.cuda.Stream``, CuPy streams, cuda.core), or a
        ``torch.cuda.Stream`` / CuPy stream of a version without it. Objects are kept
        alive by the wrapper; an int handle is not.

        ValueError for 0 (ambiguous), -1 (no stream: pass None) and a stream of another
        CUDA device than ``device``; TypeError for anything else.
        """
        device = Device.parse(device)
        if isinstance(obj, CUDAStream):
            stream = obj
        elif isinstance(obj, bool):
            raise TypeError(f"expected a CUDA stream, got {obj!r}")
        elif isinstance(obj, int):
            if obj == NO_SYNC:
                raise ValueError("stream=-1 (no synchronisation) names no stream here; pass a stream, or None")
            stream = self.stream_from_dlpack(obj, device)
            assert stream is not None
        else:
            handle = _foreign_handle(obj)
            if handle is None:
                raise TypeError(
                    f"expected a CUDA stream (tx.create_stream('cuda'), an int cudaStream_t, a cuda.core Stream, "
                    f"or an object with __cuda_stream__ such as torch.cuda.Stream), got {type(obj).__name__}"
                )
            core = obj if isinstance(obj, self._cc.Stream) else None
            stream = self._wrap_handle(handle, device, owner=obj, ordinal=_foreign_ordinal(obj, self.device_count),
                                       core=core)
        if device.type == _CUDA and stream.device.id != device.id:
            raise ValueError(f"{stream!r} belongs to {stream.device}, but the data is on {device}")
        return stream

    # -- memory ---------------------------------------------------------------------------------
    def _resource(self, kind: DeviceType, ordinal: int) -> Any:
        if kind == _CUDA:
            mr = self._device_resources.get(ordinal)
            if mr is None:
                with self._lock:
                    mr = self._device_resources.get(ordinal)
                    if mr is None:
                        core_device = self._cc.Device(ordinal)
                        if getattr(core_device.properties, "memory_pools_supported", True):
                            mr = self._cc.DeviceMemoryResource(ordinal)
                            self._pooled.add(ordinal)
                        else:  # no stream-ordered pools on this device: cuda.core's synchronous resource
                            core_device.set_current()
                            mr = core_device.memory_resource
                        self._device_resources[ordinal] = mr
            return mr
        if kind == _PINNED:
            if self._pinned_resource is None:
                self._pinned_resource = self._cc.LegacyPinnedMemoryResource()
            return self._pinned_resource
        raise ValueError(f"no memory resource for {kind!r}")

    def allocate(self, nbytes: int, device: Any, stream: Any = None, shared: bool = False) -> Allocation:
        """``nbytes`` bytes of ``device`` memory (``cuda:N``, ``cuda_host``, ``cuda_managed``).
        ``shared=True`` (``cuda:N`` only, else ValueError): from the device's IPC-enabled
        pool (``ipc_resource``), so other processes can map it (``tx.share``).

        Device memory is ordered on ``stream`` (None: the legacy default stream): usable
        there at once, elsewhere after waiting for it. Pinned and managed memory is
        host-ready on return. Zero bytes give address 0 and nothing to free.

        Ownership: the returned Allocation's ``owner`` holds the memory until
        ``free``. Raises ValueError for a device that does not exist or a stream of
        another device, CUDAOutOfMemoryError (a DeviceError and MemoryError) when the
        device is full, DeviceError for other driver failures.
        """
        device = Device.parse(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if shared and device.type != _CUDA:
            raise ValueError(f"shared=True is for cpu and cuda:N memory, not {device}; allocate on cuda:N to share it")
        st = None if stream is None else (stream if isinstance(stream, CUDAStream) else self.as_stream(stream, device))
        ordinal = self._ordinal(device, st)
        if st is not None and st.device.id != ordinal:
            raise ValueError(f"{st!r} belongs to {st.device}, but the memory is for {device}")
        if nbytes == 0:
            return Allocation(0, 0, device, owner=None)
        st = st or self.default_stream(self._devices[ordinal])
        try:
            with _Current(self, ordinal):
                if device.type == _MANAGED:
                    flags = int(self._driver.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
                    err, ptr = self._driver.cuMemAllocManaged(nbytes, flags)
                    self._check(err, f"cuMemAllocManaged({nbytes})")
                    block = _ManagedBlock(self._driver, int(ptr), nbytes)
                    return Allocation(block.address, nbytes, device, owner=block)
                resource = self.ipc_resource(ordinal) if shared else self._resource(device.type, ordinal)
                buffer = resource.allocate(nbytes, stream=st.core)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        return Allocation(int(buffer.handle), nbytes, device, owner=buffer)

    def free(self, allocation: Allocation, stream: Any = None) -> None:
        """Release ``allocation`` on ``stream`` (None: the legacy default stream).

        The registry calls this only after the work of every stream that used the memory
        has completed. Device memory returns to its pool ordered on ``stream``
        (``Buffer.close(stream)``); pinned and managed memory is freed after
        synchronising ``stream``. With EXCHANGE_DEBUG_POISON=1 the memory is first
        filled with POISON_BYTE on ``stream``. Freeing twice does nothing.
        """
        owner, allocation.owner = allocation.owner, None
        if owner is None:
            return
        device = allocation.device
        st = None if stream is None else (stream if isinstance(stream, CUDAStream) else self.as_stream(stream, device))
        ordinal = self._ordinal(device, st)
        st = (st or self.default_stream(self._devices[ordinal]))._here()
        try:
            with _Current(self, ordinal):
                if _poison_enabled() and allocation.nbytes:
                    (err,) = self._driver.cuMemsetD8Async(allocation.address, POISON_BYTE, allocation.nbytes,
                                                          st.handle)
                    self._check(err, "cuMemsetD8Async (poison on release)")
                if device.type == _PINNED:
                    _HOST_SYNCS.add()  # LegacyPinnedMemoryResource synchronises the stream, then cuMemFreeHost
                owner.close(st.core)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def free_after(self, allocation: Allocation, stream: Any, streams: list[Any]) -> bool:
        """Free device memory in stream order on the device, after the work queued on
        ``streams`` (every stream that used it), with no host wait and no reaper: the
        free stream (``stream``, the allocation's; None: the legacy default stream)
        waits on an event recorded now on each other stream (``cuStreamWaitEvent``),
        then the memory goes back to its pool (``cuMemFreeAsync``), where only work
        ordered after that free can reuse it.

        Returns False, freeing nothing, where that cannot be done (pinned or managed
        memory, whose free the host must order: the registry's reaper frees it after
        the streams' events; a device without memory pools; a stream not of this
        backend). DeviceError if a driver call fails (the registry then falls back).
        With the test-only UNORDERED_FREE_ENV set the free stream waits for nothing.
        """
        device = allocation.device
        if (device.type != _CUDA or allocation.owner is None or device.id not in self._pooled
                or not all(isinstance(s, CUDAStream) for s in streams)):
            return False
        st = stream if isinstance(stream, CUDAStream) else (
            self.default_stream(device) if stream is None else self.as_stream(stream, device))
        st = st._here()  # the allocation's per-thread default stream, released on another thread: the legacy one
        if not _unordered_free():  # the test-only switch plants a premature free here
            seen = {st.order_key()}  # one wait per stream, however many wrappers name it
            for other in streams:
                key = other.order_key()
                if key not in seen:
                    seen.add(key)
                    st.wait(other.record())
        self.free(allocation, st)
        return True

    # -- sharing across processes (exchange/sharing/) -------------------------------------------
    # cuda.core (>= 0.4) shares stream-ordered pool memory: an IPC-enabled pool
    # (DeviceMemoryResourceOptions(ipc_enabled=True)) gives each process that receives its
    # allocation handle (a file descriptor, passed over a Unix socket) a mapped pool, from
    # which Buffer.from_ipc_descriptor maps one allocation; IPC events order work across
    # the processes. Where a release differs between cuda.core versions (a property in
    # 1.x, a get_ method before), both are tried.
    def ipc_resource(self, ordinal: int) -> Any:
        """The IPC-enabled memory pool of CUDA device ``ordinal`` (made on first use).
        DeviceError when the device cannot share pool memory."""
        mr = self._ipc.resources.get(ordinal)
        if mr is not None:
            return mr
        with self._lock:
            mr = self._ipc.resources.get(ordinal)
            if mr is None:
                core_device = self._cc.Device(ordinal)
                props = core_device.properties
                if not getattr(props, "memory_pools_supported", True):
                    raise DeviceError(f"cuda:{ordinal} has no stream-ordered memory pools, so it cannot share memory")
                types = getattr(props, "mempool_supported_handle_types", None)
                if types is not None and not int(types) & _POSIX_FD:
                    raise DeviceError(f"cuda:{ordinal} cannot export pool memory as a file descriptor (IPC)")
                with _Current(self, ordinal):
                    options = self._cc.DeviceMemoryResourceOptions(ipc_enabled=True)
                    mr = self._cc.DeviceMemoryResource(ordinal, options)
                self._ipc.resources[ordinal] = mr
                self._pooled.add(ordinal)  # a stream-ordered pool too: free_after frees it with no reaper
        return mr

    def ipc_shareable(self, owner: Any) -> bool:
        """True for a Buffer of this process's IPC-enabled pools (not a mapped one)."""
        mr = getattr(owner, "memory_resource", None)
        return mr is not None and any(mr is r for r in self._ipc.resources.values())

    def ipc_stream(self, ordinal: int) -> CUDAStream:
        """The stream of device ``ordinal`` that orders sharing: a share makes it wait for
        the data's stream, attaching processes wait for it, and their releases make it
        wait for their work before this process frees."""
        st = self._ipc.streams.get(ordinal)
        if st is None:
            with self._lock:
                st = self._ipc.streams.get(ordinal)
                if st is None:
                    st = self._ipc.streams[ordinal] = self.create_stream(self._devices[ordinal])
        return st

    def device_uuid(self, ordinal: int) -> str:
        """The UUID of CUDA device ``ordinal`` (the same GPU has the same UUID in every
        process, whatever CUDA_VISIBLE_DEVICES numbers it)."""
        return str(self._cc.Device(ordinal).uuid)

    def ordinal_of_uuid(self, uuid: str) -> int | None:
        """This process's ordinal for the GPU with ``uuid``, None if it does not see it."""
        for i in range(self.device_count):
            if self.device_uuid(i) == uuid:
                return i
        return None

    def ipc_export(self, owner: Any, ordinal: int) -> tuple[str, bytes, int]:
        """``(pool uuid, buffer descriptor, pool file descriptor)`` for a shareable
        Buffer of device ``ordinal``: the descriptor is cuda.core's IPCBufferDescriptor,
        pickled; the file descriptor stays owned by the pool (send a duplicate)."""
        try:
            with _Current(self, ordinal):
                mr = owner.memory_resource
                descriptor = _ipc_get(owner, "ipc_descriptor", "get_ipc_descriptor")
                handle = _ipc_get(mr, "allocation_handle", "get_allocation_handle")
                return str(mr.uuid), pickle.dumps(descriptor), int(handle)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def ipc_has_pool(self, pool: str) -> bool:
        """True when this process has mapped the pool with uuid ``pool`` already."""
        return pool in self._ipc.pools

    def ipc_import(self, ordinal: int, pool: str, pool_fd: int | None, descriptor: bytes, stream: CUDAStream) -> Any:
        """Map one allocation of another process's pool on device ``ordinal``: the pool
        (mapped once per process, from ``pool_fd``, which the caller closes), then the
        buffer from its pickled descriptor. The Buffer's ``close(stream)`` unmaps it."""
        try:
            with _Current(self, ordinal):
                mr = self._ipc.pools.get(pool)
                if mr is None:
                    if pool_fd is None:
                        raise DeviceError(f"the memory pool {pool} is not mapped here and no handle for it came")
                    mr = self._cc.DeviceMemoryResource.from_allocation_handle(ordinal, pool_fd)
                    self._ipc.pools[pool] = mr
                return self._cc.Buffer.from_ipc_descriptor(mr, pickle.loads(descriptor), stream=stream.core)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def ipc_record(self, stream: CUDAStream) -> tuple[Any, bytes]:
        """Record an IPC-capable event on ``stream`` now; returns it (keep it alive until
        the other process has opened it) and its handle's bytes."""
        try:
            with _Current(self, stream.device.id):
                event = stream.core.record(options=self._cc.EventOptions(ipc_enabled=True))
                descriptor = _ipc_get(event, "ipc_descriptor", "get_ipc_descriptor")
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        # The descriptor pickles as (rebuild, (handle bytes, blocking_sync)): its bytes
        # are what travels; ipc_wait builds a descriptor from bytes (_ipc_descriptor),
        # never unpickling what a socket sent.
        args = descriptor.__reduce__()[1]
        return event, bytes(args[0])

    def ipc_wait(self, stream: CUDAStream, handle: bytes) -> None:
        """Make ``stream`` wait for an event another process recorded (its handle's
        bytes, from ``ipc_record``); no host block, and no event of this process made
        for it. ValueError for a malformed handle; DeviceError when this cuda.core has
        no IPCEventDescriptor to open it with."""
        if not isinstance(handle, bytes) or len(handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC event handle is {_IPC_HANDLE_BYTES} bytes, got {len(handle)!r}")
        try:
            with _Current(self, stream.device.id):
                event = self._cc.Event.from_ipc_descriptor(self._ipc_descriptor(handle))
                stream.core.wait(event)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc

    def _ipc_descriptor(self, handle: bytes) -> Any:
        """cuda.core's IPCEventDescriptor for an event handle's bytes, made as its own
        unpickling does (``IPCEventDescriptor._init(bytes, blocking_sync)``), with the
        flag ``ipc_record``'s events have: no blocking sync (it decides only how a host
        would wait on the event; this process only makes a stream wait on it)."""
        make = self._ipc.event_rebuild
        if make is None:
            module = importlib.import_module(self._cc.Event.__module__)  # cuda.core._event, or .experimental's
            cls = getattr(self._cc, "IPCEventDescriptor", None) or getattr(module, "IPCEventDescriptor", None)
            make = getattr(cls, "_init", None)
            if make is None:
                raise DeviceError(f"this cuda.core ({getattr(self._cc, '__version__', '?')}) has no "
                                  "IPCEventDescriptor._init to open another process's CUDA event with")
            self._ipc.event_rebuild = make
        return make(handle, False)

    def ipc_close_import(self, buffer: Any, device: Device, streams: list[Any]) -> tuple[Any, bytes]:
        """Unmap an imported allocation in stream order: the default stream of ``device``
        waits for ``streams``, frees the mapping (cuMemFreeAsync), and an IPC event is
        recorded after the free, which the exporting process waits on before its own
        free (CUDA requires the importer's free to complete first). Returns the event
        and its handle's bytes (``ipc_record``)."""
        st = self.default_stream(device)
        for other in streams:
            if isinstance(other, CUDAStream) and other.order_key() != st.order_key():
                st.wait(other.record())
        try:
            with _Current(self, device.id):
                buffer.close(st.core)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        return self.ipc_record(st)

    # -- copies ---------------------------------------------------------------------------------
    def _memcpy(self, dst: int, src: int, nbytes: int, stream: CUDAStream) -> None:
        (err,) = self._driver.cuMemcpyAsync(dst, src, nbytes, stream.handle)
        self._check(err, f"cuMemcpyAsync({nbytes} bytes)")

    def _stream_of(self, tensor: Any) -> CUDAStream | None:
        """The stream ``tensor``'s data is ordered on (None for CPU data)."""
        if tensor.device.type == _CPU:
            return None
        stream = tensor.stream
        if isinstance(stream, CUDAStream):
            return stream
        return self.default_stream(tensor.device)

    def copy(self, dst: Any, src: Any, stream: Any = None) -> CUDAStream | None:
        """Copy tensor ``src`` into tensor ``dst`` (equal shapes and itemsizes, any strides;
        CUDA device, pinned, managed or CPU memory), ordered on ``stream``; returns the
        stream the copy is ordered on (None for a copy between CPU tensors, complete on
        return).

        ``stream`` None: the legacy default stream of the CUDA side (``dst``'s device when
        both are CUDA devices). The copy stream first waits for the streams ``src`` and
        ``dst`` are ordered on (record-then-wait, no host block). The caller adds the
        returned stream to both records' streams (``exchange.tensor.copy_into`` does), so
        neither is released before the copy has run. Contiguous
        copies are one ``cuMemcpyAsync``; strided ones use a CuPy kernel, staging through
        contiguous buffers where one side is pageable host memory or another device.
        A copy into pageable host memory has completed when this returns, and a copy
        from ``kDLCPU`` memory has read its source when this returns (also where those
        pages are in fact page-locked, as a pinned PyTorch tensor's are: its capsule
        says kDLCPU, so the caller may write it at once; the copy stream is then
        synchronised, one host sync). Other copies complete in stream order.

        Raises ValueError for mismatched shapes or itemsizes, BackendUnavailableError when
        a strided copy needs CuPy and it is not installed, DeviceError for driver failures.
        """
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype.itemsize != src.dtype.itemsize:
            raise ValueError(
                f"copy needs equal shapes and itemsizes, got {dst.shape}/{dst.dtype.name} <- {src.shape}/{src.dtype.name}"
            )
        if dst.device.type == _CPU and src.device.type == _CPU:
            from .cpu import CPUBackend

            return CPUBackend().copy(dst, src, None)
        if stream is not None:
            side = dst if dst.device.type != _CPU else src
            st = stream if isinstance(stream, CUDAStream) else self.as_stream(stream, side.device)
        else:
            side = dst if dst.device.type == _CUDA else src if src.device.type == _CUDA else (
                dst if dst.device.type != _CPU else src)
            st = self.default_stream(side.device)
        for tensor in (src, dst):
            producer = self._stream_of(tensor)
            if producer is not None and (producer.handle != st.handle or producer.device != st.device):
                st.wait(producer.record())
        nbytes = math.prod(src.shape) * src.dtype.itemsize
        if nbytes == 0:
            return st
        try:
            with _Current(self, st.device.id):
                if _c_contiguous(src.shape, src.strides) and _c_contiguous(dst.shape, dst.strides):
                    self._memcpy(dst.data_ptr, src.data_ptr, nbytes, st)
                    if dst.device.type == _CPU or self._async_from_host(src):
                        st.synchronize()
                    return st
                self._strided_copy(dst, src, nbytes, st)
        except _CUDA_ERRORS as exc:
            raise _device_error(exc) from exc
        return st

    def _async_from_host(self, src: Any) -> bool:
        """True when a cuMemcpyAsync from ``src``, CPU-typed memory, may still be reading
        it after the call returns: its pages are page-locked memory CUDA knows
        (``cuMemAllocHost``, ``cuMemHostRegister``), which the driver copies from
        asynchronously. From pageable memory the call returns once it has staged the
        source. Unknown (a failing query): True, so the caller synchronises."""
        if src.device.type != _CPU:
            return False
        driver = self._driver
        try:
            err, kind = driver.cuPointerGetAttribute(
                driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, src.data_ptr)
            if err != self._success:  # CUDA_ERROR_INVALID_VALUE: memory CUDA does not know, pageable
                return False
            return int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)
        except Exception:
            return True

    def _local(self, tensor: Any, ordinal: int) -> bool:
        """True when a kernel on device ``ordinal`` can read and write ``tensor``."""
        kind = tensor.device.type
        return kind in (_PINNED, _MANAGED) or (kind == _CUDA and tensor.device.id == ordinal)

    def _strided_copy(self, dst: Any, src: Any, nbytes: int, st: CUDAStream) -> None:
        import numpy as np

        from .cpu import numpy_view

        cp = _cupy()
        o = st.device.id
        src_local, dst_local = self._local(src, o), self._local(dst, o)
        with cp.cuda.Device(o), _cupy_stream(cp, st):
            if src_local and dst_local:
                _cupy_view(cp, dst, o)[...] = _cupy_view(cp, src, o)
                return
            keep: list[Any] = []
            # 1. the source as contiguous bytes that cuMemcpyAsync can read
            peer_src_stream = None
            read_on_return = False  # a CPU-typed source in page-locked memory: wait for the copy (copy())
            if _c_contiguous(src.shape, src.strides):
                src_ptr = src.data_ptr
                read_on_return = self._async_from_host(src)
            elif src_local:
                staged = cp.ascontiguousarray(_cupy_view(cp, src, o))  # on st
                keep.append(staged)
                src_ptr = staged.data.ptr
            elif src.device.type == _CPU:
                host = np.ascontiguousarray(numpy_view(src.data_ptr, src.shape, src.strides, src.dtype.itemsize))
                keep.append(host)
                src_ptr = host.ctypes.data
            else:  # strided, on another CUDA device: make it contiguous there, in its stream's order
                x = src.device.id
                peer_src_stream = self._stream_of(src)
                with _Current(self, x), cp.cuda.Device(x), _cupy_stream(cp, peer_src_stream):
                    staged = cp.ascontiguousarray(_cupy_view(cp, src, x))
                keep.append(staged)
                src_ptr = staged.data.ptr
                st.wait(peer_src_stream.record())
            # 2. into the destination
            if _c_contiguous(dst.shape, dst.strides):
                self._memcpy(dst.data_ptr, src_ptr, nbytes, st)
                if dst.device.type == _CPU:
                    st.synchronize()
            elif dst_local:
                staged_dst = _cupy_empty_like(cp, dst)  # on st
                self._memcpy(staged_dst.data.ptr, src_ptr, nbytes, st)
                _cupy_view(cp, dst, o)[...] = staged_dst
            elif dst.device.type == _CPU:
                host_dst = np.empty(dst.shape, dtype=f"V{dst.dtype.itemsize}")
                self._memcpy(host_dst.ctypes.data, src_ptr, nbytes, st)
                st.synchronize()
                np.copyto(numpy_view(dst.data_ptr, dst.shape, dst.strides, dst.dtype.itemsize), host_dst)
            else:  # strided, on another CUDA device: land contiguous there, then scatter in its stream's order
                y = dst.device.id
                peer_dst_stream = self._stream_of(dst)
                with _Current(self, y), cp.cuda.Device(y), _cupy_stream(cp, peer_dst_stream):
                    staged_dst = _cupy_empty_like(cp, dst)
                st.wait(peer_dst_stream.record())
                self._memcpy(staged_dst.data.ptr, src_ptr, nbytes, st)
                peer_dst_stream.wait(st.record())
                with _Current(self, y), cp.cuda.Device(y), _cupy_stream(cp, peer_dst_stream):
                    _cupy_view(cp, dst, y)[...] = staged_dst
                st.wait(peer_dst_stream.record())
            if peer_src_stream is not None:
                # CuPy may reuse the staging block for later work on that stream only after st read it.
                peer_src_stream.wait(st.record())
            if read_on_return:
                st.synchronize()


# -- IPC helpers -----------------------------------------------------------------------------------
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, a bit of mempool_supported_handle_types
_IPC_HANDLE_BYTES = 64  # sizeof(CUipcEventHandle)


class _IPCState:
    """What the backend keeps for sharing: its IPC-enabled pools and ordering streams,
    the pools of other processes it mapped, and how cuda.core rebuilds an IPC event
    descriptor."""

    __slots__ = ("resources", "streams", "pools", "event_rebuild")

    def __init__(self) -> None:
        self.resources: dict[int, Any] = {}
        self.streams: dict[int, CUDAStream] = {}
        self.pools: dict[str, Any] = {}
        self.event_rebuild: Any = None  # IPCEventDescriptor._init, found on first use


def _ipc_get(obj: Any, prop: str, method: str) -> Any:
    """``obj.prop`` (cuda.core 1.x properties) or ``obj.method()`` (earlier releases)."""
    value = getattr(obj, prop, None)
    if value is not None and not callable(value):
        return value
    return getattr(obj, method)()


# -- CuPy helpers (imported only when a strided copy needs a kernel) ------------------------------
_UNITS = {8: "uint64", 4: "uint32", 2: "uint16", 1: "uint8"}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"a strided CUDA copy needs CuPy, which cannot be imported ({exc}); "
            f"install {_cupy_package()}, or make the data contiguous first"
        ) from exc
    return cupy


def _cupy_stream(cp: Any, stream: CUDAStream) -> Any:
    """A CuPy stream object over ``stream`` (not owning it), for ``with``."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14 (ExternalStream is deprecated there)
        try:
            return from_external(stream)
        except (TypeError, ValueError, RuntimeError):
            pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(stream.handle, stream.device.id)


def _raw_layout(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Shape, byte strides and unsigned dtype viewing ``tensor``'s elements as raw words
    (a trailing axis when the itemsize is not 1, 2, 4 or 8 bytes)."""
    itemsize = tensor.dtype.itemsize
    unit = next(u for u in (8, 4, 2, 1) if itemsize % u == 0)
    shape = tuple(tensor.shape)
    strides = tuple(s * itemsize for s in tensor.strides)
    if unit != itemsize:
        shape += (itemsize // unit,)
        strides += (unit,)
    return shape, strides, _UNITS[unit]


def _cupy_view(cp: Any, tensor: Any, ordinal: int) -> Any:
    """A CuPy array over ``tensor``'s memory (raw words), keeping ``tensor`` alive."""
    itemsize = tensor.dtype.itemsize
    lo = sum(s * (n - 1) for s, n in zip(tensor.strides, tensor.shape) if s < 0)
    hi = sum(s * (n - 1) for s, n in zip(tensor.strides, tensor.shape) if s > 0)
    span = (hi - lo + 1) * itemsize
    memory = cp.cuda.UnownedMemory(tensor.data_ptr + lo * itemsize, span, tensor, ordinal)
    pointer = cp.cuda.MemoryPointer(memory, -lo * itemsize)
    shape, strides, unit = _raw_layout(tensor)
    return cp.ndarray(shape, dtype=unit, memptr=pointer, strides=strides)


def _cupy_empty_like(cp: Any, tensor: Any) -> Any:
    shape, _, unit = _raw_layout(tensor)
    return cp.empty(shape, dtype=unit)


def _foreign_handle(obj: Any) -> int | None:
    """The ``cudaStream_t`` of a stream object, or None when ``obj`` is not one."""
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if isinstance(value, tuple) and len(value) == 2:
            return int(value[1])
        raise TypeError(f"{type(obj).__name__}.__cuda_stream__ must give (version, handle), got {value!r}")
    handle = getattr(obj, "handle", None)  # cuda.core Stream of a release without __cuda_stream__
    if handle is not None and type(obj).__module__.startswith("cuda.core"):
        return int(handle)
    cuda_stream = getattr(obj, "cuda_stream", None)  # torch.cuda.Stream
    if isinstance(cuda_stream, int) and not isinstance(cuda_stream, bool):
        return cuda_stream
    ptr = getattr(obj, "ptr", None)  # CuPy streams
    if isinstance(ptr, int) and not isinstance(ptr, bool) and type(obj).__module__.startswith("cupy"):
        return ptr
    return None


def _foreign_ordinal(obj: Any, count: int) -> int | None:
    """The CUDA device of a framework stream object when it says so without a driver
    call (PyTorch: ``.device.index``; CuPy: ``.device_id``, -1 when unknown)."""
    module = type(obj).__module__
    if module.startswith("torch"):
        index = getattr(getattr(obj, "device", None), "index", None)
        if isinstance(index, int) and 0 <= index < count:
            return index
    elif module.startswith("cupy"):
        device_id = getattr(obj, "device_id", None)
        if isinstance(device_id, int) and 0 <= device_id < count:
            return device_id
    return None
