"""Bad input: each case raises the exception docs/design.md, "The protocol", names, nothing leaks, nothing is
freed twice. Hand-made capsules (dlpack_fixtures.hand_made) count their deleter's calls:
a refused capsule keeps its name, so its deleter stays the producer's business and runs
exactly once, when the capsule itself is dropped.
"""

from __future__ import annotations


import numpy as np
import pytest

import exchange as tx
from dlpack_fixtures import Baseline, HandMadeProducer, capsule_name, hand_made


def test_capsule_consumed_twice_raises_valueerror():
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(ValueError):
        tx.from_dlpack(cap)
    assert producer.calls == 0
    del t
    assert producer.calls == 1
    del cap
    assert producer.calls == 1 and producer.destructor_calls == 0
    base.assert_clean()


@pytest.mark.parametrize("make", ["numpy", "tx", "numpy-legacy"])
def test_real_capsules_consumed_twice_raise_valueerror(make):
    base = Baseline()
    a = np.arange(3.0)
    src = tx.empty(3)
    cap = {"numpy": lambda: a.__dlpack__(max_version=(1, 3)), "numpy-legacy": a.__dlpack__,
           "tx": lambda: src.__dlpack__(max_version=(1, 3))}[make]()
    t = tx.from_dlpack(cap)
    with pytest.raises(ValueError):
        tx.from_dlpack(cap)
    with pytest.raises(ValueError):
        np.from_dlpack(_Wrap(cap))  # and NumPy agrees it is used
    del t, cap, src
    base.assert_clean()


class _Wrap:
    """Hands a given capsule to a consumer that calls ``__dlpack__``."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("name", ["not_a_dltensor", "used_dltensor", "used_dltensor_versioned"])
def test_capsule_of_another_name_raises_valueerror_and_is_not_touched(name):
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    producer = HandMadeProducer(data=a.ctypes.data, shape=(4,), strides=(1,), code=2, bits=32, keep=a)
    cap = producer.capsule(name)
    with pytest.raises(ValueError):
        tx.from_dlpack(cap)
    assert capsule_name(cap) == name
    del cap
    assert producer.calls == 0  # no DLPack owner for such a capsule: nobody calls the deleter
    base.assert_clean()


def test_foreign_capsule_raises_valueerror():
    import _datetime

    cap = _datetime.datetime_CAPI
    with pytest.raises(ValueError):
        tx.from_dlpack(cap)
    assert capsule_name(cap) == "datetime.datetime_CAPI"


# Capsules the consumer must refuse with BufferError before taking them.
REFUSED = {
    "null_shape": dict(shape=None, ndim=2),
    "negative_ndim": dict(ndim=-1),
    "huge_ndim": dict(ndim=2**31 - 1),  # must not read 2**31 extents
    "negative_extent": dict(shape=(2, -3), strides=(3, 1)),
    "unknown_dtype_code": dict(dtype_code=(99, 32, 1)),
    "float_12_bits": dict(dtype_code=(2, 12, 1)),
    "lanes_2": dict(dtype_code=(2, 32, 2)),
    "float4_packed": dict(dtype_code=(17, 4, 1)),
    "opaque_handle": dict(dtype_code=(3, 64, 1)),
    "unknown_device_99": dict(device=(99, 0)),
    "unassigned_device_5": dict(device=(5, 0)),
    "opencl_device": dict(device=(4, 0)),
    "rocm_device": dict(device=(10, 0)),
    "metal_device": dict(device=(8, 0)),
    "negative_device_id": dict(device=(1, -1)),
}


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_capsule_raises_buffererror_and_leaves_the_deleter_to_the_capsule(case, versioned):
    base = Baseline()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    cap, producer = hand_made(a, versioned=versioned, **REFUSED[case])
    name = capsule_name(cap)
    with pytest.raises(BufferError):
        tx.from_dlpack(cap)
    assert capsule_name(cap) == name, "a refused capsule must not be renamed"
    assert producer.calls == 0, "the consumer must not call the deleter of a capsule it refused"
    base.assert_clean()
    del cap
    assert producer.calls == 1 and producer.destructor_calls == 1
    assert producer.self_pointers == [producer.address]


@pytest.mark.parametrize("version", [(2, 0), (0, 9), (7, 1)])
def test_other_major_version_calls_deleter_once_and_reads_nothing_else(version):
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    # Everything after ``flags`` is garbage: reading it would crash or be refused
    # for another reason (a shape pointer into page zero, absurd ndim and dtype).
    producer = HandMadeProducer(data=0x10, shape=None, strides=None, ndim=3, code=250, bits=3, lanes=9,
                                device=(77, -5), version=version, shape_address=0x10, keep=a)
    cap = producer.capsule()
    with pytest.raises(BufferError):
        tx.from_dlpack(cap)
    assert producer.calls == 1, "another major version: the consumer calls the deleter at once"
    assert capsule_name(cap) == "used_dltensor_versioned"
    del cap
    assert producer.calls == 1 and producer.destructor_calls == 0
    base.assert_clean()


def test_higher_minor_version_with_known_values_is_accepted():
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a, version=(1, 9))
    t = tx.from_dlpack(cap)
    np.testing.assert_array_equal(np.from_dlpack(t), a)
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), [1, 3], "1.3", 1, (1.0, 3), (1, None)])
def test_max_version_not_a_pair_of_ints_raises_typeerror(bad):
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    with pytest.raises(TypeError):
        t.__dlpack__(max_version=bad)
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


@pytest.mark.parametrize("stream", [0, 1, 2, -1, 99])
def test_stream_for_cpu_tensor_raises_valueerror(stream):
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    with pytest.raises(ValueError):
        t.__dlpack__(stream=stream, max_version=(1, 3))
    with pytest.raises(ValueError):
        t.__dlpack__(stream=stream)
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


def test_copy_false_where_a_copy_is_needed_raises_buffererror():
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(tx.DeviceType.kDLCUDA, 0), copy=False, max_version=(1, 3))
    with pytest.raises(BufferError):
        tx.from_dlpack(t, device="cuda:0", copy=False)
    with pytest.raises(BufferError):
        tx.from_dlpack(a, device="cuda:0", copy=False)
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


def test_copy_false_on_a_raw_capsule_needing_a_copy_raises_buffererror():
    base = Baseline()
    a = np.arange(4, dtype=np.float32)
    cap, producer = hand_made(a)
    with pytest.raises(BufferError):
        tx.from_dlpack(cap, device="cuda:0", copy=False)
    del cap
    base.assert_clean()
    assert producer.calls == 1  # taken (the capsule is used), then released once


@pytest.mark.parametrize("obj", [object(), [1, 2, 3], 3, "abc", b"bytes", None])
def test_object_without_dlpack_raises_typeerror(obj):
    base = Baseline()
    with pytest.raises(TypeError):
        tx.from_dlpack(obj)
    base.assert_clean()
