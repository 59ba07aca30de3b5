"""The memory of sets: one region per version, and how a version is laid out in it.

A ``Region`` is host memory of the host channel (exchange/channels/memfd.py): a
``memfd`` sealed against shrinking and growing, mapped writable once by its publisher
and then sealed with ``F_SEAL_FUTURE_WRITE``, so every reader can map it read-only only
(the kernel refuses a writable mapping, and a write through the read-only one faults)
while the publisher keeps writing later versions into it through its first mapping.
Readers map it with ``map_region``.

Another kind of memory plugs in through its memory channel (``exchange.channels``):
the channel names, as ``sets``, a module of that package with a ``Region`` of the same
faces, a ``map_region(fds, nbytes, parsed)`` and a ``check_part(part, region_bytes)``;
``kind_for`` picks it by the set's device (the module its memory channel names). The
faces, which the publisher and the subscriber use without looking inside:

* publisher's region: ``id``, ``nbytes``, ``address``, ``device``, ``stream`` (where a
  copy into it is queued; None: on the host), ``fd`` (sent with every version; -1:
  none), ``written(streams)`` (a version is in it, written also on ``streams``),
  ``part(sent)`` (the kind's part of a version's message, None for host memory, and a
  descriptor to send; ``sent`` is what went on this reader's connection already),
  ``released(token, pid)`` (a reader's release token), ``close()``;
* reader's mapping: ``address``, ``nbytes``, ``close()``; a device kind's also
  ``device``, ``stream`` (its tensors' stream), ``sealed`` (False),
  ``per_version`` (True: mapped per version, never cached) and ``release(streams)``
  (unmaps it after ``streams`` and returns the release token for the publisher).
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

from ..channels import channel_for
from ..channels.memfd import SharedMemory
from ..device import CPU, Device, DeviceType
from ..dtypes import dtype as as_dtype
from ..layout import check_shape

#: Bytes between tensors of a version (each starts at a multiple).
ALIGN = 64
#: Least bytes of a region; regions are powers of two from there (pages past what a
#: version writes cost nothing but address space).
MIN_REGION = 64 << 10


class Region:
    """One publisher's region: ``nbytes`` bytes at ``address`` (writable here), sealed
    so that other processes map it read-only. ``fd`` goes to readers."""

    __slots__ = ("id", "memory")

    device = CPU
    stream = None

    def __init__(self, rid: int, nbytes: int, device: Device = CPU) -> None:
        self.id = rid
        self.memory = SharedMemory.create(nbytes, readonly=True)
        try:
            self.memory.seal_future_writes()  # this mapping stays writable; every later one is read-only
        except BaseException:
            self.memory.close()
            raise

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    @property
    def address(self) -> int:
        return self.memory.address

    @property
    def fd(self) -> int:
        return self.memory.fd

    def written(self, streams: list[Any]) -> None:
        """(Host memory: the copy completed on the host; nothing to order.)"""

    def part(self, sent: set) -> tuple[None, int]:
        return None, self.memory.fd

    def released(self, token: str, pid: int) -> None:
        """(Host readers send no token.)"""

    def close(self) -> None:
        self.memory.close()


class NewestCounter:
    """The number of a set's newest version, in shared memory its readers map read-only
    (sealed as regions are): a reader that holds an offer learns without asking whether
    a newer version was published since. ``value`` (int), ``set(number)`` (the
    publisher's), ``fd`` (to send), ``close()``."""

    __slots__ = ("memory", "_cell")

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self._cell = ctypes.c_uint64.from_address(memory.address)

    @classmethod
    def create(cls) -> "NewestCounter":
        memory = SharedMemory.create(8, readonly=True)
        try:
            memory.seal_future_writes()
        except BaseException:
            memory.close()
            raise
        return cls(memory)

    @classmethod
    def map(cls, fds: list[int]) -> "NewestCounter":
        """A reader's mapping of the counter sent as the one descriptor of ``fds``
        (taken); ValueError when it is not memory sealed as a region is."""
        try:
            return cls(map_region(fds, 8))
        except ValueError as exc:
            raise ValueError(f"the set's newest-version page: {exc}") from None

    @property
    def value(self) -> int:
        return self._cell.value

    def set(self, number: int) -> None:
        self._cell.value = number

    @property
    def fd(self) -> int:
        return self.memory.fd

    def close(self) -> None:
        self._cell = ctypes.c_uint64(0)  # (never read through the unmapped address)
        self.memory.close()
def kind_for(device: Device | DeviceType | int) -> Any:
    """The module that holds a set's versions in memory of ``device`` (a Device, or a
    DLPack device type): this one for host memory, else the one its memory channel
    names. BufferError where sets cannot hold that memory; ValueError for a device
    type that is none."""
    dtype = device.type if isinstance(device, Device) else DeviceType(device)
    if dtype == CPU.type:
        return _HOST
    channel = channel_for(dtype)
    name = getattr(channel, "sets", None)
    if name is None:
        raise BufferError(f"sets cannot hold {dtype.name} memory (no memory channel carries it as a set's); "
                          "move the tensors to the CPU or to a device whose memory can be shared")
    return importlib.import_module(f"{channel_for.__module__}.{name}")


def check_part(part: Any, region_bytes: int) -> None:
    """Host memory: a version's message has no part (ValueError for one)."""
    if part is not None:
        raise ValueError("a part for host memory, which has none")


def region_bytes(nbytes: int) -> int:
    """The size of a region that holds ``nbytes``: a power of two, at least MIN_REGION."""
    return max(MIN_REGION, 1 << max(0, nbytes - 1).bit_length())


def map_region(fds: list[int], nbytes: int, parsed: None = None) -> Any:
    """A reader's read-only mapping of a region sent as the one descriptor of ``fds``
    (taken). ValueError when the file is smaller, not sealed against shrinking, or not
    sealed against writes (the kernel must keep it read-only for every reader)."""
    memory = SharedMemory.from_fd(fds, nbytes, writable=False)
    if not memory.readonly:
        memory.close()
        raise ValueError("a set's region that is not sealed against writes: refused")
    return memory


def plan(layout: list[tuple[str, tuple[int, ...], Any]]) -> tuple[list[list], int]:
    """``entries`` ([key, dtype name, shape, offset] each, C-contiguous) and the bytes
    they span, for ``layout`` ((key, shape, dtype) each). ValueError or TypeError for a
    key that is not a non-empty str, or a shape or dtype that is not one."""
    entries, top = [], 0
    for key, shape, dt in layout:
        if not isinstance(key, str) or not key or len(key) > 256:
            raise ValueError(f"a set's keys are str of 1-256 characters, got {key!r}")
        dt = as_dtype(dt)
        shape = tuple(int(n) for n in shape)
        _, _, extent = check_shape(shape, None, dt.itemsize, f"the layout of {key!r}")
        entries.append([key, dt.name, list(shape), top])
        top += -(-max(extent, 1) // ALIGN) * ALIGN
    return entries, top


_HOST = importlib.import_module(__name__)
