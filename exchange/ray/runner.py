"""The driver's side of a Ray chain (``_ActorChain``): it starts the stages' actors,
streams batches through them (as actor tasks, or as one Ray Compiled Graph), collects
the outputs and hops, turns Ray's faults into ``tx.StageError`` naming the stage, and
drops what a failed run held. ``exchange.ray.executor``'s module docstring says what a
run gives and how each fault shows.
"""

from __future__ import annotations

import gc
import re
import time
import weakref
from collections import deque
from typing import Any, Iterable, NoReturn

from .. import tracing as _tracing
from ..chain import ChainResult, Stage, StageError, _progress, _with_room
from ..device import Device
from ..registry import registry
from ..tensor import Tensor, from_dlpack
from .compiled import CHANNEL, COPIED, CompiledGraph, from_wire, to_wire, why_not
from .objects import require_ray
from .packets import _batch_of, _hop, _Packet, _packet_of, _parts_of, _transport_hop
from .placement import _lacking, _node_id, _resources_missing, on_device_memory, stage_device
from .stage_actor import _StageActor

_REG = registry()
#: Seconds a failed run waits for the results of the batches still in flight (``_settle``).
_SETTLE_S = 2.0


class _ActorChain:
    """A chain's stages on their actors; made by :meth:`RayExecutor.start` (``executor``:
    that RayExecutor, read for its options)."""

    def __init__(self, executor: Any, stages: list[Stage], device: Device) -> None:
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
        on_gpu = any(on_device_memory(s, device) for s in stages)
        self.direct = executor.tensor_transport == "tx" or (executor.tensor_transport == "auto" and on_gpu)
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
        self._names = [s.name for s in self.stages]
        self._unique_names = len(set(self._names)) == len(self._names)
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
                self.actors[k] = self._cls.options(**opts).remote(stage, k, str(stage_device(stage, self.device)),
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
            return self.graph.submit((kind, names, to_wire(tensors), trace_batch, (), ()))
        finally:
            tensors.clear()  # a traceback keeps this frame: keep no tensor in it

    def _retire(self, refs: list[Any], result: ChainResult, peaks: dict[str, int]) -> None:
        if self.compiled:
            self._take_compiled(self._collect_compiled(refs[0]), result, peaks)
        else:
            self._account(self._collect(refs), result, peaks)

    def _collect_compiled(self, ref: Any) -> tuple:
        """What the compiled graph's last stage wrote for a batch (the wire form of
        ``exchange.ray.compiled.CompiledGraph``, its tensors still over the output
        channel); its faults as StageError (module docstring of ``exchange.ray.compiled``)."""
        ray = self.ray
        timeout_s = self.executor.timeout_s
        try:  # None: as long as it takes (Ray's own None is its 10 s RAY_CGRAPH_get_timeout)
            return self.graph.get(ref, -1 if timeout_s is None else timeout_s)
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

    def _take_compiled(self, wire: tuple, result: ChainResult, peaks: dict[str, int]) -> None:
        """A batch the compiled graph finished, into ``result`` as :meth:`_account` puts
        a packet from actor tasks: its tensors copied out of the output channel, its hops
        (the last one, into the driver, too), stage times and peaks from what each stage
        said (``exchange.ray.compiled.CompiledGraph``). A batch's hops follow from what
        the stages said of their inputs and outputs and from the outputs' sizes, which
        repeat batch to batch: they are made once per such key and copied for each batch.
        This runs on the driver per batch, on the graph's critical path beside actors
        that poll, so it goes straight from the wire into ``result`` (no packet)."""
        kind, names, values, trace_batch, times, said = wire
        key = (said, tuple([v.nbytes for v in values]))
        tensors = from_wire(values)
        made = self._hop_memo.get(key)
        if made is None:
            if len(self._hop_memo) >= 4096:
                self._hop_memo.clear()
            made = self._hop_memo[key] = self._channel_hops(said, tensors)
        hops = [dict(hop) for hop in made[0]]
        if trace_batch >= 0:
            self._traced_hops.append((trace_batch, hops, list(made[1])))
        if not result.hops:
            result.hops = hops
        result.batch_hops.append(hops)
        stage_ms = result.stage_ms
        if self._unique_names:
            for (spent, peak), name in zip(times, self._names):
                stage_ms[name] += spent
                if peak > peaks.get(name, 0):
                    peaks[name] = peak
        else:  # stages that share a name: times summed, the batch's peak the last one's (as on actor tasks)
            last: dict[str, int] = {}
            for (spent, peak), name in zip(times, self._names):
                stage_ms[name] += spent
                last[name] = peak
            for name, peak in last.items():
                peaks[name] = max(peaks.get(name, 0), peak)
        result.outputs.append(_batch_of(kind, names, tensors))

    def _channel_hops(self, said: tuple, outputs: list[Tensor]) -> tuple[list[dict[str, Any]], list[int]]:
        """A batch's hops through the graph's channels, from ``said`` (each stage's
        ``(taken, left)``) and the driver's ``outputs``, and the stage each hop is
        reported on."""
        hops: list[dict[str, Any]] = []
        stages: list[int] = []
        left: tuple = ((True, None),) * (len(said[0][0]) if said else 0)  # the driver's input: as given
        last = len(said)
        for k in range(last + 1):
            taken = said[k][0] if k < last else tuple((int(t.nbytes), True, None) for t in outputs)
            for took, out in zip(taken, left):
                hops.append(self._channel_hop(k, took, out))
                stages.append(min(k, last - 1))
            if k < last:
                left = said[k][1]
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
