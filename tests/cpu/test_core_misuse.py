"""Regression tests for defects a breaking session found in the compiled core
(exchange/native/*.c), each also run on the pure-Python twin (EXCHANGE_PURE_PYTHON=1).
Cases that can crash a process run in a subprocess with a timeout.
"""

from __future__ import annotations

import pytest

from process_helpers import run_python


# -- 1. a capsule consumed by someone else while our import of it runs -------------------------
# The import reads the DLTensor, then runs Python code (a first device or dtype
# validation, tx.track, EXCHANGE_DEBUG's creation stack, the garbage collector) before it
# renames the capsule; another thread may consume the same capsule meanwhile and its
# producer free the struct and the shape array. The import must then refuse ("already
# consumed") without reading that memory again. Here the "meanwhile" is EXCHANGE_DEBUG's
# stack capture, and the producer's shape lives on its own page, unmapped by its deleter:
# reading it after that is a segfault, not a quiet stale read.
def test_a_capsule_consumed_meanwhile_is_refused_without_touching_the_freed_struct():
    r = run_python("""
        import ctypes, mmap, sys
        sys.path.insert(0, "tests/cpu")
        import numpy as np
        import exchange as tx
        from exchange import _dlpack_abi as abi
        from dlpack_fixtures import HandMadeProducer

        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         -1, 0)
        (ctypes.c_int64 * 2).from_address(page)[:] = [3, 4]
        data = np.zeros((3, 4), np.float32)
        producer = HandMadeProducer(data=data.ctypes.data, shape=None, strides=None, code=2, bits=32, ndim=2,
                                    shape_address=page, keep=data)
        counted = producer._on_delete

        def on_delete(ptr):
            counted(ptr)
            libc.munmap(page, 4096)  # the producer frees its shape array with the struct

        producer._deleter = abi.DLManagedTensorDeleter(on_delete)
        producer.struct.deleter = ctypes.cast(producer._deleter, ctypes.c_void_p).value
        capsule = producer.capsule()
        taken = []

        class Meanwhile:  # stands for another thread taking the GIL during the stack capture
            @staticmethod
            def extract_stack(limit=None):
                if not taken:
                    taken.append("busy")
                    taken[0] = tx.from_dlpack(capsule).shape  # that Tensor goes at once: the page is unmapped
                return []

            @staticmethod
            def format_list(frames):
                return []

        sys.modules["exchange.registry"].traceback = Meanwhile
        tx.registry().debug = True
        try:
            tx.from_dlpack(capsule)
            print("outer import took the capsule")
        except ValueError as e:
            print("outer import refused:", e)
        print("inner", taken[0], "deleter calls", producer.calls, flush=True)
        stats = tx.registry().stats()
        print("live", stats["live_records"], "imports", stats["imports_outstanding"])
    """, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "outer import refused: this DLPack capsule was already consumed" in r.stdout, r.stdout
    assert "inner (3, 4) deleter calls 1" in r.stdout, r.stdout
    assert "live 0 imports 0" in r.stdout, r.stdout


# -- 2. the exchange API's allocator with a prototype it cannot read ----------------------------
# managed_tensor_allocator read proto->shape[i] for any ndim: a negative ndim came back as
# "SystemError: bad argument to internal function", a NULL shape with ndim > 0 crashed.
def test_the_exchange_api_allocator_refuses_an_unreadable_prototype_with_a_clear_error():
    r = run_python("""
        import ctypes
        import exchange as tx
        from exchange import _dlpack_abi as abi

        table = getattr(tx.Tensor, "__dlpack_c_exchange_api__", None)
        if table is None:
            print("no table (pure-Python path)")
            raise SystemExit(0)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        slots = (ctypes.c_void_p * 3).from_address(get(table, b"dlpack_exchange_api"))  # version, prev_api, allocator
        SetError = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
        errors = []
        set_error = SetError(lambda ctx, kind, message: errors.append((kind.decode(), message.decode())))
        allocate = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                     SetError)(slots[2])
        extents = (ctypes.c_int64 * 2)(2, 3)
        for ndim, shape in ((-1, extents), (2, None), (1 << 30, extents), (2, extents)):
            proto = abi.DLTensor()
            proto.ndim, proto.dtype.code, proto.dtype.bits, proto.dtype.lanes = ndim, 2, 32, 1
            proto.device.device_type, proto.device.device_id = 1, 0
            if shape is not None:
                proto.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
            out = ctypes.c_void_p()
            errors.clear()
            rc = allocate(ctypes.byref(proto), ctypes.byref(out), None, set_error)
            print(ndim, shape is None, rc, bool(out.value), errors, flush=True)
            if rc == 0:
                m = abi.DLManagedTensorVersioned.from_address(out.value)
                print("allocated", list(m.dl_tensor.shape[:m.dl_tensor.ndim]))
                abi.DLManagedTensorDeleter(m.deleter)(out.value)
        print("live", tx.registry().stats()["live_records"])
    """, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    if "no table" in r.stdout:
        return
    lines = r.stdout.splitlines()
    for line in lines[:3]:
        assert " -1 False [('ValueError', 'the prototype DLTensor has no readable shape" in line, r.stdout
    assert lines[3].startswith("2 False 0 True []"), r.stdout
    assert "allocated [2, 3]" in r.stdout and "live 0" in r.stdout, r.stdout


# -- 3. a PyTorch tensor with its conjugate bit set, through PyTorch's exchange API -------------
# torch.Tensor.__dlpack__ refuses such a tensor (DLPack cannot say "conjugate"), but
# PyTorch's C exchange table exports its memory as it is: the compiled core's hot path
# took the unconjugated values, silently (the pure path, through __dlpack__, refused).
def test_a_lazily_conjugated_torch_tensor_is_refused_not_taken_unconjugated():
    import numpy as np
    import pytest

    import exchange as tx

    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    before = tx.registry().stats()
    with pytest.raises(BufferError, match="conjugate"):
        tx.from_dlpack(z.conj())
    after = tx.registry().stats()
    assert after["live_records"] == before["live_records"] and after["imports_outstanding"] == before["imports_outstanding"]
    # a resolved conjugate (its own memory) and plain complex tensors still go through
    t = tx.from_dlpack(z.conj().resolve_conj())
    assert np.from_dlpack(t).tolist() == [1 - 2j, 3 - 4j]
    u = tx.from_dlpack(z)
    assert u.data_ptr == z.data_ptr() and np.from_dlpack(u).tolist() == [1 + 2j, 3 + 4j]


@pytest.mark.parametrize("call", [
    lambda tx, a: tx.from_dlpack(a, bogus=None),  # the compiled fast path once took this
    lambda tx, a: tx.from_dlpack(a, devcie="cpu"),
    lambda tx, a: tx.from_dlpack(a, "cpu"),  # device is keyword-only (array API)
    lambda tx, a: tx.from_dlpack(a, x=a),
], ids=["unknown-none", "misspelt", "positional-device", "x-twice"])
def test_a_wrong_call_is_a_type_error_naming_from_dlpack_on_either_path(call):
    import numpy as np

    import exchange as tx

    a = np.ones(3)
    live = tx.registry().stats()["live_records"]
    with pytest.raises(TypeError, match=r"^from_dlpack\(\)"):
        call(tx, a)
    assert tx.registry().stats()["live_records"] == live


def test_x_may_be_named_as_design_md_gives_the_signature():
    import numpy as np

    import exchange as tx

    a = np.arange(3.0)
    assert tx.from_dlpack(x=a).data_ptr == a.ctypes.data


# -- a pipelined chain's plain stage task (exchange/native/stagetask.c) ----------------------
# Made wrongly, the core's plain_task refuses with the same TypeError or IndexError on both
# paths; made rightly and then called with what is not a batch of its kind (another type,
# a field unset, a batch that is not one tensor), it runs the Python task it was made
# from, never reads a field that is not there, and never crashes the process.
PLAIN_TASK_MISUSE = """
    import contextvars, json
    import numpy as np
    import exchange as tx
    from exchange import _core

    class Slot:
        __slots__ = ("kind", "values", "ptrs", "hops", "done")

    class NoDone:
        __slots__ = ("kind", "values", "ptrs", "hops")

    def error(fn):
        try:
            fn()
        except BaseException as exc:
            return [type(exc).__name__, str(exc)]
        return None

    ctx, f = contextvars.copy_context(), (lambda *a: None)
    slow_calls = []
    slow = lambda slot: slow_calls.append(type(slot).__name__)

    def make(**change):
        args = dict(slot_type=Slot, take=f, fn=f, give=f, shared_in=None, shared_out=None, acc=[0.0], index=0,
                    then=None, post=None, context=ctx, slow=slow, fail=f, regroup=f, refuse=f)
        args.update(change)
        return _core.plain_task(*args.values())

    refused = [error(lambda: make(slot_type=1)), error(lambda: make(acc=(0.0,))), error(lambda: make(index="0")),
               error(lambda: make(index=1)), error(lambda: make(take=None)), error(lambda: make(then=f)),
               error(lambda: make(context={})), error(lambda: make(slot_type=NoDone))]
    task = make()
    odd = []
    s = Slot()  # every field unset
    odd.append(s)
    s = Slot(); s.kind, s.values, s.ptrs, s.hops, s.done = "tuple", [tx.empty(2)], None, [], None
    odd.append(s)
    s = Slot(); s.kind, s.values, s.ptrs, s.hops, s.done = "one", [np.zeros(2)], None, [], None  # not a Tensor
    odd.append(s)
    s = Slot(); s.kind, s.values, s.ptrs, s.hops, s.done = "one", [], None, [], None
    odd.append(s)
    s = Slot(); s.kind, s.values, s.ptrs, s.hops, s.done = "one", [tx.empty(2)], None, None, None  # no hops list
    odd.append(s)
    odd.append(object())
    for s in odd:
        task(s)
    print(json.dumps({"refused": refused, "slow": slow_calls, "called": error(lambda: task()),
                      "kw": error(lambda: task(odd[0], x=1)) is not None}))
"""


def test_plain_task_refuses_bad_arguments_and_sends_odd_batches_to_the_python_task():
    import json

    results = []
    for pure in ("0", "1"):
        r = run_python(PLAIN_TASK_MISUSE, timeout=60, EXCHANGE_PURE_PYTHON=pure)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(json.loads(r.stdout))
    compiled, pure = results
    assert compiled["refused"] == pure["refused"]
    assert [e[0] for e in compiled["refused"]] == ["TypeError", "TypeError", "TypeError", "IndexError", "TypeError",
                                                  "TypeError", "TypeError", "TypeError"]
    assert compiled["refused"][7][1] == "plain_task: NoDone.done must be a __slots__ field"
    assert compiled["slow"] == pure["slow"] == ["Slot"] * 5 + ["object"]  # each went to the Python task
    assert compiled["called"][0] == pure["called"][0] == "TypeError" and compiled["kw"] and pure["kw"]
