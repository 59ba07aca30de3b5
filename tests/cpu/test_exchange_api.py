"""The DLPack C exchange API this library publishes (issue 19 item 10): it never hands out
read-only memory, it orders what it exports as ``__dlpack__()`` does, and tvm-ffi gets
the same outcome from both paths (the compiled core's table, the pure path's
``__dlpack__``).

Its consumers cannot be told read-only (tvm-ffi ignores DLPack's READ_ONLY flag; a
DLTensor has no flags) and name no stream, so both entry points,
``managed_tensor_from_py_object_no_sync`` and ``dltensor_from_py_object_no_sync``,
refuse a read-only tensor with BufferError (tvm_ffi.from_dlpack then falls back to a
legacy ``__dlpack__()``, which refuses it too: docs/design.md, "The protocol"), and data still
being written on a stream of ours is made ready first. The device half of the ordering
is tests/gpu/test_gpu_exchange_api.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import exchange as tx
from exchange import _dlpack_abi as abi
from exchange._core import compiled as _compiled

NATIVE = _compiled()
from lifetime_helpers import no_leaks

HERE = pathlib.Path(__file__).resolve().parent
COMPILED = pytest.mark.skipif(not NATIVE, reason="the DLPack C exchange API is published by the compiled core")


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


# -- tvm-ffi, on both paths ----------------------------------------------------------------------
# Each case makes a tx Tensor and hands it to tvm-ffi twice: tvm_ffi.from_dlpack, and a
# tvm-ffi function call (testing.echo, which returns its argument as an ffi.Tensor). The
# outcome: the values tvm-ffi sees, or the exception; and whether the source changed.
_TVM_FFI_CASES = r"""
import json, threading, time
import numpy as np
import tvm_ffi
import exchange as tx
from exchange._core import compiled as _compiled

NATIVE = _compiled()

echo = tvm_ffi.get_global_func("testing.echo")
N = 1 << 16


def read_only_numpy():
    src = np.arange(4, dtype=np.float32)
    src.flags.writeable = False
    return tx.from_dlpack(src), src  # a versioned capsule with READ_ONLY: truly read-only


def read_only_borrow():
    src = bytes(np.arange(4, dtype=np.float32).tobytes())
    scope = tx.borrow(src, dtype="float32")
    return scope.__enter__(), scope


def legacy_import():
    src = np.arange(4, dtype=np.float32)
    return tx.from_dlpack(src.__dlpack__()), src  # a legacy capsule: read-only "unknown", as it goes out


def writable():
    src = np.arange(4, dtype=np.float32)
    return tx.from_dlpack(src), src


def written_on_a_host_stream():
    # the data is written on a host stream of ours; tvm-ffi reads it at once: it must see
    # the finished writes (a CPU export is host-ready on return)
    s = tx.create_stream("cpu")
    t = tx.empty(N, "float32", stream=s)
    gate = threading.Event()

    def write(out):
        gate.wait(5)
        time.sleep(0.2)
        out[...] = 7.0

    s.submit(lambda: gate.wait(5))
    s.submit(write, t.numpy())
    gate.set()
    return t, s


def outcome(make, consume):
    t, keep = make()
    try:
        x = consume(t)
        got = np.from_dlpack(x)
        return ["ok", float(got.sum()), got.ctypes.data == t.data_ptr]
    except Exception as exc:
        return ["refused", type(exc).__name__, str(exc)]
    finally:
        if hasattr(keep, "__exit__"):
            del t
            try:
                keep.__exit__(None, None, None)
            except Exception as exc:
                return ["scope", type(exc).__name__, str(exc)]


out = {}
for name, make in [("read-only numpy", read_only_numpy), ("read-only borrow", read_only_borrow),
                   ("legacy import", legacy_import), ("writable", writable),
                   ("written on a host stream", written_on_a_host_stream)]:
    for how, consume in [("from_dlpack", tvm_ffi.from_dlpack), ("function call", echo)]:
        out[f"{name}, {how}"] = outcome(make, consume)
tx.registry().collect(10)
stats = tx.registry().stats()
print(json.dumps({"native": NATIVE, "outcomes": out,
                  "left": [stats["live_records"], stats["exports_outstanding"]]}))
