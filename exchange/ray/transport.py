"""A Ray Direct Transport for tx.Tensor: device tensors between actors without the object
store.

Ray Direct Transport (RDT, ``@ray.method(tensor_transport=...)``, Ray 2.60's
``ray.experimental.register_tensor_transport`` and ``TensorTransportManager``) lets an
actor method's return value keep its tensors out of the object store: Ray takes the
tensors of the transport's data type out of the value, keeps them in the sending actor,
asks the transport for metadata there (``extract_tensor_transport_metadata``), and
has the receiving process fetch them (``recv_multiple_tensors``). Ray's own transports
move only ``torch.Tensor``; this module registers one for ``tx.Tensor`` under the name
:data:`NAME` (``"TX"``; pass ``tensor_transport="tx"``).

The transport is one-sided (only the receiver acts) and picks, per object:

* ``tx.share`` / ``tx.attach`` (cross-process sharing on one node: CUDA IPC for device
  memory, shared memory for host memory) when the library has them: the receiver on
  the same node attaches the sender's memory. Hop transport ``"cuda-ipc"`` (or
  ``"shared-memory"`` for host memory); memory that is not shareable as it is (not from
  ``tx.empty(..., shared=True)`` or an IPC-enabled pool) is copied into shareable memory
  by ``tx.share`` first, and the hop says so;
* NIXL, through Ray's own NIXL transport on torch views of the tensors, when NIXL is
  installed and the tensors are CUDA memory: receivers on any node. ``"nixl"``;
* otherwise a copy through host memory carried in the metadata itself (device to host
  on the sender, host to device on the receiver). ``"host-copy"``.

The receiver's tensor notes how it came (``exchange.ray.objects.transport``). NCCL (a
two-sided transport that needs a collective group) is not offered here: use Ray's own
``tensor_transport="nccl"`` with torch tensors for it.

Ownership: the sending actor keeps the tensors (Ray's RDT store holds them) and the
share handles until Ray calls ``garbage_collect`` for the object, after the last
``ObjectRef`` to it went out of scope; an attached tensor is then held across processes
by the share handle's own accounting (``tx.attach``). Host copies belong to the receiver.

Register it with :func:`register_transport` in the driver before the actors are made
(Ray then registers it on every actor it creates). The serializer of
``exchange.ray.objects`` must be registered too (:func:`exchange.ray.objects.register`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..device import CPU, Device, DeviceType
from ..tensor import Tensor, empty, from_dlpack
from .objects import _host_readable, require_ray, set_transport

require_ray()  # this module subclasses Ray's classes: without Ray, BackendUnavailableError naming the extra
from ray.experimental.rdt.tensor_transport_manager import (  # noqa: E402
    TensorTransportManager,
    TensorTransportMetadata,
)

__all__ = ["NAME", "MODES", "register_transport", "TxTransport", "TxTransportMetadata", "share_api",
           "nixl_available"]

#: The transport's name for ``tensor_transport=`` (Ray upper-cases names).
NAME = "TX"
#: What the transport can use, in order of preference; the environment variable
#: ``EXCHANGE_RAY_TX_MODE`` (read by the sender) forces one of them.
MODES = ("share", "nixl", "host-copy")


def register_transport() -> None:
    """Register :class:`TxTransport` for ``tx.Tensor`` as :data:`NAME` (idempotent), for
    ``"cpu"`` and ``"cuda"`` tensors. Call it in the driver before making the actors.
    Raises BackendUnavailableError naming the extra when Ray is not installed."""
    require_ray()
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util

    if NAME not in util.transport_manager_info:
        register_tensor_transport(NAME, ["cpu", "cuda"], TxTransport, Tensor)


def share_api() -> tuple[Any, Any] | None:
    """``(tx.share, tx.attach)`` when this library has cross-process sharing, else None."""
    import exchange

    share = getattr(exchange, "share", None)
    attach = getattr(exchange, "attach", None)
    if callable(share) and callable(attach):
        return share, attach
    return None


def nixl_available() -> bool:
    """NIXL can run in this process (Ray's NIXL transport starts its agent here)."""
    try:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        get_tensor_transport_manager("NIXL").get_nixl_agent()
        return True
    except Exception:
        return False


@dataclass
class TxTransportMetadata(TensorTransportMetadata):
    """What the receiver needs: ``mode`` (one of :data:`MODES`), ``node_id`` (the
    sender's Ray node), ``layouts`` (per tensor: shape, dtype name, device string),
    ``items`` (per tensor: a share handle, or a host NumPy copy; None for NIXL) and
    ``inner`` (Ray's NIXL metadata, for ``"nixl"``), ``why`` (for a host copy: why no
    zero-copy mode was used), ``copied`` (for ``"share"``, per tensor: why ``tx.share``
    had to copy it into shareable memory, or None)."""

    mode: str = "host-copy"
    why: str | None = None
    copied: list = field(default_factory=list)
    node_id: str | None = None
    layouts: list = field(default_factory=list)
    items: list = field(default_factory=list)
    inner: Any = None


class TxTransport(TensorTransportManager):
    """The ``TensorTransportManager`` for tx.Tensor (see the module docstring).

    ``mode``: force one of :data:`MODES` (default: ``EXCHANGE_RAY_TX_MODE``, else the
    first that applies). Ray makes one instance per process with no arguments.
    """

    def __init__(self, mode: str | None = None) -> None:
        mode = mode or os.environ.get("EXCHANGE_RAY_TX_MODE") or None
        if mode is not None and mode not in MODES:
            raise ValueError(f"unknown tx transport mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode = mode
        self._kept: dict[str, Any] = {}  # obj_id -> what must live until garbage_collect

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True  # the actor has this library: it runs the stage

    # -- sender ---------------------------------------------------------------------
    def _choose(self, tensors: list[Tensor]) -> str:
        if self.mode is not None:
            return self.mode
        if share_api() is not None:
            return "share"
        if tensors and all(t.device.type == DeviceType.kDLCUDA for t in tensors) and nixl_available():
            return "nixl"
        return "host-copy"

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> TxTransportMetadata:
        """On the sending actor, right after the method returned: describe ``rdt_object``
        (tx Tensors) and make what the receiver needs. TypeError for anything but tx
        Tensors; ValueError for tensors on different device types."""
        import ray

        tensors = list(rdt_object)
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"the {NAME} transport carries tx.Tensor, got {type(t).__name__}")
        kinds = {t.device.type for t in tensors}
        if len(kinds) > 1:
            raise ValueError(f"all tensors of one {NAME} object must be on one device type, got {sorted(map(str, kinds))}")
        mode = self._choose(tensors)
        layouts = [(t.shape, t.dtype.name, str(t.device)) for t in tensors]
        meta = TxTransportMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in tensors],
            tensor_device=_ray_device(tensors[0].device) if tensors else None,
            mode=mode, node_id=ray.get_runtime_context().get_node_id(), layouts=layouts,
        )
        if mode == "share":
            share, _ = share_api() or (None, None)
            if share is None:
                raise RuntimeError("tx.share is not available in this version of tensor-exchange")
            meta.items, meta.copied = [], []
            for t in tensors:
                try:
                    handle, why = share(t, copy=False), None  # shareable memory: no copy
                except BufferError as exc:  # ordinary memory: tx.share copies it into shareable memory
                    handle, why = share(t), f"tx.share copied it into shareable memory ({exc})"
                meta.items.append(handle)
                meta.copied.append(why)
            self._kept[obj_id] = meta.items
        elif mode == "nixl":
            import torch
            from ray.experimental.rdt.util import get_tensor_transport_manager

            views = [torch.from_dlpack(_contiguous(t)) for t in tensors]
            meta.inner = get_tensor_transport_manager("NIXL").extract_tensor_transport_metadata(obj_id, views)
            self._kept[obj_id] = views
        else:
            meta.items = [_host_copy(t) for t in tensors]
            meta.why = ("forced by EXCHANGE_RAY_TX_MODE / mode=" if self.mode else
                        "tx.share is not in this build and NIXL is not available for these tensors")
        return meta

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> Any:
        from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

        return CommunicatorMetadata()

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        raise NotImplementedError(f"the {NAME} transport is one-sided: the receiver fetches")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """On the sender, once Ray's reference counting says the object is gone: drop
        the share handles (or NIXL registrations) made for it."""
        kept = self._kept.pop(obj_id, None)
        meta = tensor_transport_meta
        if kept is None:
            return
        if getattr(meta, "mode", None) == "nixl":
            from ray.experimental.rdt.util import get_tensor_transport_manager

            get_tensor_transport_manager("NIXL").garbage_collect(obj_id, meta.inner, kept)
        else:
            for handle in kept:  # end the leases of handles no receiver attached
                close = getattr(handle, "close", None)
                if close is not None:
                    close()

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        pass  # nothing in flight to abort: the receiver's fetch is one call

    # -- receiver -------------------------------------------------------------------
    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> list[Tensor]:
        """On the receiving process: the tensors, as tx Tensors, each noting how it came
        (``exchange.ray.objects.transport``). ``target_buffers`` (tx Tensors of the same
        shapes and dtypes) receive host copies; other modes refuse them (ValueError).
        ValueError when shared memory was sent to another node."""
        import ray

        meta = tensor_transport_metadata
        if target_buffers and meta.mode != "host-copy":
            raise ValueError(f"the {NAME} transport fills target buffers only for host copies, not {meta.mode!r}")
        if meta.mode == "share":
            here = ray.get_runtime_context().get_node_id()
            if here != meta.node_id:
                raise ValueError(
                    f"tx.share memory from node {meta.node_id} cannot be attached on node {here}: "
                    "sharing works within one machine; install NIXL for device tensors across nodes, "
                    "or set EXCHANGE_RAY_TX_MODE=host-copy for the sending actors"
                )
            _, attach = share_api() or (None, None)
            if attach is None:
                raise RuntimeError("tx.attach is not available in this version of tensor-exchange")
            out = []
            for handle, (_, _, device), why in zip(meta.items, meta.layouts, meta.copied or [None] * len(meta.items)):
                t = attach(handle)
                set_transport(t, "shared-memory" if _host_readable(Device.parse(device)) else "cuda-ipc", why)
                out.append(t)
            return out
        if meta.mode == "nixl":
            from ray.experimental.rdt.util import get_tensor_transport_manager

            nixl = get_tensor_transport_manager("NIXL")
            views = nixl.recv_multiple_tensors(obj_id, meta.inner, nixl.get_communicator_metadata(None, None))
            out = [from_dlpack(v) for v in views]
            for t in out:
                set_transport(t, "nixl")
            return out
        return [_from_host(data, layout, buf, meta.why) for data, layout, buf
                in zip(meta.items, meta.layouts, target_buffers or [None] * len(meta.items))]


