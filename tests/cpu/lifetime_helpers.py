"""Shared helpers for the lifetime tests (registry, release, borrow, threads, shutdown).

``CountingProducer`` is a DLPack producer written with ctypes alone: it owns a NumPy
buffer, hands out ``dltensor_versioned`` / ``dltensor`` capsules over it, and its deleter
counts its calls, notes the thread it ran on, and poisons the buffer (as a real free
would make the memory unusable), so a test can see *when* the producer was told
"nobody holds this any more" and whether anything read the memory after that.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Iterator

import numpy as np

from exchange import _dlpack_abi as abi

#: The value the deleter writes over the buffer: reading it means use-after-release.
POISON = -12345.0

# A private handle on the CPython API, so the argtypes set here never clash with the
# library's own ctypes declarations on ``ctypes.pythonapi``.
_py = ctypes.PyDLL(None)
_py.PyCapsule_New.restype = ctypes.py_object
_py.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_py.PyCapsule_IsValid.restype = ctypes.c_int
_py.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_GetPointer.restype = ctypes.c_void_p
_py.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_SetName.restype = ctypes.c_int
_py.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_GetName.restype = ctypes.c_void_p
_py.PyCapsule_GetName.argtypes = [ctypes.py_object]

# CPython keeps the name pointer of a capsule: these bytes live as long as the module.
USED_VERSIONED = abi.USED_DLTENSOR_VERSIONED_NAME
USED_LEGACY = abi.USED_DLTENSOR_NAME
VERSIONED = abi.DLTENSOR_VERSIONED_NAME
LEGACY = abi.DLTENSOR_NAME


def capsule_name(capsule: Any) -> bytes:
    return ctypes.string_at(_py.PyCapsule_GetName(capsule))


def take_capsule(capsule: Any) -> tuple[int, bool]:
    """Consume ``capsule`` the way a C framework does: rename it ``used_...`` and return
    ``(address of the managed struct, versioned)``; the caller now owes one deleter call."""
    name = capsule_name(capsule)
    versioned = name == VERSIONED
    ptr = _py.PyCapsule_GetPointer(capsule, name)
    assert ptr, "not a live DLPack capsule"
    assert _py.PyCapsule_SetName(capsule, USED_VERSIONED if versioned else USED_LEGACY) == 0
    return ptr, versioned


def deleter_address(ptr: int, versioned: bool) -> int:
    struct = abi.DLManagedTensorVersioned if versioned else abi.DLManagedTensor
    return struct.from_address(ptr).deleter or 0


_libc = ctypes.CDLL(None, use_errno=True)
_libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_libc.pthread_create.restype = ctypes.c_int
_libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
_libc.pthread_join.restype = ctypes.c_int


def call_on_foreign_thread(function_address: int, argument: int) -> None:
    """Run the C function at ``function_address`` with ``argument`` on a thread started
    by libc's ``pthread_create`` (Python never saw it), and join it. A DLPack deleter
    ``void (*)(T*)`` serves as the start routine (its return value is ignored). The GIL
    is released while waiting (CDLL), so a deleter that takes the GIL can run."""
    tid = ctypes.c_ulong(0)
    rc = _libc.pthread_create(ctypes.byref(tid), None, function_address, argument)
    assert rc == 0, f"pthread_create failed: {rc}"
    rc = _libc.pthread_join(tid.value, None)
    assert rc == 0, f"pthread_join failed: {rc}"


class CountingProducer:
    """A ctypes DLPack producer over a float64 NumPy buffer of ``n`` elements.

    ``capsule()`` makes a fresh capsule each call; ``calls`` counts deleter calls,
    ``threads`` lists the thread idents they ran on, ``errors`` any call on a struct
    already deleted, and ``released`` is set at the first call. The deleter writes
    POISON over the buffer (unless ``poison=False``).
    """

    def __init__(self, n: int = 256, *, poison: bool = True) -> None:
        self.buffer = np.arange(n, dtype=np.float64)
        self.poison = poison
        self.calls = 0
        self.threads: list[int] = []
        self.errors: list[str] = []
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._structs: dict[int, Any] = {}
        self._deleter = abi.DLManagedTensorDeleter(self._on_delete)
        self._deleter_addr = ctypes.cast(self._deleter, ctypes.c_void_p).value
        self._destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._on_capsule_destroyed)
        self._destructor_addr = ctypes.cast(self._destructor, ctypes.c_void_p).value

    @property
    def address(self) -> int:
        return self.buffer.ctypes.data

    def capsule(self, *, versioned: bool = True, readonly: bool = False) -> Any:
        n = self.buffer.shape[0]
        shape = (ctypes.c_int64 * 1)(n)
        strides = (ctypes.c_int64 * 1)(1)
        if versioned:
            m: Any = abi.DLManagedTensorVersioned()
            m.version.major, m.version.minor = 1, 3
            m.flags = abi.DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0
        else:
            m = abi.DLManagedTensor()
        m.deleter = self._deleter_addr
        t = m.dl_tensor
        t.data = self.address
        t.device.device_type, t.device.device_id = 1, 0
        t.ndim = 1
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 64, 1
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        ptr = ctypes.addressof(m)
        with self._lock:
            self._structs[ptr] = (m, shape, strides, versioned)
        return _py.PyCapsule_New(ptr, VERSIONED if versioned else LEGACY, self._destructor_addr)

    def outstanding(self) -> int:
        """Capsules handed out whose deleter has not run."""
        with self._lock:
            return len(self._structs)

    def _on_delete(self, ptr: int) -> None:
        with self._lock:
            entry = self._structs.pop(ptr, None)
            self.calls += 1
            self.threads.append(threading.get_ident())
        if entry is None:  # raising here would only print: keep it for the test to see
            self.errors.append(f"deleter called twice, or on a struct this producer never made (0x{ptr:x})")
            return
        if self.poison:
            self.buffer[:] = POISON
        self.released.set()

    def _on_capsule_destroyed(self, cap: int) -> None:
        obj = ctypes.cast(cap, ctypes.py_object)
        for name in (VERSIONED, LEGACY):
            if _py.PyCapsule_IsValid(obj, name):
                self._on_delete(_py.PyCapsule_GetPointer(obj, name))
                return


class Gate:
    """A host-stream task that blocks until opened (bounded, so a bug cannot hang the
    suite), then reads ``array`` slowly and keeps what it read."""

    def __init__(self, array: np.ndarray | None = None, *, limit: float = 20.0) -> None:
        self.array = array
        self.limit = limit
        self.opened = threading.Event()
        self.started = threading.Event()
        self.seen: list[float] = []

    def __call__(self) -> list[float]:
        self.started.set()
        if not self.opened.wait(self.limit):
            raise TimeoutError("gate never opened")
        if self.array is not None:
            for i in range(0, self.array.shape[0], max(1, self.array.shape[0] // 8)):
                self.seen.append(float(self.array[i]))
                threading.Event().wait(0.002)  # a slow reader
        return self.seen

    def open(self) -> None:
        self.opened.set()


def live_ids() -> set[int]:
    import exchange as tx

    return {r.id for r in tx.registry().snapshot()}


def settle(timeout: float = 10.0) -> None:
    """Drop what the garbage collector can drop, then let pending releases complete."""
    import gc

    import exchange as tx

    gc.collect()
    assert tx.registry().collect(timeout), "pending releases did not complete"


def assert_none_left(before: set[int]) -> None:
    """Every record alive now that was not alive in ``before`` is a leak."""
    import gc

    import exchange as tx

    assert tx.registry().collect(10.0), "pending releases did not complete"
    if not (live_ids() - before):
        return
    gc.collect()  # only when something is left: a full collection is slow with torch loaded
    settle()
    left = [r for r in tx.registry().snapshot() if r.id not in before]
    assert not left, "records left alive: " + "; ".join(r.describe() for r in left)


@contextlib.contextmanager
def no_leaks() -> Iterator[Any]:
    """Fixture body: quiet registry at the start, nothing new left alive at the end.
    Automatic garbage collection is off meanwhile, so garbage from earlier tests cannot
    be released in the middle of a test and shift the counts it compares."""
    import gc

    import exchange as tx

    reg = tx.registry()
    assert reg.collect(10.0)
    before = live_ids()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield reg
        assert_none_left(before)
    finally:
        if enabled:
            gc.enable()
