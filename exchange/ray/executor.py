"""``tx.Chain(stages, executor="ray")``: each stage on its own Ray actor, batches streamed
through them.

Each stage runs in its own actor (a Ray worker process) inside a one-stage in-process
``tx.Chain``, so everything the in-process chain does for a stage (framework adapters,
streams, ONNX Runtime IO binding, the read-only rule of ``exchange.frameworks``) holds
there too. The driver sends a batch to the first actor and hands each actor's result
(an ``ObjectRef``) to the next one: the data moves actor to actor through the node's
object store (or, for stages on device memory, Ray Direct Transport with the
``exchange.ray.transport`` transport), never through the driver, and consecutive
batches overlap across the actors (``max_in_flight`` batches at once). The final outputs come back to the driver as tx
Tensors over the object store (read-only; their records hold the objects,
``exchange.ray.objects``). With ``RayExecutor(compiled=True)`` the actors form one Ray
Compiled Graph instead, and batches go through its channels (``exchange.ray.compiled``:
what changes there, hops and faults included).

Hops. Every hop of ``ChainResult.hops`` has ``transport``: ``"ray-object-store"`` (the
producer's output is written once into the store by Ray's serialization, and every
process on the node reads it there), the mode Ray Direct Transport used (its IPC,
shared-memory or NIXL mode, as ``exchange.ray.objects.transport`` names them), or
``"host-copy"`` (through host memory: a copy). ``shared`` is
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

The code, by concept: this module (the executor and its options),
``exchange.ray.runner`` (the driver's side of a run: actors, batches, faults),
``exchange.ray.stage_actor`` (a stage in its actor), ``exchange.ray.packets`` (a batch
between actors and its hops), ``exchange.ray.placement`` (devices, nodes, resources).

Ray APIs used: ``ray.remote`` actor classes with ``.options(...)`` (``num_cpus``,
``num_gpus``, ``resources``, ``enable_tensor_transport``), ``ray.get`` with a timeout,
``ray.exceptions.RayTaskError`` / ``RayActorError`` (``actor_id``) / ``GetTimeoutError``,
``ray.kill``. Checked with Ray 2.60.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..chain import Stage
from ..device import Device
from .objects import require_ray
from .placement import on_device_memory
from .runner import _ActorChain
from .stage_actor import InActor

__all__ = ["RayExecutor", "InActor", "start_executor"]


class RayExecutor:
    """How ``tx.Chain(stages, executor=tx.RayExecutor(...))`` runs its stages on Ray
    actors (``executor="ray"`` is ``RayExecutor()``). One executor may serve several
    chains; each chain starts actors of its own.

    ``resources``: per stage, the Ray options of its actor (``num_cpus``, ``num_gpus``,
    ``memory``, ``resources``, ...), as a dict keyed by stage name or index, or a list
    in stage order (ValueError for a name no stage has, or several stages have). A stage
    on device memory (memory the host cannot read in place: a GPU's) with no
    ``num_gpus`` gets ``1 / (number of such stages)``: they share one GPU.
    ``actor_options``: Ray options for every actor (e.g. ``scheduling_strategy``,
    ``runtime_env``, ``max_restarts``); a stage's ``resources`` win over them.
    ``max_in_flight``: batches in the actors at once (default: the number of stages,
    at least 2).
    ``tensor_transport``: ``"auto"`` (the object store for host stages, Ray Direct
    Transport with ``exchange.ray.transport`` for stages on device memory), ``"object-store"`` or
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
    that cannot be one (stages on device memory, ``tensor_transport="tx"``) runs on actor
    tasks, and ``ChainResult.executor_reason`` says why. Off by default: Ray's Compiled
    Graphs are its experimental API, and the idle polling is a cost a chain kept between
    runs should opt into.

    Devices: a stage's device is named as its actor sees it; Ray makes the GPUs it gives
    an actor visible from ordinal 0 on.

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
        on_gpu = [k for k, s in enumerate(stages) if on_device_memory(s, device)]
        out = []
        for k, opts in enumerate(per):
            merged = {**self.actor_options, **opts}
            if k in on_gpu:
                merged.setdefault("num_gpus", 1.0 / len(on_gpu))
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
