"""tensor-exchange: zero-copy, stream-aware tensor exchange between frameworks over DLPack,
with one process-wide ownership registry and stream-ordered release.

>>> import numpy as np, exchange as tx
>>> a = np.arange(6, dtype=np.float32)
>>> t = tx.from_dlpack(a)           # zero-copy: shares a's memory
>>> t.data_ptr == a.ctypes.data
True
>>> np.from_dlpack(t)[2]
np.float32(2.0)

Nothing here imports CUDA modules at import time; the CUDA backend loads on first use,
and chaining, sharing across processes and Ray load when first named.
"""

from __future__ import annotations

from . import _checkout_devices

_checkout_devices.install(__path__[0])  # exchange.devices in a checkout run from PYTHONPATH

from ._dlpack_abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
)
from ._version import __version__
from .borrow import borrow
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
from . import _multiprocessing, _ray_pickling

_multiprocessing.install()  # Queues and Pipes carry tx Tensors, with no call first
_ray_pickling.install()  # and so does Ray's own pickling, under the user's own ray.init()

# Loaded on first use, so that ``import exchange`` pays only for the core: chaining
# (dataclasses, the framework adapters), sharing across processes (sockets, secrets),
# Ray, and the backends' protocols (which import this package).
_LAZY = {
    "Chain": ".chain", "ChainResult": ".chain", "Stage": ".chain", "StageError": ".chain",
    "ShareHandle": ".sharing", "share": ".sharing", "attach": ".sharing",
    "RayExecutor": ".ray.executor",
    "serve_inspection": ".inspection",
    "trace": ".tracing",
    "publish": ".sets", "draft": ".sets", "subscribe": ".sets", "unpublish": ".sets",
    "Version": ".sets", "Draft": ".sets", "Subscription": ".sets", "Snapshot": ".sets",
    "Stream": ".devices.base", "Event": ".devices.base",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'exchange' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "Draft",
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
    "Snapshot",
    "Stream",
    "Subscription",
    "Tensor",
    "Version",
    "attach",
    "borrow",
    "create_stream",
    "draft",
    "dtype",
    "empty",
    "from_dlpack",
    "publish",
    "record_stream",
    "registry",
    "serve_inspection",
    "share",
    "subscribe",
    "trace",
    "track",
    "unpublish",
]


def _serve_inspection_if_asked() -> None:
    """EXCHANGE_INSPECT=1 (or true, yes, on; any case): serve this process's registry to
    ``tensor-exchange top PID`` from import on (exchange/inspection.py). Unset, empty, 0,
    false, no, off: not. Any other value, or a failure to serve, warns (ExchangeWarning),
    never fails the import."""
    import os

    value = os.environ.get("EXCHANGE_INSPECT", "")
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return
    if value.strip().lower() not in ("1", "true", "yes", "on"):
        import warnings

        warnings.warn(f"EXCHANGE_INSPECT={value!r} is not one of 1, true, yes, on (serve inspection) or 0, false, "
                      "no, off, empty (do not): not serving", ExchangeWarning, stacklevel=2)
        return
    try:
        from .inspection import serve_inspection as serve

        serve()
    except Exception as exc:
        import warnings

        warnings.warn(f"EXCHANGE_INSPECT is set but this process cannot serve inspection ({exc})", ExchangeWarning,
                      stacklevel=2)


_serve_inspection_if_asked()
