"""tx.Tensor and tx.Chain on Ray (issue 13), against a real local Ray cluster started once
for this module (2 CPUs, no dashboard) and shut down after it.

Covers: tensors through the object store (``ray.put`` / ``ray.get``, task and actor
arguments and returns) zero-copy, read-only, owned by their record; read-only memory
never reaching PyTorch writable; a chain across actors (hops, transports, live records
per process, close); the Ray Direct Transport for tx.Tensor through its own interface
with host memory and end to end on CPU actors; and the faults: Ray missing, a stage
that raises, an actor that dies mid-batch, a batch past its time limit, an ObjectRef
freed by its owner while a tx Tensor holds the data, a ``tx.borrow`` scope ending in an
actor, the driver exiting while actors hold tensors.

Every test is bounded: Ray calls take timeouts, subprocesses too, and an alarm stops any
test after ``LIMIT_S`` seconds. Skipped with the reason where Ray is not installed.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pickle
import signal
import subprocess
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
from process_helpers import run_python

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tensor-exchange[ray]')")

from exchange.ray import objects as ray_objects  # noqa: E402  (after the skip: Ray is here)
from ray_helpers import cluster, live_ids, time_limit  # noqa: E402, F401  (cluster, time_limit: fixtures)

ROOT = Path(__file__).resolve().parents[2]
# Ray workers cannot import this test module by name: send its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
LIMIT_S = 120  # per test
GET_S = 60  # per ray.get


def _ends(actor, within_s: float = 30.0) -> bool:
    """The actor is (or within ``within_s`` becomes) dead."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=GET_S)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


@ray.remote
class Holder:
    """Holds what it is given; answers about it."""

    def hold(self, t):
        self.t = t
        return self.describe()

    def hold_from(self, refs):
        self.t = ray.get(refs[0], timeout=GET_S)
        return self.describe()

    def describe(self):
        t = self.t
        return {"type": type(t).__name__, "readonly": t.readonly, "origin": t.record.origin,
                "sum": float(np.from_dlpack(t).astype(np.float64).sum()), "ptr": t.data_ptr,
                "transport": ray_objects.transport(t), "ref": ray_objects.object_ref(t) is not None}

    def make(self, n):
        return tx.from_dlpack(np.arange(n, dtype=np.float32))

    def borrowed(self):
        buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
        with tx.borrow(buf, shape=(4,), dtype="float32") as view:
            return view  # serialized after the scope ended

    def drop(self):
        self.t = None
        gc.collect()
        tx.registry().collect(timeout=5)
        return tx.registry().stats()["live_records"]


# -- tensors through the object store ------------------------------------------------------
def _bytes_of(t: tx.Tensor) -> np.ndarray:
    """The bytes of C-contiguous host tensor ``t`` (any dtype, bfloat16 too), as uint8."""
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr))


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "bfloat16"])
def test_put_get_is_zero_copy_read_only_and_owned(dtype):
    src = tx.empty((64, 1024), dtype)
    view = _bytes_of(src)
    view[...] = (np.arange(view.size) % 2 if dtype == "bool" else np.arange(view.size) % 251).astype(np.uint8)
    ref = ray.put(src)
    out = ray.get(ref, timeout=GET_S)
    assert isinstance(out, tx.Tensor)
    assert out.shape == src.shape and out.dtype == src.dtype and out.is_contiguous()
    assert out.readonly and out.mutability == "readonly"
    assert out.record.origin == f"imported from ray object {ref.hex()}"
    assert ray_objects.object_ref(out) == ref and ray_objects.transport(out) == "ray-object-store"
    assert (_bytes_of(out) == view).all()
    if dtype != "bfloat16":
        back = np.from_dlpack(out)
        assert not back.flags.writeable
        assert back.ctypes.data == out.data_ptr  # NumPy reads the store's memory itself
    assert out.data_ptr % 64 == 0


def test_layouts_travel_as_values():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for array in (base[:, ::-2], base.T, np.array(3.5, dtype=np.float32), np.zeros((0, 3), np.float32)):
        got = ray.get(ray.put(tx.from_dlpack(array)), timeout=GET_S)
        assert got.shape == array.shape
        assert (np.from_dlpack(got) == array).all()


def test_plain_pickle_still_refuses():
    # With Ray imported the refusal says that Ray's own pickling takes tx Tensors: only
    # plain pickle refuses, in a task's code too; Ray's pickler takes them wherever it
    # pickles once Ray is connected.
    with pytest.raises(TypeError, match=r"cannot be pickled.*Ray's own pickling .* takes tx Tensors"):
        pickle.dumps(tx.empty(3))

    @ray.remote
    def plain(x):
        try:
            pickle.dumps(x)
        except TypeError:
            return "refused"
        return "pickled"

    assert ray.get(plain.remote(tx.from_dlpack(np.arange(3.0))), timeout=GET_S) == "refused"
    assert isinstance(pickle.loads(ray.cloudpickle.dumps(tx.from_dlpack(np.arange(3.0)))), tx.Tensor)


