"""``tx.Tensor``, a strided view over a registry record, and the ways in:
``from_dlpack``, ``empty``; plus ``record_stream`` and ``create_stream``.

Every way in says who frees the memory and when (Ownership sections below). The
DLPack rules followed are DLPack 1.3's ``python_spec.rst`` and the array API's
``__dlpack__`` / ``from_dlpack`` text, as settled in docs/design.md, "The protocol".
"""

from __future__ import annotations

import math
import operator
import sys
import weakref
from typing import Any, Sequence

from . import _dlpack_abi as abi
from . import capsule as _capsule
from .device import CPU, Device, DeviceType
from .dtypes import DType
from .dtypes import dtype as _as_dtype
from .errors import LifetimeError
from .layout import check_shape, is_c_contiguous
from ._impl import NATIVE
from ._impl import impl as _impl
from .registry import Record, registry

__all__ = ["Tensor", "from_dlpack", "empty", "record_stream", "create_stream"]

_REG = registry()
_READ_ONLY = abi.DLPACK_FLAG_BITMASK_READ_ONLY
_IS_COPIED = abi.DLPACK_FLAG_BITMASK_IS_COPIED
_CPU_TYPE = DeviceType.kDLCPU
_HOST_ACCESSIBLE = (DeviceType.kDLCPU, DeviceType.kDLCUDAHost, DeviceType.kDLCUDAManaged)
_MAX_VERSION = (abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION)
#: Elements up to which ``repr`` of a CPU tensor shows its values (NumPy's way).
REPR_MAX_VALUES = 100
#: ``tensor -> reduction or None``, asked first by ``Tensor.__reduce__``: Ray's own
#: pickling (exchange/_ray_pickling.py sets it; this layer imports nothing of Ray's).
_PICKLE_HOOK: Any = None
# Why a read-only tensor is refused to a consumer that cannot be told: a legacy capsule has
# no flags, and the C exchange API's consumers (tvm-ffi) ignore DLPack's READ_ONLY flag.
_READ_ONLY_REFUSED = (
    "this tensor is read-only and neither a legacy (unversioned) DLPack capsule nor DLPack's C exchange API "
    "can make its consumer keep it so (tvm-ffi, for one, writes through either); ask __dlpack__ with "
    "max_version=(1, 0) or later, or pass a copy (copy=True, or tx.from_dlpack(tensor, copy=True))"
)


def _backend(device: Device) -> Any:
    from .devices.base import get_backend

    return get_backend(device.type)


def copy_into(dst: "Tensor", src: "Tensor", stream: Any = None, backend: Any = None) -> None:
    """Copy ``src`` into ``dst`` (equal shapes and itemsizes) with ``backend`` (default:
    ``src``'s device's), ordered on ``stream``; the stream the copy is queued on joins
    both records' streams, so neither is released before the copy has run."""
    used = (backend or _backend(src.device)).copy(dst, src, stream)
    if used is not None:
        _REG.add_stream(src._record, used)
        _REG.add_stream(dst._record, used)


