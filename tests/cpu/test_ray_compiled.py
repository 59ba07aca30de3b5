"""tx.RayExecutor(compiled=True): a chain as one Ray Compiled Graph (issue 21, item 2),
against a real local Ray cluster (2 CPUs, no dashboard) started once for this module.

Covers: the results and the hop report a compiled chain gives (the same values as on
actor tasks, every hop through a channel and copied out of it, live records at 0 in
every actor), the graph kept across runs, results kept past ``max_in_flight`` runs and
past ``Chain.close()`` and ``ray.shutdown()`` (they are the driver's own memory, never
channel memory), dict batches, the fall-back with its reason, and the faults: a stage
that raises (the graph goes on), an actor that dies and a batch past ``timeout_s``
(StageError naming the stage, the next run compiles anew).

Each compiled graph takes 3-9 s to start here and its actors poll while idle (about 65 %
of a core each), so each test closes its chain, and all but the first run once per CI
(``second_pass_in_ci``: what they check does not depend on the capsule path, and CI's
pure-Python pass, which runs beside the longer wheel pass, has the time). Every test is
bounded: an alarm stops it after ``LIMIT_S``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import exchange as tx

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tensor-exchange[ray]')")

from exchange.ray import objects as ray_objects  # noqa: E402  (after the skip: Ray is here)
from ray_helpers import cluster, live_ids, time_limit  # noqa: E402, F401  (cluster, time_limit: fixtures)

ROOT = Path(__file__).resolve().parents[2]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
LIMIT_S = 150


def _scale(x):
    return x * 2.0


def _plus_one(x):
    return x + 1


def _compiled(**options) -> tx.RayExecutor:
    return tx.RayExecutor(compiled=True, timeout_s=options.pop("timeout_s", 60), **options)


def test_a_compiled_chain_gives_what_actor_tasks_give_and_says_how():
    torch = pytest.importorskip("torch")
    batches = [np.random.default_rng(i).random((16, 10), dtype=np.float32) for i in range(6)]
    stages = [tx.Stage(_scale, framework="numpy", name="scale"),
              tx.Stage(lambda x: torch.softmax(x, dim=-1), framework="torch", name="softmax"),
              tx.Stage(_plus_one, framework="numpy", name="plus")]
    before = live_ids()
    chain = tx.Chain(stages, executor=_compiled(max_in_flight=2))
    try:
        graph = chain._executor.graph
        run = chain.run(batches)
        again = chain.run(batches[:2])
        assert chain._executor.graph is graph, "the compiled graph was not kept across runs"
        counts = chain._executor.live_records(wait_s=10.0)
    finally:
        chain.close()
    assert run.executor == "ray-compiled" and run.executor_reason is None and len(run.outputs) == 6
    for x, out in zip(batches + batches[:2], run.outputs + again.outputs):
        expect = torch.softmax(torch.from_numpy(x * 2.0), dim=-1).numpy() + 1
        np.testing.assert_allclose(np.from_dlpack(out), expect, rtol=1e-6)
        assert ray_objects.transport(out) == "ray-compiled-channel"
    assert [(h["from"], h["to"]) for h in run.hops] == [("input", "numpy"), ("numpy", "torch"),
                                                        ("torch", "numpy"), ("numpy", "tx")]
    for hop in run.hops:
        assert hop["transport"] == "ray-compiled-channel" and hop["bytes"] == 16 * 10 * 4
        assert hop["shared"] is False and "copied out of its Compiled Graph channel" in hop["reason"]
    # torch took a writable copy of the channel's bytes: no READ_ONLY copy on top of it
    assert "READ_ONLY" not in run.hops[1]["reason"]
    assert len(run.batch_hops) == 6 and all(len(b) == 4 for b in run.batch_hops)
    assert run.batch_hops[0] is not run.batch_hops[1] and run.batch_hops[0][0] is not run.batch_hops[1][0]
    assert set(run.stage_ms) == {"scale", "softmax", "plus"} and all(v > 0 for v in run.stage_ms.values())
    assert {k: v for k, v in counts.items() if k != "driver"} == {
        "stage 0 scale": 0, "stage 1 softmax": 0, "stage 2 plus": 0}
    del out
    run.outputs.clear()
    again.outputs.clear()
    assert live_ids() <= before


@pytest.mark.second_pass_in_ci
def test_results_kept_never_stall_the_graph_and_outlive_it():
    # Zero-copy results over channel memory stall a compiled graph after max_in_flight
    # calls (RayChannelTimeoutError) and read unmapped memory after teardown: these are
    # copies, the driver's own.
    chain = tx.Chain([tx.Stage(_plus_one, framework="numpy", name="plus")], executor=_compiled(max_in_flight=2))
    kept = []
    try:
        for i in range(30):  # 30 runs, 60 results held: far past max_in_flight
            kept.extend(chain.run([np.full(4, i, np.float32), np.full(4, -i, np.float32)]).outputs)
    finally:
        chain.close()
    for i in range(30):
        assert (np.from_dlpack(kept[2 * i]) == i + 1).all() and (np.from_dlpack(kept[2 * i + 1]) == 1 - i).all()
    assert not kept[0].readonly  # the driver's own copy: writable, as any copy


@pytest.mark.second_pass_in_ci
def test_results_kept_past_ray_shutdown_stay_readable():
    code = textwrap.dedent("""
        import numpy as np, ray
        import exchange as tx
        from exchange.ray import objects

        def plus(x):
            return x + 1

        objects.init(num_cpus=2, object_store_memory=100 << 20)
        chain = tx.Chain([tx.Stage(plus, framework="numpy")], executor=tx.RayExecutor(compiled=True))
        out = chain.run([np.arange(1 << 16, dtype=np.float32)] * 3).outputs
        chain.close()
        ray.shutdown()
        total = sum(float(np.from_dlpack(t).sum()) for t in out)
        print("sum", total)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    expect = 3 * float(np.arange(1 << 16, dtype=np.float64).sum() + (1 << 16))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"sum {expect}" in done.stdout


