"""Pure-Python (ctypes) twin of the compiled core's capsule and counter parts
(exchange/native/capsule.c, module.c): same results. Its deleters tell the registry
through a callback, where the compiled core's release the record themselves.

Used where the compiled core is absent (``pip install`` with no compiler, or the tree
run from PYTHONPATH) or when ``EXCHANGE_PURE_PYTHON=1``. Known limit, shared by every
ctypes DLPack producer: the capsule destructor is a ctypes callback, so if a consumer
drops a refused capsule with its exception still set, ctypes may report a SystemError
and lose that export's release (DESIGN.md, "Known hazard"). The compiled helper has no
such limit; ``exchange.capsule.NATIVE`` says which one is in use.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import sys
import threading
from typing import Callable

from . import _dlpack_abi as abi
from .layout import check_address, check_ndim, check_shape

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetName.restype = ctypes.c_void_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]

_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]
_free = _libc.free
_free.argtypes = [ctypes.c_void_p]
FREE_ADDRESS = ctypes.cast(_free, ctypes.c_void_p).value

MAX_NDIM = abi.MAX_NDIM
_VERSIONED_SIZE = ctypes.sizeof(abi.DLManagedTensorVersioned)
_LEGACY_SIZE = ctypes.sizeof(abi.DLManagedTensor)
_DELETER_OFFSET = {True: abi.DLManagedTensorVersioned.deleter.offset, False: abi.DLManagedTensor.deleter.offset}

_release_callback: Callable[[int], None] | None = None
_finalizing = False
# Blocks we exported and nobody has released yet: at shutdown their deleter field is
# pointed at libc free(), so a late deleter call frees the block and touches no Python.
_outstanding: dict[int, bool] = {}
_outstanding_lock = threading.RLock()  # reentrant: a GC-run deleter may arrive while held
# Held while a capsule is read for import and while it is renamed (import_info,
# mark_used); reentrant, since a finaliser run by a collection inside may import too.
_consume_lock = threading.RLock()


def _after_fork_in_child() -> None:
    # A thread of the parent may have held these at the fork: the child starts with new ones.
    global _outstanding_lock, _consume_lock
    _outstanding_lock = threading.RLock()
    _consume_lock = threading.RLock()


def _notify(ptr: int, versioned: bool) -> None:
    with _outstanding_lock:
        _outstanding.pop(ptr, None)
    if _finalizing or sys.is_finalizing():
        return
    struct = abi.DLManagedTensorVersioned if versioned else abi.DLManagedTensor
    ctx = struct.from_address(ptr).manager_ctx or 0
    try:
        if _release_callback is not None:
            _release_callback(ctx)
    except BaseException as exc:  # a deleter never raises
        try:
            _REPORT_UNRAISABLE(exc)
        except BaseException:
            pass
    finally:
        _free(ptr)


def _reraise(exc: BaseException) -> None:
    raise exc


# Reports an exception through sys.unraisablehook, as the compiled helper's
# PyErr_WriteUnraisable does (Python code cannot build the hook's argument itself):
# ctypes reports whatever a callback raises that way, and the call returns normally.
_REPORT_UNRAISABLE = ctypes.CFUNCTYPE(None, ctypes.py_object)(_reraise)


def _deleter_legacy(ptr: int) -> None:
    if ptr:
        _notify(ptr, False)


def _deleter_versioned(ptr: int) -> None:
    if ptr:
        _notify(ptr, True)


# ctypes callbacks must stay referenced for as long as C may call them: module globals.
_DELETER_LEGACY = abi.DLManagedTensorDeleter(_deleter_legacy)
_DELETER_VERSIONED = abi.DLManagedTensorDeleter(_deleter_versioned)
_DELETER_ADDR = {
    False: ctypes.cast(_DELETER_LEGACY, ctypes.c_void_p).value,
    True: ctypes.cast(_DELETER_VERSIONED, ctypes.c_void_p).value,
}


def _capsule_destructor(cap: int) -> None:
    # A conforming destructor: act only on an unconsumed capsule; NULL deleter is fine.
    # During interpreter teardown module globals may already be gone: then do nothing
    # (the export leaks, which is acceptable at exit; a crash is not).
    try:
        if _finalizing:
            return
        obj = ctypes.cast(cap, ctypes.py_object)
        for name in (abi.DLTENSOR_VERSIONED_NAME, abi.DLTENSOR_NAME):
            if _api.PyCapsule_IsValid(obj, name):
                ptr = _api.PyCapsule_GetPointer(obj, name)
                _call(ptr, name == abi.DLTENSOR_VERSIONED_NAME)
                return
    except BaseException:
        pass


_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_destructor)
_DESTRUCTOR_ADDR = ctypes.cast(_DESTRUCTOR, ctypes.c_void_p).value

# C may call these callbacks after this module's globals are cleared at shutdown (a
# capsule in a reference cycle is destroyed by the last collection): one reference that
# is never dropped keeps their code alive for the life of the process.
for _callback in (_DELETER_LEGACY, _DELETER_VERSIONED, _DESTRUCTOR):
    _api.Py_IncRef(ctypes.py_object(_callback))


def new_capsule(versioned, ctx, data, device_type, device_id, code, bits, shape, strides, flags):
    """Make a capsule; one malloc holds the struct, shape and strides; byte_offset 0."""
    ndim = len(shape)
    if len(strides) != ndim:
        raise ValueError(f"strides must be a tuple of {ndim} ints")
    head = _VERSIONED_SIZE if versioned else _LEGACY_SIZE
    ptr = _malloc(head + 16 * ndim + 1)
    if not ptr:
        raise MemoryError("malloc failed for a DLPack managed tensor")
    try:
        dims = (ctypes.c_int64 * (2 * ndim)).from_address(ptr + head)
        dims[:ndim] = shape
        dims[ndim:] = strides
        if versioned:
            m = abi.DLManagedTensorVersioned.from_address(ptr)
            m.version.major, m.version.minor = abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION
            m.flags = flags
        else:
            m = abi.DLManagedTensor.from_address(ptr)
        m.manager_ctx = ctx
        m.deleter = _DELETER_ADDR[bool(versioned)]
        t = m.dl_tensor
        t.data = data or None
        t.device.device_type, t.device.device_id = device_type, device_id
        t.ndim = ndim
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        if ndim:
            t.shape = ctypes.cast(ptr + head, ctypes.POINTER(ctypes.c_int64))
            t.strides = ctypes.cast(ptr + head + 8 * ndim, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        name = abi.DLTENSOR_VERSIONED_NAME if versioned else abi.DLTENSOR_NAME
        cap = _api.PyCapsule_New(ptr, name, _DESTRUCTOR_ADDR)
    except BaseException:
        _free(ptr)
        raise
    with _outstanding_lock:
        _outstanding[ptr] = bool(versioned)
    return cap


def _capsule_name(capsule) -> bytes:
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError("expected a DLPack PyCapsule")
    addr = _api.PyCapsule_GetName(capsule)
    return ctypes.string_at(addr) if addr else b""


_WHAT = "DLPack tensor"  # how the layout's errors name what they refuse
ALREADY_CONSUMED = ("this DLPack capsule was already consumed (its name is used_...); "
                    "a capsule can be consumed once: ask the producer for a new one")


# The managed structs read with one unpack (dlpack.md section 2: no padding; native byte
# order): versioned = version, manager_ctx, deleter, flags, then the DLTensor; legacy =
# the DLTensor, then manager_ctx and deleter. DLTensor: data, device_type, device_id,
# ndim, code, bits, lanes, shape, strides, byte_offset.
_VERSION = struct.Struct("=II")
_VERSIONED = struct.Struct("=IIQQQQiiiBBHQQQ")
_LEGACY = struct.Struct("=QiiiBBHQQQQQ")
_DIMS: dict[int, struct.Struct] = {}


def _dims(address: int, ndim: int) -> tuple[int, ...]:
    fmt = _DIMS.get(ndim)
    if fmt is None:
        fmt = _DIMS[ndim] = struct.Struct(f"={ndim}q")
    return fmt.unpack(ctypes.string_at(address, 8 * ndim))


def _read(capsule) -> tuple:
    """(versioned, ptr, major, minor, ctx, deleter, flags, data, device_type, device_id,
    ndim, code, bits, lanes, shape_ptr, strides_ptr, byte_offset) of an unconsumed
    capsule; ValueError for a consumed one or another name, TypeError for no capsule."""
    if _api.PyCapsule_IsValid(capsule, abi.DLTENSOR_VERSIONED_NAME):
        ptr = _api.PyCapsule_GetPointer(capsule, abi.DLTENSOR_VERSIONED_NAME)
        major, minor = _VERSION.unpack(ctypes.string_at(ptr, 8))
        if major != 1:  # another layout: the version is all that may be read
            return (True, ptr, major, minor, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        major, minor, ctx, deleter, flags, *tensor = _VERSIONED.unpack(ctypes.string_at(ptr, 80))
        return (True, ptr, major, minor, ctx, deleter, flags, *tensor)
    if _api.PyCapsule_IsValid(capsule, abi.DLTENSOR_NAME):
        ptr = _api.PyCapsule_GetPointer(capsule, abi.DLTENSOR_NAME)
        *tensor, ctx, deleter = _LEGACY.unpack(ctypes.string_at(ptr, 64))
        return (False, ptr, 0, 0, ctx, deleter, 0, *tensor)
    name = _capsule_name(capsule)  # TypeError for no capsule
    if name in (abi.USED_DLTENSOR_NAME, abi.USED_DLTENSOR_VERSIONED_NAME):
        raise ValueError(ALREADY_CONSUMED)
    raise ValueError(
        f"capsule named {name.decode(errors='replace')!r} is not a DLPack tensor; "
        "expected 'dltensor' or 'dltensor_versioned'"
    )


def peek(capsule):
    """Read a capsule without renaming it; same tuple as the compiled ``peek``."""
    (versioned, ptr, major, minor, _, _, flags, data, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr,
     strides_ptr, byte_offset) = _read(capsule)
    if versioned and major != 1:
        return (True, ptr, major, minor)
    ok_dims = 0 < ndim <= MAX_NDIM
    shape = _dims(shape_ptr, ndim) if ok_dims and shape_ptr else (() if ndim == 0 else None)
    strides = _dims(strides_ptr, ndim) if ok_dims and strides_ptr else None
    return (versioned, ptr, major, minor, flags, data, dev_type, dev_id, ndim, code, bits, lanes, shape, strides,
            byte_offset)


def import_info(capsule):
    """Same as the compiled ``import_info``: peek and validate in one call, never
    renaming; a versioned capsule of another major is renamed, its deleter called, and
    BufferError raised. The last item is the export id of a capsule we made, else 0.

    The struct is read under the consume lock, as ``mark_used`` renames: the compiled
    helper reads it in one call under the GIL; here another thread consuming the same
    capsule could otherwise rename it, release it and free the struct mid-read."""
    with _consume_lock:
        fields = _read(capsule)
        ndim, shape_ptr, strides_ptr = fields[10], fields[14], fields[15]
        ok_dims = 0 <= ndim <= MAX_NDIM and (shape_ptr or ndim == 0)  # all 0 for another major
        shape = _dims(shape_ptr, ndim) if ok_dims and ndim else ()
        strides = _dims(strides_ptr, ndim) if ok_dims and ndim and strides_ptr else None
    (versioned, ptr, major, minor, ctx, deleter, flags, data, dev_type, dev_id, _, code, bits, lanes, _, _,
     byte_offset) = fields
    if versioned and major != 1:
        _api.PyCapsule_SetName(capsule, abi.USED_DLTENSOR_VERSIONED_NAME)
        _call(ptr, True)
        raise BufferError(
            f"DLPack version {major}.{minor} is not supported (this library reads major version 1); "
            "ask the producer for max_version=(1, 3)"
        )
    # The checks, their order and their words are the compiled core's (read_layout in
    # exchange/native/capsule.c); the layout's own are exchange.layout's, shared by both.
    check_ndim(ndim, _WHAT, BufferError)
    if not ok_dims:
        raise BufferError(f"DLPack tensor has ndim={ndim} but no readable shape (NULL, or ndim negative)")
    if lanes != 1:
        raise BufferError(f"DLPack dtype with lanes={lanes} (a vector element type) is not supported; lanes must be 1")
    if bits == 0 or bits % 8:
        raise BufferError(f"DLPack dtype (code={code}, bits={bits}) is not supported; "
                          "sub-byte and odd widths cannot be held")
    strides, lo, nbytes = check_shape(shape, strides, bits // 8, _WHAT, BufferError)
    if nbytes and not data:
        raise BufferError(f"DLPack tensor has a NULL data pointer but {math.prod(shape)} elements; it is malformed "
                          "(only a zero-size tensor may have NULL data)")
    element0, address = check_address(data, byte_offset, lo, nbytes, _WHAT, BufferError)
    # False, True (READ_ONLY flag), or 2 (a legacy capsule: it cannot say; see tensor.py)
    readonly = 2 if not versioned else bool(flags & abi.DLPACK_FLAG_BITMASK_READ_ONLY)
    own = ctx if deleter == _DELETER_ADDR[versioned] else 0  # our own export, back
    return (versioned, ptr, readonly, element0, address, nbytes, _devices.get((dev_type, dev_id)),
            _dtypes.get((code, bits)), dev_type, dev_id, code, bits, shape, strides, own)


_devices: dict = {}
_dtypes: dict = {}


def set_lookups(devices: dict, dtypes: dict) -> None:
    """The Device and DType caches ``import_info`` consults (as the compiled helper)."""
    global _devices, _dtypes
    _devices, _dtypes = devices, dtypes


_USED = {abi.DLTENSOR_NAME: abi.USED_DLTENSOR_NAME, abi.DLTENSOR_VERSIONED_NAME: abi.USED_DLTENSOR_VERSIONED_NAME}
def mark_used(capsule) -> None:
    # Checking the name and renaming are one step (the C helper's is one call under the
    # GIL): two threads consuming one capsule must not both succeed.
    with _consume_lock:
        if _api.PyCapsule_IsValid(capsule, abi.DLTENSOR_VERSIONED_NAME):
            used = abi.USED_DLTENSOR_VERSIONED_NAME
        elif _api.PyCapsule_IsValid(capsule, abi.DLTENSOR_NAME):
            used = abi.USED_DLTENSOR_NAME
        else:
            raise ValueError(ALREADY_CONSUMED)
        if _api.PyCapsule_SetName(capsule, used) != 0:
            raise ValueError("could not rename the capsule")


def _call(ptr: int, versioned: bool) -> None:
    fn = ctypes.c_void_p.from_address(ptr + _DELETER_OFFSET[versioned]).value
    if fn:
        abi.DLManagedTensorDeleter(fn)(ptr)


def call_deleter(ptr: int, versioned: bool) -> None:
    """The consumer's one call of the producer's deleter (skipped when it is NULL)."""
    if ptr:
        _call(ptr, versioned)


def set_release_callback(fn: Callable[[int], None] | None) -> None:
    global _release_callback
    _release_callback = fn


def set_finalizing() -> None:
    """From now on our deleters free only their own block: point every outstanding
    export's deleter at libc free(), which needs no Python at all."""
    global _finalizing
    _finalizing = True
    with _outstanding_lock:
        for ptr, versioned in _outstanding.items():
            ctypes.c_void_p.from_address(ptr + _DELETER_OFFSET[versioned]).value = FREE_ADDRESS
        _outstanding.clear()



