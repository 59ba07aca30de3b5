"""The immutable-consumer view: how a read-only tx Tensor reaches a framework that asks
only for legacy DLPack capsules but never writes its input (JAX, tvm-ffi, ONNX Runtime
sessions).

A legacy capsule cannot say read-only, so ``Tensor.__dlpack__`` refuses to export
read-only memory through one (BufferError, as NumPy does). For a consumer that never
writes, that refusal protects nothing: the view exports through a legacy capsule all the
same. The view owns nothing; the tensor it wraps keeps the memory alive.
"""

from __future__ import annotations

from typing import Any


class ImmutableConsumerView:
    """DLPack face of a tx Tensor for a consumer that never writes."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        from ..tensor import _parse_max_version

        return self.tensor._dlpack(stream, _parse_max_version(max_version), dl_device, copy, True)


def immutable_view(t: Any) -> Any:
    """``t`` itself when writable, else its :class:`ImmutableConsumerView` (only for a
    consumer that never writes into the memory)."""
    return ImmutableConsumerView(t) if t.readonly else t
