"""``tx.borrow``: a scoped, non-owning, checked view of memory that has no deleter.

The story (apache/tvm#13678): TVM's ``NDArray::FromExternalDLTensor`` wrapped external
memory with no lifetime tracking; a function that pushed the result into a container
that outlived the call left the container reading freed memory. Here that function
fails loudly (the view closes, the scope exit names who still holds the memory), and
the managed way in (``tx.from_dlpack`` of a tensor with a deleter) stays valid and
correct after the producer object is gone.
"""

from __future__ import annotations

import array
import ctypes
import gc

import numpy as np
import pytest

import exchange as tx
from exchange import _dlpack_abi as abi
from lifetime_helpers import CountingProducer, no_leaks


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


def _closed(view: tx.Tensor) -> None:
    """Every use of a closed view raises LifetimeError."""
    for use in (lambda: view.shape, lambda: view.strides, lambda: view.dtype, lambda: view.data_ptr,
                lambda: view.device, lambda: view.nbytes, lambda: view.record, lambda: view.readonly,
                lambda: view.__dlpack__(max_version=(1, 3)), lambda: view.__dlpack_device__(),
                lambda: np.from_dlpack(view), lambda: tx.from_dlpack(view),
                lambda: tx.from_dlpack(view, copy=True), lambda: view.numpy()):
        with pytest.raises(tx.LifetimeError, match="borrow"):
            use()
    assert "closed" in repr(view)


# -- the three sources ----------------------------------------------------------------------
def test_borrow_an_address_with_shape_and_dtype(reg):
    external = np.arange(12, dtype=np.float32)
    with tx.borrow(external.ctypes.data, shape=(3, 4), dtype="float32") as view:
        assert view.shape == (3, 4) and view.strides == (4, 1)
        assert view.dtype.name == "float32" and view.device == tx.Device.parse("cpu")
        assert view.data_ptr == external.ctypes.data and not view.readonly
        a = np.from_dlpack(view)
        np.testing.assert_array_equal(a, external.reshape(3, 4))
        a[1, 2] = -1  # writes go to the external memory
        del a
    assert external[6] == -1
    _closed(view)


def test_borrow_an_address_with_strides_and_a_device(reg):
    external = np.arange(12, dtype=np.int64)
    with tx.borrow(external.ctypes.data, shape=(4, 3), dtype="int64", strides=(1, 4)) as view:
        assert view.strides == (1, 4) and not view.is_contiguous()
        np.testing.assert_array_equal(np.from_dlpack(view), external.reshape(3, 4).T)
        assert view.record.nbytes == 96
    # a device address is only described, never touched, by borrowing it
    with tx.borrow(0x7000_0000, shape=(2,), dtype="float16", device="cuda:1") as gpu_view:
        assert gpu_view.device == tx.Device.parse("cuda:1")
        assert gpu_view.__dlpack_device__() == (tx.DeviceType.kDLCUDA, 1)


def _dltensor(external: np.ndarray, *, strides: bool = True, byte_offset: int = 0):
    shape = (ctypes.c_int64 * external.ndim)(*external.shape)
    st = (ctypes.c_int64 * external.ndim)(*(s // external.itemsize for s in external.strides))
    t = abi.DLTensor()
    t.data = external.ctypes.data - byte_offset
    t.device.device_type, t.device.device_id = 1, 0
    t.ndim = external.ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 8 * external.itemsize, 1
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64)) if strides else None
    t.byte_offset = byte_offset
    return t, (shape, st)


def test_borrow_a_dltensor_by_address(reg):
    base = np.arange(20, dtype=np.float64).reshape(4, 5)
    external = base[:, 1:4]  # strided
    t, keep = _dltensor(external, byte_offset=16)
    with tx.borrow(dltensor=ctypes.addressof(t)) as view:
        assert view.shape == (4, 3) and view.strides == (5, 1)
        assert view.data_ptr == external.ctypes.data  # data + byte_offset
        np.testing.assert_array_equal(np.from_dlpack(view), external)
    _closed(view)
    compact = np.arange(6, dtype=np.float32)
    t2, keep2 = _dltensor(compact, strides=False)  # NULL strides: row-major
    with tx.borrow(dltensor=ctypes.addressof(t2)) as view2:
        assert view2.strides == (1,)
        np.testing.assert_array_equal(np.from_dlpack(view2), compact)


