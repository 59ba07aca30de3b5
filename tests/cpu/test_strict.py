"""No silent copies, when asked: ``tx.Chain(..., strict=True)`` refuses every kind of hop
that would copy, before the stage it feeds runs, with a ValueError naming the hop and
why; without it the same hops copy and say so. And ``copy=False`` keeps the same promise
on every path of ``tx.from_dlpack``, ``Tensor.__dlpack__`` and ``tx.share`` that copies
under ``copy=None`` (BufferError; ``tx.attach`` never copies, so it has no ``copy``)."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from exchange import frameworks
from exchange.frameworks.numpy_adapter import NumPyAdapter

# The fake CUDA backend (host memory posing as a device) of the CUDA-without-a-GPU tests:
# lets the device rows of the copy=False table copy for real under copy=None.
from test_cuda_without_gpu import FakeCudaProducer, fake_cuda  # noqa: F401

torch = pytest.importorskip("torch")


def _misaligned(n: int = 16, off: int = 16) -> np.ndarray:
    """float32 NumPy array of ``n`` elements whose first byte is ``off`` bytes past a
    64-byte boundary."""
    raw = np.zeros(n * 4 + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + off
    a = raw[start:start + n * 4].view(np.float32)
    a[:] = np.arange(n)
    return a


def _read_only(n: int = 4) -> np.ndarray:
    """A read-only float32 NumPy array, 64-byte aligned (JAX takes it as it is)."""
    a = _misaligned(n, off=0)
    a.flags.writeable = False
    return a


class _Calls:
    """A stage function that counts its calls: refused hops must come before it runs."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0
        self.__name__ = "counted"

    def __call__(self, *args):
        self.n += 1
        return self.fn(*args)


def _run(chain, batches):
    try:
        return chain.run(batches)
    finally:
        chain.close()


# -- the flag --------------------------------------------------------------------------------
def test_strict_is_off_by_default_and_a_bool():
    chain = tx.Chain([tx.Stage(lambda x: x, framework="numpy")])
    assert chain.strict is False
    chain.close()
    with pytest.raises(TypeError, match="strict"):
        tx.Chain([tx.Stage(lambda x: x, framework="numpy")], strict=1)


def test_a_numpy_chain_pays_nothing_per_batch_for_strict():
    # NumPy never copies on a hop by its contract: its stages keep the written-out path
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="numpy"), tx.Stage(lambda x: x + 1, framework="numpy")],
                     max_in_flight=1, strict=True)
    assert all(plan.plain for plan in chain._plans)
    run = _run(chain, [np.arange(4.0)])
    assert all(h["shared"] for h in run.hops)


def test_nothing_that_shares_is_refused():
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="numpy"),
                      tx.Stage(lambda x: x + 1, framework="torch"),
                      tx.Stage(lambda x: x - 1, framework="jax")], strict=True)
    x = np.arange(32, dtype=np.float32)
    run = _run(chain, [x, x])
    assert all(h["shared"] for h in run.hops), run.hops
    np.testing.assert_array_equal(np.from_dlpack(run.outputs[1]), x * 2)


