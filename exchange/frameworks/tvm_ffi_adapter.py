"""Apache TVM FFI stages: ``tvm_ffi.from_dlpack`` over tx Tensors. tvm-ffi tensors are
writable whatever DLPack's flag says, so ``tx.Chain`` gives such a stage a copy of truly
read-only memory (``IGNORES_READ_ONLY``); memory of unknown mutability (in through a
legacy capsule, read-only only because that capsule cannot say) goes through the
immutable-consumer view (:mod:`exchange.frameworks.immutable_view`), as its producer
would hand it out."""

from __future__ import annotations

from typing import Any

from .base import Adapter
from .immutable_view import immutable_view


class TvmFfiAdapter(Adapter):
    name = "tvm_ffi"
    module = "tvm_ffi"
    pip = "apache-tvm-ffi"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import tvm_ffi

        return tvm_ffi.from_dlpack(immutable_view(t))

    def data_ptr(self, x: Any) -> int | None:
        ptr = getattr(x, "data_ptr", None)
        return int(ptr) if isinstance(ptr, int) else None


ADAPTER = TvmFfiAdapter()
