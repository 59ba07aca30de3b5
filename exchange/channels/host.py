"""The host memory channel: CPU memory across processes, in sealed ``memfd`` files.

Owns what is shareable as it is (a block of this process's arenas, or memory of its
own: ``memfd.SharedMemory``), the shareable copies ``tx.share`` makes (sealed against
writes for a read-only tensor), what a handle says of the memory (its arena and
offset), the sender's answer to an attach (the arena's or the memory's descriptor)
and the receiver's attach (the arena mapped once and kept while used, or the memory
mapped alone). The connection, the holds and the hand-offs taken without asking are
sharing's (exchange/sharing/receiving.py keeps the arenas a receiver maps).

The memory objects here are what the records own (``Allocation.owner``: the CPU
backend allocated them from ``memfd``), so this channel reads a record's owner.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ..device import CPU
from ..errors import ExchangeError
from ..layout import row_major_strides
from ..registry import Record, registry
from ..tensor import Tensor, _backend, copy_into
from ..sharing import protocol
from ..sharing.peers import sender_exited
from ..sharing.receiving import ArenaUse, Attempt, Connections, Mapping, view
from . import Served
from .memfd import ARENAS, Block, SharedMemory

__all__ = ["CHANNEL", "HostChannel"]

_REG = registry()


class HostChannel:
    """CPU memory in shared memory files (see the module's docstring and
    ``exchange.channels.MemoryChannel``)."""

    kind = "cpu"
    label = "CPU"
    takes_stream = False
    arenas = True

    # -- the sending side
    def why_not_shareable(self, record: Record, readonly: bool, isolated: bool) -> str | None:
        owner = record._owner
        if isinstance(owner, Block):
            if isolated:
                return "it lies in one of this process's shared arenas and isolated=True asks for memory of its own"
            if owner.arena.pid != os.getpid():
                return "it lies in a shared arena of the parent process this one was forked from"
        elif not isinstance(owner, SharedMemory):
            if isinstance(owner, ArenaUse):
                return ("it lies in a shared arena of the process it was attached from, which only that process "
                        "hands out")
            return (f"its memory ({record.origin}) is private to this process; allocate it with "
                    "tx.empty(..., shared=True) to share it without a copy")
        if readonly and not owner.readonly:
            return ("it is read-only over writable shared memory, which a receiver could map writable; "
                    "a read-only tensor goes as a copy sealed against writes")
        return None

    def shareable_copy(self, tensor: Tensor, readonly: bool, isolated: bool) -> Tensor:
        """A C-contiguous copy of CPU ``tensor`` in shareable memory: a block of this
        process's arenas (of a sealed arena when ``readonly``), or memory of its own when
        ``isolated`` (sealed against writes once filled when ``readonly``: for every
        process, this one included)."""
        tensor._host_ready()
        nbytes = math.prod(tensor._shape) * tensor._dtype.itemsize
        memory = record = None
        token = 0
        try:
            memory = SharedMemory.create(nbytes, readonly=readonly) if isolated else ARENAS.allocate(nbytes, readonly)
            record, token = _REG.new_held_record(CPU, memory.address, nbytes, "allocated", "allocated", memory.close,
                                                 memory, None, "tx.share (a copy)")
            out = Tensor._make(record, memory.address, tensor._shape, row_major_strides(tensor._shape),
                               tensor._dtype, readonly)
            copy_into(out, tensor, None, _backend(CPU))
            if readonly and isolated:
                memory.seal_readonly()
            return out
        except BaseException:
            if record is None and memory is not None:
                memory.close()
            raise
        finally:
            if token:
                _REG.remove_holder(record, token)  # the copy lives on in `out` (or is released here)

    def sealed(self, record: Record) -> bool:
        return bool(record._owner.readonly)

    def export(self, record: Record, tensor: Tensor) -> tuple[tuple, int, int]:
        owner = record._owner
        return ((), owner.arena.id, owner.offset) if isinstance(owner, Block) else ((), 0, 0)

    def check_part(self, f: Any) -> bool:
        return f.channel == ()

    def serve_attach(self, record: Record, mapping: bool, want_pool: bool, want_fd: bool) -> Served:
        # Where the memory lies (the receiver checks its handle says the same), and the
        # memory's own file or its arena's (mapped once by each receiver).
        owner = record._owner
        arena = owner.arena if isinstance(owner, Block) else None
        served = Served([arena.id, owner.offset] if arena is not None else [0, 0])
        if mapping and want_fd:
            served.fds = (arena.memory.fd if arena is not None else owner.fd,)
            served.arena = arena is not None
        return served

    def released(self, record: Record, events: list[bytes], pid: int) -> None:
        pass  # host memory needs no ordering: the receiver unmapped it before telling

    # -- the receiving side
    def attach(self, conns: Connections, f: Any, stream: Any, deadline: float) -> Tensor:
        """Map the CPU memory of handle ``f`` (or reuse this process's live mapping of it).

        Memory in one of the sender's arenas: the arena is mapped once (its descriptor
        comes with the first attach from it) and kept while anything here uses it, and
        for ``receiving.ARENA_IDLE_S`` after. A handle made to be attached once
        (multiprocessing's reducer) from an arena mapped here is taken without asking
        the sender, unless its lease may have been dropped: see ``Client.take_local``."""
        client = conns.client(f, deadline)
        if f.arena and f.once:
            taken = client.take_local(f)
            if taken is not None:
                return taken
        with Attempt(client, f.entry) as a:
            a.reused = client.reuse((f.entry, not f.readonly), f)
            a.mapping = Mapping(client, f.entry, 0, None, None)
            if f.arena and a.reused is None:
                a.mapping.memory = client.use_arena(f)  # None: not mapped here (yet)
            want_fd = a.reused is None and a.mapping.memory is None
            reply, a.fds = client.request(["attach", f.entry, f.secret.hex(), f.nonce, a.reused is None, False,
                                           f.readonly, want_fd], deadline, a)
            a.mapping.rid = a.rid
            if len(reply) < 7 or type(reply[6]) is not int:
                raise ExchangeError(f"process {client.pid} sent a malformed reply (not a tensor-exchange sender of "
                                    f"protocol {protocol.PROTOCOL}?): {reply[:8]!r}")
            client.learn_watermark(reply[6])  # before an arena is mapped: see take_local
            if reply[4:6] != [f.arena, f.base]:
                raise ValueError(f"not a valid tx.ShareHandle (it names memory at {f.base} in arena #{f.arena}; "
                                 f"process {client.pid} has it at {reply[4:6]}): corrupted or forged; make a new one "
                                 "with tx.share(tensor) in the sending process")
            if a.reused is not None:
                return a.succeed(a.reused)
            if want_fd and len(a.fds) != 1:
                raise ExchangeError(f"process {client.pid} answered the attach without its memory; nothing was mapped")
            # Writable only when the handle, the sender (its reply) and the kernel (the
            # file's seals) all allow it. from_fd takes the descriptor (closing it if it fails).
            writable = not (f.readonly or reply[3] is not False)
            if not f.arena:
                a.mapping.memory = block = SharedMemory.from_fd(a.fds, f.span, writable=writable)
                address, nbytes = block.address, block.nbytes
            else:
                if a.mapping.memory is None:
                    a.mapping.memory = client.use_arena(f, a.fds)  # takes the descriptor
                    if a.mapping.memory is None:  # the sender died after its answer: nothing mapped
                        raise sender_exited(client.pid)
                use = a.mapping.memory
                address, nbytes, writable = use.arena.memory.address + f.base, f.span, writable and use.writable
            a.mapping.key = key = (f.entry, writable)
            a.record = _REG.new_record(CPU, address, nbytes, origin=f"process {client.pid} (tx.attach)",
                                       kind="imported", release=a.mapping.release, owner=a.mapping.memory)
            client.remember(key, a.record)
            return a.succeed(view(a.record, f, readonly=not writable))


#: The host channel (``exchange.channels.channel_for`` hands it out).
CHANNEL = HostChannel()
