"""The pure path's tensors and capsule exchange: the twin of exchange/native/tensor.c
and of the import and export halves of exchange/native/capsule.c, same results.

It owns a Tensor's storage (``TensorBase``: its fields, its release when it goes, the
DLPack producer's hot path), making a Tensor over a record (``new_tensor``), exporting
a record as a capsule (``export``), consuming a capsule as a Tensor (``consume``, a
capsule of ours coming back included) and ``from_dlpack``'s hot path (a NumPy array,
nothing else asked); everything else goes to the slow paths both share
(exchange/importing.py, exchange/exporting.py).
"""

from __future__ import annotations

import contextvars
import itertools
import types
from math import prod
from time import perf_counter
from typing import Any

from ... import _dlpack_abi as abi
from ...dtypes import _BY_CODE
from ..rules import parse_max_version
from . import capsules as _c
from .records import add_holder, new_record, remove_holder

_READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
_MAX_VERSION = (abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION)
_export_ids = itertools.count(1)

# Given by setup() (exchange._core.wire), as the compiled core's hooks.
_REG: Any = None
_Tensor: Any = None
_CPU: Any = None
_slow_from_dlpack: Any = None
_validate_device: Any = None
_validate_dtype: Any = None

# Devices seen on import ((type, id) -> Device; the capsule layer reads it, as the
# compiled core keeps its own), and the DType table.
_DEVICES: dict[tuple[int, int], Any] = {}
_c.set_lookups(_DEVICES, _BY_CODE)