def _ray_device(device: Device) -> str:
    return "cuda" if device.type == DeviceType.kDLCUDA else "cpu"


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else from_dlpack(t, copy=True)


def _host_copy(t: Tensor) -> Any:
    """The bytes of ``t``, C-contiguous, in a new NumPy uint8 array in host memory (it is
    pickled into the metadata). Bytes, not a typed array: every dtype of this library
    travels, bfloat16 included."""
    import ctypes

    import numpy as np

    host = t._copy_to(CPU) if not _host_readable(t.device) else _contiguous(t)
    out = np.empty(host.nbytes, dtype=np.uint8)
    if host.nbytes:
        ctypes.memmove(out.ctypes.data, host.data_ptr, host.nbytes)
    return out


def _from_host(data: Any, layout: tuple, target: Tensor | None, why: str | None) -> Tensor:
    """The tensor of ``layout`` (shape, dtype name, device) from the host bytes ``data``:
    written into ``target`` when given, else into new memory on the layout's device."""
    import ctypes

    shape, dtype_name, device_text = layout
    device = Device.parse(device_text)
    if target is not None:
        if (tuple(target.shape) != tuple(shape) or target.dtype.name != dtype_name or not target.is_contiguous()
                or not _host_readable(target.device)):
            raise ValueError(f"target buffer {target!r} does not fit the tensor received ({shape}, {dtype_name}); "
                             "give a C-contiguous host tx.Tensor of that shape and dtype")
        out = target
    else:
        out = empty(shape, dtype_name)
    if data.nbytes:
        ctypes.memmove(out.data_ptr, data.ctypes.data, data.nbytes)
    if target is None and not _host_readable(device):
        out = from_dlpack(out, device=device)
    set_transport(out, "host-copy", why)
    return out