class _PyTensorBase:
    """The pure-Python twin of ``exchange._native.TensorBase``: a Tensor's storage, its
    release when it goes, and the DLPack producer's hot path."""

    __slots__ = ("_record", "_data_ptr", "_shape", "_strides", "_dtype", "_readonly", "_stream",
                 "_token", "_closed", "__weakref__")

    def __del__(self) -> None:
        token = self._token
        if token:
            self._token = 0
            try:
                _REG.remove_holder(self._record, token)
            except Exception:
                pass

    def __dlpack_device__(self, /) -> tuple[DeviceType, int]:
        self._check()
        device = self._record.device
        return (device.type, device.id)

    def __dlpack__(self, /, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        record = self._record
        if (stream is None and dl_device is None and copy is None and record.device is CPU
                and self._stream is None and not self._closed):
            # Hot path: host data, no stream, no copy, no device change.
            versioned = _parse_max_version(max_version)
            if self._readonly is True and not versioned:
                return self._export(False, _READ_ONLY, CPU)  # raises BufferError: legacy cannot say read-only
            return _capsule.export(record, self._data_ptr, self._shape, self._strides, self._dtype, CPU,
                                   versioned, _READ_ONLY if self._readonly else 0)
        return self._dlpack_slow(stream, max_version, dl_device, copy)


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
_PyTensorBase.__dlpack__.__doc__ = _DLPACK_DOC
_PyTensorBase.__dlpack_device__.__doc__ = _DLPACK_DEVICE_DOC
if NATIVE:
    # Each docstring starts with its text signature (the "name(...)\n--\n\n" head CPython
    # reads as __text_signature__), so inspect.signature, help() and IDEs see the public
    # API's signatures on the compiled methods too, as on the pure path's.
    _impl.set_method_doc("__dlpack__", "__dlpack__($self, *, stream=None, max_version=None, dl_device=None, "
                         "copy=None)\n--\n\n" + _DLPACK_DOC)
    _impl.set_method_doc("__dlpack_device__", "__dlpack_device__($self, /)\n--\n\n" + _DLPACK_DEVICE_DOC)


class _TensorViews:
    """A strided view over memory the registry tracks (a record).

    ``shape`` (tuple of int), ``strides`` (tuple of int, **in elements**), ``dtype``
    (tx.DType), ``device`` (tx.Device), ``data_ptr`` (int, address of element 0),
    ``nbytes`` (int, bytes of the elements the view covers), ``readonly`` (bool).
    Each Tensor is a holder of its record: the memory lives at least as long as the
    Tensor, and its release after the last holder is stream-ordered.

    A borrowed Tensor (``tx.borrow``) is closed when its scope ends; any later use
    raises ``tx.LifetimeError``.

    Its storage, its release and the DLPack producer's hot path are the compiled core's
    (exchange/native/tensor.c) where it is built, else ``_PyTensorBase``. Published on
    the type: ``__dlpack_c_exchange_api__``, DLPack's C exchange API (compiled core
    only), so consumers such as tvm-ffi take a Tensor without a capsule. Tensors are
    not tracked by the garbage collector there: a Tensor refers to its record, dtype
    and stream only, none of which can refer back to it.
    """

    __slots__ = ()

    @classmethod
    def _make(cls, record: Record, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
              dtype: DType, readonly: Any, stream: Any = None, holder: str = "tx.Tensor") -> "Tensor":
        token = _REG.add_holder(record, holder)
        try:
            return _new_tensor(record, token, data_ptr, shape, strides, dtype, readonly, stream)
        except BaseException:
            _REG.remove_holder(record, token)
            raise

    def _dlpack_slow(self, stream: Any, max_version: Any, dl_device: Any, copy: Any) -> Any:
        # Every export the hot path does not take (exchange/native/tensor.c or above).
        self._check()
        return self._dlpack(stream, _parse_max_version(max_version), dl_device, copy, False)

    # -- attributes --------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            reason = getattr(self._record, "closed_reason", None)  # set by whoever closed it (exchange/sharing/)
            if reason:
                raise LifetimeError(reason)
            raise LifetimeError(
                f"this tensor borrowed memory at 0x{self._data_ptr:x} and its tx.borrow() scope has ended; "
                "copy the data inside the scope, or take it with tx.from_dlpack from an owner"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        self._check()
        return self._shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (DLPack convention), not bytes."""
        self._check()
        return self._strides

    @property
    def dtype(self) -> DType:
        self._check()
        return self._dtype

    @property
    def device(self) -> Device:
        self._check()
        return self._record.device

    @property
    def data_ptr(self) -> int:
        """Address of element 0 (for negative strides, not the lowest address)."""
        self._check()
        return self._data_ptr

    @property
    def ndim(self) -> int:
        self._check()
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        self._check()
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (size * itemsize), as NumPy's ``nbytes``."""
        self._check()
        return math.prod(self._shape) * self._dtype.itemsize

    @property
    def readonly(self) -> bool:
        """True when consumers must not write (a READ_ONLY capsule, a legacy capsule,
        a read-only borrow); exports then carry DLPack's READ_ONLY flag."""
        self._check()
        return bool(self._readonly)

    @property
    def mutability(self) -> str:
        """``"writable"``; ``"readonly"``: truly read-only memory (a versioned capsule with
        READ_ONLY, a known-immutable producer such as a JAX array, a read-only borrow,
        Ray's object store); or ``"unknown"``: read-only here because it came in through
        a legacy capsule, which cannot say, from a producer that may allow writes (ONNX
        Runtime, say). ``tx.Chain`` never hands "readonly" memory writable to a framework
        that ignores DLPack's READ_ONLY flag (PyTorch)."""
        self._check()
        if not self._readonly:
            return "writable"
        if self._readonly is True or self._record.immutable:
            return "readonly"
        return "unknown"

    @property
    def record(self) -> Record:
        """The registry record this view is over."""
        self._check()
        return self._record

    @property
    def stream(self) -> Any:
        """The stream the data is ordered on (None: the device's default stream)."""
        self._check()
        return self._stream

    def is_contiguous(self) -> bool:
        """True for C-contiguous (row-major) layout."""
        self._check()
        return is_c_contiguous(self._shape, self._strides)

    def numpy(self) -> Any:
        """A NumPy array over this tensor's memory, no copy: the same as ``np.asarray(t)``.

        Read-only when the tensor is. The array (and every view of it) holds the tensor's
        record, as an export does, so the memory lives as long as the array. bfloat16 and
        float8 tensors come back with ml_dtypes' dtypes (NumPy's own DLPack import knows
        no such codes, so ``np.from_dlpack`` refuses them; this does not). Host-accessible
        memory only: CPU, pinned (``cuda_host``) and managed (``cuda_managed``), made
        host-ready first.

        Raises TypeError for memory the host cannot read (a CUDA device's), naming the
        copy to the host to make instead, and for bfloat16 / float8 without the ml_dtypes
        package; LifetimeError for a borrow whose scope has ended.
        """
        self._check()
        return self._host_array()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """NumPy's array protocol (NumPy 2's ``__array__(dtype=None, copy=None)``), so
        ``np.asarray(t)``, ``np.array(t)`` and NumPy functions and ufuncs given a tensor
        see its values. (``np.from_dlpack(t)`` does not come here: it takes the DLPack
        export.)

        ``copy``: None or False give :meth:`numpy`'s array (no copy; read-only when the
        tensor is); True a new, writable copy. ``dtype``: another dtype converts, into a
        new array; with ``copy=False`` that is a ValueError, as in NumPy.

        Raises TypeError for memory the host cannot read (a CUDA device's: copy it to the
        host with ``tx.from_dlpack(t, device="cpu")`` first, as CuPy's ``.get()`` and
        PyTorch's ``.cpu()`` are asked for there), and as :meth:`numpy`.
        """
        self._check()
        arr = self._host_array()
        if dtype is not None:
            import numpy as np

            want = np.dtype(dtype)
            if want != arr.dtype:
                if copy is False:
                    raise ValueError(
                        f"a {self._dtype.name} tx.Tensor becomes {want} only in a copy, and copy=False was asked; "
                        "pass copy=None to allow the copy, or leave out the dtype"
                    )
                return arr.astype(want)
        if copy:
            return arr.copy(order="K")
        return arr

    def _host_array(self) -> Any:
        # The NumPy array over this tensor's memory, through its DLPack export: the
        # array's base is the capsule's hold on the record, released when the array goes.
        import numpy as np

        device = self._record.device
        if device.type not in _HOST_ACCESSIBLE:
            raise TypeError(
                f"this tx.Tensor is in {device} memory, which NumPy cannot read: implicit conversion to a NumPy "
                "array is not allowed; copy it to the host first: tx.from_dlpack(t, device='cpu').numpy(), or "
                "np.from_dlpack(t, device='cpu')"
            )
        dt = self._dtype
        if dt._np_source.startswith("numpy:"):
            return np.from_dlpack(self)
        npdt = dt.numpy  # TypeError naming ml_dtypes where it is not installed
        # NumPy's DLPack import knows no bfloat16 or float8 code: take the same memory as
        # unsigned integers of the same width and view it as ml_dtypes' type.
        raw = Tensor._make(self._record, self._data_ptr, self._shape, self._strides, _as_dtype(f"uint{dt.bits}"),
                           self._readonly, self._stream)
        return np.from_dlpack(raw).view(npdt)

    def __copy__(self) -> "Tensor":
        """A new view over the same memory (a new holder of the same record)."""
        return _view_of(self, None)

    def __deepcopy__(self, memo: Any) -> "Tensor":
        """A real copy: new memory on the same device, owned by the library."""
        self._check()
        return self._copy_to(self._record.device, self._stream)

    def __reduce__(self) -> Any:
        # Ray pickles what it sends: in a process where its serializer for tx.Tensor is not
        # registered yet, Ray's pickling lands here, and the hook registers it
        # (exchange/_ray_pickling.py, set by ``import exchange``).
        if _PICKLE_HOOK is not None:
            reduced = _PICKLE_HOOK(self)
            if reduced is not None:
                return reduced
        ray_hint = ("; Ray's own pickling (ray.put, task arguments and returns) takes tx Tensors as they are"
                    if "ray" in sys.modules else "")
        raise TypeError(
            "tx.Tensor cannot be pickled: it is a view over memory this process tracks; to hand it to another "
            "process on this machine use tx.share(tensor) and tx.attach(handle) there (multiprocessing Queues "
            "and Pipes do that for you), or pickle a framework array instead (e.g. np.from_dlpack(tensor).copy())"
            + ray_hint
        )

    def __repr__(self) -> str:
        """A small tensor in CPU memory shows its values, as NumPy's ``repr`` does
        (``tx.Tensor([1., 2.], dtype=float32, device='cpu')``); any other (more than
        ``REPR_MAX_VALUES`` elements, ordered on a stream, in device, pinned or managed
        memory) its shape, dtype, device and strides: ``repr`` never waits for a stream
        nor reads device memory. A closed tensor says so, and why where its closer said
        (a sender that exited: exchange/sharing/)."""
        if self._closed:
            reason = getattr(self._record, "closed_reason", None)
            return f"<tx.Tensor (closed: {reason})>" if reason else "<tx.Tensor (closed borrow)>"
        readonly = ", readonly" if self._readonly else ""
        if (self._record.device.type == _CPU_TYPE and self._stream is None
                and math.prod(self._shape) <= REPR_MAX_VALUES):
            values = self._values_text()
            if values is not None:
                return f"tx.Tensor({values}, dtype={self._dtype.name}, device='cpu'{readonly})"
        return (f"tx.Tensor(shape={self._shape}, dtype={self._dtype.name}, device='{self._record.device}', "
                f"strides={self._strides}{readonly})")

    def _values_text(self) -> str | None:
        # NumPy's text of the values (its print options apply), or None where they cannot
        # be read here (bfloat16 without ml_dtypes, say): repr never raises.
        try:
            import numpy as np

            arr = self._host_array()
            text = np.array2string(arr, separator=", ", prefix="tx.Tensor(")
        except Exception:
            return None
        if arr.size == 0:
            text += f", shape={self._shape}"
        return text

    # -- DLPack producer (the hot path: the storage class) ---------------------------------
    def _dlpack(self, stream: Any, versioned: bool, dl_device: Any, copy: Any, immutable_consumer: bool) -> Any:
        # immutable_consumer: the consumer never writes (JAX, tvm-ffi), so a read-only
        # tensor may go out in a legacy capsule, which cannot carry READ_ONLY.
        device = self._record.device
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
        elif stream is None and device.type != DeviceType.kDLCUDA:
            # Pinned or managed memory with no consumer stream: the consumer may read it
            # from the host (NumPy does), so make it host-ready (as CuPy does for managed).
            _backend(device).stream_from_dlpack(stream, device)
            self._host_ready()
            consumer = None
        else:
            backend = _backend(device)
            consumer = backend.stream_from_dlpack(stream, device)
        needs_copy = target != device and device.type not in _HOST_ACCESSIBLE
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
        # included) may go out the same way: that opens no new way to write it.
        if not versioned and flags & _READ_ONLY and self._readonly is True and not immutable_consumer:
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
        if device.type == DeviceType.kDLCUDA:
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


if NATIVE:
    # A type the compiled core makes (not a Python class, whose instances the garbage
    # collector would track), with the views above attached; the core refuses to make
    # one directly (TypeError, as below).
    from .registry import attach as _attach

    Tensor = _attach(_TensorViews, _impl.make_type("tensor"))
else:
    class Tensor(_TensorViews, _PyTensorBase):  # type: ignore[no-redef]
        __doc__ = _TensorViews.__doc__
        __slots__ = ()

        def __new__(cls, *args: Any, **kwargs: Any) -> "Tensor":
            # Refused in __new__, so no half-made object reaches the release.
            raise TypeError("tx.Tensor is not made directly: use tx.empty, tx.from_dlpack or tx.borrow")


# -- helpers -----------------------------------------------------------------------------


def _parse_max_version(max_version: Any) -> bool:
    """True for a versioned capsule. TypeError unless None or a 2-tuple of ints."""
    if max_version is None:
        return False
    if type(max_version) is tuple and len(max_version) == 2 and type(max_version[0]) is int \
            and type(max_version[1]) is int:
        return max_version[0] >= 1
    if (not isinstance(max_version, tuple) or len(max_version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in max_version)):
        raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, got {max_version!r}")
    return max_version[0] >= 1


def _parse_dl_device(dl_device: Any) -> Device:
    if not isinstance(dl_device, tuple) or len(dl_device) != 2:
        raise TypeError(f"dl_device must be a (device_type, device_id) tuple, got {dl_device!r}")
    try:
        return Device(dl_device[0], dl_device[1])
    except (ValueError, TypeError) as exc:
        raise BufferError(f"unsupported dl_device {dl_device!r}: {exc}") from None


def _producer_device(x: Any) -> Device:
    """``x.__dlpack_device__()`` as a Device; BufferError naming the producer when the
    answer is not a (known device type, id >= 0) pair. A host device given with id None
    (PaddlePaddle's CPU and pinned tensors) is read as id 0, the only one there is."""
    try:
        answer = x.__dlpack_device__()
        kind = int(answer[0])
        if answer[1] is None and kind in (_CPU_TYPE, DeviceType.kDLCUDAHost):
            return Device.parse((kind, 0))
        return Device.parse((kind, int(answer[1])))
    except Exception as exc:
        raise BufferError(
            f"{_producer_name(x)}.__dlpack_device__() gave no usable (device_type, device_id) pair: "
            f"{type(exc).__name__}: {exc}"
        ) from None


_PRODUCER_NAMES: dict[type, str] = {}


def _producer_name(x: Any) -> str:
    t = type(x)
    name = _PRODUCER_NAMES.get(t)
    if name is None:
        name = _PRODUCER_NAMES[t] = f"{t.__module__}.{t.__qualname__}"
    return name


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    if hasattr(shape, "__index__") and not isinstance(shape, bool):
        shape = (shape,)
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    dims = []
    for n in items:
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"shape must hold ints, got {shape!r}")
        dims.append(operator.index(n))
    return tuple(dims)  # its values are checked by exchange.layout.check_shape


def _resolve_stream(stream: Any, device: Device) -> Any:
    """Our Stream object for a ``stream=`` argument on ``device`` (None stays None)."""
    if stream is None:
        return None
    stream_device = getattr(stream, "device", None)
    if isinstance(stream_device, Device) and _compatible(stream_device, device) is False:
        raise ValueError(f"stream {stream!r} belongs to {stream_device}, but the data is on {device}")
    return _backend(device).as_stream(stream, device)


def _compatible(stream_device: Device, device: Device) -> bool:
    if stream_device == device:
        return True
    # Pinned and managed memory may be used from any CUDA device's streams.
    return stream_device.type == DeviceType.kDLCUDA and device.type in (DeviceType.kDLCUDAHost,
                                                                        DeviceType.kDLCUDAManaged)


#: Seconds an allocation that found no memory waits for its device's pending releases
#: before its one retry.
OOM_WAIT = 0.1


class _Free:
    """The release of memory a backend allocated: ``backend.free(allocation, stream)``.
    ``free_after(streams)`` asks a backend that frees in stream order itself to do so
    after the work of ``streams`` (True when it did; the registry then needs no event)."""

    __slots__ = ("backend", "allocation", "stream")

    def __init__(self, backend: Any, allocation: Any, stream: Any) -> None:
        self.backend, self.allocation, self.stream = backend, allocation, stream

    def __call__(self) -> None:
        self.backend.free(self.allocation, self.stream)

    def free_after(self, streams: list[Any]) -> bool:
        ordered = getattr(self.backend, "free_after", None)
        return bool(ordered is not None and ordered(self.allocation, self.stream, streams))


def _allocate(backend: Any, nbytes: int, device: Device, stream: Any, shared: bool = False) -> Any:
    def attempt() -> Any:
        if shared:  # only backends that can share take the keyword
            return backend.allocate(nbytes, device, stream, shared=True)
        return backend.allocate(nbytes, device, stream)

    try:
        return attempt()
    except MemoryError as exc:
        if not _REG.pending_bytes(device):
            raise _out_of_memory(exc, nbytes, device, 0) from exc
    # Outside the handler (its traceback would keep this frame's objects alive): the
    # memory waiting for its stream-ordered release is still in use; give it a moment.
    _REG.wait_for_device(device, OOM_WAIT)
    try:
        return attempt()
    except MemoryError as exc:
        raise _out_of_memory(exc, nbytes, device, _REG.pending_bytes(device)) from exc


def _out_of_memory(exc: MemoryError, nbytes: int, device: Device, pending: int) -> MemoryError:
    from .errors import ExchangeError

    message = f"cannot allocate {nbytes} bytes on {device} ({exc})"
    if pending:
        message += (f"; {pending} bytes there are still waiting for their stream-ordered release after "
                    f"{OOM_WAIT * 1e3:g} ms: finish or synchronize the streams that use them, or call "
                    "tx.registry().collect(), then retry")
    cls = type(exc) if issubclass(type(exc), ExchangeError) else MemoryError
    return cls(message)


# -- public functions -----------------------------------------------------------------------
def empty(shape: int | Sequence[int], dtype: Any = "float32", *, device: Any = "cpu",
          stream: Any = None, shared: bool = False) -> Tensor:
    """A new, uninitialised, C-contiguous tensor.

    ``shape``: int or sequence of int (extents >= 0); ``dtype``: a tx.DType, a name
    such as ``"float32"``, or a NumPy, PyTorch or JAX dtype (all that ``tx.dtype``
    takes); ``device``: ``"cpu"``, ``"cuda:0"``,
    ``"cuda_host"``, ``"cuda_managed"`` or a tx.Device; ``stream``: the stream the
    allocation is ordered on and the data will be written on (None: the default).
    ``shared=True``: memory other processes can map, so ``tx.share`` hands it over
    without a copy: on the CPU a block of this process's shared arenas (anonymous
    shared memory, 64-byte aligned, page-aligned above 4 MiB; a freed block is handed
    out again, with what it held), on CUDA an IPC-enabled cuda.core memory pool
    (``cpu`` and ``cuda:N`` only, else ValueError). See docs/processes.md.

    Ownership: the library allocates (CPU: 64-byte aligned) and frees; the free runs
    once the last holder is gone and the streams that used the memory have finished
    (for shared memory: in every process that attached it).
    CUDA device memory is freed in stream order on the device (its free stream waits on
    the other streams that used it, then ``cuMemFreeAsync``): the host never waits.

    Memory still waiting for its stream-ordered release is in use: when the backend
    finds no memory, this completes what is ready, waits up to ``OOM_WAIT`` seconds for
    that device's pending releases, and retries once.

    Raises TypeError / ValueError for a bad shape or dtype (ValueError, from the one layout
    check in exchange/layout.py: more than 1024 dimensions, a negative extent, 2**63
    elements or bytes or more, a row-major stride beyond int64 even with zero elements,
    as for ``(0, 2**40, 2**40)``), BackendUnavailableError
    when the device's backend cannot load here (for CUDA: the reason, e.g. no driver),
    MemoryError (for CUDA its subclass CUDAOutOfMemoryError) when the retry fails too,
    naming the bytes still pending release on that device.
    """
    dims = _shape_tuple(shape)
    dt = _as_dtype("float32" if dtype is None else dtype)
    what = f"tx.empty: shape {dims} of {dt.name}" if len(dims) <= 8 else f"tx.empty of {dt.name}"
    strides, _, nbytes = check_shape(dims, None, dt.itemsize, what)  # ValueError (exchange/layout.py)
    dev = Device.parse(device)
    backend = _backend(dev)
    st = _resolve_stream(stream, dev)
    alloc = _allocate(backend, nbytes, dev, st, shared)
    record = _REG.new_record(dev, alloc.address, nbytes, origin="allocated", kind="allocated",
                             release=_Free(backend, alloc, st), owner=alloc.owner)
    tensor = Tensor._make(record, alloc.address, dims, strides, dt, False, st)
    if st is not None:
        _REG.add_stream(record, st)
    return tensor


def create_stream(device: Any = "cpu") -> Any:
    """A new stream on ``device``: a host stream (ordered work queue with a worker thread)
    on the CPU, a CUDA stream on CUDA. Raises BackendUnavailableError if the device's
    backend cannot load."""
    dev = Device.parse(device)
    return _backend(dev).create_stream(dev)


def record_stream(tensor: Tensor, stream: Any) -> None:
    """Declare that work on ``stream`` uses ``tensor``'s memory: its release waits for the
    work queued on ``stream`` up to the moment the last holder goes (as PyTorch's
    ``Tensor.record_stream``, but also for imported memory).

    Raises ValueError for a stream of another device, TypeError for a non-stream.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"record_stream expects a tx.Tensor, got {type(tensor).__name__}")
    tensor._check()
    st = _resolve_stream(stream, tensor._record.device)
    if st is None:
        raise TypeError("record_stream needs a stream, got None")
    _REG.add_stream(tensor._record, st)


def _view_of(t: Tensor, stream: Any) -> Tensor:
    t._check()
    view = Tensor._make(t._record, t._data_ptr, t._shape, t._strides, t._dtype, t._readonly, stream or t._stream)
    if stream is not None:
        _REG.add_stream(t._record, stream)
    if t._record._views is not None:  # a borrowed record: the scope's end closes this view too
        t._record._views.append(weakref.ref(view))
    return view


def _from_dlpack_py(x: Any, *, device: Any = None, copy: bool | None = None, stream: Any = None) -> Tensor:
    """Take ``x`` (any object with ``__dlpack__`` / ``__dlpack_device__``, or a DLPack
    capsule named ``"dltensor"`` or ``"dltensor_versioned"``) as a tx.Tensor, zero-copy
    unless a copy is asked for or needed (array API ``from_dlpack``; DLPack python_spec).

    ``device``: None keeps ``x``'s device; else the device wanted (forwarded as
    ``dl_device``). ``copy``: True always copies, False never (BufferError when a copy
    is needed), None when needed; anything else is a TypeError, for every kind of
    ``x``. ``stream``: the stream the caller will use the data on (a Stream of ours, an
    int handle, or None = the backend default); it is added to the record's streams so
    the release waits for the work queued on it (CPU host streams included).

    The handshake (CUDA and managed producers, and pinned ones when a stream is given):
    the producer's ``__dlpack__`` always gets ``stream`` as an int, per the DLPack spec:
    the caller's stream handle, or 1 (the legacy default stream, which the result is
    then ordered on) when none was given, never omitted and never 0, since a producer
    whose own default is -1
    (PyTorch) would otherwise order nothing. The producer orders its *current* stream
    before ours, so write the data and import it inside the producer's stream context
    (``with torch.cuda.stream(s): ...``). ``stream=-1`` asks for no synchronisation at
    all (CUDA graph capture): no ordering is established and no stream is recorded, so
    the caller orders the producer's work before any use and keeps the data alive
    until work queued on it has finished. Where the CUDA backend cannot load, a CUDA
    producer is refused with BackendUnavailableError before its ``__dlpack__`` is
    called. NumPy arrays (CPU-only by type) skip ``__dlpack_device__``.

    The producer is asked with ``max_version=(1, 3)`` first, then, if it refuses the
    newer keywords with TypeError (ONNX Runtime, older producers), with ``stream`` alone;
    a device producer that refuses ``stream`` itself gets BufferError naming it.

    Ownership: the memory stays the producer's; its deleter runs exactly once, after the
    last holder anywhere (our Tensors, capsules we re-export) is gone and the streams
    that used the memory have finished. Legacy capsules import read-only. A capsule this
    library exported comes back as a view of the same record.

    Raises TypeError for an object with no ``__dlpack__``; ValueError for a consumed
    capsule or one of another name (nothing touched); BufferError for data this library
    cannot hold (unknown device type or dtype, lanes != 1, malformed layout, another
    major version) or a copy needed with copy=False; BackendUnavailableError for device
    data whose backend cannot load here.
    """
    if device is None and copy is None and stream is None:
        # Hot path: nothing asked but the data itself, from a type that lives only on
        # the CPU (NumPy arrays): no __dlpack_device__ to ask, and no stream to pass.
        cpu_only = _CPU_ONLY.get(type(x))
        if cpu_only is None:
            cpu_only = _learn_type(type(x))
        if cpu_only:
            try:
                capsule = x.__dlpack__(max_version=_MAX_VERSION)
            except TypeError:
                capsule = _ask(x.__dlpack__, None, None, None, x)[0]
            return _capsule.consume(capsule, _PRODUCER_NAMES.get(type(x)) or _producer_name(x), x)
    return _from_dlpack(x, device=device, copy=copy, stream=stream)


def _from_dlpack(x: Any, *, device: Any = None, copy: Any = None, stream: Any = None) -> Tensor:
    # Every import the hot path does not take (the compiled core's, or the one above).
    # Its signature is from_dlpack's: the compiled core passes its call on unchanged.
    if copy is not None and copy is not True and copy is not False:
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    if isinstance(x, Tensor):
        return _from_tensor(x, device, copy, stream)
    if _capsule.is_capsule(x):
        return _from_capsule(x, device, copy, stream)
    dlpack = getattr(x, "__dlpack__", None)
    if not callable(dlpack):
        what = "no __dlpack__ method" if dlpack is None else f"its __dlpack__ is not callable: {type(dlpack).__name__}"
        raise TypeError(
            f"{_producer_name(x)} does not support DLPack ({what}); "
            "pass an array from NumPy, PyTorch, JAX, CuPy, ONNX Runtime or tvm-ffi, or a DLPack capsule"
        )
    src_dev = _producer_device(x)
    target = src_dev if device is None else Device.parse(device)
    no_sync = _is_no_sync(stream)
    if no_sync and target.type == _CPU_TYPE:
        raise ValueError("stream=-1 (no synchronisation) is for CUDA data; DLPack allows only stream=None for kDLCPU")
    st = None if no_sync else _resolve_stream(stream, target)
    if target != src_dev and target.type != _CPU_TYPE:
        # Producers need only export to the CPU (array API; NumPy refuses any other
        # dl_device and any stream): take the data where it is, then copy it to the
        # target, ordered on the caller's stream.
        if copy is False:
            raise BufferError(f"importing {src_dev} data to {target} needs a copy, but copy=False")
        return from_dlpack(x)._copy_to(target, st)
    if target.type == _CPU_TYPE:
        dl_stream = None
    elif target.type == DeviceType.kDLCUDAHost and st is None and not no_sync:
        # Pinned host memory with no caller's stream: DLPack names no stream for it, and
        # producers treat it as host data (PyTorch asserts stream is None there).
        _backend(target)
        dl_stream = None
    elif no_sync:
        _backend(target)  # refuse before __dlpack__ when CUDA cannot load here
        dl_stream = -1
    else:
        # The handshake, every time: the consumer's stream as an int (1, the legacy
        # default, when the caller gave none): a producer whose own default is -1
        # (PyTorch) would otherwise order nothing. BackendUnavailableError here, before
        # the producer is asked, where CUDA cannot load.
        dl_stream = _backend(target).to_dlpack_stream(st, target)
    dl_device = None if target == src_dev else (int(target.type), target.id)
    if dl_device is None and not copy and not no_sync and target.type != _CPU_TYPE and _has_exchange_api(type(x)):
        t = _from_exchange_api(x, target, st)  # device data through the producer's C table
        if t is not None:
            return t
    capsule, honoured = _ask(dlpack, dl_stream, dl_device, copy, x)
    t = _capsule.consume(capsule, _producer_name(x), x, st)
    if t._readonly and _immutable_producer(type(x)) and t._record.kind == "imported":
        t._record.immutable = True
    if not honoured and (copy or t.device != target):
        if copy is False:
            raise BufferError(f"importing {t.device} data to {target} needs a copy, but copy=False")
        return _from_tensor(t, target, True, None)
    return t


def _from_capsule(x: Any, device: Any, copy: Any, stream: Any) -> Tensor:
    info = _capsule._impl.peek(x)  # ValueError for a consumed capsule or another name
    if device is not None and copy is False:
        want = Device.parse(device)
        if len(info) > 7 and (int(want.type), want.id) != (info[6], info[7]):
            raise BufferError(f"moving the capsule's data to {device} needs a copy, but copy=False")
    if copy:
        return _from_tensor(from_dlpack(x, stream=stream), device, True, None)
    st = None
    if stream is not None and len(info) > 7:
        # The stream is checked against the data's device before the capsule is consumed.
        st = _resolve_stream(stream, _capsule._device(info[6], info[7]))
    t = _capsule.consume(x, "a DLPack capsule", None, st)
    if device is not None and Device.parse(device) != t.device:
        return _from_tensor(t, device, copy, stream)
    return t


def _has_exchange_api(t: type) -> bool:
    found = _EXCHANGE_API_TYPES.get(t)
    if found is None:
        found = NATIVE and getattr(t, "__dlpack_c_exchange_api__", None) is not None
        if len(_EXCHANGE_API_TYPES) < 4096:
            _EXCHANGE_API_TYPES[t] = found
    return found


_EXCHANGE_API_TYPES: dict[type, bool] = {}


def _from_exchange_api(x: Any, target: Device, stream: Any) -> Tensor | None:
    """Device data through the producer's DLPack C exchange API (PyTorch, cuda.core's
    StridedMemoryView): the table exports with no synchronisation, so the Tensor is
    ordered on the producer's current work stream (its record waits for that stream's
    work), and a caller's stream waits on it (record-then-wait, no host block). None
    when the table gives nothing (then ``__dlpack__`` serves)."""
    _backend(target)  # BackendUnavailableError before anything is exported
    got = _impl.consume_exchange_api(x)
    if got is None:
        return None
    t = _adopt_device(*got)
    if stream is not None and stream.handle != t._stream.handle:
        stream.wait(t._stream.record())
        t._stream = stream
        _REG.add_stream(t._record, stream)
    return t


def _adopt_device(t: Tensor, handle: int) -> Tensor:
    # A Tensor over device data from an exchange API: ordered on the producer's current
    # work stream (``handle``; NULL is the legacy default stream).
    producer = _backend(t.device).as_stream(handle or 1, t.device)
    t._stream = producer
    _REG.add_stream(t._record, producer)
    return t


# Producer types that only ever hold CPU memory, so the hot path need not ask their
# __dlpack_device__ (type -> True); every other type seen maps to False.
_CPU_ONLY: dict[type, bool] = {}


def _learn_type(t: type) -> bool:
    cpu_only = t.__module__ == "numpy" and t.__name__ == "ndarray"
    if len(_CPU_ONLY) < 4096:
        _CPU_ONLY[t] = cpu_only
    return cpu_only


# Producer types whose arrays never change once made (JAX, TensorFlow, MLX): their
# memory is truly read-only even though they export it through legacy capsules.
_IMMUTABLE_TYPES: dict[type, bool] = {}


def _immutable_producer(t: type) -> bool:
    known = _IMMUTABLE_TYPES.get(t)
    if known is None:
        known = t.__module__.split(".")[0] in ("jax", "jaxlib", "tensorflow", "mlx")
        if len(_IMMUTABLE_TYPES) < 4096:
            _IMMUTABLE_TYPES[t] = known
    return known


def _is_no_sync(stream: Any) -> bool:
    return type(stream) is int and stream == -1


def _new_tensor(record: Record, token: int, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
                dtype: DType, readonly: Any, stream: Any) -> Tensor:
    """A Tensor over ``record`` holding it with ``token`` (the pure path; the compiled
    core has its own): the registry's holder was registered by the caller."""
    self = object.__new__(Tensor)
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