def test_task_and_actor_arguments_and_returns():
    @ray.remote
    def double(t):
        return tx.from_dlpack(np.from_dlpack(t) * 2)  # a worker sends a tx.Tensor back

    t = tx.from_dlpack(np.arange(50_000, dtype=np.float32))  # 200 KB: through the store
    out = ray.get(double.remote(t), timeout=GET_S)
    assert isinstance(out, tx.Tensor) and (np.from_dlpack(out) == np.arange(50_000) * 2).all()
    small = ray.get(double.remote(tx.from_dlpack(np.arange(3.0))), timeout=GET_S)  # inlined by Ray
    assert (np.from_dlpack(small) == [0.0, 2.0, 4.0]).all()

    h = Holder.remote()
    seen = ray.get(h.hold.remote(t), timeout=GET_S)
    assert seen["type"] == "Tensor" and seen["readonly"] and seen["transport"] == "ray-object-store"
    assert seen["origin"].startswith("imported from ray object")
    made = ray.get(h.make.remote(10), timeout=GET_S)
    assert (np.from_dlpack(made) == np.arange(10)).all()
    ray.kill(h)


def test_ray_workers_import_the_package_of_this_run():
    # CI's wheel pass tests the installed wheel in every process, Ray's workers included
    # (the others: tests/cpu/test_installed.py)
    @ray.remote
    def where():
        import exchange

        return exchange.__file__

    assert Path(ray.get(where.remote(), timeout=GET_S)).resolve().parent == Path(tx.__file__).resolve().parent


def test_object_freed_by_its_owner_stays_while_a_tensor_holds_it():
    h = Holder.remote()
    data = np.full(1 << 20, 7, dtype=np.uint8)  # 1 MiB of 7s
    ref = ray.put(tx.from_dlpack(data))
    seen = ray.get(h.hold_from.remote([ref]), timeout=GET_S)  # the actor borrows the ref
    assert seen["ref"] and seen["sum"] == 7 * (1 << 20)
    mine = ray.get(ref, timeout=GET_S)
    del ref  # the owner's last reference: without the records, the store could reuse it now
    gc.collect()
    for i in range(12):  # 192 MiB of other objects through a 200 MiB store
        ray.get(ray.put(np.full(16 << 20, i + 1, dtype=np.uint8)), timeout=GET_S)
    again = ray.get(h.describe.remote(), timeout=GET_S)
    assert again["sum"] == 7 * (1 << 20) and again["ptr"] == seen["ptr"]
    assert int(np.from_dlpack(mine).sum()) == 7 * (1 << 20)
    assert ray.get(h.drop.remote(), timeout=GET_S) == 0  # the actor's record went with the tensor
    ray.kill(h)


def test_borrow_scope_ending_in_an_actor_is_a_lifetime_error():
    h = Holder.remote()
    with pytest.raises(tx.LifetimeError, match="scope has ended"):
        ray.get(h.borrowed.remote(), timeout=GET_S)
    assert ray.get(h.make.remote(2), timeout=GET_S).shape == (2,)  # the actor lives on
    ray.kill(h)


def test_torch_never_writes_into_the_store():
    torch = pytest.importorskip("torch")
    ref = ray.put(tx.from_dlpack(np.zeros(8, dtype=np.float32)))
    t = ray.get(ref, timeout=GET_S)

    def bump(x):
        x.add_(1)
        return x

    chain = tx.Chain([tx.Stage(bump, framework="torch")], max_in_flight=1)
    try:
        run = chain.run([t])
    finally:
        chain.close()
    assert (np.from_dlpack(run.outputs[0]) == 1).all()
    assert run.hops[0]["shared"] is False and "ray object" in run.hops[0]["reason"]
    assert (np.from_dlpack(ray.get(ref, timeout=GET_S)) == 0).all(), "the stored object changed"
    del torch


# -- chains across actors ----------------------------------------------------------------------
def _scale(x):
    return x * 2.0


def _plus_one(x):
    return x + 1


def test_chain_across_actors():
    torch = pytest.importorskip("torch")
    batches = [np.random.default_rng(i).random((16, 10), dtype=np.float32) for i in range(5)]
    stages = [tx.Stage(_scale, framework="numpy", name="scale"),
              tx.Stage(lambda x: torch.softmax(x, dim=-1), framework="torch", name="softmax"),
              tx.Stage(_plus_one, framework="numpy", name="plus")]
    before = live_ids()
    chain = tx.Chain(stages, executor="ray")
    try:
        run = chain.run(batches)
        actors = list(chain._executor.actors)
        counts = chain._executor.live_records(wait_s=10.0)
    finally:
        chain.close()
    assert run.executor == "ray" and len(run.outputs) == 5
    for x, out in zip(batches, run.outputs):
        expect = torch.softmax(torch.from_numpy(x * 2.0), dim=-1).numpy() + 1
        assert np.allclose(np.from_dlpack(out), expect)
        assert out.readonly and ray_objects.transport(out) == "ray-object-store"
    assert [(h["from"], h["to"]) for h in run.hops] == [("input", "numpy"), ("numpy", "torch"),
                                                        ("torch", "numpy"), ("numpy", "tx")]
    assert all(h["transport"] == "ray-object-store" for h in run.hops)
    by_pair = {(h["from"], h["to"]): h for h in run.hops}
    torch_hop = by_pair[("numpy", "torch")]
    assert torch_hop["shared"] is False and "READ_ONLY" in torch_hop["reason"]  # torch got a copy
    for pair in (("input", "numpy"), ("torch", "numpy"), ("numpy", "tx")):
        assert by_pair[pair]["shared"] is True, by_pair[pair]
    assert len(run.batch_hops) == 5 and all(len(b) == 4 for b in run.batch_hops)
    assert set(run.stage_ms) == {"scale", "softmax", "plus"} and all(v > 0 for v in run.stage_ms.values())
    assert run.live_records["driver"] >= 5  # the outputs
    assert {k: v for k, v in counts.items() if k != "driver"} == {
        "stage 0 scale": 0, "stage 1 softmax": 0, "stage 2 plus": 0}
    for actor in actors:  # close() ended them (ray.kill takes effect a moment later)
        assert _ends(actor), "an actor outlived chain.close()"
    run.outputs.clear()
    del out
    assert live_ids() <= before