# -- the registry's counters (as the compiled helper's; a lock where C has the GIL) --------
MAX_SLOTS = 1024
_counts_lock = threading.Lock()  # held only around list arithmetic: nothing inside can re-enter
_live_bytes = [0] * MAX_SLOTS
_pending_bytes = [0] * MAX_SLOTS
_total = [0, 0, 0]  # live total, peak, peak users


def bytes_add(slot: int, delta: int) -> None:
    """Live bytes of device ``slot`` change by ``delta``."""
    with _counts_lock:
        _live_bytes[slot] += delta
        _total[0] += delta
        if _total[2] and _total[0] > _total[1]:
            _total[1] = _total[0]


def pending_add(slot: int, delta: int) -> None:
    """Bytes of device ``slot`` waiting for their release change by ``delta``."""
    with _counts_lock:
        _pending_bytes[slot] += delta


def counts(slots: int) -> tuple[list[int], list[int]]:
    """Live and pending bytes of the first ``slots`` device slots."""
    with _counts_lock:
        return _live_bytes[:slots], _pending_bytes[:slots]


def peak_begin() -> None:
    """Measure the peak of live bytes from now (measurements may nest)."""
    with _counts_lock:
        if _total[2] == 0 or _total[0] > _total[1]:
            _total[1] = _total[0]
        _total[2] += 1


def peak_end() -> int:
    """End one peak measurement; returns the peak in bytes."""
    with _counts_lock:
        _total[2] = max(0, _total[2] - 1)
        return _total[1]


def peak_value() -> int:
    return _total[1]


os.register_at_fork(after_in_child=_after_fork_in_child)


def reset_counts() -> None:
    """Zero every counter (a forked child starts its own); the lock is new too, since a
    thread of the parent may have held it at the fork."""
    global _counts_lock
    _counts_lock = threading.Lock()
    _live_bytes[:] = [0] * MAX_SLOTS
    _pending_bytes[:] = [0] * MAX_SLOTS
    _total[:] = [0, 0, 0]
