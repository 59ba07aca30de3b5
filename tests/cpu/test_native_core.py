"""The compiled core (issue 10): the DLPack C exchange API both ways, producers whose
exchange table is malformed, reference counts and memory over a million round trips,
what the garbage collector tracks, and the two paths (compiled and pure-Python) giving
the same results on the same inputs.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
from exchange import _dlpack_abi as abi
from exchange._core import compiled as _compiled

NATIVE = _compiled()
from lifetime_helpers import no_leaks

REPO = Path(__file__).resolve().parents[2]
COMPILED = pytest.mark.skipif(not NATIVE, reason="the DLPack C exchange API is the compiled core's "
                              "(through ctypes it would cost more than __dlpack__)")


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


class _CountingDlpack:
    """Counts the calls of ``cls.__dlpack__`` while the context is open."""

    def __init__(self, cls: type) -> None:
        self.cls, self.calls = cls, 0

    def __enter__(self) -> "_CountingDlpack":
        real = self.real = self.cls.__dlpack__

        def counting(obj, *args, **kwargs):
            self.calls += 1
            return real(obj, *args, **kwargs)

        self.cls.__dlpack__ = counting
        return self

    def __exit__(self, *exc) -> None:
        self.cls.__dlpack__ = self.real


# -- the exchange API, published and consumed -----------------------------------------------
@COMPILED
def test_tvm_ffi_takes_our_tensors_through_the_exchange_api_without_a_capsule(reg):
    tvm_ffi = pytest.importorskip("tvm_ffi")
    assert type(tx.Tensor.__dlpack_c_exchange_api__).__name__ == "PyCapsule"
    a = np.arange(6.0).reshape(2, 3)
    t = tx.from_dlpack(a)
    with _CountingDlpack(tx.Tensor) as counter:
        x = tvm_ffi.from_dlpack(t)
    assert counter.calls == 0  # the table, not __dlpack__
    assert tuple(x.shape) == (2, 3) and "DLPack export" in " ".join(t.record.holders)
    np.testing.assert_array_equal(np.from_dlpack(x), a)
    del x
    assert t.record.holders == ["tx.Tensor"]  # tvm-ffi let go: our export's holder went
    del t


def test_tvm_ffi_takes_our_tensors_on_either_path(reg):
    tvm_ffi = pytest.importorskip("tvm_ffi")
    t = tx.from_dlpack(np.arange(4.0))
    x = tvm_ffi.from_dlpack(t)
    assert tuple(x.shape) == (4,)
    del x, t


@COMPILED
def test_torch_tensors_come_in_through_their_exchange_api(reg):
    torch = pytest.importorskip("torch")
    if getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is None:
        pytest.skip("this PyTorch publishes no DLPack C exchange API (PyTorch >= 2.10 does)")
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]
    with _CountingDlpack(torch.Tensor) as counter:
        t = tx.from_dlpack(src)
    assert counter.calls == 0
    assert t.shape == (3, 3) and t.strides == (4, 1) and t.data_ptr == src.data_ptr()
    assert t.record.origin == "imported from torch.Tensor"
    np.testing.assert_array_equal(np.from_dlpack(t), src.numpy())
    src[0, 0] = -1.0  # the same memory
    assert np.from_dlpack(t)[0, 0] == -1.0
    del t


def test_a_torch_tensor_that_requires_grad_is_refused_on_both_paths(reg):
    # torch's __dlpack__ refuses it ("use tensor.detach()"); its exchange table would
    # export it. Both paths give torch's own refusal, and detach() is the way in.
    torch = pytest.importorskip("torch")
    src = torch.ones(3, requires_grad=True)
    with pytest.raises(BufferError, match="detach"):
        tx.from_dlpack(src)
    assert reg.stats()["imports_outstanding"] == 0
    t = tx.from_dlpack(src.detach())
    assert t.data_ptr == src.data_ptr()
    del t


def test_our_tensors_go_to_torch_and_back(reg):
    torch = pytest.importorskip("torch")
    t = tx.empty((2, 3), "float32")
    np.from_dlpack(t)[...] = 7.0
    y = torch.from_dlpack(t)
    assert y.data_ptr() == t.data_ptr and float(y.sum()) == 42.0
    back = tx.from_dlpack(y)  # a torch tensor over our export: a new record over the same memory
    assert back.data_ptr == t.data_ptr
    del y, back, t


class _Table(ctypes.Structure):
    _fields_ = abi.DLPackExchangeAPI._fields_


_FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))
_KEEP: list = []  # ctypes callbacks and tables must outlive every call


def _producer_with(api: object) -> type:
    """A NumPy-backed producer type whose type attribute __dlpack_c_exchange_api__ is ``api``."""

    class Producer:
        __dlpack_c_exchange_api__ = api
        calls = 0

        def __init__(self) -> None:
            self.a = np.arange(5.0)

        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            type(self).calls += 1
            kwargs.pop("stream", None)
            return self.a.__dlpack__(**kwargs)

    return Producer


def _capsule(table: ctypes.Structure | None, name: bytes = b"dlpack_exchange_api") -> object:
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    _KEEP.append(name)
    return new(ctypes.addressof(table) if table is not None else ctypes.addressof(_KEEP_DUMMY), name, None)


_KEEP_DUMMY = ctypes.c_int64(0)


def _table(major: int = 1, from_py: object = None, with_stream: bool = True) -> ctypes.Structure:
    table = _Table()
    table.header.version.major, table.header.version.minor = major, 3
    if from_py is not None:
        table.managed_tensor_from_py_object_no_sync = ctypes.cast(from_py, ctypes.c_void_p).value
    if with_stream:
        cb = _STREAM(lambda t, i, out: 0)
        _KEEP.append(cb)
        table.current_work_stream = ctypes.cast(cb, ctypes.c_void_p).value
    _KEEP.append(table)
    return table


def _failing(result: int):
    def from_py(obj, out):
        return result  # -1: an error (none set); 0: "success" that fills nothing

    cb = _FROM_PY(from_py)
    _KEEP.append(cb)
    return cb


@pytest.mark.parametrize("case", ["wrong-name", "an-int", "major-7", "no-functions", "returns-error",
                                  "returns-nothing"])
def test_a_malformed_exchange_api_falls_back_to_dlpack(reg, case):
    api = {
        "wrong-name": lambda: _capsule(_table(from_py=_failing(-1)), b"not_an_exchange_api"),
        "an-int": lambda: 5,
        "major-7": lambda: _capsule(_table(major=7, from_py=_failing(-1))),
        "no-functions": lambda: _capsule(_table(with_stream=False)),
        "returns-error": lambda: _capsule(_table(from_py=_failing(-1))),
        "returns-nothing": lambda: _capsule(_table(from_py=_failing(0))),
    }[case]()
    Producer = _producer_with(api)
    p = Producer()
    t = tx.from_dlpack(p)  # never a crash: the table is skipped, __dlpack__ serves
    assert Producer.calls == 1 and t.data_ptr == p.a.ctypes.data
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(5.0))
    del t


# -- reference counts, memory, the garbage collector ----------------------------------------
def test_a_million_round_trips_leave_refcounts_and_rss_flat():
    rounds = 1_000_000 if NATIVE else 100_000  # the pure path takes 10 times as long per trip
    code = textwrap.dedent("""
        import gc, sys, numpy as np, exchange as tx
        a = np.arange(16, dtype=np.float32)
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        for _ in range(100_000):
            np.from_dlpack(tx.from_dlpack(a))
        gc.collect()
        refs, before = sys.getrefcount(a), rss()
        for _ in range(ROUNDS):
            np.from_dlpack(tx.from_dlpack(a))
        gc.collect()
        s = tx.registry().stats()
        print(sys.getrefcount(a) - refs, rss() - before, s["live_records"], s["exports_outstanding"])
    """).replace("ROUNDS", str(rounds))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    refs, grew, live, exports = map(int, r.stdout.split())
    assert refs == 0 and live == 0 and exports == 0, r.stdout
    assert grew < 1 << 20, f"RSS grew by {grew} bytes over {rounds} round trips"


@COMPILED
def test_tensors_are_not_tracked_by_the_garbage_collector_records_are(reg):
    t = tx.from_dlpack(np.arange(3.0))
    assert not gc.is_tracked(t)  # a Tensor cannot be part of a cycle
    assert gc.is_tracked(t.record)  # a record holds the producer's object: it may be
    del t


# -- the two paths give the same results ----------------------------------------------------
SAME_PROGRAM = r"""
import json, numpy as np, exchange as tx
import exchange._core
out = {"native": exchange._core.compiled()}
def describe(t):
    return [list(t.shape), list(t.strides), t.dtype.name, str(t.device), t.readonly, t.mutability, t.nbytes,
            t.record.kind, t.record.origin, t.record.holders, t.record.nbytes]
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
ro = np.arange(6.0); ro.flags.writeable = False
cases = {"contiguous": base, "strided": base[:, ::2, 1:], "reversed": base[::-1], "zero-size": base[:, :0],
         "0-d": np.array(3.5), "bool": np.ones(3, bool), "complex": np.arange(3) + 1j, "read-only": ro,
         "int8": np.arange(5, dtype=np.int8)}
