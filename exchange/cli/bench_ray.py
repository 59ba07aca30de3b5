"""``tensor-exchange bench`` section ``ray``: a tensor handed actor to actor on Ray.

One hop: actor A returns a 1 MiB float32 tensor, actor B takes it and answers with its
size, the driver waits for the answer (``ray.get(b.take.remote(a.give.remote()))``).
Through the library A returns a tx.Tensor (its serializer, ``exchange.ray.objects``) and
B gets a read-only tx.Tensor over the object store; the peer is plain Ray handing the
same NumPy array (NumPy's own pickle-5 path, which Ray reads back zero-copy). Both go
through the node's object store: one write by Ray, no other copy. The candidates are
sampled in turn, in the same run, on one local cluster (started here when Ray is not
running, with 2 CPUs and no dashboard, and shut down after).

``--json`` keys: ``ray_hop_ratio`` (library over plain Ray, medians; target 1.2), and
``ray_run_fixed_ms``: what ``Chain.run`` adds on Ray to the batch it carries, in ms: a
one-batch run of a 3-stage ``tx.RayExecutor`` chain (1 KiB, NumPy stages, the object
store, ``max_in_flight=1``) minus the same batch sent through the same actors by the
executor's own submit and collect, interleaved rounds, medians (target 1);
``ray_chain_hop_us``: a hop's cost in a 3-stage ``tx.RayExecutor(compiled=True)`` chain
(a Ray Compiled Graph; 1 KiB float32, NumPy stages that return their input,
``max_in_flight=1``): a run of 8 batches over 8 batches and 3 hops, in µs, and
``ray_chain_compiled_ratio``: that over the same for a hand-written Compiled Graph of
three actors whose method returns the NumPy array it is given, the driver taking each
result out of the output channel (``.copy()``: a caller who keeps results must, or the
graph stalls). One graph is up at a time: each actor of a compiled graph polls its
channel while idle (about 65 % of a core), so with both graphs up six actors polled on
2 cores and each graph's Python ran about 5 times slower than alone (the ratio moved
from 1.19 to 1.57 from run to run). So each round starts our chain (actors, compiling,
the first execution), times it, closes it (graph torn down, actors killed), then does
the same for the hand-written graph, the two in the other order in the next round;
each turn's figure is the median of its timing samples, a round's ratio is ours over
the hand-written one's, and the key is the median of the rounds' ratios (target 1.2).
``COMPILED_ROUNDS`` rounds (``--quick``: ``COMPILED_ROUNDS_QUICK``); starting a graph
takes seconds, most of the section's time. All null
with ``details.sections.ray.skipped`` saying why (Ray not installed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterator

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("ray_hop_ratio", "ray_run_fixed_ms", "ray_chain_hop_us", "ray_chain_compiled_ratio")
TARGETS = {"ray_hop_ratio": 1.2, "ray_run_fixed_ms": 1.0, "ray_chain_compiled_ratio": 1.2}
HOP_BYTES = 1 << 20
#: Batches a compiled-chain sample carries, and the chain's stages (hops = stages).
CHAIN_BATCHES = 8
CHAIN_STAGES = 3
#: Rounds of the compiled-graph comparison (each starts and tears down two graphs, 3-9 s
#: each on 2 cores: most of the section's time).
COMPILED_ROUNDS = 3
COMPILED_ROUNDS_QUICK = 1


class _Giver:
    """Actor A: holds the array and a tx.Tensor over it; returns either."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        import exchange as tx

        self.array = np.arange(nbytes // 4, dtype=np.float32)
        self.tensor = tx.from_dlpack(self.array)

    def give_numpy(self) -> Any:
        return self.array

    def give_tx(self) -> Any:
        return self.tensor


class _Passer:
    """A stage of the hand-written Compiled Graph: returns the NumPy array it is given."""

    def step(self, x: Any) -> Any:
        return x


class _Taker:
    """Actor B: takes what it is handed (over the store's memory) and answers its size."""

    def take_numpy(self, a: Any) -> int:
        return int(a.nbytes)

    def take_tx(self, t: Any) -> int:
        return int(t.nbytes)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Ray's start-up lines go to stderr: ``--json`` keeps stdout for the JSON object."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        os.dup2(sys.stderr.fileno(), fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    """The section's result: ``{"keys": {"ray_hop_ratio": float | None}, "details": {...}}``."""
    try:
        from ..ray.objects import require_ray

        ray = require_ray()
    except ImportError as exc:  # BackendUnavailableError is an ImportError
        return {"keys": dict.fromkeys(KEYS), "details": {"skipped": str(exc)}}
    from ..ray import objects as ray_objects
    from .bench import Candidate, compare

    started = not ray.is_initialized()
    with _quiet_stdout():
        ray_objects.init(num_cpus=2, object_store_memory=256 << 20)
    try:
        giver = ray.remote(_Giver).remote(HOP_BYTES)
        taker = ray.remote(_Taker).remote()
        timeout = 60

        def hop_tx(_: Any) -> int:
            return ray.get(taker.take_tx.remote(giver.give_tx.remote()), timeout=timeout)

        def hop_numpy(_: Any) -> int:
            return ray.get(taker.take_numpy.remote(giver.give_numpy.remote()), timeout=timeout)

        if hop_tx(None) != HOP_BYTES or hop_numpy(None) != HOP_BYTES:
            raise RuntimeError("the bench actors did not hand over the whole tensor")
        samples = max(5, cfg.samples // 2)
        summary = compare([Candidate("tx", hop_tx, None), Candidate("ray_numpy", hop_numpy, None)],
                          samples, max(cfg.sample_ns, 4_000_000))
        for handle in (giver, taker):
            ray.kill(handle)
        fixed = _run_fixed(cfg)
        compiled = _compiled_chain(cfg, samples)
    finally:
        if started:
            with _quiet_stdout():
                ray.shutdown()
    tx_ns, np_ns = summary["tx"]["median_ns"], summary["ray_numpy"]["median_ns"]
    return {
        "keys": {"ray_hop_ratio": float(tx_ns / np_ns), "ray_run_fixed_ms": fixed["fixed_ms"],
                 "ray_chain_hop_us": compiled["hop_us"], "ray_chain_compiled_ratio": compiled["ratio"]},
        "details": {"bytes": HOP_BYTES, "tx_ns": tx_ns, "ray_numpy_ns": np_ns, "samples": samples,
                    "candidates": summary, "ray": ray.__version__, "cluster_started_here": started,
                    "run_fixed": fixed, "compiled": compiled},
    }


def _same(x: Any) -> Any:
    return x


def _run_fixed(cfg: Any) -> dict[str, Any]:
    """``ray_run_fixed_ms`` (module docstring)."""
    import statistics

    import numpy as np

    import exchange as tx
    from ..chain import ChainResult

    chain = tx.Chain([tx.Stage(_same, framework="numpy", name=f"stage{k}") for k in range(3)],
                     executor=tx.RayExecutor(max_in_flight=1, tensor_transport="object-store"))
    actors = chain._executor
    x = np.ones(256, dtype=np.float32)
    rounds = 11 if cfg.quick else 31
    runs, own = [], []
    try:
        chain.run([x])  # warm-up: actors started, functions shipped
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            result = chain.run([x])
            runs.append(time.perf_counter_ns() - t0)
            del result
            t0 = time.perf_counter_ns()
            bare = ChainResult()
            actors._retire(actors._submit(x), bare, {})
            own.append(time.perf_counter_ns() - t0)
            del bare
    finally:
        chain.close()
    run_ms, own_ms = statistics.median(runs) / 1e6, statistics.median(own) / 1e6
    return {"fixed_ms": run_ms - own_ms, "run_ms": run_ms, "batch_ms": own_ms, "rounds": rounds, "stages": 3}


def _compiled_chain(cfg: Any, samples: int) -> dict[str, Any]:
    """``ray_chain_hop_us`` and ``ray_chain_compiled_ratio`` (module docstring): one
    Compiled Graph up at a time, in turns (:func:`_turn`), ours and the hand-written
    one in each round, which goes first alternating from round to round."""
    import statistics

    began = time.perf_counter()
    rounds = COMPILED_ROUNDS_QUICK if cfg.quick else COMPILED_ROUNDS
    sample_ns = max(cfg.sample_ns, 20_000_000)
    turns = {"tx": _turn_tx, "by_hand": _turn_by_hand}
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        order = ("tx", "by_hand") if r % 2 == 0 else ("by_hand", "tx")
        row: dict[str, Any] = {"first": order[0]}
        for name in order:
            row[f"{name}_ns"], row[f"{name}_start_s"] = turns[name](samples, sample_ns)
        row["ratio"] = row["tx_ns"] / row["by_hand_ns"]
        per_round.append(row)
    tx_ns = statistics.median(r["tx_ns"] for r in per_round)
    hand_ns = statistics.median(r["by_hand_ns"] for r in per_round)
    hops = CHAIN_BATCHES * CHAIN_STAGES
    return {"hop_us": tx_ns / hops / 1e3, "hand_hop_us": hand_ns / hops / 1e3,
            "ratio": float(statistics.median(r["ratio"] for r in per_round)),
            "start_s": statistics.median(r["tx_start_s"] for r in per_round), "batches": CHAIN_BATCHES,
            "stages": CHAIN_STAGES, "rounds": per_round, "samples": samples,
            "seconds": time.perf_counter() - began}


def _turn(name: str, run: Any, samples: int, sample_ns: int) -> float:
    """The median of ``samples`` timings of ``run()`` (each sample about ``sample_ns``,
    several runs where one is shorter), after a warm-up: ns a run."""
    from .bench import Candidate, _gc_off

    candidate = Candidate(name, lambda _: run(), None)
    with _gc_off():
        candidate.calibrate(sample_ns)
        return candidate.round_median(samples)


def _turn_tx(samples: int, sample_ns: int) -> tuple[float, float]:
    """Our turn: a 3-stage ``tx.RayExecutor(compiled=True)`` chain started (actors,
    compiling, the first execution), checked, timed, closed (its graph torn down and
    its actors killed). ``(ns a run of CHAIN_BATCHES batches, seconds to start)``."""
    import numpy as np

    import exchange as tx

    x = np.ones(256, dtype=np.float32)
    batches = [x] * CHAIN_BATCHES
    t0 = time.perf_counter()
    chain = tx.Chain([tx.Stage(_same, framework="numpy", name=f"stage{k}") for k in range(CHAIN_STAGES)],
                     executor=tx.RayExecutor(max_in_flight=1, compiled=True))
    start_s = time.perf_counter() - t0
    try:
        result = chain.run(batches)
        if result.executor != "ray-compiled" or not np.array_equal(np.from_dlpack(result.outputs[-1]), x):
            raise RuntimeError(f"the compiled bench chain did not run as one ({result.executor_reason})")
        del result
        return _turn("tx", lambda: chain.run(batches), samples, sample_ns), start_s
    finally:
        chain.close()


def _turn_by_hand(samples: int, sample_ns: int) -> tuple[float, float]:
    """The hand-written graph's turn: three ``_Passer`` actors compiled into one graph,
    run once, timed, torn down with its actors. ``(ns a run of CHAIN_BATCHES batches,
    seconds to start)``."""
    import numpy as np
    import ray
    from ray.dag import InputNode

    batches = [np.ones(256, dtype=np.float32)] * CHAIN_BATCHES
    t0 = time.perf_counter()
    passers = [ray.remote(_Passer).remote() for _ in range(CHAIN_STAGES)]
    dag = None
    try:
        with InputNode() as source:
            node = source
            for actor in passers:
                node = actor.step.bind(node)
        dag = node.experimental_compile(_max_inflight_executions=1)

        def by_hand() -> None:
            for b in batches:
                ray.get(dag.execute(b), timeout=60).copy()

        by_hand()  # the first execution (seconds), as the chain's start makes it
        start_s = time.perf_counter() - t0
        return _turn("by_hand", by_hand, samples, sample_ns), start_s
    finally:
        if dag is not None:
            dag.teardown(kill_actors=True)
        else:
            for actor in passers:
                ray.kill(actor)


def format(section: dict[str, Any]) -> list[str]:
    """The section's table lines."""
    d = section["details"]
    head = "ray (1 MiB float32 actor -> actor through the object store)"
    if "skipped" in d:
        return [head, f"  skipped: {d['skipped']}"]
    ratio = section["keys"]["ray_hop_ratio"]
    target = TARGETS["ray_hop_ratio"]
    fixed = d["run_fixed"]
    limit = TARGETS["ray_run_fixed_ms"]
    return [head,
            f"  tx.Tensor {d['tx_ns'] / 1e3:9.1f} us   NumPy array (plain Ray) {d['ray_numpy_ns'] / 1e3:9.1f} us   "
            f"ratio {ratio:.3f}  <= {target:g}  {'ok' if ratio <= target else 'MISSED'}  (Ray {d['ray']})",
            f"  Chain.run of one batch on 3 actors {fixed['run_ms']:.2f} ms, the batch itself {fixed['batch_ms']:.2f} ms: "
            f"fixed {fixed['fixed_ms']:.2f} ms  <= {limit:g}  {'ok' if fixed['fixed_ms'] <= limit else 'MISSED'}",
            _compiled_line(d["compiled"])]


def _compiled_line(c: dict[str, Any]) -> str:
    target = TARGETS["ray_chain_compiled_ratio"]
    rounds = len(c.get("rounds", ())) or "?"
    return (f"  compiled graph, 3 stages, 1 KiB: a hop {c['hop_us']:.1f} us through tx.RayExecutor(compiled=True), "
            f"{c['hand_hop_us']:.1f} us by hand: ratio {c['ratio']:.3f}  <= {target:g}  "
            f"{'ok' if c['ratio'] <= target else 'MISSED'}  (one graph up at a time, {rounds} rounds; "
            f"the chain started in {c['start_s']:.1f} s)")