def test_four_frameworks_under_strict_share_every_hop():
    # ONNX Runtime's outputs (legacy capsules, of unknown mutability) reach PyTorch as
    # they are; PyTorch's (64-byte aligned) reach JAX as they are
    pytest.importorskip("jax")
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from test_chain import _linear_softmax_model, _reference

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((16, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    chain = tx.Chain([tx.Stage(lambda x: x * np.float32(0.5), framework="numpy"),
                      tx.Stage(_linear_softmax_model(w, b), framework="onnxruntime"),
                      tx.Stage(lambda p: p * 2, framework="torch"),
                      tx.Stage(lambda p: p.argmax(axis=-1), framework="jax")], strict=True)
    xs = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(3)]
    run = _run(chain, xs)
    assert [h["to"] for h in run.hops] == ["numpy", "onnxruntime", "torch", "jax", "tx"]
    assert all(h["shared"] for hops in run.batch_hops for h in hops), run.batch_hops
    for x, out in zip(xs, run.outputs):
        np.testing.assert_array_equal(np.from_dlpack(out), _reference(x * 0.5, w, b).argmax(-1))


# -- read-only memory into a framework that ignores the flag ----------------------------------
@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_read_only_into_torch_is_refused_before_the_stage_runs(max_in_flight):
    fn = _Calls(lambda x: x.add_(1))
    chain = tx.Chain([tx.Stage(fn, framework="torch", name="bump")], max_in_flight=max_in_flight, strict=True)
    a = _read_only()
    with pytest.raises(ValueError, match=r"strict chain: the hop input -> torch into stage 0 'bump' would copy: "
                                         r"its input is read-only memory .*ignores DLPack's READ_ONLY"):
        _run(chain, [a])
    assert fn.n == 0
    assert (a == np.arange(4)).all()


def test_read_only_refused_on_a_call_too_and_between_stages():
    # chain(x) (no report) refuses as run does; a JAX array (immutable) into PyTorch too
    jnp = pytest.importorskip("jax.numpy")
    fn = _Calls(lambda x: x * 2)
    chain = tx.Chain([tx.Stage(lambda x: jnp.asarray(x) + 1, framework="jax", name="inc"),
                      tx.Stage(fn, framework="torch", name="double")], max_in_flight=1, strict=True)
    try:
        with pytest.raises(ValueError, match=r"the hop jax -> torch into stage 1 'double' would copy: .*read-only"):
            chain(torch.zeros(16))  # 64-byte aligned: JAX takes it as it is
    finally:
        chain.close()
    assert fn.n == 0


def test_read_only_into_a_stage_that_honours_it_is_not_refused():
    # NumPy honours READ_ONLY, JAX never writes: nothing to copy
    pytest.importorskip("jax")
    chain = tx.Chain([tx.Stage(lambda x: x, framework="numpy"), tx.Stage(lambda x: x, framework="jax")],
                     max_in_flight=1, strict=True)
    run = _run(chain, [tx.from_dlpack(_read_only(16)), _read_only(16)])
    assert all(h["shared"] for hops in run.batch_hops for h in hops)


def test_read_only_into_tvm_ffi_is_refused():
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    assert "tvm_ffi" in frameworks.IGNORES_READ_ONLY
    fn = _Calls(lambda x: x)
    chain = tx.Chain([tx.Stage(fn, framework="tvm_ffi", name="writer")], max_in_flight=1, strict=True)
    with pytest.raises(ValueError, match=r"input -> tvm_ffi into stage 0 'writer'.*read-only"):
        _run(chain, [_read_only()])
    assert fn.n == 0


# -- memory the framework cannot take as it is -------------------------------------------------
def test_misaligned_input_reaches_jax_as_an_aligned_copy_that_the_hop_reports():
    jax = pytest.importorskip("jax")
    assert frameworks.get_adapter("jax").alignment == 64
    seen = []

    def inc(x):
        seen.append(x.unsafe_buffer_pointer() % 64)
        return x + 1

    a = _misaligned()
    run = _run(tx.Chain([tx.Stage(inc, framework="jax", name="inc")], max_in_flight=1), [a])
    assert seen == [0]
    hop = run.hops[0]
    assert hop["shared"] is False and "not 64-byte aligned (16 bytes past)" in hop["reason"]
    assert "copied into aligned memory" in hop["reason"]
    np.testing.assert_array_equal(np.asarray(jax.device_get(np.from_dlpack(run.outputs[0]))), a + 1)


def test_misaligned_input_into_jax_is_refused_under_strict():
    pytest.importorskip("jax")
    fn = _Calls(lambda x: x + 1)
    # the NumPy stage hands on its input as it is: misaligned
    chain = tx.Chain([tx.Stage(lambda x: x, framework="numpy", name="same"),
                      tx.Stage(fn, framework="jax", name="inc")], max_in_flight=1, strict=True)
    with pytest.raises(ValueError, match=r"the hop numpy -> jax into stage 1 'inc' would copy: its input is not "
                                         r"64-byte aligned \(8 bytes past\), which jax needs"):
        _run(chain, [_misaligned(off=8)])
    assert fn.n == 0


def test_a_copy_the_framework_makes_itself_is_refused():
    # PyTorch cannot hold negative strides: its adapter hands it a compact copy
    neg = np.arange(8.0)[::-1]
    run = _run(tx.Chain([tx.Stage(lambda x: x * 2, framework="torch")], max_in_flight=1), [neg])
    assert run.hops[0]["shared"] is False and "copied the data when it took it" in run.hops[0]["reason"]
    fn = _Calls(lambda x: x * 2)
    chain = tx.Chain([tx.Stage(fn, framework="torch", name="double")], max_in_flight=1, strict=True)
    with pytest.raises(ValueError, match=r"input -> torch into stage 0 'double' would copy: torch copied the data"):
        _run(chain, [neg])
    assert fn.n == 0


def test_a_misaligned_out_buffer_is_refused_when_the_chain_is_made():
    pytest.importorskip("jax")
    buf = tx.from_dlpack(_misaligned())
    with pytest.raises(ValueError, match="out= buffer is not 64-byte aligned, which jax needs"):
        tx.Chain([tx.Stage(lambda x, out: out, framework="jax", name="j", out=buf)])


# -- copies decided by the plan -----------------------------------------------------------------
def test_a_change_of_device_is_refused_when_the_chain_is_made():
    # refused before any stream is made: no device needed to see it
    with pytest.raises(ValueError, match=r"the hop numpy -> torch into stage 1 'gpu' would copy: stage 0 runs on "
                                         r"cpu and stage 1 on cuda:0"):
        tx.Chain([tx.Stage(lambda x: x, framework="numpy"),
                  tx.Stage(lambda x: x, framework="torch", name="gpu", device="cuda:0")], strict=True)
    with pytest.raises(ValueError, match=r"stage 0 runs on cuda:0 and stage 1 on cuda:1"):
        tx.Chain([tx.Stage(lambda x: x, framework="torch"),
                  tx.Stage(lambda x: x, framework="torch", device="cuda:1")], device="cuda:0", strict=True)


class _CopyingNumPy(NumPyAdapter):
    """A framework whose import always copies (as MLX's does): none here does."""

    name = "copying"
    zero_copy = False
    import_copies = "its DLPack import makes an array of its own"

    def to_framework_fn(self, stream):
        return lambda t: np.array(np.from_dlpack(t))


class _CopyingExport(NumPyAdapter):
    """A framework whose outputs come into tx as copies: none here does."""

    name = "exporting"
    zero_copy = False

    def from_framework_fn(self, stream):
        return lambda x: tx.from_dlpack(np.array(x))


@pytest.fixture
def fake_frameworks(monkeypatch):
    monkeypatch.setitem(frameworks._cache, "copying", _CopyingNumPy())
    monkeypatch.setitem(frameworks._cache, "exporting", _CopyingExport())


def test_a_framework_that_always_copies_is_reported_and_refused(fake_frameworks):
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="numpy"), tx.Stage(lambda x: x + 1, framework="copying")])
    run = _run(chain, [np.arange(4.0)])
    hop = run.hops[1]
    assert hop["shared"] is False and hop["reason"] == ("copying copies every input it takes: its DLPack import "
                                                        "makes an array of its own")
    with pytest.raises(ValueError, match=r"the hop numpy -> copying into stage 1 'c' would copy: copying copies "
                                         r"every input it takes"):
        tx.Chain([tx.Stage(lambda x: x, framework="numpy"), tx.Stage(lambda x: x, framework="copying", name="c")],
                 strict=True)


