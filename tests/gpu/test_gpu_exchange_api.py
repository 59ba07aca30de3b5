"""The DLPack C exchange API this library publishes, on device data (issue 19 item 10,
issue 17 item 8): an export from a tx stream must be read complete by a consumer.

The table's consumer (tvm-ffi, say) takes the tensor with
``managed_tensor_from_py_object_no_sync`` and asks ``current_work_stream`` which stream
the data is ready on (DLPack's "N0" contract: no synchronisation of its own). Ours answers
NULL, the legacy default stream, which does not wait for this library's non-blocking
streams by itself: the export must order the data before it. Each test writes the data
with a long kernel on a tx stream, hands it over at once, and checks the producer is
still busy when the consumer's work is queued, so a pass cannot come from the producer
having finished already.

The consumer here is ctypes over our own table (what tvm-ffi's argument setter does),
with CuPy for its kernels and its own stream. On the pure-Python path there is no table:
tvm-ffi takes a Tensor through ``__dlpack__()`` with no stream, so the same tests hand the
data over that way there and must see the same outcome.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import exchange as tx
from exchange import _dlpack_abi as abi
from exchange._core import compiled as _compiled

NATIVE = _compiled()
from gpu_helpers import BLOCK, GRID, SPIN_NS, busy, cupy_stream, raw_view

N = 1 << 20
_MANAGED_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ctypes.c_void_p))
_DLTENSOR_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(abi.DLTensor))
_CURRENT_STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))
_GET_POINTER = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _table() -> abi.DLPackExchangeAPI:
    return abi.DLPackExchangeAPI.from_address(_GET_POINTER(tx.Tensor.__dlpack_c_exchange_api__,
                                                           b"dlpack_exchange_api"))


class _Export:
    """``t`` handed to a consumer that names no stream: through the entry point of our C
    exchange API (``"managed"`` or ``"dltensor"``) where the compiled core publishes it,
    else through ``__dlpack__()`` as the pure path's tvm-ffi takes it. ``data`` is the
    address the consumer reads; ``release()`` lets go (the deleter, or the capsule)."""

    def __init__(self, t, entry: str = "managed") -> None:
        self._managed = None
        self._capsule = None
        if not NATIVE:
            self._capsule = t.__dlpack__()  # BufferError for read-only memory
            self.data = abi.DLManagedTensor.from_address(_GET_POINTER(self._capsule, b"dltensor")).dl_tensor.data
        elif entry == "managed":
            out = ctypes.c_void_p()
            assert _MANAGED_FROM_PY(_table().managed_tensor_from_py_object_no_sync)(t, ctypes.byref(out)) == 0
            self._managed = out.value
            self.data = abi.DLManagedTensorVersioned.from_address(out.value).dl_tensor.data
        else:
            dl = abi.DLTensor()
            assert _DLTENSOR_FROM_PY(_table().dltensor_from_py_object_no_sync)(t, ctypes.byref(dl)) == 0
            self.data = dl.data

    def release(self) -> None:
        if self._managed is not None:
            managed, self._managed = self._managed, None
            abi.DLManagedTensorDeleter(abi.DLManagedTensorVersioned.from_address(managed).deleter)(managed)
        self._capsule = None  # an unconsumed capsule's destructor calls our deleter


def _produce_late(cp, kernels, t, stream):
    """Zero ``t``, then after a long spin write 1 + i into it, all on ``stream``."""
    view = raw_view(cp, t)
    with cupy_stream(cp, stream):
        view.fill(0)
        kernels["spin_then_fill"](GRID, BLOCK, (view, np.int64(N), np.uint64(SPIN_NS), np.float32(1.0)))


def _over(cp, address: int, owner) -> object:
    """A CuPy float32 array of N elements at ``address`` (no DLPack, no registry)."""
    memory = cp.cuda.UnownedMemory(address, N * 4, owner, 0)
    return cp.ndarray((N,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(memory, 0))


def _work_stream(cp) -> object:
    """The stream the data is ready on, as a CuPy stream: what our table's
    current_work_stream names for cuda:0 (NULL: the legacy default stream); on the pure
    path the legacy default stream too, which ``__dlpack__()`` with no stream orders."""
    if not NATIVE:
        return cp.cuda.Stream.null
    handle = ctypes.c_void_p(1)
    assert _CURRENT_STREAM(_table().current_work_stream)(int(tx.DeviceType.kDLCUDA), 0, ctypes.byref(handle)) == 0
    if not handle.value:
        return cp.cuda.Stream.null
    return cp.cuda.ExternalStream(handle.value, 0)


def test_a_consumer_on_its_own_stream_reads_an_export_from_a_tx_stream_complete(cp, kernels, warm):
    a = tx.create_stream("cuda:0")  # non-blocking: the legacy stream does not wait for it by itself
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    assert busy(a)
    export = _Export(t)
    assert export.data == t.data_ptr
    # The consumer: its own non-blocking stream, ordered after the stream the data is
    # ready on (record there, wait here: the N0 contract), then a kernel that reads it.
    mine = cp.cuda.Stream(non_blocking=True)
    ready = cp.cuda.Event(disable_timing=True)
    ready.record(_work_stream(cp))
    mine.wait_event(ready)
    out = cp.empty(N, dtype=cp.float32)
    with mine:
        kernels["copy_f32"](GRID, BLOCK, (_over(cp, export.data, t), out, np.int64(N)))
    assert busy(a), "the producer finished before the consumer's work was queued: the test cannot tell order"
    mine.synchronize()
    expected = cp.arange(N, dtype=cp.float32) + np.float32(1.0)
    assert bool((out == expected).all()), "the consumer read the export before the tx stream's writes"
    export.release()
    assert tx.registry().stats()["exports_outstanding"] == 0
    del t


@pytest.mark.parametrize("entry", ["managed", "dltensor"])
def test_a_consumer_on_the_named_stream_reads_complete_and_the_release_waits_for_it(cp, kernels, warm, entry):
    # DLPack's N0 case: the consumer launches straight on the stream the data is ready on;
    # both entry points order the same way (one path on the pure path: __dlpack__())
    a = tx.create_stream("cuda:0")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    _produce_late(cp, kernels, t, a)
    assert busy(a)
    export = _Export(t, entry)
    work = _work_stream(cp)
    out = cp.empty(N, dtype=cp.float32)
    with work:
        kernels["copy_f32"](GRID, BLOCK, (_over(cp, export.data, t), out, np.int64(N)))
    assert busy(a), "the producer finished first: the test cannot tell order"
    work.synchronize()
    assert bool((out == cp.arange(N, dtype=cp.float32) + np.float32(1.0)).all())
    # the stream the consumer worked on joined the record: its release waits for it
    assert any(int(getattr(s, "handle", -1)) in (0, 1) for s in t.record.streams), t.record.streams
    export.release()
    del t


def test_read_only_device_memory_is_refused_to_a_consumer_that_cannot_be_told(cp):
    t = tx.empty((16,), "float32", device="cuda:0")
    with tx.borrow(t.data_ptr, shape=(16,), dtype="float32", device="cuda:0", readonly=True) as view:
        if NATIVE:
            table = _table()
            out_ptr = ctypes.c_void_p()
            with pytest.raises(BufferError, match="read-only"):
                _MANAGED_FROM_PY(table.managed_tensor_from_py_object_no_sync)(view, ctypes.byref(out_ptr))
            assert out_ptr.value is None
            with pytest.raises(BufferError, match="read-only"):
                _DLTENSOR_FROM_PY(table.dltensor_from_py_object_no_sync)(view, ctypes.byref(abi.DLTensor()))
        with pytest.raises(BufferError, match="read-only"):
            view.__dlpack__()  # what tvm_ffi.from_dlpack falls back to, and the pure path's only way
    assert tx.registry().stats()["exports_outstanding"] == 0
    del t
