"""One table of layouts for the one validation (exchange/layout.py, and its compiled
twin in exchange/native/capsule.c), run through capsules, ``tx.empty``, ``tx.borrow`` and
the form check of a ``tx.ShareHandle`` (exchange/sharing/protocol.py).

``python validation_cases.py`` prints, as JSON, the outcome of every case on the path
the environment selects (EXCHANGE_PURE_PYTHON); tests/cpu/test_validation.py runs it on
both paths and compares. Addresses are fixed fake ones: a layout is validated and its
record made without reading the memory, so nothing here touches them.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any, Callable

D = 0x10000  # a fake, fixed data address (never read)
TOP = 1 << 64

#: Capsule cases (unsigned ints of ``bits``): (name, shape, strides or None, bits, data,
#: byte_offset, verdict). The verdict ("ok" or "refused") is what must happen, on both paths.
CAPSULES = [
    ("issue: zero elements, row-major strides of 2**80", (0, 2**40, 2**40), None, 32, D, 0, "refused"),
    ("issue: zero elements last, valid", (2**40, 2**40, 0), None, 32, D, 0, "ok"),
    ("issue: byte_offset 2**64-8 wraps", (4,), None, 32, D, TOP - 8, "refused"),
    ("issue: negative stride reaching below 0", (2,), (-(D // 4 + 1),), 32, D, 0, "refused"),
    ("issue: 1100 dimensions", (1,) * 1100, None, 32, D, 0, "refused"),
    ("1024 dimensions", (1,) * 1024, None, 32, D, 0, "ok"),
    ("1025 dimensions", (1,) * 1025, None, 32, D, 0, "refused"),
    ("element count 2**64", (2**32, 2**32), None, 8, D, 0, "refused"),
    ("element count 2**63", (2, 2**62), None, 8, D, 0, "refused"),
    ("element count 2**62", (1, 2**62), None, 8, D, 0, "ok"),
    ("extent in bytes 2**64", (2**62,), None, 32, D, 0, "refused"),
    ("extent just below 2**63 bytes", (2**61 - 1,), None, 32, D, 0, "ok"),
    ("strides of 2**62 elements", (4, 3), (2**62, 1), 32, D, 0, "refused"),
    ("stride -2**63 over two elements", (2,), (-(2**63),), 8, D, 0, "refused"),
    ("stride -2**63 over one element", (1,), (-(2**63),), 8, D, 0, "ok"),
    ("negative extent", (-1, 3), None, 32, D, 0, "refused"),
    ("NULL data with elements", (4,), None, 32, 0, 0, "refused"),
    ("NULL data, zero elements", (0, 4), None, 32, 0, 0, "ok"),
    ("zero elements, strides meaningless", (0, 5), (2**62, -(2**62)), 32, D, 0, "ok"),
    ("zero elements, zero extent in the middle", (3, 0, 2**62), None, 8, D, 0, "ok"),
    ("zero elements, row-major stride exactly 2**63", (0, 2, 2**62), None, 8, D, 0, "refused"),
    ("negative stride inside the address space", (4,), (-1,), 32, D, 0, "ok"),
    ("byte_offset honoured", (4,), None, 32, D, 8, "ok"),
    ("last byte at 2**64-1", (3,), None, 32, TOP - 12, 0, "ok"),
    ("a byte past 2**64-1", (3,), None, 32, TOP - 8, 0, "refused"),
    ("zero elements at 2**64-1", (0,), None, 32, 0, TOP - 1, "ok"),
    ("zero elements at 2**64", (0,), None, 32, 2**63, 2**63, "refused"),
    ("0-d at the last byte", (), None, 8, TOP - 1, 0, "ok"),
]

#: tx.empty cases: (name, shape, dtype, verdict).
EMPTY = [
    ("issue: zero elements, row-major strides of 2**80", (0, 2**40, 2**40), "float32", "refused"),
    ("issue: zero elements last, valid", (2**40, 2**40, 0), "float32", "ok"),
    ("issue: 1100 dimensions", (1,) * 1100, "float32", "refused"),
    ("1024 dimensions", (1,) * 1024, "float32", "ok"),
    ("2**61 float32 elements: 2**63 bytes", (2**61,), "float32", "refused"),
    ("an extent beyond int64", (2**64,), "uint8", "refused"),
    ("negative extent", (3, -1), "float32", "refused"),
]

#: tx.borrow cases (a raw address): (name, address, shape, strides or None, dtype, verdict).
BORROW = [
    ("issue: zero elements, row-major strides of 2**80", D, (0, 2**40, 2**40), None, "float32", "refused"),
    ("issue: zero elements last, valid", D, (2**40, 2**40, 0), None, "float32", "ok"),
    ("issue: 1100 dimensions", D, (1,) * 1100, None, "float32", "refused"),
    ("issue: negative stride reaching below 0", D, (2,), (-(D // 4 + 1),), "float32", "refused"),
    ("last byte at 2**64-1", TOP - 12, (3,), None, "float32", "ok"),
    ("a byte past 2**64-1", TOP - 8, (3,), None, "float32", "refused"),
    ("an address beyond 2**64", TOP, (0,), None, "float32", "refused"),
    ("a stride beyond int64", D, (2,), (2**63,), "uint8", "refused"),
    ("extent in bytes 2**63", D, (2,), (2**62,), "uint16", "refused"),
    ("negative extent", D, (-2,), None, "float32", "refused"),
    ("address 0, zero elements", 0, (0,), None, "float32", "ok"),
]

#: tx.borrow of a DLTensor struct: (name, shape, strides or None, data, byte_offset, verdict).
DLTENSORS = [
    ("issue: byte_offset 2**64-8 wraps", (4,), None, D, TOP - 8, "refused"),
    ("issue: zero elements, row-major strides of 2**80", (0, 2**40, 2**40), None, D, 0, "refused"),
    ("issue: 1100 dimensions", (1,) * 1100, None, D, 0, "refused"),
    ("byte_offset honoured", (4,), None, D, 8, "ok"),
]

#: tx.ShareHandle cases, a float32 handle's fields forged: (name, shape, strides, offset,
#: span, kind, verdict). Only the form check runs (no process is asked).
HANDLES = [
    ("issue: zero elements, row-major strides of 2**80", (0, 2**40, 2**40), (2**80, 2**40, 1), 0, 0, "empty",
     "refused"),
    ("issue: zero elements last, valid", (2**40, 2**40, 0), (2**40, 1, 1), 0, 0, "empty", "ok"),
    ("issue: 1100 dimensions", (1,) * 1100, (1,) * 1100, 0, 4, "cpu", "refused"),
    ("issue: negative stride reaching below the memory", (2,), (-1,), 0, 8, "cpu", "refused"),
    ("negative stride inside the memory", (2,), (-1,), 4, 8, "cpu", "ok"),
    ("the last byte of the memory", (4,), (1,), 0, 16, "cpu", "ok"),
    ("a byte past the memory", (4,), (1,), 4, 16, "cpu", "refused"),
    ("offset 2**64-8", (4,), (1,), 2**64 - 8, 16, "cpu", "refused"),
    ("element count 2**64", (2**32, 2**32), (2**32, 1), 0, 2**66, "cpu", "refused"),
    ("a stride beyond int64", (2,), (2**63,), 0, 2**66, "cpu", "refused"),
    ("negative extent", (-1,), (1,), 0, 16, "cpu", "refused"),
    ("an empty handle with elements", (4,), (1,), 0, 0, "empty", "refused"),
]


def _handle_outcome(shape: tuple, strides: tuple, offset: int, span: int, kind: str) -> list:
    from exchange.sharing.protocol import PROTOCOL, check_fields

    fields = (PROTOCOL, "boot", 1, 0, b"\0tensor-exchange/1/name", 1, bytes(16), 1, kind, "cpu", "float32", shape, strides, offset,
              span, False, (), 0, 0, False)
    try:
        f = check_fields(fields)
        return ["ok", list(f.shape), list(f.strides)]
    except Exception as exc:
        return ["refused", type(exc).__name__, str(exc)]


def _outcome(make: Callable[[], Any], allocated: bool = False, struct: int = 0) -> list:
    """["ok", shape, strides, data_ptr, record address, record nbytes] or
    ["refused", exception type, message]. Addresses this process chose (an allocation's,
    ``allocated``; a DLTensor struct's, ``struct``) are given relative or named, so the
    outcomes of two processes compare."""
    try:
        with make() as t:
            base = t.data_ptr if allocated else 0
            return ["ok", list(t.shape), list(t.strides), t.data_ptr - base, t.record.address - base,
                    t.record.nbytes]
    except Exception as exc:  # the outcome is what is compared
        message = str(exc).replace(f"0x{struct:x}", "0x<struct>") if struct else str(exc)
        return ["refused", type(exc).__name__, message]


class _Held:
    """A context manager over a Tensor made now and dropped at exit."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __enter__(self) -> Any:
        self.t = self.make()
        return self.t

    def __exit__(self, *exc: Any) -> None:
        del self.t


def _dltensor(shape: tuple, strides: Any, data: int, byte_offset: int) -> tuple[int, list]:
    import ctypes

    from exchange import _dlpack_abi as abi

    keep: list = []
    t = abi.DLTensor()
    t.data, t.device.device_type, t.ndim = data or None, 1, len(shape)
    t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 32, 1
    if shape:
        dims = (ctypes.c_int64 * len(shape))(*shape)
        t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
        keep.append(dims)
    if strides is not None:
        st = (ctypes.c_int64 * len(strides))(*strides)
        t.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
        keep.append(st)
    t.byte_offset = byte_offset
    keep.append(t)
    return ctypes.addressof(t), keep


def outcomes() -> dict[str, list]:
    """Every case's outcome on this process's path, keyed "kind: name"."""
    import exchange as tx
    from dlpack_fixtures import hand_made

    out: dict[str, list] = {}
    for name, shape, strides, bits, data, offset, _ in CAPSULES:
        for versioned in (True, False):
            capsule, producer = hand_made(None, shape=shape, strides=strides, dtype_code=(1, bits, 1), data=data,
                                          byte_offset=offset, versioned=versioned)
            got = _outcome(lambda: _Held(lambda: tx.from_dlpack(capsule)))
            del capsule
            gc.collect()
            tx.registry().collect(10)
            got.append(producer.calls)  # the deleter ran exactly once, accepted or refused
            out[f"capsule{'' if versioned else ' (legacy)'}: {name}"] = got
    for name, shape, dtype, _ in EMPTY:
        out[f"empty: {name}"] = _outcome(lambda: _Held(lambda: tx.empty(shape, dtype)), allocated=True)
    for name, address, shape, strides, dtype, _ in BORROW:
        out[f"borrow: {name}"] = _outcome(lambda: tx.borrow(address, shape=shape, strides=strides, dtype=dtype))
    for name, shape, strides, data, offset, _ in DLTENSORS:
        address, keep = _dltensor(shape, strides, data, offset)
        out[f"dltensor: {name}"] = _outcome(lambda: tx.borrow(dltensor=address), struct=address)
        del keep
    for name, shape, strides, offset, span, kind, _ in HANDLES:
        out[f"handle: {name}"] = _handle_outcome(shape, strides, offset, span, kind)
    return out


def verdicts() -> dict[str, str]:
    """What each case must give ("ok" or "refused"), keyed as ``outcomes``."""
    found = {}
    for name, *_, verdict in CAPSULES:
        found[f"capsule: {name}"] = found[f"capsule (legacy): {name}"] = verdict
    for kind, table in (("empty", EMPTY), ("borrow", BORROW), ("dltensor", DLTENSORS), ("handle", HANDLES)):
        for name, *_, verdict in table:
            found[f"{kind}: {name}"] = verdict
    return found


if __name__ == "__main__":
    from exchange._core import compiled as _compiled

    NATIVE = _compiled()

    json.dump({"native": NATIVE, "outcomes": outcomes()}, sys.stdout)
