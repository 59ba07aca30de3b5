"""The core seam: one small internal API for what the compiled core does, with either
the C module ``exchange._native`` (exchange/native/*.c, its Python face in
``_compiled.py``) or its pure-Python twin (``_pure/``) behind it, chosen once, at
import (``choice.py`` says how and why). Nothing outside this package asks which path
runs, except to report it: ``compiled()``, ``WHY_PURE``, ``FIX_PURE`` and
``NOT_BUILT`` (doctor, inspection, metrics, bench).

The API (both paths, the same names, arguments and results; tests/cpu/test_core_seam.py
runs one table of cases through both):

- counters: ``bytes_add(slot, delta)``, ``pending_add(slot, delta)``,
  ``counts(n) -> (live, pending)`` (bytes per device slot), ``peak_begin()``,
  ``peak_end() -> bytes``, ``peak_value()``, ``reset_counts()``;
- records: ``make_record_type(*views)``, ``new_record(device, address, nbytes,
  origin, kind, release, owner, label, holder) -> (record, token)``,
  ``add_holder(record, description) -> token``, ``remove_holder(record, token)`` (the
  last holder starts the release), ``record_gone(record)``, ``totals()``,
  ``live_records()`` (oldest first), ``records_alive()`` (any order),
  ``holder_count(records)``, ``set_debug``, ``set_tracking``, ``set_note_gone``;
- capsules: ``export(record, data, device_type, device_id, code, bits, shape,
  strides, versioned, flags) -> capsule``, ``consume(capsule, producer, owner,
  stream) -> Tensor``, ``peek(capsule)``, ``set_finalizing()``;
- tensors: ``make_tensor_type(*views)``, ``new_tensor(record, token, data_ptr, shape,
  strides, dtype, readonly, stream)``, ``new_tensors(record, base, entries,
  readonly) -> list`` (a Tensor per ``(offset, shape, strides, dtype)``, each a new
  holder), ``bind_from_dlpack(doc) -> from_dlpack``,
  ``set_method_doc(name, doc)``, ``consume_exchange_api(x)`` (None: not taken);
- a chain stage's hot path: ``call_stage(fn, arg, tensor, hops, template, acc,
  index)`` (``(template, tensor's nbytes)`` appended to ``hops``, then ``fn(arg)``,
  its milliseconds added to ``acc[index]``; returns its result), and ``plain_task(...)``,
  a pipelined chain's task for one plain stage (exchange/chain_pipeline.py's ``slow``
  task, given back as it is by the pure twin; the compiled core's runs its taken path
  in C);
- host streams: ``HostQueue()``, an ordered work queue and its one worker's loop
  (``put(fn, args, tag)``, ``put_in(context, fn, *args)``: False once closed;
  ``close()``; ``run(on_stop, on_error, drop)``; ``after_fork()``; ``seq``, ``done``,
  ``pending``, ``closed``, ``dropping``);
- copies: ``copy_streaming(dst, src, nbytes)`` (addresses, not overlapping; large
  copies store past the cache on the compiled path, a memmove on the pure one);
- ``wire(**hooks)``: the one place the core gets its hooks (the Tensor and Record
  types, the slow paths, validation), called once by exchange.tensor when everything
  is defined (the seam imports nothing above it).

The release rules: the no-stream release and a record leaving the live set are each
written once per path (exchange/native/registry.c; ``_pure/records.py``); the
stream-ordered release is the registry's, shared (exchange/registry.py); running a
release and reporting its failure, once in Python (``rules.py``) and once in C.
"""

from __future__ import annotations

from typing import Any

from .choice import FIX_PURE, IGNORE_MISSING_CORE, NOT_BUILT, NOT_BUILT_NOTE, WHY_PURE, impl
from .choice import NATIVE as _COMPILED

if _COMPILED:
    from ._compiled import *  # noqa: F403
    from ._compiled import __all__ as _API
    from ._compiled import setup as _setup
else:
    from ._pure import *  # type: ignore[assignment]  # noqa: F403
    from ._pure import __all__ as _API
    from ._pure import setup as _setup


def compiled() -> bool:
    """True when the compiled core runs (False: the pure-Python twin). For reporting
    only: the seam's API behaves the same on both paths."""
    return _COMPILED


def wire(**hooks: Any) -> None:
    """Give the core its hooks, once (exchange/tensor.py, when the types and slow paths
    exist): ``tensor_type``, ``record_type``, ``registry``, ``begin_release``,
    ``note_tracked``, ``where``, ``slow_from_dlpack``, ``validate_device``,
    ``validate_dtype``, ``lifetime_error``, ``cpu``, ``allocate``, ``adopt_device``,
    ``debug``. Both paths take the same; the compiled core keeps them in C, the pure twin
    in its modules. The core's warnings are ``rules.warn``'s on both."""
    from .rules import warn

    _setup(warn=warn, **hooks)


__all__ = [*_API, "compiled", "wire", "WHY_PURE", "FIX_PURE", "NOT_BUILT", "NOT_BUILT_NOTE",
           "IGNORE_MISSING_CORE", "impl"]
