"""MLX stages (``mlx[cpu]`` on Linux): ``mx.from_dlpack`` of tx Tensors, which copies;
MLX arrays come back through ``tx.from_dlpack``, zero-copy.

MLX 0.32 on Linux copies every import into memory of its own (ml-explore/mlx#3531), so
the hop into an MLX stage is never shared and says why (``import_copies``). Since MLX
only reads what it copies, read-only tensors go to it through the immutable-consumer
view of the JAX adapter (MLX asks for legacy capsules only, which cannot say read-only).

Its import would change values silently, so the adapter does not let it:
``mx.from_dlpack`` turns float64 into float32 (1e300 becomes inf); float64 goes in through
``mx.array(..., dtype=mx.float64)`` instead. MLX has no complex128 (it would become
complex64) and no float8 arrays: TypeError. Negative strides, which MLX refuses, go as a
compact copy.

MLX arrays are immutable as exported: an in-place update (``a[0] = 1``) makes a new
buffer while an export holds the old one, so they come in read-only and immutable. The
export evaluates a lazy array first.
"""

from __future__ import annotations

from typing import Any

from ..tensor import from_dlpack
from .base import Adapter
from .jax_adapter import immutable_view
from .tensorflow_adapter import exported_data_ptr

_REFUSED = {
    "complex128": "MLX has no complex128 (its import would make it complex64)",
}


class MlxAdapter(Adapter):
    name = "mlx"
    module = "mlx.core"
    pip = "mlx[cpu]"
    import_copies = ("on Linux its DLPack import (mx.from_dlpack) makes an array in memory of its own "
                     "(MLX 0.32; ml-explore/mlx#3531)")

    def to_framework(self, t: Any, stream: Any) -> Any:
        import mlx.core as mx

        name = t.dtype.name
        if name in _REFUSED or name.startswith("float8") or name.startswith("float4"):
            raise TypeError(f"MLX cannot take {name} data: {_REFUSED.get(name, 'it has no such dtype')}")
        if any(s < 0 for s in t.strides):
            t = from_dlpack(t, copy=True)  # MLX refuses negative strides
        if name == "float64":
            return mx.array(t.numpy(), dtype=mx.float64)  # mx.from_dlpack would make it float32
        return mx.from_dlpack(immutable_view(t))

    def data_ptr(self, x: Any) -> int | None:
        return exported_data_ptr(x)


ADAPTER = MlxAdapter()