@pytest.mark.parametrize("make", [
    lambda: bytearray(b"\x01\x02\x03\x04"),
    lambda: array.array("d", [1.0, 2.0, 3.0]),
    lambda: np.arange(10, dtype=np.int16)[::2],  # strided
    lambda: memoryview(bytearray(8)).cast("i"),
    lambda: np.zeros((2, 3), dtype=np.complex64),
], ids=["bytearray", "array.array", "strided-numpy", "memoryview", "complex-2d"])
def test_borrow_a_buffer_protocol_object(reg, make):
    source = make()
    expected = np.array(source, copy=True)
    with tx.borrow(source) as view:
        assert view.shape == expected.shape
        np.testing.assert_array_equal(np.from_dlpack(view), expected)
        assert not view.readonly
    _closed(view)


def test_borrow_reinterprets_a_contiguous_buffer(reg):
    buf = bytearray(np.arange(6, dtype=np.float32).tobytes())
    with tx.borrow(buf, shape=(2, 3), dtype="float32") as view:
        np.testing.assert_array_equal(np.from_dlpack(view), np.arange(6, dtype=np.float32).reshape(2, 3))
    with tx.borrow(buf, dtype="float32") as flat:
        assert flat.shape == (6,)


def test_copy_inside_the_scope_outlives_it(reg):
    external = np.arange(5, dtype=np.float32)
    with tx.borrow(external.ctypes.data, shape=(5,), dtype="float32") as view:
        copy = tx.from_dlpack(view, copy=True)
    external[:] = 0
    np.testing.assert_array_equal(np.from_dlpack(copy), np.arange(5, dtype=np.float32))
    assert copy.record.origin == "allocated"
    del copy


# -- holders at scope exit ------------------------------------------------------------------
def test_exit_with_an_unreleased_export_raises_naming_it(reg):
    buf = bytearray(16)
    keep = []
    with pytest.raises(tx.LifetimeError, match=r"still held by: DLPack export #\d+"):
        with tx.borrow(buf) as view:
            rec = view.record
            keep.append(view.__dlpack__(max_version=(1, 3)))  # never consumed
    assert rec.state == "live"  # still held: not released, and the buffer is held open
    with pytest.raises(BufferError):
        buf.extend(b"x")  # a bytearray with a buffer export cannot be resized
    keep.clear()
    assert rec.state == "released"
    buf.extend(b"x")  # now it can
    _closed(view)


def test_exit_with_a_numpy_array_kept_raises_and_keeps_the_memory_open(reg):
    buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
    arrays = []
    with pytest.raises(tx.LifetimeError, match="DLPack export"):
        with tx.borrow(buf, dtype="float32") as view:
            arrays.append(np.from_dlpack(view))
            rec = view.record
    np.testing.assert_array_equal(arrays[0], np.arange(4, dtype=np.float32))
    arrays.clear()
    assert rec.state == "released"


def test_exit_with_a_tensor_kept_in_a_container_raises_and_closes_it(reg):
    external = np.arange(4, dtype=np.float32)
    box = []
    with pytest.raises(tx.LifetimeError, match="still held by: tx.Tensor"):
        with tx.borrow(external.ctypes.data, shape=(4,), dtype="float32") as view:
            box.append(tx.from_dlpack(view))
            rec = view.record
    _closed(box[0])  # the Tensor made from the view is closed with it
    assert rec.state == "live"
    box.clear()
    assert rec.state == "released"


def test_exit_names_every_holder(reg):
    buf = bytearray(8)
    keep = []
    with pytest.raises(tx.LifetimeError) as info:
        with tx.borrow(buf) as view:
            keep += [tx.from_dlpack(view), view.__dlpack__(max_version=(1, 3)), np.from_dlpack(view)]
    message = str(info.value)
    assert message.count("tx.Tensor") == 1 and message.count("DLPack export #") == 2
    keep.clear()


def test_borrow_of_an_array_made_from_our_export(reg):
    # The borrowed buffer is numpy's array over one of our exports, and the borrow is
    # its last holder: ending the scope releases the export from inside a release.
    import threading

    t = tx.empty(4, "float32")
    rec = t.record
    done = []

    def scope(a) -> None:
        with tx.borrow(a) as view:
            assert view.data_ptr == rec.address
            del a
        done.append(True)

    parts = [np.from_dlpack(t)]
    del t
    worker = threading.Thread(target=lambda: scope(parts.pop()), daemon=True)
    worker.start()
    worker.join(10)
    assert done, "ending the borrow deadlocked (a release nested in a release)"
    assert rec.state == "released"


# -- the FromExternalDLTensor story ---------------------------------------------------------
def wrap_external(store: list, *, keep_view: bool) -> None:
    """What FromExternalDLTensor invited: wrap memory someone else owns and push the
    result into a container that outlives this call."""
    external = np.arange(8, dtype=np.float64)
    with tx.borrow(external.ctypes.data, shape=(8,), dtype="float64") as view:
        store.append(view if keep_view else tx.from_dlpack(view))
    del external  # the owner frees its memory when the call returns