def test_a_traced_ray_run_holds_each_actors_stage_spans_records_and_flows(tmp_path):
    """tx.trace in the driver around a Ray chain: each actor is a process of the trace,
    named for its stage, with a span per batch and the records it held; the hops are
    ChainResult.batch_hops, each on the span of the stage it went into; batches are
    numbered once for the whole trace (two runs), and flows join a batch's spans actor
    to actor; the file keeps the format's rules."""
    from trace_format import check_format, spans_inside

    batches = [np.full((4, 4), float(i), dtype=np.float32) for i in range(3)]
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(_plus_one, framework="numpy", name="plus")],
                     executor=tx.RayExecutor(max_in_flight=1))
    path = tmp_path / "ray.json"
    try:
        with tx.trace(path):
            runs = [chain.run(batches), chain.run(batches[:2])]
            for run in runs:
                run.outputs.clear()
    finally:
        chain.close()
    doc = json.loads(path.read_text())
    events = check_format(doc)
    spans_inside(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    actors = {pid: name for pid, name in names.items() if name.startswith("Ray actor")}
    assert sorted(name.split(" (pid")[0] for name in actors.values()) == [
        "Ray actor: stage 0 'scale'", "Ray actor: stage 1 'plus'"]
    spans = [e for e in events if e["ph"] == "X"]
    by_stage = {}
    for e in spans:
        by_stage.setdefault(names[e["pid"]].split(" (pid")[0], []).append(e["args"]["batch"])
    assert {k: sorted(v) for k, v in by_stage.items()} == {
        "Ray actor: stage 0 'scale'": [0, 1, 2, 3, 4], "Ray actor: stage 1 'plus'": [0, 1, 2, 3, 4]}
    hops = [e["args"] for e in events if e["ph"] == "i" and e.get("cat") == "hop"]
    expected = [h for run in runs for batch in run.batch_hops for h in batch]
    key = lambda h: (h["from"], h["to"], h["bytes"], h["shared"], h["transport"])  # noqa: E731
    assert sorted(map(key, hops)) == sorted(map(key, expected)) and len(hops) == 5 * 3
    cross = [e for e in events if e["ph"] == "s" and e["id"] >= 1 << 40]
    assert len(cross) == 5  # stage 0 -> stage 1, per batch
    held = [e for e in events if e.get("cat") == "record" and e["ph"] == "b" and e["pid"] in actors]
    assert held, "the actors' records are in the trace"
    assert os.getpid() in names  # and the driver's own


def _boom_on_batch_three(x):
    if float(x.flat[0]) == 6.0:  # batch 3, scaled by the stage before
        raise ValueError("batch three")
    return x


def test_a_traced_ray_run_with_a_failing_batch_joins_only_the_batches_that_went_on(tmp_path):
    batches = [np.full(4, float(i), dtype=np.float32) for i in range(6)]
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="a"),
                      tx.Stage(_boom_on_batch_three, framework="numpy", name="boom"),
                      tx.Stage(_plus_one, framework="numpy", name="c")],
                     executor=tx.RayExecutor(max_in_flight=2, timeout_s=60))
    try:
        with tx.trace(None) as recording:
            with pytest.raises(tx.StageError, match="stage 1 'boom'"):
                chain.run(batches)
        events = recording.events()
    finally:
        chain.close()
    from trace_format import check_format

    check_format({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {}})
    spans = [e for e in events if e["ph"] == "X"]

    def span_at(e):
        return next(x for x in spans if x["pid"] == e["pid"] and x["tid"] == e["tid"] and x["ts"] == e["ts"])

    joined = {}
    for e in events:
        if e["ph"] in ("s", "f") and e["id"] >= 1 << 40:
            joined.setdefault(e["id"], {})[e["ph"]] = span_at(e)
    assert joined and all(f["s"]["args"]["batch"] == f["f"]["args"]["batch"] for f in joined.values())
    assert not any(f["s"]["args"].get("failed") for f in joined.values())  # nothing leaves a failed span
    failed = [e for e in spans if e["args"].get("failed")]
    assert [e["args"]["batch"] for e in failed] == [3]