@pytest.mark.second_pass_in_ci
def test_dict_batches_and_a_chain_that_cannot_be_compiled():
    def split(x):
        return {"a": x, "b": x * 3}

    def join(a, b):  # a dict batch: its entries as keyword arguments
        return a + b

    chain = tx.Chain([tx.Stage(join, framework="numpy", name="join"),
                      tx.Stage(split, framework="numpy", name="split")], executor=_compiled(max_in_flight=1))
    try:
        run = chain.run([{"a": np.ones(3, np.float32), "b": np.full(3, 2, np.float32)}])
        assert run.executor == "ray-compiled"
        out = run.outputs[0]
        assert sorted(out) == ["a", "b"]
        assert (np.from_dlpack(out["a"]) == 3).all() and (np.from_dlpack(out["b"]) == 9).all()
        assert [(h["from"], h["to"]) for h in run.hops] == [("input", "numpy")] * 2 + [("numpy", "numpy")] + [
            ("numpy", "tx")] * 2
    finally:
        chain.close()
    direct = tx.Chain([tx.Stage(_plus_one, framework="numpy")],
                      executor=tx.RayExecutor(compiled=True, tensor_transport="tx", timeout_s=60))
    try:
        run = direct.run([np.ones(2, np.float32)])
        assert run.executor == "ray" and "Ray Direct Transport" in run.executor_reason
        assert direct._executor.graph is None and (np.from_dlpack(run.outputs[0]) == 2).all()
    finally:
        direct.close()
    with pytest.raises(TypeError, match="compiled must be True or False"):
        tx.RayExecutor(compiled="yes")


