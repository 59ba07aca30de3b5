"""``tensor-exchange demo``: a real model on real data, across four frameworks, with
every hand-over going through ``exchange`` and checked to share memory.

The pipeline (CPU, no GPU and no download needed)::

    NumPy (test pixels) --> ONNX Runtime (MLP -> logits) --> PyTorch (softmax)
         \\                                                        |
          `-- (labels) ------------------------------------> JAX (accuracy, confidence)

The data are the 8x8 handwritten digits scikit-learn ships (``load_digits``); the
model is a small MLP trained with scikit-learn in about a second, exported by hand to
an ONNX graph (``onnx.helper``: Mul, MatMul, Add, Relu) and served by ONNX Runtime.

Every hop is ``tx.from_dlpack(producer_object)`` followed by the consumer's own
``from_dlpack(tx_tensor)``, and is reported *shared* only if the producer's data
pointer, the ``tx.Tensor.data_ptr`` and the consumer's data pointer are one address.

The pieces are separable, for the ``tx.Chain`` rebuild to come: data loading
(:func:`load_digits_split`), training (:func:`train_classifier`), ONNX graph building
(:func:`build_onnx_model`, :func:`make_session`), the framework table
(:data:`FRAMEWORKS`) and one hop (:func:`hop`), the stages (:func:`infer_onnxruntime`,
:func:`postprocess_torch`, :func:`score_jax`), the run (:func:`run_demo`) and the
reports (:func:`report_json`, :func:`print_text`).

Things the peers do that decide which chain can share (found while building this):

* JAX asks for a legacy (unversioned) capsule, so it cannot take a read-only tensor
  from us (``BufferError``); it copies silently when the data are not 64-byte aligned,
  and it converts int64 to int32 (a copy) unless x64 is enabled. Hence JAX is fed by
  PyTorch (its results are writable and 64-byte aligned) and by int32 labels kept in a
  64-byte aligned NumPy array.
* ONNX Runtime's ``__dlpack__`` takes no ``max_version``: its outputs come in as a
  legacy capsule, which this library imports read-only (DESIGN.md). PyTorch 2.x
  accepts a read-only versioned capsule without copying (it does not enforce the flag),
  so ONNX Runtime feeds PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Sequence

__all__ = [
    "Digits",
    "MLPWeights",
    "Framework",
    "FRAMEWORKS",
    "Hop",
    "DemoResult",
    "INPUT_NAME",
    "OUTPUT_NAME",
    "load_digits_split",
    "aligned",
    "train_classifier",
    "build_onnx_model",
    "make_session",
    "hop",
    "infer_onnxruntime",
    "postprocess_torch",
    "score_jax",
    "run_demo",
    "report_json",
    "print_text",
    "add_arguments",
    "main",
]

#: ONNX graph input: float32 (batch, 64), raw pixel intensities 0..16.
INPUT_NAME = "pixels"
#: ONNX graph output: float32 (batch, 10), unnormalised class scores.
OUTPUT_NAME = "logits"
#: Byte alignment the demo gives NumPy arrays it hands on (what JAX needs to not copy).
ALIGNMENT = 64
#: The accuracy the demo's check asks for on the held-out split.
MIN_ACCURACY = 0.9


# -- data --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Digits:
    """A train/test split of scikit-learn's digits.

    ``x_train`` / ``x_test``: float32 (n, 64), pixel intensities 0..16 (8x8 images,
    row-major); ``y_train`` / ``y_test``: int32 (n,), classes 0..9. The arrays are
    C-contiguous and 64-byte aligned NumPy arrays owned by this object.
    """

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any


def aligned(array: Any, alignment: int = ALIGNMENT) -> Any:
    """A C-contiguous copy of ``array`` whose first byte is ``alignment``-byte aligned.

    Returns a NumPy array (same shape and dtype) that is a view into a slightly larger
    NumPy buffer; the view keeps that buffer alive, so NumPy stays the owner.
    """
    import numpy as np

    src = np.ascontiguousarray(array)
    raw = np.empty(src.nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    out = raw[start:start + src.nbytes].view(src.dtype).reshape(src.shape)
    out[...] = src
    return out


def load_digits_split(test_size: float = 0.25, seed: int = 0) -> Digits:
    """Load the digits scikit-learn ships (1797 images; no download) and split them,
    stratified, into a training set and a held-out test set (``test_size`` of the
    images; 450 with the default). Deterministic for a given ``seed``."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y)
    return Digits(
        x_train=aligned(x_train.astype(np.float32)),
        y_train=aligned(y_train.astype(np.int32)),
        x_test=aligned(x_test.astype(np.float32)),
        y_test=aligned(y_test.astype(np.int32)),
    )