def test_max_in_flight_admits_exactly_n_batches(tmp_path):
    # max_in_flight=N let N + 1 batches into the actors: the check came after the submit.
    import threading

    gate = tmp_path / "go"

    def held(x):  # in the actor: holds every batch until the driver creates the file
        deadline = time.monotonic() + 30
        while not os.path.exists(str(gate)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return x + 1

    pulled: list[int] = []

    def batches():
        for i in range(5):
            pulled.append(i)
            yield np.full(4, i, dtype=np.float32)

    chain = tx.Chain([tx.Stage(held, framework="numpy", name="held"), tx.Stage(_plus_one, framework="numpy")],
                     executor=tx.RayExecutor(max_in_flight=2))
    out: list = []
    try:
        chain.run([np.zeros(4, dtype=np.float32)])  # the actors started, warm
        worker = threading.Thread(target=lambda: out.append(chain.run(batches())))
        worker.start()
        deadline = time.monotonic() + 10
        while len(pulled) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # time to take more batches than it may
        taken = len(pulled)
        gate.touch()
        worker.join(GET_S)
        assert not worker.is_alive()
    finally:
        gate.touch()
        chain.close()
    assert taken == 2, f"max_in_flight=2 took {taken} batches in while the first was held"
    assert [float(np.from_dlpack(t)[0]) for t in out[0].outputs] == [i + 2.0 for i in range(5)]


def test_a_run_collects_no_garbage_and_counts_live_records_when_read():
    # Every run() ended with a full collection in the driver and in each actor, to count
    # live records: about 170 ms a run (a one-batch run: 133 ms against 9 ms now).
    full = []

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    chain = tx.Chain([tx.Stage(_plus_one, framework="numpy"), tx.Stage(_plus_one, framework="numpy")],
                     executor=tx.RayExecutor(max_in_flight=1))
    gc.callbacks.append(watch)
    gc.disable()  # no collection of the interpreter's own: only an explicit one counts
    try:
        run = chain.run([np.zeros(4, dtype=np.float32)])
        during = len(full)
        counts = run.live_records
    finally:
        gc.enable()
        gc.callbacks.remove(watch)
        chain.close()
    assert during == 0, "run() collected garbage"
    assert len(full) >= 1 and counts["driver"] >= 1  # counted on the first read (the output is alive)
    assert set(counts) == {"driver", "stage 0 _plus_one", "stage 1 _plus_one"}, counts
    assert run.live_records == counts  # counted once


def test_the_tx_transport_recovers_on_the_next_run_after_an_actor_dies():
    # Under Ray Direct Transport Ray also ends the actors on both sides of a failed
    # transfer: the next run met a dead stage and failed again (two or three runs to
    # recover). Now every actor is stopped after a failure there and the next run works.
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="a"),
                      tx.Stage(_die_on_negative, framework="numpy", name="fragile"),
                      tx.Stage(_scale, framework="numpy", name="c")],
                     executor=tx.RayExecutor(tensor_transport="tx", timeout_s=60))
    try:
        assert chain.run([np.ones(3)]).hops[1]["transport"] != "ray-object-store"
        for _ in range(2):  # the stage that died is named, every time, and the next run recovers
            with pytest.raises(tx.StageError, match="every stage's actor was stopped") as caught:
                chain.run([np.ones(3), -np.ones(3), np.ones(3), np.ones(3)])
            assert str(caught.value).startswith("stage 1 'fragile' (numpy): its Ray actor died"), caught.value
        again = chain.run([np.ones(3)] * 3)
        assert [np.from_dlpack(o).tolist() for o in again.outputs] == [[6.0] * 3] * 3  # (1 * 2 + 1) * 2
        del again
    finally:
        chain.close()


def test_dict_and_tuple_batches_and_factories():
    def split(x):
        return {"a": x + 1, "b": x * 3}

    def join(a, b):
        return a + b, a - b

    chain = tx.Chain([tx.Stage(split, framework="numpy"),
                      tx.Stage(tx.RayExecutor.in_actor(lambda k: (lambda a, b: join(a * k, b)), 1.0),
                               framework="numpy", name="join")],
                     executor=tx.RayExecutor(max_in_flight=1))
    try:
        out = chain(np.arange(4.0))
    finally:
        chain.close()
    assert isinstance(out, tuple) and len(out) == 2
    x = np.arange(4.0)
    assert (np.from_dlpack(out[0]) == (x + 1) + x * 3).all() and (np.from_dlpack(out[1]) == (x + 1) - x * 3).all()


def test_stage_error_names_the_stage_and_the_chain_lives_on():
    def picky(x):
        if x[0] < 0:
            raise ValueError("negative input")
        return x

    before = live_ids()
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(picky, framework="numpy", name="picky")], executor="ray")
    try:
        with pytest.raises(tx.StageError, match=r"stage 1 'picky' \(numpy\).*ValueError: negative input"):
            chain.run([np.ones(3), -np.ones(3), np.ones(3)])
        assert live_ids() <= before
        again = chain.run([np.ones(3)])
        assert (np.from_dlpack(again.outputs[0]) == 2).all()
        del again
    finally:
        chain.close()


