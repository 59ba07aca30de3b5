"""Devices in DLPack's terms: ``DeviceType`` (``DLDeviceType``) and ``Device`` (``DLDevice``)."""

from __future__ import annotations

from typing import Any

from ._dlpack_abi import DLDeviceType

__all__ = ["DeviceType", "Device"]

#: ``tx.DeviceType`` is DLPack's ``DLDeviceType``: an IntEnum with the header's names.
DeviceType = DLDeviceType

# One table drives both str() and Device.parse(), so every printed name parses back.
_NAMES: dict[DeviceType, str] = {
    DeviceType.kDLCPU: "cpu",
    DeviceType.kDLCUDA: "cuda",
    DeviceType.kDLCUDAHost: "cuda_host",
    DeviceType.kDLOpenCL: "opencl",
    DeviceType.kDLVulkan: "vulkan",
    DeviceType.kDLMetal: "metal",
    DeviceType.kDLVPI: "vpi",
    DeviceType.kDLROCM: "rocm",
    DeviceType.kDLROCMHost: "rocm_host",
    DeviceType.kDLExtDev: "ext_dev",
    DeviceType.kDLCUDAManaged: "cuda_managed",
    DeviceType.kDLOneAPI: "oneapi",
    DeviceType.kDLWebGPU: "webgpu",
    DeviceType.kDLHexagon: "hexagon",
    DeviceType.kDLMAIA: "maia",
    DeviceType.kDLTrn: "trn",
}
_TYPES = {name: t for t, name in _NAMES.items()}
# Types whose device_id is always 0 (DLPack header): the id is left out of str().
_HOST_LIKE = {DeviceType.kDLCPU, DeviceType.kDLCUDAHost, DeviceType.kDLCUDAManaged}


class Device:
    """A DLPack device: ``type`` (a DeviceType) and ``id`` (the ordinal; always 0 for
    CPU, pinned host and managed memory, as dlpack.h says: another id is a ValueError).

    ``str()`` gives ``"cpu"``, ``"cuda:1"``, ``"cuda_host"``, ``"cuda_managed"``; each
    parses back with ``Device.parse``. Instances are immutable and hashable.
    """

    __slots__ = ("type", "id", "_slot")

    type: DeviceType
    id: int
    _slot: int  # index of this (type, id) in the registry's per-device counters

    def __init__(self, type: DeviceType | int | str, id: int | None = None) -> None:
        if isinstance(type, str):
            parsed = Device.parse(type)
            if id is not None and id != parsed.id and ":" in type:
                raise ValueError(f"device {type!r} already names id {parsed.id}; got id={id} as well")
            type, id = parsed.type, parsed.id if id is None else id
        if id is None:
            id = 0
        try:
            dtype = DeviceType(int(type))
        except ValueError:
            raise ValueError(
                f"unknown DLPack device type {type!r}; known: "
                + ", ".join(f"{t.name}={int(t)}" for t in DeviceType)
            ) from None
        if isinstance(id, bool) or not isinstance(id, int) or id < 0:
            raise ValueError(f"device id must be an int >= 0, got {id!r}")
        if id != 0 and dtype in _HOST_LIKE:
            raise ValueError(
                f"{_NAMES[dtype]} has device id 0 only (DLPack: kDLCPU, kDLCUDAHost and kDLCUDAManaged are "
                f"always id 0), got id {id}; use {_NAMES[dtype]!r}"
            )
        object.__setattr__(self, "type", dtype)
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "_slot", _slot_of(dtype, id))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Device is immutable")

    @staticmethod
    def parse(spec: "str | Device | tuple[int, int]") -> "Device":
        """Parse ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"cuda_host"``, ``"cuda_managed"``
        (any name ``str()`` prints), a ``(device_type, device_id)`` tuple as
        ``__dlpack_device__`` returns, or a Device (returned as is).

        Raises ValueError for an unknown name or a malformed id.
        """
        if isinstance(spec, Device):
            return spec
        if isinstance(spec, tuple) and len(spec) == 2:
            return from_dlpack_device(spec[0], spec[1])
        if not isinstance(spec, str):
            raise TypeError(f"expected a device string such as 'cpu' or 'cuda:0', got {spec!r}")
        name, sep, ordinal = spec.strip().lower().partition(":")
        if name not in _TYPES:
            raise ValueError(f"unknown device {spec!r}; use one of: {', '.join(_TYPES)} (with ':N' for an id)")
        if not sep:
            return Device(_TYPES[name], 0)
        if not ordinal.isdigit():
            raise ValueError(f"bad device id in {spec!r}: expected a non-negative integer after ':'")
        return Device(_TYPES[name], int(ordinal))

    def __dlpack_device__(self) -> tuple[DeviceType, int]:
        return (self.type, self.id)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Device):
            return self.type == other.type and self.id == other.id
        return NotImplemented

    def __hash__(self) -> int:
        return hash((int(self.type), self.id))

    def __str__(self) -> str:
        name = _NAMES[self.type]
        if self.type in _HOST_LIKE and self.id == 0:
            return name
        return f"{name}:{self.id}"

    def __repr__(self) -> str:
        return f"Device('{self}')"

    def __reduce__(self):
        return (Device, (int(self.type), self.id))


#: Per-device counter slots (live and pending bytes in the registry): one per distinct
#: (type, id) seen, in order; SLOT_DEVICES[slot] is its Device. Past MAX_SLOTS distinct
#: devices (never in practice: DLPack ids are ordinals) the last slot is shared.
MAX_SLOTS = 1024
_SLOTS: dict[tuple[int, int], int] = {}
SLOT_DEVICES: list[Device] = []


def _slot_of(device_type: DeviceType, device_id: int) -> int:
    key = (int(device_type), device_id)
    slot = _SLOTS.get(key)
    if slot is None:
        if len(SLOT_DEVICES) >= MAX_SLOTS:
            return MAX_SLOTS - 1
        slot = _SLOTS.setdefault(key, len(_SLOTS))
        if slot == len(SLOT_DEVICES):
            SLOT_DEVICES.append(_new_bare(device_type, device_id, slot))
    return slot


def _new_bare(device_type: DeviceType, device_id: int, slot: int) -> Device:
    device = object.__new__(Device)
    object.__setattr__(device, "type", device_type)
    object.__setattr__(device, "id", device_id)
    object.__setattr__(device, "_slot", slot)
    return device


CPU = Device(DeviceType.kDLCPU, 0)

# Devices seen in DLPack tuples, by (device_type, device_id): one object each, so the
# hot path neither validates nor builds a Device per exchange.
_SEEN: dict[tuple[int, int], Device] = {(1, 0): CPU}


def from_dlpack_device(device_type: int, device_id: int) -> Device:
    """The Device for a DLPack ``(device_type, device_id)`` pair (cached).
    ValueError for an unknown type or a negative id."""
    key = (device_type, device_id)
    found = _SEEN.get(key)
    if found is None:
        found = Device(device_type, device_id)
        if len(_SEEN) < 1024:
            _SEEN[(int(found.type), found.id)] = found
    return found
