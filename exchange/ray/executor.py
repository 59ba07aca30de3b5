"""``tx.Chain(stages, executor="ray")``: each stage on its own Ray actor, batches streamed
through them.

Each stage runs in its own actor (a Ray worker process) inside a one-stage in-process
``tx.Chain``, so everything the in-process chain does for a stage (framework adapters,
streams, ONNX Runtime IO binding, the read-only rule of ``exchange.frameworks``) holds
there too. The driver sends a batch to the first actor and hands each actor's result
(an ``ObjectRef``) to the next one: the data moves actor to actor through the node's
object store (or, for CUDA stages, Ray Direct Transport with the ``exchange.ray.transport``
transport), never through the driver, and consecutive batches overlap across the actors
(``max_in_flight`` batches at once). The final outputs come back to the driver as tx
Tensors over the object store (read-only; their records hold the objects,
``exchange.ray.objects``). With ``RayExecutor(compiled=True)`` the actors form one Ray
Compiled Graph instead, and batches go through its channels (``exchange.ray.compiled``:
what changes there, hops and faults included).

Hops. Every hop of ``ChainResult.hops`` has ``transport``: ``"ray-object-store"`` (the
producer's output is written once into the store by Ray's serialization, and every
process on the node reads it there), ``"cuda-ipc"`` / ``"shared-memory"`` / ``"nixl"``
(Ray Direct Transport), or ``"host-copy"`` (through host memory: a copy). ``shared`` is
true when no copy was made beyond the transport's own delivery: the producer's output
went into the transport as it was, and the consumer's array is over the memory the
transport delivered. A hop that is not shared says why in ``reason``.

Faults. A stage that raises gives ``tx.StageError`` naming the stage (the actor lives on);
a stage whose actor dies (killed, out of memory, ``os._exit``) gives ``tx.StageError``
naming the stage as soon as Ray reports the death, and a new actor is started for it by
the next ``run``; a batch that takes longer than ``timeout_s`` gives ``tx.StageError``
naming the stage it waits on, and that actor is stopped; an actor that does not start
gives ``tx.StageError`` naming the resources it asked for that the cluster lacks or has
busy (Ray keeps it pending, silent: a stage asking for more than the whole cluster has,
``num_gpus`` without GPUs, waits at most ``timeout_s``). In every case the driver drops
what it holds of the run (its registry keeps nothing of it), after taking the results of
the batches still in flight (at most 2 s), whose errors Ray would otherwise log as
"Unhandled error" tracebacks.

Ray APIs used: ``ray.remote`` actor classes with ``.options(...)`` (``num_cpus``,
``num_gpus``, ``resources``, ``enable_tensor_transport``), ``ray.get`` with a timeout,
``ray.exceptions.RayTaskError`` / ``RayActorError`` (``actor_id``) / ``GetTimeoutError``,
``ray.kill``. Checked with Ray 2.60.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
import weakref
from collections import deque
from typing import Any, Iterable, NoReturn, Sequence

from .. import tracing as _tracing
from ..chain import ChainResult, Stage, StageError, _progress, _with_room
from ..device import Device, DeviceType
from ..registry import registry
from ..tensor import Tensor, from_dlpack
from .compiled import CHANNEL, COPIED, CompiledGraph, from_wire, to_wire, why_not
from .objects import require_ray

__all__ = ["RayExecutor", "InActor", "start_executor"]

_REG = registry()
#: Seconds a failed run waits for the results of the batches still in flight (``_settle``).
_SETTLE_S = 2.0
#: Transports that deliver memory without a copy of their own.
_ZERO_COPY = ("in-process", "ray-object-store", "cuda-ipc", "shared-memory", "nixl")


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


class RayExecutor:
    """How ``tx.Chain(stages, executor=tx.RayExecutor(...))`` runs its stages on Ray
    actors (``executor="ray"`` is ``RayExecutor()``). One executor may serve several
    chains; each chain starts actors of its own.

    ``resources``: per stage, the Ray options of its actor (``num_cpus``, ``num_gpus``,
    ``memory``, ``resources``, ...), as a dict keyed by stage name or index, or a list
    in stage order (ValueError for a name no stage has, or several stages have). A CUDA stage with no ``num_gpus`` gets ``1 / (number of CUDA
    stages)``: the CUDA stages share one GPU.
    ``actor_options``: Ray options for every actor (e.g. ``scheduling_strategy``,
    ``runtime_env``, ``max_restarts``); a stage's ``resources`` win over them.
    ``max_in_flight``: batches in the actors at once (default: the number of stages,
    at least 2).
    ``tensor_transport``: ``"auto"`` (the object store for CPU stages, Ray Direct
    Transport with ``exchange.ray.transport`` for CUDA stages), ``"object-store"`` or
    ``"tx"`` (Ray Direct Transport for every stage).
    ``timeout_s``: seconds a batch may take from submission to result before the chain
    gives up on it (StageError); ``start_timeout_s``: seconds for the actors to start
    (StageError naming the resources short; a stage asking for more than the whole
    cluster has, such as ``num_gpus`` where there is no GPU, waits at most ``timeout_s``).
    ``init``: options for ``exchange.ray.objects.init`` when Ray is not running yet
    (it then starts a local cluster: no dashboard, quiet workers).
    ``compiled``: run the actors as one Ray Compiled Graph (``exchange.ray.compiled``):
    a batch costs channel writes and reads instead of task submissions (3 stages, 1 KiB:
    0.8-1.9 ms a batch against about 5 ms here), for 4-9 s of compiling when the chain
    starts and each actor polling while idle (about 65 % of a core here) until
    ``Chain.close()``; every tensor is copied out of its channel as it is read. A chain
    that cannot be one (CUDA stages, ``tensor_transport="tx"``) runs on actor tasks, and
    ``ChainResult.executor_reason`` says why. Off by default: Ray's Compiled Graphs are its experimental API, and the
    idle polling is a cost a chain kept between runs should opt into.

    Devices: a stage's device is named as its actor sees it; Ray makes the GPUs it gives
    an actor visible from ``cuda:0`` on (``CUDA_VISIBLE_DEVICES``).

    Raises BackendUnavailableError naming the extra when Ray is not installed,
    ValueError / TypeError for bad options.
    """

    in_actor = staticmethod(InActor)

    def __init__(self, *, resources: dict[Any, dict[str, Any]] | Sequence[dict[str, Any] | None] | None = None,
                 actor_options: dict[str, Any] | None = None, max_in_flight: int | None = None,
                 tensor_transport: str = "auto", timeout_s: float | None = 300.0, start_timeout_s: float = 120.0,
                 init: dict[str, Any] | None = None, compiled: bool = False) -> None:
        require_ray()
        if tensor_transport not in ("auto", "object-store", "tx"):
            raise ValueError(f"tensor_transport must be 'auto', 'object-store' or 'tx', got {tensor_transport!r}")
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (or None), got {timeout_s!r}")
        self.resources = resources
        self.actor_options = dict(actor_options or {})
        self.max_in_flight = max_in_flight
        self.tensor_transport = tensor_transport
        self.timeout_s = timeout_s
        self.start_timeout_s = float(start_timeout_s)
        self.init = dict(init or {})
        if not isinstance(compiled, bool):
            raise TypeError(f"compiled must be True or False, got {compiled!r}")
        self.compiled = compiled

    def __repr__(self) -> str:
        return (f"RayExecutor(tensor_transport={self.tensor_transport!r}, max_in_flight={self.max_in_flight}, "
                f"compiled={self.compiled})")

    def start(self, stages: list[Stage], device: Device) -> "_ActorChain":
        """Start actors for a chain's ``stages`` (``device``: the chain's default device);
        the runner that ``tx.Chain`` hands its batches to. ``exchange.chain.ChainExecutor``:
        called by ``tx.Chain.__init__``."""
        return _ActorChain(self, stages, device)

    def _options_for(self, stages: list[Stage], device: Device) -> list[dict[str, Any]]:
        per: list[dict[str, Any]] = [{} for _ in stages]
        names = {s.name: k for k, s in enumerate(stages)}
        if isinstance(self.resources, dict):
            for key, opts in self.resources.items():
                same = [k for k, s in enumerate(stages) if s.name == key] if not isinstance(key, int) else []
                if len(same) > 1:  # a name several stages have (two lambdas, say) picks none of them
                    raise ValueError(f"resources key {key!r} names stages {' and '.join(map(str, same))}; "
                                     "key resources by index, or give the stages names of their own")
                k = key if isinstance(key, int) else names.get(key)
                if k is None or not 0 <= k < len(stages):
                    raise ValueError(f"resources names stage {key!r}, which is not in the chain "
                                     f"(stages: {', '.join(names)})")
                per[k] = dict(opts or {})
        elif self.resources is not None:
            listed = list(self.resources)
            if len(listed) != len(stages):
                raise ValueError(f"resources lists {len(listed)} entries for {len(stages)} stages")
            per = [dict(o or {}) for o in listed]
        cuda = [k for k, s in enumerate(stages) if _stage_device(s, device).type == DeviceType.kDLCUDA]
        out = []
        for k, opts in enumerate(per):
            merged = {**self.actor_options, **opts}
            if k in cuda:
                merged.setdefault("num_gpus", 1.0 / len(cuda))
            out.append(merged)
        return out


def start_executor(executor: Any, chain: Any) -> "_ActorChain":
    """The runner of ``chain`` for ``executor`` (``"ray"`` or a RayExecutor). ``tx.Chain``
    calls :meth:`RayExecutor.start` instead (``exchange.chain.ChainExecutor``); this stays
    for callers of the old hook."""
    if isinstance(executor, str):
        if executor != "ray":
            raise ValueError(f"unknown executor {executor!r}; use None (in-process), 'ray' or tx.RayExecutor(...)")
        executor = RayExecutor()
    if not isinstance(executor, RayExecutor):
        raise TypeError(f"executor must be None, 'ray' or a tx.RayExecutor, got {type(executor).__name__}")
    return executor.start(chain.stages, chain.device)


def _stage_device(stage: Stage, device: Device) -> Device:
    return stage.device or device


@dataclasses.dataclass
class _Packet:
    """One batch between actors: its tensors (``values``; ``names`` for a dict batch),
    what the producer side said of each (``pending``: from, shared, reason), the hops so
    far, and each stage's milliseconds and peak live bytes for this batch."""

    kind: str
    names: list[str] | None
    values: list[Any]
    pending: list[dict[str, Any]]
    hops: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    node: str = ""  # the Ray node its values were made on ("": not known)
    trace_batch: int = -1  # its number in the driver's tx.trace (-1: no trace records)
    hop_stages: list[int] = dataclasses.field(default_factory=list)  # the stage each of ``hops`` went into

    def batch(self) -> Any:
        return _batch_of(self.kind, self.names, self.values)

    outputs = batch


