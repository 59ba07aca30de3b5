"""JAX stages: ``jax.dlpack.from_dlpack`` over tx Tensors.

JAX asks only for legacy capsules (it passes no ``max_version``), and a legacy capsule
cannot say read-only, so a read-only tensor would be refused (BufferError, as NumPy
does). JAX arrays are immutable, so handing JAX read-only memory is safe: the adapter
exports read-only tensors to JAX through the immutable-consumer view
(:mod:`exchange.frameworks.immutable_view`).
"""

from __future__ import annotations

from typing import Any

from .base import Adapter
from .immutable_view import immutable_view


class JaxAdapter(Adapter):
    name = "jax"
    module = "jax"
    pip = "jax"
    # XLA's CPU buffers are 64-byte aligned, and jax.dlpack.from_dlpack copies any host
    # memory that is not (seen with JAX 0.10): the chain makes that copy itself, and says
    # so. (CUDA allocations are 256-byte aligned: there only offset views are copied.)
    alignment = 64

    def to_framework(self, t: Any, stream: Any) -> Any:
        import jax.dlpack

        return jax.dlpack.from_dlpack(immutable_view(t))

    def data_ptr(self, x: Any) -> int | None:
        try:
            return int(x.unsafe_buffer_pointer())
        except Exception:
            return None


ADAPTER = JaxAdapter()
