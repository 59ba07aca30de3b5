"""tx.Chain on the CPU with real NumPy, PyTorch, JAX and ONNX Runtime stages (issue 5)."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest

import exchange as tx

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _settle() -> dict:
    gc.collect()
    tx.registry().collect(timeout=10)
    return tx.registry().stats()


def _linear_softmax_model(w: np.ndarray, b: np.ndarray) -> "ort.InferenceSession":
    """A real ONNX graph: probs = softmax(x @ w + b), batch dimension symbolic."""
    from onnx import TensorProto, helper, numpy_helper

    n_in, n_out = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]),
         helper.make_node("Add", ["xw", "b"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)],
        "linear_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _reference(x, w, b):
    z = x @ w + b
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def model():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    return w, b, _linear_softmax_model(w, b)


def test_four_frameworks_share_memory_and_compute(model):
    w, b, session = model
    base = _settle()
    chain = tx.Chain([
        tx.Stage(lambda x: x * np.float32(0.5), framework="numpy", name="scale"),
        tx.Stage(session, framework="onnxruntime", name="model"),
        tx.Stage(lambda p: torch.log(p), framework="torch", name="log"),
        tx.Stage(lambda lp: jnp.argmax(lp, axis=-1).astype(jnp.int32), framework="jax", name="argmax"),
    ])
    xs = [np.random.default_rng(i).standard_normal((8, 16)).astype(np.float32) for i in range(3)]
    run = chain.run(xs)
    assert [h["to"] for h in run.hops] == ["numpy", "onnxruntime", "torch", "jax", "tx"]
    assert all(h["shared"] for h in run.hops), run.hops
    assert set(run.stage_ms) == {"scale", "model", "log", "argmax"}
    for x, out in zip(xs, run.outputs):
        expected = _reference(x * 0.5, w, b).argmax(-1)
        np.testing.assert_array_equal(np.from_dlpack(out), expected)
    del run, out
    chain.close()
    assert _settle()["live_records"] == base["live_records"]


def test_outputs_outlive_chain_models_and_sessions(model):
    w, b, session = model
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    chain = tx.Chain([tx.Stage(session, framework="onnxruntime"),
                      tx.Stage(lambda p: p * 2.0, framework="torch")])
    out = chain(x)
    chain.close()
    del chain, session, model
    gc.collect()
    tx.registry().collect()
    assert out.record.state == "live"
    np.testing.assert_allclose(np.from_dlpack(out), 2 * _reference(x, w, b), rtol=1e-5)


def test_dict_inputs_and_several_outputs():
    chain = tx.Chain([
        tx.Stage(lambda a, b: (a + b, a - b), framework="numpy", name="sum_diff"),
        tx.Stage(lambda s, d: {"prod": s * d}, framework="torch", name="prod"),
    ])
    a, b = np.arange(6.0), np.ones(6)
    out = chain({"a": a, "b": b})
    assert set(out) == {"prod"}
    np.testing.assert_allclose(np.from_dlpack(out["prod"]), (a + b) * (a - b))
    chain.close()


def test_pipelining_overlaps_stages_of_consecutive_batches():
    # Stage 1 of batch 0 waits until stage 0 of batch 1 has started: this completes only
    # if the two run at the same time (host streams), and times out if they are serial.
    started_b1 = threading.Event()
    overlapped = []

    def first(x):
        if x[0] == 1:
            started_b1.set()
        return x + 0

    def second(x):
        if x[0] == 0:
            overlapped.append(started_b1.wait(timeout=20))
        return x * 1

    chain = tx.Chain([tx.Stage(first, framework="numpy"), tx.Stage(second, framework="numpy")], max_in_flight=2)
    run = chain.run([np.full(4, float(i)) for i in range(3)])
    chain.close()
    assert overlapped == [True]
    assert [float(np.from_dlpack(o)[0]) for o in run.outputs] == [0.0, 1.0, 2.0]


def test_each_stage_runs_on_its_own_host_stream():
    threads = {}

    def record(name):
        def fn(x):
            threads[name] = threading.current_thread().name
            return x + 1
        return fn

    chain = tx.Chain([tx.Stage(record("a"), framework="numpy"), tx.Stage(record("b"), framework="torch")])
    chain(np.zeros(3))
    chain.close()
    assert threads["a"] != threads["b"]
    assert all(name.startswith("tx-host-stream") for name in threads.values())


def test_intermediates_released_as_the_next_stage_takes_them():
    n = 1 << 16  # 512 KiB of float64 per stage output
    chain = tx.Chain([tx.Stage(lambda x: x + 1, framework="numpy", name=f"s{i}") for i in range(6)],
                     max_in_flight=1)
    x = np.zeros(n)
    base = _settle()
    run = chain.run([x])
    per_output = n * 8
    sum_of_outputs = 6 * per_output
    # input + at most two stage outputs at once, not the sum of all six
    assert run.peak_live_bytes - sum(base["live_bytes"].values()) <= 3 * per_output < sum_of_outputs
    np.testing.assert_array_equal(np.from_dlpack(run.outputs[0]), np.full(n, 6.0))
    chain.close()


def test_onnxruntime_writes_into_caller_buffer(model):
    w, b, session = model
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    out = tx.empty((4, 5), "float32")
    chain = tx.Chain([tx.Stage(session, framework="onnxruntime", out=out)])
    result = chain(x)
    chain.close()
    assert result is out
    np.testing.assert_allclose(np.from_dlpack(out), _reference(x, w, b), rtol=1e-5)


def test_torch_writes_into_caller_buffer_with_out():
    out = tx.empty((5,), "float32")
    chain = tx.Chain([tx.Stage(lambda x, out: torch.add(x, 1.0, out=out), framework="torch", out=out)])
    result = chain(np.arange(5, dtype=np.float32))
    chain.close()
    assert result is out
    np.testing.assert_array_equal(np.from_dlpack(out), np.arange(1, 6, dtype=np.float32))


def test_wrong_output_buffer_is_refused_before_anything_runs(model):
    _, _, session = model
    with pytest.raises(ValueError, match="float32"):
        tx.Chain([tx.Stage(session, framework="onnxruntime", out=tx.empty((4, 5), "float64"))])
    with pytest.raises(ValueError, match="shape"):
        tx.Chain([tx.Stage(session, framework="onnxruntime", out=tx.empty((4, 6), "float32"))])


def test_stage_returning_non_dlpack_names_the_stage():
    chain = tx.Chain([tx.Stage(lambda x: [1, 2, 3], framework="numpy", name="bad_stage")])
    with pytest.raises(TypeError, match="bad_stage"):
        chain(np.zeros(3))
    chain.close()


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_stage_returning_python_values_says_what_a_stage_returns(max_in_flight):
    cases = [
        (lambda x: [1, 2], r"'bad' \(numpy\) returned a list of 2 items, which a chain takes as 2 outputs, one per "
                           r"item; item 0 is an int, which has no __dlpack__\. Return one array \(np\.asarray"),
        (lambda x: (x, None), r"returned a tuple of 2 items.*item 1 is None, which has no __dlpack__"),
        (lambda x: 3.5, r"returned a float, which has no __dlpack__; return an array \(np\.asarray\(value\)\)"),
        (lambda x: {"y": 1}, r"returned a dict whose output 'y' is an int, which has no __dlpack__"),
    ]
    for fn, message in cases:
        chain = tx.Chain([tx.Stage(fn, framework="numpy", name="bad")], max_in_flight=max_in_flight)
        try:
            with pytest.raises(TypeError, match=message):
                chain.run([np.zeros(3)])
        finally:
            chain.close()
    chain = tx.Chain([tx.Stage(lambda x: [1, 2], framework="torch", name="t")])
    with pytest.raises(TypeError, match=r"torch\.as_tensor\(value\)"):
        chain(np.zeros(3))
    chain.close()


def test_run_given_one_batch_says_it_takes_an_iterable_of_batches():
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="numpy")], max_in_flight=1)
    for one in (np.zeros(3), tx.empty((3,)), {"x": np.zeros(3)}, "x"):
        with pytest.raises(TypeError, match=r"Chain\.run takes an iterable of batches .*got one batch .*"
                                            r"call chain\(x\) or chain\.run\(\[x\]\)"):
            chain.run(one)
    for scalar in (5, np.float64(1.0)):
        with pytest.raises(TypeError, match=r"iterable of batches.*(int|float64), which is not iterable; to run one "
                                            r"batch x, call chain\(x\)"):
            chain.run(scalar)
    with pytest.raises(TypeError, match=r"the batch is a builtins\.float, which has no __dlpack__; a batch is an "
                                        r"array .*, a tuple or a dict of arrays"):
        chain.run([1.0, 2.0])
    with pytest.raises(TypeError, match=r"the batch's input 1 is a builtins\.str, which has no __dlpack__"):
        chain((np.zeros(2), "x"))
    # an array of rows is an iterable of batches, as before
    assert len(chain.run(np.zeros((2, 3))).outputs) == 2
    chain.close()


def test_stage_that_raises_is_named_and_nothing_leaks():
    base = _settle()

    def boom(x):
        raise RuntimeError("model exploded")

    chain = tx.Chain([tx.Stage(lambda x: x + 1, framework="numpy"),
                      tx.Stage(boom, framework="torch", name="exploder"),
                      tx.Stage(lambda x: x, framework="numpy")])
    with pytest.raises(tx.StageError, match="exploder") as info:
        chain.run([np.zeros(8) for _ in range(4)])
    assert isinstance(info.value.__cause__, RuntimeError)
    chain.close()
    del info
    after = _settle()
    assert after["live_records"] == base["live_records"]
    assert after["exports_outstanding"] == base["exports_outstanding"]


def test_missing_framework_names_the_package(monkeypatch):
    from exchange import frameworks

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail as if absent
    monkeypatch.setattr(frameworks, "_cache", {})
    with pytest.raises(tx.BackendUnavailableError, match="cupy"):
        tx.Chain([tx.Stage(lambda x: x, framework="cupy")])
    with pytest.raises(ImportError):  # BackendUnavailableError is an ImportError
        tx.Chain([tx.Stage(lambda x: x, framework="cupy")])


def test_unknown_framework_and_bad_stage():
    with pytest.raises(ValueError, match="unknown framework"):
        tx.Chain([tx.Stage(lambda x: x, framework="caffe")])
    with pytest.raises(TypeError):
        tx.Stage(42, framework="numpy")
    with pytest.raises(TypeError):
        tx.Chain([lambda x: x])


# -- the chain's own overhead (issue 10, item 5): what it skips must not change results --
def _numpy_chain(max_in_flight, log=None, stream=None):
    def first(x):
        y = x * 2
        if log is not None:
            log.append(("in0", x.ctypes.data, "out0", y.ctypes.data))
        return y

    def second(x):
        y = x + 1
        if log is not None:
            log.append(("in1", x.ctypes.data, "out1", y.ctypes.data))
        return y

    return tx.Chain([tx.Stage(first, framework="numpy", stream=stream),
                     tx.Stage(second, framework="numpy", stream=stream)], max_in_flight=max_in_flight)


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_numpy_hops_reported_shared_are_one_address(max_in_flight):
    # NumPy hops are shared by NumPy's contract (no pointer read back per batch): the
    # stages' own arrays show it is so, input to output.
    log = []
    chain = _numpy_chain(max_in_flight, log)
    xs = [np.arange(256, dtype=np.float32) + i for i in range(3)]
    run = chain.run(xs)
    chain.close()
    # each stage sees the batches in order (pipelined, the two stages' entries interleave)
    firsts = [e for e in log if e[0] == "in0"]
    seconds = [e for e in log if e[0] == "in1"]
    for x, out, (_, in0, _, out0), (_, in1, _, out1) in zip(xs, run.outputs, firsts, seconds, strict=True):
        assert in0 == x.ctypes.data and in1 == out0 and out.data_ptr == out1
    assert [(h["from"], h["to"], h["shared"], h["bytes"]) for h in run.hops] == [
        ("input", "numpy", True, 1024), ("numpy", "numpy", True, 1024), ("numpy", "tx", True, 1024)]
    assert len(run.batch_hops) == 3 and all(b == run.hops for b in run.batch_hops)
    for x, out in zip(xs, run.outputs):
        np.testing.assert_array_equal(np.from_dlpack(out), x * 2 + 1)


def test_call_without_a_report_gives_what_run_gives_and_keeps_nothing():
    base = _settle()
    inline, piped = _numpy_chain(1), _numpy_chain(2)
    x = np.arange(256, dtype=np.float32)
    for chain in (inline, piped):
        np.testing.assert_array_equal(np.from_dlpack(chain(x)), np.from_dlpack(chain.run([x]).outputs[0]))
        for _ in range(200):
            chain(x)
    inline.close()
    piped.close()
    after = _settle()
    assert after["live_records"] == base["live_records"]
    assert after["exports_outstanding"] == base["exports_outstanding"]


def test_pipelined_and_inline_report_the_same():
    batches = [np.full((4, 8), float(i), dtype=np.float32) for i in range(6)]
    runs = []
    for mif in (1, 3):
        chain = tx.Chain([tx.Stage(lambda x: x + 1, framework="numpy", name="same"),
                          tx.Stage(lambda x: torch.relu(x), framework="torch", name="relu"),
                          tx.Stage(lambda x: x * 2, framework="numpy", name="same")], max_in_flight=mif)
        runs.append(chain.run(batches))
        chain.close()
    inline, piped = runs
    assert inline.batch_hops == piped.batch_hops and len(piped.batch_hops) == len(batches)
    assert [h["to"] for h in piped.hops] == ["numpy", "torch", "numpy", "tx"]
    assert set(inline.stage_ms) == set(piped.stage_ms) == {"same", "relu"}  # a shared name is summed
    for a, b in zip(inline.outputs, piped.outputs):
        np.testing.assert_array_equal(np.from_dlpack(a), np.from_dlpack(b))


def test_pipelined_stages_run_in_the_callers_context_and_report_plain_dicts():
    """Each stage's stream runs in a copy of the caller's contextvars context made when
    the run starts (what tx.track() relies on): every stage sees what the caller set, and
    what a stage sets reaches neither the caller nor another stage. The hops, kept
    compact while the batches run, come back as dicts."""
    import contextvars
    import json

    var = contextvars.ContextVar("tx_test_chain_var", default="unset")
    seen = []

    def look(label):
        def stage(x):
            seen.append((label, var.get()))
            var.set(f"set by {label}")
            return x
        return stage

    chain = tx.Chain([tx.Stage(look("a"), framework="numpy", name="a"),
                      tx.Stage(look("b"), framework="numpy", name="b")], max_in_flight=2)
    token = var.set("caller")
    try:
        result = chain.run([np.ones(4, dtype=np.float32)] * 3)
    finally:
        var.reset(token)
    chain.close()
    assert [v for _, v in seen if _ == "b"] == ["caller", "set by b", "set by b"]  # b's own copy, not a's
    assert [v for _, v in seen if _ == "a"] == ["caller", "set by a", "set by a"]
    assert var.get() == "unset"
    assert all(type(h) is dict for batch in result.batch_hops for h in batch)
    assert json.loads(json.dumps(result.batch_hops))[0] == [
        {"from": "input", "to": "numpy", "bytes": 16, "shared": True, "transport": "in-process"},
        {"from": "numpy", "to": "numpy", "bytes": 16, "shared": True, "transport": "in-process"},
        {"from": "numpy", "to": "tx", "bytes": 16, "shared": True, "transport": "in-process"}]


def test_pipelined_intermediates_are_released_on_their_stage_without_an_event():
    # Each stage drops its inputs inside its own task, after its function returned: the
    # release needs no event, so nothing is left pending once the run is back.
    base = _settle()
    chain = _numpy_chain(2)
    run = chain.run([np.ones(64, dtype=np.float32) for _ in range(20)])
    stats = tx.registry().stats()
    assert stats["pending_releases"] == base["pending_releases"]
    assert stats["live_records"] == base["live_records"] + len(run.outputs)
    chain.close()


def test_stages_on_one_stream_run_in_one_task():
    # Two stages given the same host stream: the second runs in the first one's task,
    # right after it, never behind the next batch's first stage.
    s = tx.create_stream("cpu")
    log = []
    chain = _numpy_chain(4, log, stream=s)
    try:
        run = chain.run([np.full(16, float(i), dtype=np.float32) for i in range(8)])
    finally:
        chain.close()
        s.close()
    assert [e[0] for e in log] == ["in0", "in1"] * 8
    assert [float(np.from_dlpack(o)[0]) for o in run.outputs] == [i * 2 + 1.0 for i in range(8)]


def test_hop_reports_are_separate_objects():
    chain = _numpy_chain(1)
    first = chain.run([np.zeros(8), np.zeros(8)])
    first.batch_hops[0][0]["bytes"] = -1
    second = chain.run([np.zeros(8)])
    chain.close()
    assert first.batch_hops[1][0]["bytes"] == 64 and second.hops[0]["bytes"] == 64


def test_inline_stages_on_a_host_stream_take_views_ordered_on_it():
    # The inline path with a stream (what CUDA stages take, here on a host stream): each
    # stage gets views ordered on its stream, and the outputs are correct and shared.
    s = tx.create_stream("cpu")
    chain = _numpy_chain(1, stream=s)
    try:
        x = np.arange(32, dtype=np.float32)
        run = chain.run([x, x + 1])
        out = chain(x)
    finally:
        chain.close()
    assert all(h["shared"] for b in run.batch_hops for h in b) and len(run.hops) == 3
    np.testing.assert_array_equal(np.from_dlpack(run.outputs[1]), (x + 1) * 2 + 1)
    np.testing.assert_array_equal(np.from_dlpack(out), x * 2 + 1)
    assert out.stream is s
    s.close()


@pytest.mark.parametrize("call", ["call", "run"])
def test_inline_errors_name_the_stage_and_leak_nothing(call):
    base = _settle()

    def boom(x):
        raise RuntimeError("model exploded")

    cases = [([tx.Stage(lambda x: [1, 2, 3], framework="numpy", name="bad_stage")], TypeError, "bad_stage"),
             ([tx.Stage(lambda x: x + 1, framework="numpy"), tx.Stage(boom, framework="numpy", name="exploder")],
              tx.StageError, "exploder"),
             ([tx.Stage(lambda x: x, framework="numpy", name="takes_cpu")], tx.StageError, "could not take")]
    for stages, error, match in cases:
        chain = tx.Chain(stages, max_in_flight=1)
        x = np.zeros(8)
        if match == "could not take":  # a view whose borrow() scope has ended: its export refuses
            with tx.borrow(bytearray(64), shape=(8,), dtype="float64") as x:
                pass
        try:
            with pytest.raises(error, match=match):
                chain(x) if call == "call" else chain.run([x, x])
        finally:
            chain.close()
    del x  # the last input, a tx Tensor of its own
    after = _settle()
    assert after["live_records"] == base["live_records"]
    assert after["exports_outstanding"] == base["exports_outstanding"]


def test_stages_with_the_same_default_name_get_their_own_timings():
    # Two lambdas: both named "<lambda>" by default; their timings stay apart (a name
    # the caller gives twice is summed, as documented).
    chain = tx.Chain([tx.Stage(lambda x: x * 2, framework="numpy"), tx.Stage(lambda x: x + 1, framework="numpy")],
                     max_in_flight=1)
    run = chain.run([np.ones(2)])
    assert set(run.stage_ms) == {"<lambda>", "<lambda> #1"}
    chain.close()


def _pulled_while_the_first_batch_is_held(run, n_batches: int, gate: threading.Event,
                                         admitted: int) -> tuple[int, Any]:
    """Run ``run(batches)`` on a thread while the first stage holds every batch until
    ``gate`` is set: how many batches the chain took in meanwhile (waiting first for the
    ``admitted`` it should take, then a while for any more), and what the run gave."""
    pulled: list[int] = []

    def batches():
        for i in range(n_batches):
            pulled.append(i)
            yield np.full(4, i, dtype=np.float32)

    out: list = []
    worker = threading.Thread(target=lambda: out.append(run(batches())))
    worker.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(pulled) < admitted:
        time.sleep(0.01)
    time.sleep(0.5)  # the chain has had time to take more batches than it may
    taken = len(pulled)
    gate.set()
    worker.join(30)
    assert not worker.is_alive()
    return taken, out[0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_max_in_flight_admits_exactly_n_batches(n):
    # max_in_flight=N let N + 1 batches in: the check came after the append.
    gate = threading.Event()

    def held(x):
        gate.wait(20)
        return x + 1

    chain = tx.Chain([tx.Stage(held, framework="numpy"), tx.Stage(lambda x: x * 2, framework="numpy")],
                     max_in_flight=n)
    try:
        taken, result = _pulled_while_the_first_batch_is_held(chain.run, n + 3, gate, n)
    finally:
        chain.close()
    assert taken == n, f"max_in_flight={n} took {taken} batches in while the first was held"
    assert [float(np.from_dlpack(t)[0]) for t in result.outputs] == [(i + 1) * 2.0 for i in range(n + 3)]


def test_a_pipelined_chain_leaves_no_cycle_behind_its_runs():
    # Each run's stage task hands itself on to the next stream; were it a closure over
    # itself, a dropped chain (its streams, its threads' work) would wait for a collection.
    gc.collect()
    gc.disable()
    try:
        chain = tx.Chain([tx.Stage(lambda x: x, framework="numpy"), tx.Stage(lambda x: x + 1, framework="numpy")],
                         max_in_flight=2)
        for _ in range(2):
            assert [float(np.from_dlpack(t)[0]) for t in chain.run([np.ones(4)] * 5).outputs] == [2.0] * 5
        ref = weakref.ref(chain)
        del chain
        # The last stage's worker may still be letting go of its finished task (on the
        # pure path it does so once it has the GIL again): that goes by itself, a cycle
        # would not (the collector is off).
        deadline = time.monotonic() + 5
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ref() is None, "the chain outlived its last reference: a cycle holds it"
    finally:
        gc.enable()


def test_an_executor_is_anything_with_start():
    # exchange.chain.ChainExecutor, the one interface between the chain and an executor (the
    # chain never imports an executor's module: tests/cpu/test_layout.py)
    class Runner:
        def __init__(self) -> None:
            self.closed = False

        def run(self, batches: Any, *, progress: bool = False) -> Any:
            return tx.ChainResult(outputs=[b for b in batches], executor="elsewhere")

        def close(self) -> None:
            self.closed = True

    class Elsewhere:
        def start(self, stages: list, device: Any) -> Runner:
            self.started = (list(stages), str(device))
            self.runner = Runner()
            return self.runner

    executor = Elsewhere()
    stage = tx.Stage(lambda x: x, framework="numpy", name="same")
    chain = tx.Chain([stage], executor=executor)
    assert executor.started == ([stage], "cpu")
    run = chain.run([1, 2])
    assert run.outputs == [1, 2] and run.executor == "elsewhere"
    assert chain(3) == 3  # one batch goes through the runner too
    chain.close()
    assert executor.runner.closed
    with pytest.raises(TypeError, match="executor must be"):
        tx.Chain([stage], executor=object())
    with pytest.raises(ValueError, match="unknown executor"):
        tx.Chain([stage], executor="dask")


def test_a_torch_stage_may_return_a_tx_tensor():
    # tx.Tensor.data_ptr is an int, not torch's method: the report must still say the
    # hop out shared the stage's memory rather than fail reading the pointer.
    torch = pytest.importorskip("torch")

    def stage(x):
        return tx.from_dlpack(x * 2)

    chain = tx.Chain([tx.Stage(stage, framework="torch")])
    run = chain.run([np.arange(4.0)])
    chain.close()
    np.testing.assert_array_equal(np.from_dlpack(run.outputs[0]), np.arange(4.0) * 2)
    assert torch is not None
    out_hop = run.hops[-1]
    assert out_hop["shared"], out_hop  # the stage's tx Tensor is the output itself
