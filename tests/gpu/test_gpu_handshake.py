"""The producer/consumer stream handshake: a long kernel writes on stream A, the
consumer takes the data on stream B at once and reads it with a kernel on B; B must
see the written values. Each test first checks that A is still busy when the consumer
starts, so a pass cannot come from the producer having simply finished already."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import BLOCK, GRID, SPIN_NS, busy, cupy_stream, raw_view

N = 1 << 20


def _expected(cp, base=1.0):
    return cp.arange(N, dtype=cp.float32) + np.float32(base)


def _produce_late(cp, kernels, t, stream):
    """Zero ``t`` and then, after a long spin, write base + i into it, all on ``stream``."""
    view = raw_view(cp, t)
    with cupy_stream(cp, stream):
        view.fill(0)
        kernels["spin_then_fill"](GRID, BLOCK, (view, np.int64(N), np.uint64(SPIN_NS), np.float32(1.0)))


def test_cupy_consumer_waits_for_producer(cp, kernels):
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    assert busy(a)
    with cupy_stream(cp, b):
        arr = cp.from_dlpack(t)  # CuPy passes b's handle: b must wait for a
        out = cp.empty_like(arr)
        kernels["copy_f32"](GRID, BLOCK, (arr, out, np.int64(N)))
    assert busy(a), "producer finished during the import: the test cannot tell order"
    b.synchronize()
    assert bool((out == _expected(cp)).all()), "the consumer read before the producer's writes"


def test_tx_view_on_another_stream_waits(cp, kernels):
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    v = tx.from_dlpack(t, stream=b)  # a view ordered on b
    assert v.stream is b and v.data_ptr == t.data_ptr
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["copy_f32"](GRID, BLOCK, (raw_view(cp, v), out, np.int64(N)))
    assert busy(a)
    b.synchronize()
    assert bool((out == _expected(cp)).all())


def test_tx_consumer_of_cupy_producer(cp, kernels):
    """CuPy produces on its stream A; tx imports with stream B (our to_dlpack_stream),
    so CuPy must make B wait for A."""
    a = cp.cuda.Stream(non_blocking=True)
    b = tx.create_stream("cuda:0")
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()  # the zeros are written on the NULL stream
    with a:
        kernels["spin_then_fill"](GRID, BLOCK, (x, np.int64(N), np.uint64(SPIN_NS), np.float32(1.0)))
        t = tx.from_dlpack(x, stream=b)  # exported while A is CuPy's current stream
    assert t.stream is b and t.data_ptr == x.data.ptr
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, b):
        kernels["copy_f32"](GRID, BLOCK, (raw_view(cp, t), out, np.int64(N)))
    assert not a.done, "producer finished during the import: the test cannot tell order"
    b.synchronize()
    assert bool((out == _expected(cp)).all())


def test_torch_consumer_waits_for_producer(cp, kernels, torch_cuda):
    torch = torch_cuda
    a = tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    ts = torch.cuda.Stream(device=0)
    with torch.cuda.stream(ts):
        y = torch.from_dlpack(t)  # PyTorch passes its current stream
        z = y * 1  # a kernel on ts
    assert y.data_ptr() == t.data_ptr
    assert busy(a)
    ts.synchronize()
    assert torch.equal(z, torch.arange(N, dtype=torch.float32, device="cuda:0") + 1)


def test_stream_minus_one_skips_the_handshake_and_zero_is_refused(cp):
    a = tx.create_stream("cuda:0")
    t = tx.empty((8,), "float32", device="cuda:0", stream=a)
    capsule = t.__dlpack__(stream=-1, max_version=(1, 3))
    del capsule
    with pytest.raises(ValueError, match="ambiguous"):
        t.__dlpack__(stream=0)
    a.synchronize()


def test_default_stream_consumer(cp, kernels):
    """A consumer on the legacy default stream (stream=None / 1) still waits for a
    non-blocking producer stream, which the legacy stream would not do by itself."""
    a = tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    arr = cp.from_dlpack(t)  # CuPy's current stream is the NULL stream: it passes 1
    out = cp.empty_like(arr)
    kernels["copy_f32"](GRID, BLOCK, (arr, out, np.int64(N)))
    assert busy(a)
    cp.cuda.Stream.null.synchronize()
    assert bool((out == _expected(cp)).all())


# -- the producer's current stream, no stream given (#7: tx passes stream=1) -------------------------
def _read_on_host(t):
    """What ``t`` holds, copied out on the legacy default stream (the stream a
    ``tx.from_dlpack`` without ``stream=`` orders its import on)."""
    return tx.from_dlpack(t, device="cpu").numpy()


def test_torch_producer_on_a_side_stream_without_a_stream_argument(cp, kernels, torch_cuda):
    """A torch tensor written by a long kernel on torch's current (side) stream, imported
    with ``tx.from_dlpack(x)`` and no stream: tx asks ``__dlpack__(stream=1)``, so torch
    makes the legacy default stream wait for its current stream, and a read on the
    default stream sees the complete data."""
    from gpu_helpers import tx_stream

    torch = torch_cuda
    side = torch.cuda.Stream(device=0)
    x = torch.zeros(N, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        with cupy_stream(cp, tx_stream(side)):
            kernels["spin_then_fill"](GRID, BLOCK, (np.uint64(x.data_ptr()), np.int64(N), np.uint64(SPIN_NS),
                                                    np.float32(1.0)))
        t = tx.from_dlpack(x)  # side is torch's current stream here
        assert not side.query(), "the producer finished before the import: the test cannot tell order"
    assert t.data_ptr == x.data_ptr()
    np.testing.assert_array_equal(_read_on_host(t), np.arange(N, dtype=np.float32) + 1)


def test_cupy_producer_on_a_side_stream_without_a_stream_argument(cp, kernels):
    """The same with CuPy: its current stream is the side stream while tx imports with
    no stream; CuPy makes the legacy default stream (1) wait for it."""
    side = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()
    with side:
        kernels["spin_then_fill"](GRID, BLOCK, (x, np.int64(N), np.uint64(SPIN_NS), np.float32(1.0)))
        t = tx.from_dlpack(x)
    assert not side.done, "the producer finished before the import: the test cannot tell order"
    assert t.data_ptr == x.data.ptr
    np.testing.assert_array_equal(_read_on_host(t), np.arange(N, dtype=np.float32) + 1)


def test_export_to_torch_on_its_own_stream_waits_for_our_producer(cp, kernels, torch_cuda):
    """tx -> torch: our tensor is written late on stream a; torch takes it on its own
    current stream and reads it there (device-side comparison, no host copy)."""
    torch = torch_cuda
    a = tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    ts = torch.cuda.Stream(device=0)
    with torch.cuda.stream(ts):
        y = torch.from_dlpack(t)
        assert busy(a), "the producer finished before the export: the test cannot tell order"
        ok = torch.equal(y, torch.arange(N, dtype=torch.float32, device="cuda:0") + 1)  # a sync on ts
    assert y.data_ptr() == t.data_ptr
    assert ok, "torch read before our producer's writes"


def test_export_to_cupy_on_its_own_stream_waits_for_our_producer(cp, kernels):
    a = tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    b = cp.cuda.Stream(non_blocking=True)
    with b:
        arr = cp.from_dlpack(t)
        assert busy(a), "the producer finished before the export: the test cannot tell order"
        ok = bool((arr == _expected(cp)).all())  # computed on b, then read by the host
    assert arr.data.ptr == t.data_ptr
    assert ok, "CuPy read before our producer's writes"


# -- per-thread default streams of two threads (issue 31 item 7) -----------------------------------
def test_per_thread_default_streams_of_two_threads(cp, kernels):
    """Written late on one thread's per-thread default stream (handle 2), read on
    another thread's (handle 2 too, another stream): the reader's stream waits (through
    the legacy default stream, which follows every thread's per-thread stream), and the
    memory's release on the reading thread frees after the writer's work."""
    import threading

    made: dict = {}

    def produce():
        t = tx.empty((N,), "float32", device="cuda:0", stream=2)  # this thread's per-thread default stream
        _produce_late(cp, kernels, t, t.stream)
        made["t"], made["busy"] = t, busy(t.stream)

    worker = threading.Thread(target=produce)
    worker.start()
    worker.join(30)
    t = made.pop("t")
    assert made["busy"], "the producer finished before the host could look: the test cannot tell order"
    mine = tx.from_dlpack(t, stream=2)  # this thread's per-thread default stream
    assert mine.stream.handle == t.stream.handle == 2 and mine.stream is not t.stream
    out = cp.empty(N, dtype=cp.float32)
    with cupy_stream(cp, mine.stream):
        kernels["copy_f32"](GRID, BLOCK, (raw_view(cp, mine), out, np.int64(N)))
    assert busy(t.stream), "the producer finished during the import: the test cannot tell order"
    mine.stream.synchronize()
    assert bool((out == _expected(cp)).all()), "the reader's per-thread stream did not wait for the writer's"
    del mine, t
