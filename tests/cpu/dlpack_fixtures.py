"""Helpers shared by the core exchange tests: DLPack capsules built by hand with ctypes
(a producer whose deleter counts its calls), reading the struct inside any capsule, and
registry bookkeeping.

Import it as a module (``from dlpack_fixtures import ...``); never from conftest.py.

Capsules made here own nothing: the producer object keeps the struct, shape, strides,
the data buffer and its ctypes callbacks alive for the whole test session (module list
``_KEEP``), so a deleter that runs late, or a bug that calls it twice, is counted
instead of crashing the process.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any, Sequence

import numpy as np

import exchange as tx
from exchange import _dlpack_abi as abi

# -- CPython capsule API, as separate function objects (ctypes.pythonapi's shared ones
# are configured by the library; these take raw addresses and never touch refcounts).
_api = ctypes.pythonapi
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api))
_PyCapsule_IsValid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_PyCapsule_GetPointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_PyCapsule_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", _api))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

# CPython keeps the name *pointer*: these bytes live as long as the module.
NAME_LEGACY = b"dltensor"
NAME_VERSIONED = b"dltensor_versioned"
NAME_USED_LEGACY = b"used_dltensor"
NAME_USED_VERSIONED = b"used_dltensor_versioned"
NAME_OTHER = b"not_a_dltensor"
_NAMES = {"dltensor": NAME_LEGACY, "dltensor_versioned": NAME_VERSIONED, "used_dltensor": NAME_USED_LEGACY,
          "used_dltensor_versioned": NAME_USED_VERSIONED, "not_a_dltensor": NAME_OTHER}

READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
IS_COPIED = abi.DLPACK_FLAG_BITMASK_IS_COPIED

_KEEP: list[Any] = []  # every HandMadeProducer ever made (see module docstring)
_BY_ADDRESS: dict[int, "HandMadeProducer"] = {}


def _capsule_destructor(cap: int) -> None:
    # A conforming producer destructor (DLPack python_spec): call the deleter only when
    # the capsule was never consumed (its name is still the unused one).
    for name in (NAME_VERSIONED, NAME_LEGACY):
        if _PyCapsule_IsValid_raw(cap, name):
            ptr = _PyCapsule_GetPointer_raw(cap, name)
            producer = _BY_ADDRESS.get(ptr)
            if producer is not None:
                producer.destructor_calls += 1
            fn = ctypes.c_void_p.from_address(ptr + (16 if name == NAME_VERSIONED else 56)).value
            if fn:
                abi.DLManagedTensorDeleter(fn)(ptr)
            return


_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_destructor)
_DESTRUCTOR_ADDRESS = ctypes.cast(_DESTRUCTOR, ctypes.c_void_p).value


class HandMadeProducer:
    """One managed tensor built with ctypes, and the count of its deleter's calls.

    ``calls`` is how many times the deleter ran; ``self_pointers`` the ``self``
    argument of each call (it must be the struct's address); ``threads`` the thread
    names it ran on.
    """

    def __init__(self, *, data: int | None, shape: Sequence[int] | None, strides: Sequence[int] | None,
                 code: int, bits: int, lanes: int = 1, device: tuple[int, int] = (1, 0),
                 ndim: int | None = None, byte_offset: int = 0, versioned: bool = True,
                 version: tuple[int, int] = (1, 3), flags: int = 0, keep: Any = None,
                 shape_address: int | None = None, null_deleter: bool = False) -> None:
        self.calls = 0
        self.destructor_calls = 0
        self.self_pointers: list[int] = []
        self.threads: list[str] = []
        self.keep = keep  # the memory behind ``data`` (a NumPy array)
        self.versioned = versioned
        n = len(shape) if ndim is None and shape is not None else (ndim or 0)
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape) if shape is not None else None
        self._strides = (ctypes.c_int64 * max(len(strides), 1))(*strides) if strides is not None else None
        self._deleter = abi.DLManagedTensorDeleter(self._on_delete)
        if versioned:
            self.struct = abi.DLManagedTensorVersioned()
            self.struct.version.major, self.struct.version.minor = version
            self.struct.flags = flags
        else:
            self.struct = abi.DLManagedTensor()
        self.struct.manager_ctx = None
        self.struct.deleter = None if null_deleter else ctypes.cast(self._deleter, ctypes.c_void_p).value
        t = self.struct.dl_tensor
        t.data = data or None
        t.device.device_type, t.device.device_id = device
        t.ndim = n
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
        if shape_address is not None:
            t.shape = ctypes.cast(shape_address, ctypes.POINTER(ctypes.c_int64))
        elif self._shape is not None:
            t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        self.address = ctypes.addressof(self.struct)
        _KEEP.append(self)
        _BY_ADDRESS[self.address] = self

    def _on_delete(self, ptr: int) -> None:
        self.calls += 1
        self.self_pointers.append(ptr)
        self.threads.append(threading.current_thread().name)

    def capsule(self, name: str | None = None) -> Any:
        """A new capsule over this struct (normally only one is made per producer)."""
        if name is None:
            name = "dltensor_versioned" if self.versioned else "dltensor"
        return _PyCapsule_New(self.address, _NAMES[name], _DESTRUCTOR_ADDRESS)


def hand_made(array: np.ndarray | None = None, *, versioned: bool = True, readonly: bool = False,
              dtype_code: tuple[int, int, int] | None = None, strides: Any = "auto",
              shape: Any = "auto", **kwargs: Any) -> tuple[Any, HandMadeProducer]:
    """A capsule over ``array``'s memory (or over nothing) and its producer.

    ``dtype_code`` (code, bits, lanes) defaults to the DLPack code of ``array``'s dtype;
    ``strides`` defaults to the array's strides in elements (None: NULL strides);
    ``shape`` to the array's shape (None: NULL shape). Other keywords go to
    HandMadeProducer (device, ndim, byte_offset, version, flags, data...).
    """
    if array is not None:
        dt = tx.dtype(array.dtype)
        code = dtype_code or (dt.code, dt.bits, 1)
        if shape == "auto":
            shape = array.shape
        if strides == "auto":
            strides = tuple(s // array.itemsize for s in array.strides)
        kwargs.setdefault("data", array.ctypes.data)
    else:
        code = dtype_code or (2, 32, 1)
        shape = () if shape == "auto" else shape
        strides = None if strides == "auto" else strides
        kwargs.setdefault("data", None)
    flags = kwargs.pop("flags", READ_ONLY if readonly else 0)
    producer = HandMadeProducer(shape=shape, strides=strides, code=code[0], bits=code[1], lanes=code[2],
                                versioned=versioned, flags=flags, keep=array, **kwargs)
    return producer.capsule(), producer


# -- reading capsules ------------------------------------------------------------------------
class CapsuleView:
    """What a capsule holds, read with ctypes (no consumption, no rename)."""

    def __init__(self, capsule: Any) -> None:
        raw = _PyCapsule_GetName(capsule)
        self.name = raw.decode() if raw is not None else None
        self.versioned = self.name in ("dltensor_versioned", "used_dltensor_versioned")
        self.address = _PyCapsule_GetPointer(capsule, raw)
        if self.versioned:
            m = abi.DLManagedTensorVersioned.from_address(self.address)
            self.version: tuple[int, int] | None = (m.version.major, m.version.minor)
            self.flags: int | None = m.flags
        else:
            m = abi.DLManagedTensor.from_address(self.address)
            self.version = None
            self.flags = None
        self.deleter = m.deleter
        t = m.dl_tensor
        self.data = t.data or 0
        self.device = (t.device.device_type, t.device.device_id)
        self.ndim = t.ndim
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.shape_is_null = not bool(t.shape)
        self.strides_is_null = not bool(t.strides)
        self.shape = tuple(t.shape[: t.ndim]) if t.shape else None
        self.strides = tuple(t.strides[: t.ndim]) if t.strides else None
        self.byte_offset = t.byte_offset


def capsule_name(capsule: Any) -> str:
    raw = _PyCapsule_GetName(capsule)
    return raw.decode() if raw is not None else ""


# -- NumPy over raw memory ---------------------------------------------------------------------
def array_at(address: int, shape: tuple[int, ...], strides_elems: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A NumPy view of ``shape``/``strides`` (in elements) at ``address`` (element 0),
    for dtypes NumPy's DLPack cannot take (bfloat16, float8: ml_dtypes)."""
    npdt = np.dtype(dtype)
    if 0 in shape:
        return np.empty(shape, npdt)
    lo = sum(s * (n - 1) for s, n in zip(strides_elems, shape) if s < 0)
    hi = sum(s * (n - 1) for s, n in zip(strides_elems, shape) if s > 0)
    span = (hi - lo + 1) * npdt.itemsize
    buf = (ctypes.c_char * span).from_address(address + lo * npdt.itemsize)
    return np.ndarray(shape, npdt, buffer=buf, offset=-lo * npdt.itemsize,
                      strides=tuple(s * npdt.itemsize for s in strides_elems))


def tensor_bytes(t: tx.Tensor) -> bytes:
    """The bytes of ``t``'s elements in row-major order."""
    return array_at(t.data_ptr, t.shape, t.strides, f"V{t.dtype.itemsize}").tobytes()


# -- registry ---------------------------------------------------------------------------------
_COUNTS = ("live_records", "exports_outstanding", "imports_outstanding", "pending_releases")
_TOTALS = ("created_total", "released_total")


def settle(full: bool = True) -> dict[str, Any]:
    """Run the garbage collector (``full``: all generations, else the young ones) and
    wait for pending releases; then the registry's stats."""
    if full:
        gc.collect()
    else:
        gc.collect(1)
    assert tx.registry().collect(timeout=10), "pending releases did not complete in 10 s"
    return tx.registry().stats()


_last_clean: dict[str, Any] | None = None


class Baseline:
    """Registry counts at the start of a test, to check nothing is left at its end
    (other tests in the same process may keep their own records alive).

    A full garbage collection costs tens of milliseconds with PyTorch and JAX loaded,
    so it runs only when needed: at the start when the registry moved since the last
    clean check, at the end when the young generations did not bring the counts back.
    """

    def __init__(self) -> None:
        now = tx.registry().stats()
        if _last_clean is not None and all(now[k] == _last_clean[k] for k in _COUNTS + _TOTALS):
            self.before = now
        else:
            self.before = settle(full=True)

    def delta(self, full: bool = True) -> dict[str, int]:
        after = settle(full)
        return {k: after[k] - self.before[k] for k in _COUNTS}

    def assert_clean(self) -> None:
        global _last_clean
        zero = {k: 0 for k in _COUNTS}
        d = self.delta(full=False)
        if d != zero:
            d = self.delta(full=True)
        assert d == zero, f"registry has leftovers: {d}"
        _last_clean = tx.registry().stats()
