"""Read-only memory is never handed writable to a framework that ignores DLPack's
READ_ONLY flag (issue 13, item 3), in the in-process ``tx.Chain``: truly read-only memory
(a read-only NumPy array, a JAX array) reaches a PyTorch stage as a copy, the hop says
so and why; memory of unknown mutability (ONNX Runtime's legacy capsules) flows
zero-copy. Every hop names its transport."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx
from exchange.frameworks import IGNORES_READ_ONLY

torch = pytest.importorskip("torch")


def _add_one_in_place(x):
    x.add_(1)  # what a torch stage may do to its input: must never reach read-only memory
    return x


def test_read_only_numpy_reaches_torch_as_a_copy_and_stays_unchanged():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.flags.writeable = False
    before = a.copy()
    t = tx.from_dlpack(a)
    assert t.readonly and t.mutability == "readonly"
    chain = tx.Chain([tx.Stage(_add_one_in_place, framework="torch", name="bump")], max_in_flight=1)
    try:
        run = chain.run([t])
    finally:
        chain.close()
    assert (a == before).all(), "PyTorch wrote into read-only memory"
    assert (np.from_dlpack(run.outputs[0]) == before + 1).all()
    hop = run.hops[0]
    assert hop["shared"] is False and hop["transport"] == "in-process"
    assert "read-only" in hop["reason"] and "torch" in hop["reason"]


def test_jax_array_reaches_torch_as_a_copy():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(6.0, dtype=jnp.float32)
    chain = tx.Chain([tx.Stage(_add_one_in_place, framework="torch")], max_in_flight=1)
    try:
        run = chain.run([x])
    finally:
        chain.close()
    assert (np.asarray(x) == np.arange(6.0)).all()
    assert run.hops[0]["shared"] is False and "read-only" in run.hops[0]["reason"]


def test_read_only_numpy_reaches_a_tvm_ffi_stage_as_a_copy():
    # tvm-ffi tensors are writable (and its C exchange API carries no flag): the chain gives
    # such a stage a copy of truly read-only memory
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False

    def write_through(x):
        np.from_dlpack(x)[...] = -1.0  # a kernel that writes its input
        return x

    chain = tx.Chain([tx.Stage(write_through, framework="tvm_ffi", name="writer")], max_in_flight=1)
    try:
        run = chain.run([a])
    finally:
        chain.close()
    assert (a == np.arange(4, dtype=np.float32)).all(), "tvm-ffi wrote into read-only memory"
    assert run.hops[0]["shared"] is False and "read-only" in run.hops[0]["reason"]


def test_unknown_mutability_keeps_flowing_zero_copy():
    # A legacy capsule cannot say read-only; the library imports it read-only, of
    # unknown mutability (ONNX Runtime's outputs come so): it is not copied.
    t = tx.from_dlpack(np.zeros(4, dtype=np.float32).__dlpack__())
    assert t.readonly and t.mutability == "unknown"
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="torch")], max_in_flight=1)
    try:
        run = chain.run([t])
    finally:
        chain.close()
    assert run.hops[0]["shared"] is True and "reason" not in run.hops[0]


def test_numpy_stage_gets_read_only_memory_without_a_copy():
    a = np.arange(4.0)
    a.flags.writeable = False
    chain = tx.Chain([tx.Stage(lambda x: x + 1, framework="numpy")], max_in_flight=1)
    try:
        run = chain.run([a])
    finally:
        chain.close()
    assert run.hops[0]["shared"] is True  # NumPy honours the flag: no copy needed


def test_the_list_and_the_hop_keys():
    assert {"torch", "cupy", "tvm_ffi"} <= IGNORES_READ_ONLY and "numpy" not in IGNORES_READ_ONLY
    assert tx.empty(3).mutability == "writable"
    with tx.borrow(bytes(16), shape=(4,), dtype="float32") as view:
        assert view.mutability == "readonly"
    chain = tx.Chain([tx.Stage(lambda x: x[::2].copy(), framework="numpy")], max_in_flight=1)
    try:
        run = chain.run([np.arange(8.0)])
    finally:
        chain.close()
    for hop in run.hops:
        assert hop["transport"] == "in-process"
        assert ("reason" in hop) is (not hop["shared"])


def test_read_only_copy_in_a_pipelined_chain_is_made_before_the_stage_reads_it():
    # Pipelined, the stage runs inside its host stream's task: the copy must be made at
    # once, not queued behind that very task (the stage would read unwritten memory).
    a = np.arange(1 << 16, dtype=np.float32)
    a.flags.writeable = False
    chain = tx.Chain([tx.Stage(lambda x: x.clone(), framework="torch"),
                      tx.Stage(lambda x: x + 0, framework="numpy")], max_in_flight=2)
    try:
        run = chain.run([a] * 4)
    finally:
        chain.close()
    for out in run.outputs:
        np.testing.assert_array_equal(np.from_dlpack(out), a)
    assert all(not b[0]["shared"] and "read-only" in b[0]["reason"] for b in run.batch_hops)
