"""``tx.borrow``: a scoped, non-owning, checked view of memory that has no deleter.

This is the answer to TVM's ``NDArray::FromExternalDLTensor`` (apache/tvm#13678): an
array over external memory with no lifetime tracking, kept in a container, outlived
the memory it read. Here the view over external memory lives only inside a ``with``
block. When the block ends the view closes, and every later use raises
``tx.LifetimeError`` instead of reading freed memory; if anything else still holds the
memory (a DLPack export not yet released, another Tensor made from the view), the exit
raises ``tx.LifetimeError`` naming those holders.
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from typing import Any, Iterator, Sequence

from . import _dlpack_abi as abi
from .layout import MAX_NDIM, check_layout, check_ndim, check_shape
from .device import Device, DeviceType
from .dtypes import dtype as _as_dtype
from .dtypes import from_dlpack_code
from .errors import ExchangeWarning, LifetimeError
from .registry import _describe_holder, registry
from .tensor import Tensor, _shape_tuple

__all__ = ["borrow"]

_REG = registry()


@contextlib.contextmanager
def borrow(source: Any = None, *, shape: int | Sequence[int] | None = None, dtype: Any = None,
           strides: Sequence[int] | None = None, device: Any = "cpu", dltensor: int | None = None,
           readonly: bool | None = None, label: str | None = None) -> Iterator[Tensor]:
    """Open a scope in which external memory is seen as a tx.Tensor without owning it.

    One of three sources:

    * ``source`` an int address with ``shape``, ``dtype``, optional ``strides`` (in
      elements; default row-major) and ``device`` (default ``"cpu"``);
    * ``dltensor=`` the address (int) of a ``DLTensor`` struct (not a managed tensor:
      it has no deleter); its fields are read once, at entry;
    * ``source`` an object with the buffer protocol (bytes, bytearray, memoryview,
      array.array, NumPy arrays...); ``shape``/``dtype`` may reinterpret a contiguous
      buffer, and must fit inside it. A read-only buffer gives a read-only Tensor.

    Ownership: nothing is freed by this library; the caller keeps the memory alive for
    the whole block (a buffer-protocol source is held open by the block, and longer if
    something still holds the view at exit).

    Threads: the scope's end races with other threads still using the view; end the use
    (join those threads) before the block ends, as with any scoped resource.

    Raises ValueError for a shape that does not fit the buffer, and for any layout the
    one layout check refuses (exchange/layout.py: more than 1024 dimensions, a negative
    extent, 2**63 elements or bytes or more, strides beyond int64, an address the view
    would reach outside ``[0, 2**64)``); TypeError for a source of no known kind, LifetimeError at exit if the memory is
    still held (the view is closed all the same). When the block itself raises, that
    exception goes on unchanged and the holders still found are added to it as a note.
    """
    data, byte_offset, dims, given_strides, dt, dev, ro, keep = _describe(source, shape, dtype, strides, device,
                                                                          dltensor, readonly)
    # The one layout check (exchange/layout.py): ValueError for what no memory can be.
    elem_strides, address, base, nbytes = check_layout(dims, given_strides, dt.itemsize, data, byte_offset,
                                                       "tx.borrow")
    record = _REG.new_record(dev, base, nbytes, origin="borrowed", kind="borrowed",
                             release=None, owner=keep, label=label)
    record._views = []
    tensor = Tensor._make(record, address, dims, elem_strides, dt, ro, None, holder="tx.borrow view")
    try:
        yield tensor
    except BaseException as exc:
        # The body's own error goes on; a view still held is said through it, not
        # instead of it (a note where Python has them, else a warning).
        held = _close(tensor)
        if held:
            if hasattr(exc, "add_note"):
                exc.add_note(held)
            else:  # Python 3.10
                warnings.warn(held, ExchangeWarning, stacklevel=3)
        raise
    held = _close(tensor)
    if held:
        raise LifetimeError(held)


def _close(tensor: Tensor) -> str:
    """Close the scope's views; returns what still holds the memory ("" if nothing)."""
    record = tensor._record
    views = [v for v in (ref() for ref in record._views) if v is not None]
    for view in [tensor, *views]:
        view._closed = True
    token, tensor._token = tensor._token, 0
    with _REG._lock:
        holders = [_describe_holder(h) for t, h in record._holder_items() if t != token]
    _REG.remove_holder(record, token)
    if not holders:
        return ""
    return (f"tx.borrow scope over {record.nbytes} bytes at 0x{record.address:x} ended while the memory is "
            f"still held by: {', '.join(holders)}. Release those first (delete the arrays made from it), "
            "or copy the data (tx.from_dlpack(view, copy=True)) before the scope ends")


