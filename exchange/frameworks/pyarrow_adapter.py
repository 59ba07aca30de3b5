"""pyarrow stages: tx Tensors become pyarrow arrays and tensors through DLPack 1.3
(zero-copy), and pyarrow's come back through ``tx.from_dlpack``.

What a pyarrow stage receives: a ``pyarrow.Array`` for 1-D data (``pa.Array.from_dlpack``;
strided 1-D data as a compact copy, since an Array is contiguous), a ``pyarrow.Tensor``
for 0-d and N-D data (``pa.Tensor.from_dlpack``, strides kept; negative strides, which
pyarrow refuses, as a compact copy). A stage may return an Array, a Tensor or a
ChunkedArray (one chunk: zero-copy; more: ``combine_chunks()``, a copy that the hop
reports).

pyarrow is strict about read-only memory: it honours DLPack's READ_ONLY flag on import
(a Tensor over read-only memory is immutable) and exports every Array read-only (Arrow
arrays are immutable), so a pyarrow buffer never comes back writable: a stage after it
that ignores the flag (PyTorch, PaddlePaddle) gets a copy.

Refused, with TypeError before pyarrow is asked: bool (Arrow's booleans are bit-packed,
one bit a value), bfloat16, float8 and complex dtypes, which Arrow's DLPack does not
speak. An Array with nulls has no DLPack form (pyarrow raises ArrowTypeError: DLPack has
no validity bitmap); fill them first (``pyarrow.compute.fill_null``).
"""

from __future__ import annotations

from typing import Any

from ..tensor import Tensor, from_dlpack
from .base import Adapter

#: tx dtype names that pyarrow 26 imports and exports through DLPack.
DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64"})


class PyArrowAdapter(Adapter):
    name = "pyarrow"
    module = "pyarrow"
    pip = "pyarrow"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import pyarrow as pa

        if t.dtype.name not in DTYPES:
            raise TypeError(f"pyarrow's DLPack takes no {t.dtype.name} data (it takes {', '.join(sorted(DTYPES))}); "
                            "cast it in the stage before")
        if len(t.shape) == 1:
            if t.shape[0] > 0 and t.strides[0] != 1:
                # an Array is one contiguous buffer, and pyarrow checks the stride itself,
                # even of one element (which tx counts as contiguous)
                t = from_dlpack(t, copy=True)
            return pa.Array.from_dlpack(t)
        if any(s < 0 for s in t.strides):
            t = from_dlpack(t, copy=True)  # pyarrow refuses negative strides
        return pa.Tensor.from_dlpack(t)

    def from_framework(self, x: Any, stream: Any) -> Any:
        if hasattr(x, "combine_chunks") and hasattr(x, "num_chunks"):  # a ChunkedArray
            x = x.chunk(0) if x.num_chunks == 1 else x.combine_chunks()
        return from_dlpack(x)

    def data_ptr(self, x: Any) -> int | None:
        if isinstance(x, Tensor):  # a stage may return a tx Tensor
            return x.data_ptr
        try:
            if hasattr(x, "num_chunks"):  # a ChunkedArray: where its first chunk is
                if x.num_chunks == 0:
                    return None
                x = x.chunk(0)
            if hasattr(x, "buffers"):  # an Array: its data buffer, past its offset
                return int(x.buffers()[1].address) + x.offset * x.type.bit_width // 8
            return int(x.to_numpy().ctypes.data)  # a Tensor: NumPy's view of it, no copy
        except Exception:
            return None


ADAPTER = PyArrowAdapter()
