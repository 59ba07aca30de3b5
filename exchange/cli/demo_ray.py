"""``tensor-exchange demo --ray``: the digits chain of ``tensor-exchange demo`` with each
stage on its own Ray actor, on a local Ray cluster the command starts (this machine's
CPUs only, no dashboard) and stops.

The stages are the demo's (``exchange.cli.demo_parts``, shared with ``exchange.cli.demo``):
NumPy scales the pixels, ONNX Runtime runs the MLP (its session made inside its actor,
``tx.RayExecutor.in_actor``, since a session cannot be pickled), PyTorch takes the softmax, JAX the argmax. The batches go
actor to actor through the node's object store (``exchange.ray.executor``); the final
outputs come back to the driver as read-only tx Tensors over the store and are scored
there, against the labels and against the same MLP computed in NumPy (so the accuracy is
the in-process chain's).

What to expect of the hops (``--report json`` gives each one's ``transport`` and, when it
is not shared, its ``reason``): the hops between actors travel by ``ray-object-store``
(Ray writes the producer's output once into the store; the consumer reads it there, no
copy); the hop into PyTorch is a copy, because the store is read-only and PyTorch
ignores DLPack's READ_ONLY flag; every other hop is shared.

The check (exit status 0): accuracy >= 0.9 and equal to the NumPy reference's, every hop
shared or reported as a copy with its reason, and no registry record left alive in any
process (driver and actors) once the outputs are dropped.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from typing import Any

__all__ = ["RayDemoResult", "reference_predictions", "build_stages", "run_ray_demo", "report_json",
           "print_text", "main"]

#: Seconds the demo gives Ray to free the objects of the run before counting what is left.
SETTLE_S = 5.0


@dataclasses.dataclass
class RayDemoResult:
    """What a ``--ray`` run found. As ``exchange.cli.demo.DemoResult``, plus:
    ``reference_accuracy`` (the same MLP in NumPy), ``same_predictions`` (fraction of
    images where the chain and the reference agree), hops with ``transport`` (and
    ``reason`` when not shared), ``live_records_by_process`` (``"driver"`` and each
    stage's actor, after the run's objects were dropped) and ``live_records_end`` their
    sum, ``actors`` (stage name -> pid)."""

    accuracy: float
    reference_accuracy: float
    same_predictions: float
    hops: list[dict[str, Any]]
    unshared: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    peak_live_bytes: int
    stage_output_bytes_total: int
    live_records_end: int
    live_records_by_process: dict[str, int]
    records_end: list[str]
    batches: int
    n_train: int
    n_test: int
    seconds: dict[str, float]
    chain_ms: float
    actors: dict[str, int]
    ray_version: str

    @property
    def ok(self) -> bool:
        from .demo_parts import MIN_ACCURACY

        explained = all(h["shared"] or h.get("reason") for h in self.hops + self.unshared)
        return (self.accuracy >= MIN_ACCURACY and abs(self.accuracy - self.reference_accuracy) < 1e-9
                and explained and self.live_records_end == 0)


def reference_predictions(weights: Any, pixels: Any) -> Any:
    """The MLP of ``weights`` on raw ``pixels`` (uint8 (n, 64)) in NumPy, float32, as the
    ONNX graph computes it: int32 (n,) predicted classes."""
    import numpy as np

    h = pixels.astype(np.float32) * np.float32(weights.input_scale)
    last = len(weights.layers) - 1
    for i, (w, b) in enumerate(weights.layers):
        h = h @ w + b
        if i != last:
            h = np.maximum(h, 0)
    return np.argmax(h, axis=1).astype(np.int32)


def build_stages(weights: Any, model_bytes: bytes, threads: int | None = 1) -> list[Any]:
    """The demo's four stages for actors: the ONNX Runtime session is made in its actor
    from ``model_bytes`` (``threads`` intra-op threads; default 1, an actor per stage)."""
    import exchange as tx

    from .demo_parts import argmax_jax, make_scale, make_session, softmax_torch

    return [
        tx.Stage(make_scale(weights.input_scale), framework="numpy", name="scale"),
        tx.Stage(tx.RayExecutor.in_actor(make_session, model_bytes, threads=threads), framework="onnxruntime",
                 name="mlp"),
        tx.Stage(softmax_torch, framework="torch", name="softmax"),
        tx.Stage(argmax_jax, framework="jax", name="argmax"),
    ]


def run_ray_demo(*, seed: int = 0, test_size: float = 0.25, threads: int | None = 1, batches: int = 8,
                 progress: bool = False, num_cpus: int | None = None) -> RayDemoResult:
    """Start a local Ray cluster (``num_cpus``: default this machine's; with
    ``RAY_ADDRESS`` set, join that cluster instead), load and split
    the digits, train the MLP, run the chain with one actor per stage over ``batches``
    batches, score the outputs, drop everything, count what is left alive in every
    process, end the actors and stop the cluster (if this call started it).
    ``progress``: show each phase on stderr as it starts and ends (the cluster's start
    first: it takes seconds), as ``tensor-exchange demo`` does (``demo_parts._Phases``).

    Raises BackendUnavailableError naming the extra when Ray is not installed."""
    import exchange as tx
    from ..ray import objects as ray_objects

    from .demo_parts import Laps, _Phases, build_onnx_model, load_digits_split, split_batches, train_classifier

    ray = ray_objects.require_ray()
    lap = Laps()
    seconds = lap.seconds

    reg = tx.registry()
    before = {r.id for r in reg.snapshot()}
    started = not ray.is_initialized()
    joining = bool(os.environ.get("RAY_ADDRESS"))
    where = ("join the Ray cluster at RAY_ADDRESS" if joining else "start a local Ray cluster") if started else \
        "use the Ray cluster this process runs"
    chain = None
    with _Phases(progress) as phases:
        try:
            with phases.phase(where):
                if joining:  # join that cluster as it is
                    ray_objects.init()
                else:
                    ray_objects.init(num_cpus=num_cpus or os.cpu_count() or 1, object_store_memory=512 << 20)
            lap("cluster")
            with phases.phase("load the digits, train the MLP (scikit-learn), build its ONNX model"):
                data = load_digits_split(test_size=test_size, seed=seed)
                x_batches = split_batches(data.x_test, batches)
                y_batches = split_batches(data.y_test, batches)
                weights = train_classifier(data.x_train, data.y_train, seed=seed)
                model_bytes = build_onnx_model(weights, scale_input=False).SerializeToString()
            lap("train")
            with phases.phase("start one Ray actor per stage"):
                chain = tx.Chain(build_stages(weights, model_bytes, threads), executor=tx.RayExecutor())
                actors = {s.name: int(p.get("pid", 0)) for s, p in zip(chain.stages, chain._executor.places)}
            lap("actors")
            with phases.phase(f"run the chain over {len(x_batches)} batches", total=len(x_batches)):
                run = chain.run(_Stepping(x_batches, phases.step))
            lap("run")
            with phases.phase("score"):
                scored = _score(run, chain, weights, data, y_batches)
            lap("score")
            with phases.phase("release, count what is left in every process"):
                run.outputs.clear()
                del run
                by_process, records = _left_alive(chain, reg, before, ray)
            lap("release")
        finally:
            leave = (" and leave the cluster" if joining else " and the cluster") if started else ""
            with phases.phase("stop the actors" + leave):
                if chain is not None:
                    chain.close()
                if started:
                    ray.shutdown()
    seconds["total"] = round(sum(seconds.values()), 3)
    return RayDemoResult(
        **scored, live_records_end=int(sum(by_process.values())), live_records_by_process=by_process,
        records_end=records, batches=len(x_batches), n_train=int(data.x_train.shape[0]),
        n_test=int(data.x_test.shape[0]), seconds=seconds, actors=actors, ray_version=str(ray.__version__),
    )


class _Stepping:
    """The input batches, ``step`` called after each one is handed to the chain."""

    def __init__(self, batches: list[Any], step: Any) -> None:
        self.batches, self.step = batches, step

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for b in self.batches:
            yield b
            self.step()


def _score(run: Any, chain: Any, weights: Any, data: Any, y_batches: list[Any]) -> dict[str, Any]:
    """The final outputs (read-only tx Tensors over the store) taken into NumPy and scored
    against the labels and the NumPy reference; the hops, stage times and bytes."""
    import numpy as np

    from .demo_parts import HOP_TENSORS, _merge_hops

    correct = 0
    taken: list[list[dict[str, Any]]] = []
    predicted = []
    for out, labels in zip(run.outputs, y_batches):
        arrays = [np.from_dlpack(t) for t in out]  # read-only views of the store
        taken.append([{"from": "tx", "to": "numpy", "bytes": int(t.nbytes), "transport": "in-process",
                       "shared": a.ctypes.data == t.data_ptr} for t, a in zip(out, arrays)])
        correct += int((arrays[0] == labels).sum())
        predicted.append(np.array(arrays[0]))
        del arrays, out
    reference = reference_predictions(weights, data.x_test)
    n = int(data.x_test.shape[0])
    hops, unshared = _merge_hops([b + t for b, t in zip(run.batch_hops, taken)], names=HOP_TENSORS)
    return {"accuracy": correct / n, "reference_accuracy": float((reference == data.y_test).mean()),
            "same_predictions": float((np.concatenate(predicted) == reference).mean()), "hops": hops,
            "unshared": unshared,
            "stages": [{"name": s.name, "framework": s.framework, "ms": float(run.stage_ms[s.name])}
                       for s in chain.stages],
            "peak_live_bytes": int(run.peak_live_bytes),
            "stage_output_bytes_total": int(sum(h["bytes"] for b in run.batch_hops for h in b
                                                if h["from"] != "input")),
            "chain_ms": float(run.wall_ms)}


def _left_alive(chain: Any, reg: Any, before: set[int], ray: Any) -> tuple[dict[str, int], list[str]]:
    """Live records per process once the run's objects are dropped (the driver: only
    those this run made), and their descriptions."""
    gc.collect()
    by_process = chain._executor.live_records(wait_s=SETTLE_S)
    reg.collect(timeout=10.0)
    alive = [r for r in reg.snapshot() if r.id not in before]
    by_process["driver"] = len(alive)
    records = [f"driver: {r.describe()}" for r in alive]
    for k, actor in enumerate(chain._executor.actors):
        name = f"stage {k} {chain.stages[k].name}"
        if by_process.get(name):
            records += [f"{name}: {d}" for d in ray.get(actor.records.remote(), timeout=30)]
    return by_process, records


def report_json(result: RayDemoResult) -> dict[str, Any]:
    """The ``--ray --report json`` object: the demo's keys (accuracy, hops, live_records_end,
    device, batches, stages, peak_live_bytes, stage_output_bytes_total) with
    ``"executor": "ray"``, each hop's ``transport`` (and ``reason`` when not shared),
    ``live_records_end`` summed over every process (``live_records_by_process`` per
    process), ``reference_accuracy``, ``same_predictions``, ``chain_ms`` (the chain's wall
    time, all batches), ``seconds`` (each phase) and ``ok``.
    ``peak_live_bytes`` is the sum over the actors of each one's peak."""
    from .demo_parts import run_json

    hops = []
    for h in result.hops:
        hop = {"from": h["from"], "to": h["to"], "tensor": h.get("tensor", ""), "bytes": int(h["bytes"]),
               "shared": bool(h["shared"]), "transport": h["transport"]}
        if not h["shared"]:
            hop["reason"] = str(h.get("reason") or "")
        hops.append(hop)
    return {
        "executor": "ray",
        "accuracy": float(result.accuracy),
        "reference_accuracy": float(result.reference_accuracy),
        "same_predictions": float(result.same_predictions),
        "hops": hops,
        "live_records_end": int(result.live_records_end),
        "live_records_by_process": {k: int(v) for k, v in result.live_records_by_process.items()},
        "device": "cpu",
        **run_json(result),
        "ray": result.ray_version,
        "ok": bool(result.ok),
    }


