"""The pure-Python twin of the compiled core (exchange/native/), behind the same API
(exchange/_core/__init__.py lists it): ``capsules`` (the ctypes layer: our exports'
structs, reading and renaming capsules, the byte and record counters), ``records``
(records, holders, the no-stream release), ``tensors`` (a Tensor's storage, export,
consume, from_dlpack's hot path), ``copy`` (host copies), ``hostqueue`` (a host
stream's work queue and its worker's loop). Loaded only where the seam
chose this path.
"""

from __future__ import annotations

from typing import Any

from . import records as _records
from . import tensors as _tensors
from .capsules import (bytes_add, counts, peak_begin, peak_end, peak_value, peek, pending_add, reset_counts,
                       set_finalizing)
from .copy import copy_streaming
from .hostqueue import HostQueue
from .records import (add_holder, holder_count, live_records, make_record_type, new_record, record_gone,
                      records_alive, remove_holder, set_debug, set_note_gone, set_tracking, totals)
from .tensors import (bind_from_dlpack, call_stage, consume, consume_exchange_api, export, make_tensor_type, new_tensor,
                      new_tensors, plain_task, set_method_doc)
from ..api import NAMES


def setup(**hooks: Any) -> None:
    """The core's hooks, the same the compiled core's ``setup`` takes (exchange._core.wire)."""
    _records.setup(**hooks)
    _tensors.setup(**hooks)


__all__ = list(NAMES)