def _die_on_negative(x):
    if x[0] < 0:
        os._exit(1)  # the actor's process dies mid-batch
    return x + 1


def test_actor_dying_mid_batch_is_a_stage_error_and_leaves_the_driver_clean():
    before = live_ids()
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(_die_on_negative, framework="numpy", name="fragile")],
                     executor=tx.RayExecutor(timeout_s=60))
    try:
        with pytest.raises(tx.StageError, match=r"stage 1 'fragile'.*actor died"):
            chain.run([np.ones(3), -np.ones(3), np.ones(3), np.ones(3)])
        assert live_ids() <= before, "the driver's registry kept tensors of the failed run"
        again = chain.run([np.ones(3)])  # a new actor for the stage
        assert (np.from_dlpack(again.outputs[0]) == 3).all()
        del again
    finally:
        chain.close()


def _slow_plus_one(x):
    time.sleep(0.1)
    return x + 1


def _dies_on_negative(x):
    if x[0] < 0:
        os._exit(1)
    time.sleep(0.1)
    return x


def test_a_failed_run_leaves_no_unhandled_ray_errors(caplog):
    # The first actor dies while later batches are in flight behind it: each of them then
    # fails in the next actor ("an input argument could not be computed"). The chain
    # raises for the first; the others must not be left for Ray to report at random
    # later as "Unhandled error" tracebacks on the driver's log.
    chain = tx.Chain([tx.Stage(_dies_on_negative, framework="numpy", name="fragile"),
                      tx.Stage(_slow_plus_one, framework="numpy", name="slow")],
                     executor=tx.RayExecutor(timeout_s=60, max_in_flight=6))
    try:
        with caplog.at_level("ERROR"):
            with pytest.raises(tx.StageError, match="stage 0 'fragile'.*actor died"):
                chain.run([np.ones(2)] * 2 + [-np.ones(2)] + [np.ones(2)] * 6)
            gc.collect()
            deadline = time.monotonic() + 3  # Ray reports a dropped error within a moment
            while time.monotonic() < deadline and "Unhandled error" not in caplog.text:
                time.sleep(0.1)
        assert "Unhandled error" not in caplog.text, caplog.text[-2000:]
    finally:
        chain.close()


def test_a_batch_past_its_time_limit_is_a_stage_error():
    def slow(x):
        time.sleep(30 if x[0] < 0 else 0)
        return x

    chain = tx.Chain([tx.Stage(slow, framework="numpy", name="slow")], executor=tx.RayExecutor(timeout_s=2))
    try:
        with pytest.raises(tx.StageError, match=r"stage 0 'slow'.*did not finish a batch within 2 s"):
            chain.run([-np.ones(2)])
    finally:
        chain.close()


def test_a_stage_asking_for_a_gpu_the_cluster_lacks_fails_within_timeout_s():
    # Ray keeps such an actor pending, silent; the chain's wait for it is bounded by
    # timeout_s, and the error names what the cluster lacks.
    signal.alarm(60)  # a hang guard: it used to wait start_timeout_s, 120 s, whatever timeout_s said
    stage = tx.Stage(_scale, framework="numpy", name="scale")
    executor = tx.RayExecutor(resources={"scale": {"num_gpus": 1}}, timeout_s=3)
    with pytest.raises(tx.StageError, match=r"stage 0 'scale' \(numpy\): its Ray actor did not start within 3 s "
                                            r"\(timeout_s\): it asks for GPU 1, more than the whole cluster has "
                                            r"\(GPU 0; all it has: CPU 2"):
        tx.Chain([stage], executor=executor)
    assert tx.Chain([stage], executor=tx.RayExecutor(timeout_s=3)).run([np.ones(2)]).outputs  # the cluster is fine


def test_stages_on_device_memory_share_a_gpu_and_host_stages_ask_for_none():
    """Whether a stage needs a GPU is asked of its backend (the host cannot read its
    memory in place: exchange.devices' MemoryKind), not read from a device name: such
    stages share one GPU unless they say otherwise; host stages ask for none. Nothing
    starts here (no actor, no device)."""
    stages = [tx.Stage(_scale, framework="torch", device="cuda:0", name="a"),
              tx.Stage(_scale, framework="numpy", name="b"),
              tx.Stage(_scale, framework="torch", device="cuda:0", name="c")]
    options = tx.RayExecutor(resources={"c": {"num_gpus": 0.25}})._options_for(stages, tx.Device.parse("cpu"))
    assert [o.get("num_gpus") for o in options] == [0.5, None, 0.25]
    host = tx.RayExecutor()._options_for(stages[1:2], tx.Device.parse("cpu"))
    assert host == [{}]


