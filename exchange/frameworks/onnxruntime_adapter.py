"""ONNX Runtime stages.

A stage whose function is an ``onnxruntime.InferenceSession`` runs through IO binding:
inputs are bound as OrtValues over the tx Tensors (``OrtValue.from_dlpack``, zero-copy),
outputs are bound to the caller's buffers when the stage has ``out=`` (ORT then writes
straight into them), else ORT allocates them (on the GPU of the session's CUDA execution
provider when the inputs are CUDA memory, else on the CPU) and they come back through
DLPack. Any other callable gets the inputs as OrtValues and returns OrtValues (or
anything with ``__dlpack__``).

ONNX Runtime asks for legacy capsules, which cannot say read-only; a session only reads
its inputs, so read-only tensors (Ray's object store, say) go to it through the
immutable-consumer view (:mod:`exchange.frameworks.immutable_view`) instead of being
refused. A stage function that writes into its input OrtValues (``update_inplace``)
must not get read-only memory.
"""

from __future__ import annotations

from typing import Any

from .base import Adapter
from .immutable_view import immutable_view

# ONNX tensor type string -> numpy dtype name.
_ONNX_TYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32", "tensor(int64)": "int64",
    "tensor(uint8)": "uint8", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64", "tensor(bool)": "bool", "tensor(bfloat16)": "bfloat16",
}


def is_session(fn: Any) -> bool:
    return hasattr(fn, "io_binding") and hasattr(fn, "get_outputs") and hasattr(fn, "run_with_iobinding")


class OnnxRuntimeAdapter(Adapter):
    name = "onnxruntime"
    module = "onnxruntime"
    pip = "onnxruntime"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import onnxruntime as ort

        return ort.OrtValue.from_dlpack(immutable_view(t))

    def data_ptr(self, x: Any) -> int | None:
        try:
            return int(x.data_ptr())
        except Exception:
            return None

    def check_out(self, session: Any, out: list[Any]) -> None:
        """ValueError, before anything runs, when a caller's output buffer does not fit
        the model's declared output (dtype, rank, static extents)."""
        declared = session.get_outputs()
        if len(out) != len(declared):
            raise ValueError(f"the model has {len(declared)} outputs but {len(out)} output buffers were given")
        for meta, buf in zip(declared, out):
            want = _ONNX_TYPES.get(meta.type)
            if want is not None and buf.dtype.name != want:
                raise ValueError(f"output {meta.name!r} is {want} but the buffer given is {buf.dtype.name}")
            if len(meta.shape) != len(buf.shape) or any(
                isinstance(d, int) and d != n for d, n in zip(meta.shape, buf.shape)
            ):
                raise ValueError(f"output {meta.name!r} has shape {meta.shape} but the buffer given is {buf.shape}")
            if not buf.is_contiguous():
                raise ValueError(f"output buffer for {meta.name!r} must be C-contiguous for IO binding")

    def run_session(self, session: Any, inputs: dict[str, Any], out: list[Any] | None) -> Any:
        """Run ``session`` with IO binding. ``inputs``: name -> OrtValue; ``out``: tx
        Tensors to bind the outputs to, or None. Returns the outputs (OrtValues that ORT
        allocated, or the ``out`` Tensors themselves): one value for a one-output model,
        else a tuple."""
        binding = session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        declared = session.get_outputs()
        if out:
            for meta, buf in zip(declared, out):
                device = "cpu" if buf.device.type == 1 else "cuda"
                binding.bind_output(meta.name, device, buf.device.id, buf.dtype.numpy, list(buf.shape), buf.data_ptr)
        else:
            device, device_id = _output_device(session, inputs)
            for meta in declared:
                binding.bind_output(meta.name, device, device_id)
        session.run_with_iobinding(binding)
        values = list(out) if out else binding.get_outputs()
        return values[0] if len(values) == 1 else tuple(values)


def _output_device(session: Any, inputs: dict[str, Any]) -> tuple[str, int]:
    """Where ORT allocates the outputs no buffer was given for: on the GPU of the
    session's CUDA execution provider when an input is CUDA memory, else the CPU."""
    if any(str(v.device_name()).lower() == "cuda" for v in inputs.values()):
        options = session.get_provider_options().get("CUDAExecutionProvider")
        if options is not None:
            return "cuda", int(options.get("device_id", 0))
    return "cpu", 0


ADAPTER = OnnxRuntimeAdapter()
