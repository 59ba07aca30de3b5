"""``tx.RayExecutor(compiled=True)``: a chain's actors as one Ray Compiled Graph.

Ray Compiled Graphs (``ray.dag``: ``InputNode``, ``.bind``, ``experimental_compile``)
run a fixed graph of actor methods over channels set up once: a call costs a write
and a read of shared memory per hop instead of a task submission through the raylet
(a 3-stage chain of 1 KiB batches: 0.8-1.9 ms a batch on this 2-core machine against
about 5 ms as ordinary actor tasks). A chain is such a graph: stage 0's actor reads the
driver's input channel, each actor writes the next one's, the last writes the driver's
output channel. Ray writes each batch into a channel by its serializer (for tx Tensors,
this package's, ``exchange.ray.objects``: one copy into the channel), and the reader
gets it over the channel's memory.

Channel memory is rewritten. A channel has ``max_in_flight`` buffers, and Ray writes a
later batch into one as soon as its reader has read the next (Ray 2.60's
``BufferedSharedMemoryChannel``); a driver that keeps results over it stalls the graph
(``RayChannelTimeoutError`` after ``max_in_flight`` calls), and an actor that keeps
its input reads another batch later. Nor may anything read a channel after
``teardown()`` unmaps it (SIGSEGV at exit, measured with NumPy results kept). So every
tensor is copied out of its channel as it is read (:func:`from_wire`): the stage
gets its input in its actor's own memory, and ``Chain.run`` returns outputs in the
driver's, owned by their records like any other tensor; a hop through a channel says
so (``transport`` ``"ray-compiled-channel"``, ``shared`` false with the reason). The
copy costs little beside a hop (1 KiB: a few µs against hundreds).

Where a chain cannot be one (:func:`why_not`): stages on device memory the host cannot read (CUDA), or
``tensor_transport="tx"``: those go through Ray Direct Transport, which compiled graphs
do not carry (their GPU channels move ``torch.Tensor`` over NCCL between actors on
distinct GPUs); the chain then runs on ordinary actor tasks and every ``ChainResult``
says why (``executor_reason``).

Costs Ray imposes, measured here with Ray 2.60: compiling takes 0.1 s and the first
execution 3-9 s (done once, when the chain starts: :class:`CompiledGraph` runs a
warm-up batch); each actor of a compiled graph polls its channel while idle (about 65 %
of a core each here), until ``Chain.close()`` or the chain is collected;
``teardown()`` without ``kill_actors=True`` can hang for minutes, so this always kills
the actors.

Faults. A stage that raises: its error travels down the graph as the batch's value,
``tx.StageError`` naming the stage, and the graph goes on, once the batches in flight
behind it are taken (``_SETTLE_S``). Ray never releases a result whose ``get`` did not
end (timed out, interrupted) and counts it in flight for good, so where one did (a
batch behind the failed one slower than that, Ctrl-C) the graph goes as below. An actor that dies or a
batch past ``timeout_s``: the graph cannot go on without that actor, so it is torn
down with all its actors, ``tx.StageError`` names the stage (the one whose actor no
longer answers, or the one inside its function longest: each actor answers
``busy()`` from Ray's default concurrency group while the graph's loop runs in
``_ray_system``), and the next ``run`` starts the actors and compiles anew.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..device import Device
from ..tensor import Tensor, from_dlpack
from .objects import _host_readable, set_transport

__all__ = ["CHANNEL", "COPIED", "CompiledGraph", "from_wire", "to_wire", "why_not"]

#: ``transport`` of a hop through a Compiled Graph channel.
CHANNEL = "ray-compiled-channel"
COPIED = ("copied out of its Compiled Graph channel, whose buffer Ray rewrites with a later batch "
          "(nothing may keep a view of it)")
#: Seconds the fault probes wait for the actors to answer.
_PROBE_S = 5.0


def why_not(stages: list[Any], device: Device, direct: bool) -> str | None:
    """Why a chain of ``stages`` cannot run as a Compiled Graph; None when it can."""
    on_device = [s.name for s in stages if not _host_readable(s.device or device)]
    if on_device:
        return (f"stages {', '.join(map(repr, on_device))} are on a device whose memory the host cannot read: "
                "their tensors go by Ray Direct Transport, which Compiled Graphs do not carry (their GPU channels "
                "move torch.Tensor over NCCL between actors on distinct GPUs); ran on Ray actor tasks")
    if direct:
        return ("tensor_transport='tx' sends tensors by Ray Direct Transport, which Compiled Graphs do not carry; "
                "ran on Ray actor tasks (use tensor_transport='auto' for the compiled graph)")
    return None


def to_wire(tensors: list[Tensor]) -> list[Any]:
    """The tensors as Ray writes them fastest into a channel: NumPy views over them
    (Ray's own pickle-5 path: the bytes as one out-of-band buffer, no copy here); a
    tensor NumPy cannot view (a dtype it lacks, such as bfloat16) goes as itself, by
    this package's serializer."""
    out: list[Any] = []
    for t in tensors:
        try:
            out.append(np.from_dlpack(t))
        except (BufferError, TypeError, ValueError, RuntimeError):
            out.append(t)
    return out


def from_wire(values: list[Any], note: bool = True) -> list[Tensor]:
    """The tensors read from a channel (:func:`to_wire`'s values over the channel's
    memory), each copied into this process's memory; then ``values`` is emptied, so
    nothing here keeps the channel's buffer. ``note``: note on each record the transport
    and why it copied (``exchange.ray.objects.transport``; the driver's outputs: a stage
    inside the graph reports its hops by what it says, not by its records)."""
    tensors = [from_dlpack(v.copy()) if isinstance(v, np.ndarray) else from_dlpack(v, copy=True) for v in values]
    values.clear()
    if note:
        for t in tensors:
            set_transport(t, CHANNEL, COPIED)
    return tensors


class CompiledGraph:
    """The actors of a chain, in stage order, compiled into one graph of their
    ``run_compiled`` methods (``max_in_flight`` batches at once), warmed up by one
    execution that carries no batch (bounded by ``start_timeout_s``).

    What travels between them (the "wire"): ``(kind, names, values, trace_batch,
    times, said)``: the batch's form (``"one"``, ``"tuple"``, ``"dict"`` and its
    names), its tensors by :func:`to_wire`, its number in the driver's trace (-1:
    none), and per stage run so far one entry in ``times``, ``(ms, peak_live_bytes)``,
    and one in ``said``, ``(inputs, outputs)``: ``inputs`` ``(nbytes, shared,
    reason)`` for each input as the stage took it and ``outputs`` ``(shared, reason)``
    for each output as it left. ``said`` repeats batch to batch, so the driver keys
    the hops it makes of it on ``said`` itself. Plain tuples of plain values: the
    actors' own dataclass of hop dicts, sent instead, made a call about 0.25 ms slower
    (3 hops, 1 KiB, one measurement).
    """

    def __init__(self, ray: Any, actors: list[Any], max_in_flight: int, start_timeout_s: float) -> None:
        from ray.dag import InputNode

        self.ray = ray
        self.actors = list(actors)
        with InputNode() as source:
            node = source
            for actor in self.actors:
                node = actor.run_compiled.bind(node)
        self.dag = node.experimental_compile(_max_inflight_executions=max_in_flight)
        try:
            ray.get(self.dag.execute(None), timeout=start_timeout_s)  # None: the warm-up, passed along
        except BaseException:
            self.teardown(kill_first=True)
            raise

    def submit(self, packet: Any) -> Any:
        """Start one batch; its ``CompiledDAGRef``."""
        return self.dag.execute(packet)

    def get(self, ref: Any, timeout_s: float | None) -> Any:
        """What the last stage wrote for the batch (its tensors still over the output
        channel: take them with :func:`from_wire` before the next ``get``)."""
        return self.ray.get(ref, timeout=timeout_s)

    def dead(self) -> list[int]:
        """The indices of the actors that no longer answer (dead, or gone with their node)."""
        refs = [a.__ray_ready__.remote() for a in self.actors]
        gone = []
        deadline = time.monotonic() + _PROBE_S
        for k, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                gone.append(k)
        return gone

    def busiest(self) -> int | None:
        """The index of the actor inside its stage function longest (None: none is)."""
        best, longest = None, -1.0
        for k, actor in enumerate(self.actors):
            try:
                seconds = self.ray.get(actor.busy.remote(), timeout=_PROBE_S)
            except Exception:
                return k  # it does not answer: that one is stuck
            if seconds is not None and seconds > longest:
                best, longest = k, seconds
        return best

    def teardown(self, kill_first: bool = False) -> None:
        """Stop the graph and kill its actors: Ray's ``teardown(kill_actors=True)`` (its
        plain ``teardown()`` can hang for minutes). ``kill_first``: kill the actors
        before, for a graph that failed: Ray's teardown first waits up to 30 s
        (``RAY_CGRAPH_teardown_timeout``) for an actor inside a stage that hangs, and
        an actor already dead ends its loop at once. Ray then logs each killed actor's
        loop as an error ("Error cancelling worker task"), expected here: those lines
        are kept out of the log. Idempotent; never raises."""
        dag, self.dag = getattr(self, "dag", None), None
        if dag is None:
            return
        log = logging.getLogger("ray.dag.compiled_dag_node")
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            if kill_first:
                for actor in self.actors:
                    try:
                        self.ray.kill(actor, no_restart=True)
                    except Exception:  # already gone
                        pass
            dag.teardown(kill_actors=True)
        except Exception:
            pass
        finally:
            log.setLevel(level)