@pytest.mark.second_pass_in_ci
def test_a_stage_that_raises_names_the_stage_and_the_graph_goes_on():
    def picky(x):
        if x[0] < 0:
            raise ValueError("negative input")
        return x

    before = live_ids()
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(picky, framework="numpy", name="picky")], executor=_compiled(max_in_flight=3))
    try:
        graph = chain._executor.graph
        with pytest.raises(tx.StageError, match=r"stage 1 'picky' \(numpy\).*ValueError: negative input"):
            chain.run([np.ones(3), -np.ones(3), np.ones(3), np.ones(3)])
        assert live_ids() <= before, "the driver kept tensors of the failed run"
        again = chain.run([np.ones(3)] * 3)
        assert chain._executor.graph is graph, "a stage's error tore the graph down"
        assert all((np.from_dlpack(t) == 2).all() for t in again.outputs)
        del again
    finally:
        chain.close()


def _die_on_negative(x):
    if x[0] < 0:
        os._exit(1)  # the actor's process dies mid-batch
    return x + 1


@pytest.mark.second_pass_in_ci
def test_an_actor_that_dies_is_a_stage_error_naming_it_and_the_next_run_recovers():
    before = live_ids()
    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(_die_on_negative, framework="numpy", name="fragile"),
                      tx.Stage(_plus_one, framework="numpy", name="plus")], executor=_compiled(timeout_s=30))
    try:
        t0 = time.monotonic()
        with pytest.raises(tx.StageError, match=r"stage 1 'fragile'.*actor died.*compiled graph was torn down"):
            chain.run([np.ones(3), -np.ones(3), np.ones(3)])
        assert time.monotonic() - t0 < 45  # timeout_s 30 at most, then the probes
        assert live_ids() <= before, "the driver's registry kept tensors of the failed run"
        assert chain._executor.graph is None
        again = chain.run([np.ones(3)])  # new actors, a new graph
        assert again.executor == "ray-compiled" and (np.from_dlpack(again.outputs[0]) == 4).all()
        del again
    finally:
        chain.close()


@pytest.mark.second_pass_in_ci
def test_a_batch_past_its_time_limit_names_the_stage_it_waits_on():
    def slow(x):
        time.sleep(60 if x[0] < 0 else 0)
        return x

    chain = tx.Chain([tx.Stage(_scale, framework="numpy", name="scale"),
                      tx.Stage(slow, framework="numpy", name="slow")], executor=_compiled(timeout_s=3))
    try:
        t0 = time.monotonic()
        with pytest.raises(tx.StageError, match=r"stage 1 'slow'.*did not finish a batch within 3 s"):
            chain.run([-np.ones(2)])
        assert time.monotonic() - t0 < 30  # timeout_s, the probes, the teardown
        again = chain.run([np.ones(2)])
        assert (np.from_dlpack(again.outputs[0]) == 2).all()
        del again
    finally:
        chain.close()


@pytest.mark.second_pass_in_ci
def test_timeout_s_none_waits_past_rays_own_get_limit():
    # Ray's get on a compiled graph's result takes None as its own limit
    # (RAY_CGRAPH_get_timeout, 10 s): None here must wait as long as the batch takes.
    # The limit is lowered to 1 s for this graph, so a 3 s stage is past it.
    from ray.dag import DAGContext

    def slow(x):
        time.sleep(3)
        return x + 1

    context = DAGContext.get_current()
    limit, context.get_timeout = context.get_timeout, 1
    try:
        chain = tx.Chain([tx.Stage(slow, framework="numpy", name="slow")],
                         executor=tx.RayExecutor(compiled=True, timeout_s=None))
    finally:
        context.get_timeout = limit
    try:
        run = chain.run([np.ones(2)])
        assert (np.from_dlpack(run.outputs[0]) == 2).all()
        del run
    finally:
        chain.close()


def _zero_fails_small_ones_slow(x):
    if x[0] == 0:
        raise ValueError("zero")
    if x[0] < 5:
        time.sleep(3)  # longer than the 2 s a failed run waits for the batches behind
    return x + 1


