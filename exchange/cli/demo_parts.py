"""The pieces of ``tensor-exchange demo`` that its in-process run (exchange/cli/demo.py)
and its Ray run (``--ray``, exchange/cli/demo_ray.py) share: the digits data, the MLP and
its ONNX model, the stage functions, the progress display and the hop and stdout helpers.

Both programs import them from here, so neither imports the other for them (demo.py
only hands ``--ray`` on to demo_ray.py). ``exchange.cli.demo`` still offers every name
it offered before under its own name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
import warnings
from typing import Any, Iterator, Sequence

__all__ = [
    "INPUT_NAME", "OUTPUT_NAME", "ALIGNMENT", "MIN_ACCURACY", "HOP_TENSORS",
    "Digits", "aligned", "load_digits_split", "split_batches",
    "MLPWeights", "train_classifier", "build_onnx_model", "make_session",
    "make_scale", "softmax_torch", "argmax_jax", "pip_hint", "Laps", "rich_table", "run_json",
]

#: ONNX graph input: float32 (batch, 64), pixel intensities (scaled to 0..1 by the demo).
INPUT_NAME = "pixels"
#: ONNX graph output: float32 (batch, 10), unnormalised class scores.
OUTPUT_NAME = "logits"
#: Byte alignment the demo gives NumPy arrays it hands on (what JAX needs to not copy).
ALIGNMENT = 64
#: The accuracy the demo's check asks for on the held-out split.
MIN_ACCURACY = 0.9
#: What each hop of a batch carries, in the order of the hops: into each stage, the two
#: outputs of the last one, then the two outputs taken for scoring.
HOP_TENSORS = ("pixels", "scaled pixels", "logits", "probabilities", "predictions", "confidence",
               "predictions", "confidence")


# -- data ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Digits:
    """A train/test split of scikit-learn's digits.

    ``x_train`` / ``x_test``: uint8 (n, 64), pixel intensities 0..16 (8x8 images,
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
        x_train=aligned(x_train.astype(np.uint8)),
        y_train=aligned(y_train.astype(np.int32)),
        x_test=aligned(x_test.astype(np.uint8)),
        y_test=aligned(y_test.astype(np.int32)),
    )


def split_batches(array: Any, n: int) -> list[Any]:
    """``array`` split along its first axis into ``n`` nearly equal batches (the first
    ones one row longer when it does not divide), each a C-contiguous, 64-byte aligned
    NumPy array (a view when the slice already is, else an aligned copy)."""
    import numpy as np

    if not 1 <= n <= array.shape[0]:
        raise ValueError(f"cannot split {array.shape[0]} rows into {n} batches")
    out = []
    for part in np.array_split(array, n):
        out.append(part if part.flags.c_contiguous and part.ctypes.data % ALIGNMENT == 0 else aligned(part))
    return out