for name, arr in cases.items():
    attempt("import " + name, lambda arr=arr: describe(tx.from_dlpack(arr)))
    attempt("round trip " + name, lambda arr=arr: np.from_dlpack(tx.from_dlpack(arr)).tolist())
    attempt("legacy " + name, lambda arr=arr: describe(tx.from_dlpack(arr.__dlpack__())))
t = tx.from_dlpack(ro)
attempt("legacy export of read-only", lambda: t.__dlpack__())
attempt("bad max_version", lambda: t.__dlpack__(max_version=(1,)))
attempt("stream on cpu", lambda: t.__dlpack__(stream=3))
attempt("bad copy", lambda: tx.from_dlpack(t, copy="yes"))
attempt("not dlpack", lambda: tx.from_dlpack(object()))
attempt("consumed twice", lambda: [tx.from_dlpack(c) for c in [base.__dlpack__()] * 2])
attempt("view", lambda: describe(tx.from_dlpack(t)))
attempt("own capsule back", lambda: describe(tx.from_dlpack(t.__dlpack__(max_version=(1, 3)))))
attempt("copy", lambda: describe(tx.from_dlpack(t, copy=True)))
attempt("empty", lambda: describe(tx.empty((2, 2), "bfloat16")))
with tx.borrow(bytearray(16), shape=(4,), dtype="float32") as view:
    out["borrow"] = describe(view)
del t
s = tx.registry().stats()
out["stats"] = {k: v for k, v in s.items() if k not in ("created_total", "released_total")}
print(json.dumps(out, default=repr))
"""


@pytest.mark.skipif(not NATIVE, reason="compares the compiled core with the pure path: needs the compiled one")
def test_both_paths_give_the_same_results_on_the_same_inputs():
    results = []
    for pure in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", SAME_PROGRAM], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "EXCHANGE_PURE_PYTHON": pure})
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout))
    compiled, pure = results
    assert compiled.pop("native") is True and pure.pop("native") is False
    assert compiled.keys() == pure.keys()
    for key in compiled:
        assert compiled[key] == pure[key], (key, compiled[key], pure[key])
