"""Regression tests for the defects a new user's breaking session found (issue 14, items
1-11; item 3, JAX -> tx -> JAX, is in test_peers.py, item 9's device ids in
test_dtypes_device.py, item 10's re-import in test_release.py, item 11's collect()
timeout in test_registry.py). Cases that can kill or hang a process run in a subprocess
with a timeout.
"""

from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest

import exchange as tx
import exchange._core
from exchange import _dlpack_abi as abi
from lifetime_helpers import CountingProducer, Gate, capsule_name, no_leaks
from process_helpers import run_python

WAIT = 20.0


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


# -- 1. exit with work queued on host streams -------------------------------------------------
def test_exit_with_torch_work_queued_on_a_host_stream_is_clean():
    pytest.importorskip("torch")
    r = run_python("""
        import torch, exchange as tx
        s = tx.create_stream("cpu"); x = torch.rand(512, 512)
        for _ in range(2000): s.submit(torch.mm, x, x)
        print("queued", flush=True)
    """, EXCHANGE_EXIT_TIMEOUT="1")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "terminate called" not in r.stderr and "Fatal Python error" not in r.stderr
    assert r.stderr.count("were still queued at exit after 1 s and were dropped") == 1, r.stderr[-2000:]


def test_exit_runs_what_was_queued_within_the_deadline():
    r = run_python("""
        import functools, time, exchange as tx
        s = tx.create_stream("cpu")
        for i in range(5): s.submit(time.sleep, 0.02)
        s.submit(functools.partial(print, "ran at exit", flush=True))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ran at exit" and "dropped" not in r.stderr


def test_exit_while_threads_make_host_streams_is_quiet():
    # The exit hook may see a stream another thread is still making: it must be whole.
    r = run_python("""
        import threading, time, exchange as tx
        def h():
            while True:
                tx.create_stream("cpu")
        for _ in range(2):
            threading.Thread(target=h, daemon=True).start()
        time.sleep(0.3)
    """, EXCHANGE_EXIT_TIMEOUT="1")
    assert r.returncode == 0, r.stderr[-2000:]
    for bad in ("Traceback", "AttributeError", "Exception ignored"):
        assert bad not in r.stderr, r.stderr[-2000:]


# -- 2. fork while other threads use the registry --------------------------------------------
FORK_PROGRAM = """
    import os, threading, time, numpy as np, exchange as tx
    def h():
        s = tx.create_stream(); a = np.arange(64.)
        while True:
            t = tx.from_dlpack(a, stream=s); del t
    for _ in range(3): threading.Thread(target=h, daemon=True).start()
    time.sleep(.3)
    # and a release pending at the fork: its stream is blocked in the parent
    gate = threading.Event(); blocked = tx.create_stream(); blocked.submit(gate.wait, 30)
    p = tx.from_dlpack(np.ones(8), stream=blocked); del p
    pid = os.fork()
    if pid == 0:
        try:
            t = tx.from_dlpack(np.ones(4), stream=tx.create_stream("cpu"))
            with tx.track():
                u = tx.empty(8); del u
            del t
            assert tx.registry().collect(5), "collect hung on the parent's pending releases"
            try:
                blocked.submit(print, "ran twice")
            except RuntimeError as exc:
                assert "forked" in str(exc), exc
            else:
                raise AssertionError("a stream inherited from the parent accepted work")
            assert tx.registry().stats()["pending_releases"] == 0
            os._exit(0)
        except BaseException as exc:
            print("child failed:", repr(exc), flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    gate.set()
    print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize("pure", ["0", "1"], ids=["compiled", "pure-python"])
def test_fork_while_threads_exchange_does_not_hang_the_child(pure):
    r = run_python(FORK_PROGRAM, timeout=60, EXCHANGE_PURE_PYTHON=pure)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "child 0", r.stdout + r.stderr[-2000:]


# -- 4. track() scoped to its own context -----------------------------------------------------
def test_track_does_not_blame_records_of_other_threads(reg):
    started, stop = threading.Event(), threading.Event()
    kept: list = []

    def other():
        kept.append(tx.empty(4))  # made while the block runs, kept past its end
        started.set()
        stop.wait(WAIT)

    th = threading.Thread(target=other)
    with tx.track():
        th.start()
        assert started.wait(WAIT)
        mine = tx.empty(2)
        del mine
    stop.set()
    th.join(WAIT)
    kept.clear()


def test_track_counts_what_its_host_stream_tasks_make(reg):
    s = tx.create_stream()
    kept: list = []
    with pytest.raises(tx.LeakError, match="1 record"):
        with tx.track():
            s.submit(lambda: kept.append(tx.empty(3))).result(WAIT)
    kept.clear()
    s.close()


def test_track_coexists_with_collect_in_another_thread(reg):
    s = tx.create_stream()
    gate = Gate()
    s.submit(gate)
    p = CountingProducer(4)
    t = tx.from_dlpack(p.capsule(), stream=s)
    del t  # pending while the gate is closed
    results: list = []
    th = threading.Thread(target=lambda: results.append(tx.registry().collect(WAIT)))
    th.start()
    with tx.track():  # its own records only: not the other thread's pending release
        u = tx.empty(4)
        del u
    gate.open()
    th.join(WAIT)
    assert results == [True] and p.calls == 1
    s.close()


# -- 5. NULL data with a non-zero size --------------------------------------------------------
class _NullDataProducer(CountingProducer):
    def capsule(self, **kwargs):
        cap = super().capsule(**kwargs)
        ptr = ctypes.pythonapi.PyCapsule_GetPointer
        ptr.restype, ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        m = abi.DLManagedTensorVersioned.from_address(ptr(cap, abi.DLTENSOR_VERSIONED_NAME))
        m.dl_tensor.data = None
        return cap


def test_null_data_with_elements_is_refused_before_consuming(reg):
    p = _NullDataProducer(8)
    cap = p.capsule()
    with pytest.raises(BufferError, match="NULL data pointer but 8 elements"):
        tx.from_dlpack(cap)
    assert capsule_name(cap) == abi.DLTENSOR_VERSIONED_NAME  # not consumed: the producer stays in charge
    del cap
    gc.collect()
    assert p.calls == 1


# -- 6. copy= validated for every kind of input -----------------------------------------------
@pytest.mark.parametrize("bad", ["yes", 1, "no"])
def test_copy_is_validated_for_tensors_capsules_and_producers(reg, bad):
    a = np.arange(3.0)
    t = tx.from_dlpack(a)
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        tx.from_dlpack(t, copy=bad)
    cap = a.__dlpack__(max_version=(1, 0))
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        tx.from_dlpack(cap, copy=bad)
    assert capsule_name(cap) == abi.DLTENSOR_VERSIONED_NAME
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        tx.from_dlpack(a, copy=bad)
    del t, cap


# -- 7. a borrow scope keeps the user's own exception -----------------------------------------
def test_borrow_scope_lets_the_bodys_exception_through_with_a_note(reg):
    buf = bytearray(16)
    kept: list = []
    with pytest.raises(KeyError, match="boom") as info:
        with tx.borrow(buf, shape=(4,), dtype="float32") as view:
            kept.append(np.from_dlpack(view))
            raise KeyError("boom")
    notes = getattr(info.value, "__notes__", [])
    assert any("still held by: DLPack export" in n for n in notes), notes
    kept.clear()


# -- 8. two threads consuming one capsule (pure-Python path) ----------------------------------
def test_pure_path_consumes_a_capsule_once_under_thread_races():
    r = run_python("""
        import sys, threading, numpy as np, exchange as tx
        import exchange._core
        assert not exchange._core.compiled()
        sys.setswitchinterval(1e-6)
        a = np.arange(8.0)
        tries, wins, refused = 3000, [0], [0]
        t = tx.from_dlpack(a)
        for _ in range(tries):
            cap = t.__dlpack__(max_version=(1, 3))
            go = threading.Barrier(2)
            def take():
                go.wait()
                try:
                    u = tx.from_dlpack(cap); wins[0] += 1; del u
                except ValueError:
                    refused[0] += 1
            th = [threading.Thread(target=take) for _ in range(2)]
            for x in th: x.start()
            for x in th: x.join()
            del cap
        del t
        stats = tx.registry().stats()
        print(wins[0], refused[0], stats["exports_outstanding"], stats["live_records"], flush=True)
    """, timeout=300, EXCHANGE_PURE_PYTHON="1")
    assert r.returncode == 0, r.stderr[-2000:]
    wins, refused, exports, live = map(int, r.stdout.split())
    assert wins == 3000 and refused == 3000 and exports == 0 and live == 0, r.stdout


# -- 9. tx.empty's input ----------------------------------------------------------------------
def test_empty_defaults_to_float32_and_names_a_shape_too_large(reg):
    assert tx.empty(3, dtype=None).dtype.name == "float32"
    with pytest.raises(ValueError, match=r"shape \(4294967296, 4294967296\) of float32: its element count "
                                         r"overflows int64 \(2\*\*63 elements or more; the limit is 2\*\*63 - 1\)"):
        tx.empty((1 << 32, 1 << 32))
    with pytest.raises(ValueError, match=r"shape \(2305843009213693952,\) of float32: its extent in bytes overflows"):
        tx.empty(1 << 61)  # 2**61 elements fit int64, their 2**63 bytes do not
    with pytest.raises(MemoryError, match="cannot allocate 1099511627776000 bytes on cpu"):
        tx.empty((1000, 1 << 40), "uint8")


# -- 10. a corrupt DLTensor given to borrow ---------------------------------------------------
def test_borrow_of_a_dltensor_with_a_corrupt_ndim_is_refused():
    r = run_python("""
        import ctypes, numpy as np, exchange as tx
        from exchange import _dlpack_abi as abi
        a = np.arange(4.0); shape = (ctypes.c_int64 * 1)(4)
        t = abi.DLTensor(); t.data = a.ctypes.data; t.device.device_type = 1; t.ndim = 2_000_000
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 64, 1
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        try:
            with tx.borrow(dltensor=ctypes.addressof(t)): pass
        except ValueError as exc:
            print("refused:", exc)
    """)
    assert r.returncode == 0, r.stderr
    assert "refused: DLTensor at" in r.stdout and "2000000 dimensions, more than the limit of 1024" in r.stdout


# -- 11. clear errors -------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [None, 7])
def test_a_dlpack_that_returns_no_capsule_is_named(reg, answer):
    class Producer:
        def __dlpack__(self, **kwargs):
            return answer

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match=r"Producer.__dlpack__\(\) returned .*, not a DLPack capsule"):
        tx.from_dlpack(Producer())


def test_a_dlpack_attribute_that_is_not_callable_is_named(reg):
    class Producer:
        __dlpack__ = 5

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match="Producer does not support DLPack .its __dlpack__ is not callable: int"):
        tx.from_dlpack(Producer())


def test_a_stage_output_that_cannot_be_taken_names_the_stage(reg):
    # A stage returning what its framework will not export (a sparse PyTorch tensor;
    # the case was one that requires grad, which torch's __dlpack__ refuses but
    # its C exchange API, used by the compiled path, exports): StageError naming it.
    torch = pytest.importorskip("torch")
    chain = tx.Chain([tx.Stage(lambda x: (x * 2).to_sparse(), framework="torch", name="sparse")], max_in_flight=1)
    with pytest.raises(tx.StageError, match="stage 0 'sparse' .torch. returned output 0 .*layout"):
        chain.run([np.ones(3, np.float32)])
    chain.close()
    del torch


def test_making_a_tensor_directly_is_a_type_error_without_noise():
    r = run_python("""
        import exchange as tx
        try:
            tx.Tensor()
        except TypeError as exc:
            print(exc)
        import gc; gc.collect()
    """)
    assert r.returncode == 0 and "not made directly" in r.stdout
    assert "Exception ignored" not in r.stderr, r.stderr
