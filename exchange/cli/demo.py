"""``tensor-exchange demo``: a real model on real data, run as a ``tx.Chain`` across four
frameworks, every hop through ``exchange`` and checked to share memory.

The chain (the held-out images streamed through it in ``--batches`` batches)::

    uint8 pixels --> NumPy "scale" --> ONNX Runtime "mlp" --> PyTorch "softmax" --> JAX "argmax"
    (NumPy arrays)   (float32 0..1)    (InferenceSession,     (class                (predictions,
                                        IO binding: logits)     probabilities)        confidence)

The data are the 8x8 handwritten digits scikit-learn ships (``load_digits``), kept as
uint8 pixel intensities 0..16; the model is a small MLP trained with scikit-learn in
a few seconds, exported by hand to an ONNX graph (``onnx.helper``: MatMul, Add, Relu)
and served by ONNX Runtime. The final outputs (registry records that outlive the chain)
are taken into NumPy and scored against the labels: accuracy over all batches.

Sharing is checked for every hop of every batch: ``tx.Chain`` reports a hop shared only
if the producer's data pointer, the ``tx.Tensor.data_ptr`` and the consuming
framework's data pointer are one address; the demo adds the same check for the final
outputs it takes into NumPy.

On CUDA (``--device cuda``; the default when CUDA is usable here) the same code runs
with ``device="cuda"`` stages: the input batches are moved with
``tx.from_dlpack(x, device="cuda")``, CuPy takes the scaling stage, ONNX Runtime runs
its CUDA execution provider on the stage's own stream, and the outputs are scored in CuPy.
Where ONNX Runtime is the CPU build (no CUDA execution provider), the model stage runs
on the CPU: its input is copied to the host and its output back to the GPU through
``tx.from_dlpack(..., device=...)``, and those two hops are reported as copies with the
reason (``"reason"`` in the hop), not as a failure.

Things the peers do that decide which chain can share (found while building this):

* ONNX Runtime's ``__dlpack__`` takes no ``max_version``: its outputs come in as a
  legacy capsule, which this library imports read-only (docs/design.md, "The protocol"). PyTorch accepts a
  read-only versioned capsule without copying (it ignores the flag), so ONNX Runtime
  feeds PyTorch.
* JAX asks for legacy capsules; the chain's JAX adapter exports read-only tensors to it
  anyway (JAX arrays are immutable). JAX copies data that is not 64-byte aligned, so it
  is fed by PyTorch, whose CPU allocations are 64-byte aligned; the demo keeps its own
  NumPy inputs 64-byte aligned too (:func:`aligned`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from typing import Any, Iterator

from . import write_report

# What the Ray run (demo_ray.py) shares with this one lives in demo_parts.py, so that the
# two programs do not import each other; every name is still offered here as before.
from .demo_parts import (  # noqa: F401  (ALIGNMENT: a name of this module too)
    ALIGNMENT,
    HOP_TENSORS,
    INPUT_NAME,
    MIN_ACCURACY,
    OUTPUT_NAME,
    Digits,
    Laps,
    MLPWeights,
    _merge_hops,
    _Phases,
    _report_console,
    _stdout_to_stderr,
    aligned,
    argmax_jax,
    build_onnx_model,
    load_digits_split,
    make_scale,
    make_session,
    pip_hint,
    rich_table,
    run_json,
    softmax_torch,
    split_batches,
    train_classifier,
)

__all__ = [
    "Digits",
    "MLPWeights",
    "HOP_TENSORS",
    "missing_packages",
    "pip_hint",
    "DemoResult",
    "DeviceUnavailable",
    "INPUT_NAME",
    "OUTPUT_NAME",
    "STAGES",
    "load_digits_split",
    "aligned",
    "train_classifier",
    "build_onnx_model",
    "make_session",
    "cuda_unusable_reason",
    "choose_device",
    "make_scale",
    "softmax_torch",
    "argmax_jax",
    "build_chain",
    "split_batches",
    "run_demo",
    "report_json",
    "print_text",
    "add_arguments",
    "main",
]

#: The chain's stages, in order: (name, framework on the CPU, framework on CUDA).
STAGES = (("scale", "numpy", "cupy"), ("mlp", "onnxruntime", "onnxruntime"),
          ("softmax", "torch", "torch"), ("argmax", "jax", "jax"))
#: The packages the demo needs (import name, pip name); all come with the ``demo`` extra.
NEEDS = (("sklearn", "scikit-learn"), ("onnx", "onnx"), ("onnxruntime", "onnxruntime"), ("torch", "torch"),
         ("jax", "jax"))
#: Why the model's hops copy where ONNX Runtime is the CPU build on a CUDA run.
ORT_CPU_REASON = ("ONNX Runtime here is the CPU build (no CUDAExecutionProvider), so the model runs on the CPU: "
                  "its input is copied to the host and its output back to the GPU")


class DeviceUnavailable(RuntimeError):
    """``--device cuda`` was asked for where the demo cannot run on CUDA; the message says why."""


# -- device --------------------------------------------------------------------------------
def missing_packages(device: str = "cpu") -> list[str]:
    """The pip names of the packages the demo needs that are not installed (CuPy too
    for ``device="cuda"``); empty when everything is there."""
    import importlib.util

    needs = list(NEEDS) + ([("cupy", _cupy_pip())] if device == "cuda" else [])
    return [pip for name, pip in needs if importlib.util.find_spec(name) is None]


def _cupy_pip() -> str:
    from exchange.devices.cuda import driver_cuda_major

    major = driver_cuda_major()
    return f"cupy-cuda{min(major, 13)}x" if major and major >= 12 else "cupy-cuda13x"


def ort_has_cuda() -> bool:
    """True when this ONNX Runtime has the CUDA execution provider (onnxruntime-gpu)."""
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def cuda_unusable_reason() -> str | None:
    """Why the demo cannot run on CUDA here, or None when it can: the CUDA backend must
    load (``exchange.devices.base.get_backend``), and CuPy (the scale stage), PyTorch (softmax) and
    JAX (argmax) must each see a GPU. ONNX Runtime without its CUDA execution provider
    is no reason: the model stage then runs on the CPU (:data:`ORT_CPU_REASON`)."""
    from exchange.devices.base import get_backend
    from exchange.devices.cuda import driver_cuda_major

    from ..device import DeviceType
    from ..errors import BackendUnavailableError

    try:
        get_backend(DeviceType.kDLCUDA)
    except BackendUnavailableError as exc:
        return f"the CUDA backend cannot load: {exc}"
    major = driver_cuda_major() or 13
    extra = f"cuda{min(major, 13)}"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU (the scale stage runs in CuPy on CUDA)"
    except ImportError:
        return f"CuPy is not installed (the scale stage runs in CuPy on CUDA; pip install {_cupy_pip()})"
    except Exception as exc:  # CuPy cannot reach the device
        return f"CuPy cannot use the GPU (the scale stage runs in CuPy on CUDA): {type(exc).__name__}: {exc}"
    try:
        import torch

        if not torch.cuda.is_available():
            return f"PyTorch {torch.__version__} here has no CUDA support (the softmax stage; install a CUDA build of torch)"
    except ImportError:
        return "PyTorch is not installed (the softmax stage)"
    try:
        import jax

        jax.devices("gpu")
    except ImportError:
        return f"JAX is not installed (the argmax stage; pip install 'jax[{extra}]')"
    except Exception as exc:  # RuntimeError: unknown backend / no GPU
        return f"JAX here has no GPU backend (the argmax stage; pip install 'jax[{extra}]'): {exc}"
    return None


def choose_device(requested: str = "auto") -> tuple[str, str | None]:
    """``(device, why_not_cuda)``. ``requested``: ``"auto"`` (CUDA when usable, else
    the CPU), ``"cpu"`` or ``"cuda"``. ``why_not_cuda``: the reason CUDA was not used
    (None when it was, or when the CPU was asked for). Raises DeviceUnavailable for
    ``"cuda"`` where the demo cannot run on CUDA, naming the reason."""
    if requested == "cpu":
        return "cpu", None
    reason = cuda_unusable_reason()
    if requested == "cuda" and reason is not None:
        raise DeviceUnavailable(f"--device cuda: cannot run the demo on CUDA here: {reason}")
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {requested!r}")
    return ("cpu", reason) if reason is not None else ("cuda", None)


# -- stages (the four stage functions are in demo_parts.py) --------------------------------
def mlp_on_host(session: Any, device: str) -> Any:
    """The model stage of a CUDA chain whose ONNX Runtime is the CPU build: takes the
    scaled pixels (CuPy float32 (batch, 64) on the GPU), copies them to the host
    (``tx.from_dlpack(x, device="cpu")``, which waits for the stage's stream), runs
    ``session`` on the CPU and copies the logits back to ``device``; returns that tx
    Tensor (float32 (batch, 10), owned by the registry)."""
    import numpy as np

    import exchange as tx

    def mlp(pixels: Any) -> Any:
        host = tx.from_dlpack(pixels, device="cpu")
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: np.from_dlpack(host)})
        return tx.from_dlpack(np.ascontiguousarray(logits), device=device)

    return mlp


def build_chain(session: Any, weights: MLPWeights, device: str = "cpu", ort_stream: Any = None,
                model_on_host: bool = False) -> Any:
    """The demo's ``tx.Chain``: scale (NumPy; CuPy on CUDA) -> mlp (``session``, ONNX
    Runtime) -> softmax (PyTorch) -> argmax (JAX), every stage on ``device``, the mlp
    stage on ``ort_stream`` when given (the stream the session runs on). With
    ``model_on_host`` (a CUDA chain, ONNX Runtime without CUDA) the mlp stage is
    :func:`mlp_on_host`, a CuPy stage that runs the session on the CPU."""
    import exchange as tx

    cuda = device != "cpu"
    fns = {"scale": make_scale(weights.input_scale), "mlp": session, "softmax": softmax_torch,
           "argmax": argmax_jax}
    stages = []
    for name, cpu, gpu in STAGES:
        if name == "mlp" and model_on_host:
            stages.append(tx.Stage(mlp_on_host(session, device), framework="cupy", name=name, device=device))
            continue
        stages.append(tx.Stage(fns[name], framework=gpu if cuda else cpu, name=name, device=device,
                               stream=ort_stream if name == "mlp" else None))
    return tx.Chain(stages, device=device)


class _Batches:
    """The input batches, moved to ``device`` one at a time as the chain takes them
    (``tx.from_dlpack(x, device="cuda")``); on the CPU the NumPy arrays themselves.
    ``step`` is called after each batch has been handed out (the progress display)."""

    def __init__(self, arrays: list[Any], device: str, step: Any = None) -> None:
        self.arrays = arrays
        self.device = device
        self.step = step

    def __len__(self) -> int:
        return len(self.arrays)

    def __iter__(self) -> Iterator[Any]:
        import exchange as tx

        for a in self.arrays:
            yield a if self.device == "cpu" else tx.from_dlpack(a, device=self.device)
            if self.step is not None:
                self.step()


# -- the run -------------------------------------------------------------------------------
@dataclasses.dataclass
class DemoResult:
    """What a demo run found.

    ``accuracy`` / ``confidence``: over all held-out images, in [0, 1].
    ``hops``: one entry per hop of the pipeline, in order, as the report shows them:
    ``{"from", "to", "tensor", "bytes", "shared"}`` with ``tensor`` what it carries
    (:data:`HOP_TENSORS`), ``bytes`` summed over all batches and ``shared`` true only if
    that hop shared memory in every batch; a hop that copies by design (the model's hops
    where ONNX Runtime is the CPU build on a CUDA run) also has ``"reason"``.
    ``unshared``: the hops of any batch that did not share (with ``"batch"``: its
    index); empty when all shared. ``stages``: ``{"name", "framework", "ms"}`` in chain order, ``ms`` the total
    over all batches. ``peak_live_bytes``: most bytes the registry held at once during
    the chain's run; ``stage_output_bytes_total``: bytes of all stages' outputs, summed
    over all batches and stages. ``live_records_end``: registry records made by this run
    still alive after the chain, the session and every intermediate were dropped and
    ``tx.registry().collect()`` ran (0 means nothing leaked); ``records_end`` are their
    descriptions. ``seconds``: wall time of each phase; ``chain_ms``: the chain's run.
    ``device_note``: why CUDA was not used (None when it was, or when the CPU was asked for).
    """

    accuracy: float
    confidence: float
    hops: list[dict[str, Any]]
    unshared: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    peak_live_bytes: int
    stage_output_bytes_total: int
    live_records_end: int
    records_end: list[str]
    device: str
    batches: int
    n_train: int
    n_test: int
    seconds: dict[str, float]
    chain_ms: float = 0.0
    device_note: str | None = None

    @property
    def peak_below_outputs(self) -> bool:
        """The registry never held all the stages' outputs at once."""
        return self.peak_live_bytes < self.stage_output_bytes_total

    @property
    def ok(self) -> bool:
        """The demo's check: accuracy >= 0.9, every hop of every batch shared (except the
        hops that copy by design, which carry a reason), nothing left alive, and (with
        more than one batch) the peak below the sum of the stages' outputs:
        intermediates were released as the next stage took them."""
        return (self.accuracy >= MIN_ACCURACY and not [h for h in self.unshared if not h.get("reason")]
                and all(h["shared"] or h.get("reason") for h in self.hops)
                and self.live_records_end == 0 and (self.batches == 1 or self.peak_below_outputs))