def _describe(source: Any, shape: Any, dtype: Any, strides: Any, device: Any, dltensor: Any,
              readonly: Any) -> tuple:
    if dltensor is not None:
        if source is not None:
            raise TypeError("pass either source or dltensor=, not both")
        if not isinstance(dltensor, int) or dltensor <= 0:
            raise ValueError(f"dltensor= must be the (non-NULL) address of a DLTensor, got {dltensor!r}")
        return _from_dltensor(dltensor, readonly)
    if isinstance(source, int) and not isinstance(source, bool):
        if shape is None or dtype is None:
            raise TypeError("borrowing a raw address needs shape= and dtype=")
        dims = _shape_tuple(shape)
        if source < 0 or (source == 0 and 0 not in dims):
            raise ValueError(f"cannot borrow {math.prod(dims)} elements at address {source}: not a valid pointer")
        dt = _as_dtype(dtype)
        st = None if strides is None else _strides_tuple(strides, dims)
        return source, 0, dims, st, dt, Device.parse(device), bool(readonly), None
    if Device.parse(device).type != DeviceType.kDLCPU:
        raise ValueError(f"a buffer-protocol object is host memory; device={device!r} does not apply (leave it 'cpu')")
    try:
        view = memoryview(source)
    except TypeError:
        raise TypeError(
            f"cannot borrow {type(source).__name__}: pass an int address with shape= and dtype=, "
            "dltensor=<address of a DLTensor>, or an object with the buffer protocol"
        ) from None
    return _from_buffer(view, shape, dtype, strides, readonly)


def _strides_tuple(strides: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    st = tuple(operator.index(s) for s in strides)
    if len(st) != len(dims):
        raise ValueError(f"strides {st} do not match shape {dims}: need {len(dims)} values (in elements)")
    return st


def _from_dltensor(address: int, readonly: Any) -> tuple:
    t = abi.DLTensor.from_address(address)
    check_ndim(t.ndim, f"DLTensor at 0x{address:x}")  # before its shape is read
    if t.ndim < 0 or (t.ndim > 0 and not t.shape):
        raise ValueError(f"DLTensor at 0x{address:x} has ndim={t.ndim} and no usable shape "
                         f"(ndim must be 0 to {MAX_NDIM}, with a shape for ndim > 0); it is corrupt")
    dims = _shape_tuple(tuple(t.shape[: t.ndim]))
    if not t.data and 0 not in dims:
        raise ValueError(f"DLTensor at 0x{address:x} has a NULL data pointer but {math.prod(dims)} elements")
    st = tuple(t.strides[: t.ndim]) if t.strides else None
    try:
        dt = from_dlpack_code(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        dev = Device(DeviceType(t.device.device_type), t.device.device_id)
    except (BufferError, ValueError) as exc:
        raise ValueError(f"DLTensor at 0x{address:x} cannot be borrowed: {exc}") from None
    return t.data or 0, t.byte_offset, dims, st, dt, dev, bool(readonly), None


def _from_buffer(view: memoryview, shape: Any, dtype: Any, strides: Any, readonly: Any) -> tuple:
    import numpy as np

    try:
        arr = np.asarray(view)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot borrow a buffer of format {view.format!r}: {exc}") from None
    if readonly is False and view.readonly:
        raise ValueError("the buffer is read-only; it cannot be borrowed writable")
    ro = view.readonly or bool(readonly)
    address = arr.__array_interface__["data"][0]
    cpu = Device(DeviceType.kDLCPU)
    if shape is None and dtype is None and strides is None:
        if any(s % arr.itemsize for s in arr.strides):
            raise ValueError("buffer strides are not multiples of the item size; DLPack strides count elements")
        st = tuple(s // arr.itemsize for s in arr.strides)
        return address, 0, arr.shape, st, _as_dtype(arr.dtype), cpu, ro, view
    if not view.c_contiguous:
        raise ValueError("reinterpreting a buffer with shape=/dtype=/strides= needs a C-contiguous buffer")
    dt = _as_dtype(dtype if dtype is not None else arr.dtype)
    dims = _shape_tuple(shape if shape is not None else (view.nbytes // dt.itemsize,))
    st = None if strides is None else _strides_tuple(strides, dims)
    if st is not None and any(s < 0 for s in st):
        raise ValueError("negative strides cannot reinterpret a buffer; borrow it as it is and flip the view")
    st, _, need = check_shape(dims, st, dt.itemsize, "tx.borrow")  # no negative strides: it starts at element 0
    if need > view.nbytes:
        raise ValueError(
            f"shape {dims} with dtype {dt.name} needs {need} bytes but the buffer holds {view.nbytes}; "
            "pass a shape that fits"
        )
    return address, 0, dims, st, dt, cpu, ro, view
