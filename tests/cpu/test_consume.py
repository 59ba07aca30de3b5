"""Consuming: tx.from_dlpack of objects and raw capsules, legacy and versioned, with
capsules built by hand (dlpack_fixtures.hand_made) whose deleter counts its calls.

The producer's deleter must run exactly once, after the last view of ours is gone,
whatever dies first: the capsule, the Tensor, or a NumPy array made from our re-export.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import exchange as tx
import exchange._core
from exchange import capsule as _capsule
from dlpack_fixtures import READ_ONLY, Baseline, CapsuleView, array_at, capsule_name, hand_made


def test_capsule_implementation_matches_environment():
    pure = os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0")
    assert exchange._core.compiled() is not pure


# -- objects and raw capsules --------------------------------------------------------------------
def test_numpy_object_is_imported_zero_copy_and_writable():
    base = Baseline()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tx.from_dlpack(a)
    assert t.data_ptr == a.ctypes.data and t.shape == (3, 4) and t.strides == (4, 1)
    assert t.dtype == "float32" and t.device == tx.Device.parse("cpu") and not t.readonly
    assert t.nbytes == a.nbytes
    assert "numpy" in t.record.origin and t.record.device == tx.Device.parse("cpu")
    stats = tx.registry().stats()
    assert stats["imports_outstanding"] == base.before["imports_outstanding"] + 1
    np.from_dlpack(t)[1, 2] = -5  # the same memory
    assert a[1, 2] == -5
    del t
    base.assert_clean()


def test_readonly_numpy_object_imports_readonly():
    base = Baseline()
    a = np.arange(4.0)
    a.flags.writeable = False
    t = tx.from_dlpack(a)
    assert t.readonly and t.data_ptr == a.ctypes.data
    del t
    base.assert_clean()


@pytest.mark.parametrize("max_version,readonly", [(None, True), ((1, 0), False), ((1, 3), False)])
def test_numpy_raw_capsule_legacy_is_readonly_versioned_is_not(max_version, readonly):
    base = Baseline()
    a = np.arange(6, dtype=np.int64)
    cap = a.__dlpack__(max_version=max_version)
    assert capsule_name(cap) == ("dltensor" if max_version is None else "dltensor_versioned")
    t = tx.from_dlpack(cap)
    assert capsule_name(cap).startswith("used_")
    assert t.readonly is readonly and t.data_ptr == a.ctypes.data
    back = np.from_dlpack(t)
    assert back.flags.writeable is not readonly
    np.testing.assert_array_equal(back, a)
    del cap, t, back
    base.assert_clean()


@pytest.mark.parametrize("versioned,flags,readonly", [(False, 0, True), (True, 0, False), (True, READ_ONLY, True)])
def test_hand_made_capsule_imports_values_and_flags(versioned, flags, readonly):
    base = Baseline()
    a = np.arange(10, dtype=np.int32).reshape(2, 5)
    cap, producer = hand_made(a, versioned=versioned, flags=flags)
    t = tx.from_dlpack(cap)
    assert t.readonly is readonly  # a legacy capsule imports read-only
    assert t.data_ptr == a.ctypes.data and t.shape == (2, 5) and t.strides == (5, 1)
    np.testing.assert_array_equal(np.from_dlpack(t), a)
    assert producer.calls == 0
    del cap, t
    assert producer.calls == 1 and producer.self_pointers == [producer.address]
    assert producer.destructor_calls == 0  # renamed used_: the destructor did not act
    base.assert_clean()


def test_byte_offset_is_honoured():
    base = Baseline()
    buf = np.arange(16, dtype=np.float32)
    cap, producer = hand_made(buf, shape=(2, 3), strides=None, byte_offset=2 * 4)
    t = tx.from_dlpack(cap)
    assert t.data_ptr == buf.ctypes.data + 8
    back = np.from_dlpack(t)
    assert back.ctypes.data == buf.ctypes.data + 8
    np.testing.assert_array_equal(back, buf[2:8].reshape(2, 3))
    del cap, t, back
    assert producer.calls == 1
    base.assert_clean()


def test_byte_offset_with_strides_and_zero_d():
    base = Baseline()
    buf = np.arange(40, dtype=np.int16)
    cap, producer = hand_made(buf, shape=(3, 2), strides=(-4, 3), byte_offset=30 * 2)
    t = tx.from_dlpack(cap)
    expected = np.lib.stride_tricks.as_strided(buf[30:], shape=(3, 2), strides=(-8, 6))
    np.testing.assert_array_equal(array_at(t.data_ptr, t.shape, t.strides, np.int16), expected)
    np.testing.assert_array_equal(np.from_dlpack(t), expected)
    cap0, producer0 = hand_made(buf, shape=(), strides=None, byte_offset=7 * 2)
    s = tx.from_dlpack(cap0)
    assert s.shape == () and np.from_dlpack(s)[()] == 7
    del cap, t, cap0, s
    assert producer.calls == producer0.calls == 1
    base.assert_clean()


def test_null_strides_mean_row_major():
    base = Baseline()
    a = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    for versioned in (False, True):
        cap, producer = hand_made(a, strides=None, versioned=versioned)
        assert CapsuleView(cap).strides_is_null
        t = tx.from_dlpack(cap)
        assert t.strides == (12, 4, 1) and t.is_contiguous()
        np.testing.assert_array_equal(np.from_dlpack(t), a)
        del cap, t
        assert producer.calls == 1
    base.assert_clean()


@pytest.mark.parametrize("null_data", [True, False])
def test_zero_size_import_accepts_null_and_non_null_data(null_data):
    base = Baseline()
    a = np.empty((0, 4), np.float32)
    kwargs = {"data": None} if null_data else {"data": np.empty(4, np.float32).ctypes.data}
    cap, producer = hand_made(a, **kwargs)
    t = tx.from_dlpack(cap)
    assert t.shape == (0, 4) and t.nbytes == 0
    back = np.from_dlpack(t)
    assert back.shape == (0, 4)
    del cap, t, back
    assert producer.calls == 1
    base.assert_clean()


def test_zero_d_with_null_shape_and_strides():
    base = Baseline()
    a = np.array(2.25, np.float64)
    cap, producer = hand_made(a, shape=None, strides=None, ndim=0)
    v = CapsuleView(cap)
    assert v.shape_is_null and v.strides_is_null and v.ndim == 0
    t = tx.from_dlpack(cap)
    assert t.shape == () and t.strides == () and t.data_ptr == a.ctypes.data
    assert np.from_dlpack(t)[()] == 2.25
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


def test_null_deleter_is_tolerated():
    base = Baseline()
    a = np.arange(3.0)
    cap, producer = hand_made(a, null_deleter=True)
    t = tx.from_dlpack(cap)
    np.testing.assert_array_equal(np.from_dlpack(t), a)
    del cap, t
    assert producer.calls == 0
    base.assert_clean()


# -- who dies first ------------------------------------------------------------------------------
@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("order", list(itertools.permutations(["capsule", "tensor", "array"])), ids="-".join)
def test_deleter_runs_once_after_the_last_view(order, versioned):
    base = Baseline()
    a = np.arange(8, dtype=np.float32)
    cap, producer = hand_made(a, versioned=versioned)
    t = tx.from_dlpack(cap)
    arr = np.from_dlpack(t)  # NumPy holds one of our exports of the imported record
    assert arr.ctypes.data == a.ctypes.data
    objs = {"capsule": cap, "tensor": t, "array": arr}
    del cap, t, arr
    alive = set(objs)
    for name in order:
        del objs[name]
        alive.discard(name)
        expected = 0 if alive & {"tensor", "array"} else 1
        assert producer.calls == expected, f"after dropping {name}, {sorted(alive)} alive"
    assert producer.calls == 1 and producer.self_pointers == [producer.address]
    assert producer.destructor_calls == 0
    base.assert_clean()


def test_deleter_waits_for_unconsumed_reexport_and_views():
    base = Baseline()
    a = np.arange(5, dtype=np.int8)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    view = tx.from_dlpack(t)  # a second Tensor over the same record
    assert view.record is t.record and view.data_ptr == t.data_ptr
    again = t.__dlpack__(max_version=(1, 3))  # our export, never consumed
    del cap, t
    assert producer.calls == 0
    del view
    assert producer.calls == 0
    del again  # the unconsumed capsule's destructor releases the export
    assert producer.calls == 1
    base.assert_clean()


def test_deleter_may_run_on_another_thread():
    base = Baseline()
    a = np.arange(5, dtype=np.int8)
    cap, producer = hand_made(a)
    box = [tx.from_dlpack(cap)]
    del cap
    worker = threading.Thread(target=box.clear, name="dropper")
    worker.start()
    worker.join()
    assert producer.calls == 1 and producer.threads == ["dropper"]
    base.assert_clean()


def test_imported_record_counts_while_alive():
    base = Baseline()
    a = np.arange(6, dtype=np.float32)
    cap, producer = hand_made(a)
    t = tx.from_dlpack(cap)
    s = tx.registry().stats()
    assert s["imports_outstanding"] == base.before["imports_outstanding"] + 1
    assert s["live_records"] == base.before["live_records"] + 1
    (rec,) = [r for r in tx.registry().snapshot() if r is t.record]
    assert rec.address == a.ctypes.data and rec.nbytes == a.nbytes and rec.state == "live"
    assert rec.origin.startswith("imported")
    del cap, t
    assert producer.calls == 1
    base.assert_clean()


# -- keyword fallback and copies ---------------------------------------------------------------
class StreamOnlyProducer:
    """An old producer: ``__dlpack__`` takes only ``stream`` (as ONNX Runtime's)."""

    def __init__(self, a):
        self.a = a
        self.calls = []

    def __dlpack__(self, stream=None):
        self.calls.append(stream)
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class NoKeywordProducer(StreamOnlyProducer):
    def __dlpack__(self):
        self.calls.append("no keywords")
        return self.a.__dlpack__()


@pytest.mark.parametrize("cls", [StreamOnlyProducer, NoKeywordProducer])
def test_old_producers_are_asked_again_without_new_keywords(cls):
    base = Baseline()
    a = np.arange(4.0)
    p = cls(a)
    t = tx.from_dlpack(p)
    assert t.data_ptr == a.ctypes.data
    assert t.readonly  # a legacy capsule
    assert len(p.calls) == 1
    del t, p
    base.assert_clean()


def test_from_dlpack_of_our_tensor_is_a_view():
    base = Baseline()
    t = tx.empty((2, 2), "int32")
    v = tx.from_dlpack(t)
    assert v is not t and v.record is t.record and v.data_ptr == t.data_ptr
    del t
    assert v.record.state == "live"
    del v
    base.assert_clean()


@pytest.mark.parametrize("source", ["numpy", "capsule", "readonly", "tensor"])
def test_copy_true_gives_a_writable_copy(source):
    base = Baseline()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]
    if source == "readonly":
        a.flags.writeable = False
    x = {"numpy": a, "readonly": a, "capsule": a.__dlpack__(max_version=(1, 3)), "tensor": tx.from_dlpack(a)}[source]
    c = tx.from_dlpack(x, copy=True)
    assert c.data_ptr != a.ctypes.data and not c.readonly
    np.testing.assert_array_equal(np.from_dlpack(c), a)
    np.from_dlpack(c)[...] = 0
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1])
    del x, c
    base.assert_clean()


# -- a garbage collection inside the registry lock ------------------------------------------------
def test_finalizers_run_by_gc_inside_registry_calls_do_not_deadlock():
    # A Tensor (or a capsule) kept in a reference cycle is freed by the garbage
    # collector, which may run at any allocation, including one made while the registry
    # holds its lock on the same thread; its finaliser then calls back into the
    # registry. Run in a child so a deadlock fails the test instead of hanging the run.
    code = textwrap.dedent("""
        import gc, numpy as np, exchange as tx
        class Cycle: pass
        for threshold in (7, 13, 29, 100):  # move where in the code collections land
            gc.set_threshold(threshold)
            for i in range(500):
                t = tx.empty(4)
                c = Cycle(); c.me = c; c.cap = t.__dlpack__(); c.t = tx.from_dlpack(np.ones(3))
                del c, t
                tx.registry().stats(); tx.registry().snapshot()
        gc.set_threshold(700)
        gc.collect()
        tx.registry().collect(timeout=10)
        s = tx.registry().stats()
        assert s["live_records"] == 0 and s["exports_outstanding"] == 0, s
        print("done")
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: a finaliser run by the garbage collector waited for the registry lock "
                    "its own thread held")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
