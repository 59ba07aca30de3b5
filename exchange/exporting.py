"""Export: a Tensor as a DLPack producer (``__dlpack__``, ``__dlpack_device__``, and the
DLPack C exchange API's preparation). The hot path (host data, nothing asked) is the
core's (exchange/_core); this module owns every other export: to another device or
the host, with a consumer's stream (the record-then-wait handshake), a copy, a
read-only tensor, and the rules a consumer that cannot be told read-only gets.

Which memory is host-readable, and so host-ready on an export with no consumer
stream, is what its backend declares (exchange.devices' MemoryKind), never a device
kind named here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core
from . import _dlpack_abi as abi
from . import capsule as _capsule
from ._core.rules import parse_max_version as _parse_max_version
from .allocation import _backend, _memory, copy_into, empty
from .device import CPU, Device, DeviceType
from .registry import registry

if TYPE_CHECKING:
    from .tensor_type import Tensor

__all__: list[str] = []

_REG = registry()
_READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
_IS_COPIED = abi.DLPACK_FLAG_BITMASK_IS_COPIED
_CPU_TYPE = DeviceType.kDLCPU
# Why a read-only tensor is refused to a consumer that cannot be told: a legacy capsule has
# no flags, and the C exchange API's consumers (tvm-ffi) ignore DLPack's READ_ONLY flag.
_READ_ONLY_REFUSED = (
    "this tensor is read-only and neither a legacy (unversioned) DLPack capsule nor DLPack's C exchange API "
    "can make its consumer keep it so (tvm-ffi, for one, writes through either); ask __dlpack__ with "
    "max_version=(1, 0) or later, or pass a copy (copy=True, or tx.from_dlpack(tensor, copy=True))"
)


_DLPACK_DOC = """Export as a DLPack capsule (DLPack 1.3 python_spec; array API ``__dlpack__``).

Parameters
----------
stream : the consumer's stream, as an int. CPU data: only None (else ValueError).
    CUDA: None or 1 legacy default, 2 per-thread default, -1 no synchronisation,
    > 2 a ``cudaStream_t``; 0 is ambiguous and raises ValueError. The producer
    records an event on the stream that last wrote the tensor and makes the
    consumer's stream wait on it: the host is not blocked (except for an export
    to the CPU, which is host-ready on return).
max_version : None or major 0 gives a legacy ``"dltensor"`` capsule (a read-only
    tensor then raises BufferError, unless its memory came in through a legacy
    capsule); major >= 1 gives ``"dltensor_versioned"`` at version (1, 3) with
    READ_ONLY / IS_COPIED flags. Not a 2-tuple of ints: TypeError.
dl_device : None or this tensor's device, or ``(kDLCPU, 0)`` (copied for device
    memory; no copy for pinned and managed memory). Any other: BufferError.
copy : True makes a real copy (IS_COPIED set, writable even if this tensor is
    read-only); False raises BufferError when a copy would be needed; None
    copies only when ``dl_device`` requires it.

