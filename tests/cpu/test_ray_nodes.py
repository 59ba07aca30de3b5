"""A chain across the nodes of a real multi-node Ray cluster made on this machine
(``ray.cluster_utils.Cluster``: each node its own raylet and object store), stages
pinned to nodes by custom resources: values cross nodes intact, each hop says it
crossed, live records end at 0 in every process, a received tensor keeps its object
alive until dropped, and a node removed mid-run is a StageError naming the stage
within ``timeout_s``.

The behaviour is the same on both capsule paths (it is Ray's object stores that
differ), so CI runs this module once, in its pure-Python pass (``second_pass_in_ci``)."""

from __future__ import annotations

import gc
import sys
import time

import numpy as np
import pytest

import exchange as tx

ray = pytest.importorskip("ray", reason="needs the ray extra")
from ray.cluster_utils import Cluster  # noqa: E402

from exchange.ray import objects as ray_objects  # noqa: E402
from ray_helpers import ray_starting_processes, time_limit  # noqa: E402, F401  (a fixture)

pytestmark = pytest.mark.second_pass_in_ci
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
LIMIT_S = 180
STORE = 80 << 20


@pytest.fixture(scope="module")
def nodes():
    """A head node ("node_a") and a second node ("node_b"); the driver joins the head."""
    if ray.is_initialized():
        ray.shutdown()
    with ray_starting_processes():
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"node_a": 4}, "object_store_memory": STORE, "include_dashboard": False})
        cluster.add_node(num_cpus=1, resources={"node_b": 4}, object_store_memory=STORE)
        cluster.wait_for_nodes()
    try:
        with ray_starting_processes():
            ray_objects.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _scale(x):
    return x * 2.0


def _plus_one(x):
    return x + 1.0


def _pinned(timeout_s: float = 60.0) -> tx.RayExecutor:
    return tx.RayExecutor(resources={"scale": {"num_cpus": 0, "resources": {"node_a": 1}},
                                     "plus": {"num_cpus": 0, "resources": {"node_b": 1}}},
                          tensor_transport="object-store", max_in_flight=2, timeout_s=timeout_s)


def test_values_cross_nodes_intact_and_each_hop_says_where(nodes):
    batches = [np.random.default_rng(i).random((64, 32), dtype=np.float32) for i in range(4)]
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(_plus_one, framework="numpy", name="plus")], executor=_pinned())
    try:
        run = chain.run(batches)
        places = [p["node"] for p in chain._executor.places]
        counts = run.live_records
    finally:
        chain.close()
    assert places[0] != places[1], "the stages were meant to run on two nodes"
    for x, out in zip(batches, run.outputs):
        np.testing.assert_array_equal(np.from_dlpack(out), x * 2.0 + 1.0)
    driver = chain_node = ray.get_runtime_context().get_node_id()
    assert driver == places[0]  # the driver joined the head node, where "scale" runs
    hops = {(h["from"], h["to"]): h for h in run.hops}
    crossed = hops[("numpy", "numpy")]  # scale (node a) -> plus (node b)
    assert crossed["nodes"] == [places[0][:8], places[1][:8]] and crossed["shared"] is False
    assert "crossed nodes" in crossed["reason"] and crossed["transport"] == "ray-object-store"
    back = hops[("numpy", "tx")]  # plus (node b) -> the driver (node a)
    assert back["nodes"] == [places[1][:8], chain_node[:8]] and "crossed nodes" in back["reason"]
    into = hops[("input", "numpy")]  # the driver -> scale, both on node a: shared, no crossing
    assert into["nodes"][0] == into["nodes"][1] and into["shared"] is True
    assert counts["stage 0 scale"] == 0 and counts["stage 1 plus"] == 0
    run.outputs.clear()


def test_a_tensor_from_another_node_keeps_its_object_until_dropped(nodes):
    @ray.remote(resources={"node_b": 1}, num_cpus=0)
    def make():
        return tx.from_dlpack(np.arange(1 << 16, dtype=np.float32))

    t = ray.get(make.remote(), timeout=60)  # made on node b, its object copied to node a's store
    gc.collect()  # the ObjectRef is gone: only the tensor's record holds the object now
    for _ in range(3):  # fill the store past its size: an unheld object would be evicted
        filler = [ray.put(np.zeros(STORE // 8, dtype=np.uint8)) for _ in range(4)]
        del filler
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(1 << 16, dtype=np.float32))
    assert t.readonly and ray_objects.transport(t) == "ray-object-store"
    rid = t.record.id
    del t
    gc.collect()
    assert rid not in {r.id for r in tx.registry().snapshot()}


def test_a_node_removed_mid_run_is_a_stage_error_naming_the_stage(nodes):
    with ray_starting_processes():
        extra = nodes.add_node(num_cpus=1, resources={"node_c": 4}, object_store_memory=STORE)
    nodes.wait_for_nodes()

    def slow(x):
        time.sleep(0.5)
        return x + 1.0

    executor = tx.RayExecutor(resources={"scale": {"num_cpus": 0, "resources": {"node_a": 1}},
                                         "slow": {"num_cpus": 0, "resources": {"node_c": 1}}},
                              tensor_transport="object-store", max_in_flight=2, timeout_s=30)
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(slow, framework="numpy", name="slow")], executor=executor)
    try:
        assert chain.run([np.ones(4)]).outputs  # both actors up
        gone = {"done": False}

        def batches():
            for i in range(40):
                if i == 3 and not gone["done"]:
                    nodes.remove_node(extra, allow_graceful=False)
                    gone["done"] = True
                yield np.full(4, float(i))

        started = time.monotonic()
        with pytest.raises(tx.StageError, match=r"stage 1 'slow'") as caught:
            chain.run(batches())
        assert time.monotonic() - started < 30 + 15
        assert "died" in str(caught.value) or "did not finish" in str(caught.value)
    finally:
        chain.close()
