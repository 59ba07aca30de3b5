"""Real peers on the CPU, both directions: NumPy, PyTorch, JAX, tvm-ffi, ONNX Runtime.

Each exchange must share memory (same data address) and keep values, and once both
sides are dropped the registry is back where it started (every export released, every
import's producer deleter called). A peer is skipped only when it cannot be imported.
"""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from dlpack_fixtures import Baseline, CapsuleView, array_at, capsule_name

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bfloat16 values")


def filled(shape, dtype="float32", start=0):
    """A writable tx tensor of our own (64-byte aligned) allocation: start, start+1, ..."""
    t = tx.empty(shape, dtype)
    np.from_dlpack(t)[...] = (np.arange(int(np.prod(shape))) + start).astype(dtype).reshape(shape)
    return t


def values(t):
    return array_at(t.data_ptr, t.shape, t.strides, t.dtype.numpy).copy()


# -- NumPy -------------------------------------------------------------------------------------------
class TestNumPy:
    def test_tx_to_numpy_shares_memory_both_ways(self):
        base = Baseline()
        t = filled((3, 4))
        a = np.from_dlpack(t)
        assert a.ctypes.data == t.data_ptr and a.flags.writeable
        np.testing.assert_array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))
        a[2, 3] = -1
        assert values(t)[2, 3] == -1
        del t  # NumPy's array keeps the memory alive
        assert a[2, 3] == -1 and a.sum() == np.arange(11).sum() - 1
        del a
        base.assert_clean()

    def test_numpy_to_tx_shares_memory_both_ways(self):
        base = Baseline()
        a = np.arange(10, dtype=np.int64)
        t = tx.from_dlpack(a)
        assert t.data_ptr == a.ctypes.data
        np.from_dlpack(t)[0] = 99
        assert a[0] == 99
        del a  # our tensor keeps NumPy's array alive
        np.testing.assert_array_equal(values(t), [99, *range(1, 10)])
        del t
        base.assert_clean()

    def test_numpy_asks_for_a_copy_or_the_cpu(self):
        base = Baseline()
        t = filled((4,))
        c = np.from_dlpack(t, copy=True)
        assert c.ctypes.data != t.data_ptr and c.flags.writeable
        np.testing.assert_array_equal(c, values(t))
        d = np.from_dlpack(t, device="cpu")
        assert d.ctypes.data == t.data_ptr
        del t, c, d
        base.assert_clean()


# -- PyTorch -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


class TestTorch:
    def test_tx_to_torch(self, torch):
        base = Baseline()
        t = filled((3, 4))
        tt = torch.from_dlpack(t)
        assert tt.data_ptr() == t.data_ptr and tuple(tt.shape) == (3, 4) and tt.dtype == torch.float32
        assert torch.equal(tt, torch.arange(12, dtype=torch.float32).reshape(3, 4))
        tt[0, 1] = 100.0
        assert values(t)[0, 1] == 100
        del t  # torch keeps our export alive
        assert tt[0, 1].item() == 100.0 and tt.sum().item() == sum(range(12)) - 1 + 100
        del tt
        base.assert_clean()

    def test_tx_strided_to_torch(self, torch):
        base = Baseline()
        a = np.arange(24, dtype=np.float64).reshape(4, 6)
        t = tx.from_dlpack(a.T[::2])  # transposed, every other row: strides (2, 6) elements
        tt = torch.from_dlpack(t)
        assert tt.data_ptr() == t.data_ptr and tuple(tt.stride()) == t.strides
        assert np.array_equal(tt.numpy(), a.T[::2])
        del t, tt
        base.assert_clean()

    def test_torch_to_tx(self, torch):
        base = Baseline()
        tt = torch.arange(8, dtype=torch.int32).reshape(2, 4)
        t = tx.from_dlpack(tt)
        assert t.data_ptr == tt.data_ptr() and t.shape == (2, 4) and t.dtype == "int32" and not t.readonly
        assert "torch" in t.record.origin
        np.from_dlpack(t)[1, 3] = -7
        assert tt[1, 3].item() == -7
        del tt  # our tensor keeps torch's storage alive
        np.testing.assert_array_equal(values(t), [[0, 1, 2, 3], [4, 5, 6, -7]])
        del t
        base.assert_clean()

    def test_torch_transposed_to_tx(self, torch):
        base = Baseline()
        tt = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
        t = tx.from_dlpack(tt)
        assert t.strides == tuple(tt.stride()) and t.data_ptr == tt.data_ptr()
        np.testing.assert_array_equal(values(t), tt.numpy())
        del t, tt
        base.assert_clean()

    @pytest.mark.parametrize("how", ["to_dlpack", "__dlpack__", "__dlpack__(1,3)"])
    def test_torch_capsules_to_tx(self, torch, how):
        base = Baseline()
        tt = torch.arange(6, dtype=torch.float64)
        cap = {"to_dlpack": lambda: torch.utils.dlpack.to_dlpack(tt), "__dlpack__": tt.__dlpack__,
               "__dlpack__(1,3)": lambda: tt.__dlpack__(max_version=(1, 3))}[how]()
        legacy = how != "__dlpack__(1,3)"
        assert capsule_name(cap) == ("dltensor" if legacy else "dltensor_versioned")
        t = tx.from_dlpack(cap)
        assert t.data_ptr == tt.data_ptr()
        assert t.readonly is legacy  # a legacy capsule cannot say writable: read-only on import
        np.testing.assert_array_equal(values(t), np.arange(6.0))
        del cap, tt, t
        base.assert_clean()

    @pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "bool", "complex64"])
    def test_dtypes_both_ways(self, torch, name):
        base = Baseline()
        tt = (torch.arange(8, dtype=torch.float32) - 3).to(getattr(torch, name))
        t = tx.from_dlpack(tt)
        assert t.dtype.name == name and t.data_ptr == tt.data_ptr()
        np.testing.assert_array_equal(values(t).astype(np.float32) if name != "complex64" else values(t),
                                      tt.to(torch.float32).numpy() if name != "complex64" else tt.numpy())
        back = torch.from_dlpack(t)
        assert back.dtype == tt.dtype and back.data_ptr() == tt.data_ptr() and torch.equal(back, tt)
        del tt, t, back
        base.assert_clean()