# -- model -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MLPWeights:
    """A trained multi-layer perceptron: ``logits = L_k(relu(...relu(L_1(x * input_scale))))``
    with ``L_i(h) = h @ weight_i + bias_i``.

    ``layers``: tuple of (weight float32 (fan_in, fan_out), bias float32 (fan_out,));
    the first fan_in is 64 (pixels), the last fan_out is 10 (classes).
    ``input_scale``: multiplies the raw pixels (1/16 maps 0..16 to 0..1).
    """

    layers: tuple[tuple[Any, Any], ...]
    input_scale: float

    @property
    def n_inputs(self) -> int:
        return int(self.layers[0][0].shape[0])

    @property
    def n_classes(self) -> int:
        return int(self.layers[-1][0].shape[1])


def train_classifier(x: Any, y: Any, hidden: Sequence[int] = (64,), seed: int = 0,
                     max_iter: int = 300, input_scale: float = 1.0 / 16.0) -> MLPWeights:
    """Train a ReLU MLP (scikit-learn ``MLPClassifier``, Adam, softmax output) on
    ``x`` (float32 (n, 64), raw pixels 0..16) and ``y`` (int (n,), 0..9).

    Takes about a second on one CPU core. Returns the weights as float32 NumPy arrays
    (copies; scikit-learn's model is discarded). Deterministic for a given ``seed``.
    """
    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    model = MLPClassifier(hidden_layer_sizes=tuple(hidden), activation="relu", max_iter=max_iter,
                          random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(np.asarray(x, dtype=np.float64) * input_scale, np.asarray(y))
    if list(model.classes_) != list(range(len(model.classes_))):
        raise ValueError(f"expected classes 0..n-1, got {model.classes_!r}")
    layers = tuple((np.ascontiguousarray(w, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32))
                   for w, b in zip(model.coefs_, model.intercepts_))
    return MLPWeights(layers=layers, input_scale=float(input_scale))


def build_onnx_model(weights: MLPWeights, opset: int = 17) -> Any:
    """The ONNX graph of ``weights``, built with ``onnx.helper`` (no converter).

    Input ``"pixels"``: float32 (batch, 64), raw pixels. Output ``"logits"``: float32
    (batch, 10). Nodes: Mul (input scale), then per layer MatMul, Add, and Relu between
    layers. The weights are initializers (copied into the ModelProto). The model is
    checked with ``onnx.checker``.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(weights.input_scale, dtype=np.float32), "input_scale")]
    nodes = [helper.make_node("Mul", [INPUT_NAME, "input_scale"], ["h0"], name="scale")]
    current = "h0"
    last = len(weights.layers) - 1
    for i, (w, b) in enumerate(weights.layers):
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [current, f"W{i}"], [f"mm{i}"], name=f"matmul{i}"))
        out = OUTPUT_NAME if i == last else f"z{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [out], name=f"add{i}"))
        if i != last:
            nodes.append(helper.make_node("Relu", [out], [f"a{i}"], name=f"relu{i}"))
            current = f"a{i}"
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", weights.n_inputs])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", weights.n_classes])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="tensor-exchange demo")
    model.ir_version = 8  # opset 17 needs IR >= 8; ONNX Runtime 1.14 and later load it
    onnx.checker.check_model(model)
    return model


def make_session(model: Any, threads: int | None = None) -> Any:
    """An ONNX Runtime ``InferenceSession`` (CPU execution provider) for ``model`` (a
    ModelProto or its serialized bytes). ``threads``: intra-op threads (None: ONNX
    Runtime's default, one per core)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only, on stderr
    if threads is not None:
        options.intra_op_num_threads = threads
    data = model if isinstance(model, (bytes, bytearray)) else model.SerializeToString()
    return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])


