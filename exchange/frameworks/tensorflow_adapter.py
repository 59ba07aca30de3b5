"""TensorFlow stages: ``tf.experimental.dlpack.from_dlpack`` over tx Tensors; TensorFlow's
eager tensors come back through ``tx.from_dlpack``.

TensorFlow (tensorflow-cpu 2.21) speaks legacy capsules only, both ways: its
``from_dlpack`` takes a capsule, not an object, and its ``__dlpack__`` ignores
``max_version``. A legacy capsule cannot say read-only; TensorFlow's tensors are
immutable (its kernels never write their inputs), so read-only tensors go to it through
the immutable-consumer view of the JAX adapter, and its own tensors come in read-only
and immutable.

Its kernels need 64-byte aligned memory: one over memory that is not (a NumPy array's
buffer is 16-byte aligned) aborts the whole process (SIGABRT, ``Check failed:
IsAligned()``) at its first kernel, not at the import. Its importer also refuses
anything but compact row-major strides ("Invalid strides array from DLPack"). So a
tensor that is misaligned or not C-contiguous goes to TensorFlow as a copy into tx's own
memory (64-byte aligned, row-major); the hop reports it. float8 data is refused with
TypeError (TensorFlow's DLPack has no code for it).

Its export synchronises: ``__dlpack__`` resolves the tensor handle, waiting for the ops
that make it (on a GPU, the device); on the CPU eager ops have finished when they return,
so nothing is waited for.
"""

from __future__ import annotations

from typing import Any

from ..tensor import Tensor, from_dlpack
from .base import Adapter
from .immutable_view import immutable_view

#: Byte alignment TensorFlow's CPU kernels check (Eigen's EIGEN_MAX_ALIGN_BYTES).
ALIGNMENT = 64

_REFUSED = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                      "float4_e2m1fn"})


def needs_copy(t: Any) -> str | None:
    """Why TensorFlow cannot take ``t``'s memory as it is (a tx Tensor), or None."""
    if t.size == 0:
        return None
    if t.data_ptr % ALIGNMENT:
        return f"not {ALIGNMENT}-byte aligned (TensorFlow's kernels abort the process on such memory)"
    if not t.is_contiguous():
        return "not C-contiguous (TensorFlow's DLPack import takes compact row-major data only)"
    return None


def exported_data_ptr(x: Any) -> int | None:
    """Where element 0 of ``x`` is, read from a capsule of its own ``__dlpack__()`` (for
    frameworks with no data pointer of their own); None when it has none."""
    from .. import _core

    if isinstance(x, Tensor):  # a stage may return a tx Tensor
        return x.data_ptr
    try:
        info = _core.peek(x.__dlpack__())
        return int(info[5]) + int(info[14])
    except Exception:
        return None


#: TensorFlow dtypes whose elements are not plain bytes, which its __dlpack__ cannot export.
_NOT_PLAIN_BYTES = frozenset({"string", "resource", "variant"})


class TensorFlowAdapter(Adapter):
    name = "tensorflow"
    module = "tensorflow"
    pip = "tensorflow-cpu"
    alignment = ALIGNMENT

    def to_framework(self, t: Any, stream: Any) -> Any:
        import tensorflow as tf

        if t.dtype.name in _REFUSED:
            raise TypeError(f"TensorFlow's DLPack takes no {t.dtype.name} data; cast it in the stage before")
        if needs_copy(t) is not None:
            t = from_dlpack(t, copy=True)  # tx's memory: 64-byte aligned, row-major
        return tf.experimental.dlpack.from_dlpack(immutable_view(t).__dlpack__())

    def from_framework(self, x: Any, stream: Any) -> Any:
        # TensorFlow's own __dlpack__ aborts the process (a failed Check, SIGABRT) on a
        # tensor whose elements are not plain bytes: refuse those before asking it.
        kind = getattr(getattr(x, "dtype", None), "name", None)
        if kind in _NOT_PLAIN_BYTES:
            raise TypeError(f"a TensorFlow {kind} tensor has no DLPack form (TensorFlow aborts the process "
                            "exporting one); return numbers from the stage")
        return from_dlpack(x)

    def data_ptr(self, x: Any) -> int | None:
        return exported_data_ptr(x)


ADAPTER = TensorFlowAdapter()
