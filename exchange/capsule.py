"""Producing and consuming DLPack capsules (DLPack 1.3, ``python_spec.rst``).

Producing: one malloc holds the managed struct with shape and strides; ``manager_ctx``
carries an integer export id, never an object pointer; the capsule's destructor calls
the deleter only if the capsule was never consumed; our deleter tells the registry the
export is released, from any thread, and only frees its own block after shutdown.

Consuming: read and validate everything and build the result first; rename the capsule
to its ``used_`` name last, so that any failure leaves the producer's deleter in charge.

The compiled core ``exchange._native`` does the C parts; ``exchange._capsule_ctypes``
is its pure-Python twin, used when the core is absent or EXCHANGE_PURE_PYTHON=1.
"""

from __future__ import annotations

import atexit
import itertools
from typing import Any

from . import _dlpack_abi as abi
from .device import Device, DeviceType, from_dlpack_device
from .dtypes import _BY_CODE, DType, from_dlpack_code
from .layout import is_c_contiguous, row_major_strides  # noqa: F401  (re-exported)
from .registry import Record, registry

__all__ = ["NATIVE", "export", "consume", "is_capsule", "is_c_contiguous", "row_major_strides"]

from ._impl import NATIVE
from ._impl import impl as _impl

_REG = registry()
if not NATIVE:  # the compiled core's deleters tell the registry themselves
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


def export(record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
           dtype: DType, device: Device, versioned: bool, flags: int) -> Any:
    """A new capsule over ``record``'s memory; the registry counts it as a holder until
    the consumer calls the deleter (or the unconsumed capsule is destroyed).

    ``data`` is the address of element 0 with ``byte_offset`` 0 (several consumers
    ignored byte_offset: pytorch#168177, warp#1573); zero-size tensors carry NULL.
    """
    data = 0 if 0 in shape else data_ptr
    if NATIVE:
        return _impl.export(record, data, int(device.type), device.id, dtype.code, dtype.bits, shape, strides,
                            versioned, flags)
    ctx = next(_export_ids)
    _REG.add_export(record, ctx)
    try:
        return _impl.new_capsule(versioned, ctx, data, device.type, device.id, dtype.code, dtype.bits, shape,
                                 strides, flags)
    except BaseException:
        _REG.export_released(ctx)
        raise


def consume(capsule: Any, producer: str, owner: Any = None, stream: Any = None) -> Any:
    """Consume a DLPack capsule as a tx.Tensor: validate it, make an imported record
    whose release is one call of the producer's deleter (the Tensor its first holder,
    ordered on ``stream``, which joins the record's streams when given), and only then
    rename the capsule ``used_...``. ``owner`` (the producer object, if any) is kept
    referenced until the release as well: some producers (ONNX Runtime's
    ``OrtValue.__dlpack__``) say their object must outlive the capsule. A capsule this
    library exported comes back as a view of the same record.

    Raises TypeError when ``capsule`` is none (naming ``producer``); ValueError for a
    consumed capsule or one of another name (nothing touched); BufferError for what
    this library cannot hold (unknown device type or dtype, lanes != 1, NULL data with
    elements, and any layout the one layout check refuses: exchange/layout.py, which the
    compiled core repeats); BufferError for another major version, after
    calling its deleter as the spec requires (nothing else is read).
    """
    if not is_capsule(capsule):
        raise TypeError(f"{producer}.__dlpack__() returned {type(capsule).__name__}, not a DLPack capsule; "
                        "a producer's __dlpack__ must return a PyCapsule named 'dltensor' or "
                        "'dltensor_versioned'")
    if NATIVE:
        return _impl.consume(capsule, producer, owner, stream)
    (versioned, ptr, readonly, element0, address, nbytes, device, dtype, dev_type, dev_id, code, bits, shape,
     strides, own) = _impl.import_info(capsule)
    if own:
        return _consume_own(capsule, own, ptr, versioned, element0, shape, strides, dtype, code, bits, readonly,
                            stream)
    if device is None:
        device = _device(dev_type, dev_id)  # not seen before: validate (BufferError if refused)
    if dtype is None:
        dtype = from_dlpack_code(code, bits, 1)  # raises BufferError saying why
    record, token = _REG.new_held_record(device, address, nbytes, producer, "imported",
                                         (_impl.call_deleter, ptr, versioned), owner, None,
                                         "tx.Tensor")
    try:
        result = _new_tensor(record, token, element0, shape, strides, dtype, readonly, stream)
        if stream is not None:
            _REG.add_stream(record, stream)
        _impl.mark_used(capsule)
    except BaseException:
        _REG.discard(record)
        raise
    return result


def _consume_own(capsule: Any, ctx: int, ptr: int, versioned: bool, element0: int, shape: tuple[int, ...],
                 strides: tuple[int, ...], dtype: Any, code: int, bits: int, readonly: Any, stream: Any) -> Any:
    # A capsule this library exported, coming back (docs/design.md, "The compiled core":
    # it shares its record): the new Tensor holds the same record, and our export's holder goes now.
    # Claimed first (the rename is one atomic step): a second thread consuming the same
    # capsule then gets "already consumed", and the deleter call is ours from here on.
    _impl.mark_used(capsule)
    try:
        record = _REG._exports[ctx][0]  # held by this export until the deleter below
        if dtype is None:
            dtype = from_dlpack_code(code, bits, 1)
        token = _REG.add_holder(record, "tx.Tensor")
        try:
            result = _new_tensor(record, token, element0, shape, strides, dtype, readonly, stream)
            if stream is not None:
                _REG.add_stream(record, stream)
            return result
        except BaseException:
            _REG.remove_holder(record, token)
            raise
    finally:
        _impl.call_deleter(ptr, versioned)  # consumed by us: the export's holder is released


def _new_tensor(*args: Any) -> Any:
    raise RuntimeError("exchange.tensor has not registered its Tensor constructor")  # never: see below


def set_tensor_constructor(make: Any) -> None:
    """The pure path's Tensor constructor, given by exchange.tensor when it loads (it
    builds on this module; this module never imports it)."""
    global _new_tensor
    _new_tensor = make


def _device(dev_type: int, dev_id: int) -> Device:
    """Validate a DLPack device this library has not cached (BufferError if refused)."""
    try:
        device_type = DeviceType(dev_type)
    except ValueError:
        raise BufferError(f"unknown DLPack device type {dev_type}; this library holds CPU and CUDA memory") from None
    if device_type not in _KNOWN_DEVICES:
        raise BufferError(f"{device_type.name} memory is not supported; this library holds CPU and CUDA memory")
    if dev_id < 0:
        raise BufferError(f"negative device_id {dev_id} in DLPack tensor")
    try:
        device = from_dlpack_device(device_type, dev_id)
    except ValueError as exc:  # e.g. a CPU device id other than 0
        raise BufferError(f"DLPack device ({dev_type}, {dev_id}) cannot be held: {exc}") from None
    if len(_KNOWN) < 1024:
        _KNOWN[(dev_type, dev_id)] = device
    return device


_KNOWN: dict[tuple[int, int], Device] = {}
if not NATIVE:
    _impl.set_lookups(_KNOWN, _BY_CODE)

