"""tensor-exchange: zero-copy, stream-aware tensor exchange between frameworks over DLPack,
with one process-wide ownership registry and stream-ordered release.

>>> import numpy as np, exchange as tx
>>> a = np.arange(6, dtype=np.float32)
>>> t = tx.from_dlpack(a)           # zero-copy: shares a's memory
>>> t.data_ptr == a.ctypes.data
True
>>> np.from_dlpack(t)[2]
np.float32(2.0)

Nothing here imports CUDA modules at import time; the CUDA backend loads on first use.
"""

from __future__ import annotations

from ._dlpack_abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
)
from .borrow import borrow
from .chain import Chain, ChainResult, Stage, StageError
from .device import Device, DeviceType
from .dtypes import DType, dtype
from .errors import (
    BackendUnavailableError,
    DeviceError,
    ExchangeError,
    ExchangeWarning,
    LeakError,
    LifetimeError,
)
from .registry import Record, Registry, registry, track
from .tensor import Tensor, create_stream, empty, from_dlpack, record_stream
from .share import ShareHandle, attach, share

try:
    from importlib.metadata import version as _version

    __version__ = _version("tensor-exchange")
except Exception:  # run from a source tree
    __version__ = "0.1.0"



def __getattr__(name: str):
    # The Stream and Event protocols live in devices/base.py, which imports this
    # package: take them lazily so either package may be imported first.
    if name in ("Stream", "Event"):
        from devices import base

        return getattr(base, name)
    if name == "RayExecutor":  # Ray is optional: the module imports it only when used
        from .ray_executor import RayExecutor

        return RayExecutor
    raise AttributeError(f"module 'exchange' has no attribute {name!r}")

__all__ = [
    "DLPACK_FLAG_BITMASK_IS_COPIED",
    "DLPACK_FLAG_BITMASK_READ_ONLY",
    "DLPACK_MAJOR_VERSION",
    "DLPACK_MINOR_VERSION",
    "BackendUnavailableError",
    "Chain",
    "ChainResult",
    "Stage",
    "StageError",
    "Device",
    "DeviceError",
    "DeviceType",
    "DType",
    "Event",
    "ExchangeError",
    "ExchangeWarning",
    "LeakError",
    "LifetimeError",
    "RayExecutor",
    "Record",
    "Registry",
    "ShareHandle",
    "Stream",
    "Tensor",
    "attach",
    "borrow",
    "create_stream",
    "dtype",
    "empty",
    "from_dlpack",
    "record_stream",
    "registry",
    "share",
    "track",
]