def test_an_output_copied_into_tx_is_refused_before_the_next_stage(fake_frameworks):
    fn = _Calls(lambda x: x)
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="exporting", name="e"), tx.Stage(fn, framework="numpy")],
                     max_in_flight=1, strict=True)
    with pytest.raises(ValueError, match=r"the hop exporting -> numpy out of stage 0 'e' would copy: the output of "
                                         r"exporting was copied on its way into tx"):
        _run(chain, [np.arange(4.0)])
    assert fn.n == 0


def test_strict_with_an_executor_says_it_does_not_reach_there():
    # refused before Ray is looked for
    with pytest.raises(ValueError, match="strict=True is for in-process chains"):
        tx.Chain([tx.Stage(lambda x: x, framework="numpy")], executor="ray", strict=True)


# -- copy=False: every path that copies under copy=None raises BufferError -----------------------
def _cpu(n=4):
    return np.arange(n, dtype=np.float32)


# (name, make the source, take it with copy=...): each copies under copy=None
_DEVICE_COPIES = [
    ("from_dlpack: NumPy array to cuda:0", lambda: _cpu(), lambda x, c: tx.from_dlpack(x, device="cuda:0", copy=c)),
    ("from_dlpack: tx.Tensor to cuda:0", lambda: tx.from_dlpack(_cpu()),
     lambda x, c: tx.from_dlpack(x, device="cuda:0", copy=c)),
    ("from_dlpack: capsule to cuda:0", lambda: _cpu().__dlpack__(max_version=(1, 0)),
     lambda x, c: tx.from_dlpack(x, device="cuda:0", copy=c)),
    ("from_dlpack: cuda tx.Tensor to cpu", lambda: tx.from_dlpack(_cpu(), device="cuda:0"),
     lambda x, c: tx.from_dlpack(x, device="cpu", copy=c)),
    ("from_dlpack: old producer of cuda memory to cpu",
     lambda: FakeCudaProducer(tx.from_dlpack(_cpu(), device="cuda:0"), refuses={"max_version", "dl_device", "copy"}),
     lambda x, c: tx.from_dlpack(x, device="cpu", copy=c)),
    ("from_dlpack: producer of cuda memory to cpu", lambda: FakeCudaProducer(tx.from_dlpack(_cpu(), device="cuda:0")),
     lambda x, c: tx.from_dlpack(x, device="cpu", copy=c)),
    ("Tensor.__dlpack__: cuda to dl_device cpu", lambda: tx.from_dlpack(_cpu(), device="cuda:0"),
     lambda x, c: tx.from_dlpack(x.__dlpack__(dl_device=(1, 0), copy=c, max_version=(1, 3)))),
]


