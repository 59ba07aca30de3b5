"""Multi-model chaining across frameworks: ``tx.Chain([tx.Stage(...), ...])``.

Between stages tensors move through DLPack, zero-copy, with the consumer's stream;
intermediates are registry records released in stream order as soon as the next stage
has taken them; the final outputs are registry records that stay valid after the chain,
the models and their sessions are gone.

Execution. On a GPU every stage may have its own stream: stages are called one after the
other on the host, and the DLPack handshake (event record on the producer's stream, wait
on the consumer's) orders the GPU work; the host never synchronises. On the CPU every
stage runs on its own host stream (a worker thread): the stage's task, once done, queues
the batch's next stage on the next stage's stream (or runs it at once when that is the
same stream), so stage k of batch n+1 runs while stage k+1 of batch n runs. A stage uses
its inputs only inside its own task and drops them there after its function returned,
so their release follows the stage's work on that stream with no event to record.
With ``max_in_flight=1`` the stages run inline on the caller's thread.

Cost. What a batch pays beyond the DLPack hops themselves is kept small: each stage's
adapter functions, stream and hop templates are worked out once per chain (``_Plan``);
a stage with one input and one output runs a written-out path; pipelined, each stream's
task is made once per run with what it reads bound, a batch goes on through the host
stream's queue in one call (``HostStream.poster``) and the stage's call, hop and time
are one call into the core (``call_stage``), since on the stages' own threads every
step costs about twice what it does inline; NumPy hops are shared by
NumPy's contract (``Adapter.zero_copy``) rather than by reading pointers back with
ctypes; ``Chain.__call__`` builds no report (nothing returns one). ``strict`` decides at
plan time what it can (device changes, frameworks that always copy); per batch it adds
only the pointer reads a report makes anyway, and only to stages whose framework is not
zero-copy by contract (so nothing to a NumPy chain).

Owns: the public types (``Stage``, ``Chain``, ``ChainResult``, ``StageError``, the executor
protocols ``ChainExecutor`` and ``ChainRunner``), the per-stage plan (``_Plan``), a batch in
flight (``_Slot``) and running the stages on it, inline or pipelined. Beside it, by concept:
exchange/chain_hops.py (a batch's tensors into the chain, the hop reports),
exchange/chain_pipeline.py (the tasks a pipelined run's streams run, and how a batch
goes on from one to the next), exchange/chain_copies.py (the copies a stage's input may
need, and strict's refusals of them) and exchange/chain_errors.py (its errors).
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

# The hops and the copies, by concept beside this module: each name imported itself, so a
# batch pays a global lookup for it, as before, not an attribute one.
from .chain_copies import (_aligned_copies, _joined, _read_only_copies, _refuse_given_copies,
                           _refuse_planned_copies, _refuse_taken_copies)
from .chain_errors import StageError, _check_batches, _input_error, _output_error, _stage_failed, _take_failed
from .chain_hops import _check_out, _hop, _hops_in, _hops_out, _take_one, hop_dicts
from .chain_pipeline import first_of, plain_task, poster, stage_task, step_of
from .device import Device, DeviceType
from .frameworks import IGNORES_READ_ONLY, get_adapters
from .devices.base import memory_kind
from .frameworks.base import Adapter
from .frameworks.onnxruntime_adapter import is_session
from . import tracing as _trace
from .registry import registry
from .tensor import Tensor, create_stream, from_dlpack

__all__ = ["Stage", "Chain", "ChainResult", "StageError", "ChainExecutor", "ChainRunner"]

_REG = registry()
#: What a stage may return for several outputs (anything else is one output).
_GROUPS = (dict, tuple, list)
_now = time.perf_counter
_now_ns = time.perf_counter_ns


class Stage:
    """One model or function in a chain.

    ``fn``: called with the stage's inputs as the framework's arrays (positionally, or as
    keyword arguments when the previous stage returned a dict); returns an array, a
    tuple of arrays or a dict of arrays, anything with ``__dlpack__``. For
    ``framework="onnxruntime"`` ``fn`` may be an ``InferenceSession``, run through IO
    binding (inputs bound by the model's input names).
    ``framework``: ``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``, ``"tvm_ffi"``,
    ``"onnxruntime"``, ``"paddle"``, ``"pyarrow"``, ``"tensorflow"``, ``"mlx"`` (what each
    receives: its adapter's docstring in ``exchange.frameworks``).
    ``name``: for timings and errors (default: the function's name).
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
        self.named = name is not None  # chosen by the caller, not the function's name
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
    where the producer's is known; a framework that never copies on either side of a
    DLPack hop by its own contract, NumPy, is taken at its word: ``Adapter.zero_copy``),
    ``batch_hops`` (every batch's hops, in batch order),
    ``stage_ms`` (stage name -> total milliseconds in the stage's function, all batches;
    stages given one name share its entry, and a stage whose default name, its
    function's, is already taken is keyed ``"<name> #<stage index>"``),
    ``peak_live_bytes`` (most bytes the registry held at once during the run),
    ``wall_ms`` (milliseconds for the whole run). Every hop also has ``transport``
    (``"in-process"`` here; across Ray actors see ``exchange.ray.executor``) and, when not
    shared, ``reason``. ``executor``: ``"in-process"``, ``"ray"`` or ``"ray-compiled"``
    (a Ray Compiled Graph; ``executor_reason`` says why one asked for was not); ``live_records``:
    with ``executor="ray"``, live registry records per process (``"driver"``, which counts
    the outputs, and each stage's actor), counted when first read, not by the run: the
    count collects garbage here and in every actor (about 50 ms each with PyTorch
    loaded), which a run does not pay. So it is the processes' state at that read (the
    driver's count is every live record of this process then, other runs' outputs
    included), kept for later reads; read it before ``Chain.close()`` to have the
    actors' counts (after it, the driver's alone). Empty in-process."""

    outputs: list[Any] = field(default_factory=list)
    hops: list[dict[str, Any]] = field(default_factory=list)
    batch_hops: list[list[dict[str, Any]]] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=dict)
    peak_live_bytes: int = 0
    wall_ms: float = 0.0
    executor: str = "in-process"
    #: with ``tx.RayExecutor(compiled=True)``, why the chain ran on Ray actor tasks
    #: instead of a Compiled Graph (None: it did not, or was not asked to)
    executor_reason: str | None = None
    #: the counts, or the function that counts them on first read (set by the executor)
    _live_records: Any = field(default=None, repr=False, compare=False)

    @property
    def live_records(self) -> dict[str, int]:
        if callable(self._live_records):
            self._live_records = self._live_records()
        return dict(self._live_records or {})


class ChainRunner(Protocol):
    """A chain's stages started elsewhere (``ChainExecutor.start``): ``tx.Chain`` hands it
    ``run`` and ``close``."""

    def run(self, batches: Iterable[Any], *, progress: bool = False) -> ChainResult: ...

    def close(self) -> None: ...


class ChainExecutor(Protocol):
    """Where a chain's stages run when not in this process (``tx.RayExecutor``): the one
    interface between ``tx.Chain`` and an executor. This module never imports an
    executor's module (which imports this one): ``executor="ray"`` is found by its public
    name in ``exchange`` (:data:`_NAMED_EXECUTORS`)."""

    def start(self, stages: list[Stage], device: Device) -> ChainRunner: ...


#: ``executor=`` names -> the public name in ``exchange`` of the executor class, made
#: with no arguments (``exchange``'s lazy table loads its module on first use).
_NAMED_EXECUTORS = {"ray": "RayExecutor"}


def _executor_of(executor: Any) -> ChainExecutor:
    """``executor`` as a ChainExecutor: a name of :data:`_NAMED_EXECUTORS`, or an object
    with ``start``. ValueError for an unknown name, TypeError for anything else."""
    if isinstance(executor, str):
        public = _NAMED_EXECUTORS.get(executor)
        if public is None:
            raise ValueError(f"unknown executor {executor!r}; use None (in-process), 'ray' or tx.RayExecutor(...)")
        import exchange

        return getattr(exchange, public)()
    if not callable(getattr(executor, "start", None)):
        raise TypeError(f"executor must be None, 'ray' or a tx.RayExecutor, got {type(executor).__name__}")
    return executor


class _Slot:
    """One batch in flight: ``kind`` ("one", "tuple", "dict"), its current tensors
    (``values``: a list, a dict for "dict"), their producer's data pointers (``ptrs``:
    a list, or None where none is known or needed), its hops (None: no report is
    made), its error; ``done``: a
    lock held until the batch has left its last stage (pipelined runs only: lighter
    than an Event, and released exactly once)."""

    __slots__ = ("kind", "values", "ptrs", "hops", "error", "done", "batch")

    def __init__(self, kind: str, values: Any, hops: list[dict[str, Any]] | None) -> None:
        self.batch = 0  # its number in a trace (flows join its stages by it)
        self.kind = kind
        self.values = values
        self.ptrs: list[int | None] | None = None
        self.hops = hops
        self.error: BaseException | None = None
        self.done: Any = None


class _Plan:
    """What one stage needs per batch, worked out once when the chain is made, so a
    batch pays for no lookups: the functions that hand a tx Tensor to the framework
    (``take``) and take an output back (``give``, bound to the stream the next stage
    runs on when pipelined), the data-pointer check (``ptr``; None where the framework
    never copies by its contract, ``Adapter.zero_copy``), and how to call the stage."""

    __slots__ = ("index", "stage", "fn", "name", "framework", "before", "after", "adapter", "stream", "take", "give",
                 "ptr", "work_stream", "view", "guard_read_only", "align", "import_copies", "strict", "check_ptrs",
                 "session", "direct", "plain", "last", "shared_in", "shared_out")

    def __init__(self, chain: "Chain", k: int, give_stream: Any) -> None:
        stage, adapter, stream = chain.stages[k], chain._adapters[k], chain._streams[k]
        self.index, self.stage, self.fn, self.name, self.framework = k, stage, stage.fn, stage.name, stage.framework
        self.before = chain.stages[k - 1].framework if k else "input"
        self.after = chain.stages[k + 1].framework if k + 1 < len(chain.stages) else "tx"
        self.adapter, self.stream = adapter, stream
        self.take = adapter.to_framework_fn(stream)
        self.give = adapter.from_framework_fn(give_stream)
        self.ptr = None if adapter.zero_copy else adapter.data_ptr
        # Where the stage's own work (a read-only input's copy) is ordered. Pipelined, the
        # stage already runs inside its stream's task: work queued on that stream would run
        # only after the task, so it runs at once instead (no hand-off to the same stream).
        self.work_stream = None if chain._pipelined else stream
        # Inline with a stream (a GPU's): views ordered on this stage's stream, made per
        # batch (the handshake with the previous stage's stream).
        self.view = stream is not None and not chain._pipelined
        self.guard_read_only = stage.framework in IGNORES_READ_ONLY
        self.align = adapter.alignment  # bytes; 0: any address will do
        self.import_copies = (None if adapter.import_copies is None
                              else f"{stage.framework} copies every input it takes: {adapter.import_copies}")
        # strict: refuse copies instead of making them; where the framework is not
        # zero-copy by contract, read each hop's pointers to see whether it copied.
        self.strict = chain.strict
        self.check_ptrs = chain.strict and self.ptr is not None
        self.session = stage.framework == "onnxruntime" and is_session(stage.fn)
        # Every adapter's stream context is empty for host streams (Adapter contract), so
        # with no output buffers the function is called as it is.
        self.direct = (not self.session and not stage.out and _host_stream(stream)
                       and type(adapter).call is Adapter.call)
        # Nothing but the hops and the call: no view, no read-only or alignment guard, no
        # copy to report or pointer to check, called as it is.
        self.plain = (self.direct and not self.view and not self.guard_read_only and not self.align
                      and self.import_copies is None and not self.check_ptrs)
        self.last = k == len(chain.stages) - 1
        # A shared hop, in and (last stage) out, less its bytes: copied per batch.
        self.shared_in = {"from": self.before, "to": stage.framework, "bytes": 0, "shared": True,
                          "transport": "in-process"}
        self.shared_out = {"from": stage.framework, "to": "tx", "bytes": 0, "shared": True, "transport": "in-process"}


def _timing_names(stages: Sequence[Stage]) -> list[str]:
    """The stage_ms keys: each stage's name; a default name (two lambdas, say) that an
    earlier stage has already taken gets the stage's index."""
    names: list[str] = []
    for k, stage in enumerate(stages):
        name = stage.name
        if not getattr(stage, "named", True) and name in names:
            name = f"{name} #{k}"
        names.append(name)
    return names


class Chain:
    """Run stages written for different frameworks one after another (docs/design.md,
    "Chain").

    ``device``: the default device of the stages (default ``"cpu"``).
    ``max_in_flight``: batches in flight at once on the CPU (host streams); 1 runs the
    stages inline on the calling thread (no host streams, least overhead per batch).
    ``executor``: None runs the stages in this process; ``"ray"`` (or a
    ``tx.RayExecutor(...)`` with options) runs each stage on its own Ray actor
    (``exchange.ray.executor``; ``close()`` ends the actors); any :class:`ChainExecutor`
    runs them where it starts them.

    A stage whose framework ignores DLPack's READ_ONLY flag (``IGNORES_READ_ONLY`` in
    ``exchange.frameworks``: PyTorch, CuPy) gets a copy of memory that is truly read-only
    (mutability ``"readonly"``: Ray's object store, a read-only NumPy array, a JAX
    array); its hop reports ``shared: false`` and the reason. Memory of unknown
    mutability (ONNX Runtime's legacy capsules) is handed over as it is. A stage whose
    framework needs aligned memory (``Adapter.alignment``: JAX, 64 bytes) gets
    misaligned input as an aligned copy, and a stage whose framework copies whatever it
    imports (``Adapter.import_copies``) has every hop into it reported as a copy; both
    hops say why.

    ``strict``: True refuses every hop that would copy, before the stage it feeds runs,
    with ValueError naming the hop (from, to, the stage) and why; False (the default)
    lets the chain copy where it must, and the hop reports it (``ChainResult.hops``,
    ``shared: false``, ``reason``; the demo's report and ``tx.trace`` show the same).
    Refused when the chain is made: a stage on another device than the stage before it
    (its input would have to be copied across devices), and a stage whose framework
    always copies on import. Refused per batch, before the stage's function is called:
    truly read-only memory into a framework that ignores READ_ONLY, memory not aligned
    as the framework needs, and a hop whose consumer's array (or producer's output)
    lies at another address than the tx Tensor, a copy the framework made itself
    (PyTorch's of negatively strided input, say). The batches you pass are taken where
    they are: the chain never moves them to a stage's device. Cost: nothing per batch
    for stages whose framework never copies by contract (NumPy); the data-pointer reads
    of ``run``'s report for the others. Not with an ``executor`` (ValueError): a Ray
    chain's hops are made in each stage's actor and by Ray's transports (the object
    store hands read-only memory, a Compiled Graph copies every tensor out of its
    channel), which this flag does not reach; their hops say which copied.

    The stages' functions, frameworks, streams and output buffers are read when the
    chain is made.

    Raises BackendUnavailableError naming the package when a stage's framework is not
    installed, ValueError for an output buffer of the wrong shape or dtype or not aligned
    as its framework needs, and (``strict``) for a hop that copies by the plan, all
    before anything runs; TypeError for a ``strict`` that is not a bool.
    """

    def __init__(self, stages: Sequence[Stage], *, device: Any = None, max_in_flight: int = 2,
                 executor: Any = None, strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self.strict = strict
        stages = list(stages)
        if not stages:
            raise ValueError("a chain needs at least one stage")
        for s in stages:
            if not isinstance(s, Stage):
                raise TypeError(f"Chain takes tx.Stage objects, got {type(s).__name__}")
        self.stages = stages
        self.device = Device.parse(device) if device is not None else (stages[0].device or Device.parse("cpu"))
        self._executor: ChainRunner | None = None
        if executor is not None and executor != "in-process":
            if strict:
                raise ValueError("strict=True is for in-process chains: with an executor, each hop is made in a "
                                 "stage's actor and by Ray's transports, which it does not reach; leave strict off "
                                 "and read ChainResult.hops (shared, reason) to see which hops copied")
            self._start_executor(executor)
            return
        self._adapters = get_adapters([s.framework for s in stages])
        for s, adapter in zip(stages, self._adapters):
            if s.out and s.framework == "onnxruntime" and is_session(s.fn):
                try:
                    adapter.check_out(s.fn, s.out)
                except ValueError as exc:
                    raise ValueError(f"stage {s.name!r}: {exc}") from None
            for o in s.out or ():
                if adapter.alignment and o.data_ptr % adapter.alignment:
                    raise ValueError(f"stage {s.name!r}: out= buffer is not {adapter.alignment}-byte aligned, which "
                                     f"{s.framework} needs; allocate it with tx.empty (64-byte aligned)")
        if strict:
            _refuse_planned_copies(stages, self._adapters, self.device)
        self._own_streams: list[Any] = []
        # CPU: host streams pipeline consecutive batches; with max_in_flight=1 (or caller
        # output buffers) there is nothing to overlap, so stages run inline on the caller's
        # thread, with no host stream and no thread hand-off.
        self._pipelined = (self.device.type == DeviceType.kDLCPU and max_in_flight > 1
                           and not any(s.out for s in stages))
        inline_cpu = self.device.type == DeviceType.kDLCPU and not self._pipelined
        self._streams = [s.stream if inline_cpu else self._stream_for(s) for s in stages]
        self.max_in_flight = max(1, max_in_flight) if self._pipelined else 1
        # Pipelined on host streams, a stage uses its inputs only inside its own task, and
        # drops them there once its function has returned: their release then follows the
        # stage's work on that stream's worker, with no event to record or wait for, so
        # inputs and outputs are taken with no stream.
        gives = [None] * len(stages) if self._pipelined else self._streams
        self._plans = [_Plan(self, k, gives[k]) for k in range(len(stages))]
        # Pipelined: how stage k gets a batch, worked out once (no lookup per hop): its
        # stream's post; None where it shares the stream of stage k - 1 (run at once).
        self._hands = [None if k and self._streams[k] is self._streams[k - 1] else poster(self._streams[k])
                       for k in range(len(stages))] if self._pipelined else []
        self._names = _timing_names(stages)
        self._unique_names = len(set(self._names)) == len(stages)
        self._closed = False
        # NVTX ranges per stage where Nsight can show them beside the kernels: a chain on
        # a GPU, or any chain with EXCHANGE_NVTX=1, and only where nvtx is importable.
        wants_nvtx = (self.device.type != DeviceType.kDLCPU
                      or os.environ.get("EXCHANGE_NVTX", "") not in ("", "0"))
        self._nvtx = _trace.nvtx_module() if wants_nvtx else None
        self._watch: _trace.StageWatch | None = None  # per run: a trace records, or NVTX

    def _start_executor(self, executor: Any) -> None:
        chosen = _executor_of(executor)  # Ray only where asked for
        self._adapters, self._own_streams, self._streams, self._plans, self._names = [], [], [], [], []
        self._unique_names = True
        self._pipelined, self.max_in_flight, self._closed = False, 1, False
        self._nvtx = self._watch = None
        self._executor = chosen.start(self.stages, self.device)

    def _stream_for(self, stage: Stage) -> Any:
        if stage.stream is not None:
            return stage.stream
        stream = create_stream(stage.device or self.device)
        self._own_streams.append(stream)
        return stream

    # -- running -------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """Run one batch; returns its outputs (a tx.Tensor, tuple or dict of them).
        Inline (``max_in_flight=1``, or on a GPU) it makes no report, since nothing returns
        one: no hops, stage timings or peak (``run([batch])`` reports them)."""
        batch = named if named else (inputs[0] if len(inputs) == 1 else inputs)
        if self._pipelined or self._executor is not None or self._closed:
            return self.run((batch,)).outputs[0]
        slot = self._take(batch, None)
        self._run_batch(slot, None)
        return _output_of(slot)

    def run(self, batches: Iterable[Any], *, progress: bool = False) -> ChainResult:
        """Stream an iterable of batches through the stages. A batch is an array (anything
        with ``__dlpack__``), a tuple of arrays or a dict of arrays. ``progress``: show a
        progress bar (rich or tqdm, when installed).

        An array of two or more dimensions given as ``batches`` is an iterable of its rows,
        each a batch. Raises TypeError when ``batches`` is one batch rather than an iterable
        of them (an array of at most one dimension, a tx.Tensor, a dict: ``run([x])`` or
        ``chain(x)`` runs one) or is not iterable, and when a batch holds something with no
        ``__dlpack__``, or a stage returns such a thing; StageError naming the stage that
        failed; RuntimeError when the chain is closed, also when another thread closes it
        while it runs."""
        if self._closed:
            raise RuntimeError("this chain is closed")
        _check_batches(batches)
        if self._executor is not None:
            return self._executor.run(batches, progress=progress)
        result = ChainResult()
        ms = [0.0] * len(self._plans)  # milliseconds per stage, by name at the end
        self._watch = _trace.stage_watch(self._nvtx)
        _REG.reset_peak()
        start = _now()
        try:
            if self._pipelined:
                try:
                    self._run_pipelined(_progress(batches, progress), result, ms)
                except RuntimeError as exc:  # a stream of ours refused: say the chain was closed
                    if self._closed and type(exc) is RuntimeError:
                        raise RuntimeError("this chain was closed while it ran") from exc
                    raise
            else:
                for batch in _progress(batches, progress):
                    slot = self._take(batch, [])
                    self._run_batch(slot, ms)
                    self._finish(slot, result)
            for hops in result.batch_hops:
                hop_dicts(hops)
        finally:
            result.peak_live_bytes = _REG.end_peak()
            self._watch = None
        result.wall_ms = (_now() - start) * 1e3
        if self._unique_names:
            result.stage_ms = dict(zip(self._names, ms))
        else:  # stages that share a name: summed
            for name, spent in zip(self._names, ms):
                result.stage_ms[name] = result.stage_ms.get(name, 0.0) + spent
        return result

    def _run_alone(self, batch: Any) -> tuple[Any, list[dict[str, Any]], list[float], int]:
        """One batch inline, as ``run([batch])`` runs it in a chain that is neither
        pipelined nor given an executor, without the ``ChainResult``: ``(outputs, hops,
        ms, peak_live_bytes)``, ``ms`` the milliseconds of each stage in order. For a
        Ray stage actor, which runs one batch a call (a ``ChainResult`` and the checks
        of an iterable cost about 3 us of its 7). Raises what ``run`` raises."""
        ms = [0.0] * len(self._plans)
        self._watch = _trace.stage_watch(self._nvtx)
        _REG.reset_peak()
        try:
            slot = self._take(batch, [])
            self._run_batch(slot, ms)
        finally:
            peak = _REG.end_peak()
            self._watch = None
        return _output_of(slot), hop_dicts(slot.hops), ms, peak  # type: ignore[arg-type]

    def _run_pipelined(self, batches: Iterable[Any], result: ChainResult, ms: list[float]) -> None:
        """Each batch goes to the first stage's host stream; each stage, when done, hands
        it to the next stage's stream (no event, no wait item: the hand-off is the
        ordering, each stream running its tasks in order), so stage k of batch n+1 runs
        while stage k+1 of batch n runs. A batch is taken from ``batches`` only while
        fewer than ``max_in_flight`` are in flight (so a generator never runs ahead)."""
        in_flight: deque[_Slot] = deque()
        limit, take, wait, finish = self.max_in_flight, self._take, self._wait_done, self._finish
        outputs, batch_hops = result.outputs, result.batch_hops
        held = None  # a retired batch's done lock, acquired again: the next batch's, as it is
        first, spent = self._stage_tasks()
        try:
            for batch in batches:
                slot = take(batch, [])
                if held is None:
                    held = threading.Lock()
                    held.acquire()
                slot.done, done, held = held, held, None
                try:
                    first(slot)
                except BaseException:
                    done.release()
                    raise
                in_flight.append(slot)
                while len(in_flight) >= limit:
                    # _retire written out for one tensor out (the caller's part of each
                    # batch's way round, paid while the stages wait for the next batch)
                    old = in_flight.popleft()
                    if not old.done.acquire(True, 0.05):
                        wait(old)
                    elif old.error is None:
                        held = old.done  # its task is done with it: the next batch's lock
                    if old.error is not None or old.kind != "one":
                        finish(old, result)
                    else:
                        hops = old.hops
                        if not result.hops:
                            result.hops = hops  # type: ignore[assignment]
                        batch_hops.append(hops)  # type: ignore[arg-type]
                        values, old.values = old.values, None
                        outputs.append(values[0])
            while in_flight:
                self._retire(in_flight.popleft(), result)
        finally:
            for slot in in_flight:  # an error: let the others finish, drop their tensors
                if slot.done is not None:
                    self._wait_done(slot)
                slot.values = None
            for acc in spent:
                for k, t in enumerate(acc):
                    ms[k] += t

    def _run_batch(self, slot: _Slot, ms: list[float] | None) -> None:
        """Every stage on one batch, inline on this thread. ``ms``: where to add each
        stage's milliseconds (None: not timed)."""
        run_one, run_stage = self._run_one, self._run_stage
        if self._watch is not None:
            run_one = run_stage = self._watched
        plans = self._plans
        if not plans:  # close() from another thread drops them: a batch must not pass through unrun
            raise RuntimeError("this chain was closed while it ran")
        try:
            for plan in plans:
                if plan.plain and slot.kind == "one":
                    run_one(plan, slot, ms)
                else:
                    run_stage(plan, slot, ms)
        except BaseException:
            slot.values = None  # drop the intermediates now; their release is stream-ordered
            raise

    def _stage_tasks(self) -> tuple[Callable[[_Slot], None], list[list[float]]]:
        """This run's tasks, one per stream in stage order: ``first(slot)`` queues a
        batch's first task. A task runs its stream's stages on the batch (a stage that
        shares the stream of the stage before it runs in the same task), then queues the
        next task on the next stream, or marks the batch done. An error (a stage's, or
        the next stream refusing the work: closed) goes on the batch, which runs no
        further stage and drops its intermediates there (their release is stream-
        ordered). Also the per-stream lists of each stage's milliseconds, each written
        by its own stream's worker alone (the run adds them up at its end).

        Everything a task reads is bound when it is made, and each stream's task, list
        and context are its own: every step here is paid per stage and batch on a worker
        thread, where an object that other threads touch too (its reference count
        included) costs a cache miss. Each task runs in its own copy of the caller's
        ``contextvars`` context, made when the run starts (``tx.track()`` counts what
        stages make; a stream runs its tasks one at a time, so its context is never
        entered twice at once). The tasks are made from the last to the first, each
        holding the next one: no cycle, nothing to undo."""
        plans, hands, n = self._plans, self._hands, len(self._plans)
        run_one, run_stage = self._run_one, self._run_stage
        if self._watch is not None:
            run_one = run_stage = self._watched
        starts = [k for k in range(n) if k == 0 or hands[k] is not None]
        spent: list[list[float]] = []
        task: Callable[[_Slot], None] | None = None
        for i in range(len(starts) - 1, -1, -1):
            k, end = starts[i], starts[i + 1] if i + 1 < len(starts) else n
            acc = [0.0] * n
            spent.append(acc)
            post, refused = hands[end] if end < n else (None, None)
            task = (self._plain_task(plans[k], acc, run_one, run_stage, task, post, refused) if end == k + 1
                    else None) \
                or stage_task([step_of(plan, acc, run_one, run_stage) for plan in plans[k:end]], task, post, refused)
        context = contextvars.copy_context()
        put, refused = hands[0]  # type: ignore[misc]
        return first_of(put, refused, context, task), spent

    def _plain_task(self, plan: _Plan, acc: list[float], run_one: Callable[..., None], run_stage: Callable[..., None],
                    then: Callable[[_Slot], None] | None, post: Callable[..., bool] | None,
                    refused: Callable[..., None] | None) -> Callable[[_Slot], None] | None:
        """``chain_pipeline.plain_task`` for ``plan`` where it applies: a plain stage of
        a framework that never copies by its contract (``_Plan.plain``, no ``ptr``:
        NumPy), no watch. None for any other stage."""
        if not plan.plain or plan.ptr is not None or self._watch is not None:
            return None
        return plain_task(plan, acc, run_one, run_stage, self._outputs, then, post, refused, _Slot)

    def _take(self, batch: Any, hops: list[dict[str, Any]] | None) -> _Slot:
        stream = None if self._pipelined else self._streams[0]
        try:
            if isinstance(batch, dict):
                slot = _Slot("dict", {k: _take_one(v, stream) for k, v in batch.items()}, hops)
            elif isinstance(batch, (tuple, list)):
                slot = _Slot("tuple", [_take_one(v, stream) for v in batch], hops)
            else:  # _take_one written out: one batch, one array (most chains)
                if isinstance(batch, Tensor):
                    t = batch
                else:
                    t = from_dlpack(batch) if stream is None else from_dlpack(batch, stream=stream)
                slot = _Slot("one", [t], hops)
        except TypeError as exc:
            raise _input_error(batch, exc) from exc
        if self._watch is not None:
            slot.batch = self._watch.next_batch()
        return slot

    def _watched(self, plan: _Plan, slot: _Slot, ms: list[float] | None) -> None:
        """One stage on one batch, as ``_run_one`` or ``_run_stage`` does it, reported to
        the run's watch (exchange/tracing.py): its NVTX range, and in a trace its span,
        the hops it made and the flow from the stage before."""
        watch, hops = self._watch, slot.hops
        first_hop = len(hops) if hops is not None else 0
        nvtx = watch.nvtx  # type: ignore[union-attr]
        if nvtx is not None:
            watch.push(plan)  # type: ignore[union-attr]
        t0 = _now_ns()
        failed = True
        try:
            if plan.plain and slot.kind == "one":
                self._run_one(plan, slot, ms)
            else:
                self._run_stage(plan, slot, ms)
            failed = False
        finally:
            t1 = _now_ns()
            if nvtx is not None:
                watch.pop()  # type: ignore[union-attr]
            trace = watch.trace  # type: ignore[union-attr]
            if trace is not None:
                trace.stage(self, plan, slot.batch, t0, t1, hops, first_hop, failed)

    def _retire(self, slot: _Slot, result: ChainResult) -> None:
        self._wait_done(slot)
        self._finish(slot, result)

    def _wait_done(self, slot: _Slot) -> None:
        """Wait until a pipelined batch is done (its last task lets go of ``slot.done``).
        The exit hook drops the tasks still queued on host streams unrun (a batch's with
        them) and marks the streams ``_exiting``: once one of ours is, a batch not done
        ends with a RuntimeError rather than waiting for ever (a non-daemon thread's run
        would hang the exit that joins it)."""
        done, streams = slot.done, self._streams
        while not done.acquire(True, 0.05):
            if any(getattr(s, "_exiting", False) for s in streams):
                if slot.error is None:
                    slot.error = RuntimeError("this chain's host streams were closed at interpreter exit; the "
                                              "batch's queued work was dropped")
                slot.values = None
                return

    def _finish(self, slot: _Slot, result: ChainResult) -> None:
        if slot.error is not None:
            error, slot.error = slot.error, None
            raise error
        if not result.hops:
            result.hops = slot.hops  # type: ignore[assignment]
        result.batch_hops.append(slot.hops)  # type: ignore[arg-type]
        result.outputs.append(_output_of(slot))

    def _run_stage(self, plan: _Plan, slot: _Slot, ms: list[float] | None) -> None:
        """One stage on one batch: its inputs to the framework, the hops into it (unless
        ``slot.hops`` is None), the function (timed into ``ms`` unless None), its
        outputs as tx Tensors, which become the slot's values."""
        tensors = slot.values
        names = None
        if slot.kind == "dict":
            names = list(tensors)
            tensors = list(tensors.values())
        if plan.view:
            stream = plan.stream
            tensors = [from_dlpack(t, stream=stream) for t in tensors]
        reasons = None
        if plan.guard_read_only or plan.align:
            tensors = list(tensors)
            if plan.guard_read_only:
                reasons = _read_only_copies(plan, tensors)
            if plan.align:
                reasons = _aligned_copies(plan, tensors, reasons)
        if plan.import_copies is not None:
            reasons = [_joined(r, plan.import_copies) for r in reasons or [None] * len(tensors)]
        try:
            arrays = list(map(plan.take, tensors))
        except Exception as exc:
            raise _take_failed(plan, exc) from exc
        if plan.check_ptrs:
            _refuse_taken_copies(plan, tensors, arrays)
        if slot.hops is not None:
            _hops_in(plan, slot, tensors, arrays, reasons)
        fn = plan.fn
        t0 = _now() if ms is not None else 0.0
        try:
            if plan.direct:
                raw = fn(**dict(zip(names, arrays))) if names else fn(*arrays)
            else:
                raw = self._call(plan, fn, names, arrays)
        except Exception as exc:
            raise _stage_failed(plan, exc) from exc
        if ms is not None:
            ms[plan.index] += (_now() - t0) * 1e3
        del arrays
        slot.kind, slot.values = self._outputs(plan, raw, slot)

    def _run_one(self, plan: _Plan, slot: _Slot, ms: list[float] | None) -> None:
        """``_run_stage`` for the common case, written out: one tensor in, a stage called
        as it is (``_Plan.plain``). The same steps, without the loops over inputs; sets
        the slot's kind and values itself."""
        t = slot.values[0]
        try:
            a = plan.take(t)
        except Exception as exc:
            raise _take_failed(plan, exc) from exc
        hops, ptr = slot.hops, plan.ptr
        if hops is not None:
            ptrs = slot.ptrs
            if ptr is None and ptrs is None:  # no pointer to compare: shared by contract
                hops.append((plan.shared_in, t._nbytes))  # its dict: hop_dicts, when the run is over
            else:
                p = t.data_ptr
                consumer = p if ptr is None else ptr(a)
                producer = None if ptrs is None else ptrs[0]
                if consumer == p and (producer is None or producer == p):
                    hops.append((plan.shared_in, t._nbytes))
                else:
                    hops.append(_hop(plan.before, plan.framework, t, consumer, producer))
        t0 = _now() if ms is not None else 0.0
        try:
            raw = plan.fn(a)
        except Exception as exc:
            raise _stage_failed(plan, exc) from exc
        if ms is not None:
            ms[plan.index] += (_now() - t0) * 1e3
        del a
        if isinstance(raw, _GROUPS):
            slot.kind, slot.values = self._outputs(plan, raw, slot)
            return
        try:
            out = plan.give(raw)
        except Exception as exc:
            raise _output_error(plan, raw, None, [raw], exc) from exc
        slot.values = [out]
        if hops is not None:
            slot.ptrs = None if ptr is None else [ptr(raw)]
            if plan.last:
                _hops_out(plan, slot, slot.values)

    def _call(self, plan: _Plan, fn: Any, names: list[str] | None, arrays: list[Any]) -> Any:
        """A stage that is not called as it is: an ONNX Runtime session (IO binding), a
        stage with output buffers, or one whose stream the framework must make current."""
        stage, adapter = plan.stage, plan.adapter
        if plan.session:
            feed = dict(zip(names or [i.name for i in fn.get_inputs()], arrays))
            return adapter.run_session(fn, feed, stage.out)
        out = [plan.take(o) for o in stage.out] if stage.out else None
        if names:
            return adapter.call(fn, [], dict(zip(names, arrays)), out, plan.stream)
        return adapter.call(fn, arrays, {}, out, plan.stream)

    def _outputs(self, plan: _Plan, raw: Any, slot: _Slot) -> tuple[str, Any]:
        if isinstance(raw, dict):
            kind, keys, values = "dict", list(raw), list(raw.values())
        elif isinstance(raw, (tuple, list)):
            kind, keys, values = "tuple", None, list(raw)
        else:
            kind, keys, values = "one", None, [raw]
        if plan.stage.out:
            outs = _check_out(plan, keys, values)
            slot.ptrs = [buf.data_ptr for buf in outs]
        else:
            try:
                outs = list(map(plan.give, values))
            except Exception as exc:
                raise _output_error(plan, raw, keys, values, exc) from exc
            if plan.check_ptrs:
                _refuse_given_copies(plan, values, outs)
            if slot.hops is not None:
                ptr = plan.ptr
                slot.ptrs = None if ptr is None else list(map(ptr, values))
                if plan.last:
                    _hops_out(plan, slot, outs)
        if kind == "dict":
            return kind, dict(zip(keys, outs))  # type: ignore[arg-type]
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
        self._plans = []
        self._hands = []

    def __enter__(self) -> "Chain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _output_of(slot: _Slot) -> Any:
    """A finished batch's outputs as ``run`` gives them; the slot lets go of them."""
    values, slot.values = slot.values, None
    if slot.kind == "one":
        return values[0]
    if slot.kind == "dict":
        return dict(values)
    return tuple(values)


def _with_room(batches: Iterable[Any], in_flight: deque, limit: int, retire: Callable[[Any], None]) -> Iterator[Any]:
    """The batches, each taken from ``batches`` only once ``in_flight`` has room for it
    (its oldest entries retired while it holds ``limit``): the pipelined chain and the
    Ray executor hold at most ``limit`` batches at once, counting one still being made
    by the caller's generator."""
    it = iter(batches)
    while True:
        while len(in_flight) >= limit:
            retire(in_flight.popleft())
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch


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


def _host_stream(stream: Any) -> bool:
    """Whether ``stream`` is None or a host stream (one on memory the host reads in place),
    for which every adapter's stream context is empty."""
    device = getattr(stream, "device", None)
    if device is None:
        return True
    kind = memory_kind(device.type)
    return kind is not None and kind.host_readable
