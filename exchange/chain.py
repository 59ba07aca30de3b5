"""Multi-model chaining across frameworks: ``tx.Chain([tx.Stage(...), ...])``.

Between stages tensors move through DLPack, zero-copy, with the consumer's stream;
intermediates are registry records released in stream order as soon as the next stage
has taken them; the final outputs are registry records that stay valid after the chain,
the models and their sessions are gone.

Execution. On CUDA every stage may have its own stream: stages are called one after the
other on the host, and the DLPack handshake (event record on the producer's stream, wait
on the consumer's) orders the GPU work; the host never synchronises. On the CPU every
stage runs on its own host stream (a worker thread) with cross-stream waits, so stage k
of batch n+1 runs while stage k+1 of batch n runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .device import Device, DeviceType
from .errors import ExchangeError
from .frameworks import IGNORES_READ_ONLY, get_adapter
from .frameworks.onnxruntime_adapter import is_session
from .registry import registry
from .tensor import Tensor, create_stream, from_dlpack, record_stream

__all__ = ["Stage", "Chain", "ChainResult", "StageError"]

_REG = registry()


class StageError(ExchangeError):
    """A stage's function raised; the message names the stage, ``__cause__`` is the error."""


class Stage:
    """One model or function in a chain.

    ``fn``: called with the stage's inputs as the framework's arrays (positionally, or as
    keyword arguments when the previous stage returned a dict); returns an array, a
    tuple of arrays or a dict of arrays, anything with ``__dlpack__``. For
    ``framework="onnxruntime"`` ``fn`` may be an ``InferenceSession``, run through IO
    binding (inputs bound by the model's input names).
    ``framework``: ``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``, ``"tvm_ffi"``,
    ``"onnxruntime"``. ``name``: for timings and errors (default: the function's name).
    ``device``: where the stage runs (default: the chain's). ``stream``: the stream the
    stage runs on (default: a new one per stage). ``out``: output memory the caller
    provides (a tx.Tensor, or a sequence of them): ONNX Runtime writes into it through IO
    binding, other frameworks get it as ``out=`` and must write into it; the stage's
    outputs are then those very Tensors (no copy). A stage with ``out`` runs one batch at
    a time, since every batch writes the same memory.
    """

    def __init__(self, fn: Any, *, framework: str, name: str | None = None, device: Any = None,
                 stream: Any = None, out: Tensor | Sequence[Tensor] | None = None) -> None:
        if not callable(fn) and not is_session(fn):
            raise TypeError(f"stage function must be callable (or an ONNX Runtime session), got {type(fn).__name__}")
        self.fn = fn
        self.framework = framework
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.device = None if device is None else Device.parse(device)
        self.stream = stream
        if out is None:
            self.out: list[Tensor] | None = None
        else:
            outs = [out] if isinstance(out, Tensor) else list(out)
            for o in outs:
                if not isinstance(o, Tensor):
                    raise TypeError(f"stage {self.name!r}: out= takes tx Tensors (tx.empty), got {type(o).__name__}")
                if o.readonly:
                    raise ValueError(f"stage {self.name!r}: out= buffer is read-only; pass writable memory (tx.empty)")
            self.out = outs

    def __repr__(self) -> str:
        return f"Stage({self.name!r}, framework={self.framework!r})"


@dataclass
class ChainResult:
    """What ``Chain.run`` returns: ``outputs`` (one entry per batch: a tx.Tensor, a tuple
    or a dict of them), ``hops`` (the first batch's hops: from, to, bytes, shared; shared
    means the producer's, the tx Tensor's and the consumer's data pointers are one address,
    where the producer's is known), ``batch_hops`` (every batch's hops, in batch order),
    ``stage_ms`` (stage name -> total milliseconds in the stage's function, all batches),
    ``peak_live_bytes`` (most bytes the registry held at once during the run),
    ``wall_ms`` (milliseconds for the whole run). Every hop also has ``transport``
    (``"in-process"`` here; across Ray actors see ``exchange.ray_executor``) and, when not
    shared, ``reason``. ``executor``: ``"in-process"`` or ``"ray"``; ``live_records``:
    with ``executor="ray"``, live registry records per process at the end of the run
    (``"driver"``, which counts the outputs, and each stage's actor)."""

    outputs: list[Any] = field(default_factory=list)
    hops: list[dict[str, Any]] = field(default_factory=list)
    batch_hops: list[list[dict[str, Any]]] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=dict)
    peak_live_bytes: int = 0
    wall_ms: float = 0.0
    executor: str = "in-process"
    live_records: dict[str, int] = field(default_factory=dict)