@pytest.mark.second_pass_in_ci
def test_a_failed_run_with_slow_batches_behind_it_leaves_a_chain_that_works():
    chain = tx.Chain([tx.Stage(_zero_fails_small_ones_slow, framework="numpy", name="a"),
                      tx.Stage(_plus_one, framework="numpy", name="b")], executor=_compiled(max_in_flight=3))
    try:
        with pytest.raises(tx.StageError, match="stage 0 'a'.*zero"):
            chain.run([np.full(2, float(i)) for i in range(3)])
        for value in (5.0, 6.0):  # a result never taken would stall these
            run = chain.run([np.full(2, value)])
            assert (np.from_dlpack(run.outputs[0]) == value + 2).all()
            del run
    finally:
        chain.close()


def _small_ones_very_slow(x):
    if x[0] < 5:
        time.sleep(10)  # far longer than a Ctrl-C may take to return, on a loaded machine too
    return x + 1


@pytest.mark.second_pass_in_ci
def test_ctrl_c_mid_run_returns_at_once_and_the_next_run_works():
    chain = tx.Chain([tx.Stage(_small_ones_very_slow, framework="numpy", name="a")],
                     executor=_compiled(max_in_flight=3))

    def batches():
        yield np.full(2, 1.0)  # 10 s in the stage
        yield np.full(2, 7.0)
        raise KeyboardInterrupt

    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            chain.run(batches())
        assert time.monotonic() - t0 < 7, "Ctrl-C waited for the batches in flight"
        run = chain.run([np.full(2, 8.0)])
        assert (np.from_dlpack(run.outputs[0]) == 9).all()
        del run
    finally:
        chain.close()


@pytest.mark.second_pass_in_ci
def test_a_chain_collected_without_close_ends_its_actors():
    chain = tx.Chain([tx.Stage(_plus_one, framework="numpy", name="a")], executor=_compiled())
    actors = list(chain._executor.actors)
    out = chain.run([np.ones(2)]).outputs
    del chain
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actors[0].__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the actor of a collected compiled chain lived on (polling a core)")
    assert (np.from_dlpack(out[0]) == 2).all()


def test_channel_hops_are_made_once_and_each_batch_gets_its_own():
    """The driver makes a batch's channel hops once per shape of what the stages said
    (they repeat batch to batch) and copies them for each batch: equal hops, never the
    same dicts, so a caller who edits one batch's report edits no other."""
    from exchange.chain import ChainResult
    from exchange.ray import executor

    runner = executor._ActorChain.__new__(executor._ActorChain)
    runner.stages = [tx.Stage(_scale, framework="numpy", name=f"s{k}") for k in range(2)]
    runner.places, runner.node, runner._hop_memo = [{"node": "a" * 16}, {"node": "b" * 16}], "c" * 16, {}
    runner._names, runner._unique_names, runner._traced_hops = ["s0", "s1"], True, []
    times = ((0.5, 64), (0.25, 32))
    said = ((((16, True, None),), ((True, None),)), (((16, False, "copied"),), ((True, None),)))
    x = np.ones(4, dtype=np.float32)
    result, peaks = ChainResult(stage_ms={"s0": 0.0, "s1": 0.0}), {}
    for _ in range(3):
        runner._take_compiled(("one", None, [x], -1, times, said), result, peaks)
    first, second, third = result.batch_hops
    assert len(runner._hop_memo) == 1 and len(first) == 3 and first == second
    assert all(a is not b for a, b in zip(first, second)) and result.hops is first
    first[0]["bytes"] = -1
    assert second[0]["bytes"] == 16 and third[0]["bytes"] == 16
    assert result.stage_ms == {"s0": 1.5, "s1": 0.75} and peaks == {"s0": 64, "s1": 32}
    assert first[1]["reason"].endswith("copied") and not first[1]["shared"]
    assert len(result.outputs) == 3 and (np.from_dlpack(result.outputs[0]) == 1).all()