def _shared_read_only():
    from exchange.tensor import Tensor

    t = tx.empty(4, "float32", shared=True)
    return Tensor._make(t.record, t.data_ptr, t.shape, t.strides, t.dtype, True)


_SHARE_COPIES = [
    ("share: private memory", lambda: tx.from_dlpack(_cpu())),
    ("share: read-only over writable shared memory", _shared_read_only),
    ("share: an arena block asked isolated", lambda: tx.empty(4, "float32", shared=True)),
]


@pytest.mark.parametrize("name,make,take", _DEVICE_COPIES, ids=[r[0] for r in _DEVICE_COPIES])
def test_device_copies_copy_under_none_and_refuse_under_false(fake_cuda, name, make, take):  # noqa: F811
    src = make()
    copied = take(src, None)
    assert isinstance(copied, tx.Tensor)
    ptr = getattr(src, "data_ptr", None) if not isinstance(src, FakeCudaProducer) else src.tensor.data_ptr
    if isinstance(ptr, int):
        assert copied.data_ptr != ptr, "copy=None was expected to copy here"
    with pytest.raises(BufferError, match="copy=False"):
        take(make(), False)
    del copied, src


@pytest.mark.parametrize("name,make", _SHARE_COPIES, ids=[r[0] for r in _SHARE_COPIES])
def test_share_copies_under_none_and_refuses_under_false(name, make):
    isolated = "isolated" in name
    t = make()
    h = tx.share(t, isolated=isolated)
    assert h._f is not None
    with pytest.raises(BufferError, match="cannot be shared without a copy"):
        tx.share(t, copy=False, isolated=isolated)
    h.close()
    del t, h


def test_borrowed_memory_copies_under_none_and_refuses_under_false():
    buf = bytearray(16)
    with tx.borrow(buf, shape=(4,), dtype="float32") as view:
        with pytest.raises(BufferError, match="borrowed"):
            tx.share(view, copy=False)
        tx.share(view).close()


def test_copy_false_takes_what_needs_no_copy():
    # the rows above refuse only because they copy: the same calls with nothing to copy pass
    a = _cpu()
    t = tx.from_dlpack(a, copy=False)
    assert t.data_ptr == a.ctypes.data
    assert tx.from_dlpack(t, device="cpu", copy=False).data_ptr == t.data_ptr
    assert tx.from_dlpack(t.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 3))).data_ptr == t.data_ptr
    s = tx.empty(4, "float32", shared=True)
    tx.share(s, copy=False).close()


def test_numpy_protocol_copy_false_refuses_a_conversion():
    # NumPy's __array__ protocol says ValueError (not BufferError) for copy=False
    t = tx.from_dlpack(_cpu())
    assert np.asarray(t, dtype=np.float64).dtype == np.float64  # copy=None converts, into a copy
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(t, dtype=np.float64, copy=False)
