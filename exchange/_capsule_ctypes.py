"""Pure-Python (ctypes) twin of the compiled core's capsule and counter parts
(exchange/native/capsule.c, module.c): same results. Its exports tell the registry
through a callback, where the compiled core's deleters release the record themselves.

Used where the compiled core is absent (``pip install`` with no compiler, or the tree
run from PYTHONPATH) or when ``EXCHANGE_PURE_PYTHON=1``; ``exchange.capsule.NATIVE``
says which one is in use.

No C code of ours runs here, and no ctypes callback either: a ctypes callback runs its
Python code with whatever exception its caller has pending, and a consumer drops a
refused capsule (or the array it made from one) while its own error unwinds. ctypes
then reports a SystemError in place of that error, and a callback that clears it
leaves the interpreter unwinding with no exception at all: it dereferences NULL
(SIGSEGV). So the capsule destructor and the deleter of our exports are NumPy's C
functions (a required dependency), and the Python code that tells the registry runs
from ``__del__`` of the reference the block holds, which the interpreter calls with
any pending exception saved and restored (docs/design.md, "Capsules").
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
import threading
from typing import Callable

from . import _dlpack_abi as abi
from .layout import check_address, check_ndim, check_shape
from .runtime import CORE, register

# A private handle on the C API (the same library as ctypes.pythonapi): the argtypes set
# here cannot clash with another package's declarations on ctypes.pythonapi.
_api = ctypes.PyDLL(None, handle=ctypes.pythonapi._handle)
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
_api.PyCapsule_GetDestructor.restype = ctypes.c_void_p
_api.PyCapsule_GetDestructor.argtypes = [ctypes.py_object]
_api.PyMem_Malloc.restype = ctypes.c_void_p
_api.PyMem_Malloc.argtypes = [ctypes.c_size_t]
_api.PyMem_Free.restype = None
_api.PyMem_Free.argtypes = [ctypes.c_void_p]
_api.Py_IncRef.restype = None
_api.Py_IncRef.argtypes = [ctypes.py_object]
_api.Py_DecRef.restype = None
_api.Py_DecRef.argtypes = [ctypes.py_object]

MAX_NDIM = abi.MAX_NDIM
_VERSIONED_SIZE = ctypes.sizeof(abi.DLManagedTensorVersioned)
_LEGACY_SIZE = ctypes.sizeof(abi.DLManagedTensor)
_DELETER_OFFSET = {True: abi.DLManagedTensorVersioned.deleter.offset, False: abi.DLManagedTensor.deleter.offset}
_CTX_OFFSET = {True: abi.DLManagedTensorVersioned.manager_ctx.offset, False: abi.DLManagedTensor.manager_ctx.offset}

# Held while a capsule is read for import and while it is renamed (import_info,
# mark_used); reentrant, since a finaliser run by a collection inside may import too.
_consume_lock = threading.RLock()


def _after_fork_in_child() -> None:
    # A thread of the parent may have held it at the fork: the child starts with a new one.
    global _consume_lock
    _consume_lock = threading.RLock()


# -- who owns an export, and who tells the registry -------------------------------------------
# An export is one PyMem block (struct, shape, strides) whose manager_ctx holds one strong
# reference to an _Export, the export id as an int. Its capsule's destructor and its
# deleter are NumPy's (numpy/_core/src/multiarray/dlpack.c, the same since NumPy 2.1):
#   destructor: if the capsule is still named dltensor[_versioned], call the deleter
#               (what the DLPack Python spec asks of every producer);
#   deleter:    leak if Py_IsInitialized() is false; else take the GIL (any thread),
#               PyMem_Free the block, drop the manager_ctx reference.
# Dropping that reference runs _Export.__del__ through the interpreter's finaliser
# (slot_tp_finalize), which saves the pending exception first and restores it after:
# the registry is told with no exception pending, and the consumer's own exception
# arrives unchanged. Exceptions in __del__ go to sys.unraisablehook, as the compiled
# core's PyErr_WriteUnraisable.

#: [callback] with the registry's export_released; [None] before it is set and from the
#: exit hook on (set_finalizing): a late deleter then frees the block and tells no one.
_NOTIFY: list[Callable[[int], None] | None] = [None]
#: id(_Export) -> export id of each export whose deleter has not run: how import_info
#: knows a capsule of ours coming back (an _Export's address is not reused while alive).
_outstanding: dict[int, int] = {}


class _Export(int):
    """The reference an export's block holds in manager_ctx; its value is the export id."""

    __slots__ = ()

    # Module globals may be cleared by the time a late deleter runs at shutdown: what
    # __del__ needs is bound here.
    def __del__(self, _outstanding=_outstanding, _notify=_NOTIFY, _id=id, _int=int) -> None:
        _outstanding.pop(_id(self), None)
        callback = _notify[0]
        if callback is not None:
            callback(_int(self))


# NumPy's destructor and deleter, legacy (False) and versioned (True), read from capsules
# NumPy makes, on first export (``import exchange`` does not import NumPy). -1 matches no
# deleter read from a struct.
_DESTRUCTOR_ADDR = {False: -1, True: -1}
_DELETER_ADDR = {False: -1, True: -1}


