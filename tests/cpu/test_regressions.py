"""Regressions found by trying to break the library as a new user would."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import exchange as tx
from dlpack_fixtures import hand_made

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _settle() -> dict:
    gc.collect()
    tx.registry().collect(timeout=10)
    return tx.registry().stats()


def test_copy_is_a_new_holder_and_deepcopy_a_real_copy():
    base = _settle()
    capsule, producer = hand_made(np.arange(8, dtype=np.float32))
    t = tx.from_dlpack(capsule)
    shallow = copy.copy(t)
    assert shallow.data_ptr == t.data_ptr and len(t.record.holders) == 2
    del shallow
    assert producer.calls == 0 and t.record.state == "live"
    deep = copy.deepcopy(t)
    assert deep.data_ptr != t.data_ptr and deep.record is not t.record
    np.testing.assert_array_equal(np.from_dlpack(deep), np.arange(8, dtype=np.float32))
    del deep, t
    after = _settle()
    assert producer.calls == 1  # exactly once: the copies never called it
    assert after["live_records"] == base["live_records"]


def test_tensor_refuses_pickle():
    t = tx.from_dlpack(np.zeros(3))
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(t)


def test_device_from_string_keeps_its_id():
    assert tx.Device("cuda:1").id == 1
    assert tx.Device("cuda", 2) == tx.Device.parse("cuda:2")
    with pytest.raises(ValueError):
        tx.Device("cuda:1", 2)


def test_borrow_refuses_null_and_negative_addresses():
    with pytest.raises(ValueError):
        with tx.borrow(dltensor=0):
            pass
    with pytest.raises(ValueError):
        with tx.borrow(dltensor=-8):
            pass
    with pytest.raises(ValueError, match="not a valid pointer"):
        with tx.borrow(0, shape=(3,), dtype="float32"):
            pass
    with tx.borrow(0, shape=(0,), dtype="float32") as empty:  # nothing to read: allowed
        assert empty.shape == (0,)


@pytest.mark.parametrize("shape,strides", [((2**32, 2**32), None), ((4, 3), (2**62, 1))])
def test_layout_that_overflows_64_bits_is_refused(shape, strides):
    keep = np.zeros(16, dtype=np.float32)
    capsule, producer = hand_made(keep, shape=shape, strides=strides)
    with pytest.raises(BufferError, match="overflow"):
        tx.from_dlpack(capsule)
    del capsule
    gc.collect()
    assert producer.calls == 1  # refused unconsumed: the producer's destructor released it


def test_read_only_out_buffer_is_refused():
    ro = tx.from_dlpack(np.zeros(4).__dlpack__())  # legacy capsule: read-only
    assert ro.readonly
    with pytest.raises(ValueError, match="read-only"):
        tx.Stage(lambda x, out: x, framework="numpy", out=ro)


def test_stage_input_refused_by_its_framework_is_a_stage_error():
    pytest.importorskip("jax")
    chain = tx.Chain([tx.Stage(lambda x: x[:, ::2], framework="numpy", name="gappy"),
                      tx.Stage(lambda x: x + 1, framework="jax", name="jax_stage")])
    x = np.from_dlpack(tx.empty((4, 6), "float32"))  # 64-byte aligned: misaligned input would reach JAX
    x[...] = 1.0                                     # as the chain's compact copy, which it takes
    try:
        with pytest.raises(tx.StageError, match="jax_stage"):
            chain(x)
    finally:
        chain.close()


def test_negative_strides_into_torch_are_copied_not_fatal():
    # PyTorch 2.13 aborts the process on negative strides (pytorch#188023): run in a child.
    pytest.importorskip("torch")
    code = (
        "import numpy as np, torch, exchange as tx\n"
        "ch = tx.Chain([tx.Stage(lambda x: x[::-1], framework='numpy'), tx.Stage(lambda x: x + 1, framework='torch')])\n"
        "run = ch.run([np.arange(20, dtype=np.float32).reshape(4, 5)])\n"
        "out = np.from_dlpack(run.outputs[0])\n"
        "assert (out == np.arange(20, dtype=np.float32).reshape(4, 5)[::-1] + 1).all()\n"
        "assert [h['shared'] for h in run.hops][1] is False  # numpy -> torch was a copy\n"
        "ch.close(); print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("pure", ["0", "1"])
def test_unconsumed_capsule_in_a_cycle_at_exit(pure):
    code = "import exchange as tx; L = [tx.empty(3).__dlpack__()]; L.append(L)"
    env = {**os.environ, "EXCHANGE_PURE_PYTHON": pure}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_borrow_exit_while_another_thread_exports():
    # The registry's hot paths take no lock: a scope exit must still see a consistent
    # holder set, leave nothing live, and other threads must get LifetimeError, never
    # another error.
    import threading
    import time

    base = _settle()
    errors = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(60):
            buf = np.zeros(64)
            stop = threading.Event()
            try:
                with tx.borrow(buf) as view:
                    def user():
                        while not stop.is_set():
                            try:
                                a = np.from_dlpack(view)
                                del a
                            except tx.LifetimeError:
                                return
                            except Exception as exc:  # anything else is a bug
                                errors.append(exc)
                                return
                    th = threading.Thread(target=user)
                    th.start()
                    time.sleep(0.001)
            except tx.LifetimeError:
                pass  # an export was still out at the exit: named, as documented
            finally:
                stop.set()
                th.join(timeout=10)
    finally:
        sys.setswitchinterval(old)
    del view
    assert errors == []
    assert _settle()["live_records"] == base["live_records"]