def _batch_of(kind: str, names: list[str] | None, values: list[Any]) -> Any:
    """The batch a stage gets: one tensor, a tuple or a dict of them."""
    if kind == "dict":
        return dict(zip(names or [], values))
    if kind == "tuple":
        return tuple(values)
    return values[0]


def _parts_of(batch: Any) -> tuple[str, list[str] | None, list[Any]]:
    """A batch's form, its names (for a dict) and its values: :func:`_batch_of` undone."""
    if isinstance(batch, dict):
        return "dict", list(batch), list(batch.values())
    if isinstance(batch, (tuple, list)):
        return "tuple", None, list(batch)
    return "one", None, [batch]


def _packet_of(batch: Any) -> _Packet:
    """The driver's packet for one input batch: arrays taken as tx Tensors (zero-copy)."""
    kind, names, values = _parts_of(batch)
    tensors = [v if isinstance(v, Tensor) else from_dlpack(v) for v in values]
    return _Packet(kind, names, tensors, [{"from": "input", "shared": True, "reason": None} for _ in tensors])


def _transport_hop(src: str, dst: str, t: Any, before: dict[str, Any], after: dict[str, Any] | None,
                   nodes: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """One hop across processes: the producer side (``before``), the transport (noted on
    ``t``'s record), and the consumer side (``after``: the in-actor chain's hop; None
    for the driver, which takes the tx Tensor as it came). ``nodes``: the Ray nodes of
    the producer and the consumer; when both are known and differ, the hop crossed
    nodes: Ray copied the object from one node's store to the other's."""
    from .objects import transport, transport_reason

    return _hop(src, dst, int(t.nbytes), transport(t), transport_reason(t), before["shared"], before.get("reason"),
                after, nodes)


def _hop(src: str, dst: str, nbytes: int, how: str, why: str | None, shared_out: bool, reason_out: str | None,
         after: dict[str, Any] | None, nodes: tuple[str, str]) -> dict[str, Any]:
    """:func:`_transport_hop` from what was said of the tensor: its size, its transport
    and the transport's reason to copy, and whether the producer's output left shared."""
    reasons = []
    if nodes[0] and nodes[1] and nodes[0] != nodes[1]:
        where = "object store" if how == "ray-object-store" else "memory"
        reasons.append(f"crossed nodes: Ray copied it from node {nodes[0][:8]}'s {where} to "
                       f"node {nodes[1][:8]}'s")
    if not shared_out:
        reasons.append(reason_out or f"{src}'s output was copied on its way out")
    if how == "host-copy":
        reasons.append(f"copied through host memory by the transport{f' ({why})' if why else ''}")
    elif how not in _ZERO_COPY or why:
        reasons.append(f"{how}: {why or 'a copy'}")
    if after is not None and not after["shared"]:
        reasons.append(after.get("reason") or f"{dst} copied the data when it took it")
    hop = {"from": src, "to": dst, "bytes": nbytes, "shared": not reasons, "transport": how}
    if nodes[0] and nodes[1]:
        hop["nodes"] = [nodes[0][:8], nodes[1][:8]]
    if reasons:
        hop["reason"] = "; ".join(reasons)
    return hop


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
        kind, names, values, trace_batch, facts = wire
        self._busy_since = time.monotonic()
        try:
            tensors = from_wire(values, note=False)
            if trace_batch >= 0:
                _tracing.number_next_batch(trace_batch)
            try:
                result = self.chain.run([_batch_of(kind, names, tensors)])
            except StageError as exc:
                source = self._source if facts else "input"
                raise StageError(self._message(exc, source)) from None
            n_in, hops = len(tensors), result.hops
            taken = tuple((h["bytes"], h["shared"], h.get("reason")) for h in hops[:n_in])
            left = tuple((h["shared"], h.get("reason")) for h in hops[n_in:])
            kind, names, outputs = _parts_of(result.outputs[0])
            fact = (result.stage_ms[self.name], int(result.peak_live_bytes), taken, left)
            return (kind, names, to_wire(outputs), trace_batch, facts + (fact,))
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


class _ActorChain:
    """A chain's stages on their actors; made by :meth:`RayExecutor.start`."""

    def __init__(self, executor: RayExecutor, stages: list[Stage], device: Device) -> None:
        from .objects import init

        self.ray = ray = require_ray()
        for s in stages:
            if s.stream is not None:
                raise ValueError(f"stage {s.name!r}: stream= cannot travel to a Ray actor; leave it None "
                                 "(the stage's actor makes its own)")
            if s.out:
                raise ValueError(f"stage {s.name!r}: out= buffers are the driver's memory; "
                                 "with executor='ray' stages allocate their outputs")
        self.executor = executor
        self.stages = list(stages)
        self.device = device
        init(**executor.init)
        self.node = _node_id()  # the driver's node: hops from and to it say when they crossed
        self._recording: Any = None  # the driver's tx.trace during a run, if one records
        self._traced_hops: list[tuple[int, list[dict[str, Any]], list[int]]] = []
        cuda = any(_stage_device(s, device).type == DeviceType.kDLCUDA for s in stages)
        self.direct = executor.tensor_transport == "tx" or (executor.tensor_transport == "auto" and cuda)
        if self.direct:
            from .transport import register_transport

            register_transport()
        self.options = executor._options_for(self.stages, device)
        self.max_in_flight = executor.max_in_flight or max(2, len(stages))
        self.actors: list[Any] = [None] * len(stages)
        self.places: list[dict[str, Any]] = [{} for _ in stages]
        # Ray reads enable_tensor_transport when the class is declared, not from .options().
        self._cls = ray.remote(enable_tensor_transport=True)(_StageActor) if self.direct else ray.remote(_StageActor)
        self._closed = False
        # The compiled graph (exchange.ray.compiled) when asked for and the chain can be one.
        self.compiled_reason = why_not(self.stages, device, self.direct) if executor.compiled else None
        self.compiled = executor.compiled and self.compiled_reason is None
        self.graph: Any = None
        self._hop_memo: dict[tuple, tuple[list[dict[str, Any]], list[int]]] = {}
        try:
            self._start_missing()
        except BaseException:
            self.close()
            raise

    # -- actors ------------------------------------------------------------------------
    def _label(self, k: int) -> str:
        s = self.stages[k]
        return f"stage {k} {s.name!r} ({s.framework})"

    def _start_missing(self) -> None:
        ray = self.ray
        started = []
        for k, stage in enumerate(self.stages):
            if self.actors[k] is not None:
                continue
            opts = dict(self.options[k])
            try:
                source = self.stages[k - 1].framework if k else "input"
                self.actors[k] = self._cls.options(**opts).remote(stage, k, str(_stage_device(stage, self.device)),
                                                                  source)
            except TypeError as exc:
                raise TypeError(f"{self._label(k)} cannot be sent to a Ray actor: {exc}. Pickle-proof the stage "
                                "function, or make it in the actor with tx.RayExecutor.in_actor(factory, *args)"
                                ) from exc
            started.append(k)
        # Ray keeps an actor that asks for more than the cluster has (num_gpus where there
        # is no GPU) pending, silent: such a stage waits at most timeout_s, not start_timeout_s.
        t0 = time.monotonic()
        for k in started:
            wait_s, which = self.executor.start_timeout_s, "start_timeout_s"
            timeout_s = self.executor.timeout_s
            if timeout_s is not None and timeout_s < wait_s and _lacking(ray, self.options[k]):
                wait_s, which = timeout_s, "timeout_s"
            try:
                self.places[k] = ray.get(self.actors[k].ready.remote(),
                                         timeout=max(0.0, t0 + wait_s - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise StageError(f"{self._label(k)}: its Ray actor did not start within {wait_s:g} s ({which}): "
                                 f"{_resources_missing(ray, self.options[k])}") from None
            except ray.exceptions.RayError as exc:
                raise StageError(f"{self._label(k)}: its Ray actor could not start: {_short(exc)}") from None
        if self.compiled and self.graph is None:
            self._compile()

    def _compile(self) -> None:
        """The actors as one compiled graph, warmed up (its first execution takes seconds).
        A chain collected without ``close()`` tears it down too: its actors would poll on."""
        ray = self.ray
        try:
            self.graph = CompiledGraph(ray, self.actors, self.max_in_flight, self.executor.start_timeout_s)
            # At exit ray.shutdown() tears every compiled graph down itself.
            weakref.finalize(self, self.graph.teardown, True).atexit = False
        except (ray.exceptions.GetTimeoutError, TimeoutError):
            self._drop_graph()
            raise StageError(f"the chain's compiled graph did not run its first (empty) batch within "
                             f"{self.executor.start_timeout_s:g} s (start_timeout_s)") from None
        except ray.exceptions.RayError as exc:
            self._drop_graph()
            raise StageError(f"the chain's compiled graph could not start: {_short(exc)}") from None

    def _drop_graph(self, failed: bool = True) -> None:
        """Tear the compiled graph down with every actor of it (the next run starts them
        and compiles anew); ``failed``: after a fault, when a stage may hang (the actors
        are killed first)."""
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.teardown(failed)
        for k in range(len(self.actors)):
            self._drop_actor(k)

    def _drop_actor(self, k: int) -> None:
        actor, self.actors[k] = self.actors[k], None
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass

    def _drop_after_failure(self, k: int) -> None:
        """Stage ``k`` failed, died or hung. Under Ray Direct Transport Ray also ends the
        actors on both sides of each transfer that failed with it ("RDT transfer ...
        failed. Killing the actors", Ray 2.60), so the next run found another stage dead
        and blamed it, and took two or three runs to recover: there every actor goes, and
        the next run starts them all anew."""
        for j in (range(len(self.actors)) if self.direct else (k,)):
            self._drop_actor(j)

    def _dropped_what(self) -> str:
        if self.compiled:
            return ("the compiled graph was torn down with every stage's actor; the next run starts them anew "
                    "and compiles again (seconds)")
        if self.direct:
            return ("every stage's actor was stopped (Ray ends both sides of a failed direct transfer); "
                    "the next run starts them anew")
        return "its actor was stopped; the next run starts a new one"

    def _stage_of_pid(self, pid: Any) -> int | None:
        """The stage whose actor ran as process ``pid`` (None: no stage's)."""
        if not isinstance(pid, int):
            return None
        for k, place in enumerate(self.places):
            if place.get("pid") == pid:
                return k
        return None

    def _stage_of(self, actor_id: Any) -> int | None:
        for k, actor in enumerate(self.actors):
            if actor is not None and actor_id is not None and actor._actor_id.hex() == actor_id:
                return k
        return None

    # -- running -------------------------------------------------------------------------
    def run(self, batches: Iterable[Any], *, progress: bool = False) -> ChainResult:
        if self._closed:
            raise RuntimeError("this chain is closed")
        self._start_missing()
        result = ChainResult(stage_ms={s.name: 0.0 for s in self.stages})
        result.executor = "ray-compiled" if self.compiled else "ray"
        result.executor_reason = self.compiled_reason
        peaks: dict[str, int] = {}
        recording = self._recording = _tracing.active()
        self._traced_hops: list[tuple[int, list[dict[str, Any]], list[int]]] = []
        if recording is not None:
            self._trace_actors("trace_start")
        start = time.perf_counter()
        in_flight: deque[list[Any]] = deque()
        try:
            for batch in _with_room(_progress(batches, progress), in_flight, self.max_in_flight,
                                    lambda refs: self._retire(refs, result, peaks)):
                in_flight.append(self._submit(batch))
            while in_flight:
                self._retire(in_flight.popleft(), result, peaks)
        except BaseException as exc:
            # Drop every tensor of the run here (the outputs so far, the refs in flight):
            # the caller gets the error and the driver's registry keeps nothing of it.
            if isinstance(exc, Exception):
                self._settle(in_flight)
            elif self.compiled:  # Ctrl-C must not wait: a compiled graph goes (module docstring)
                self._drop_graph()
            in_flight.clear()
            result.outputs.clear()
            raise
        finally:
            self._recording = None
            if recording is not None:
                self._merge_traces(recording)
        result.wall_ms = (time.perf_counter() - start) * 1e3
        result.peak_live_bytes = sum(peaks.values())
        result._live_records = lambda: self.live_records(wait_s=0.0)  # on first read: a run pays nothing
        return result

    def _trace_actors(self, method: str) -> list[Any]:
        """Call ``method`` on every live actor; what each returned (None where it could
        not answer within timeout_s: a trace never fails a run)."""
        alive = [(k, a) for k, a in enumerate(self.actors) if a is not None]
        answers: list[Any] = [None] * len(self.actors)
        for k, actor in alive:
            try:
                answers[k] = self.ray.get(getattr(actor, method).remote(), timeout=self.executor.timeout_s)
            except Exception:
                pass
        return answers

    def _merge_traces(self, recording: Any) -> None:
        """The actors' events into the driver's trace: each actor a process named for
        its stage, its stage track renamed "stage K: ..."; the hops are the run's own
        (``ChainResult.batch_hops``, each on the span of the stage it went into; the
        actors' in-process hops are left out), and a flow joins a batch's span in each
        stage to its span in the next (the driver numbered the batches)."""
        taken = self._trace_actors("trace_take")
        spans: list[dict[int, dict[str, Any]]] = []
        for k, events in enumerate(taken):
            events = [e for e in (events or []) if e.get("cat") != "hop"]
            stage = self.stages[k]
            for e in events:
                if e["ph"] == "M" and e["name"] == "process_name":
                    e["args"] = {"name": f"Ray actor: stage {k} {stage.name!r} (pid {e['pid']})"}
                elif e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"].startswith("stage 0: "):
                    e["args"] = {"name": f"stage {k}: {stage.name} ({stage.framework})"}
            spans.append({e["args"]["batch"]: e for e in events if e["ph"] == "X"})
            recording.add_foreign(events)
        extra: list[dict[str, Any]] = []
        for k in range(len(spans) - 1):
            for batch, a in spans[k].items():
                b = spans[k + 1].get(batch)
                if b is None or a["args"].get("failed"):
                    continue
                flow = recording.new_flow_id()
                extra.append({"ph": "s", "name": "batch", "cat": "batch", "ts": a["ts"], "pid": a["pid"],
                              "tid": a["tid"], "id": flow})
                extra.append({"ph": "f", "name": "batch", "cat": "batch", "ts": b["ts"], "pid": b["pid"],
                              "tid": b["tid"], "id": flow, "bp": "e"})
        for batch, hops, stages in self._traced_hops:
            for hop, k in zip(hops, stages):
                span = spans[k].get(batch) if k < len(spans) else None
                if span is not None:
                    extra.append({"ph": "i", "name": f"hop {hop['from']} -> {hop['to']}", "cat": "hop",
                                  "ts": span["ts"], "pid": span["pid"], "tid": span["tid"], "s": "t",
                                  "args": dict(hop)})
        self._traced_hops = []
        recording.add_foreign(extra)

    def _submit(self, batch: Any) -> list[Any]:
        if self.compiled:
            return [self._submit_compiled(batch)]
        packet = _packet_of(batch)
        packet.node = self.node
        if self._recording is not None:
            packet.trace_batch = self._recording.next_batch()
        refs = []
        arg: Any = packet
        try:
            for actor in self.actors:
                method = actor.run.options(tensor_transport="tx") if self.direct else actor.run
                arg = method.remote(arg)
                refs.append(arg)
        except BaseException:
            packet.values.clear()  # the traceback keeps this frame: keep no tensor in it
            raise
        return refs  # the packet's tensors were serialized by the first .remote(): dropped here

    def _submit_compiled(self, batch: Any) -> Any:
        """Start one batch on the compiled graph: Ray writes it into the graph's input
        channel here (the wire form of ``exchange.ray.compiled.CompiledGraph``)."""
        kind, names, values = _parts_of(batch)
        tensors = [v if isinstance(v, Tensor) else from_dlpack(v) for v in values]
        trace_batch = self._recording.next_batch() if self._recording is not None else -1
        try:
            return self.graph.submit((kind, names, to_wire(tensors), trace_batch, ()))
        finally:
            tensors.clear()  # a traceback keeps this frame: keep no tensor in it

    def _retire(self, refs: list[Any], result: ChainResult, peaks: dict[str, int]) -> None:
        packet = self._collect_compiled(refs[0]) if self.compiled else self._collect(refs)
        self._account(packet, result, peaks)

    def _collect_compiled(self, ref: Any) -> _Packet:
        """A batch's packet from the compiled graph; its faults as StageError (module
        docstring of ``exchange.ray.compiled``)."""
        ray = self.ray
        timeout_s = self.executor.timeout_s
        try:  # None: as long as it takes (Ray's own None is its 10 s RAY_CGRAPH_get_timeout)
            return self._unwire(self.graph.get(ref, -1 if timeout_s is None else timeout_s))
        except ray.exceptions.RayTaskError as exc:  # a stage raised: the graph goes on
            cause = getattr(exc, "cause", None)
            if isinstance(cause, StageError):
                raise StageError(str(cause)) from None
            k = self._stage_of_pid(getattr(exc, "pid", None))
            dead = self.graph.dead()
            if dead:
                return self._died(dead[0], exc)
            raise StageError(f"{self._where(k)} failed on its Ray actor: {_short(exc)}") from None
        except (ray.exceptions.GetTimeoutError, TimeoutError):
            dead = self.graph.dead()
            if dead:
                return self._died(dead[0], None)
            k = self.graph.busiest()
            self._drop_graph()
            raise StageError(f"{self._where(k)} did not finish a batch within {timeout_s} s "
                             f"(timeout_s); {self._dropped_what()}") from None
        except (ray.exceptions.RayChannelError, ray.exceptions.RayActorError) as exc:
            dead = self.graph.dead() if self.graph is not None else []
            return self._died(dead[0] if dead else None, exc)

    def _unwire(self, wire: tuple) -> _Packet:
        """The packet of a batch the compiled graph finished: its tensors copied out of the
        output channel, and its hops (the last one, into the driver, too: ``pending``
        left empty), stage times and peaks from what each stage said
        (``exchange.ray.compiled.CompiledGraph``): the same report as on actor tasks.
        A batch's hops follow from what the stages said of their inputs and outputs and
        from the outputs' sizes, which repeat batch to batch: they are made once per
        such key and copied for each batch (this runs on the driver per batch, beside
        actors that poll)."""
        kind, names, values, trace_batch, facts = wire
        packet = _Packet(kind, names, from_wire(values), [], trace_batch=trace_batch)
        key = (tuple(f[2:] for f in facts), tuple(t.nbytes for t in packet.values))
        made = self._hop_memo.get(key)
        if made is None:
            if len(self._hop_memo) >= 4096:
                self._hop_memo.clear()
            made = self._hop_memo[key] = self._channel_hops(facts, packet.values)
        hops, stages = made
        packet.hops = [dict(hop) for hop in hops]
        packet.hop_stages = list(stages)
        ms, peaks = packet.ms, packet.peaks
        for (spent, peak, _, _), stage in zip(facts, self.stages):
            ms[stage.name] = ms.get(stage.name, 0.0) + spent
            peaks[stage.name] = peak
        return packet

    def _channel_hops(self, facts: tuple, outputs: list[Tensor]) -> tuple[list[dict[str, Any]], list[int]]:
        """A batch's hops through the graph's channels, from ``facts`` (each stage's
        ``(ms, peak, taken, left)``) and the driver's ``outputs``, and the stage each hop
        is reported on."""
        hops: list[dict[str, Any]] = []
        stages: list[int] = []
        left: tuple = ((True, None),) * (len(facts[0][2]) if facts else 0)  # the driver's input: as given
        last = len(facts)
        for k in range(last + 1):
            taken = facts[k][2] if k < last else tuple((int(t.nbytes), True, None) for t in outputs)
            for took, out in zip(taken, left):
                hops.append(self._channel_hop(k, took, out))
                stages.append(min(k, last - 1))
            if k < last:
                left = facts[k][3]
        return hops, stages

    def _channel_hop(self, k: int, took: tuple, out: tuple) -> dict[str, Any]:
        """The hop into stage ``k`` (``len(stages)``: into the driver) through a channel:
        ``took`` (bytes, shared, reason) as the consumer took it, ``out`` (shared, reason)
        as the producer's output left."""
        n = len(self.stages)
        src = self.stages[k - 1].framework if k else "input"
        dst = self.stages[k].framework if k < n else "tx"
        here = lambda j: str(self.places[j].get("node") or "") if 0 <= j < n else self.node  # noqa: E731
        after = {"shared": took[1], "reason": took[2]} if k < n else None
        return _hop(src, dst, took[0], CHANNEL, COPIED, out[0], out[1], after, (here(k - 1), here(k)))

    def _died(self, k: int | None, exc: BaseException | None) -> NoReturn:
        """Stage ``k``'s actor died (None: no stage could be named): the graph goes, and
        StageError says so."""
        self._drop_graph()
        how = f" ({_short(exc)})" if exc is not None else ""
        raise StageError(f"{self._where(k)}: its Ray actor died while running a batch{how}; "
                         f"{self._dropped_what()}") from None

    def _where(self, k: int | None) -> str:
        return self._label(k) if k is not None else "the chain's compiled graph (no stage could be named)"

    def _collect(self, refs: list[Any]) -> _Packet:
        ray = self.ray
        try:
            packet = ray.get(refs[-1], timeout=self.executor.timeout_s)
        except ray.exceptions.GetTimeoutError:
            k = self._first_unfinished(refs)
            self._drop_after_failure(k)
            raise StageError(f"{self._label(k)} did not finish a batch within {self.executor.timeout_s:g} s "
                             f"(timeout_s); {self._dropped_what()}") from None
        except ray.exceptions.RayActorError as exc:
            k = self._stage_of(getattr(exc, "actor_id", None))
            if k is None:
                k = self._first_failed(refs)
            self._drop_after_failure(k)
            raise StageError(f"{self._label(k)}: its Ray actor died while running a batch ({_short(exc)}); "
                             f"{self._dropped_what()}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, StageError):
                raise StageError(str(cause)) from None
            dead = self._stage_of_pid(getattr(cause, "pid", None))
            if dead is not None:  # a stage's process exited under a transfer from it
                self._drop_after_failure(dead)
                raise StageError(f"{self._label(dead)}: its Ray actor died while running a batch (process "
                                 f"{cause.pid} exited; a later stage could not take its output); "  # type: ignore[union-attr]
                                 f"{self._dropped_what()}") from None
            k = self._first_failed(refs)
            after = ""
            if self.direct:  # a failed direct transfer may have ended actors of other stages
                self._drop_after_failure(k)
                after = f"; {self._dropped_what()}"
            raise StageError(f"{self._label(k)} failed on its Ray actor: {_short(exc)}{after}") from None
        return packet

    def _account(self, packet: _Packet, result: ChainResult, peaks: dict[str, int]) -> None:
        """A collected batch into ``result``: its outputs, hops, stage times and peaks."""
        hops = packet.hops
        for t, before in zip(packet.values, packet.pending):  # the hops into the driver, where not made yet
            hops.append(_transport_hop(before["from"], "tx", t, before, None, (packet.node, self.node)))
            packet.hop_stages.append(len(self.stages) - 1)  # out of the last stage
        if packet.trace_batch >= 0:
            self._traced_hops.append((packet.trace_batch, hops, packet.hop_stages))
        if not result.hops:
            result.hops = hops
        result.batch_hops.append(hops)
        for name, ms in packet.ms.items():
            result.stage_ms[name] = result.stage_ms.get(name, 0.0) + ms
        for name, peak in packet.peaks.items():
            peaks[name] = max(peaks.get(name, 0), peak)
        result.outputs.append(packet.outputs())

    def _settle(self, in_flight: deque[list[Any]]) -> None:
        """After a failed run: take the results of the batches still in flight, waiting
        at most ``_SETTLE_S`` for them. Once one stage failed, the batches behind it fail
        too (a dead actor's outputs cannot be computed), and Ray logs every such error
        that nobody retrieved as "Unhandled error" with its traceback when the driver
        drops the ref: taking them here keeps the run's one error the caller's."""
        finals = [refs[-1] for refs in in_flight if refs]
        if not finals:
            return
        if self.compiled:  # a compiled graph's results come in order, each taken once
            deadline = time.monotonic() + _SETTLE_S
            for ref in finals:
                if self.graph is None:
                    return  # torn down: its results went with it
                try:
                    self.graph.get(ref, max(0.0, deadline - time.monotonic()))
                except self.ray.exceptions.RayTaskError:
                    pass  # a stage's error, behind the one raised: taken
                except Exception:
                    # Not taken in time (or the graph broke): Ray never releases a result
                    # whose get did not end, and counts it in flight for good, so the
                    # graph would stall a later run. It goes; the next run compiles anew.
                    self._drop_graph()
                    return
            return
        try:
            ready, _ = self.ray.wait(finals, num_returns=len(finals), timeout=_SETTLE_S)
        except Exception:
            return
        for ref in ready:
            try:
                self.ray.get(ref, timeout=0)  # a packet (dropped at once) or the error, now handled
            except Exception:
                pass

    def _first_unfinished(self, refs: list[Any]) -> int:
        for k, ref in enumerate(refs):
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                return k
        return len(refs) - 1

    def _first_failed(self, refs: list[Any]) -> int:
        for k, ref in enumerate(refs):
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                return k
            try:
                self.ray.get(ref, timeout=0)
            except Exception:
                return k
        return len(refs) - 1

    # -- inspection ------------------------------------------------------------------------
    def live_records(self, wait_s: float = 2.0) -> dict[str, int]:
        """Live registry records per process: ``"driver"`` (this process; it includes the
        outputs still held) and each stage (``"stage k name"``). Ray frees objects a
        little after their last reference goes, so this polls up to ``wait_s`` seconds
        for the actors' counts to reach 0."""
        ray = self.ray
        deadline = time.monotonic() + wait_s
        while True:
            gc.collect()
            _REG.collect(timeout=1.0)
            counts = {"driver": _REG.stats()["live_records"]}
            alive = [(k, a) for k, a in enumerate(self.actors) if a is not None]
            answers = ray.get([a.stats.remote() for _, a in alive], timeout=30)
            for (k, _), answer in zip(alive, answers):
                counts[f"stage {k} {self.stages[k].name}"] = int(answer["live_records"])
            if all(v == 0 for key, v in counts.items() if key != "driver") or time.monotonic() >= deadline:
                return counts
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the actors (Ray keeps running). Outputs stay valid."""
        if self._closed:
            return
        self._closed = True
        self._drop_graph(failed=False)


#: Ray's actor options -> the resource names the cluster counts them in.
_RESOURCE_OPTIONS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def _node_id() -> str:
    """This process's Ray node (hex), "" where Ray cannot say."""
    import ray

    try:
        return str(ray.get_runtime_context().get_node_id() or "")
    except Exception:
        return ""


def _asked(options: dict[str, Any]) -> dict[str, float]:
    """The resources an actor with Ray ``options`` asks for, by the cluster's names."""
    asked = {name: float(options[key]) for key, name in _RESOURCE_OPTIONS.items() if options.get(key)}
    asked.update({str(k): float(v) for k, v in (options.get("resources") or {}).items()})
    return asked


def _lacking(ray: Any, options: dict[str, Any]) -> bool:
    """True when the whole cluster has less of a resource than ``options`` ask for."""
    asked = _asked(options)
    if not asked:
        return False
    try:
        total = ray.cluster_resources()
    except Exception:  # the cluster did not answer: the usual wait, and the error says so
        return False
    return any(total.get(k, 0.0) < v for k, v in asked.items())


def _resources_missing(ray: Any, options: dict[str, Any]) -> str:
    """Why an actor with ``options`` may not start: each resource it asks for that the
    cluster lacks in all (``ray.cluster_resources()``) or has but is using
    (``ray.available_resources()``), or that nothing it asks for is short."""
    asked = _asked(options)
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception as exc:  # the cluster did not answer: say what was asked
        return f"it asks for {_amounts(asked) or 'no resources'} (the cluster's resources unknown: {exc})"
    lacking = {k: v for k, v in asked.items() if total.get(k, 0.0) < v}
    if lacking:
        return (f"it asks for {_amounts(lacking)}, more than the whole cluster has "
                f"({_amounts({k: total.get(k, 0.0) for k in lacking})}; all it has: {_amounts(total)})")
    busy = {k: v for k, v in asked.items() if free.get(k, 0.0) < v}
    if busy:
        return (f"it asks for {_amounts(busy)}, which the cluster has but other actors or tasks hold "
                f"(free now: {_amounts({k: free.get(k, 0.0) for k in busy})})")
    return f"it asks for {_amounts(asked) or 'no resources'}, which the cluster has free; Ray is slow to start it"


def _amounts(resources: dict[str, float]) -> str:
    """``{"GPU": 1.0, "memory": 2e9}`` as ``GPU 1, memory 2 GB``; Ray's own ``node:`` labels left out."""
    parts = []
    for name, value in sorted(resources.items()):
        if name.startswith("node:"):
            continue
        parts.append(f"{name} {value / 1e9:.3g} GB" if name.endswith("memory") else f"{name} {value:g}")
    return ", ".join(parts)


def _short(exc: BaseException) -> str:
    """A Ray error in one line: its first line and, when Ray appended a traceback, the
    error at its end (what actually went wrong)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Ray colours its task names
    lines = [line.strip() for line in plain.strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{type(exc).__name__}: {lines[0]}"
    if len(lines) > 1 and lines[-1] != lines[0]:
        text += f" ... {lines[-1]}"
    return text[:800]