class _Slot:
    """One batch in flight: its current tensors, their producer's data pointers (None:
    unknown), its hops, its error."""

    __slots__ = ("kind", "values", "ptrs", "hops", "error", "done")

    def __init__(self, kind: str, values: Any) -> None:
        self.kind = kind
        self.values = values
        self.ptrs: list[int | None] = [None] * len(values)
        self.hops: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.done: Any = None


class Chain:
    """Run stages written for different frameworks one after another (DESIGN.md,
    "Chaining").

    ``device``: the default device of the stages (default ``"cpu"``).
    ``max_in_flight``: batches in flight at once on the CPU (host streams); 1 runs the
    stages inline on the calling thread (no host streams, least overhead per batch).
    ``executor``: None runs the stages in this process; ``"ray"`` (or a
    ``tx.RayExecutor(...)`` with options) runs each stage on its own Ray actor
    (``exchange.ray_executor``; ``close()`` ends the actors).

    A stage whose framework ignores DLPack's READ_ONLY flag (``IGNORES_READ_ONLY`` in
    ``exchange.frameworks``: PyTorch, CuPy) gets a copy of memory that is truly read-only
    (mutability ``"readonly"``: Ray's object store, a read-only NumPy array, a JAX
    array); its hop reports ``shared: false`` and the reason. Memory of unknown
    mutability (ONNX Runtime's legacy capsules) is handed over as it is.

    Raises BackendUnavailableError naming the package when a stage's framework is not
    installed, ValueError for an output buffer of the wrong shape or dtype, both before
    anything runs.
    """

    def __init__(self, stages: Sequence[Stage], *, device: Any = None, max_in_flight: int = 2,
                 executor: Any = None) -> None:
        stages = list(stages)
        if not stages:
            raise ValueError("a chain needs at least one stage")
        for s in stages:
            if not isinstance(s, Stage):
                raise TypeError(f"Chain takes tx.Stage objects, got {type(s).__name__}")
        self.stages = stages
        self.device = Device.parse(device) if device is not None else (stages[0].device or Device.parse("cpu"))
        self._executor = None
        if executor is not None and executor != "in-process":
            self._start_executor(executor)
            return
        self._adapters = [get_adapter(s.framework) for s in stages]
        for s, adapter in zip(stages, self._adapters):
            if s.out and s.framework == "onnxruntime" and is_session(s.fn):
                try:
                    adapter.check_out(s.fn, s.out)
                except ValueError as exc:
                    raise ValueError(f"stage {s.name!r}: {exc}") from None
        self._own_streams: list[Any] = []
        # CPU: host streams pipeline consecutive batches; with max_in_flight=1 (or caller
        # output buffers) there is nothing to overlap, so stages run inline on the caller's
        # thread, with no host stream and no thread hand-off.
        self._pipelined = (self.device.type == DeviceType.kDLCPU and max_in_flight > 1
                           and not any(s.out for s in stages))
        inline_cpu = self.device.type == DeviceType.kDLCPU and not self._pipelined
        self._streams = [s.stream if inline_cpu else self._stream_for(s) for s in stages]
        self.max_in_flight = max(1, max_in_flight) if self._pipelined else 1
        self._closed = False

    def _start_executor(self, executor: Any) -> None:
        from .ray_executor import start_executor  # Ray only where asked for

        self._adapters, self._own_streams, self._streams = [], [], []
        self._pipelined, self.max_in_flight, self._closed = False, 1, False
        self._executor = start_executor(executor, self)

    def _stream_for(self, stage: Stage) -> Any:
        if stage.stream is not None:
            return stage.stream
        stream = create_stream(stage.device or self.device)
        self._own_streams.append(stream)
        return stream

    # -- running -------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """Run one batch; returns its outputs (a tx.Tensor, tuple or dict of them)."""
        batch = named if named else (inputs[0] if len(inputs) == 1 else inputs)
        return self.run([batch]).outputs[0]

    def run(self, batches: Iterable[Any], *, progress: bool = False) -> ChainResult:
        """Stream an iterable of batches through the stages. A batch is an array (anything
        with ``__dlpack__``), a tuple of arrays or a dict of arrays. ``progress``: show a
        progress bar (rich or tqdm, when installed)."""
        if self._closed:
            raise RuntimeError("this chain is closed")
        if self._executor is not None:
            return self._executor.run(batches, progress=progress)
        result = ChainResult(stage_ms={s.name: 0.0 for s in self.stages})
        _REG.reset_peak()
        start = time.perf_counter()
        in_flight: deque[_Slot] = deque()
        try:
            for batch in _progress(batches, progress):
                slot = self._take(batch)
                if self._pipelined:
                    self._submit(slot, result)
                    in_flight.append(slot)
                    while len(in_flight) >= self.max_in_flight + 1:
                        self._retire(in_flight.popleft(), result)
                else:
                    for k in range(len(self.stages)):
                        self._stage(k, slot, result)
                    self._finish(slot, result)
            while in_flight:
                self._retire(in_flight.popleft(), result)
        finally:
            for slot in in_flight:  # an error: let the others finish, drop their tensors
                if slot.done is not None:
                    slot.done.synchronize()
                slot.values = None
            result.peak_live_bytes = _REG.end_peak()
        result.wall_ms = (time.perf_counter() - start) * 1e3
        return result

    def _take(self, batch: Any) -> _Slot:
        stream = self._streams[0]
        if isinstance(batch, dict):
            return _Slot("dict", {k: _take_one(v, stream) for k, v in batch.items()})
        if isinstance(batch, (tuple, list)):
            return _Slot("tuple", [_take_one(v, stream) for v in batch])
        return _Slot("one", [_take_one(batch, stream)])

    def _submit(self, slot: _Slot, result: ChainResult) -> None:
        previous = None
        for k, stream in enumerate(self._streams):
            if previous is not None:
                stream.wait(previous)
            stream.submit(self._stage, k, slot, result)
            previous = stream.record()
        slot.done = previous

    def _retire(self, slot: _Slot, result: ChainResult) -> None:
        slot.done.synchronize()
        self._finish(slot, result)

    def _finish(self, slot: _Slot, result: ChainResult) -> None:
        if slot.error is not None:
            error, slot.error = slot.error, None
            raise error
        if not result.hops:
            result.hops = slot.hops
        result.batch_hops.append(slot.hops)
        values, slot.values = slot.values, None
        if slot.kind == "one":
            result.outputs.append(values[0])
        elif slot.kind == "dict":
            result.outputs.append(dict(values))
        else:
            result.outputs.append(tuple(values))

    def _stage(self, k: int, slot: _Slot, result: ChainResult) -> None:
        if slot.error is not None:
            return
        try:
            slot.kind, slot.values = self._run_stage(k, slot, result)
        except BaseException as exc:
            slot.error = exc
            slot.values = None  # drop the intermediates now; their release is stream-ordered

    def _run_stage(self, k: int, slot: _Slot, result: ChainResult) -> tuple[str, Any]:
        stage, adapter, stream = self.stages[k], self._adapters[k], self._streams[k]
        before = self.stages[k - 1].framework if k else "input"
        names = list(slot.values) if slot.kind == "dict" else None
        # Views ordered on this stage's stream (the cross-stream wait already ran), so the
        # release of each record also waits for this stage's work.
        values = slot.values.values() if names else slot.values
        tensors = list(values) if stream is None else [from_dlpack(t, stream=stream) for t in values]
        reasons = _read_only_copies(tensors, stage.framework, stream) if stage.framework in IGNORES_READ_ONLY else None
        try:
            arrays = [adapter.to_framework(t, stream) for t in tensors]
        except Exception as exc:
            raise StageError(f"stage {k} {stage.name!r} ({stage.framework}) could not take its input "
                             f"from {before}: {type(exc).__name__}: {exc}") from exc
        for i, (t, a, p) in enumerate(zip(tensors, arrays, slot.ptrs)):
            slot.hops.append(_hop(before, stage.framework, t, adapter.data_ptr(a), p, reasons and reasons[i]))
        t0 = time.perf_counter()
        try:
            if stage.framework == "onnxruntime" and is_session(stage.fn):
                feed = dict(zip(names or [i.name for i in stage.fn.get_inputs()], arrays))
                raw = adapter.run_session(stage.fn, feed, stage.out)
            else:
                out = [adapter.to_framework(o, stream) for o in stage.out] if stage.out else None
                if names:
                    raw = adapter.call(stage.fn, [], dict(zip(names, arrays)), out, stream)
                else:
                    raw = adapter.call(stage.fn, arrays, {}, out, stream)
        except Exception as exc:
            raise StageError(f"stage {k} {stage.name!r} ({stage.framework}) failed: {type(exc).__name__}: {exc}") from exc
        finally:
            result.stage_ms[stage.name] += (time.perf_counter() - t0) * 1e3
        del arrays
        return self._outputs(k, raw, slot)

    def _outputs(self, k: int, raw: Any, slot: _Slot) -> tuple[str, Any]:
        stage, adapter, stream = self.stages[k], self._adapters[k], self._streams[k]
        if isinstance(raw, dict):
            kind, items = "dict", list(raw.items())
        elif isinstance(raw, (tuple, list)):
            kind, items = "tuple", list(enumerate(raw))
        else:
            kind, items = "one", [(0, raw)]
        if stage.out:
            if len(items) != len(stage.out):
                raise ValueError(f"stage {stage.name!r} returned {len(items)} outputs for {len(stage.out)} out buffers")
            for (key, value), buf in zip(items, stage.out):
                if value is not buf and adapter.data_ptr(value) != buf.data_ptr:
                    raise ValueError(f"stage {stage.name!r} did not write into the out buffer given for output {key!r}")
                if stream is not None:
                    record_stream(buf, stream)
            outs = list(stage.out)
            slot.ptrs = [buf.data_ptr for buf in outs]
        else:
            outs = []
            slot.ptrs = [adapter.data_ptr(value) for _, value in items]
            for key, value in items:
                if not hasattr(value, "__dlpack__") and not isinstance(value, Tensor):
                    raise TypeError(
                        f"stage {k} {stage.name!r} ({stage.framework}) returned {type(value).__name__} for output "
                        f"{key!r}, which has no __dlpack__; return the framework's arrays"
                    )
                try:
                    outs.append(adapter.from_framework(value, stream))
                except Exception as exc:  # e.g. PyTorch refusing a tensor that requires grad
                    raise StageError(f"stage {k} {stage.name!r} ({stage.framework}) returned output {key!r} that "
                                     f"could not be taken: {type(exc).__name__}: {exc}") from exc
                if k == len(self.stages) - 1:
                    slot.hops.append(_hop(stage.framework, "tx", outs[-1], adapter.data_ptr(value)))
        if kind == "dict":
            return kind, dict(zip([key for key, _ in items], outs))
        return kind, outs

    def close(self) -> None:
        """Finish queued work and stop the chain's own streams (with ``executor="ray"``:
        end the actors). Outputs stay valid."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.close()
        for stream in self._own_streams:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            else:
                stream.synchronize()
        self._own_streams.clear()
        self.stages = []
        self._adapters = []

    def __enter__(self) -> "Chain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _take_one(x: Any, stream: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    return from_dlpack(x, stream=stream)


def _hop(src: str, dst: str, t: Tensor, ptr: int | None, producer_ptr: int | None = None,
         reason: str | None = None) -> dict[str, Any]:
    shared = (reason is None and ptr is not None and ptr == t.data_ptr
              and (producer_ptr is None or producer_ptr == t.data_ptr))
    hop = {"from": src, "to": dst, "bytes": t.nbytes, "shared": shared, "transport": "in-process"}
    if not shared:
        hop["reason"] = reason or _not_shared_because(src, dst, t, ptr, producer_ptr)
    return hop


def _not_shared_because(src: str, dst: str, t: Tensor, ptr: int | None, producer_ptr: int | None) -> str:
    if producer_ptr is not None and producer_ptr != t.data_ptr:
        return f"the output of {src} was copied on its way into tx"
    if ptr is None:
        return f"{dst} does not say where its data is, so sharing cannot be checked"
    return f"{dst} copied the data when it took it"


def _read_only_copies(tensors: list[Tensor], framework: str, stream: Any) -> list[str | None] | None:
    """Replace, in ``tensors``, each truly read-only one by a copy (the stage's framework
    ignores READ_ONLY and could write into it); the reasons for the hops, or None."""
    reasons: list[str | None] | None = None
    for i, t in enumerate(tensors):
        if t.mutability == "readonly":
            tensors[i] = from_dlpack(t, copy=True, stream=stream)
            if reasons is None:
                reasons = [None] * len(tensors)
            reasons[i] = (f"read-only memory ({t.record.origin}) copied for {framework}, which ignores "
                          "DLPack's READ_ONLY flag")
    return reasons


def _progress(batches: Iterable[Any], enabled: bool) -> Iterable[Any]:
    if not enabled:
        return batches
    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    try:
        from tqdm import tqdm

        return tqdm(batches, total=total, desc="chain", unit="batch")
    except ImportError:
        pass
    try:
        from rich.progress import track

        return track(batches, total=total, description="chain")
    except ImportError:
        return batches
