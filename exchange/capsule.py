"""Producing and consuming DLPack capsules (DLPack 1.3, ``python_spec.rst``).

Producing: one malloc holds the managed struct with shape and strides; ``manager_ctx``
carries an integer export id, never an object pointer; the capsule's destructor calls
the deleter only if the capsule was never consumed; our deleter tells the registry the
export is released, from any thread, and only frees its own block after shutdown.

Consuming: read and validate everything and build the result first; rename the capsule
to its ``used_`` name last, so that any failure leaves the producer's deleter in charge.

The compiled helper ``exchange._native`` does the C parts; ``exchange._capsule_ctypes``
is its pure-Python twin, used when the helper is absent or EXCHANGE_PURE_PYTHON=1.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
from typing import Any

from . import _dlpack_abi as abi
from .device import Device, DeviceType
from .dtypes import DType, from_dlpack_code
from .registry import Record, registry

__all__ = ["NATIVE", "export", "consume", "is_capsule", "row_major_strides"]

_impl: Any
if os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0"):
    from . import _capsule_ctypes as _impl
else:
    try:
        from . import _native as _impl  # type: ignore[attr-defined, no-redef]
    except ImportError:
        from . import _capsule_ctypes as _impl

#: True when the compiled helper is in use (False: the pure-Python ctypes path).
NATIVE: bool = _impl.__name__.endswith("_native")

_REG = registry()
_impl.set_release_callback(_REG.export_released)
_export_ids = itertools.count(1)

# Device types whose memory this library can hold; anything else is refused on import.
_KNOWN_DEVICES = {DeviceType.kDLCPU, DeviceType.kDLCUDA, DeviceType.kDLCUDAHost, DeviceType.kDLCUDAManaged}
_READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
_IS_COPIED = abi.DLPACK_FLAG_BITMASK_IS_COPIED


@atexit.register
def _at_exit() -> None:
    # Exports still held by other frameworks may be released during interpreter
    # teardown: from now on our deleters only free their own block (a leak of the data
    # is acceptable there; a call into a finalising interpreter is not).
    _REG._shutdown()
    _impl.set_finalizing()


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides in elements for ``shape``."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def export(record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
           dtype: DType, device: Device, versioned: bool, flags: int) -> Any:
    """A new capsule over ``record``'s memory; the registry counts it as a holder until
    the consumer calls the deleter (or the unconsumed capsule is destroyed).

    ``data`` is the address of element 0 with ``byte_offset`` 0 (several consumers
    ignored byte_offset: pytorch#168177, warp#1573); zero-size tensors carry NULL.
    """
    ctx = next(_export_ids)
    data = 0 if 0 in shape else data_ptr
    _REG.add_export(record, ctx)
    try:
        return _impl.new_capsule(versioned, ctx, data, int(device.type), device.id, dtype.code, dtype.bits,
                                 shape, strides, flags)
    except BaseException:
        _REG.export_released(ctx)
        raise


class Imported:
    """What ``consume`` hands back: the new record and the view's layout."""

    __slots__ = ("record", "data_ptr", "shape", "strides", "dtype", "readonly", "copied")

    def __init__(self, record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: DType, readonly: bool, copied: bool) -> None:
        self.record = record
        self.data_ptr = data_ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.readonly = readonly
        self.copied = copied


def consume(capsule: Any, producer: str, build: Any, owner: Any = None) -> Any:
    """Consume a DLPack capsule: validate it, make an imported record whose release is
    one call of the producer's deleter, call ``build(imported)`` to make the result,
    and only then rename the capsule ``used_...``. ``owner`` (the producer object, if
    any) is kept referenced until the release as well: some producers (ONNX Runtime's
    ``OrtValue.__dlpack__``) say their object must outlive the capsule.

    Raises ValueError for a consumed capsule or one of another name (nothing touched);
    BufferError for what this library cannot hold (unknown device type or dtype,
    lanes != 1, malformed shape); BufferError for another major version, after calling
    its deleter as the spec requires (nothing else is read).
    """
    info = _impl.peek(capsule)
    versioned, ptr = info[0], info[1]
    if versioned and info[2] != abi.DLPACK_MAJOR_VERSION:
        _impl.mark_used(capsule)
        _impl.call_deleter(ptr, True)
        raise BufferError(
            f"DLPack version {info[2]}.{info[3]} is not supported (this library reads major version 1); "
            "ask the producer for max_version=(1, 3)"
        )
    (_, _, _, _, flags, data, dev_type, dev_id, ndim, code, bits, lanes, shape, strides, byte_offset) = info
    try:
        device_type = DeviceType(dev_type)
    except ValueError:
        raise BufferError(f"unknown DLPack device type {dev_type}; this library holds CPU and CUDA memory") from None
    if device_type not in _KNOWN_DEVICES:
        raise BufferError(f"{device_type.name} memory is not supported; this library holds CPU and CUDA memory")
    if dev_id < 0:
        raise BufferError(f"negative device_id {dev_id} in DLPack tensor")
    dtype = from_dlpack_code(code, bits, lanes)
    if ndim < 0:
        raise BufferError(f"DLPack tensor has negative ndim {ndim}")
    if shape is None:
        raise BufferError(f"DLPack tensor has ndim={ndim} but shape is NULL (or ndim is too large to read)")
    if any(n < 0 for n in shape):
        raise BufferError(f"DLPack tensor has a negative extent in shape {shape}")
    if strides is None:
        strides = row_major_strides(shape)  # NULL strides mean compact row-major
    itemsize = dtype.itemsize
    size = math.prod(shape)
    element0 = data + byte_offset
    if size == 0:
        address, nbytes = element0, 0
    else:
        lo = sum(st * (n - 1) for st, n in zip(strides, shape) if st < 0)
        hi = sum(st * (n - 1) for st, n in zip(strides, shape) if st > 0)
        address, nbytes = element0 + lo * itemsize, (hi - lo + 1) * itemsize
    readonly = (not versioned) or bool(flags & _READ_ONLY)
    record = _REG.new_record(Device(device_type, dev_id), address, nbytes,
                             origin=f"imported from {producer}", kind="imported",
                             release=_deleter_call(ptr, versioned), owner=owner)
    try:
        result = build(Imported(record, element0, shape, strides, dtype, readonly, bool(flags & _IS_COPIED)))
        _impl.mark_used(capsule)
    except BaseException:
        _REG.discard(record)
        raise
    return result


def _deleter_call(ptr: int, versioned: bool) -> Any:
    call = _impl.call_deleter
    return lambda: call(ptr, versioned)


def deleter_addresses() -> tuple[int, int]:
    """Addresses of our legacy and versioned deleters (to recognise our own capsules)."""
    return _impl.deleter_addresses()
