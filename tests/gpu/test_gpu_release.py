"""Stream-ordered release on CUDA: when the last holder goes while a kernel on another
stream still reads the memory, the memory is neither freed nor reused until that
kernel has finished. EXCHANGE_DEBUG_POISON=1 makes the backend fill memory with a
pattern on the free stream just before freeing it, so an early free shows up as the
pattern in what the reader copied out."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import exchange as tx
from devices.base import Allocation
from devices.cuda import POISON_BYTE, POISON_ENV
from gpu_helpers import BLOCK, GRID, SPIN_NS, busy, cupy_stream, raw_view

N = 1 << 20


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setenv(POISON_ENV, "1")


def _filled(cp, stream, base=7.0):
    t = tx.empty((N,), "float32", device="cuda:0", stream=stream)
    view = raw_view(cp, t)
    with cupy_stream(cp, stream):
        view[...] = cp.arange(N, dtype=cp.float32) + np.float32(base)
    del view
    return t


def _scribble(cp, stream):
    """Allocate what a premature free would hand out again, and overwrite it."""
    u = tx.empty((N,), "float32", device="cuda:0", stream=stream)
    view = raw_view(cp, u)
    with cupy_stream(cp, stream):
        view.fill(-1.0)
    del view
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


def test_release_waits_for_cupy_consumer_kernel(cp, kernels, poison):
    a = tx.create_stream("cuda:0")
    b = cp.cuda.Stream(non_blocking=True)
    t = _filled(cp, a)
    a.synchronize()
    out = cp.empty(N, dtype=cp.float32)
    with b:
        arr = cp.from_dlpack(t)  # b joins the record's streams
        kernels["spin_then_copy"](GRID, BLOCK, (arr, out, np.int64(N), np.uint64(SPIN_NS)))
    record = t.record
    del arr, t  # the last holders go while the kernel on b still spins
    gc.collect()
    assert record.state == "releasing", f"released with a reader still running (state {record.state})"
    assert tx.registry().stats()["pending_releases"] >= 1
    u = _scribble(cp, a)
    assert not b.done, "the reader finished before the release: the test cannot tell order"
    b.synchronize()
    expected = cp.arange(N, dtype=cp.float32) + np.float32(7.0)
    assert bool((out == expected).all()), "the reader saw poisoned or reused memory"
    assert tx.registry().collect(timeout=10)
    assert record.state == "released"
    del u


def test_release_waits_for_record_stream(cp, kernels, poison):
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = _filled(cp, a)
    a.synchronize()
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N), np.uint64(SPIN_NS)))
    tx.record_stream(t, b)  # as torch's record_stream: the release must wait for b
    record = t.record
    del t
    gc.collect()
    assert record.state == "releasing"
    u = _scribble(cp, a)
    assert busy(b)
    b.synchronize()
    assert bool((out == cp.arange(N, dtype=cp.float32) + np.float32(7.0)).all())
    assert tx.registry().collect(timeout=10)
    del u


def test_release_waits_for_torch_consumer(cp, kernels, torch_cuda, poison):
    torch = torch_cuda
    a = tx.create_stream("cuda:0")
    t = _filled(cp, a)
    a.synchronize()
    ts = torch.cuda.Stream(device=0)
    out = cp.empty(N, dtype=cp.float32)
    with torch.cuda.stream(ts):
        y = torch.from_dlpack(t)  # ts joins the record's streams
    with cupy_stream(cp, _as_tx(ts)):  # a reader on torch's stream, as a torch kernel would be
        kernels["spin_then_copy"](GRID, BLOCK, (np.uint64(y.data_ptr()), out, np.int64(N), np.uint64(SPIN_NS)))
    record = t.record
    del y, t
    gc.collect()
    assert record.state == "releasing"
    u = _scribble(cp, a)
    ts.synchronize()
    assert bool((out == cp.arange(N, dtype=cp.float32) + np.float32(7.0)).all())
    assert tx.registry().collect(timeout=10)
    del u


def _as_tx(torch_stream):
    from devices.base import get_backend

    return get_backend(tx.DeviceType.kDLCUDA).as_stream(torch_stream, tx.Device.parse("cuda:0"))


def test_release_without_readers_completes_and_balances(cp):
    before = tx.registry().stats()
    with tx.track():
        s = tx.create_stream("cuda:0")
        t = tx.empty((1000,), "float64", device="cuda:0", stream=s)
        assert tx.registry().stats()["live_bytes"].get("cuda:0", 0) >= 8000
        del t
    after = tx.registry().stats()
    assert after["live_bytes"].get("cuda:0", 0) == before["live_bytes"].get("cuda:0", 0)


def test_imported_cupy_memory_outlives_the_producer_until_readers_finish(cp, kernels):
    """An import's producer deleter (CuPy's) runs only after our consumers' streams are done."""
    b = tx.create_stream("cuda:0")
    x = cp.arange(N, dtype=cp.float32) + np.float32(7.0)
    cp.cuda.Stream.null.synchronize()
    t = tx.from_dlpack(x, stream=b)
    del x  # CuPy's array is gone; our import keeps its memory
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["spin_then_copy"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N), np.uint64(SPIN_NS)))
    record = t.record
    del t
    gc.collect()
    assert record.state == "releasing"
    junk = cp.full(N, -1.0, dtype=cp.float32)  # CuPy's pool would hand the block out again
    assert busy(b)
    b.synchronize()
    assert bool((out == cp.arange(N, dtype=cp.float32) + np.float32(7.0)).all())
    assert tx.registry().collect(timeout=10)
    del junk