if NATIVE:
    _new_tensor = _impl.new_tensor  # noqa: F811 (same arguments, in C)
_capsule.set_tensor_constructor(_new_tensor)


def _ask(dlpack: Any, stream: Any, dl_device: Any, copy: Any, x: Any = None) -> tuple[Any, bool]:
    """Call the producer's ``__dlpack__`` with the newest keywords it accepts: first
    ``stream``, ``max_version=(1, 3)`` and any ``dl_device`` / ``copy``; on TypeError
    ``stream`` alone (older producers). Returns the capsule and whether ``dl_device`` /
    ``copy`` were passed on. A producer of device data that refuses ``stream`` itself
    gets BufferError: its data could not be ordered before the consumer's work."""
    kwargs: dict[str, Any] = {"max_version": _MAX_VERSION}
    if dl_device is not None:
        kwargs["dl_device"] = dl_device
    if copy is not None:
        kwargs["copy"] = copy
    try:
        return dlpack(stream=stream, **kwargs), True
    except TypeError:
        pass
    try:
        return dlpack(stream=stream), False  # older producers: stream only
    except TypeError as exc:
        if stream is not None:
            name = _producer_name(x) if x is not None else "the producer"
            raise BufferError(
                f"{name}.__dlpack__ refused stream={stream!r} ({exc}); its device data cannot be ordered before "
                "the consumer's work, so it is not taken (synchronize it and import with stream=-1 if that is safe)"
            ) from exc
    return dlpack(), False


