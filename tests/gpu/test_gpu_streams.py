"""CUDA streams and events: the DLPack stream table, stream objects of other libraries,
record / wait / query / synchronize."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import BLOCK, GRID, SPIN_NS, busy, cupy_stream

CUDA0 = tx.Device.parse("cuda:0")


def test_stream_table(cuda):
    legacy = cuda.stream_from_dlpack(None, CUDA0)
    assert legacy.handle == 1 and cuda.stream_from_dlpack(1, CUDA0) is legacy
    assert cuda.stream_from_dlpack(2, CUDA0).handle == 2
    assert cuda.stream_from_dlpack(-1, CUDA0) is None
    with pytest.raises(ValueError, match="ambiguous"):
        cuda.stream_from_dlpack(0, CUDA0)
    s = tx.create_stream("cuda:0")
    assert s.handle > 2 and s.device == CUDA0
    wrapped = cuda.stream_from_dlpack(s.handle, CUDA0)
    assert wrapped.handle == s.handle and wrapped.device == CUDA0
    assert cuda.to_dlpack_stream(None, CUDA0) == 1
    assert cuda.to_dlpack_stream(s, CUDA0) == s.handle
    assert cuda.to_dlpack_stream(legacy, CUDA0) == 1


def test_record_query_synchronize(cuda):
    s = tx.create_stream("cuda")
    event = s.record()
    event.synchronize()
    assert event.query()
    s.synchronize()
    cuda.default_stream(CUDA0).synchronize()


def test_wait_orders_streams_without_blocking_the_host(cp, kernels):
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    out = cp.zeros(1024, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()  # the zeros are written on the NULL stream
    with cupy_stream(cp, a):
        kernels["spin_then_fill"](GRID, BLOCK, (out, np.int64(out.size), np.uint64(SPIN_NS), np.float32(1.0)))
    b.wait(a.record())  # returns at once: the host is not blocked
    assert busy(a), "the spin kernel finished before the host could look: the test cannot tell order"
    assert busy(b), "stream b did not wait for stream a's event"
    b.synchronize()
    assert not busy(a)
    assert float(out[5].get()) == 6.0


def test_as_stream_accepts_stream_objects(cuda, cp):
    ours = tx.create_stream("cuda:0")
    assert cuda.as_stream(ours, CUDA0) is ours
    assert cuda.as_stream(ours.handle, CUDA0).handle == ours.handle
    assert cuda.as_stream(1, CUDA0).handle == 1
    with pytest.raises(ValueError):
        cuda.as_stream(-1, CUDA0)
    with pytest.raises(ValueError):
        cuda.as_stream(0, CUDA0)
    with pytest.raises(TypeError):
        cuda.as_stream(object(), CUDA0)
    # cuda.core's own stream
    core = ours.core
    assert cuda.as_stream(core, CUDA0).handle == ours.handle
    # CuPy streams (their __cuda_stream__, or .ptr)
    cs = cp.cuda.Stream(non_blocking=True)
    assert cuda.as_stream(cs, CUDA0).handle == cs.ptr
    assert cuda.as_stream(cp.cuda.Stream.null, CUDA0).handle == 1  # the NULL stream is the legacy one
    # tx.empty / tx.from_dlpack take them too
    t = tx.empty((4,), device="cuda:0", stream=cs)
    assert t.stream.handle == cs.ptr


def test_as_stream_accepts_torch_streams(cuda, torch_cuda):
    torch = torch_cuda
    ts = torch.cuda.Stream(device=0)
    wrapped = cuda.as_stream(ts, CUDA0)
    assert wrapped.handle == ts.cuda_stream
    assert wrapped.device == CUDA0
    assert cuda.as_stream(torch.cuda.default_stream(0), CUDA0).handle == 1


def test_our_stream_works_in_other_libraries(cp, torch_cuda):
    s = tx.create_stream("cuda:0")
    assert s.__cuda_stream__() == (0, s.handle)
    with cupy_stream(cp, s):
        x = cp.arange(10, dtype=cp.float32) * 2
    s.synchronize()
    assert float(x[3].get()) == 6.0
    torch = torch_cuda
    ts = torch.cuda.ExternalStream(s.handle, device=torch.device("cuda", 0))
    with torch.cuda.stream(ts):
        y = torch.arange(4, device="cuda:0") + 1
    s.synchronize()
    assert y.cpu().tolist() == [1, 2, 3, 4]


def test_stream_of_missing_device_is_refused(cuda):
    with pytest.raises(ValueError, match="does not exist"):
        tx.empty((4,), device=f"cuda:{cuda.device_count}")
