"""tx.Tensor through Ray's object store: ``ray.put`` / ``ray.get``, task and actor
arguments and return values.

Ray is optional (``pip install "tensor-exchange[ray]"``); this module imports it only
when a function here is called, and ``import exchange`` never imports this module.

How a tensor travels. Ray pickles task arguments and return values with its own
cloudpickle; :func:`register` gives it a serializer for ``tx.Tensor`` (plain ``pickle``
still refuses a tx.Tensor). The serializer hands the tensor's bytes to Ray as one
out-of-band pickle-5 buffer, which Ray writes once into the node's shared-memory object
store (objects under about 100 KiB are kept inline in the owner's memory instead). The
receiver gets a tx.Tensor over that memory, with no further copy:

* read-only (``Tensor.readonly``, and mutability ``"readonly"``): the store is immutable,
  so a framework that ignores DLPack's READ_ONLY flag (PyTorch) must not get it as
  writable memory; ``tx.Chain`` gives such a stage a copy. Code that calls
  ``torch.from_dlpack`` on it directly must not write to the result (or clone it first,
  ``tx.from_dlpack(t, copy=True)``);
* C-contiguous, 64-byte aligned (Ray aligns store buffers), on the CPU;
* its record (``Tensor.record``) is ``imported from ray object <id>``; it holds the
  store's buffer (which pins the object in the store) and the ``ObjectRef`` it came
  from, where Ray names one, so the object stays alive until the last holder of the
  record goes, even when its owner drops every reference of its own.

CUDA tensors sent this way are copied to host memory on the way in and back to the same
device number on the way out (the record then says ``transport == "host-copy"``);
between actors, Ray Direct Transport with the transport of ``exchange.ray.transport``
moves them without the store. Pinned and managed host memory arrive as CPU memory.

Registering. A process that *sends* tx Tensors needs the serializer (receiving needs
nothing: the deserializer is this module's function, imported by name), and gets it by
itself: where it is not registered yet, Ray's pickling of a tx.Tensor reaches
``Tensor.__reduce__``, whose hook (exchange/_ray_pickling.py) calls
:func:`reduce_under_ray`: it finds Ray's pickler calling, registers the serializer
(:func:`register`) and gives Ray the same reduction. So a plain ``ray.init()`` is
enough, in the driver and in every worker. :func:`init` (or
:func:`runtime_env` passed to your own ``ray.init``) registers it as each worker starts,
through Ray's ``worker_process_setup_hook``; the actors that ``tx.RayExecutor`` starts
register themselves as well.

Ray APIs used: ``ray.util.register_serializer`` (Ray's serialization docs, "Customized
Serialization"); the serialization context's outer ``ObjectRef``
(``get_outer_object_ref``) to name and hold the object; ``worker_process_setup_hook``
in ``runtime_env``; the module name of Ray's pickler, ``ray.cloudpickle``, to know its
pickling from any other. Checked with Ray 2.60.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
from typing import Any

from ..layout import row_major_strides
from ..device import CPU, Device
from ..devices.base import memory_kind
from ..dtypes import dtype as _as_dtype
from ..errors import require_module
from ..registry import registry
from ..tensor import Tensor, from_dlpack

__all__ = ["EXTRA", "SETUP_HOOK", "require_ray", "register", "reduce_under_ray", "setup_worker", "runtime_env", "init",
           "object_ref", "transport", "set_transport", "transport_reason", "LOCAL_CLUSTER"]

#: How to install what this module needs.
EXTRA = 'pip install "tensor-exchange[ray]"'
#: The ``worker_process_setup_hook`` that registers the serializer in every Ray worker.
SETUP_HOOK = f"{__name__}.setup_worker"
#: ``ray.init`` options :func:`init` uses for a local cluster started here: no
#: dashboard, no usage report, quiet workers; the object store at most 2 GiB (Ray's
#: default is 30% of memory, more than a tensor pipeline on one machine needs).
LOCAL_CLUSTER: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                 "configure_logging": False}
_STORE_CAP = 2 << 30
#: Seconds :func:`init` waits for a cluster address to accept a connection.
CONNECT_TIMEOUT_S = 10.0
_STATE_VERSION = 1
_REG = registry()


def _host_readable(device: Device) -> bool:
    """The host reads ``device``'s memory in place (as its backend's MemoryKind says):
    such memory goes through the object store as it is, other memory as a host copy."""
    kind = memory_kind(device.type)
    return kind is not None and kind.host_readable


def require_ray() -> Any:
    """The ``ray`` module; ``tx.BackendUnavailableError`` naming the extra when Ray is not
    installed (or fails to import)."""
    return require_module("ray", "running on Ray", EXTRA)


# -- registering ---------------------------------------------------------------------
def register() -> None:
    """Give Ray's serializer in this process the ``tx.Tensor`` serializer (idempotent;
    cheap). Needs a connected Ray (after ``ray.init``, or inside a worker).

    Also keeps Ray Direct Transport from replacing it: Ray registers a serializer of
    its own for a transport's data type the first time a method with that
    ``tensor_transport`` returns, and that one falls back to plain ``pickle`` (which
    refuses tx Tensors) for every other method. The serializer here does both jobs, so
    Ray is told it is already in place (``_rdt_custom_serializer_registered``, Ray 2.60).

    Raises BackendUnavailableError without Ray, RuntimeError when Ray is not connected.
    """
    ray = require_ray()
    worker = ray._private.worker.global_worker
    if not worker.connected:
        raise RuntimeError("exchange.ray.objects.register() needs a connected Ray: call ray.init() first "
                           "(or exchange.ray.objects.init())")
    ray.util.register_serializer(Tensor, serializer=_serialize, deserializer=_deserialize)
    flags = getattr(worker.get_serialization_context(), "_rdt_custom_serializer_registered", None)
    if isinstance(flags, dict):
        flags[Tensor] = True


def reduce_under_ray(t: Tensor) -> tuple | None:
    """``Tensor.__reduce__`` when Ray's pickler (``ray.cloudpickle``: Ray's serialization
    of objects, arguments and returns, its pickling of functions and their closures) is
    the one pickling, in a connected process where :func:`register` has not run (a plain
    ``ray.init()``, or a worker of a job started without :func:`runtime_env`): registers
    the serializer for what follows and returns this tensor's reduction, the one the
    serializer gives. So a Ray user needs no call to this module. Ray registers
    serializers for its pickler process-wide, so from then on it takes tx Tensors
    wherever it pickles; this makes that so from the start. None for any other pickler
    (plain ``pickle`` still refuses a tx.Tensor) and where Ray is not connected."""
    ray = sys.modules.get("ray")
    if ray is None or not _pickled_by_ray():
        return None
    try:
        if not ray._private.worker.global_worker.connected:
            return None
    except AttributeError:  # a Ray without the worker internals this module reads
        return None
    register()
    return _deserialize, (_serialize(t),)


def _pickled_by_ray() -> bool:
    """The pickler that called ``Tensor.__reduce__`` is Ray's: the first Python frame
    above this library's own is in ``ray.cloudpickle`` (its ``Pickler.dump``; the C
    pickler between them has no frame). Plain ``pickle`` called anywhere, a Ray task's
    code included, has the caller's frame there instead."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "exchange":
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("ray.cloudpickle")


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` (:data:`SETUP_HOOK`): runs in every new worker
    process of a Ray started with :func:`runtime_env`, and registers the serializer."""
    register()


def runtime_env(env: dict[str, Any] | None = None) -> dict[str, Any]:
    """``env`` (a Ray ``runtime_env`` dict, or None) with :data:`SETUP_HOOK` as its
    ``worker_process_setup_hook``: the workers of a Ray started with it register the
    serializer; the driver that calls ``ray.init`` still needs :func:`register` after
    it. ValueError when ``env`` already has another hook: call :func:`setup_worker` from
    that hook instead."""
    out = dict(env or {})
    hook = out.get("worker_process_setup_hook")
    if hook is not None and hook != SETUP_HOOK and hook is not setup_worker:
        raise ValueError(f"runtime_env already has worker_process_setup_hook={hook!r}; call "
                         f"{SETUP_HOOK}() from it so Ray workers can send tx Tensors")
    out["worker_process_setup_hook"] = SETUP_HOOK
    return out


def init(**options: Any) -> Any:
    """Start (or join) Ray with the tx.Tensor serializer in every worker, and register it
    here. ``options`` go to ``ray.init``; for a new local cluster (no ``address``, no
    ``RAY_ADDRESS`` in the environment) the defaults are :data:`LOCAL_CLUSTER` and
    ``object_store_memory`` the smaller of Ray's default (30% of memory) and 2 GiB.
    ``runtime_env`` gets the setup hook (:func:`runtime_env`).

    When Ray is already initialized nothing is restarted: the serializer is registered
    in this process only (workers started without the hook can still receive tx
    Tensors but not send them: a task returning one fails with a TypeError saying
    so; the actors of ``tx.RayExecutor`` register themselves).

    Returns what ``ray.init`` returns (None when Ray was already up). Raises
    BackendUnavailableError naming the extra when Ray is not installed;
    ConnectionError within :data:`CONNECT_TIMEOUT_S` seconds when ``address`` (or
    ``RAY_ADDRESS``) names ``host:port`` (or ``ray://host:port``) where nothing answers
    (``ray.init`` itself retries such an address for minutes).
    """
    ray = require_ray()
    if ray.is_initialized():
        register()
        return None
    opts = dict(options)
    opts["runtime_env"] = runtime_env(opts.get("runtime_env"))
    if not _connecting(opts):
        for key, value in LOCAL_CLUSTER.items():
            opts.setdefault(key, value)
        opts.setdefault("object_store_memory", _default_store_bytes())
    else:
        _check_reachable(opts)
    context = ray.init(**opts)
    register()
    return context


def _connecting(options: dict[str, Any]) -> bool:
    """True when ``ray.init(**options)`` joins a running cluster instead of starting one."""
    import os

    return options.get("address") is not None or bool(os.environ.get("RAY_ADDRESS"))


def _check_reachable(options: dict[str, Any]) -> None:
    """ConnectionError unless something listens at the cluster address ``ray.init`` is
    about to join (``host:port`` or ``ray://host:port``; other forms, such as ``auto``,
    are Ray's to resolve). One TCP connection, closed at once."""
    import os
    import socket

    from_env = options.get("address") is None
    address = str(os.environ.get("RAY_ADDRESS", "") if from_env else options["address"])
    text = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        where = f"RAY_ADDRESS={address}" if from_env else f"address={address!r}"
        raise ConnectionError(f"no Ray cluster answers at {address} ({exc.strerror or exc}; from {where}): start it, "
                              "or leave the address out (unset RAY_ADDRESS) to start a local cluster here") from None


def _default_store_bytes() -> int:
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _STORE_CAP
    return int(min(_STORE_CAP, 0.3 * total))


# -- what a received tensor says ----------------------------------------------------------
def object_ref(t: Tensor) -> Any:
    """The Ray ``ObjectRef`` that ``t``'s memory came from (held by its record), or None."""
    owner = t.record._owner
    if isinstance(owner, _StoreOwner):
        return owner.ref
    return None


def transport(t: Tensor) -> str:
    """How ``t``'s memory reached this process: ``"in-process"`` (made or imported here),
    ``"ray-object-store"``, ``"host-copy"``, or what the Ray Direct Transport of
    ``exchange.ray.transport`` used (the name it gives, e.g. ``"shared-memory"``, ``"nixl"``)."""
    return t.record.__dict__.get("transport", "in-process")


def set_transport(t: Tensor, name: str, why: str | None = None) -> None:
    """Note on ``t``'s record how its memory arrived (see :func:`transport`), and for a
    copy why it was one (:func:`transport_reason`)."""
    record = t.record
    record.transport = name
    if why is not None:
        record.transport_reason = why


def transport_reason(t: Tensor) -> str | None:
    """Why the transport of ``t``'s memory copied it, when it said (else None)."""
    return t.record.__dict__.get("transport_reason")


class _StoreOwner:
    """What a record over Ray's store holds: the buffer (pins the object in the store)
    and the ObjectRef it came from (keeps the object owned)."""

    __slots__ = ("buffer", "ref")

    def __init__(self, buffer: Any, ref: Any) -> None:
        self.buffer = buffer
        self.ref = ref

    def __repr__(self) -> str:
        return f"<Ray object {self.ref.hex() if self.ref is not None else '(inline)'}>"


# -- the serializer ------------------------------------------------------------------------
def _serialize(t: Tensor) -> tuple:
    """tx.Tensor -> the state Ray pickles. Runs in the sending process, inside Ray's
    serialization of a task argument, a return value or a ``ray.put``."""
    t._check()  # a closed tx.borrow view: LifetimeError, never freed memory
    ctx = _context()
    local = getattr(ctx, "_thread_local", None)
    if local is not None and getattr(local, "use_external_transport", False):
        # Ray Direct Transport collects the tensors of this value; they travel by the
        # transport, and the pickled value keeps only their index (as Ray's own does).
        local.rdt_tensors.append(t)
        return ("rdt", len(local.rdt_tensors) - 1)
    device = t.device
    src = t
    if not _host_readable(device):
        src = t._copy_to(CPU)  # device memory goes through host memory: a copy
    elif not src.is_contiguous():
        src = from_dlpack(src, copy=True)  # one C-contiguous copy, then the bytes as they are
    return ("tx", _STATE_VERSION, src.shape, src.dtype.name, str(device), _buffer(src))


def _buffer(t: Tensor) -> Any:
    """The bytes of C-contiguous host tensor ``t`` as an out-of-band pickle buffer (Ray
    writes it into the store; no copy here). The buffer holds ``t`` alive."""
    n = t.nbytes
    if n == 0:
        return b""
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr)
    raw._tx_keep = t  # the buffer keeps the tensor, and so its memory, alive while Ray copies
    return pickle.PickleBuffer(memoryview(raw))


def _deserialize(state: tuple) -> Tensor:
    """The state from :func:`_serialize` -> a tx.Tensor over the received memory. Runs in
    the receiving process, inside Ray's deserialization."""
    if state[0] == "rdt":
        return _context()._thread_local.rdt_tensors[state[1]]
    if state[0] != "tx" or state[1] != _STATE_VERSION:
        raise ValueError(f"not a tx.Tensor of this version of tensor-exchange: {state[:2]!r}")
    _, _, shape, dtype_name, device_text, buf = state
    ref = _outer_ref()
    t = _over_buffer(buf, tuple(shape), _as_dtype(dtype_name), ref)
    device = Device.parse(device_text)
    if _host_readable(device):
        return t
    moved = from_dlpack(t, device=device)  # back to the device it left, as a copy
    set_transport(moved, "host-copy", "device memory goes through the object store as a host copy; "
                  "use Ray Direct Transport (tensor_transport='tx') between actors")
    return moved


def _over_buffer(buf: Any, shape: tuple[int, ...], dt: Any, ref: Any) -> Tensor:
    import numpy as np

    view = memoryview(buf)
    nbytes = view.nbytes
    address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if nbytes else 0
    origin = f"ray object {ref.hex()}" if ref is not None else "ray object (small, inlined by Ray)"
    record = _REG.new_record(CPU, address, nbytes, origin=origin, kind="imported", release=None,
                             owner=_StoreOwner(buf, ref))
    record.transport = "ray-object-store"
    return Tensor._make(record, address, shape, row_major_strides(shape), dt, True)


def _context() -> Any:
    import ray

    return ray._private.worker.global_worker.get_serialization_context()


def _outer_ref() -> Any:
    try:
        ref = _context().get_outer_object_ref()
    except Exception:  # no Ray context (an object unpickled outside Ray): no ref to hold
        return None
    if ref is None or ref.is_nil():  # a small argument Ray inlined into the task: no object
        return None
    return ref