def wrap_managed(store: list, make) -> None:
    """The fix: take a managed tensor (one with a deleter) with tx.from_dlpack."""
    producer = make()
    store.append(tx.from_dlpack(producer))
    del producer


def test_story_wrapping_external_memory_fails_loudly_at_the_scope_exit(reg):
    store: list = []
    with pytest.raises(tx.LifetimeError, match="still held by: tx.Tensor"):
        wrap_external(store, keep_view=False)
    with pytest.raises(tx.LifetimeError):
        np.from_dlpack(store[0])  # never a read of freed memory
    store.clear()


def test_story_keeping_the_view_itself_fails_loudly_at_first_use(reg):
    store: list = []
    wrap_external(store, keep_view=True)
    with pytest.raises(tx.LifetimeError, match="scope has ended"):
        store[0].data_ptr
    with pytest.raises(tx.LifetimeError):
        np.from_dlpack(store[0])
    store.clear()


@pytest.mark.parametrize("producer", ["numpy", "torch", "capsule"])
def test_story_managed_tensor_stays_valid_after_the_producer_is_gone(reg, producer):
    expected = np.arange(8, dtype=np.float64)
    counting = None
    if producer == "numpy":
        def make():
            return np.arange(8, dtype=np.float64)
    elif producer == "torch":
        torch = pytest.importorskip("torch")

        def make():
            return torch.arange(8, dtype=torch.float64)
    else:
        counting = CountingProducer(8)

        def make():
            return counting.capsule()

    store: list = []
    wrap_managed(store, make)
    gc.collect()
    churn = [np.full(8, -1.0) for _ in range(1000)]  # reuse any memory that was freed
    del churn
    np.testing.assert_array_equal(np.from_dlpack(store[0]), expected)
    assert store[0].record.state == "live"
    if counting is not None:
        assert counting.calls == 0
    store.clear()
    if counting is not None:
        assert counting.calls == 1


# -- bad input ------------------------------------------------------------------------------
def test_shape_that_does_not_fit_the_buffer(reg):
    buf = bytearray(16)
    with pytest.raises(ValueError, match="needs 32 bytes but the buffer holds 16"):
        with tx.borrow(buf, shape=(4,), dtype="float64"):
            pass  # pragma: no cover
    with tx.borrow(buf, shape=(2,), dtype="float32", strides=(3,)) as fits:  # bytes 0-4 and 12-16
        assert fits.record.nbytes == 16
    with pytest.raises(ValueError, match="needs 20 bytes"):
        with tx.borrow(buf, shape=(2,), dtype="float32", strides=(4,)):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="strides"):
        with tx.borrow(buf, shape=(2, 2), dtype="float32", strides=(1,)):
            pass  # pragma: no cover


def test_negative_extent(reg):
    external = np.zeros(4)
    with pytest.raises(ValueError, match="negative extent"):
        with tx.borrow(external.ctypes.data, shape=(2, -1), dtype="float64"):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="negative extent"):
        with tx.borrow(bytearray(8), shape=(-2,), dtype="uint8"):
            pass  # pragma: no cover


def test_read_only_buffer_cannot_be_written_through(reg):
    data = bytes(np.arange(4, dtype=np.float32).tobytes())
    with tx.borrow(data, dtype="float32") as view:
        assert view.readonly
        a = np.from_dlpack(view)
        assert not a.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 5.0
        with pytest.raises(BufferError, match="read-only"):
            view.__dlpack__()  # a legacy capsule cannot say "read-only"
        with pytest.raises(BufferError):
            view.__dlpack__(max_version=(0, 8))
        del a
    assert data == np.arange(4, dtype=np.float32).tobytes()
    with pytest.raises(ValueError, match="read-only"):
        with tx.borrow(data, readonly=False):
            pass  # pragma: no cover
    # an address can be declared read-only too
    external = np.zeros(2)
    with tx.borrow(external.ctypes.data, shape=(2,), dtype="float64", readonly=True) as ro:
        assert ro.readonly
        assert not np.from_dlpack(ro).flags.writeable


def test_sources_of_no_known_kind(reg):
    with pytest.raises(TypeError, match="cannot borrow"):
        with tx.borrow("not memory"):
            pass  # pragma: no cover
    with pytest.raises(TypeError, match="shape= and dtype="):
        with tx.borrow(1234):
            pass  # pragma: no cover
    with pytest.raises(TypeError, match="either"):
        with tx.borrow(bytearray(4), dltensor=1234):
            pass  # pragma: no cover


def test_an_error_inside_the_scope_still_closes_the_view(reg):
    with pytest.raises(KeyError):
        with tx.borrow(bytearray(4)) as view:
            raise KeyError("inside")
    _closed(view)
