"""Producing: tx.Tensor.__dlpack__ exactly as docs/design.md, "The protocol", settles it.

Every capsule is opened with ctypes (dlpack_fixtures.CapsuleView) to check its name,
version, flags, data pointer, shape, strides and dtype, not only what a consumer makes
of it.
"""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from dlpack_fixtures import IS_COPIED, READ_ONLY, Baseline, CapsuleView, array_at, hand_made

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bfloat16 and float8")

CPU = (tx.DeviceType.kDLCPU, 0)


def filled(shape, dtype="float32"):
    """A writable tx tensor of our own allocation, filled with 0, 1, 2, ..."""
    t = tx.empty(shape, dtype)
    np.from_dlpack(t)[...] = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return t


def readonly_tensor(shape=(2, 3)):
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    a.flags.writeable = False
    t = tx.from_dlpack(a)
    assert t.readonly
    return t, a


# -- legacy or versioned -------------------------------------------------------------------
@pytest.mark.parametrize("max_version", [None, (0, 0), (0, 8)])
def test_legacy_capsule_for_none_or_major_zero(max_version):
    base = Baseline()
    t = filled((2, 3))
    cap = t.__dlpack__(max_version=max_version)
    v = CapsuleView(cap)
    assert v.name == "dltensor"
    assert v.data == t.data_ptr and v.byte_offset == 0
    assert v.device == (1, 0)
    assert (v.ndim, v.shape, v.strides) == (2, (2, 3), (3, 1))
    assert v.dtype == (2, 32, 1)
    assert v.deleter
    del cap, t
    base.assert_clean()


@pytest.mark.parametrize("max_version", [(1, 0), (1, 3), (1, 99), (2, 0), (100, 3)])
def test_versioned_capsule_at_1_3_for_major_one_and_above(max_version):
    base = Baseline()
    t = filled((4,))
    cap = t.__dlpack__(max_version=max_version)
    v = CapsuleView(cap)
    assert v.name == "dltensor_versioned"
    assert v.version == (1, 3)
    assert v.flags == 0  # writable, not a copy
    assert v.data == t.data_ptr and v.shape == (4,) and v.strides == (1,)
    del cap, t
    base.assert_clean()


def test_each_call_gives_a_fresh_capsule_and_unconsumed_ones_are_released():
    base = Baseline()
    t = filled((3,))
    caps = [t.__dlpack__(), t.__dlpack__(max_version=(1, 3)), t.__dlpack__()]
    assert len({CapsuleView(c).address for c in caps}) == 3
    assert tx.registry().stats()["exports_outstanding"] - base.before["exports_outstanding"] == 3
    del caps
    assert tx.registry().stats()["exports_outstanding"] == base.before["exports_outstanding"]
    del t
    base.assert_clean()


def test_dlpack_device():
    t = tx.empty(2)
    dev = t.__dlpack_device__()
    assert dev == (tx.DeviceType.kDLCPU, 0)
    assert isinstance(dev[0], tx.DeviceType)


# -- read-only ------------------------------------------------------------------------------
@pytest.mark.parametrize("max_version", [None, (0, 2)])
def test_readonly_tensor_refuses_legacy_capsule(max_version):
    base = Baseline()
    t, _ = readonly_tensor()
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=max_version)
    del t
    base.assert_clean()


@pytest.mark.parametrize("max_version", [(1, 0), (1, 3), (2, 0)])
def test_readonly_tensor_exports_read_only_flag(max_version):
    base = Baseline()
    t, a = readonly_tensor()
    cap = t.__dlpack__(max_version=max_version)
    v = CapsuleView(cap)
    assert v.flags == READ_ONLY
    assert v.data == a.ctypes.data
    back = np.from_dlpack(t)  # NumPy asks for a versioned capsule and honours the flag
    assert not back.flags.writeable
    assert back.ctypes.data == a.ctypes.data
    del cap, t, back
    base.assert_clean()