def _load_numpy_functions() -> None:
    import numpy as np

    owner = np.empty(1, np.uint8)
    found = {}
    for versioned in (False, True):
        refs = sys.getrefcount(owner)
        cap = owner.__dlpack__(max_version=(1, 0)) if versioned else owner.__dlpack__()
        name = abi.DLTENSOR_VERSIONED_NAME if versioned else abi.DLTENSOR_NAME
        ptr = _api.PyCapsule_GetPointer(cap, name)
        deleter = ctypes.c_void_p.from_address(ptr + _DELETER_OFFSET[versioned]).value
        ctx = ctypes.c_void_p.from_address(ptr + _CTX_OFFSET[versioned]).value
        destructor = _api.PyCapsule_GetDestructor(cap)
        # What this module relies on: the capsule holds one reference to the array, in
        # manager_ctx; both functions exist.
        if not (deleter and destructor and ctx == id(owner) and sys.getrefcount(owner) == refs + 1):
            raise RuntimeError(
                f"NumPy {np.__version__}'s DLPack export does not hold a reference to its array in manager_ctx, "
                "as NumPy 2.1 to 2.4 do: the pure-Python path builds on that (docs/design.md, Capsules); use one "
                "of those, or the compiled core (install tensor-exchange from a wheel, or with a C compiler)")
        found[versioned] = destructor, deleter
        del cap  # NumPy's destructor releases the probe
    # The deleter last: new_capsule checks it, so another thread that sees it sees both.
    for versioned, (destructor, deleter) in found.items():
        _DESTRUCTOR_ADDR[versioned], _DELETER_ADDR[versioned] = destructor, deleter


def new_capsule(versioned, ctx, data, device_type, device_id, code, bits, shape, strides, flags):
    """A capsule for export id ``ctx``: one PyMem block holds the struct, shape and
    strides (byte_offset 0), its manager_ctx the _Export that tells the registry; the
    destructor and the deleter are NumPy's (see above)."""
    versioned = bool(versioned)
    if _DELETER_ADDR[versioned] == -1:
        _load_numpy_functions()
    ndim = len(shape)
    if len(strides) != ndim:
        raise ValueError(f"strides must be a tuple of {ndim} ints")
    head = _VERSIONED_SIZE if versioned else _LEGACY_SIZE
    ptr = _api.PyMem_Malloc(head + 16 * ndim + 1)
    if not ptr:
        raise MemoryError("PyMem_Malloc failed for a DLPack managed tensor")
    owner = _Export(ctx)
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
        m.manager_ctx = id(owner)
        m.deleter = _DELETER_ADDR[versioned]
        t = m.dl_tensor
        t.data = data or None
        t.device.device_type, t.device.device_id = device_type, device_id
        t.ndim = ndim
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        if ndim:
            t.shape = ctypes.cast(ptr + head, ctypes.POINTER(ctypes.c_int64))
            t.strides = ctypes.cast(ptr + head + 8 * ndim, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
    except BaseException:
        _api.PyMem_Free(ptr)
        raise
    name = abi.DLTENSOR_VERSIONED_NAME if versioned else abi.DLTENSOR_NAME
    _outstanding[id(owner)] = ctx
    _api.Py_IncRef(owner)  # the block's reference to it: NumPy's deleter drops it
    try:
        return _api.PyCapsule_New(ptr, name, _DESTRUCTOR_ADDR[versioned])
    except (MemoryError, ValueError):  # only PyCapsule_New's own failures: then no capsule owns the block
        _api.PyMem_Free(ptr)
        _api.Py_DecRef(owner)
        raise


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
    core reads it in one call under the GIL; here another thread consuming the same
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
    own = _outstanding.get(ctx, 0) if deleter == _DELETER_ADDR[versioned] else 0  # our own export, back
    return (versioned, ptr, readonly, element0, address, nbytes, _devices.get((dev_type, dev_id)),
            _dtypes.get((code, bits)), dev_type, dev_id, code, bits, shape, strides, own)


_devices: dict = {}
_dtypes: dict = {}


def set_lookups(devices: dict, dtypes: dict) -> None:
    """The Device and DType caches ``import_info`` consults (as the compiled core)."""
    global _devices, _dtypes
    _devices, _dtypes = devices, dtypes


_USED = {abi.DLTENSOR_NAME: abi.USED_DLTENSOR_NAME, abi.DLTENSOR_VERSIONED_NAME: abi.USED_DLTENSOR_VERSIONED_NAME}
def mark_used(capsule) -> None:
    # Checking the name and renaming are one step (the compiled core's is one call under the
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
    """``fn(export_id)`` is called when the consumer of one of our exports is done."""
    _NOTIFY[0] = fn


def set_finalizing() -> None:
    """From the exit hook on, a deleter frees its block and tells no one (the registry
    releases nothing more; NumPy's deleter leaks even the block once the interpreter is
    finalized)."""
    _NOTIFY[0] = None



# -- the registry's counters (as the compiled core's; a lock where C has the GIL) --------
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


register("after_fork_in_child", "capsule.consume_lock", _after_fork_in_child, CORE + 10)


def reset_counts() -> None:
    """Zero every counter (a forked child starts its own); the lock is new too, since a
    thread of the parent may have held it at the fork."""
    global _counts_lock
    _counts_lock = threading.Lock()
    _live_bytes[:] = [0] * MAX_SLOTS
    _pending_bytes[:] = [0] * MAX_SLOTS
    _total[:] = [0, 0, 0]
