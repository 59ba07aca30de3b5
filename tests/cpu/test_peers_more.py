"""Four more real peers on the CPU, both directions: PaddlePaddle, pyarrow, TensorFlow, MLX.

Each exchange either shares memory (same data address) and keeps values, or, where the
peer cannot take the memory as it is (a quirk of its own), is a copy that the adapter
makes and the chain's hop reports, or a clear error: never a wrong result. Once both
sides are dropped the registry is back where it started. A peer is skipped only when it
cannot be imported; each is imported once per test process (fixtures of module scope:
TensorFlow alone takes seconds), and every case here runs in this process.
"""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest

import exchange as tx
from exchange._core import compiled as _compiled
from exchange.frameworks import FRAMEWORKS, IGNORES_READ_ONLY, get_adapter
from dlpack_fixtures import Baseline, array_at
from process_helpers import run_python

NATIVE = _compiled()

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bfloat16 values")


def filled(shape, dtype="float32", start=0):
    """A writable tx tensor of our own (64-byte aligned) allocation: start, start+1, ..."""
    t = tx.empty(shape, dtype)
    array_at(t.data_ptr, t.shape, t.strides, t.dtype.numpy)[...] = (
        np.arange(int(np.prod(shape))) + start).reshape(shape)
    return t


def values(t):
    return array_at(t.data_ptr, t.shape, t.strides, t.dtype.numpy).copy()


