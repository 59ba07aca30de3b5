"""Device backends for tensor-exchange: one module per backend (``cpu``, ``cuda``) and the
protocols they implement (``base``). Backends load lazily through
``exchange.devices.base.get_backend``; this package registers them by DLPack device type
(the backends import ``base``; ``base`` imports none of them), with the MemoryKind of each
device type: what the device-neutral core asks instead of naming a device kind, and
which memory channel (exchange/channels/) carries it to other processes."""

from .base import Backend, Event, MemoryKind, Stream, get_backend, memory_kind, register_backend
from exchange.device import DeviceType

__all__ = ["Backend", "Event", "MemoryKind", "Stream", "get_backend", "memory_kind", "register_backend"]


def _load_cpu() -> Backend:
    from . import cpu

    return cpu.CPUBackend()


def _load_cuda() -> Backend:
    from . import cuda

    return cuda.load()


register_backend((DeviceType.kDLCPU,), _load_cpu, {DeviceType.kDLCPU: MemoryKind(host_readable=True, channel="host")})
_CUDA = (DeviceType.kDLCUDA,)
register_backend((DeviceType.kDLCUDA, DeviceType.kDLCUDAHost, DeviceType.kDLCUDAManaged), _load_cuda, {
    DeviceType.kDLCUDA: MemoryKind(host_readable=False, producer_stream=True, channel="cuda"),
    DeviceType.kDLCUDAHost: MemoryKind(host_readable=True, shared_by=_CUDA),
    DeviceType.kDLCUDAManaged: MemoryKind(host_readable=True, shared_by=_CUDA, producer_stream=True),
})
