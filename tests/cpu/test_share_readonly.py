"""Read-only memory is never handed out writable across processes (issue 19, item 1):
the sender decides from its own record, never from the handle, and the kernel enforces
it. CPU memory shared read-only is a memfd sealed with F_SEAL_FUTURE_WRITE: no process
can map it writable, write it, punch a hole in it or mprotect its mapping writable,
whatever descriptor it holds (a reopened /proc/self/fd/N included). Writable memory
shared read-only goes as a sealed copy.

The receiver here is this process acting as a hostile one (it looks for the memory's
descriptors and mappings itself); the sender is a worker process.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

import exchange as tx
from exchange.sharing import handle as share_handle
from exchange.tensor import Tensor
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import Worker, WorkerError, memfds

REG = tx.registry()


def _forged(h, **changes):
    return share_handle._rebuild_handle(tuple(h._f._replace(**changes)))


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def test_a_handle_forged_writable_gets_no_writable_memory():
    # Item 1: the sender trusted the handle's readonly field: flipped, the receiver mapped
    # the memory writable and the sender's read-only tensor then read [-1.0, ...].
    with Worker() as w:
        h = w.call("share_readonly", "a", 4, 1.0)
        assert h.readonly
        try:
            t = tx.attach(_forged(h, readonly=False))
        except ValueError as exc:  # a refusal is fine, so is a read-only Tensor
            assert "forged" in str(exc), exc
        else:
            a = np.from_dlpack(t)
            assert t.readonly and not a.flags.writeable, "a forged handle got writable memory"
            del a, t
        assert w.call("values", "a") == [1.0, 2.0, 3.0, 4.0]


def test_a_handle_forged_writable_gets_no_writable_view_in_the_sending_process_either():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    h = tx.share(tx.from_dlpack(a))
    try:
        t = tx.attach(_forged(h, readonly=False))
    except ValueError as exc:
        assert "forged" in str(exc), exc
    else:
        assert t.readonly, "a forged handle got a writable view"
        del t
    h.close()


def test_a_receiver_cannot_make_read_only_memory_writable():
    # Item 1: the descriptor a receiver got was opened read-write (fdinfo flags 0100002):
    # even an honest receiver's memory could be remapped writable. Here every way a
    # process holding the descriptor and the mapping could write is tried.
    with Worker() as w:
        h = w.call("share_readonly", "a", 1024, 1.0)
        before = set(memfds())
        t = tx.attach(h)
        assert t.readonly and not np.from_dlpack(t).flags.writeable
        fds = sorted(set(memfds()) - before)
        assert len(fds) == 1
        fd, size = fds[0], os.fstat(fds[0]).st_size
        libc = _libc()
        refused = {}
        for how in ("mmap", "reopened /proc/self/fd"):
            target = fd if how == "mmap" else os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                m = mmap.mmap(target, size)  # shared, writable
            except OSError as exc:
                refused[how] = exc.errno
            else:
                m[0:4] = np.float32(-1.0).tobytes()
                m.close()
            for what, call in (("write", lambda: os.pwrite(target, b"\0\0\x80\xbf", 0)),
                               ("punch a hole", lambda: _check(libc.fallocate(target, 3, 0, size)))):
                try:
                    call()
                except OSError as exc:
                    refused[f"{what} ({how})"] = exc.errno
            if target != fd:
                os.close(target)
        # the mapping itself: mprotect to writable
        if libc.mprotect(ctypes.c_void_p(t.record.address & ~4095), 4096, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            refused["mprotect"] = ctypes.get_errno()
        assert w.call("values", "a")[:2] == [1.0, 2.0], "a receiver wrote read-only memory"
        assert refused == {"mmap": errno.EPERM, "reopened /proc/self/fd": errno.EPERM,
                           "write (mmap)": errno.EPERM, "write (reopened /proc/self/fd)": errno.EPERM,
                           "punch a hole (mmap)": errno.EPERM, "punch a hole (reopened /proc/self/fd)": errno.EPERM,
                           "mprotect": errno.EACCES}, refused
        del t


def _check(rc: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _readonly_view(t):
    return Tensor._make(t.record, t.data_ptr, t.shape, t.strides, t.dtype, True)


def test_writable_memory_shared_read_only_goes_as_a_sealed_copy():
    t = tx.empty(8, "float32", shared=True)
    np.from_dlpack(t)[:] = 3.0
    view = _readonly_view(t)
    with pytest.raises(BufferError, match="read-only.*writable shared memory.*copy"):
        tx.share(view, copy=False)
    created = REG.created_total
    h = tx.share(view)
    assert REG.created_total == created + 1, "a copy"
    assert h.readonly
    with Worker() as w:
        info = w.call("attach", "a", h)
        assert info["readonly"]
        np.from_dlpack(t)[:] = 4.0  # the sender still writes its own memory...
        assert w.call("read", "a", 0) == 3.0  # ...which is not what the receiver maps
        with pytest.raises(WorkerError, match="read-only"):
            w.call("write", "a", 0, 5.0)
        w.call("drop", "a")
    del view, t, h


def test_read_only_memory_of_an_arena_is_shared_on_as_a_sealed_copy():
    with Worker() as sender, Worker() as middle, Worker() as last:
        h = sender.call("share_readonly", "a", 8, 1.0)  # a copy in the sender's sealed arena
        middle.call("attach", "a", h)
        h2 = middle.call("share_held", "a")  # the sender's arena goes to nobody else: a copy, sealed too
        assert h2.readonly and h2.pid == middle.pid and middle.call("stats")["created_total"] == 2
        info = last.call("attach", "a", h2)
        assert info["readonly"] and last.call("read", "a", 7) == 8.0
        with pytest.raises(WorkerError, match="read-only"):
            last.call("write", "a", 0, 5.0)


def test_read_only_memory_a_receiver_attached_is_shared_on_as_it_is():
    with Worker() as sender, Worker() as middle, Worker() as last:
        h = sender.call("share_readonly", "a", 8, 1.0, True)  # sealed memory of its own
        middle.call("attach", "a", h)
        h2 = middle.call("share_held", "a")  # sealed already: no copy needed, none made
        assert h2.readonly and middle.call("stats")["created_total"] == 1
        info = last.call("attach", "a", h2)
        assert info["readonly"] and last.call("read", "a", 7) == 8.0
        with pytest.raises(WorkerError, match="read-only"):
            last.call("write", "a", 0, 5.0)