class TensorBase:
    """A Tensor's storage, its release when it goes, and the DLPack producer's hot path
    (the twin of the compiled core's ``TensorBase``)."""

    __slots__ = ("_record", "_data_ptr", "_shape", "_strides", "_dtype", "_readonly", "_stream",
                 "_token", "_closed", "__weakref__")

    def __del__(self) -> None:
        token = self._token
        if token:
            self._token = 0
            try:
                remove_holder(self._record, token)
            except Exception:
                pass

    @property
    def _nbytes(self) -> int:
        """Bytes of the elements with no closed check (the chain's hop reports)."""
        return prod(self._shape) * self._dtype.itemsize

    def __dlpack_device__(self, /) -> tuple[Any, int]:
        self._check()
        device = self._record.device
        return (device.type, device.id)

    def __dlpack__(self, /, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        record = self._record
        if (stream is None and dl_device is None and copy is None and record.device is _CPU
                and self._stream is None and not self._closed):
            # Hot path: host data, no stream, no copy, no device change.
            versioned = parse_max_version(max_version)
            if self._readonly is True and not versioned:
                return self._export(False, _READ_ONLY, _CPU)  # raises BufferError: legacy cannot say read-only
            shape, dtype = self._shape, self._dtype
            return export(record, 0 if 0 in shape else self._data_ptr, 1, 0, dtype.code, dtype.bits, shape,
                          self._strides, versioned, _READ_ONLY if self._readonly else 0)
        return self._dlpack_slow(stream, max_version, dl_device, copy)


def call_stage(fn: Any, arg: Any, tensor: Any, hops: list, template: Any, acc: list, index: int) -> Any:
    """A chain stage's call on its hot path: the shared hop of ``tensor`` into the stage
    noted on ``hops`` as ``(template, nbytes)``, then ``fn(arg)``, its milliseconds added
    to ``acc[index]``; returns what ``fn`` returned, raises what it raised (the hop
    noted first, the time not added)."""
    if not isinstance(tensor, TensorBase) or type(hops) is not list or type(acc) is not list:
        raise TypeError("call_stage: tensor must be a tx.Tensor, hops and acc lists")
    if not isinstance(index, int):  # before fn runs, as the compiled core refuses it
        raise TypeError(f"call_stage: index must be an int, not {type(index).__name__}")
    if not 0 <= index < len(acc):
        raise IndexError("call_stage: index out of range of acc")
    hops.append((template, tensor._nbytes))
    t0 = perf_counter()
    result = fn(arg)
    if index < len(acc):
        acc[index] += (perf_counter() - t0) * 1e3
    return result


def plain_task(slot_type: type, take: Any, fn: Any, give: Any, shared_in: Any, shared_out: Any, acc: list,
               index: int, then: Any, post: Any, context: Any, slow: Any, fail: Any, regroup: Any,
               refuse: Any) -> Any:
    """A pipelined chain's task for one plain stage (exchange/chain_pipeline.py's
    ``plain_task`` makes ``slow``, which does all of it): here ``slow`` itself. The
    compiled core's runs the taken path of a ``slot_type`` batch with no Python frame, the
    same steps with the same results, and ``slow`` for every other batch. Refuses what the
    compiled core refuses: TypeError, IndexError."""
    if not isinstance(slot_type, type) or type(acc) is not list or type(context) is not contextvars.Context:
        raise TypeError("plain_task: a slot type, an acc list and a contextvars.Context")
    if not isinstance(index, int):
        raise TypeError(f"plain_task: index must be an int, not {type(index).__name__}")
    if not 0 <= index < len(acc):
        raise IndexError("plain_task: index out of range of acc")
    for i, f in ((1, take), (2, fn), (3, give), (11, slow), (12, fail), (13, regroup), (14, refuse)):
        if not callable(f):
            raise TypeError(f"plain_task: argument {i} must be callable")
    if then is not None and not callable(post):
        raise TypeError("plain_task: a task handed on needs a callable post")
    for name in ("kind", "values", "ptrs", "hops", "done"):
        # the field's descriptor, as the compiled core reads it: a subclass's inherited
        # slots count, a slot whose descriptor was replaced on the class does not
        if type(getattr(slot_type, name, None)) is not types.MemberDescriptorType:
            raise TypeError(f"plain_task: {slot_type.__name__}.{name} must be a __slots__ field")
    return slow


def set_method_doc(name: str, doc: str) -> None:
    """Give a TensorBase method its docstring (its text signature head dropped: a Python
    function has a real signature)."""
    getattr(TensorBase, name).__doc__ = doc.split("\n--\n\n", 1)[-1]


def make_tensor_type(*views: type) -> type:
    """The public Tensor class: ``views`` (Python attributes) over ``TensorBase``; it
    refuses to be made directly (TypeError, in __new__, so no half-made object reaches
    the release)."""
    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("tx.Tensor is not made directly: use tx.empty, tx.from_dlpack or tx.borrow")

    return type("Tensor", (*views, TensorBase), {"__slots__": (), "__doc__": views[0].__doc__, "__new__": __new__,
                                                 "__module__": "exchange.tensor", "__qualname__": "Tensor"})


def new_tensor(record: Any, token: int, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
               dtype: Any, readonly: Any, stream: Any) -> Any:
    """A Tensor over ``record`` holding it with ``token`` (the caller registered it)."""
    self = object.__new__(_Tensor)
    self._record = record
    self._data_ptr = data_ptr
    self._shape = shape
    self._strides = strides
    self._dtype = dtype
    self._readonly = readonly
    self._stream = stream
    self._closed = False
    self._token = token
    return self


def new_tensors(record: Any, base: int, entries: list, readonly: Any) -> list:
    """A Tensor per entry ``(offset, shape, strides, dtype)`` at ``base + offset`` over
    ``record``, each a new holder of it; on an error the tensors made go again."""
    out = []
    for entry in entries:
        if not (type(entry) is tuple and len(entry) == 4 and type(entry[1]) is tuple):
            raise TypeError("new_tensors: each entry is (offset, shape: tuple, strides, dtype)")
        offset, shape, strides, dtype = entry
        token = add_holder(record, "tx.Tensor")
        try:
            out.append(new_tensor(record, token, base + offset, shape, tuple(strides), dtype, bool(readonly), None))
        except BaseException:
            remove_holder(record, token)
            raise
    return out


def export(record: Any, data: int, device_type: int, device_id: int, code: int, bits: int,
           shape: tuple[int, ...], strides: tuple[int, ...], versioned: bool, flags: int) -> Any:
    """A new capsule over ``record``'s memory, a holder of it until the consumer calls
    the deleter (or the unconsumed capsule is destroyed): the registry's export table
    counts it, and the deleter reports through the capsule layer's callback."""
    ctx = next(_export_ids)
    _REG.add_export(record, ctx)
    try:
        return _c.new_capsule(versioned, ctx, data, device_type, device_id, code, bits, shape, strides, flags)
    except BaseException:
        _REG.export_released(ctx)
        raise


def consume(capsule: Any, producer: str, owner: Any, stream: Any) -> Any:
    """A DLPack capsule as a Tensor (see exchange.capsule.consume): validated first, the
    imported record made, the capsule renamed ``used_...`` last."""
    (versioned, ptr, readonly, element0, address, nbytes, device, dtype, dev_type, dev_id, code, bits, shape,
     strides, own) = _c.import_info(capsule)
    if own:
        return _consume_own(capsule, own, ptr, versioned, element0, shape, strides, dtype, code, bits, readonly,
                            stream)
    if device is None:
        device = _validate_device(dev_type, dev_id)  # not seen before: BufferError if refused
        if len(_DEVICES) < 1024:
            _DEVICES[(dev_type, dev_id)] = device
    if dtype is None:
        dtype = _validate_dtype(code, bits, 1)  # raises BufferError saying why
    # The release: one call of the producer's deleter (a capsule's pointer is never NULL).
    release = (_c.call_struct_deleter, ptr, versioned)
    record, token = new_record(device, address, nbytes, producer, "imported", release, owner, None, "tx.Tensor")
    try:
        result = new_tensor(record, token, element0, shape, strides, dtype, readonly, stream)
        if stream is not None:
            _REG.add_stream(record, stream)
        _c.mark_used(capsule)
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
    _c.mark_used(capsule)
    try:
        record = _REG._exports[ctx][0]  # held by this export until the deleter below
        if dtype is None:
            dtype = _validate_dtype(code, bits, 1)
        token = add_holder(record, "tx.Tensor")
        try:
            result = new_tensor(record, token, element0, shape, strides, dtype, readonly, stream)
            if stream is not None:
                _REG.add_stream(record, stream)
            return result
        except BaseException:
            remove_holder(record, token)
            raise
    finally:
        _c.call_deleter(ptr, versioned)  # consumed by us: the export's holder is released


# Producer types that only ever hold CPU memory, so the hot path need not ask their
# __dlpack_device__ (type -> True); every other type seen maps to False.
_CPU_ONLY: dict[type, bool] = {}


def from_dlpack(x: Any, *, device: Any = None, copy: Any = None, stream: Any = None) -> Any:
    # The hot path: nothing asked but the data itself, from a type that lives only on the
    # CPU (NumPy arrays): no __dlpack_device__ to ask, and no stream to pass. Its
    # docstring is the public one (bind_from_dlpack).
    if device is None and copy is None and stream is None:
        cpu_only = _CPU_ONLY.get(type(x))
        if cpu_only is None:
            cpu_only = _learn_type(type(x))
        if cpu_only:
            try:
                capsule = x.__dlpack__(max_version=_MAX_VERSION)
            except TypeError:
                pass  # refused the keyword: the slow path asks again without it
            else:
                return consume(capsule, "numpy.ndarray", x, None)
    return _slow_from_dlpack(x, device=device, copy=copy, stream=stream)


def _learn_type(t: type) -> bool:
    cpu_only = t.__module__ == "numpy" and t.__name__ == "ndarray"
    if len(_CPU_ONLY) < 4096:
        _CPU_ONLY[t] = cpu_only
    return cpu_only


def bind_from_dlpack(doc: str) -> Any:
    """``from_dlpack`` with the public docstring (its text signature head dropped)."""
    from_dlpack.__doc__ = doc.split("\n--\n\n", 1)[-1]
    from_dlpack.__module__ = "exchange.tensor"
    return from_dlpack


def consume_exchange_api(x: Any) -> None:
    """DLPack's C exchange API takes C: on this path, never (None: ``__dlpack__`` serves)."""
    return None


def setup(*, tensor_type: Any, registry: Any, cpu: Any, slow_from_dlpack: Any, validate_device: Any,
          validate_dtype: Any, **_: Any) -> None:
    """The hooks, as the compiled core's ``setup`` takes them (exchange._core.wire)."""
    global _Tensor, _REG, _CPU, _slow_from_dlpack, _validate_device, _validate_dtype
    _Tensor, _REG, _CPU = tensor_type, registry, cpu
    _slow_from_dlpack, _validate_device, _validate_dtype = slow_from_dlpack, validate_device, validate_dtype
    _c.set_release_callback(registry.export_released)