# -- JAX ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jax():
    return pytest.importorskip("jax", reason="JAX is not installed")


class TestJax:
    @pytest.mark.parametrize("entry", ["jnp.from_dlpack", "jax.dlpack.from_dlpack"])
    def test_tx_to_jax_zero_copy(self, jax, entry):
        import jax.dlpack
        import jax.numpy as jnp

        base = Baseline()
        t = filled((4, 8))
        assert t.data_ptr % 64 == 0  # JAX copies misaligned buffers; ours are aligned
        fn = jnp.from_dlpack if entry == "jnp.from_dlpack" else jax.dlpack.from_dlpack
        j = fn(t)
        assert j.unsafe_buffer_pointer() == t.data_ptr
        np.testing.assert_array_equal(np.asarray(j), np.arange(32, dtype=np.float32).reshape(4, 8))
        del t  # JAX keeps our export alive
        assert float(j.sum()) == sum(range(32))
        del j
        base.assert_clean()

    def test_jax_to_tx(self, jax):
        import jax.numpy as jnp

        base = Baseline()
        j = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 2
        t = tx.from_dlpack(j)
        assert t.data_ptr == j.unsafe_buffer_pointer() and t.shape == (3, 4) and t.dtype == "float32"
        assert t.readonly  # JAX arrays are immutable and say so
        np.testing.assert_array_equal(np.from_dlpack(t), np.arange(12, dtype=np.float32).reshape(3, 4) * 2)
        del j
        np.testing.assert_array_equal(values(t)[2], [16, 18, 20, 22])
        del t
        base.assert_clean()

    def test_jax_bfloat16_to_tx_and_back_zero_copy(self, jax):
        # Issue 14 item 3: JAX -> tx -> JAX works, zero-copy. JAX answers and asks with
        # legacy capsules only; memory that came in through a legacy capsule may go out
        # through one (its producer hands it out so to anyone), so nothing new is opened.
        import jax.numpy as jnp

        base = Baseline()
        j = jnp.arange(6, dtype=jnp.bfloat16) - 2
        t = tx.from_dlpack(j)
        assert t.dtype.name == "bfloat16" and t.data_ptr == j.unsafe_buffer_pointer()
        assert t.readonly and t.mutability == "readonly"  # JAX arrays are immutable
        np.testing.assert_array_equal(values(t).astype(np.float32), np.arange(6, dtype=np.float32) - 2)
        back = jax.dlpack.from_dlpack(t)
        assert back.unsafe_buffer_pointer() == t.data_ptr and bool((back == j).all())
        again = jax.dlpack.from_dlpack(tx.from_dlpack(jnp.arange(6.0)))  # the reproducer
        assert float(again.sum()) == 15.0
        del j, t, back, again
        base.assert_clean()

    def test_truly_read_only_memory_still_refuses_a_legacy_capsule(self, jax):
        # ... but memory that is read-only by a versioned READ_ONLY flag (a read-only
        # NumPy array) never goes out legacy, where a writer could not be told.
        base = Baseline()
        a = np.arange(4.0)
        a.flags.writeable = False
        t = tx.from_dlpack(a)
        assert t.mutability == "readonly"
        with pytest.raises(BufferError, match="read-only"):
            t.__dlpack__()
        with pytest.raises(BufferError, match="read-only"):
            jax.dlpack.from_dlpack(t)
        w = tx.from_dlpack(t, copy=True)  # a writable copy can go
        assert float(jax.dlpack.from_dlpack(w).sum()) == 6.0
        del t, w
        base.assert_clean()


