"""Host shared memory: the memory of the host memory channel (exchange/channels/host.py).

Owns ``SharedMemory`` (an anonymous memory file, ``memfd_create``: sealed, mapped
shared, never a name in /dev/shm), the arenas shared CPU tensors are carved from
(``Block``, ``Arena``, ``Arenas`` and this process's ``ARENAS``) and ``arena_stats``.
The CPU backend allocates ``tx.empty(..., shared=True)`` memory here; the host channel
hands it to other processes and maps what they send.

Part of the library's bottom layer: it imports only the standard library, so the CPU
backend may import it (exchange.devices.cpu re-exports these names, where they lived
before). Nothing here is loaded by ``import exchange``.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import mmap
import os
import stat
import threading
from typing import Any

from ..runtime import DEVICES, register

__all__ = ["SharedMemory", "Block", "Arena", "Arenas", "ARENAS", "arena_stats", "F_SEAL_FUTURE_WRITE"]

_MAP_FAILED = ctypes.c_void_p(-1).value
_fd_limit_raised = False
_LIBC: Any = None


def _libc() -> Any:
    # libc's mmap/munmap: a mapping at an address of our choosing to unmap when the
    # registry says so (Python's mmap objects refuse to close while buffers exist).
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mprotect.restype = ctypes.c_int
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


#: F_SEAL_FUTURE_WRITE (Linux 5.1; Python's fcntl has no name for it): no new writable
#: mapping (EPERM), no write(), no hole punched, no mprotect to writable (EACCES), for
#: every descriptor of the file, a reopened /proc/self/fd/N included; mappings made
#: writable before it keep working.
F_SEAL_FUTURE_WRITE = 0x10


class SharedMemory:
    """Host memory other processes can map (exchange/sharing/): an anonymous memory file
    (``memfd_create``, Linux), sealed against shrinking and growing, mapped shared.

    ``fd`` (the file, owned), ``address`` (int, page-aligned), ``nbytes`` (the mapped
    bytes, at least 1: an mmap cannot be empty), ``writable`` (this mapping),
    ``readonly`` (the file is sealed against writes: no process can map it writable or
    write it, whatever descriptor it holds). The memory exists while any process maps it
    or holds its file: it has no name (nothing in /dev/shm), and the kernel removes it
    when the last mapping and descriptor go, SIGKILL included. ``close()`` unmaps and
    closes the file (once; the registry calls it through ``CPUBackend.free`` after the
    last holder). Sizes in bytes.

    The seals are planned at creation: memory made writable (``create``) is sealed
    against new seals too, so no process it is shared with can seal it against its
    owner; memory made to be read-only (``create(readonly=True)``) waits for
    ``seal_readonly()`` once it is filled.
    """

    __slots__ = ("fd", "address", "nbytes", "writable", "readonly", "__weakref__")

    def __init__(self, fds: list[int], nbytes: int, writable: bool, readonly: bool = False) -> None:
        # Takes the one descriptor of ``fds`` (the caller's list owns it until then: no
        # moment where nobody or both own it, whatever interrupts) and maps it. OSError
        # (the file is closed) if mapping fails; any exception here (KeyboardInterrupt
        # included) leaves nothing mapped or open.
        self.fd, self.address, self.nbytes, self.writable, self.readonly = -1, 0, nbytes, writable, readonly
        try:
            self.fd = fds.pop()
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.address = _libc().mmap(None, nbytes, prot, mmap.MAP_SHARED, self.fd, 0) or 0
            if self.address == _MAP_FAILED:
                self.address = 0
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {nbytes} shared bytes failed: {os.strerror(err)}")
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, nbytes: int, readonly: bool = False) -> "SharedMemory":
        """New zero-filled shared memory of ``nbytes`` bytes (1 if 0), mapped writable
        here. ``readonly=True``: to be sealed read-only by ``seal_readonly()`` once
        filled. OSError when the system refuses (no memory, too many open files)."""
        if not hasattr(os, "memfd_create"):
            raise OSError(errno.ENOSYS, "shared memory (tx.empty(shared=True), tx.share) needs Linux's memfd_create")
        import fcntl

        if not hasattr(fcntl, "F_ADD_SEALS"):
            seals = 0
        elif readonly:
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # F_SEAL_FUTURE_WRITE and F_SEAL_SEAL come once filled
        else:
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        if readonly and not seals:
            raise OSError(errno.ENOSYS, "read-only shared memory needs file seals (Linux memfd, F_ADD_SEALS)")
        _raise_fd_limit()
        size = max(1, nbytes)
        fds: list[int] = []
        try:
            fds.append(os.memfd_create("tensor-exchange", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals else 0)))
            os.ftruncate(fds[0], size)
            if seals:  # no process can resize it under another's mapping (that would SIGBUS)
                fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, seals)
            return cls(fds, size, True)
        except BaseException:
            _close_all(fds)  # (nothing left there once the mapping took it)
            raise

    def seal_readonly(self) -> None:
        """Seal memory made by ``create(readonly=True)`` against writes, for good: no
        process can write it any more, this one included (its mapping is made read-only
        too). OSError when the kernel lacks F_SEAL_FUTURE_WRITE (Linux 5.1)."""
        import fcntl

        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            raise OSError(exc.errno, f"sealing shared memory read-only failed ({os.strerror(exc.errno)}): sharing "
                                     "read-only memory needs Linux 5.1's F_SEAL_FUTURE_WRITE") from None
        if _libc().mprotect(ctypes.c_void_p(self.address), self.nbytes, mmap.PROT_READ) == 0:
            self.writable = False
        self.readonly = True

    def seal_future_writes(self) -> None:
        """Seal memory made by ``create(readonly=True)`` against writes by any mapping made
        from now on (``F_SEAL_FUTURE_WRITE``): other processes can only map it read-only;
        this process's own mapping, made before, stays writable. OSError as
        ``seal_readonly``."""
        import fcntl

        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            raise OSError(exc.errno, f"sealing shared memory read-only failed ({os.strerror(exc.errno)}): sharing "
                                     "read-only memory needs Linux 5.1's F_SEAL_FUTURE_WRITE") from None
        self.readonly = True

    @classmethod
    def from_fd(cls, fds: list[int], need: int, writable: bool) -> "SharedMemory":
        """Map a shared-memory file received from another process: the one descriptor
        of the list ``fds``, taken from it (closed if anything fails). Writable when asked
        and the file is not sealed against writes, else read-only. ValueError when the
        file is smaller than ``need`` bytes, is not a regular file, or is not sealed
        against shrinking (``F_SEAL_SHRINK``, which this library's memory always has): a
        file its sender could still truncate would make this mapping fault (SIGBUS) when
        read past the new end."""
        try:
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size < max(1, need):
                raise ValueError(f"the shared memory file holds {st.st_size} bytes, the handle needs {need}")
            if not _sealed_against_shrinking(fds[0]):
                raise ValueError("the shared memory file is not sealed against shrinking (F_SEAL_SHRINK), as this "
                                 "library's always is: its sender could truncate it under this mapping; refused")
            readonly = _sealed_against_writes(fds[0])
            _raise_fd_limit()
            return cls(fds, st.st_size, writable and not readonly, readonly)
        except BaseException:
            _close_all(fds)  # (nothing left there once the mapping took it)
            raise

    def close(self) -> None:
        """Unmap and close the file; nothing if already closed. Never raises."""
        address, self.address = self.address, 0
        fd, self.fd = self.fd, -1
        if address:
            _libc().munmap(address, self.nbytes)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (f"SharedMemory(fd={self.fd}, nbytes={self.nbytes}, {'writable' if self.writable else 'read-only'}"
                f"{', sealed read-only' if self.readonly else ''})")


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _sealed_against_shrinking(fd: int) -> bool:
    import fcntl

    if not hasattr(fcntl, "F_GET_SEALS"):  # no seals on this system: its senders cannot seal either
        return True
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # not a memfd
        return False


def _sealed_against_writes(fd: int) -> bool:
    import fcntl

    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except (OSError, AttributeError):  # not a memfd, or no seals here
        return False
    return bool(seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE))


def _raise_fd_limit() -> None:
    # Every shared allocation holds one open file: lift the soft limit on open files to
    # the hard limit once (the usual soft limit, 1024, would cap live shared tensors).
    global _fd_limit_raised
    if _fd_limit_raised:
        return
    _fd_limit_raised = True
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


class Block:
    """A block of an Arena: ``nbytes`` bytes at ``offset`` in ``arena`` (``address`` here).
    What a shared CPU record owns (``Allocation.owner``); it goes back to its arena when
    the registry frees the record, after its last holder in any process."""

    __slots__ = ("arena", "offset", "nbytes", "address", "size_class")

    def __init__(self, arena: "Arena", offset: int, nbytes: int, size_class: int) -> None:
        self.arena, self.offset, self.nbytes, self.size_class = arena, offset, nbytes, size_class
        self.address = arena.memory.address + offset

    @property
    def readonly(self) -> bool:
        return self.arena.readonly

    def close(self) -> None:
        """Give the block back to its arena (once; never raises)."""
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.put_back(self)

    def __repr__(self) -> str:
        return f"Block(arena #{self.arena.id if self.arena else '-'}, offset={self.offset}, nbytes={self.nbytes})"


class Arena:
    """A large SharedMemory of this process that shared CPU tensors are carved from
    (``tx.empty(..., shared=True)``, the copies ``tx.share`` and the multiprocessing
    reducer make). A receiver maps a whole arena once (exchange/sharing/) and keeps it;
    it can then read every block in it, and write every block of a writable arena.

    ``readonly``: an arena of read-only blocks, sealed against writes
    (``F_SEAL_FUTURE_WRITE``) right after this process mapped it writable: no other
    process can map it writable, and this process fills a block before handing it on.
    Blocks of size class ``c`` (a power of two, bytes) are carved at offsets that are
    multiples of ``c`` (page-aligned from 4 KiB up); a freed block waits in its class's
    free list for the next allocation of that class (the memory stays touched: no
    first-touch cost again). An arena of one large block (``dedicated``) holds one
    allocation above ``Arenas.SMALL_MAX`` and is kept for a later one of its size class."""

    __slots__ = ("id", "memory", "readonly", "pid", "top", "dedicated", "in_use", "__weakref__")

    def __init__(self, aid: int, nbytes: int, readonly: bool, dedicated: bool) -> None:
        self.memory = SharedMemory.create(nbytes, readonly=readonly)  # sealed against shrinking and growing
        if readonly:
            try:  # this mapping stays writable: this process fills each block before it goes out
                self.memory.seal_future_writes()
            except BaseException:
                self.memory.close()
                raise
        self.id, self.readonly, self.dedicated = aid, readonly, dedicated
        self.pid = os.getpid()  # a forked child's copy is not its to carve
        self.top = 0  # bytes carved so far
        self.in_use = 0  # blocks out

    def put_back(self, block: Block) -> None:
        ARENAS.put_back(self, block)


def _size_class(nbytes: int) -> int:
    return 1 << max(6, (max(1, nbytes) - 1).bit_length())  # at least 64 bytes (ALIGNMENT)


class Arenas:
    """This process's arenas and their free blocks (one lock; allocation and free are
    O(1): a free list per size class, and a bump in the newest arena of its kind).

    ``ARENA_BYTES`` (64 MiB): an arena of small blocks (address space: pages are touched
    as blocks are written). ``SMALL_MAX`` (4 MiB): larger allocations get a dedicated
    arena, rounded up to a power of two too (address space: pages beyond what is written
    cost nothing); up to ``CACHE_BYTES`` (1 GiB) of dedicated arenas freed here wait for
    an allocation of the same size class, the oldest closed beyond that. Freed blocks of
    small arenas stay in their size class for reuse (never split nor merged, nor given
    back to the system while the process lives): ``stats()`` says how much there is."""

    ARENA_BYTES = 64 << 20
    SMALL_MAX = 4 << 20
    CACHE_BYTES = 1 << 30

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.by_id: dict[int, Arena] = {}
        self.free: dict[tuple[int, bool], list[tuple[Arena, int]]] = {}  # (size class, readonly) -> (arena, offset)
        self.current: dict[bool, Arena] = {}  # readonly -> the small arena being carved
        self.cached: "collections.OrderedDict[tuple[int, bool], list[Arena]]" = collections.OrderedDict()
        self.cached_bytes = 0

    def allocate(self, nbytes: int, readonly: bool = False) -> Block:
        """A block of at least ``nbytes`` bytes (uninitialised: zero in a new arena, the
        last contents in a reused block). OSError when the system refuses memory."""
        size = _size_class(nbytes)
        if size > self.SMALL_MAX:
            return self._dedicated(nbytes, size, readonly)
        with self.lock:
            free = self.free.get((size, readonly))
            if free:
                arena, offset = free.pop()
                arena.in_use += 1
                return Block(arena, offset, nbytes, size)  # a new object: an old one's close() does nothing
            arena = self.current.get(readonly)
            if arena is None or arena.top + size > arena.memory.nbytes:
                arena = self._new(self.ARENA_BYTES, readonly, False)
                self.current[readonly] = arena
            offset = (arena.top + size - 1) // size * size
            arena.top = offset + size
            arena.in_use += 1
            return Block(arena, offset, nbytes, size)

    def _dedicated(self, nbytes: int, size: int, readonly: bool) -> Block:
        # An arena of the whole size class (a power of two, past SMALL_MAX: whole pages),
        # so that a freed one serves any later request of its class, not only one of
        # exactly its page count.
        with self.lock:
            kept = self.cached.get((size, readonly))
            if kept:
                arena = kept.pop()
                if not kept:
                    del self.cached[(size, readonly)]
                self.cached_bytes -= size
            else:
                arena = self._new(size, readonly, True)
            arena.in_use = 1
            return Block(arena, 0, nbytes, size)

    def _new(self, nbytes: int, readonly: bool, dedicated: bool) -> Arena:
        arena = Arena(next(self.ids), nbytes, readonly, dedicated)
        self.by_id[arena.id] = arena
        return arena

    def put_back(self, arena: Arena, block: Block) -> None:
        """A freed block goes back to its arena (the registry's free, on any thread,
        at any time: never raises). A forked child's blocks of its parent's arenas are
        dropped: those arenas are the parent's to carve."""
        try:
            if arena.pid != os.getpid():
                return
            with self.lock:
                arena.in_use -= 1
                if not arena.dedicated:  # ready to hand out again
                    self.free.setdefault((block.size_class, arena.readonly), []).append((arena, block.offset))
                    return
                key = (block.size_class, arena.readonly)
                self.cached.setdefault(key, []).append(arena)
                self.cached.move_to_end(key)
                self.cached_bytes += block.size_class
                while self.cached_bytes > self.CACHE_BYTES and self.cached:  # the oldest go
                    old_key, kept = next(iter(self.cached.items()))
                    oldest = kept.pop(0)
                    if not kept:
                        del self.cached[old_key]
                    self.cached_bytes -= oldest.memory.nbytes
                    del self.by_id[oldest.id]
                    oldest.memory.close()  # (receivers unmap it once idle)
        except Exception:
            pass

    def stats(self) -> dict[str, int]:
        """``arenas`` (this process's), ``bytes`` (their size), ``blocks_in_use`` (blocks
        handed out and not yet freed, in any process), ``cached_bytes`` (dedicated arenas
        waiting for reuse)."""
        with self.lock:
            mine = [a for a in self.by_id.values() if a.pid == os.getpid()]
            return {"arenas": len(mine), "bytes": sum(a.memory.nbytes for a in mine),
                    "blocks_in_use": sum(a.in_use for a in mine), "cached_bytes": self.cached_bytes}

    def after_fork_in_child(self) -> None:
        # The parent's arenas stay mapped here for the records the child inherited; new
        # blocks come from the child's own arenas (two processes carving one arena would
        # hand out the same bytes twice).
        self.lock = threading.Lock()
        self.free, self.current, self.cached, self.cached_bytes = {}, {}, collections.OrderedDict(), 0


ARENAS = Arenas()
register("after_fork_in_child", "channels.memfd.arenas", ARENAS.after_fork_in_child, DEVICES)


def arena_stats() -> dict[str, int]:
    """This process's shared-memory arenas (``Arenas.stats``)."""
    return ARENAS.stats()