# -- malformed arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), [1, 0], "1.0", 1, (1.0, 0), (1, "0"), (None, None), ()])
def test_malformed_max_version_raises_typeerror(bad):
    base = Baseline()
    t = filled((2,))
    with pytest.raises(TypeError):
        t.__dlpack__(max_version=bad)
    del t
    base.assert_clean()


@pytest.mark.parametrize("stream", [0, 1, 2, -1, 12345, object()])
@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_stream_for_cpu_tensor_raises_valueerror(stream, max_version):
    base = Baseline()
    t = filled((2,))
    with pytest.raises(ValueError):
        t.__dlpack__(stream=stream, max_version=max_version)
    del t
    base.assert_clean()


# -- copy -------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_copy_true_makes_a_real_copy(max_version):
    base = Baseline()
    t = filled((2, 3))
    cap = t.__dlpack__(copy=True, max_version=max_version)
    v = CapsuleView(cap)
    assert v.data != t.data_ptr
    if max_version is not None:
        assert v.flags == IS_COPIED
    copy = tx.from_dlpack(cap)
    assert copy.data_ptr == v.data and copy.shape == (2, 3)
    np.testing.assert_array_equal(np.from_dlpack(copy) if not copy.readonly else array_at(
        copy.data_ptr, copy.shape, copy.strides, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3))
    # Writing the copy leaves the source alone.
    array_at(copy.data_ptr, copy.shape, copy.strides, np.float32)[...] = -1
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(6, dtype=np.float32).reshape(2, 3))
    del cap, t, copy
    base.assert_clean()


def test_copy_true_of_readonly_source_is_writable_and_flagged_copied():
    base = Baseline()
    t, a = readonly_tensor((3, 2))
    cap = t.__dlpack__(copy=True, max_version=(1, 3))
    v = CapsuleView(cap)
    assert v.flags == IS_COPIED  # and not READ_ONLY
    assert v.data != a.ctypes.data
    copy = tx.from_dlpack(cap)
    assert not copy.readonly
    arr = np.from_dlpack(copy)
    assert arr.flags.writeable
    np.testing.assert_array_equal(arr, a)
    arr[...] = 7
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32).reshape(3, 2))
    # A legacy capsule is fine too for a copy: it is not read-only.
    legacy = t.__dlpack__(copy=True)
    assert CapsuleView(legacy).name == "dltensor"
    del cap, copy, arr, legacy, t
    base.assert_clean()


def test_copy_true_of_strided_source_copies_values_in_order():
    base = Baseline()
    a = np.arange(24, dtype=np.int32).reshape(4, 6)[::-1, ::2]
    t = tx.from_dlpack(a)
    copy = tx.from_dlpack(t.__dlpack__(copy=True, max_version=(1, 3)))
    assert copy.data_ptr != a.ctypes.data
    assert copy.is_contiguous()
    np.testing.assert_array_equal(np.from_dlpack(copy), a)
    del t, copy
    base.assert_clean()


@pytest.mark.parametrize("dl_device", [None, CPU, (1, 0)])
def test_copy_false_when_no_copy_is_needed_shares_memory(dl_device):
    base = Baseline()
    t = filled((5,))
    cap = t.__dlpack__(copy=False, dl_device=dl_device, max_version=(1, 3))
    v = CapsuleView(cap)
    assert v.data == t.data_ptr and v.flags == 0 and v.device == (1, 0)
    del cap, t
    base.assert_clean()


@pytest.mark.parametrize("dl_device", [(2, 0), (tx.DeviceType.kDLCUDA, 1), (3, 0), (13, 0), (4, 0), (1, 1), (99, 0)])
@pytest.mark.parametrize("copy", [None, True, False])
def test_dl_device_other_than_own_or_cpu_raises_buffererror(dl_device, copy):
    base = Baseline()
    t = filled((2,))
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=dl_device, copy=copy, max_version=(1, 3))
    del t
    base.assert_clean()


