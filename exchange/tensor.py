"""``exchange.tensor``: the Tensor and the ways in, as users and the library import
them (every name this module has given stays here). Each concept lives in its own
module, and this one puts them together and gives the core its hooks, once:

- the type, ``tx.Tensor``, and ``tx.record_stream``: exchange/tensor_type.py;
- import, ``tx.from_dlpack``: exchange/importing.py;
- export, ``Tensor.__dlpack__`` beyond the hot path: exchange/exporting.py;
- allocation and streams, ``tx.empty`` and ``tx.create_stream``: exchange/allocation.py;
- the storage and the hot paths: the core seam, exchange/_core.

The DLPack rules followed are DLPack 1.3's ``python_spec.rst`` and the array API's
``__dlpack__`` / ``from_dlpack`` text, as settled in docs/design.md, "The protocol".
"""

from __future__ import annotations

from typing import Any

from . import _core
from . import capsule as _capsule
from . import registry as _registry
from ._core.rules import parse_max_version as _parse_max_version  # noqa: F401
from .allocation import (OOM_WAIT, _backend, _resolve_stream, _shape_tuple, copy_into,  # noqa: F401
                         create_stream, empty)
from .device import CPU
from .dtypes import from_dlpack_code
from .errors import LifetimeError
from .importing import _adopt_device, _allocate_for_api, _from_dlpack, from_dlpack
from .tensor_type import REPR_MAX_VALUES, Tensor, _view_of, record_stream  # noqa: F401

__all__ = ["Tensor", "from_dlpack", "empty", "record_stream", "create_stream"]


def set_pickle_hook(hook: Any) -> None:
    """``hook(tensor) -> reduction or None``, asked first by ``Tensor.__reduce__`` (Ray's
    own pickling: exchange/_ray_pickling.py)."""
    from . import tensor_type

    tensor_type._PICKLE_HOOK = hook


_REG = _registry.registry()
# The core's hooks, given once, now that the types and slow paths they name exist.
_core.wire(tensor_type=Tensor, record_type=_registry.Record, registry=_REG, begin_release=_REG._begin_release,
           note_tracked=_registry._note_tracked, where=_registry._where, slow_from_dlpack=_from_dlpack,
           validate_device=_capsule._device, validate_dtype=from_dlpack_code, lifetime_error=LifetimeError,
           cpu=CPU, allocate=_allocate_for_api, adopt_device=_adopt_device, debug=_REG.debug)
