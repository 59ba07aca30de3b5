"""Import: ``tx.from_dlpack``, every way data comes in as a Tensor (a producer object, a
DLPack capsule, one of our Tensors, DLPack's C exchange API), with the handshake that
orders a producer's work before the caller's stream. The hot path (a NumPy array,
nothing asked) is the core's (exchange/_core); this module owns the rest and the
public docstring.

Whether a producer of a device type gets a stream when the caller gave none is what
its backend declares (exchange.devices' MemoryKind ``producer_stream``).
"""

from __future__ import annotations

from typing import Any

from . import _core
from . import _dlpack_abi as abi
from . import capsule as _capsule
from .allocation import _backend, _memory, _resolve_stream, empty
from .device import Device, DeviceType
from .tensor_type import Tensor, _view_of

__all__ = ["from_dlpack"]

_REG = _capsule._REG
_CPU_TYPE = DeviceType.kDLCPU
_MAX_VERSION = (abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION)
_FROM_DLPACK_DOC = """Take ``x`` (any object with ``__dlpack__`` / ``__dlpack_device__``, or a DLPack
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


def _from_dlpack(x: Any, *, device: Any = None, copy: Any = None, stream: Any = None) -> Tensor:
    # Every import the hot path does not take (the core's: exchange/_core).
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
    elif st is None and not no_sync and _takes_no_stream(target):
        # Memory whose producers take no stream when the caller gave none (pinned host
        # memory: DLPack names no stream for it, and producers treat it as host data;
        # PyTorch asserts stream is None there).
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


def _takes_no_stream(device: Device) -> bool:
    # A producer of this memory gets no stream when the caller gave none, as its backend
    # declared (a device type no backend serves is refused further on).
    kind = _memory(device.type)
    return kind is not None and not kind.producer_stream


def _from_capsule(x: Any, device: Any, copy: Any, stream: Any) -> Tensor:
    info = _core.peek(x)  # ValueError for a consumed capsule or another name
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
        found = getattr(t, "__dlpack_c_exchange_api__", None) is not None
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
    got = _core.consume_exchange_api(x)  # None where the core does not take it
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


def _producer_device(x: Any) -> Device:
    """``x.__dlpack_device__()`` as a Device; BufferError naming the producer when the
    answer is not a (known device type, id >= 0) pair. Host-readable memory given with id
    None (PaddlePaddle's CPU and pinned tensors) is read as id 0, the only one there is."""
    try:
        answer = x.__dlpack_device__()
        device_type = int(answer[0])
        if answer[1] is None:
            memory = _memory(device_type)
            if memory is not None and memory.host_readable:
                return Device.parse((device_type, 0))
        return Device.parse((device_type, int(answer[1])))
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


# A wrong call names the public function.
_from_dlpack.__qualname__ = _from_dlpack.__name__ = "from_dlpack"
#: tx.from_dlpack: the core's (its hot path: in C, or the pure twin's), with the public
#: docstring; everything it does not take goes to _from_dlpack.
from_dlpack = _core.bind_from_dlpack("from_dlpack(x, *, device=None, copy=None, stream=None)\n--\n\n"
                                     + _FROM_DLPACK_DOC)