Ownership: the capsule is a holder of this tensor's record until the consumer
calls its deleter (or the unconsumed capsule is destroyed); the consumer's
stream is added to the record's streams, so the release waits for its work.
"""
_DLPACK_DEVICE_DOC = "``(device_type, device_id)`` as DLPack numbers them (``tx.DeviceType``)."
# Each docstring starts with its text signature (the "name(...)\n--\n\n" head CPython
# reads as __text_signature__), so inspect.signature, help() and IDEs see the public
# API's signatures on the compiled methods too, as on the pure path's.
_core.set_method_doc("__dlpack__", "__dlpack__($self, *, stream=None, max_version=None, dl_device=None, "
                     "copy=None)\n--\n\n" + _DLPACK_DOC)
_core.set_method_doc("__dlpack_device__", "__dlpack_device__($self, /)\n--\n\n" + _DLPACK_DEVICE_DOC)


class _Producer:
    """A Tensor's DLPack producer beyond the core's hot path (attached to tx.Tensor)."""

    __slots__ = ()

    def _dlpack_slow(self, stream: Any, max_version: Any, dl_device: Any, copy: Any) -> Any:
        # Every export the hot path does not take (the core's: exchange/_core).
        self._check()
        return self._dlpack(stream, _parse_max_version(max_version), dl_device, copy, False)

    def _dlpack(self, stream: Any, versioned: bool, dl_device: Any, copy: Any, immutable_consumer: bool) -> Any:
        # immutable_consumer: the consumer never writes (JAX, tvm-ffi), so a read-only
        # tensor may go out in a legacy capsule, which cannot carry READ_ONLY.
        device = self._record.device
        kind = None if device.type == _CPU_TYPE else _memory(device.type)  # what its backend declared
        target = device if dl_device is None else _parse_dl_device(dl_device)
        if target != device and target != CPU:  # (kDLCPU, 1) is no CPU: DLPack's CPU id is 0
            raise BufferError(
                f"cannot export {device} data to dl_device {target}; only this tensor's device or (kDLCPU, 0)"
            )
        if device.type == _CPU_TYPE:
            if stream is not None:
                raise ValueError(f"stream={stream!r} given for a CPU tensor; DLPack allows only stream=None for kDLCPU")
            consumer = None
            if self._stream is not None and not copy:
                self._stream.synchronize()  # CPU exports are host-ready on return
        elif target.type == _CPU_TYPE:
            if stream is not None:
                raise ValueError(f"stream={stream!r} given with dl_device=(kDLCPU, 0); it must be None")
            consumer = None
        elif stream is None and kind is not None and kind.host_readable:
            # Host-readable device memory (pinned, managed) with no consumer stream: the
            # consumer may read it from the host (NumPy does), so make it host-ready (as
            # CuPy does for managed).
            _backend(device).stream_from_dlpack(stream, device)
            self._host_ready()
            consumer = None
        else:
            backend = _backend(device)
            consumer = backend.stream_from_dlpack(stream, device)
        needs_copy = target != device and not (kind is not None and kind.host_readable)
        if copy is False and needs_copy:
            raise BufferError(f"exporting {device} data to {target} needs a copy, but copy=False")
        if copy or needs_copy:
            src = self._copy_to(target, stream=None if target.type == _CPU_TYPE else consumer)
            return src._export(versioned, _IS_COPIED, target)
        if target != device:  # pinned or managed memory seen from the host
            self._host_ready()
            return self._export(versioned, _READ_ONLY if self._readonly else 0, target, immutable_consumer)
        if consumer is not None:
            self._handshake(consumer)
        return self._export(versioned, _READ_ONLY if self._readonly else 0, device, immutable_consumer)

    def _export(self, versioned: bool, flags: int, device: Device, immutable_consumer: bool = False) -> Any:
        # A legacy capsule cannot say read-only. Memory that came in through a legacy
        # capsule (_readonly is LEGACY: its producer hands it out so to anyone, JAX
        # included) may go out the same way: that opens no new way to write it. Nor does
        # memory the kernel keeps read-only here (a set's version, ``record.sealed``): a
        # write through the capsule faults, it cannot change the memory.
        if not versioned and flags & _READ_ONLY and self._readonly is True and not immutable_consumer \
                and not self._record.sealed:
            raise BufferError(_READ_ONLY_REFUSED)
        return _capsule.export(self._record, self._data_ptr, self._shape, self._strides, self._dtype,
                               device, versioned, flags)

    def _for_exchange_api(self) -> None:
        # Called by the DLPack C exchange API we publish (exchange/native/tensor.c), before
        # it exports a tensor that is read-only, ordered on a stream of ours, or not in
        # host memory; its consumer (tvm-ffi) can neither be told read-only nor name a
        # stream. So: refuse what a legacy capsule refuses, and order what __dlpack__()
        # with no stream orders (the pure path's tvm-ffi gets exactly that): device memory
        # before the legacy default stream, which the table's current_work_stream names
        # (record-then-wait, no host block); host, pinned and managed memory host-ready.
        self._check()
        if self._readonly is True:
            raise BufferError(_READ_ONLY_REFUSED)
        if self._readonly and self._record.immutable:
            # a JAX array's memory, in through a legacy capsule: never through the table
            # (docs/design.md, "The compiled core"); the consumer falls back to a legacy __dlpack__(), which hands it
            # out as its producer does, opening no new way to write it
            raise BufferError(f"this tensor's memory is immutable ({self._record.origin}) and DLPack's C exchange "
                              "API cannot tell its consumer so; take it through __dlpack__(), or pass a copy "
                              "(tx.from_dlpack(tensor, copy=True))")
        device = self._record.device
        kind = _memory(device.type)
        if kind is None or not kind.host_readable:
            self._handshake(_backend(device).stream_from_dlpack(None, device))
        else:
            if device.type != _CPU_TYPE:
                _backend(device)  # BackendUnavailableError before anything is waited on
            self._host_ready()

    def _handshake(self, consumer: Any) -> None:
        # Make the consumer's stream wait for the last writer's work: record-then-wait,
        # never a host block (DLPack python_spec "stream", CuPy/PyTorch practice). The
        # backend says whether the two are one ordered queue: equal handles are not
        # (CUDA's per-thread default stream is handle 2 on every thread).
        backend = _backend(self._record.device)
        producer = self._stream or backend.default_stream(self._record.device)
        if backend.order_key(producer) != backend.order_key(consumer):
            consumer.wait(producer.record())
        _REG.add_stream(self._record, consumer)

    def _host_ready(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        elif self._record.device.type != _CPU_TYPE:
            _backend(self._record.device).default_stream(self._record.device).synchronize()

    def _copy_to(self, target: Device, stream: Any = None) -> "Tensor":
        """A new, writable, C-contiguous copy on ``target``; host-ready when ``target``
        is the CPU."""
        source = self._record.device
        if target.type == _CPU_TYPE and source.type != _CPU_TYPE:
            stream = self._stream  # device to host: ordered on the source's stream, then synchronised
        out = empty(self._shape, self._dtype, device=target, stream=stream if target.type != _CPU_TYPE else None)
        backend = _backend(source if source.type != _CPU_TYPE else target)
        if source.type == _CPU_TYPE:
            self._host_ready()
        copy_into(out, self, stream, backend)
        if target.type == _CPU_TYPE and source.type != _CPU_TYPE:
            (stream or backend.default_stream(source)).synchronize()
        return out


def _parse_dl_device(dl_device: Any) -> Device:
    if not isinstance(dl_device, tuple) or len(dl_device) != 2:
        raise TypeError(f"dl_device must be a (device_type, device_id) tuple, got {dl_device!r}")
    try:
        return Device(dl_device[0], dl_device[1])
    except (ValueError, TypeError) as exc:
        raise BufferError(f"unsupported dl_device {dl_device!r}: {exc}") from None