def _from_tensor(t: Tensor, device: Any, copy: Any, stream: Any) -> Tensor:
    target = t.device if device is None else Device.parse(device)
    st = _resolve_stream(stream, target)
    if copy is True or target != t.device:
        if copy is False:
            raise BufferError(f"moving {t.device} data to {target} needs a copy, but copy=False")
        return t._copy_to(target, st)
    if st is not None and t.device.type != _CPU_TYPE:
        t._handshake(st)  # the new view's stream waits for the data's last writer (no host block)
    return _view_of(t, st)


def _allocate_for_api(device_type: int, device_id: int, code: int, bits: int, shape: tuple[int, ...]) -> Tensor:
    # managed_tensor_allocator of the exchange API we publish (exchange/native/tensor.c).
    from .dtypes import from_dlpack_code

    return empty(shape, from_dlpack_code(code, bits, 1), device=Device(device_type, device_id))


# A wrong call names the public function, on either path.
_from_dlpack.__qualname__ = _from_dlpack_py.__qualname__ = "from_dlpack"
_from_dlpack.__name__ = _from_dlpack_py.__name__ = "from_dlpack"

if NATIVE:
    # tx.from_dlpack is the compiled core's (its hot paths in C), with this docstring;
    # everything it does not take goes to _from_dlpack.
    from_dlpack = _impl.bind_from_dlpack(
        "from_dlpack(x, *, device=None, copy=None, stream=None)\n--\n\n" + (_from_dlpack_py.__doc__ or ""))
    from . import registry as _registry_module
    from .dtypes import from_dlpack_code

    _impl.setup(tensor_type=Tensor, record_type=Record, begin_release=_REG._begin_release,
                warn=_registry_module._warn, note_tracked=_registry_module._note_tracked,
                where=_registry_module._where, slow_from_dlpack=_from_dlpack,
                validate_device=_capsule._device, validate_dtype=from_dlpack_code,
                lifetime_error=LifetimeError, cpu=CPU, allocate=_allocate_for_api, adopt_device=_adopt_device,
                debug=_REG.debug)
else:
    from_dlpack = _from_dlpack_py