# -- model -----------------------------------------------------------------------------
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
    ``x`` ((n, 64), raw pixels 0..16, any real dtype) and ``y`` (int (n,), 0..9).

    Runs on one BLAS thread: 2 to 4 s on a busy 2-core machine. Returns the weights as
    float32 NumPy arrays (copies; scikit-learn's model is discarded). Deterministic for a
    given ``seed``.
    """
    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from threadpoolctl import threadpool_limits  # a requirement of scikit-learn's

    model = MLPClassifier(hidden_layer_sizes=tuple(hidden), activation="relu", max_iter=max_iter,
                          random_state=seed)
    # One BLAS thread: the matrices are small (64 wide), and on a loaded 2-core machine
    # OpenBLAS's second thread made the fit 2 to 8 times slower (4 to 17 s, not 2 to 4).
    with warnings.catch_warnings(), threadpool_limits(limits=1, user_api="blas"):
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(np.asarray(x, dtype=np.float64) * input_scale, np.asarray(y))
    if list(model.classes_) != list(range(len(model.classes_))):
        raise ValueError(f"expected classes 0..n-1, got {model.classes_!r}")
    layers = tuple((np.ascontiguousarray(w, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32))
                   for w, b in zip(model.coefs_, model.intercepts_))
    return MLPWeights(layers=layers, input_scale=float(input_scale))


def build_onnx_model(weights: MLPWeights, opset: int = 17, scale_input: bool = True) -> Any:
    """The ONNX graph of ``weights``, built with ``onnx.helper`` (no converter).

    Input ``"pixels"``: float32 (batch, 64): raw pixels, or pixels already multiplied
    by ``weights.input_scale`` when ``scale_input`` is False. Output ``"logits"``:
    float32 (batch, 10). Nodes: Mul (the input scale, only with ``scale_input``), then
    per layer MatMul, Add, and Relu between layers. The weights are initializers
    (copied into the ModelProto). The model is checked with ``onnx.checker``.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits: list[Any] = []
    nodes: list[Any] = []
    current = INPUT_NAME
    if scale_input:
        inits.append(numpy_helper.from_array(np.array(weights.input_scale, dtype=np.float32), "input_scale"))
        nodes.append(helper.make_node("Mul", [INPUT_NAME, "input_scale"], ["h0"], name="scale"))
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


def make_session(model: Any, threads: int | None = None, device: str = "cpu", stream: Any = None) -> Any:
    """An ONNX Runtime ``InferenceSession`` for ``model`` (a ModelProto or its serialized
    bytes). ``threads``: intra-op threads (None: ONNX Runtime's default, one per core).
    ``device``: ``"cpu"`` (CPU execution provider) or ``"cuda"`` / ``"cuda:N"`` (CUDA
    execution provider on GPU N, with the CPU one as fallback); ``stream``: on CUDA, a
    tx CUDA stream the session runs its work on (``user_compute_stream``), so the
    chain's stream handshake orders it."""
    import onnxruntime as ort

    from ..device import Device, DeviceType

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only, on stderr
    if threads is not None:
        options.intra_op_num_threads = threads
    dev = Device.parse(device)
    providers: list[Any] = ["CPUExecutionProvider"]
    if dev.type == DeviceType.kDLCUDA:
        cuda_options: dict[str, str] = {"device_id": str(dev.id)}
        if stream is not None:
            cuda_options["user_compute_stream"] = str(int(stream.handle))
        providers.insert(0, ("CUDAExecutionProvider", cuda_options))
    data = model if isinstance(model, (bytes, bytearray)) else model.SerializeToString()
    return ort.InferenceSession(data, sess_options=options, providers=providers)


# -- stages ----------------------------------------------------------------------------
def make_scale(scale: float) -> Any:
    """The first stage: ``pixels`` (uint8 (batch, 64), a NumPy array on the CPU or a
    CuPy array on CUDA) to a new float32 (batch, 64) array of the same framework,
    multiplied by ``scale``."""

    def scale_pixels(pixels: Any) -> Any:
        x = pixels.astype("float32")
        x *= scale
        return x

    return scale_pixels


def softmax_torch(logits: Any) -> Any:
    """Class probabilities: ``softmax(logits, dim=1)``. ``logits``: torch float32
    (batch, 10), only read (it is ONNX Runtime's read-only output). Returns a new torch
    float32 (batch, 10) tensor (PyTorch owns it; 64-byte aligned on the CPU)."""
    import torch

    with torch.no_grad():
        return torch.softmax(logits, dim=1)


@functools.lru_cache(maxsize=1)
def _argmax_jit() -> Any:
    import jax
    import jax.numpy as jnp

    def argmax(probs: Any) -> tuple[Any, Any]:
        return jnp.argmax(probs, axis=1).astype(jnp.int32), jnp.max(probs, axis=1)

    return jax.jit(argmax)


def argmax_jax(probs: Any) -> tuple[Any, Any]:
    """``(predictions, confidence)`` for ``probs`` (JAX float32 (batch, 10)):
    predictions int32 (batch,), the argmax class; confidence float32 (batch,), the top
    probability. Compiled with ``jax.jit`` (once per batch shape)."""
    return _argmax_jit()(probs)


# -- running and reporting -------------------------------------------------------------
def pip_hint(extra: str) -> str:
    """The command that installs ``extra`` into the environment running this program:
    its own interpreter's pip (a bare ``pip`` may be another environment's, or the system's)."""
    import shlex

    return f"{shlex.quote(sys.executable)} -m pip install 'tensor-exchange[{extra}]'"


class Laps:
    """The wall time of each phase of a demo run: ``lap(name)`` ends the phase that
    began at the previous lap (or when this was made) and files it in ``seconds`` (name
    -> seconds, rounded to the millisecond, in the order the phases ran)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._clock, 3)
        self._clock = now


def run_json(result: Any) -> dict[str, Any]:
    """What every demo report's JSON says of the chain's run (``result``: a DemoResult or
    a RayDemoResult): ``batches``, ``stages`` (name, framework, ms over all batches),
    ``peak_live_bytes`` and ``stage_output_bytes_total`` (bytes), ``chain_ms`` (the
    chain's wall time, milliseconds) and ``seconds`` (each phase's wall time)."""
    return {
        "batches": int(result.batches),
        "stages": [{"name": s["name"], "framework": s["framework"], "ms": float(s["ms"])} for s in result.stages],
        "peak_live_bytes": int(result.peak_live_bytes),
        "stage_output_bytes_total": int(result.stage_output_bytes_total),
        "chain_ms": float(result.chain_ms),
        "seconds": {k: float(v) for k, v in result.seconds.items()},
    }


def rich_table() -> Any:
    """rich's ``Table`` class for a report's tables, or None where rich is not installed
    (the report is then plain text)."""
    try:
        from rich.table import Table
    except ImportError:
        return None
    return Table


class _Phases:
    """The demo's phases shown on stderr as they run: rich's progress display where rich
    is installed and stderr is a terminal; elsewhere (a pipe, a file, rich missing) two
    lines per phase, ``demo: NAME ...`` when it starts and ``demo: NAME (S s)`` when it
    ends, so that a slow phase never leaves stderr silent and each says what it took.
    Nothing when not ``enabled``. ``tensor-exchange demo`` and ``--ray`` both show their
    phases through this, in text and in JSON mode alike (stdout has the report only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._rich: Any = None
        self._task: Any = None
        self._started = 0.0
        self._name = ""
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TimeElapsedColumn

                self._rich = Progress(SpinnerColumn(), "{task.description}", BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True))
            except ImportError:
                self._rich = None

    def __enter__(self) -> "_Phases":
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()

    @contextlib.contextmanager
    def phase(self, name: str, total: int = 1) -> Iterator[None]:
        """One phase, ``total`` steps long (see :meth:`step`): said when it starts and
        marked done, with its seconds, when it ends."""
        if not self.enabled:
            yield
            return
        self._name, self._started = name, time.perf_counter()
        if self._rich is not None:
            self._task = self._rich.add_task(name, total=total)
        else:
            print(f"demo: {name} ...", file=sys.stderr, flush=True)
        yield
        if self._rich is not None:
            self._rich.update(self._task, completed=total)
        else:
            print(f"demo: {name} ({time.perf_counter() - self._started:.2f} s)", file=sys.stderr, flush=True)

    def step(self) -> None:
        if self._rich is not None and self._task is not None:
            self._rich.advance(self._task)


#: The width rich lays a report out in where its file is not a terminal: wide enough that
#: no table is squeezed (a table takes the width it needs, no more).
_PIPE_WIDTH = 10_000


def _report_console(file: Any) -> Any:
    """A rich Console that prints a report to ``file``: on a terminal, at its width (rich
    wraps long lines between words there); elsewhere (a pipe, a file) no line is wrapped
    or cut (``soft_wrap``) and tables get the width they need, so a sentence stays one
    line for ``grep`` and friends, and no colour codes are written."""
    from rich.console import Console

    class ReportConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich's own exits with status 1; the caller says the verdict instead
            self.quiet = True
            raise BrokenPipeError("the reader of the report has gone")

    if hasattr(file, "isatty") and file.isatty():
        return ReportConsole(file=file, highlight=False)
    return ReportConsole(file=file, highlight=False, soft_wrap=True, width=_PIPE_WIDTH)


def _merge_hops(batch_hops: list[list[dict[str, Any]]],
                names: Sequence[str] = HOP_TENSORS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-position hops over all batches (bytes summed, shared in all, the first reason
    a batch gave for not sharing; ``tensor`` from ``names`` where a hop has none), and
    the hops that did not share (with ``"batch"``)."""
    merged = [dict(h) for h in batch_hops[0]]
    for m, name in zip(merged, names):
        m.setdefault("tensor", name)
    unshared = []
    for b, hops in enumerate(batch_hops):
        if [(h["from"], h["to"]) for h in hops] != [(h["from"], h["to"]) for h in merged]:
            raise RuntimeError(f"batch {b} took another path through the chain: {hops}")
        for m, h in zip(merged, hops):
            if b:
                m["bytes"] += h["bytes"]
                m["shared"] = m["shared"] and h["shared"]
                if not h["shared"] and h.get("reason") and "reason" not in m:
                    m["reason"] = h["reason"]
            if not h["shared"]:
                unshared.append({**h, "batch": b})
    return merged, unshared


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

