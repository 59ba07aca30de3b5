"""A tx.Tensor as NumPy sees it: ``np.asarray(t)`` / ``np.array(t)`` (``__array__``,
NumPy 2's protocol: no copy unless asked, read-only kept, the memory held while the
array lives), ``t.numpy()`` (bfloat16 and float8 too, through ml_dtypes), and ``repr``
showing a small tensor's values as NumPy does. Device memory: tests/cpu/test_cuda_without_gpu.py.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
from dlpack_fixtures import Baseline

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bfloat16 and float8")


def _filled(shape=(3, 4), dtype=np.float32) -> tx.Tensor:
    t = tx.empty(shape, np.dtype(dtype).name)
    np.from_dlpack(t)[...] = np.arange(int(np.prod(shape))).reshape(shape)
    return t


def test_asarray_is_the_tensors_memory_and_keeps_it_alive():
    base = Baseline()
    t = _filled()
    a = np.asarray(t)
    assert type(a) is np.ndarray and a.dtype == np.float32 and a.shape == (3, 4)
    assert a.ctypes.data == t.data_ptr and a.flags.writeable
    a[1, 2] = -1
    assert t.numpy()[1, 2] == -1  # one memory
    assert np.asarray(t, copy=False).ctypes.data == t.data_ptr
    record = t.record
    del t
    gc.collect()
    assert record.state == "live", "the array holds the record, as an export does"
    np.testing.assert_array_equal(a[0], [0, 1, 2, 3])
    view = a[1:]  # a view of the array holds it too
    del a
    gc.collect()
    assert record.state == "live"
    assert view[0, 2] == -1
    del view
    assert tx.registry().collect(timeout=5)
    assert record.state == "released"
    base.assert_clean()


def test_array_copies_and_asarray_copy_true_copies():
    base = Baseline()
    t = _filled()
    for c in (np.array(t), np.asarray(t, copy=True), np.array(t, copy=True)):
        assert c.ctypes.data != t.data_ptr and c.flags.writeable and c.flags.owndata
        np.testing.assert_array_equal(c, np.arange(12).reshape(3, 4))
        c[0, 0] = 99
        assert t.numpy()[0, 0] == 0
    del t, c
    base.assert_clean()


def test_read_only_tensor_gives_a_read_only_array_unless_copied():
    base = Baseline()
    src = np.arange(4.0)
    src.flags.writeable = False
    r = tx.from_dlpack(src)
    assert r.readonly
    for a in (np.asarray(r), np.asarray(r, copy=False), r.numpy()):
        assert not a.flags.writeable and a.ctypes.data == src.ctypes.data
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
    for c in (np.array(r), np.asarray(r, copy=True), np.asarray(r, dtype=np.float32)):
        assert c.flags.writeable and c.ctypes.data != src.ctypes.data
        c[0] = 7
    assert src[0] == 0
    del r, a, c
    base.assert_clean()


def test_dtype_argument_converts_and_copy_false_refuses_a_conversion():
    base = Baseline()
    t = _filled((4,), np.int32)
    same = np.asarray(t, dtype=np.int32)
    assert same.ctypes.data == t.data_ptr  # no conversion: no copy
    f = np.asarray(t, dtype=np.float64)
    assert f.dtype == np.float64 and f.ctypes.data != t.data_ptr
    np.testing.assert_array_equal(f, [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(t, dtype=np.float64, copy=False)
    np.asarray(t, dtype=np.int32, copy=False)  # no conversion: fine
    del t, same, f
    base.assert_clean()


def test_strided_zero_size_and_0d_tensors():
    base = Baseline()
    src = np.arange(24, dtype=np.int64).reshape(4, 6)[::-1, ::2]
    t = tx.from_dlpack(src)
    a = np.asarray(t)
    assert a.ctypes.data == src.ctypes.data and a.strides == src.strides
    np.testing.assert_array_equal(a, src)
    z = np.asarray(tx.empty((0, 3)))
    assert z.shape == (0, 3) and z.dtype == np.float32
    s = np.asarray(tx.from_dlpack(np.array(2.5)))
    assert s.shape == () and s == 2.5
    del t, a, z, s
    base.assert_clean()


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_bfloat16_and_float8_come_back_as_ml_dtypes_arrays(name):
    # NumPy's own DLPack import has no code for these (np.from_dlpack refuses them:
    # test_produce.py); asarray and numpy() view the same memory with ml_dtypes' type.
    base = Baseline()
    t = tx.empty((2, 3), name)
    a = np.asarray(t)
    assert a.dtype == np.dtype(getattr(ml_dtypes, name)) and a.shape == (2, 3)
    assert a.ctypes.data == t.data_ptr and a.flags.writeable
    a[...] = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(t.numpy().astype(np.float32), np.arange(6).reshape(2, 3))
    with pytest.raises((BufferError, RuntimeError, TypeError)):
        np.from_dlpack(t)  # unchanged: __array__ does not reach np.from_dlpack
    record = t.record
    del t
    gc.collect()
    assert record.state == "live"
    del a
    base.assert_clean()


def test_a_jax_bfloat16_array_through_tx_to_numpy():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed")
    base = Baseline()
    j = jnp.arange(6, dtype=jnp.bfloat16) - 2
    t = tx.from_dlpack(j)
    a = np.asarray(t)
    assert a.dtype == np.dtype(ml_dtypes.bfloat16) and not a.flags.writeable  # JAX's memory is immutable
    np.testing.assert_array_equal(a, np.asarray(j))
    del j, t, a
    base.assert_clean()


def test_bfloat16_without_ml_dtypes_says_so():
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None  # as if not installed
        import numpy as np
        import exchange as tx
        t = tx.empty((2,), "bfloat16")
        try:
            np.asarray(t)
        except TypeError as exc:
            print("TypeError:", exc)
        print(repr(t))
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "TypeError:" in out.stdout and "pip install ml_dtypes" in out.stdout
    assert "tx.Tensor(shape=(2,), dtype=bfloat16" in out.stdout  # repr keeps the summary, never raises


def test_a_float8_that_an_older_ml_dtypes_lacks_says_so():
    # ml_dtypes before 0.5 has no float8_e8m0fnu, float8_e3m4 nor float8_e4m3 (JAX 0.4
    # pins such a one): a TypeError naming the version, not an AttributeError.
    code = textwrap.dedent("""
        import sys, types
        old = types.ModuleType("ml_dtypes")  # as an ml_dtypes 0.4 is for these: no such attribute
        old.__version__ = "0.4.1"
        sys.modules["ml_dtypes"] = old
        import numpy as np
        import exchange as tx
        t = tx.empty((2,), "float8_e8m0fnu")
        try:
            np.asarray(t)
        except TypeError as exc:
            print("TypeError:", exc)
        print(repr(t))
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "TypeError: dtype float8_e8m0fnu needs ml_dtypes 0.5 or later (0.4.1 is installed)" in out.stdout, out.stdout
    assert "tx.Tensor(shape=(2,), dtype=float8_e8m0fnu" in out.stdout