# -- frameworks and hops ---------------------------------------------------------------------
class Framework(NamedTuple):
    """How the demo talks to one framework: ``importer(tx_tensor)`` is the framework's
    own DLPack import (returns its array type, sharing memory when it can);
    ``data_ptr(obj)`` is the framework's own address of element 0 of its array."""

    name: str
    importer: Callable[[Any], Any]
    data_ptr: Callable[[Any], int]


def _numpy() -> Framework:
    import numpy as np

    return Framework("numpy", np.from_dlpack, lambda a: int(a.ctypes.data))


def _onnxruntime() -> Framework:
    from onnxruntime import OrtValue

    return Framework("onnxruntime", OrtValue.from_dlpack, lambda v: int(v.data_ptr()))


def _torch() -> Framework:
    import torch

    return Framework("torch", torch.from_dlpack, lambda t: int(t.data_ptr()))


def _jax() -> Framework:
    import jax.numpy as jnp

    return Framework("jax", jnp.from_dlpack, lambda x: int(x.unsafe_buffer_pointer()))


#: Framework name -> loader of its :class:`Framework` (imports the framework lazily).
FRAMEWORKS: dict[str, Callable[[], Framework]] = {
    "numpy": _numpy,
    "onnxruntime": _onnxruntime,
    "torch": _torch,
    "jax": _jax,
}


@dataclasses.dataclass(frozen=True)
class Hop:
    """One hand-over between frameworks. ``nbytes``: bytes of the tensor moved.
    ``shared``: True only if ``producer_ptr == tx_ptr == consumer_ptr`` (one address
    seen by producer, ``exchange`` and consumer); otherwise the data were copied."""

    src: str
    dst: str
    what: str
    nbytes: int
    shared: bool
    producer_ptr: int
    tx_ptr: int
    consumer_ptr: int

    def to_json(self) -> dict[str, Any]:
        """The report's form: ``{"from", "to", "bytes", "shared"}``."""
        return {"from": self.src, "to": self.dst, "bytes": self.nbytes, "shared": self.shared}


def hop(obj: Any, src: str, dst: str, what: str = "") -> tuple[Any, Hop]:
    """Hand ``obj`` (an array of framework ``src``) to framework ``dst`` through
    ``exchange``: ``tx.from_dlpack(obj)``, then ``dst``'s own ``from_dlpack`` of that
    tx.Tensor. Returns ``dst``'s array and the :class:`Hop` record.

    Ownership: the memory stays ``src``'s. The tx.Tensor made here is dropped on return;
    the record stays live while the consumer holds our export capsule, and ``src``'s
    deleter runs once that (and every other holder) is gone.
    """
    import exchange as tx

    producer_ptr = FRAMEWORKS[src]().data_ptr(obj)
    consumer = FRAMEWORKS[dst]()
    t = tx.from_dlpack(obj)
    out = consumer.importer(t)
    consumer_ptr = consumer.data_ptr(out)
    record = Hop(src=src, dst=dst, what=what, nbytes=t.nbytes,
                 shared=producer_ptr == t.data_ptr == consumer_ptr,
                 producer_ptr=producer_ptr, tx_ptr=t.data_ptr, consumer_ptr=consumer_ptr)
    del t
    return out, record


# -- stages ------------------------------------------------------------------------------
def infer_onnxruntime(session: Any, pixels: Any) -> Any:
    """Run the ONNX model on ``pixels`` (an ``OrtValue``, float32 (batch, 64), bound
    without a copy through IO binding). Returns the ``"logits"`` output, an
    ``OrtValue`` float32 (batch, 10) that ONNX Runtime allocated and owns. The binding
    is cleared before returning, so only the caller holds ``pixels``."""
    binding = session.io_binding()
    binding.bind_ortvalue_input(INPUT_NAME, pixels)
    binding.bind_output(OUTPUT_NAME, "cpu")
    session.run_with_iobinding(binding)
    (logits,) = binding.get_outputs()
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    return logits