def imported(name, reason):
    """``name`` imported for the rest of this process, its objects frozen out of the garbage
    collector as tests/conftest.py does for what collection imported: with these four
    loaded unfrozen (about 400,000 objects) a full ``gc.collect()``, which the tests after
    these run before and after most cases, took 220 ms instead of nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Paddle's "No ccache found", from its C++ extension helper
        module = pytest.importorskip(name, reason=reason)
    gc.collect()
    gc.freeze()
    return module


def read_only(a):
    """A tx tensor over NumPy memory that is truly read-only."""
    a = np.array(a)
    a.flags.writeable = False
    t = tx.from_dlpack(a)
    assert t.mutability == "readonly"
    return t


def test_the_four_are_chain_frameworks():
    for name in ("paddle", "pyarrow", "tensorflow", "mlx"):
        assert name in FRAMEWORKS
    assert "paddle" in IGNORES_READ_ONLY  # its from_dlpack writes through READ_ONLY
    assert not {"pyarrow", "tensorflow", "mlx"} & IGNORES_READ_ONLY


# -- PaddlePaddle -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paddle():
    paddle = imported("paddle", "paddlepaddle is not installed")
    # Paddle's import installs C-level handlers for SIGSEGV, SIGABRT, SIGTERM and more;
    # the rest of this process's tests fork children and signal them expecting defaults.
    paddle.disable_signal_handler()
    return paddle


class TestPaddle:
    def test_tx_to_paddle_shares_memory_both_ways(self, paddle):
        base = Baseline()
        t = filled((3, 4))
        p = get_adapter("paddle").to_framework(t, None)
        assert p.data_ptr() == t.data_ptr and p.shape == [3, 4]
        np.testing.assert_array_equal(p.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
        p[1, 2] = -5.0
        assert values(t)[1, 2] == -5
        del t  # Paddle keeps our export alive
        assert float(p.sum()) == sum(range(12)) - 6 - 5
        del p
        base.assert_clean()

    def test_paddle_to_tx_through_its_exchange_table(self, paddle, monkeypatch):
        # On the compiled core tx.from_dlpack takes a Paddle tensor through Paddle's DLPack
        # C exchange table, never its __dlpack__; the pure path asks __dlpack__ (versioned).
        base = Baseline()
        calls = []
        dunder = paddle.Tensor.__dlpack__
        monkeypatch.setattr(paddle.Tensor, "__dlpack__", lambda self, **kw: calls.append(kw) or dunder(self, **kw))
        assert paddle.Tensor.__dlpack_c_exchange_api__ is not None
        p = paddle.arange(8, dtype="int32").reshape([2, 4])
        t = tx.from_dlpack(p)
        assert t.data_ptr == p.data_ptr() and t.shape == (2, 4) and t.dtype == "int32"
        assert t.mutability == "writable" and "paddle" in t.record.origin
        assert len(calls) == (0 if NATIVE else 1)
        np.from_dlpack(t)[1, 3] = 70
        assert int(p[1, 3]) == 70
        del p  # our tensor keeps Paddle's memory alive
        np.testing.assert_array_equal(values(t), [[0, 1, 2, 3], [4, 5, 6, 70]])
        del t
        base.assert_clean()

    @pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float16", "bool", "complex64", "uint8"])
    def test_dtypes_both_ways_zero_copy(self, paddle, name):
        t = filled((4,), name)
        p = paddle.from_dlpack(t)
        assert str(p.dtype) == f"paddle.{name}" and p.data_ptr() == t.data_ptr
        back = tx.from_dlpack(p)
        assert back.dtype == name and back.data_ptr == t.data_ptr
        np.testing.assert_array_equal(values(back), values(t))

    def test_quirks_are_copies_or_clear_errors(self, paddle):
        adapter = get_adapter("paddle")
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        # Negative strides: Paddle's importer would ask for 2**64 bytes; a compact copy.
        flipped = tx.from_dlpack(a[::-1])
        p = adapter.to_framework(flipped, None)
        assert p.data_ptr() != flipped.data_ptr
        np.testing.assert_array_equal(p.numpy(), a[::-1])
        # Read-only memory: Paddle would write through the flag; it gets a copy.
        ro = read_only(a)
        p = adapter.to_framework(ro, None)
        p[0, 0] = 99.0
        assert values(ro)[0, 0] == 0 and p.data_ptr() != ro.data_ptr
        # A tensor that requires gradients: Paddle's own refusal, which says what to do.
        g = paddle.ones([3])
        g.stop_gradient = False
        with pytest.raises(BufferError, match="requires gradients"):
            tx.from_dlpack(g)
        assert tx.from_dlpack(g.detach()).shape == (3,)


# -- pyarrow ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pa():
    return imported("pyarrow", "pyarrow is not installed")


class TestPyArrow:
    def test_tx_to_pyarrow_array_and_tensor_zero_copy(self, pa):
        base = Baseline()
        adapter = get_adapter("pyarrow")
        t = filled((6,), "int64")
        arr = adapter.to_framework(t, None)
        assert isinstance(arr, pa.Array) and arr.type == pa.int64()
        assert adapter.data_ptr(arr) == t.data_ptr and arr.to_pylist() == list(range(6))
        m = filled((2, 3), "float32")
        ten = adapter.to_framework(m, None)
        assert isinstance(ten, pa.Tensor) and ten.shape == (2, 3) and ten.is_mutable
        assert adapter.data_ptr(ten) == m.data_ptr
        np.testing.assert_array_equal(ten.to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        del t, m  # pyarrow keeps our exports alive
        assert arr.to_pylist() == list(range(6)) and ten.to_numpy()[1, 2] == 5
        del arr, ten
        base.assert_clean()

    def test_pyarrow_to_tx_is_read_only_zero_copy(self, pa):
        base = Baseline()
        arr = pa.array(np.arange(10, dtype=np.float64)).slice(2, 5)
        t = tx.from_dlpack(arr)
        assert t.data_ptr == get_adapter("pyarrow").data_ptr(arr) and t.shape == (5,)
        assert t.mutability == "readonly"  # Arrow arrays are immutable and say so
        assert not np.from_dlpack(t).flags.writeable
        with pytest.raises(BufferError):
            t.__dlpack__()  # nor does it leave writable through a capsule that cannot say so
        del arr
        np.testing.assert_array_equal(values(t), [2, 3, 4, 5, 6])
        del t
        base.assert_clean()

    def test_read_only_stays_read_only_through_pyarrow(self, pa):
        ro = read_only(np.arange(6, dtype=np.float32).reshape(2, 3))
        ten = get_adapter("pyarrow").to_framework(ro, None)
        assert not ten.is_mutable  # pyarrow honours READ_ONLY on import
        assert tx.from_dlpack(ten).mutability == "readonly"

    def test_quirks_are_copies_or_clear_errors(self, pa):
        adapter = get_adapter("pyarrow")
        a = np.arange(12, dtype=np.int32).reshape(3, 4)
        strided = tx.from_dlpack(a[:, 1])  # 1-D, stride 4: an Array is contiguous, so a copy
        arr = adapter.to_framework(strided, None)
        assert isinstance(arr, pa.Array) and arr.to_pylist() == [1, 5, 9]
        assert adapter.data_ptr(arr) != strided.data_ptr
        flipped = tx.from_dlpack(a[::-1])  # pyarrow refuses negative strides: a copy
        np.testing.assert_array_equal(adapter.to_framework(flipped, None).to_numpy(), a[::-1])
        for name in ("bool", "bfloat16", "complex64", "float8_e5m2"):
            with pytest.raises(TypeError, match=f"pyarrow's DLPack takes no {name}"):
                adapter.to_framework(tx.empty((3,), name), None)
        with pytest.raises(pa.ArrowTypeError, match="no nulls"), warnings.catch_warnings():
            # ArrowTypeError is a TypeError, so tx asks again without max_version, which
            # pyarrow says is deprecated before refusing the same way
            warnings.simplefilter("ignore", DeprecationWarning)
            tx.from_dlpack(pa.array([1.0, None]))
        one = pa.chunked_array([[1.0, 2.0]])
        assert adapter.from_framework(one, None).data_ptr == adapter.data_ptr(one)  # one chunk: shared
        two = pa.chunked_array([[1.0], [2.0, 3.0]])
        np.testing.assert_array_equal(values(adapter.from_framework(two, None)), [1, 2, 3])


# -- TensorFlow ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # its start-up notices, on stderr
    return imported("tensorflow", "tensorflow-cpu is not installed")


class TestTensorFlow:
    def test_tx_to_tensorflow_zero_copy(self, tf):
        base = Baseline()
        adapter = get_adapter("tensorflow")
        t = filled((3, 4))
        x = adapter.to_framework(t, None)
        assert adapter.data_ptr(x) == t.data_ptr and x.shape == (3, 4) and x.dtype == tf.float32
        np.testing.assert_array_equal(tf.reduce_sum(x, axis=0).numpy(), [12, 15, 18, 21])
        del t  # TensorFlow keeps our export alive
        assert float(tf.reduce_sum(x)) == sum(range(12))
        del x
        base.assert_clean()

    def test_tensorflow_to_tx_immutable_zero_copy(self, tf):
        base = Baseline()
        x = tf.reshape(tf.range(6, dtype=tf.int64), (2, 3)) * 2
        t = tx.from_dlpack(x)
        assert t.data_ptr == get_adapter("tensorflow").data_ptr(x) and t.shape == (2, 3)
        assert t.mutability == "readonly"  # a legacy capsule, and TensorFlow's tensors never change
        del x
        np.testing.assert_array_equal(values(t), [[0, 2, 4], [6, 8, 10]])
        del t
        base.assert_clean()

    def test_misaligned_memory_goes_as_an_aligned_copy_never_a_crash(self, tf):
        # TensorFlow's kernels abort the process (SIGABRT) on memory not 64-byte aligned,
        # such as a NumPy buffer's. The pointer is checked before any kernel runs.
        adapter = get_adapter("tensorflow")
        a = np.arange(40, dtype=np.float32)
        start = next(i for i in range(16) if (a.ctypes.data + 4 * i) % 64)
        t = tx.from_dlpack(a[start:start + 16])
        assert t.data_ptr % 64
        x = adapter.to_framework(t, None)
        assert adapter.data_ptr(x) % 64 == 0 and adapter.data_ptr(x) != t.data_ptr
        np.testing.assert_array_equal((x + 1).numpy(), a[start:start + 16] + 1)
        assert adapter.alignment == 64

    def test_quirks_are_copies_or_clear_errors(self, tf):
        adapter = get_adapter("tensorflow")
        base = tx.empty((4, 6), "float64")
        np.from_dlpack(base)[...] = np.arange(24.0).reshape(4, 6)
        view = tx.from_dlpack(np.from_dlpack(base).T)  # aligned, not C-contiguous: a copy
        assert view.data_ptr % 64 == 0 and not view.is_contiguous()
        np.testing.assert_array_equal(adapter.to_framework(view, None).numpy(), np.arange(24.0).reshape(4, 6).T)
        with pytest.raises(TypeError, match="takes no float8_e4m3fn"):
            adapter.to_framework(tx.empty((2,), "float8_e4m3fn"), None)
        # Read-only memory goes through a legacy capsule (TensorFlow never writes it);
        # its ops leave the source as it was.
        src = tx.empty((8,), "float32")
        n = np.from_dlpack(src)
        n[...] = 1
        n.flags.writeable = False
        ro = tx.from_dlpack(n)
        x = adapter.to_framework(ro, None)
        assert adapter.data_ptr(x) == ro.data_ptr
        assert float(tf.reduce_sum(tf.nn.relu(x * 3) + x)) == 32.0
        np.testing.assert_array_equal(values(ro), np.ones(8))


# -- MLX ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mx():
    return imported("mlx.core", "mlx (mlx[cpu]) is not installed")


class TestMlx:
    def test_tx_to_mlx_copies_and_says_why(self, mx):
        base = Baseline()
        adapter = get_adapter("mlx")
        assert "memory of its own" in adapter.import_copies
        t = filled((3, 4), "bfloat16")
        m = adapter.to_framework(t, None)
        assert m.dtype == mx.bfloat16 and tuple(m.shape) == (3, 4)
        assert adapter.data_ptr(m) != t.data_ptr  # MLX 0.32 on Linux copies on import
        np.testing.assert_array_equal(np.array(m.astype(mx.float32)), values(t).astype(np.float32))
        del t, m
        base.assert_clean()

    def test_mlx_to_tx_immutable_zero_copy(self, mx):
        base = Baseline()
        m = mx.arange(6, dtype=mx.float32).reshape(2, 3) * 2  # lazy: the export evaluates it
        t = tx.from_dlpack(m)
        assert t.data_ptr == get_adapter("mlx").data_ptr(m) and t.mutability == "readonly"
        m[0, 0] = 100  # MLX updates into a new buffer while the export holds this one
        mx.eval(m)
        del m
        np.testing.assert_array_equal(values(t), [[0, 2, 4], [6, 8, 10]])
        del t
        base.assert_clean()

    def test_values_never_change_on_the_way_in(self, mx):
        adapter = get_adapter("mlx")
        # mx.from_dlpack would make float64 float32 (1e300 -> inf): the adapter keeps float64
        big = tx.from_dlpack(np.array([1e300, 1 / 3]))
        m = adapter.to_framework(big, None)
        assert m.dtype == mx.float64 and np.array(m).tolist() == [1e300, 1 / 3]
        with pytest.raises(TypeError, match="no complex128"):
            adapter.to_framework(tx.from_dlpack(np.ones(2, np.complex128)), None)
        with pytest.raises(TypeError, match="float8_e4m3fn"):
            adapter.to_framework(tx.empty((2,), "float8_e4m3fn"), None)
        a = np.arange(12, dtype=np.int32).reshape(3, 4)
        np.testing.assert_array_equal(np.array(adapter.to_framework(tx.from_dlpack(a[::-1, ::2]), None)), a[::-1, ::2])
        ro = read_only(a)
        np.testing.assert_array_equal(np.array(adapter.to_framework(ro, None)), a)


# -- all four in chains -------------------------------------------------------------------------------
def test_a_chain_through_all_four_reports_each_hop(paddle, pa, tf, mx):
    import pyarrow.compute as pc

    stages = [
        tx.Stage(lambda p: p + 1, framework="paddle", name="paddle"),
        tx.Stage(lambda x: tf.nn.relu(x - 3), framework="tensorflow", name="tf"),
        tx.Stage(lambda m: m * 10, framework="mlx", name="mlx"),
        tx.Stage(lambda a: pc.add(a, 1), framework="pyarrow", name="arrow"),
    ]
    base = Baseline()
    with tx.Chain(stages, max_in_flight=1) as chain:
        result = chain.run([filled((8,))])
    out = result.outputs[0]
    np.testing.assert_array_equal(values(out), np.maximum(np.arange(8) + 1 - 3, 0) * 10 + 1)
    assert out.mutability == "readonly"  # a pyarrow buffer never comes back writable
    hops = {(h["from"], h["to"]): h for h in result.hops}
    for shared in [("input", "paddle"), ("paddle", "tensorflow"), ("mlx", "pyarrow"), ("pyarrow", "tx")]:
        assert hops[shared]["shared"], hops[shared]
    into_mlx = hops[("tensorflow", "mlx")]
    assert not into_mlx["shared"] and into_mlx["reason"].startswith("mlx copies every input it takes: on Linux")
    del result, out
    base.assert_clean()


def test_strict_refuses_each_peers_copies_and_passes_what_they_share(paddle, pa, tf, mx):
    def chain(*stages):
        return tx.Chain([tx.Stage(fn, framework=f, name=f) for f, fn in stages], max_in_flight=1, strict=True)

    same = lambda x: x  # noqa: E731
    with chain(("paddle", same), ("tensorflow", same), ("pyarrow", same)) as c:
        assert all(h["shared"] for h in c.run([filled((8,))]).hops)
    with chain(("paddle", tx.from_dlpack), ("tensorflow", tx.from_dlpack), ("pyarrow", tx.from_dlpack)) as c:
        assert all(h["shared"] for h in c.run([filled((8,))]).hops)  # a stage may return a tx Tensor
    with pytest.raises(ValueError, match=r"hop paddle -> mlx .* would copy: mlx copies every input it takes"):
        chain(("paddle", same), ("mlx", same))
    a = np.arange(40, dtype=np.float32)
    start = next(i for i in range(16) if (a.ctypes.data + 4 * i) % 64)
    for framework, batch, why in [
        ("tensorflow", a[start:start + 8], "not 64-byte aligned .* which tensorflow needs"),
        ("paddle", read_only(a[:8]), "read-only memory .* paddle ignores DLPack's READ_ONLY flag"),
        ("paddle", tx.from_dlpack(a[::-1]), "paddle copied the data when it took it"),
        ("pyarrow", tx.from_dlpack(a[::2]), "pyarrow copied the data when it took it"),
        ("tensorflow", tx.from_dlpack(np.from_dlpack(filled((4, 4))).T), "tensorflow copied the data"),
    ]:
        with chain((framework, same)) as c, pytest.raises(ValueError, match=f"input -> {framework} .*{why}"):
            c.run([batch])


def test_read_only_peers_outputs_reach_paddle_as_copies(paddle, pa, tf):
    # pyarrow's buffers and TensorFlow's tensors are read-only; Paddle ignores the flag,
    # so its stage gets a copy, the hop says why, and the producers' memory is untouched.
    arrow_out = pa.array(np.zeros(4, dtype=np.float32))
    tf_out = tf.zeros((4,))

    def write(p):
        p[0] = 7.0
        return p

    for framework, fn, read_back in [("pyarrow", lambda _: arrow_out, lambda: arrow_out.to_numpy()),
                                     ("tensorflow", lambda _: tf_out, lambda: tf_out.numpy())]:
        stages = [tx.Stage(fn, framework=framework, name="src"), tx.Stage(write, framework="paddle", name="w")]
        with tx.Chain(stages, max_in_flight=1) as chain:
            result = chain.run([filled((4,))])
        assert values(result.outputs[0])[0] == 7
        hop = next(h for h in result.hops if h["to"] == "paddle")
        assert not hop["shared"] and "READ_ONLY" in hop["reason"], hop
        np.testing.assert_array_equal(read_back(), np.zeros(4))


@pytest.mark.once_per_ci  # a child process of its own, on the path it was given
def test_a_chain_from_tensorflow_to_paddle_imports_them_in_an_order_that_works():
    # Paddle imported after TensorFlow crashes the process (SIGSEGV in Paddle's import):
    # a chain that names them in that order must still run.
    pytest.importorskip("paddle")
    pytest.importorskip("tensorflow")
    out = run_python("""
        import numpy as np, exchange as tx
        chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="tensorflow"),
                          tx.Stage(lambda x: x + 1, framework="paddle")])
        out = chain(np.arange(4.0))
        print(np.from_dlpack(out).tolist())
    """, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split("\n")[-2] == "[1.0, 3.0, 5.0, 7.0]", out.stdout


@pytest.mark.once_per_ci  # a child process: a regression aborts it
def test_a_tensorflow_stage_returning_strings_is_a_stage_error_not_an_abort():
    pytest.importorskip("tensorflow")
    out = run_python("""
        import numpy as np, exchange as tx
        import tensorflow as tf
        chain = tx.Chain([tx.Stage(lambda x: tf.strings.as_string(x), framework="tensorflow")])
        try:
            chain(np.arange(4.0))
        except tx.StageError as exc:
            print("refused:", exc)
    """, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused:" in out.stdout and "string" in out.stdout, out.stdout


def test_a_one_element_strided_view_reaches_pyarrow_as_an_array(pa):
    t = filled((16,), "float32")
    view = tx.from_dlpack(np.from_dlpack(t)[::16])
    chain = tx.Chain([tx.Stage(lambda a: a, framework="pyarrow")])
    run = chain.run([view])
    assert values(run.outputs[0]).tolist() == [0.0]
    assert run.hops[0]["shared"] is False  # pyarrow takes a stride of one element only: a copy


def test_doctor_sees_what_pyarrow_and_tensorflow_ask_of_a_producer(pa, tf):
    from exchange.cli import doctor

    for name in ("pyarrow", "tensorflow"):
        asked = doctor._consumer(get_adapter(name), filled((4,)))
        assert asked.get("passes") is not None, (name, asked)
