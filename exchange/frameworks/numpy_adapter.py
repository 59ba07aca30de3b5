"""NumPy stages: arrays over tx Tensors through ``np.from_dlpack`` (CPU memory only)."""

from __future__ import annotations

from typing import Any, Callable

from .base import Adapter


class NumPyAdapter(Adapter):
    name = "numpy"
    module = "numpy"
    pip = "numpy"
    # np.from_dlpack makes a view of the producer's memory or raises (it copies only when
    # asked, copy=True, which the chain never passes), and ndarray.__dlpack__ exports the
    # array's own buffer or raises: NumPy hops share memory by NumPy's contract, so the
    # chain does not read the pointers back (a ctypes call of about 1-2 us each).
    zero_copy = True

    def to_framework(self, t: Any, stream: Any) -> Any:
        import numpy as np

        return np.from_dlpack(t)

    def to_framework_fn(self, stream: Any) -> Callable[[Any], Any]:
        import numpy as np

        return np.from_dlpack

    def data_ptr(self, x: Any) -> int | None:
        try:
            return int(x.ctypes.data)
        except AttributeError:  # not a NumPy array
            return None


ADAPTER = NumPyAdapter()