def postprocess_torch(logits: Any) -> Any:
    """Class probabilities: ``softmax(logits, dim=1)``. ``logits``: torch float32
    (batch, 10), only read. Returns a new torch float32 (batch, 10) tensor (PyTorch
    owns it; 64-byte aligned, writable)."""
    import torch

    with torch.no_grad():
        return torch.softmax(logits, dim=1).contiguous()


def score_jax(probs: Any, labels: Any) -> tuple[float, float]:
    """``(accuracy, mean confidence)`` of ``probs`` (JAX float32 (batch, 10)) against
    ``labels`` (JAX int32 (batch,)): the fraction of argmax predictions that are
    right, and the mean of the top probability. Both Python floats in [0, 1]; the
    JAX work is finished on return."""
    import jax.numpy as jnp

    predictions = jnp.argmax(probs, axis=1)
    accuracy = jnp.mean((predictions == labels).astype(jnp.float32))
    confidence = jnp.mean(jnp.max(probs, axis=1))
    return float(accuracy), float(confidence)


# -- the run -------------------------------------------------------------------------------
@dataclasses.dataclass
class DemoResult:
    """What a demo run found. ``accuracy`` / ``confidence``: on the held-out split, in
    [0, 1]. ``hops``: in pipeline order. ``live_records_end``: registry records made by
    this run that are still alive after the intermediates were dropped and
    ``tx.registry().collect()`` ran (0 means nothing leaked); ``records_end`` are
    their descriptions. ``live_records_peak``: records the run had alive at once,
    before the drop. ``seconds``: wall time of each phase."""

    accuracy: float
    confidence: float
    hops: list[Hop]
    live_records_end: int
    records_end: list[str]
    live_records_peak: int
    device: str
    n_train: int
    n_test: int
    seconds: dict[str, float]

    @property
    def ok(self) -> bool:
        """The demo's check: accuracy >= 0.9, every hop shared, nothing left alive."""
        return (self.accuracy >= MIN_ACCURACY and all(h.shared for h in self.hops)
                and self.live_records_end == 0)


def run_demo(*, seed: int = 0, test_size: float = 0.25, threads: int | None = None) -> DemoResult:
    """Load the digits, train the MLP, build and load the ONNX model, then run the test
    split through NumPy -> ONNX Runtime -> PyTorch -> JAX (plus the labels NumPy ->
    JAX), every hop through ``exchange`` and checked for sharing. Drops every
    intermediate, waits for the registry's pending releases, and counts the records
    this run made that are still alive. CPU only; no download; a few seconds."""
    import exchange as tx

    reg = tx.registry()
    before = {r.id for r in reg.snapshot()}
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 3)
        clock = now

    data = load_digits_split(test_size=test_size, seed=seed)
    lap("load")
    weights = train_classifier(data.x_train, data.y_train, seed=seed)
    lap("train")
    session = make_session(build_onnx_model(weights), threads=threads)
    for name in FRAMEWORKS:  # import the peers now, so "pipeline" times the hops
        FRAMEWORKS[name]()
    lap("build")

    hops: list[Hop] = []
    pixels_ort, h = hop(data.x_test, "numpy", "onnxruntime", "pixels")
    hops.append(h)
    logits_ort = infer_onnxruntime(session, pixels_ort)
    logits_torch, h = hop(logits_ort, "onnxruntime", "torch", "logits")
    hops.append(h)
    probs_torch = postprocess_torch(logits_torch)
    probs_jax, h = hop(probs_torch, "torch", "jax", "probabilities")
    hops.append(h)
    labels_jax, h = hop(data.y_test, "numpy", "jax", "labels")
    hops.append(h)
    accuracy, confidence = score_jax(probs_jax, labels_jax)
    peak = sum(1 for r in reg.snapshot() if r.id not in before)
    lap("pipeline")

    # Drop every intermediate (the consumers' arrays hold our export capsules), then
    # let the registry finish the stream-ordered releases.
    del pixels_ort, logits_ort, logits_torch, probs_torch, probs_jax, labels_jax, session
    gc.collect()
    reg.collect(timeout=10.0)
    alive = [r for r in reg.snapshot() if r.id not in before]
    lap("release")

    return DemoResult(
        accuracy=accuracy, confidence=confidence, hops=hops, live_records_end=len(alive),
        records_end=[r.describe() for r in alive], live_records_peak=peak, device="cpu",
        n_train=int(data.x_train.shape[0]), n_test=int(data.x_test.shape[0]), seconds=seconds,
    )


