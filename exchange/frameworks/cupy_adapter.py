"""CuPy stages: ``cupy.from_dlpack`` over tx Tensors, with the stage's stream current
through ``cupy.cuda.Stream.from_external`` (CuPy 14 deprecates ``ExternalStream``)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from .base import Adapter, cuda_handle


class _StreamProtocol:
    """``__cuda_stream__`` over a raw handle, for ``Stream.from_external``."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(cupy: Any, stream: Any) -> Any:
    """A CuPy stream object over our CUDA stream ``stream`` (not owning it), for ``with``.
    CuPy >= 14: ``Stream.from_external`` (which keeps ``stream`` alive); older CuPy:
    ``ExternalStream`` with the handle and device."""
    handle = int(stream.handle)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(stream if hasattr(stream, "__cuda_stream__") else _StreamProtocol(handle))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, stream.device.id)


class CuPyAdapter(Adapter):
    name = "cupy"
    module = "cupy"

    @property
    def pip(self) -> str:  # type: ignore[override]
        """The CuPy wheel for this machine's driver (cupy-cuda13x for a CUDA 13 driver)."""
        from exchange.devices.cuda import driver_cuda_major

        major = driver_cuda_major()
        return "cupy-cuda12x" if major == 12 else "cupy-cuda13x"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import cupy

        with self.stream_context(stream):
            return cupy.from_dlpack(t)

    def data_ptr(self, x: Any) -> int | None:
        return int(x.data.ptr) if hasattr(x, "data") and hasattr(x.data, "ptr") else None

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        if cuda_handle(stream) is None:
            yield
            return
        import cupy

        with cupy.cuda.Device(stream.device.id), cupy_stream(cupy, stream):
            yield


ADAPTER = CuPyAdapter()