def test_numpy_functions_and_ufuncs_take_tensors():
    base = Baseline()
    t = _filled((4,))
    out = np.add(t, 1)
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, [1, 2, 3, 4])
    assert float(np.sum(t)) == 6.0
    np.testing.assert_array_equal(np.stack([t, t]), [[0, 1, 2, 3]] * 2)
    back = np.from_dlpack(t)  # the DLPack path is unchanged
    assert back.ctypes.data == t.data_ptr
    del t, out, back
    base.assert_clean()


def test_numpy_reads_a_tx_dtype():
    # np.dtype reads an object's .dtype (NumPy's protocol for dtype-like objects): so
    # np.zeros(shape, t.dtype) and np.finfo(t.dtype) take ours. (np.result_type(t) does
    # not: it wants an array-like's .dtype to be a numpy.dtype itself.)
    t = _filled((2,), np.float32)
    assert np.dtype(t.dtype) == np.float32
    assert np.zeros(3, t.dtype).dtype == np.float32
    assert np.result_type(t.dtype, np.float64) == np.float64
    assert np.issubdtype(t.dtype, np.floating) and np.can_cast(t.dtype, np.float64)
    assert np.finfo(tx.dtype("bfloat16")).bits == 16 and np.dtype(tx.dtype("bfloat16")) == ml_dtypes.bfloat16
    for dt in ("bool", "int8", "uint64", "complex128", "float8_e4m3fn"):
        assert np.dtype(tx.dtype(dt)) == tx.dtype(dt).numpy
    assert tx.dtype("float32").dtype == np.float32  # the attribute NumPy reads: .numpy


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_a_stream_ordered_tensor_is_read_after_the_work_queued_on_its_stream(name):
    # A tensor ordered on a host stream: every way into NumPy waits for the work queued
    # there (a write that sleeps first), never reading before it has run.
    import threading
    import time

    base = Baseline()
    s = tx.create_stream("cpu")
    try:
        t = tx.empty((4,), name, stream=s)
        conversions = {"asarray": lambda: np.asarray(t), "numpy": lambda: t.numpy(),
                       "array": lambda: np.array(t), "asarray float64": lambda: np.asarray(t, dtype=np.float64),
                       "ufunc": lambda: np.add(t, 0)}
        for value, (label, convert) in enumerate(conversions.items(), start=1):
            started = threading.Event()

            def write(value=value):
                started.set()
                time.sleep(0.2)
                np.asarray(t)[...] = value  # on the stream's worker: no wait for itself

            s.submit(write)
            assert started.wait(5)
            got = convert()
            assert got.astype(np.float64).tolist() == [value] * 4, label
        del t, got
    finally:
        s.close()
    base.assert_clean()


