"""CuPy stages: ``cupy.from_dlpack`` over tx Tensors, with the stage's stream current
through ``cupy.cuda.ExternalStream``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .base import Adapter, cuda_handle


class CuPyAdapter(Adapter):
    name = "cupy"
    module = "cupy"
    pip = "cupy-cuda12x or cupy-cuda13x"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import cupy

        with self.stream_context(stream):
            return cupy.from_dlpack(t)

    def data_ptr(self, x: Any) -> int | None:
        return int(x.data.ptr) if hasattr(x, "data") and hasattr(x.data, "ptr") else None

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        handle = cuda_handle(stream)
        if handle is None:
            yield
            return
        import cupy

        with cupy.cuda.Device(stream.device.id), cupy.cuda.ExternalStream(handle, stream.device.id):
            yield


ADAPTER = CuPyAdapter()
