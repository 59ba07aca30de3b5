"""The compiled core's Python face: exchange._native (exchange/native/*.c) under the
seam's API (exchange/_core/__init__.py lists it), the same names and results as the
pure twin (exchange/_core/_pure/). Most names are the C functions themselves, so the
hot paths gain no Python call; the rest adapt a C call to the seam's shape. Loaded
only where the seam chose this path.
"""

from __future__ import annotations

import operator
from typing import Any

from .. import _native as _c
from .api import NAMES
from .rules import attach

# The counters of live and pending bytes, and the peak.
bytes_add, pending_add, counts, reset_counts = _c.bytes_add, _c.pending_add, _c.counts, _c.reset_counts
peak_begin, peak_end, peak_value = _c.peak_begin, _c.peak_end, _c.peak_value
# Records and holders (exchange/native/registry.c).
new_record, add_holder, remove_holder, record_gone = _c.new_record, _c.add_holder, _c.remove_holder, _c.record_gone
totals, live_records, records_alive = _c.totals, _c.live_records, _c.live_records
set_debug, set_tracking, set_note_gone, set_finalizing = _c.set_debug, _c.set_tracking, _c.set_note_gone, \
    _c.set_finalizing
# Capsules and tensors (exchange/native/capsule.c, tensor.c).
export, consume, peek = _c.export, _c.consume, _c.peek
new_tensor, new_tensors = _c.new_tensor, _c.new_tensors
bind_from_dlpack, set_method_doc = _c.bind_from_dlpack, _c.set_method_doc
consume_exchange_api = _c.consume_exchange_api
call_stage = _c.call_stage  # a chain stage's hot path
plain_task = _c.plain_task  # a pipelined chain's plain stage task (exchange/native/stagetask.c)
# Host copies (exchange/native/copy.c).
copy_streaming = _c.copy_streaming
# A host stream's work queue and its worker's loop (exchange/native/hostqueue.c).
HostQueue = _c.HostQueue
_NHOLDERS = operator.attrgetter("_nholders")


def holder_count(records: list[Any]) -> int:
    """The holders of ``records``, all together."""
    return sum(map(_NHOLDERS, records))


def make_record_type(*views: type) -> type:
    """The public Record class: a type the compiled core makes (its instances deallocate
    without Python's generic subclass machinery), with ``views`` attached."""
    return attach(_c.make_type("record"), *views)


def make_tensor_type(*views: type) -> type:
    """The public Tensor class: a type the compiled core makes (not a Python class, whose
    instances the garbage collector would track; the core refuses to make one
    directly), with ``views`` attached."""
    return attach(_c.make_type("tensor"), *views)


def setup(*, registry: Any, **hooks: Any) -> None:
    """The core's hooks (exchange._core.wire); the compiled core keeps the registry's
    hot-path state in C, so it takes no ``registry``."""
    _c.setup(**hooks)


__all__ = list(NAMES)
