"""Which implementation of the compiled core is in use: ``exchange._native`` (C), or
its pure-Python twin ``exchange._capsule_ctypes`` where the core is not built (no
compiler, a tree run from PYTHONPATH) or ``EXCHANGE_PURE_PYTHON=1`` asks for it.

Both give the same functions with the same results: capsules (produce, consume, our
deleters) and the registry's counters (bytes per device, the peak).
"""

from __future__ import annotations

import os
from typing import Any

impl: Any
#: Why the pure-Python path is in use ("" with the compiled core).
WHY_PURE = ""
if os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0"):
    from . import _capsule_ctypes as impl

    WHY_PURE = "EXCHANGE_PURE_PYTHON is set"
else:
    try:
        from . import _native as impl  # type: ignore[attr-defined, no-redef]
    except ImportError as exc:
        from . import _capsule_ctypes as impl

        WHY_PURE = f"the compiled core exchange._native is not built here ({exc})"

#: True when the compiled core is in use (False: the pure-Python ctypes path).
NATIVE: bool = impl.__name__.endswith("_native")
