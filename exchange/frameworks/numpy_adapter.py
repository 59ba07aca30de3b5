"""NumPy stages: arrays over tx Tensors through ``np.from_dlpack`` (CPU memory only)."""

from __future__ import annotations

from typing import Any

from .base import Adapter


class NumPyAdapter(Adapter):
    name = "numpy"
    module = "numpy"
    pip = "numpy"

    def to_framework(self, t: Any, stream: Any) -> Any:
        import numpy as np

        return np.from_dlpack(t)

    def data_ptr(self, x: Any) -> int | None:
        return int(x.ctypes.data) if hasattr(x, "ctypes") else None


ADAPTER = NumPyAdapter()
