"""Memory channels: memory that crosses processes, one implementation per kind of memory.

``exchange.sharing`` owns how processes find each other, prove who they are, count
each other's holds and notice each other's death; a memory channel owns which memory
travels and how: what a handle carries of it, what the sender answers an attach with
(descriptors, events), how the receiver maps it and releases it. Sharing picks the
channel by the memory's DLPack device type: the backend names it
(``MemoryKind.channel``, declared in exchange/devices/__init__.py), so nothing in
sharing names a device kind.

The channels (each module says what it owns):

* ``host``: host memory in sealed ``memfd`` files, carved from arenas
  (``memfd``: ``SharedMemory``, ``Arenas``, ``arena_stats``; the CPU backend allocates
  ``tx.empty(..., shared=True)`` memory there);
* ``cuda``: CUDA memory of IPC-enabled stream-ordered pools, with IPC events ordering
  the work of both processes.

A new channel is a module here with one object, ``CHANNEL``, that has what
:class:`MemoryChannel` lists, and a ``MemoryKind(channel=<module name>)`` for each
device type it carries. Nothing here imports a device's module at import time: a
channel loads on first use of its memory.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

__all__ = ["MemoryChannel", "Served", "channel_for", "channel_of_handle"]


class Served:
    """What a sender answers an attach with, besides the protocol's own fields:
    ``reply`` (JSON values appended to the answer, in the channel's order), ``fds``
    (file descriptors sent with it, still owned by the memory: the socket sends
    copies), ``keep`` (an object to keep alive until the receiver says it opened the
    answer, or None), ``arena`` (True: the receiver was sent a descriptor that maps a
    whole arena of this process, so ``drop_leases`` fences it from now on)."""

    __slots__ = ("reply", "fds", "keep", "arena")

    def __init__(self, reply: list, fds: tuple[int, ...] = (), keep: Any = None, arena: bool = False) -> None:
        self.reply, self.fds, self.keep, self.arena = reply, fds, keep, arena


class MemoryChannel(Protocol):
    """What sharing asks of a channel. ``record`` is the sender's registry record,
    ``f`` a handle's fields (``exchange.sharing.protocol.HandleFields``).

    ``kind``: the handle's ``kind`` for this memory (its name on the wire).
    ``label``: the memory's name in messages ("CPU", "CUDA").
    ``takes_stream``: an attach may name a stream for the receiver's work to wait on.
    ``arenas``: handles may name a block of an arena (``f.arena``, ``f.base``), which
    a receiver maps whole and then takes hand-offs from without asking (the fences
    of ``drop_leases``).
    ``sets`` (optional): the module of this package that holds a set's versions in
    this memory (``exchange.sets.memory`` loads it); absent where sets do not.
    """

    kind: str
    label: str
    takes_stream: bool
    arenas: bool

    def why_not_shareable(self, record: Any, readonly: bool, isolated: bool) -> str | None:
        """Why this memory cannot go to another process as it is (None: it can)."""
        ...

    def shareable_copy(self, tensor: Any, readonly: bool, isolated: bool) -> Any:
        """A C-contiguous copy of ``tensor`` in memory this channel can share."""
        ...

    def sealed(self, record: Any) -> bool:
        """The memory is sealed against writes for every process (attaches are read-only)."""
        ...

    def export(self, record: Any, tensor: Any) -> tuple[tuple, int, int]:
        """For a new handle: ``(part, arena, base)``: the channel's own part of the
        handle (checked by ``check_part``), the arena holding the memory (0: none)
        and the memory's offset in it (bytes)."""
        ...

    def check_part(self, f: Any) -> bool:
        """The handle's channel part (and arena fields) have this channel's form."""
        ...

    def serve_attach(self, record: Any, mapping: bool, want_pool: bool, want_fd: bool) -> Served:
        """The sender's answer to an attach (see :class:`Served`). Raises what the
        memory's driver raises; the sender then refuses the attach."""
        ...

    def released(self, record: Any, events: list[bytes], pid: int) -> None:
        """Receiver ``pid`` released a mapping, sending ``events`` (its release events):
        make this process's free of ``record`` wait for them."""
        ...

    def attach(self, conns: Any, f: Any, stream: Any, deadline: float) -> Any:
        """Map the memory of handle ``f`` here (an ``Attempt`` on the connection to its
        sender, undone whole if it fails) and return a Tensor over it."""
        ...


_LOADED: dict[str, MemoryChannel] = {}


def channel_for(device_type: Any) -> MemoryChannel | None:
    """The channel that carries memory of ``device_type`` (a DLPack device type), as
    its backend declared; None when none does (such memory is copied first, or
    refused). Loads the channel's module on first use; never loads a backend."""
    from exchange.devices.base import memory_kind

    kind = memory_kind(device_type)
    name = kind.channel if kind is not None else None
    if name is None:
        return None
    channel = _LOADED.get(name)
    if channel is None:
        channel = _LOADED[name] = importlib.import_module(f"{__name__}.{name}").CHANNEL
    return channel


def channel_of_handle(kind: str, device_type: Any) -> MemoryChannel | None:
    """The channel of a handle of ``kind`` for memory of ``device_type``; None when no
    channel carries that memory, or it calls itself otherwise (a forged handle)."""
    channel = channel_for(device_type)
    return channel if channel is not None and channel.kind == kind else None