# -- dtypes ----------------------------------------------------------------------------------------
NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"]
ML_DTYPES = ["bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
             "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]


def sample(name, n=11):
    """Distinct values that ``name`` holds exactly."""
    if name == "bool":
        return np.array([True, False] * 5 + [True])
    dt = np.dtype(name)
    if dt.kind == "c":
        return (np.arange(n) - 3 + 1j * np.arange(n)[::-1]).astype(dt)
    if dt.kind == "u":
        return (np.arange(n) * 7 % 256).astype(dt)
    return (np.arange(n) - 5).astype(dt) * (1 if dt.kind == "i" else np.array(0.5, dt))


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_dtypes_round_trip(name):
    base = Baseline()
    a = sample(name)
    t = tx.from_dlpack(a)
    assert t.dtype.name == name and t.data_ptr == a.ctypes.data
    v = CapsuleView(cap := t.__dlpack__(max_version=(1, 3)))
    assert v.dtype == (t.dtype.code, t.dtype.bits, 1)
    del cap
    back = np.from_dlpack(t)
    assert back.dtype == a.dtype and back.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(back, a)
    del t, back
    base.assert_clean()


def ml_sample(name):
    dt = np.dtype(getattr(ml_dtypes, name))
    values = np.array([0.0, 1.0, -2.0, 0.5, 4.0, -0.25, 3.0], dtype=np.float32)
    if name == "float8_e8m0fnu":  # powers of two only, no sign, no zero
        values = np.array([1.0, 2.0, 0.5, 4.0, 0.25, 8.0, 16.0], dtype=np.float32)
    return values.astype(dt)


@pytest.mark.parametrize("name", ML_DTYPES)
def test_ml_dtypes_round_trip(name):
    base = Baseline()
    a = ml_sample(name)
    dt = tx.dtype(name)
    cap, producer = hand_made(a)  # NumPy cannot export these: a hand-made capsule can
    t = tx.from_dlpack(cap)
    assert t.dtype is dt and t.data_ptr == a.ctypes.data
    out = t.__dlpack__(max_version=(1, 3))
    v = CapsuleView(out)
    assert v.dtype == (dt.code, dt.bits, 1)
    assert v.data == a.ctypes.data
    seen = array_at(v.data, v.shape, v.strides, a.dtype)
    assert seen.tobytes() == a.tobytes()
    np.testing.assert_array_equal(seen.astype(np.float32), a.astype(np.float32))
    del out, cap, t, seen
    base.assert_clean()
    assert producer.calls == 1


@pytest.mark.parametrize("name", NUMPY_DTYPES + ML_DTYPES)
def test_empty_of_every_dtype_exports_its_code(name):
    base = Baseline()
    t = tx.empty((3, 2), name)
    assert t.nbytes == 6 * t.dtype.itemsize
    assert t.data_ptr % 64 == 0
    v = CapsuleView(cap := t.__dlpack__(max_version=(1, 3)))
    assert v.dtype == (t.dtype.code, t.dtype.bits, 1)
    del cap, t
    base.assert_clean()


# -- layouts -----------------------------------------------------------------------------------
def _layouts():
    a1 = np.arange(10, dtype=np.float64)
    a2 = np.arange(24, dtype=np.float32).reshape(4, 6)
    a3 = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    return {
        "reversed": a1[::-1],
        "step3": a1[::3],
        "transposed": a2.T,
        "neg2d": a2[::-1, ::-2],
        "neg3d": a3[:, ::-2, 1:],
        "broadcast_zero_stride": np.broadcast_to(np.arange(3.0), (4, 3)),
        "broadcast_row": np.broadcast_to(np.arange(4.0)[:, None], (4, 5)),
        "overlapping_windows": np.lib.stride_tricks.as_strided(a1, shape=(8, 3), strides=(8, 8), writeable=False),
        "sliding_window_view": np.lib.stride_tricks.sliding_window_view(a1, 4)[::-1],
        "size1_dims": np.arange(6.0).reshape(1, 6, 1),
    }


@pytest.mark.parametrize("kind", list(_layouts()))
def test_strided_layouts_round_trip_through_numpy(kind):
    base = Baseline()
    a = _layouts()[kind]
    t = tx.from_dlpack(a)
    elem_strides = tuple(s // a.itemsize for s in a.strides)
    assert t.shape == a.shape and t.strides == elem_strides and t.data_ptr == a.ctypes.data
    cap = t.__dlpack__(max_version=(1, 3))
    v = CapsuleView(cap)
    assert v.data == a.ctypes.data and v.shape == a.shape and v.strides == elem_strides
    del cap
    back = np.from_dlpack(t)
    assert back.ctypes.data == a.ctypes.data
    assert back.strides == a.strides
    np.testing.assert_array_equal(back, a)
    del t, back
    base.assert_clean()


def test_writes_through_an_export_are_seen_by_the_source():
    base = Baseline()
    a = np.zeros((3, 4), np.int32)
    t = tx.from_dlpack(a[:, ::-1])
    view = np.from_dlpack(t)
    assert view.flags.writeable
    view[0, 0] = 42  # element (0, 3) of a
    assert a[0, 3] == 42
    del t, view
    base.assert_clean()


@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_strides_always_filled_for_ndim_above_zero(max_version):
    base = Baseline()
    for shape in [(5,), (2, 3), (2, 1, 4), (1,), (3, 0)]:
        t = tx.empty(shape)
        v = CapsuleView(cap := t.__dlpack__(max_version=max_version))
        assert not v.strides_is_null and not v.shape_is_null, shape
        assert v.shape == shape and len(v.strides) == len(shape)
        if 0 not in shape:
            assert v.strides == t.strides
        del cap, t
    base.assert_clean()


def test_zero_d_tensor():
    base = Baseline()
    a = np.array(3.5, dtype=np.float64)
    t = tx.from_dlpack(a)
    assert t.shape == () and t.strides == () and t.data_ptr == a.ctypes.data
    v = CapsuleView(cap := t.__dlpack__(max_version=(1, 3)))
    assert v.ndim == 0 and v.data == a.ctypes.data
    del cap
    back = np.from_dlpack(t)
    assert back.shape == () and back.ctypes.data == a.ctypes.data and back[()] == 3.5
    del t, back
    base.assert_clean()


@pytest.mark.parametrize("make", [lambda: tx.empty((0, 3)), lambda: tx.empty(0, "int8"),
                                  lambda: tx.from_dlpack(np.empty((2, 0), np.float32)),
                                  lambda: tx.from_dlpack(np.arange(10.0)[5:5])])
@pytest.mark.parametrize("max_version", [None, (1, 3)])
def test_zero_size_tensor_exports_null_data(make, max_version):
    base = Baseline()
    t = make()
    assert 0 in t.shape
    v = CapsuleView(cap := t.__dlpack__(max_version=max_version))
    assert v.data == 0, "a zero-size tensor is exported with data = NULL"
    assert v.shape == t.shape
    del cap
    back = np.from_dlpack(t)
    assert back.shape == t.shape and back.size == 0
    del t, back
    base.assert_clean()


# -- a consumer that refuses our capsule (more consumers: test_refused_exports.py) ------------------
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_refused_capsule_keeps_the_consumers_exception_and_releases_the_export(name):
    # NumPy 2.4 does not know these DLPack codes: it takes our capsule, refuses it and
    # drops it with its own error pending, so our destructor runs inside that error.
    base = Baseline()
    t = tx.empty((4,), name)
    with pytest.raises(Exception) as info:
        np.from_dlpack(t)
    assert not isinstance(info.value, SystemError), f"the consumer's exception was lost: {info.value!r}"
    assert isinstance(info.value, (BufferError, RuntimeError, TypeError)), repr(info.value)
    assert "dtype" in str(info.value).lower()  # NumPy's own message
    del info
    stats = tx.registry().stats()
    assert stats["exports_outstanding"] == base.before["exports_outstanding"], "the refused export leaked"
    del t
    base.assert_clean()


def test_refused_capsule_in_a_loop_leaks_nothing():
    base = Baseline()
    t = tx.empty((8,), "bfloat16")
    for _ in range(200):
        try:
            np.from_dlpack(t)
        except Exception:
            pass
    assert tx.registry().stats()["exports_outstanding"] == base.before["exports_outstanding"]
    del t
    base.assert_clean()