def test_closed_borrow_raises_lifetime_error():
    with tx.borrow(bytearray(16), shape=(4,), dtype="float32") as view:
        np.testing.assert_array_equal(np.asarray(view), np.zeros(4))
    for use in (lambda: np.asarray(view), lambda: np.array(view), lambda: view.numpy()):
        with pytest.raises(tx.LifetimeError, match="borrow"):
            use()


# -- repr ----------------------------------------------------------------------------------
def test_repr_of_a_small_tensor_shows_its_values():
    t = _filled((2, 3))
    expected = np.array2string(np.arange(6, dtype=np.float32).reshape(2, 3), separator=", ", prefix="tx.Tensor(")
    assert repr(t) == f"tx.Tensor({expected}, dtype=float32, device='cpu')"
    assert repr(t) == "tx.Tensor([[0., 1., 2.],\n           [3., 4., 5.]], dtype=float32, device='cpu')"
    src = np.arange(3)
    src.flags.writeable = False
    assert repr(tx.from_dlpack(src)) == "tx.Tensor([0, 1, 2], dtype=int64, device='cpu', readonly)"
    assert repr(tx.from_dlpack(np.array(2.5))) == "tx.Tensor(2.5, dtype=float64, device='cpu')"
    assert repr(tx.empty((0, 3))) == "tx.Tensor([], shape=(0, 3), dtype=float32, device='cpu')"  # NumPy's way
    b = tx.empty((2,), "bfloat16")
    np.asarray(b)[...] = [1.5, -2]
    assert repr(b) == "tx.Tensor([1.5, -2], dtype=bfloat16, device='cpu')"
    assert str(t) == repr(t)


def test_repr_of_a_closed_tensor_says_why():
    with tx.borrow(bytearray(16), shape=(4,), dtype="float32") as view:
        pass
    assert repr(view) == "<tx.Tensor (closed borrow)>"
    # A tensor over CUDA memory whose sender exited is closed with a reason on its record
    # (exchange/sharing/receiving.py, sender_died; tests/gpu/test_gpu_share.py sees it on a
    # device): repr says that reason, not "borrow". Here done as sender_died does it.
    t = tx.empty((2,))
    reason = "process 4242, which shared this CUDA memory, has exited: the memory may be freed"
    t.record.closed_reason = reason
    t._closed = True
    assert repr(t) == f"<tx.Tensor (closed: {reason})>"
    with pytest.raises(tx.LifetimeError, match="has exited"):
        np.asarray(t)


def test_repr_of_a_large_or_stream_ordered_tensor_keeps_the_summary():
    big = tx.empty((101,), "int32")
    assert repr(big) == "tx.Tensor(shape=(101,), dtype=int32, device='cpu', strides=(1,))"
    assert repr(tx.empty((10, 10), "int32")).startswith("tx.Tensor([[")  # 100 elements: values
    s = tx.create_stream("cpu")
    try:
        on_stream = tx.empty((2,), stream=s)
        # repr never waits for a stream's work: the summary, not the values
        assert repr(on_stream) == "tx.Tensor(shape=(2,), dtype=float32, device='cpu', strides=(1,))"
        del on_stream
    finally:
        s.close()
