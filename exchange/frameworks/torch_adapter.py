"""PyTorch stages: ``torch.from_dlpack`` over tx Tensors; on CUDA the stage's stream is
made current with ``torch.cuda.stream(torch.cuda.ExternalStream(handle))``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..tensor import Tensor
from .base import Adapter, cuda_handle


class TorchAdapter(Adapter):
    name = "torch"
    module = "torch"
    pip = "torch"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import torch

        if any(s < 0 for s in t.strides):
            # PyTorch cannot hold negative strides; 2.13 aborts the process on them
            # (pytorch#188023). Hand it a compact copy instead: the hop shows as copied.
            from ..tensor import from_dlpack

            t = from_dlpack(t, copy=True)
        with self.stream_context(stream):
            return torch.from_dlpack(t)

    def data_ptr(self, x: Any) -> int | None:
        if isinstance(x, Tensor):  # a stage may return a tx Tensor: data_ptr is an int there
            return x.data_ptr
        try:
            return int(x.data_ptr())
        except (AttributeError, RuntimeError):  # not a tensor, or one without storage (sparse)
            return None

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        handle = cuda_handle(stream)
        if handle is None:
            yield
            return
        import torch

        device = torch.device("cuda", stream.device.id)
        with torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device)):
            yield


ADAPTER = TorchAdapter()
