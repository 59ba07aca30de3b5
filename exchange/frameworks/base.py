"""The adapter contract shared by every framework module."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from ..errors import require_module
from ..tensor import Tensor, from_dlpack


class Adapter:
    """How one framework takes and gives tx Tensors.

    ``module``: the import name; ``pip``: the package that provides it.
    ``to_framework(t, stream)``: the framework's array over ``t``'s memory (zero-copy).
    ``from_framework(x, stream)``: ``tx.from_dlpack(x, stream=stream)``.
    ``stream_context(stream)``: a context that makes ``stream`` current in the framework
    (nothing on the CPU). ``data_ptr(x)``: address of ``x``'s element 0, to check that
    a hop shared memory. ``call(fn, args, kwargs, out, stream)``: run a stage.
    ``to_framework_fn(stream)`` / ``from_framework_fn(stream)``: the two hops with the
    stream bound, which a chain works out once and calls per batch.
    """

    name = "base"
    module = ""
    pip = ""
    #: True where the framework's own DLPack import (of a tx Tensor, ``to_framework``) and
    #: export (``__dlpack__`` of its arrays, taken by ``from_framework``) never copy, by
    #: the framework's contract: a chain then knows such a hop shared memory without
    #: reading the arrays' data pointers back every batch (see NumPy's adapter).
    zero_copy = False
    #: Bytes of alignment the framework needs for the memory it takes (0: none): its
    #: kernels abort on misaligned memory (TensorFlow: 64), or its import copies it
    #: (JAX: 64). A chain hands such a stage misaligned input as an aligned copy, reported
    #: in the hop with the reason (refused under ``tx.Chain(..., strict=True)``).
    alignment: int = 0
    #: None, or why the framework's import always copies (its DLPack import takes no
    #: view of the producer's memory): every hop into such a stage is reported as a copy
    #: with this reason, and ``tx.Chain(..., strict=True)`` refuses the stage when the
    #: chain is made.
    import_copies: str | None = None

    def load(self) -> Any:
        return require_module(self.module, f"framework {self.name!r}", f"pip install {self.pip}")

    def to_framework(self, t: Tensor, stream: Any) -> Any:
        raise NotImplementedError

    def from_framework(self, x: Any, stream: Any) -> Tensor:
        return from_dlpack(x, stream=stream if _is_ours(stream) else None)

    def data_ptr(self, x: Any) -> int | None:
        return None

    def to_framework_fn(self, stream: Any) -> Callable[[Tensor], Any]:
        """``to_framework`` with ``stream`` bound."""
        return functools.partial(self.to_framework, stream=stream)

    def from_framework_fn(self, stream: Any) -> Callable[[Any], Tensor]:
        """``from_framework`` with ``stream`` bound: ``tx.from_dlpack`` itself where no
        stream of ours is given and the adapter keeps the default ``from_framework``."""
        if type(self).from_framework is not Adapter.from_framework:
            return functools.partial(self.from_framework, stream=stream)
        if not _is_ours(stream):
            return from_dlpack
        return functools.partial(from_dlpack, stream=stream)

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        yield

    def out_kwargs(self, out: list[Any]) -> dict[str, Any]:
        """Keyword arguments that hand the caller's output buffers to the stage."""
        return {"out": out[0] if len(out) == 1 else tuple(out)}

    def call(self, fn: Any, args: list[Any], kwargs: dict[str, Any], out: list[Any] | None,
             stream: Any) -> Any:
        if out:
            kwargs = {**kwargs, **self.out_kwargs(out)}
        with self.stream_context(stream):
            return fn(*args, **kwargs)


def _is_ours(stream: Any) -> bool:
    return stream is not None and hasattr(stream, "record") and hasattr(stream, "handle")


def cuda_handle(stream: Any) -> int | None:
    """The CUDA stream handle of one of our streams, or None for host streams."""
    if stream is None:
        return None
    device = getattr(stream, "device", None)
    if device is None or str(device).startswith("cpu"):
        return None
    return int(stream.handle)