def test_bad_executor_options():
    stage = tx.Stage(_scale, framework="numpy", name="scale")
    with pytest.raises(ValueError, match="unknown executor"):
        tx.Chain([stage], executor="dask")
    with pytest.raises(ValueError, match="tensor_transport"):
        tx.RayExecutor(tensor_transport="carrier pigeon")
    with pytest.raises(ValueError, match="not in the chain"):
        tx.Chain([stage], executor=tx.RayExecutor(resources={"nope": {"num_cpus": 1}}))
    twins = [tx.Stage(_scale, framework="numpy"), tx.Stage(_plus_one, framework="numpy", name="_scale")]
    with pytest.raises(ValueError, match=r"'_scale' names stages 0 and 1.*by index"):
        tx.Chain(twins, executor=tx.RayExecutor(resources={"_scale": {"num_cpus": 0.5}}))  # not silently the last
    with pytest.raises(ValueError, match="out= buffers"):
        tx.Chain([tx.Stage(_scale, framework="numpy", out=tx.empty(3))], executor="ray")
    with pytest.raises(TypeError, match="made in a Ray actor"):
        tx.RayExecutor.in_actor(lambda: _scale)(np.ones(2))


# -- Ray Direct Transport for tx.Tensor ----------------------------------------------------------
def test_tx_transport_through_its_own_interface_with_host_memory():
    from exchange.ray.transport import NAME, TxTransport

    manager = TxTransport(mode="host-copy")
    assert manager.tensor_transport_backend() == NAME and manager.is_one_sided()
    src = [tx.from_dlpack(np.arange(12, dtype=np.float32).reshape(3, 4)),
           tx.from_dlpack(np.arange(10, dtype=np.int16)[::-2])]
    meta = manager.extract_tensor_transport_metadata("obj-1", src)
    assert meta.mode == "host-copy" and meta.tensor_device == "cpu" and len(meta.tensor_meta) == 2
    meta = pickle.loads(pickle.dumps(meta))  # it travels through Ray as a pickle
    got = manager.recv_multiple_tensors("obj-1", meta, manager.get_communicator_metadata(None, None))
    for s, g in zip(src, got):
        assert isinstance(g, tx.Tensor) and ray_objects.transport(g) == "host-copy"
        assert (np.from_dlpack(g) == np.from_dlpack(s)).all() and g.data_ptr != s.data_ptr
    targets = [tx.empty((3, 4), "float32"), tx.empty((5,), "int16")]
    filled = manager.recv_multiple_tensors("obj-1", meta, None, target_buffers=targets)
    assert filled[0] is targets[0] and (np.from_dlpack(targets[1]) == np.arange(10)[::-2]).all()
    with pytest.raises(ValueError, match="does not fit"):
        manager.recv_multiple_tensors("obj-1", meta, None, target_buffers=[tx.empty(2), tx.empty(5, "int16")])
    manager.garbage_collect("obj-1", meta, src)
    with pytest.raises(TypeError, match="carries tx.Tensor"):
        manager.extract_tensor_transport_metadata("obj-2", [np.zeros(2)])
    with pytest.raises(ValueError, match="unknown tx transport mode"):
        TxTransport(mode="telepathy")


def test_tx_transport_share_mode_through_its_own_interface():
    from exchange.ray.transport import TxTransport, share_api

    if share_api() is None:
        pytest.skip("tx.share / tx.attach are not in this build (cross-process sharing, issue 12)")
    manager = TxTransport(mode="share")
    src = [tx.from_dlpack(np.arange(1000, dtype=np.float32))]
    meta = manager.extract_tensor_transport_metadata("obj-3", src)
    got = manager.recv_multiple_tensors("obj-3", pickle.loads(pickle.dumps(meta)), None)
    assert ray_objects.transport(got[0]) == "shared-memory"
    assert (np.from_dlpack(got[0]) == np.arange(1000)).all()
    del got
    manager.garbage_collect("obj-3", meta, src)


def test_chain_over_the_tx_direct_transport_on_cpu_actors():
    from exchange.ray.transport import share_api

    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(_plus_one, framework="numpy", name="plus")],
                     executor=tx.RayExecutor(tensor_transport="tx"))
    sharing = share_api() is not None
    try:
        run = chain.run([np.arange(6.0), np.arange(300_000.0)])
        assert (np.from_dlpack(run.outputs[1]) == np.arange(300_000.0) * 2 + 1).all()
        hops = run.hops
        assert hops[0]["transport"] == "ray-object-store"  # the driver's input goes by the store
        expected = "shared-memory" if sharing else "host-copy"
        for hop in hops[1:]:
            assert hop["transport"] == expected
            if expected == "host-copy":
                assert hop["shared"] is False and "host memory" in hop["reason"]
        if sharing:  # the last actor owns the outputs' memory while the driver holds them
            held = chain._executor.live_records()
            assert held["stage 1 plus"] == 2 and held["stage 0 scale"] == 0, held
        del run
        counts = chain._executor.live_records(wait_s=5.0)
    finally:
        chain.close()
    assert all(v == 0 for k, v in counts.items() if k != "driver"), counts


def test_actor_returns_tx_tensors_by_both_paths():
    from exchange.ray.transport import register_transport

    register_transport()

    @ray.remote(enable_tensor_transport=True)
    class Both:
        @ray.method(tensor_transport="tx")
        def direct(self, n):
            return tx.from_dlpack(np.arange(n, dtype=np.float32))

        def plain(self, n):
            return tx.from_dlpack(np.arange(n, dtype=np.float32))

    b = Both.remote()
    d = ray.get(b.direct.remote(5), timeout=GET_S)
    assert ray_objects.transport(d) in ("host-copy", "shared-memory")
    p = ray.get(b.plain.remote(5), timeout=GET_S)  # after a direct return: still our serializer
    assert ray_objects.transport(p) == "ray-object-store"
    assert (np.from_dlpack(d) == np.from_dlpack(p)).all()
    ray.kill(b)