def print_text(result: RayDemoResult, file: Any = None) -> None:
    """The human report, in tables as ``tensor-exchange demo`` prints it (rich where it is
    installed, else plain columns): accuracy, the stages with their actors and times, the
    hops with what they carry, their transports and why a hop copied, live records per
    process, timings."""
    out = sys.stdout if file is None else file
    head = (f"digits on Ray {result.ray_version}: trained on {result.n_train}, tested on {result.n_test} held-out "
            f"images in {result.batches} batches, one actor per stage")
    score = (f"accuracy {result.accuracy:.4f} (NumPy reference {result.reference_accuracy:.4f}, "
             f"same predictions {result.same_predictions:.1%})")
    reasons = [f"copied: {h['from']} -> {h['to']}: {h.get('reason') or 'no reason given'}"
               for h in result.hops if not h["shared"]]
    live = "live records at the end: " + ", ".join(f"{k} {v}" for k, v in result.live_records_by_process.items())
    timing = f"time: chain {result.chain_ms:.1f} ms; " + ", ".join(f"{k} {v:.2f} s" for k, v in result.seconds.items())
    verdict = "OK" if result.ok else "FAILED"
    stage_rows = [(s["name"], s["framework"], str(result.actors.get(s["name"], "?")), f"{s['ms']:.1f}")
                  for s in result.stages]
    hop_rows = [(h["from"], h["to"], h.get("tensor", ""), str(h["bytes"]), h["transport"],
                 "shared" if h["shared"] else "copied") for h in result.hops]
    from .demo_parts import _report_console, rich_table

    Table = rich_table()  # noqa: N806
    if Table is not None:
        console = _report_console(out)
        console.print(head, markup=False)
        console.print(score, markup=False)
        table = Table(title="tx.Chain stages, one Ray actor each", title_justify="left")
        for col in ("stage", "framework", "actor pid", "ms, all batches"):
            table.add_column(col, justify="right" if col.startswith("ms") else "left")
        for row in stage_rows:
            table.add_row(*row)
        console.print(table)
        table = Table(title="hops (bytes: all batches)", title_justify="left")
        for col in ("from", "to", "tensor", "bytes", "transport", "memory"):
            table.add_column(col, justify="right" if col == "bytes" else "left", no_wrap=True)
        for row in hop_rows:
            table.add_row(*row[:-1], "[green]shared[/green]" if row[-1] == "shared" else "[yellow]copied[/yellow]")
        console.print(table)
        for line in reasons + [live] + ["  " + r for r in result.records_end] + [timing]:
            console.print(line, markup=False)
        console.print(f"[bold {'green' if result.ok else 'red'}]{verdict}[/]")
        return
    print(head, file=out)
    print(score, file=out)
    print("tx.Chain stages, one Ray actor each:", file=out)
    print(f"  {'stage':<10} {'framework':<12} {'actor pid':>9} {'ms, all batches':>16}", file=out)
    for name, framework, pid, ms in stage_rows:
        print(f"  {name:<10} {framework:<12} {pid:>9} {ms:>16}", file=out)
    print("hops (bytes: all batches):", file=out)
    print(f"  {'from':>11}    {'to':<11} {'tensor':<14} {'bytes':>8}  {'transport':<17} memory", file=out)
    for src, dst, tensor, nbytes, transport, state in hop_rows:
        print(f"  {src:>11} -> {dst:<11} {tensor:<14} {nbytes:>8}  {transport:<17} {state}", file=out)
    for line in reasons + [live] + ["  " + r for r in result.records_end] + [timing, verdict]:
        print(line, file=out)


