"""One stage of a Ray chain in its own actor (``_StageActor``: a one-stage in-process
``tx.Chain``), and ``InActor``, a stage function made inside that actor.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from .. import tracing as _tracing
from ..chain import Stage, StageError
from ..registry import registry
from ..tensor import Tensor
from .compiled import from_wire, to_wire
from .packets import _batch_of, _Packet, _parts_of, _transport_hop
from .placement import _node_id

__all__ = ["InActor"]

_REG = registry()


class InActor:
    """A stage function made inside the stage's actor: ``factory(*args, **kwargs)`` runs
    there, once, when the actor starts. For what cannot be pickled to an actor, such as
    an ONNX Runtime ``InferenceSession``: ``tx.Stage(tx.RayExecutor.in_actor(make_session,
    model_bytes), framework="onnxruntime")``. ``factory`` and its arguments must pickle
    (cloudpickle: module functions, lambdas and closures do).

    In an in-process chain it is not callable (TypeError)."""

    def __init__(self, factory: Any, *args: Any, **kwargs: Any) -> None:
        if not callable(factory):
            raise TypeError(f"InActor needs a callable factory, got {type(factory).__name__}")
        self.factory, self.args, self.kwargs = factory, args, kwargs
        self.__name__ = getattr(factory, "__name__", type(factory).__name__)

    def build(self) -> Any:
        return self.factory(*self.args, **self.kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"stage function {self.__name__!r} is made in a Ray actor (RayExecutor.in_actor); "
                        "run its chain with executor='ray'")


class _StageActor:
    """One stage in its own Ray actor: a one-stage in-process tx.Chain. Made by
    ``ray.remote(_StageActor).options(...).remote(stage, index, device)``."""

    def __init__(self, stage: Stage, index: int, device: str, source: str = "input") -> None:
        from ..chain import Chain  # the worker process's own chain runs the stage
        from .objects import register

        register()
        if isinstance(stage.fn, InActor):
            stage.fn = stage.fn.build()
        self.index, self.name, self.framework = index, stage.name, stage.framework
        self.chain = Chain([stage], device=device, max_in_flight=1)
        self.node = _node_id()
        self._busy_since: float | None = None  # when the batch in hand started (compiled graph)
        self._source = source  # the framework of the stage before (compiled graph: its errors name it)

    def ready(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def run(self, packet: _Packet) -> _Packet:
        if packet.trace_batch >= 0:  # traced: this actor's span gets the driver's number for the batch
            _tracing.number_next_batch(packet.trace_batch)
        try:
            result = self.chain.run([packet.batch()])
        except StageError as exc:
            raise StageError(self._message(exc, packet.pending[0]["from"] if packet.pending else "input")) from None
        n_in = len(packet.values)
        for t, before, after in zip(packet.values, packet.pending, result.hops[:n_in]):
            packet.hops.append(_transport_hop(before["from"], self.framework, t, before, after,
                                              (packet.node, self.node)))
            packet.hop_stages.append(self.index)
        kind, names, values = _parts_of(result.outputs[0])
        pending = [{"from": self.framework, "shared": h["shared"], "reason": h.get("reason")}
                   for h in result.hops[n_in:]]
        packet.ms[self.name] = packet.ms.get(self.name, 0.0) + result.stage_ms[self.name]
        packet.peaks[self.name] = int(result.peak_live_bytes)
        return _Packet(kind, names, values, pending, packet.hops, packet.ms, packet.peaks, self.node,
                       packet.trace_batch, packet.hop_stages)

    def run_compiled(self, wire: tuple | None) -> tuple | None:
        """:meth:`run` as a node of a Compiled Graph, on the graph's wire form
        (``exchange.ray.compiled.CompiledGraph``): the batch's tensors copied out of the
        channel they came in, the stage run, its outputs and what it did appended. None
        (the warm-up) passes."""
        if wire is None:
            return None
        kind, names, values, trace_batch, times, said = wire
        self._busy_since = time.monotonic()
        try:
            tensors = from_wire(values, note=False)
            if trace_batch >= 0:
                _tracing.number_next_batch(trace_batch)
            try:
                out, hops, ms, peak = self.chain._run_alone(_batch_of(kind, names, tensors))
            except StageError as exc:
                source = self._source if times else "input"
                raise StageError(self._message(exc, source)) from None
            n_in = len(tensors)
            del tensors
            times += ((ms[0], peak),)
            if n_in == 1 and len(hops) == 2 and isinstance(out, Tensor):
                # One tensor in, one out (most chains): the general path below, written out
                # (this runs per batch and stage, cold, between other actors' polling).
                h, g = hops
                said += ((((h["bytes"], h["shared"], h.get("reason")),), ((g["shared"], g.get("reason")),)),)
                return ("one", None, to_wire([out]), trace_batch, times, said)
            taken = tuple((h["bytes"], h["shared"], h.get("reason")) for h in hops[:n_in])
            left = tuple((h["shared"], h.get("reason")) for h in hops[n_in:])
            kind, names, outputs = _parts_of(out)
            del out
            return (kind, names, to_wire(outputs), trace_batch, times, said + ((taken, left),))
        finally:
            self._busy_since = None

    def busy(self) -> float | None:
        """Seconds the batch in hand has taken so far (None: none in hand). Answered from
        Ray's default concurrency group while a compiled graph's loop runs in another."""
        since = self._busy_since
        return None if since is None else time.monotonic() - since

    def _message(self, exc: StageError, source: str) -> str:
        text = str(exc)
        tail = text.split(" failed: ", 1)[1] if " failed: " in text else text
        where = f"stage {self.index} {self.name!r} ({self.framework}) on its Ray actor (pid {os.getpid()})"
        if "could not take its input" in text:
            return f"{where} could not take its input from {source}: {text.split(': ', 1)[-1]}"
        return f"{where} failed: {tail}"

    def trace_start(self) -> None:
        """Record this actor's side of a traced run (the driver's ``tx.trace``): its
        stage's spans, hops and records, in memory until :meth:`trace_take`."""
        from .. import tracing

        if tracing.active() is None:
            self._trace = tracing.trace(None)
            self._trace.start()

    def trace_take(self) -> list[dict[str, Any]]:
        """Stop recording; the events (Chrome trace form, this process's pid)."""
        recording, self._trace = getattr(self, "_trace", None), None
        if recording is None:
            return []
        recording.stop()
        return recording.events()

    def stats(self) -> dict[str, Any]:
        """This process's registry after a collection: live records and bytes."""
        gc.collect()
        _REG.collect(timeout=2.0)
        s = _REG.stats()
        return {"live_records": s["live_records"], "live_bytes": s["live_bytes"], "pid": os.getpid()}

    def records(self) -> list[str]:
        return [r.describe() for r in _REG.snapshot()]