# -- processes: Ray missing, driver exit -----------------------------------------------------------
#: A child Python for Ray's entry points, on a cluster of its own (no RAY_ADDRESS inherited).
_python = functools.partial(run_python, timeout=90, RAY_ADDRESS=None)


def test_without_ray_every_entry_says_which_extra_to_install():
    proc = _python("""
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import numpy as np
        import exchange as tx
        assert tx.RayExecutor.__name__ == "RayExecutor"  # naming it needs no Ray
        stage = tx.Stage(lambda x: x, framework="numpy")
        from exchange.ray import objects as ray_objects
        for attempt in (lambda: tx.RayExecutor(), lambda: tx.Chain([stage], executor="ray"),
                        lambda: ray_objects.init(), lambda: __import__("exchange.ray.transport")):
            try:
                attempt()
            except tx.BackendUnavailableError as exc:
                assert "tensor-exchange[ray]" in str(exc), exc
                assert isinstance(exc, ImportError)
            else:
                raise AssertionError("no error without Ray")
        run = tx.Chain([stage]).run([np.ones(2)])  # in-process chains need no Ray
        print("ok", run.hops[0]["transport"])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "in-process"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:  # a port nothing listens on (bound, then let go)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_address_where_no_cluster_answers_is_a_clear_error_not_a_hang():
    # ray.init(address=...) retries a GCS that is not there for minutes; a stale
    # RAY_ADDRESS made `tensor-exchange demo --ray` hang. Both fail at once, naming it.
    port = _closed_port()
    env_address = f"127.0.0.1:{port}"
    try:
        proc = _python(f"""
            import os, sys, time
            from exchange.ray import objects as ray_objects
            start = time.monotonic()
            try:
                ray_objects.init(address={env_address!r})
            except ConnectionError as exc:
                print("REFUSED", round(time.monotonic() - start), exc)
            os.environ["RAY_ADDRESS"] = {"ray://" + env_address!r}
            from exchange.cli import main
            sys.exit(main(["demo", "--ray", "--batches", "1"]))
        """, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung on an address where no Ray cluster answers: {exc}")
    assert "REFUSED" in proc.stdout and f"no Ray cluster answers at {env_address}" in proc.stdout, proc.stdout
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert "RAY_ADDRESS" in proc.stderr and "no Ray cluster answers" in proc.stderr, proc.stderr[-2000:]


def test_a_plain_ray_init_is_all_a_ray_user_needs():
    # What a Ray user does: their own ray.init() (no runtime_env of ours, no call to
    # exchange.ray.objects), then tx Tensors through put/get, task arguments and returns,
    # and an actor's returns. The driver and this job's workers never registered
    # anything: the first tx.Tensor Ray pickles in a process registers the serializer
    # there (it refused with a TypeError before).
    address = ray.get_runtime_context().gcs_address
    proc = _python(f"""
        import sys
        import numpy as np, ray
        import exchange as tx
        ray.init(address={address!r})
        t = tx.from_dlpack(np.arange(4.0))

        @ray.remote
        def total():
            return float(np.from_dlpack(t).sum())  # t travels in the function's closure

        print("CLOSURE", ray.get(total.remote(), timeout=60), flush=True)  # the first pickling of a tx.Tensor
        back = ray.get(ray.put(t), timeout=60)
        print("PUT", np.from_dlpack(back).tolist(), back.readonly, flush=True)
        big = tx.from_dlpack(np.arange(50_000, dtype=np.float32))  # 200 KB: through the store

        @ray.remote
        def double(x):
            return tx.from_dlpack(np.from_dlpack(x) * 2)  # a worker of this job sends a tx.Tensor

        out = ray.get(double.remote(big), timeout=60)
        print("TASK", bool((np.from_dlpack(out) == np.arange(50_000) * 2).all()), out.record.origin[:26],
              flush=True)

        @ray.remote
        class Maker:
            def make(self, n):
                return tx.from_dlpack(np.ones(n))

        m = Maker.remote()
        print("ACTOR", np.from_dlpack(ray.get(m.make.remote(3), timeout=60)).tolist(), flush=True)
        print("HELPERS", "exchange.ray.objects" in sys.modules, flush=True)
    """)
    out = proc.stdout
    assert "CLOSURE 6.0" in out, (out, proc.stderr[-3000:])
    assert "PUT [0.0, 1.0, 2.0, 3.0] True" in out, (out, proc.stderr[-3000:])
    assert "TASK True imported from ray object" in out, (out, proc.stderr[-3000:])
    assert "ACTOR [1.0, 1.0, 1.0]" in out, (out, proc.stderr[-3000:])
    assert "HELPERS True" in out  # loaded by Ray's first pickling of a tx.Tensor, not by the user
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("how", ["return", "SIGKILL"])
def test_driver_exit_while_actors_hold_tensors(how):
    # A second driver joins this module's cluster, gives tensors to actors of its own and
    # exits (normally, or killed). Its actors must end with it, and the cluster go on.
    address = ray.get_runtime_context().gcs_address
    exit_line = "pass" if how == "return" else "os.kill(os.getpid(), 9)"
    proc = _python(f"""
        import os, numpy as np, ray
        import exchange as tx
        from exchange.ray import objects as ray_objects
        ray_objects.init(address={address!r})

        @ray.remote
        class Keep:
            def hold(self, t):
                self.t = t
                return os.getpid(), int(np.from_dlpack(t).sum())

        keepers = [Keep.remote() for _ in range(2)]
        t = tx.from_dlpack(np.ones(1 << 18))
        print("HELD", *ray.get([k.hold.remote(t) for k in keepers], timeout=60), flush=True)
        {exit_line}
    """)
    held = [line for line in proc.stdout.splitlines() if line.startswith("HELD")]
    assert held, proc.stderr[-3000:]
    if how == "return":
        assert proc.returncode == 0, proc.stderr[-3000:]
    pids = [int(p) for p in re.findall(r"\((\d+), 262144\)", held[0])]
    assert len(pids) == 2, held
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "actors outlived their driver"
    t = ray.get(ray.put(tx.from_dlpack(np.arange(4.0))), timeout=GET_S)  # the cluster goes on
    assert (np.from_dlpack(t) == np.arange(4.0)).all()


# -- the demo --------------------------------------------------------------------------------
def _ray_demo_phases(batches: int) -> list[str]:
    """The --ray demo's phases between the cluster's and the stop's."""
    return ["load the digits, train the MLP (scikit-learn), build its ONNX model", "start one Ray actor per stage",
            f"run the chain over {batches} batches", "score", "release, count what is left in every process"]


def _check_phases(stderr: str, names: list[str]) -> None:
    """Each phase said twice, in order: ``demo: NAME ...`` at its start, ``demo: NAME (S s)``
    at its end, as the in-process demo says them (tests/cpu/test_demo.py)."""
    said = [ln for ln in stderr.splitlines() if ln.startswith("demo: ")]
    got = [ln if ln.endswith(" ...") else ln.rsplit(" (", 1)[0] + " (S s)" for ln in said]
    assert got == [line for name in names for line in (f"demo: {name} ...", f"demo: {name} (S s)")], stderr[-3000:]


def test_demo_ray_report_json():
    # The command line, on this module's cluster (RAY_ADDRESS): the actors, the scoring,
    # the JSON on stdout alone. (Starting a cluster of its own adds about 5 s.)
    pytest.importorskip("sklearn")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    env = dict(os.environ)
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--ray", "--report", "json", "--batches", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Token authentication" not in proc.stderr  # Ray's notice, left out by our commands (exchange/cli)
    # stdout is the JSON alone; stderr shows each phase when it starts and when it ends
    _check_phases(proc.stderr, ["join the Ray cluster at RAY_ADDRESS", *_ray_demo_phases(3),
                                "stop the actors and leave the cluster"])
    report = __import__("json").loads(proc.stdout)
    assert report["executor"] == "ray" and report["ok"] is True
    assert report["accuracy"] >= 0.9 and report["accuracy"] == report["reference_accuracy"]
    assert report["live_records_end"] == 0 and set(report["live_records_by_process"]) == {
        "driver", "stage 0 scale", "stage 1 mlp", "stage 2 softmax", "stage 3 argmax"}
    hops = report["hops"]
    assert [(h["from"], h["to"]) for h in hops] == [
        ("input", "numpy"), ("numpy", "onnxruntime"), ("onnxruntime", "torch"), ("torch", "jax"),
        ("jax", "tx"), ("jax", "tx"), ("tx", "numpy"), ("tx", "numpy")]
    for h in hops:
        assert h["transport"] in ("ray-object-store", "in-process")
        assert h["shared"] or h["reason"], h
    into_torch = hops[2]
    assert into_torch["shared"] is False and "READ_ONLY" in into_torch["reason"]
    assert all(h["shared"] for i, h in enumerate(hops) if i != 2)


@pytest.mark.slow
def test_demo_ray_text_shows_each_phase_as_it_starts_and_ends_and_reports_in_tables(capfd):
    # The text mode: each phase is said when it starts (the screen is never silent while
    # the cluster and the actors start) and when it ends, then the report's tables, as in
    # the in-process demo. In this process, on this module's cluster.
    pytest.importorskip("sklearn")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    import io

    from exchange.cli import demo_ray

    result = demo_ray.run_ray_demo(batches=2, progress=True)
    _check_phases(capfd.readouterr().err, ["use the Ray cluster this process runs", *_ray_demo_phases(2),
                                           "stop the actors"])
    assert result.ok, result
    out = io.StringIO()
    demo_ray.print_text(result, file=out)
    text = out.getvalue()
    assert "tx.Chain stages, one Ray actor each" in text and "hops" in text
    for word in ("ray-object-store", "scaled pixels", "probabilities", "actor pid", "READ_ONLY", "OK"):
        assert word in text, (word, text)
