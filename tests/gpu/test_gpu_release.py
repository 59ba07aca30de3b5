"""Stream-ordered release on CUDA: when the last holder goes while a kernel on another
stream still reads the memory, the memory is neither freed nor reused until that
kernel has finished, and the host is not blocked to make it so.

EXCHANGE_DEBUG_POISON=1 makes the backend fill memory with a pattern on the free stream
just before freeing it, so an early free shows up as the pattern in what the reader
copied out. Every window (from the drop to the reader's end) spins about 1 s
(RELEASE_SPIN_NS) and contains no kernel compile: the ``warm`` fixture compiles what
the windows use first.

Memory we allocated (``tx.empty``) may go back to its pool at once, freed in stream
order (the free stream waits for the readers' streams, then ``cuMemFreeAsync``):
then a later allocation may get the same address, but its work runs only after the
reader. Imported memory is handed back by calling the producer's deleter, which takes
no stream: that call waits until the readers' work has completed.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import exchange as tx
from exchange.devices.base import Allocation
from exchange.devices.cuda import POISON_BYTE, POISON_ENV
from gpu_helpers import BLOCK, GRID, RELEASE_SPIN_NS, busy, cupy_stream, host_syncs, raw_view, tx_stream

N = 1 << 20
SPIN = np.uint64(RELEASE_SPIN_NS)


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setenv(POISON_ENV, "1")


def _expected(cp, base=7.0):
    return cp.arange(N, dtype=cp.float32) + np.float32(base)


def _filled(cp, stream, base=7.0):
    """Our allocation on ``stream``, holding base + i once ``stream`` has run."""
    t = tx.empty((N,), "float32", device="cuda:0", stream=stream)
    view = raw_view(cp, t)
    with cupy_stream(cp, stream):
        view[...] = cp.arange(N, dtype=cp.float32) + np.float32(base)
    del view
    return t


def _scribble(cp, kernels, stream):
    """Allocate what a premature free or reuse would hand out again, and overwrite it
    with -1 on ``stream`` (a canary kernel, compiled before the window)."""
    u = tx.empty((N,), "float32", device="cuda:0", stream=stream)
    with cupy_stream(cp, stream):
        kernels["fill_f32"](GRID, BLOCK, (raw_view(cp, u), np.int64(N), np.float32(-1.0)))
    return u


def test_poison_fills_memory_on_free(cuda, cp, poison):
    """The control: the backend's free really writes the pattern (memory owned by
    CuPy, handed to free() through a non-owning cuda.core Buffer, so nothing is freed)."""
    keep = cp.zeros(4096, dtype=cp.uint8)
    cp.cuda.Stream.null.synchronize()  # the zeros are written on the NULL stream
    s = tx.create_stream("cuda:0")
    buffer = cuda._cc.Buffer.from_handle(keep.data.ptr, keep.nbytes)  # no mr, no owner: closing frees nothing
    cuda.free(Allocation(keep.data.ptr, keep.nbytes, tx.Device.parse("cuda:0"), owner=buffer), s)
    s.synchronize()
    assert bool((keep == POISON_BYTE).all())


def test_release_waits_for_cupy_consumer_kernel(cp, kernels, warm, poison):
    a = tx.create_stream("cuda:0")
    b = cp.cuda.Stream(non_blocking=True)
    t = _filled(cp, a)
    a.synchronize()
    out = cp.empty(N, dtype=cp.float32)
    with b:
        arr = cp.from_dlpack(t)  # b joins the record's streams
        kernels["spin_then_copy"](GRID, BLOCK, (arr, out, np.int64(N), SPIN))
    record = t.record
    syncs = host_syncs()
    del arr, t  # the last holders go while the kernel on b still spins
    gc.collect()
    assert record.state in ("releasing", "released"), record.state
    u = _scribble(cp, kernels, a)
    assert host_syncs() == syncs, "dropping the last holder blocked the host"
    assert not b.done, "the reader finished before the release: the test cannot tell order"
    b.synchronize()
    assert bool((out == _expected(cp)).all()), "the reader saw poisoned or reused memory"
    assert tx.registry().collect(timeout=10)
    assert record.state == "released"
    del u


def test_release_waits_for_record_stream(cp, kernels, warm, poison):
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = _filled(cp, a)
    a.synchronize()
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N), SPIN))
    tx.record_stream(t, b)  # as torch's record_stream: the release must wait for b
    record = t.record
    del t
    gc.collect()
    assert record.state in ("releasing", "released"), record.state
    u = _scribble(cp, kernels, a)
    assert busy(b)
    b.synchronize()
    assert bool((out == _expected(cp)).all())
    assert tx.registry().collect(timeout=10)
    del u


def test_release_waits_for_torch_consumer(cp, kernels, warm, torch_cuda, poison):
    torch = torch_cuda
    a = tx.create_stream("cuda:0")
    t = _filled(cp, a)
    a.synchronize()
    ts = torch.cuda.Stream(device=0)
    out = cp.empty(N, dtype=cp.float32)
    with torch.cuda.stream(ts):
        y = torch.from_dlpack(t)  # ts joins the record's streams
    with cupy_stream(cp, tx_stream(ts)):  # a reader on torch's stream, as a torch kernel would be
        kernels["spin_then_copy"](GRID, BLOCK, (np.uint64(y.data_ptr()), out, np.int64(N), SPIN))
    record = t.record
    del y, t
    gc.collect()
    assert record.state in ("releasing", "released"), record.state
    u = _scribble(cp, kernels, a)
    assert not ts.query(), "the reader finished before the release: the test cannot tell order"
    ts.synchronize()
    assert bool((out == _expected(cp)).all())
    assert tx.registry().collect(timeout=10)
    del u


def test_own_allocation_is_not_reused_before_the_reader_ends(cp, kernels, warm):
    """Our allocation, freed in stream order once its last holder goes, may be handed out
    again at once, but the new owner's work (a canary kernel writing -1) runs only after
    the reader: what the reader copied is the original data. No poison here: this is the
    pool's own ordering."""
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = _filled(cp, a)
    address = t.data_ptr
    out = cp.empty(N, dtype=cp.float32)
    b.wait(a.record())
    v = tx.from_dlpack(t, stream=b)  # a view ordered on b: b joins the record
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, v), out, np.int64(N), SPIN))
    syncs = host_syncs()
    del t, v  # the last holders: the memory goes back in stream order
    reused = []
    for _ in range(4):  # the pool may hand the block out to any of these
        u = _scribble(cp, kernels, a)
        reused.append(u)
    assert host_syncs() == syncs, "the stream-ordered free blocked the host"
    assert busy(b), "the reader finished before the canaries were queued: the test cannot tell order"
    b.synchronize()
    a.synchronize()
    assert bool((out == _expected(cp)).all()), "a later allocation overwrote memory a kernel was still reading"
    for u in reused:
        assert bool((raw_view(cp, u) == -1.0).all())
    print(f"address reused by a later allocation: {any(u.data_ptr == address for u in reused)}")
    del reused, u
    assert tx.registry().collect(timeout=10)


