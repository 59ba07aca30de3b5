"""Producing and consuming DLPack capsules (DLPack 1.3, ``python_spec.rst``).

Producing: one malloc holds the managed struct with shape and strides; ``manager_ctx``
carries an integer export id, never an object pointer; the capsule's destructor calls
the deleter only if the capsule was never consumed; our deleter tells the registry the
export is released, from any thread, and only frees its own block after shutdown.

Consuming: read and validate everything and build the result first; rename the capsule
to its ``used_`` name last, so that any failure leaves the producer's deleter in charge.

The core seam (exchange/_core) does the work on either path: the compiled core in C,
or its pure-Python twin; this module is the one face the rest of the library uses.
"""

from __future__ import annotations

import atexit
from typing import Any

from . import _core
from .device import Device, DeviceType, from_dlpack_device
from .dtypes import DType
from .layout import is_c_contiguous, row_major_strides  # noqa: F401  (re-exported)
from .registry import Record, registry

__all__ = ["export", "consume", "is_capsule", "is_c_contiguous", "row_major_strides"]

_REG = registry()


@atexit.register
def _at_exit() -> None:
    # Exports still held by other frameworks may be released during interpreter
    # teardown: from now on our deleters only free their own block (a leak of the data
    # is acceptable there; a call into a finalising interpreter is not).
    _REG._shutdown()
    _core.set_finalizing()


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def export(record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
           dtype: DType, device: Device, versioned: bool, flags: int) -> Any:
    """A new capsule over ``record``'s memory; the registry counts it as a holder until
    the consumer calls the deleter (or the unconsumed capsule is destroyed).

    ``data`` is the address of element 0 with ``byte_offset`` 0 (several consumers
    ignored byte_offset: pytorch#168177, warp#1573); zero-size tensors carry NULL.
    """
    return _core.export(record, 0 if 0 in shape else data_ptr, int(device.type), device.id, dtype.code,
                        dtype.bits, shape, strides, versioned, flags)


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
    return _core.consume(capsule, producer, owner, stream)


def _device(dev_type: int, dev_id: int) -> Device:
    """Validate a DLPack device this library has not cached (BufferError if refused)."""
    try:
        device_type = DeviceType(dev_type)
    except ValueError:
        raise BufferError(f"unknown DLPack device type {dev_type}; this library holds {_HELD}") from None
    from .devices.base import memory_kind

    if memory_kind(device_type) is None:  # no backend declared what this memory is
        raise BufferError(f"{device_type.name} memory is not supported; this library holds {_HELD}")
    if dev_id < 0:
        raise BufferError(f"negative device_id {dev_id} in DLPack tensor")
    try:
        device = from_dlpack_device(device_type, dev_id)
    except ValueError as exc:  # e.g. a CPU device id other than 0
        raise BufferError(f"DLPack device ({dev_type}, {dev_id}) cannot be held: {exc}") from None
    return device


# What the refusals say this library holds (a backend's device types, as registered in
# exchange.devices).
_HELD = "the memory kinds its device backends declare (exchange.devices)"