# -- tvm-ffi -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tvm_ffi():
    return pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")


class TestTvmFfi:
    def test_tx_to_tvm_ffi(self, tvm_ffi):
        base = Baseline()
        t = filled((2, 3), "int32")
        v = tvm_ffi.from_dlpack(t, require_alignment=64)
        assert v.data_ptr() == t.data_ptr and tuple(v.shape) == (2, 3) and tuple(v.strides) == (3, 1)
        back = np.from_dlpack(v)
        assert back.ctypes.data == t.data_ptr
        back[0, 0] = 41
        assert values(t)[0, 0] == 41
        del t, back
        assert np.from_dlpack(v)[0, 0] == 41  # tvm-ffi keeps our export alive
        del v
        base.assert_clean()

    def test_tvm_ffi_to_tx(self, tvm_ffi):
        base = Baseline()
        a = np.arange(6, dtype=np.float32)
        v = tvm_ffi.from_dlpack(a)
        del a
        t = tx.from_dlpack(v)
        assert t.data_ptr == v.data_ptr() and not t.readonly
        np.testing.assert_array_equal(values(t), np.arange(6, dtype=np.float32))
        del v
        np.testing.assert_array_equal(values(t), np.arange(6, dtype=np.float32))
        del t
        base.assert_clean()

    @pytest.mark.parametrize("max_version", [None, (1, 3)])
    def test_tvm_ffi_capsules_to_tx(self, tvm_ffi, max_version):
        base = Baseline()
        src = filled((5,))
        v = tvm_ffi.from_dlpack(src)
        cap = v.__dlpack__(max_version=max_version)
        assert CapsuleView(cap).data == src.data_ptr
        t = tx.from_dlpack(cap)
        assert t.data_ptr == src.data_ptr and t.readonly is (max_version is None)
        del src, v, cap
        np.testing.assert_array_equal(values(t), np.arange(5, dtype=np.float32))
        del t
        base.assert_clean()


# -- ONNX Runtime ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort():
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")


class TestOnnxRuntime:
    def test_tx_to_ortvalue(self, ort):
        base = Baseline()
        t = filled((2, 3))
        ov = ort.OrtValue.from_dlpack(t)
        assert ov.data_ptr() == t.data_ptr and ov.shape() == [2, 3] and ov.data_type() == "tensor(float)"
        np.testing.assert_array_equal(ov.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        del t  # the OrtValue keeps our export alive
        np.testing.assert_array_equal(ov.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        del ov
        base.assert_clean()

    def test_ortvalue_to_tx_through_its_stream_only_dlpack(self, ort):
        base = Baseline()
        ov = ort.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.int64))
        t = tx.from_dlpack(ov)  # ORT's __dlpack__ takes no max_version: tx falls back
        assert t.data_ptr == ov.data_ptr() and t.readonly  # a legacy capsule
        np.testing.assert_array_equal(values(t), np.arange(4))
        del ov
        np.testing.assert_array_equal(values(t), np.arange(4))
        del t
        base.assert_clean()

    def test_ortvalue_raw_capsules_to_tx(self, ort):
        from onnxruntime.capi import _pybind_state as C

        base = Baseline()
        src = filled((3,), "float64")
        ov = C.OrtValue.from_dlpack(src.__dlpack__())  # the binding takes a raw legacy capsule
        cap = ov.to_dlpack()
        assert capsule_name(cap) == "dltensor"
        t = tx.from_dlpack(cap)
        assert t.data_ptr == src.data_ptr
        cap2 = ort.OrtValue.from_dlpack(src).__dlpack__()
        t2 = tx.from_dlpack(cap2)
        assert t2.data_ptr == src.data_ptr
        del src, ov, cap, cap2
        np.testing.assert_array_equal(values(t), [0.0, 1.0, 2.0])
        del t, t2
        base.assert_clean()

    def test_session_runs_on_tx_memory_and_its_output_outlives_it(self, ort):
        onnx = pytest.importorskip("onnx", reason="onnx is not installed")
        from onnx import TensorProto, helper

        base = Baseline()
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ"]
        graph = helper.make_graph([helper.make_node("Add", ["X", "Y"], ["Z"])], "add", io[:2], io[2:])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x, y = filled((2, 3)), filled((2, 3), start=10)
        feeds = {"X": ort.OrtValue.from_dlpack(x), "Y": ort.OrtValue.from_dlpack(y)}
        (out,) = session.run_with_ort_values(["Z"], feeds)
        z = tx.from_dlpack(out)
        assert z.data_ptr == out.data_ptr()
        del out, feeds, session, x, y
        np.testing.assert_array_equal(values(z), np.arange(6).reshape(2, 3) * 2 + 10)
        del z
        base.assert_clean()