def test_release_without_readers_completes_and_balances(cp):
    before = tx.registry().stats()
    with tx.track():
        s = tx.create_stream("cuda:0")
        t = tx.empty((1000,), "float64", device="cuda:0", stream=s)
        assert tx.registry().stats()["live_bytes"].get("cuda:0", 0) >= 8000
        del t
    after = tx.registry().stats()
    assert after["live_bytes"].get("cuda:0", 0) == before["live_bytes"].get("cuda:0", 0)


def test_imported_cupy_memory_outlives_the_producer_until_readers_finish(cp, kernels, warm):
    """An import's producer deleter (CuPy's) runs only after our consumers' streams are
    done: the deleter frees CuPy's array, whose finalizer notes whether the reader's
    event had completed by then."""
    b = tx.create_stream("cuda:0")
    x = _expected(cp)
    cp.cuda.Stream.null.synchronize()
    t = tx.from_dlpack(x, stream=b)
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N), SPIN))
    end = b.record()
    seen: dict = {}
    freed = threading.Event()

    def on_free() -> None:  # runs in whichever thread calls CuPy's deleter
        try:
            seen["reader_done"] = end.query()
        except Exception as exc:  # shown by the assertion below
            seen["reader_done"] = repr(exc)
        freed.set()

    weakref.finalize(x, on_free)
    del x  # CuPy's array is gone from here; only the capsule we consumed holds it
    record = t.record
    syncs = host_syncs()
    del t
    gc.collect()
    assert record.state == "releasing"
    assert not freed.is_set(), "CuPy's deleter ran while a kernel still read the memory"
    junk = cp.full(N, -1.0, dtype=cp.float32)  # CuPy's pool would hand the block out again
    assert host_syncs() == syncs
    assert busy(b)
    b.synchronize()
    assert bool((out == _expected(cp)).all())
    assert tx.registry().collect(timeout=10)
    assert freed.wait(10), "CuPy's deleter never ran"
    assert seen.get("reader_done") is True, f"CuPy's deleter ran before the reader's kernel ended: {seen}"
    del junk


def test_imported_torch_memory_is_returned_only_after_the_reader(cp, kernels, warm, torch_cuda):
    """PyTorch's deleter returns its block to PyTorch's caching allocator, which knows
    nothing of our stream: it must not run before our reader has finished."""
    torch = torch_cuda
    b = tx.create_stream("cuda:0")
    x = torch.arange(N, dtype=torch.float32, device="cuda:0") + 7
    torch.cuda.synchronize()
    t = tx.from_dlpack(x, stream=b)
    held = torch.cuda.memory_allocated(0)
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N), SPIN))
    del x  # PyTorch's tensor is gone from here; our import keeps its storage
    record = t.record
    del t
    gc.collect()
    assert record.state == "releasing"
    assert torch.cuda.memory_allocated(0) == held, "PyTorch's deleter ran while a kernel still read the memory"
    junk = torch.full((N,), -1.0, device="cuda:0")  # would reuse the block if it had been returned
    assert busy(b)
    b.synchronize()
    assert bool((out == _expected(cp)).all())
    assert tx.registry().collect(timeout=10)
    assert record.state == "released"
    del junk