# -- reports -------------------------------------------------------------------------------
def report_json(result: DemoResult) -> dict[str, Any]:
    """The ``--report json`` object: ``{"accuracy": float, "hops": [{"from": str,
    "to": str, "bytes": int, "shared": bool}], "live_records_end": int, "device": str}``."""
    return {
        "accuracy": float(result.accuracy),
        "hops": [h.to_json() for h in result.hops],
        "live_records_end": int(result.live_records_end),
        "device": result.device,
    }


def print_text(result: DemoResult, file: Any = None) -> None:
    """Print the human report to ``file`` (default stdout): accuracy, one line per hop,
    the registry's live records at the end. Uses rich when it is installed."""
    file = sys.stdout if file is None else file
    verdict = "OK" if result.ok else "FAILED"
    head = (f"digits: trained on {result.n_train}, tested on {result.n_test} held-out images "
            f"({result.device})")
    score = f"accuracy {result.accuracy:.4f}   mean confidence {result.confidence:.4f}"
    registry_line = (f"registry: {result.live_records_peak} records alive during the pipeline, "
                     f"{result.live_records_end} alive at the end")
    timing = "time: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.seconds.items())
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806
    if Console is not None:
        console = Console(file=file, highlight=False)
        console.print(head)
        console.print(score)
        table = Table(title="hops (each through tx.from_dlpack)", title_justify="left")
        for col in ("from", "to", "tensor", "bytes", "address", ""):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        for h in result.hops:
            table.add_row(h.src, h.dst, h.what, str(h.nbytes), f"0x{h.tx_ptr:x}",
                          "[green]shared[/green]" if h.shared else "[red]copied[/red]")
        console.print(table)
        console.print(registry_line)
        for line in result.records_end:
            console.print("  " + line, markup=False)
        console.print(timing)
        console.print(f"[bold {'green' if result.ok else 'red'}]{verdict}[/]")
        return
    print(head, file=file)
    print(score, file=file)
    print("hops (each through tx.from_dlpack):", file=file)
    for h in result.hops:
        print(f"  {h.src:>11} -> {h.dst:<11} {h.what:<13} {h.nbytes:>8} bytes  0x{h.tx_ptr:x}  "
              f"{'shared' if h.shared else 'copied'}", file=file)
    print(registry_line, file=file)
    for line in result.records_end:
        print("  " + line, file=file)
    print(timing, file=file)
    print(verdict, file=file)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (Python and C level) to stderr meanwhile, so a
    JSON report stays the only thing on stdout whatever the libraries print."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # stdout replaced by a non-file (tests)
        fd = saved = -1
    try:
        if saved >= 0:
            sys.stderr.flush()
            os.dup2(sys.stderr.fileno(), fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved >= 0:
            sys.stdout.flush()
            os.dup2(saved, fd)
            os.close(saved)


# -- command line ------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    """The ``demo`` subcommand's options (argparse)."""
    parser.add_argument("--report", choices=("text", "json"), default="text",
                        help="text: a table for people (default); json: one JSON object on stdout")
    parser.add_argument("--seed", type=int, default=0, help="split and training seed (default 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="ONNX Runtime intra-op threads (default: one per core)")


def main(args: Any) -> int:
    """Run the demo and print its report. Exit status 0 when the check holds (accuracy
    >= 0.9, every hop shared, no record left alive), 1 otherwise."""
    if args.report == "json":
        with _stdout_to_stderr():
            result = run_demo(seed=args.seed, threads=args.threads)
        sys.stdout.write(json.dumps(report_json(result)) + "\n")
        sys.stdout.flush()
    else:
        result = run_demo(seed=args.seed, threads=args.threads)
        print_text(result)
    return 0 if result.ok else 1