"""


def _tvm_ffi_outcomes(pure: bool) -> dict:
    env = dict(os.environ, EXCHANGE_PURE_PYTHON="1" if pure else "0")
    proc = subprocess.run([sys.executable, "-c", _TVM_FFI_CASES], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.once_per_ci  # runs both paths in children of its own
def test_tvm_ffi_gets_the_same_outcome_from_both_paths_and_never_a_writable_read_only_tensor():
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    pure = _tvm_ffi_outcomes(pure=True)
    assert pure["native"] is False
    try:
        from exchange import _native  # noqa: F401
    except ImportError:
        compiled = None
    else:
        compiled = _tvm_ffi_outcomes(pure=False)
        assert compiled["native"] is True
        assert compiled["outcomes"] == pure["outcomes"]
    for run in filter(None, (pure, compiled)):
        got = run["outcomes"]
        for how in ("from_dlpack", "function call"):
            for name in ("read-only numpy", "read-only borrow"):
                kind, error, message = got[f"{name}, {how}"]
                assert (kind, error) == ("refused", "BufferError"), got
                assert "read-only" in message and "copy=True" in message
            assert got[f"legacy import, {how}"] == ["ok", 6.0, True]  # as a legacy capsule gives it
            assert got[f"writable, {how}"] == ["ok", 6.0, True]  # zero-copy
            assert got[f"written on a host stream, {how}"] == ["ok", 7.0 * (1 << 16), True]  # the writes done
        assert run["left"] == [0, 0], run  # nothing held, no export left after a refusal


# -- the two entry points, called directly ----------------------------------------------------------
def _table() -> abi.DLPackExchangeAPI:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return abi.DLPackExchangeAPI.from_address(get(tx.Tensor.__dlpack_c_exchange_api__, b"dlpack_exchange_api"))


# PYFUNCTYPE: called with the GIL held (the table's functions set Python errors), and a
# Python error they set is raised here.
_MANAGED_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ctypes.c_void_p))
_DLTENSOR_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(abi.DLTensor))
_CURRENT_STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


def _entry_points() -> tuple:
    table = _table()
    return (_MANAGED_FROM_PY(table.managed_tensor_from_py_object_no_sync),
            _DLTENSOR_FROM_PY(table.dltensor_from_py_object_no_sync))


@COMPILED
@pytest.mark.parametrize("make", ["versioned READ_ONLY capsule", "read-only borrow", "JAX array"])
def test_both_entry_points_refuse_a_read_only_tensor(reg, make):
    managed_from_py, dltensor_from_py = _entry_points()
    src = np.arange(4, dtype=np.float32)
    if make == "read-only borrow":
        scope = tx.borrow(src, readonly=True)
        t = scope.__enter__()
    elif make == "JAX array":  # in through JAX's legacy capsule, but immutable: never through the table (docs/design.md)
        jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed")
        src = jnp.arange(4, dtype=jnp.float32)
        t = tx.from_dlpack(src)
        assert t.mutability == "readonly"
    else:
        src.flags.writeable = False
        t = tx.from_dlpack(src)
    holders = list(t.record.holders)
    out = ctypes.c_void_p(1)
    with pytest.raises(BufferError, match="(read-only|immutable).*C exchange API"):
        managed_from_py(t, ctypes.byref(out))
    assert out.value is None  # nothing handed out
    dl = abi.DLTensor()
    with pytest.raises(BufferError, match="(read-only|immutable).*C exchange API"):
        dltensor_from_py(t, ctypes.byref(dl))
    assert not dl.data and dl.ndim == 0  # left unfilled
    assert t.record.holders == holders and reg.stats()["exports_outstanding"] == 0
    assert np.array_equal(np.asarray(src), np.arange(4, dtype=np.float32))
    if make == "read-only borrow":
        del t
        scope.__exit__(None, None, None)
    else:
        del t


@COMPILED
def test_both_entry_points_hand_out_a_writable_tensor_and_a_closed_one_raises_lifetime_error(reg):
    managed_from_py, dltensor_from_py = _entry_points()
    src = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = tx.from_dlpack(src)
    out = ctypes.c_void_p()
    assert managed_from_py(t, ctypes.byref(out)) == 0
    m = abi.DLManagedTensorVersioned.from_address(out.value)
    assert m.dl_tensor.data == src.ctypes.data and m.flags & abi.DLPACK_FLAG_BITMASK_READ_ONLY == 0
    assert reg.stats()["exports_outstanding"] == 1
    abi.DLManagedTensorDeleter(m.deleter)(out.value)
    assert reg.stats()["exports_outstanding"] == 0
    dl = abi.DLTensor()
    assert dltensor_from_py(t, ctypes.byref(dl)) == 0
    assert dl.data == src.ctypes.data and list(dl.shape[:2]) == [2, 3] and list(dl.strides[:2]) == [3, 1]
    current = ctypes.c_void_p(1)
    assert _CURRENT_STREAM(_table().current_work_stream)(2, 0, ctypes.byref(current)) == 0
    assert current.value is None  # NULL: the legacy default stream, which device exports are ordered before
    del t
    with tx.borrow(src) as view:
        kept = view
    with pytest.raises(tx.LifetimeError):
        managed_from_py(kept, ctypes.byref(out))
    with pytest.raises(tx.LifetimeError):
        dltensor_from_py(kept, ctypes.byref(dl))
    del kept


@COMPILED
def test_both_entry_points_make_data_written_on_a_host_stream_ready_first(reg):
    import threading
    import time

    managed_from_py, dltensor_from_py = _entry_points()
    for entry in ("managed", "dltensor"):
        s = tx.create_stream("cpu")
        t = tx.empty(1 << 16, "float32", stream=s)
        arr = t.numpy()
        arr[...] = 0.0
        started = threading.Event()

        def write(out=arr):
            started.set()
            time.sleep(0.2)
            out[...] = 3.0

        s.submit(write)
        assert started.wait(5)
        if entry == "managed":
            out = ctypes.c_void_p()
            assert managed_from_py(t, ctypes.byref(out)) == 0
            seen = np.ctypeslib.as_array(ctypes.cast(
                abi.DLManagedTensorVersioned.from_address(out.value).dl_tensor.data,
                ctypes.POINTER(ctypes.c_float)), shape=(1 << 16,)).copy()
            abi.DLManagedTensorDeleter(abi.DLManagedTensorVersioned.from_address(out.value).deleter)(out.value)
        else:
            dl = abi.DLTensor()
            assert dltensor_from_py(t, ctypes.byref(dl)) == 0
            seen = np.ctypeslib.as_array(ctypes.cast(dl.data, ctypes.POINTER(ctypes.c_float)),
                                         shape=(1 << 16,)).copy()
        assert (seen == 3.0).all(), f"{entry}: the export did not wait for the host stream's writes"
        del t, arr
        s.synchronize()


def test_chain_stages_still_get_read_only_memory_as_before(reg):
    # tx.Chain hands tvm-ffi a read-only tensor through its immutable-consumer view (a
    # legacy capsule, no table): the refusal above must not reach it
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    from exchange.frameworks import get_adapter

    src = np.arange(4, dtype=np.float32)
    src.flags.writeable = False
    t = tx.from_dlpack(src)
    x = get_adapter("tvm_ffi").to_framework(t, None)
    assert tuple(x.shape) == (4,)
    del x, t


def test_the_read_only_refusal_names_the_way_out():
    code = textwrap.dedent("""
        import numpy as np, exchange as tx
        src = np.zeros(2); src.flags.writeable = False
        t = tx.from_dlpack(src)
        try:
            t.__dlpack__()
        except BufferError as exc:
            print(exc)
        print(np.from_dlpack(tx.from_dlpack(t, copy=True)).flags.writeable)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "max_version=(1, 0) or later" in proc.stdout and "copy=True" in proc.stdout
    assert proc.stdout.split()[-1] == "True"