def _mark_host_model(hops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One batch's chain hops when the model ran on the host (:func:`mlp_on_host`): the
    hop into it and the hop out of it are copies, with the reason."""
    out = [dict(h) for h in hops]
    if len(out) > 2:
        out[1].update({"to": "onnxruntime", "shared": False, "reason": ORT_CPU_REASON})
        out[2].update({"from": "onnxruntime", "shared": False, "reason": ORT_CPU_REASON})
    return out


def run_demo(*, seed: int = 0, test_size: float = 0.25, threads: int | None = None, batches: int = 8,
             device: str = "cpu", progress: bool = False, device_note: str | None = None) -> DemoResult:
    """Load the digits, train the MLP, build the ONNX model and its session, then stream
    the test split in ``batches`` batches through the chain (:func:`build_chain`) on
    ``device`` (``"cpu"`` or ``"cuda"``; see :func:`choose_device`), showing a progress
    display of its phases (load, train, build, run, score, release) on stderr when
    ``progress``. Scores the final outputs against the labels (accuracy over all
    batches), then closes the chain, drops the outputs, the session and every
    intermediate, waits for the registry's pending releases, and counts the records this
    run made that are still alive. ``device_note``: why CUDA was not used, for the report.
    No download; a few seconds on the CPU."""
    import exchange as tx

    reg = tx.registry()
    before = {r.id for r in reg.snapshot()}
    lap = Laps()
    seconds = lap.seconds

    cuda = device != "cpu"
    with _Phases(progress) as phases:
        with phases.phase("load the digits"):
            data = load_digits_split(test_size=test_size, seed=seed)
            x_batches = split_batches(data.x_test, batches)
            y_batches = split_batches(data.y_test, batches)
        lap("load")
        with phases.phase("train the MLP (scikit-learn)"):
            weights = train_classifier(data.x_train, data.y_train, seed=seed)
        lap("train")
        with phases.phase("build the ONNX model, its session and the chain"):
            model_on_host = cuda and not ort_has_cuda()
            ort_stream = tx.create_stream(device) if cuda and not model_on_host else None
            session = make_session(build_onnx_model(weights, scale_input=False), threads=threads,
                                   device="cpu" if model_on_host else device, stream=ort_stream)
            chain = build_chain(session, weights, device=device, ort_stream=ort_stream, model_on_host=model_on_host)
        lap("build")
        with phases.phase(f"run the chain over {len(x_batches)} batches", total=len(x_batches)):
            run = chain.run(_Batches(x_batches, device, step=phases.step))
        lap("run")
        with phases.phase("score"):
            result = _score(run, chain, y_batches, data, cuda, model_on_host)
        lap("score")
        with phases.phase("release"):
            # Drop everything this run made (the outputs are registry records that outlive
            # the chain), then let the registry finish the stream-ordered releases.
            run.outputs.clear()
            chain.close()
            del run, chain, session, ort_stream
            gc.collect()
            reg.collect(timeout=10.0)
            alive = [r for r in reg.snapshot() if r.id not in before]
        lap("release")

    return DemoResult(
        **result, live_records_end=len(alive), records_end=[r.describe() for r in alive], device=device,
        batches=len(x_batches), n_train=int(data.x_train.shape[0]), n_test=int(data.x_test.shape[0]),
        seconds=seconds, device_note=device_note,
    )


def _score(run: Any, chain: Any, y_batches: list[Any], data: Digits, cuda: bool,
           model_on_host: bool) -> dict[str, Any]:
    """Take the chain's final outputs (registry records) into NumPy (CuPy on CUDA),
    score them, and gather the hops, stage times and bytes for the report."""
    from ..frameworks import get_adapter

    consumer = get_adapter("cupy" if cuda else "numpy")
    xp = consumer.load()
    correct = 0
    confidence_sum = 0.0
    taken: list[list[dict[str, Any]]] = []
    for out, labels in zip(run.outputs, y_batches):
        hops = []
        arrays = []
        for t in out:
            a = consumer.to_framework(t, None)
            hops.append({"from": "tx", "to": consumer.name, "bytes": t.nbytes,
                         "shared": consumer.data_ptr(a) == t.data_ptr})
            arrays.append(a)
        predictions, top = arrays
        correct += int((predictions == xp.asarray(labels)).sum())
        confidence_sum += float(top.sum())
        taken.append(hops)
        del arrays, predictions, top, a, t, out
    chain_hops = [_mark_host_model(b) for b in run.batch_hops] if model_on_host else run.batch_hops
    hops, unshared = _merge_hops([b + t for b, t in zip(chain_hops, taken)])
    output_bytes = sum(h["bytes"] for b in run.batch_hops for h in b if h["from"] != "input")
    stages = [{"name": s.name, "framework": "onnxruntime" if s.name == "mlp" and model_on_host else s.framework,
               "ms": float(run.stage_ms[s.name])} for s in chain.stages]
    n = int(data.x_test.shape[0])
    return {"accuracy": correct / n, "confidence": confidence_sum / n, "hops": hops, "unshared": unshared,
            "stages": stages, "peak_live_bytes": int(run.peak_live_bytes),
            "stage_output_bytes_total": int(output_bytes), "chain_ms": float(run.wall_ms)}


# -- reports -------------------------------------------------------------------------------
def report_json(result: DemoResult) -> dict[str, Any]:
    """The ``--report json`` object::

        {"accuracy": float,
         "hops": [{"from": str, "to": str, "tensor": str, "bytes": int, "shared": bool,
                   "reason": str (only on a hop that copies by design)}],
         "live_records_end": int, "device": str, "device_note": str | None, "batches": int,
         "stages": [{"name": str, "framework": str, "ms": float}],
         "peak_live_bytes": int, "stage_output_bytes_total": int,
         "chain_ms": float, "seconds": {"load": float, "train": float, "build": float, "run": float,
                                        "score": float, "release": float}}

    ``hops[i]["bytes"]`` is summed over all batches and ``shared`` holds for every batch;
    the hops out of the stages (all but the first, from ``"input"``, and the last ones,
    from ``"tx"`` into the scoring) add up to ``stage_output_bytes_total``.
    ``device_note`` says why CUDA was not used (None when it was, or the CPU was asked for).
    ``chain_ms``: the chain's wall time over all batches, in milliseconds; ``seconds``: each
    phase of the run, in seconds (the text report's time line)."""
    hops = []
    for h in result.hops:
        hop = {"from": h["from"], "to": h["to"], "tensor": h.get("tensor", ""), "bytes": int(h["bytes"]),
               "shared": bool(h["shared"])}
        if h.get("reason"):
            hop["reason"] = h["reason"]
        hops.append(hop)
    return {
        "accuracy": float(result.accuracy),
        "hops": hops,
        "live_records_end": int(result.live_records_end),
        "device": result.device,
        "device_note": result.device_note,
        **run_json(result),
    }


def print_text(result: DemoResult, file: Any = None) -> None:
    """Print the human report to ``file`` (default stdout): accuracy, the stages with
    their times, the hops, peak live bytes against the stages' outputs, the registry's
    live records at the end. Uses rich when it is installed."""
    file = sys.stdout if file is None else file
    verdict = "OK" if result.ok else "FAILED"
    device = result.device + (f" (CUDA not used: {result.device_note})" if result.device_note else "")
    head = (f"digits: trained on {result.n_train}, tested on {result.n_test} held-out images "
            f"in {result.batches} batches, device {device}")
    score = f"accuracy {result.accuracy:.4f}   mean confidence {result.confidence:.4f}"
    share = result.peak_live_bytes / result.stage_output_bytes_total if result.stage_output_bytes_total else 0.0
    memory = (f"peak live bytes {result.peak_live_bytes} = {share:.0%} of the {result.stage_output_bytes_total} "
              f"bytes the stages output ({'below' if result.peak_below_outputs else 'NOT below'} their sum)")
    registry_line = f"registry: {result.live_records_end} records made by this run alive at the end"
    timing = (f"time: chain {result.chain_ms:.1f} ms; "
              + ", ".join(f"{k} {v:.2f} s" for k, v in result.seconds.items()))
    unshared = [f"copied: batch {h['batch']} {h['from']} -> {h['to']} ({h['bytes']} bytes)" for h in result.unshared
                if not h.get("reason")]
    reasons = sorted({h["reason"] for h in result.hops if h.get("reason")})
    unshared += [f"copied by design: {r}" for r in reasons]
    Table = rich_table()  # noqa: N806
    if Table is not None:
        console = _report_console(file)
        console.print(head, markup=False)
        console.print(score)
        table = Table(title="tx.Chain stages", title_justify="left")
        for col in ("stage", "framework", "ms, all batches"):
            table.add_column(col, justify="left" if col in ("stage", "framework") else "right")
        for s in result.stages:
            table.add_row(s["name"], s["framework"], f"{s['ms']:.1f}")
        console.print(table)
        table = Table(title="hops", title_justify="left")
        for col in ("from", "to", "tensor", "bytes, all batches", "memory"):
            table.add_column(col, justify="right" if col.startswith("bytes") else "left")
        for h in result.hops:
            state = ("[green]shared[/green]" if h["shared"] else
                     "[yellow]copied by design[/yellow]" if h.get("reason") else "[red]copied[/red]")
            table.add_row(h["from"], h["to"], h.get("tensor", ""), str(h["bytes"]), state)
        console.print(table)
        for line in unshared:
            console.print("  " + line, markup=False)
        console.print(memory, markup=False)
        console.print(registry_line, markup=False)
        for line in result.records_end:
            console.print("  " + line, markup=False)
        console.print(timing, markup=False)
        console.print(f"[bold {'green' if result.ok else 'red'}]{verdict}[/]")
        return
    print(head, file=file)
    print(score, file=file)
    print("tx.Chain stages (ms, all batches):", file=file)
    for s in result.stages:
        print(f"  {s['name']:<10} {s['framework']:<12} {s['ms']:>10.1f} ms", file=file)
    print(f"hops:\n  {'from':>11}    {'to':<11} {'tensor':<14} {'bytes, all batches':>18}  memory", file=file)
    for h in result.hops:
        state = "shared" if h["shared"] else "copied by design" if h.get("reason") else "copied"
        print(f"  {h['from']:>11} -> {h['to']:<11} {h.get('tensor', ''):<14} {h['bytes']:>18}  {state}", file=file)
    for line in unshared:
        print("  " + line, file=file)
    print(memory, file=file)
    print(registry_line, file=file)
    for line in result.records_end:
        print("  " + line, file=file)
    print(timing, file=file)
    print(verdict, file=file)


# -- command line ------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    """The ``demo`` subcommand's options (argparse)."""
    from .arguments import integer, non_negative, positive

    parser.add_argument("--report", choices=("text", "json"), default="text",
                        help="text: tables for people (default); json: one JSON object on stdout. "
                             "Either way each phase is shown on stderr as it runs")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the chain runs (default: cuda when usable here, else cpu); "
                             "cuda fails with the reason where it cannot run")
    parser.add_argument("--batches", type=integer(1, 450), default=8,
                        help="split the held-out images into this many batches streamed through the chain "
                             "(1 to 450: the held-out split has 450 images; default 8)")
    parser.add_argument("--seed", type=non_negative, default=0, help="split and training seed (default 0)")
    parser.add_argument("--threads", type=positive, default=None,
                        help="ONNX Runtime intra-op threads (default: one per core)")
    parser.add_argument("--ray", action="store_true",
                        help="run each stage on its own Ray actor, on a local Ray cluster started for the run "
                             "(needs the [ray] extra; exchange/cli/demo_ray.py)")
    parser.add_argument("--publish", action="store_true",
                        help="a PyTorch trainer publishes its weights as a tensor set after each epoch; a JAX and a "
                             "NumPy reader process follow the newest version and score it (exchange/cli/demo_publish.py)")
    parser.add_argument("--trace", metavar="PATH", default=None,
                        help="write a timeline of the run to PATH (Chrome trace JSON: open it in ui.perfetto.dev "
                             "or chrome://tracing; docs/observability.md); with --ray the actors' events too")


def main(args: Any) -> int:
    """Run the demo and print its report. Exit status 0 when the check holds (accuracy
    >= 0.9, every hop shared, no record left alive, peak live bytes below the stages'
    outputs), 1 otherwise, 2 when the device asked for cannot be used (the reason on
    stderr), also when a package the demo needs is missing (naming the extra that brings it).
    ``--ray``: see ``exchange.cli.demo_ray``."""
    missing = missing_packages()  # CuPy, for CUDA, is checked with the device (choose_device)
    if missing:
        print(f"tensor-exchange demo needs {', '.join(missing)}, not installed here: {pip_hint('demo')} "
              "(in a checkout: make demo)", file=sys.stderr)
        return 2
    trace_path = getattr(args, "trace", None)
    if trace_path is not None:
        return _traced(args, trace_path)
    return _run(args)


def _traced(args: Any, path: str) -> int:
    """``main`` inside ``tx.trace(path)``; an unwritable path fails first (exit 2)."""
    import exchange as tx

    recording = tx.trace(path)
    try:
        recording.start()
    except OSError as exc:
        print(f"tensor-exchange demo: {exc}", file=sys.stderr)
        return 2
    try:
        status = _run(args)
    finally:
        recording.stop()
    try:
        recording.write(path)
    except OSError as exc:
        print(f"tensor-exchange demo: {exc}", file=sys.stderr)
        return 2
    dropped = f", {recording.dropped} entries dropped (ring full)" if recording.dropped else ""
    print(f"tensor-exchange demo: trace written to {path} ({len(recording.events())} events{dropped}); "
          "open it in ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    return status


def _run(args: Any) -> int:
    if getattr(args, "publish", False):
        from .demo_publish import main as publish_main

        return publish_main(args)
    if getattr(args, "ray", False):
        from .demo_ray import main as ray_main

        return ray_main(args)
    try:
        device, note = choose_device(getattr(args, "device", "auto"))
    except DeviceUnavailable as exc:
        print(f"tensor-exchange demo: {exc}", file=sys.stderr)
        return 2
    batches = getattr(args, "batches", 8)
    if args.report == "json":
        with _stdout_to_stderr():  # the phases on stderr as in text mode; stdout gets the JSON alone
            result = run_demo(seed=args.seed, threads=args.threads, batches=batches, device=device, progress=True,
                              device_note=note)
        write_report(lambda: sys.stdout.write(json.dumps(report_json(result)) + "\n"))
    else:
        result = run_demo(seed=args.seed, threads=args.threads, batches=batches, device=device, progress=True,
                          device_note=note)
        write_report(lambda: print_text(result))  # a reader that left (`| head`) changes no verdict
    return 0 if result.ok else 1