def main(args: Any) -> int:
    """``tensor-exchange demo --ray``: run, print the report; exit status 0 when the check
    holds, 1 when not, 2 when Ray is not installed, when no cluster answers at
    ``RAY_ADDRESS``, or when ``--device cuda`` was asked for (the Ray demo runs on the
    CPU)."""
    from ..errors import BackendUnavailableError
    from .demo_parts import _stdout_to_stderr

    if getattr(args, "device", "auto") == "cuda":
        print("tensor-exchange demo --ray: runs on the CPU (--device cuda is not supported with --ray)",
              file=sys.stderr)
        return 2
    from ..ray import objects as ray_objects
    from . import write_report
    from .demo_parts import pip_hint

    try:
        ray_objects.require_ray()
    except BackendUnavailableError:
        print(f"tensor-exchange demo --ray needs Ray, which is not installed here: {pip_hint('ray')} "
              "(in a checkout: make demo ARGS=--ray)", file=sys.stderr)
        return 2
    threads = getattr(args, "threads", None) or 1
    try:
        if args.report == "json":
            with _stdout_to_stderr():
                result = run_ray_demo(seed=args.seed, threads=threads, batches=args.batches, progress=True)
            write_report(lambda: sys.stdout.write(json.dumps(report_json(result)) + "\n"))
        else:
            result = run_ray_demo(seed=args.seed, threads=threads, batches=args.batches, progress=True)
            write_report(lambda: print_text(result))  # a reader that left (`| head`) changes no verdict
    except (BackendUnavailableError, ConnectionError) as exc:  # no Ray, or no cluster at RAY_ADDRESS
        print(f"tensor-exchange demo --ray: {exc}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1