# -- text signatures (issue 19 item 11) ---------------------------------------------------------
_SIGNATURE_CHECK = r"""
import inspect, json
import exchange as tx
from exchange._core import compiled as _compiled

NATIVE = _compiled()
t = tx.empty((2,))
out = {}
for name, f in [("tx.from_dlpack", tx.from_dlpack), ("Tensor.__dlpack__", tx.Tensor.__dlpack__),
                ("Tensor.__dlpack_device__", tx.Tensor.__dlpack_device__),
                ("tensor.__dlpack__", t.__dlpack__), ("tensor.__dlpack_device__", t.__dlpack_device__)]:
    sig = inspect.signature(f)
    out[name] = [[p.name, p.kind.name, repr(p.default)] for p in sig.parameters.values()]
out["doc"] = (tx.Tensor.__dlpack__.__doc__ or "").startswith("Export as a DLPack capsule")
print(json.dumps({"native": NATIVE, "signatures": out}))
"""

#: The public API's signatures: tx.from_dlpack(x, *, device=None, copy=None, stream=None),
#: .__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None), .__dlpack_device__()
_KW = "KEYWORD_ONLY"
_DESIGN = {
    "tx.from_dlpack": [["x", "POSITIONAL_OR_KEYWORD", "<class 'inspect._empty'>"], ["device", _KW, "None"],
                       ["copy", _KW, "None"], ["stream", _KW, "None"]],
    "Tensor.__dlpack__": [["self", "POSITIONAL_ONLY", "<class 'inspect._empty'>"], ["stream", _KW, "None"],
                          ["max_version", _KW, "None"], ["dl_device", _KW, "None"], ["copy", _KW, "None"]],
    "Tensor.__dlpack_device__": [["self", "POSITIONAL_ONLY", "<class 'inspect._empty'>"]],
    "tensor.__dlpack__": [["stream", _KW, "None"], ["max_version", _KW, "None"], ["dl_device", _KW, "None"],
                          ["copy", _KW, "None"]],
    "tensor.__dlpack_device__": [],
    "doc": True,
}


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_the_public_functions_and_methods_carry_designs_signatures_on_both_paths(pure):
    env = dict(os.environ, EXCHANGE_PURE_PYTHON="1" if pure else "0")
    proc = subprocess.run([sys.executable, "-c", _SIGNATURE_CHECK], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    if not pure and not got["native"]:
        pytest.skip("the compiled core is not built here")
    assert got["native"] is (not pure)
    assert got["signatures"] == _DESIGN
