"""The Tensor type, ``tx.Tensor``: a strided view over a registry record (its
attributes, its NumPy views, ``repr``, copies, pickling's refusal), new views of it
(``_view_of``) and ``tx.record_stream``. Its storage and hot paths are the core's
(exchange/_core); its exports beyond the hot path are exchange/exporting.py's, mixed
in. Users reach it as ``exchange.tensor.Tensor`` (exchange/tensor.py).
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

from . import _core
from .allocation import _host_readable, _make, _resolve_stream
from .device import Device, DeviceType
from .dtypes import DType
from .dtypes import dtype as _as_dtype
from .errors import LifetimeError
from .exporting import _Producer
from .layout import is_c_contiguous
from .registry import Record, registry

__all__ = ["Tensor", "record_stream"]

_REG = registry()
_CPU_TYPE = DeviceType.kDLCPU
#: Elements up to which ``repr`` of a CPU tensor shows its values (NumPy's way).
REPR_MAX_VALUES = 100
#: ``tensor -> reduction or None``, asked first by ``Tensor.__reduce__``: Ray's own
#: pickling (exchange/_ray_pickling.py sets it through exchange.tensor.set_pickle_hook;
#: this layer imports nothing of Ray's).
_PICKLE_HOOK: Any = None


class _TensorViews:
    """A strided view over memory the registry tracks (a record).

    ``shape`` (tuple of int), ``strides`` (tuple of int, **in elements**), ``dtype``
    (tx.DType), ``device`` (tx.Device), ``data_ptr`` (int, address of element 0),
    ``nbytes`` (int, bytes of the elements the view covers), ``readonly`` (bool).
    Each Tensor is a holder of its record: the memory lives at least as long as the
    Tensor, and its release after the last holder is stream-ordered.

    A borrowed Tensor (``tx.borrow``) is closed when its scope ends; any later use
    raises ``tx.LifetimeError``.

    Its storage, its release and the DLPack producer's hot path are the core's
    (exchange/_core: the compiled core's, or its pure-Python twin's); the other exports
    are exchange/exporting.py's. Published on the type with the compiled core:
    ``__dlpack_c_exchange_api__``, DLPack's C exchange API, so consumers such as
    tvm-ffi take a Tensor without a capsule. Tensors are not tracked by the garbage
    collector there: a Tensor refers to its record, dtype and stream only, none of
    which can refer back to it.
    """

    __slots__ = ()

    #: ``Tensor._make(record, data_ptr, shape, strides, dtype, readonly, stream=None,
    #: holder="tx.Tensor")``: a new Tensor over ``record``, a new holder of it.
    _make = staticmethod(_make)

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
        if device.type != _CPU_TYPE and not _host_readable(device):
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


Tensor = _core.make_tensor_type(_TensorViews, _Producer)


def _view_of(t: Tensor, stream: Any) -> Tensor:
    t._check()
    view = Tensor._make(t._record, t._data_ptr, t._shape, t._strides, t._dtype, t._readonly, stream or t._stream)
    if stream is not None:
        _REG.add_stream(t._record, stream)
    if t._record._views is not None:  # a borrowed record: the scope's end closes this view too
        t._record._views.append(weakref.ref(view))
    return view


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
