"""Memory layout in DLPack's terms: shapes as tuples of int, strides in elements, sizes
and addresses in bytes; and the one validation of a layout that every way in uses.

The bottom layer of the library, beside the ABI and the dtypes: the backends
(``exchange.devices``), capsules, Tensors and borrowing all use these, and this module
imports nothing of the library.

The validation (``check_shape``, ``check_address``, ``check_layout``) is the library's
only definition of a layout it can hold; capsules on import, ``tx.empty``, ``tx.borrow``
and shared handles go through it, and the compiled core (exchange/native/capsule.c,
``check_layout``) repeats it check for check and word for word, so both paths refuse
the same inputs with the same message. What it guarantees, computed exactly (no
arithmetic that can wrap):

* at most ``MAX_NDIM`` dimensions, every extent >= 0;
* the element count and the extent in bytes fit int64 (below 2**63);
* the row-major strides fit int64, zero-element shapes included (``(2**40, 2**40, 0)``
  is fine, ``(0, 2**40, 2**40)`` is not: its first stride would be 2**80);
* element 0 (``data + byte_offset``) and every byte the view reaches lie inside the
  address space ``[0, 2**64)``.
"""

from __future__ import annotations

__all__ = ["MAX_NDIM", "row_major_strides", "is_c_contiguous", "check_ndim", "check_shape", "check_address",
           "check_layout"]

#: The most dimensions a layout may have (DLTensors, tx.empty, tx.borrow, handles);
#: exchange/native/native.h has the same limit.
MAX_NDIM = 1024

_INT64 = 1 << 63      # the first value int64 cannot hold
_ADDRESSES = 1 << 64  # one past the last address


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides in elements for ``shape``."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True for a C-contiguous (row-major) layout; strides in elements; extents of 1 and
    zero-size tensors place no constraint."""
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 0:
            return True
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def check_ndim(ndim: int, what: str = "layout", error: type[Exception] = ValueError) -> None:
    """Raise ``error`` for more than ``MAX_NDIM`` dimensions (the message starts with ``what``)."""
    if ndim > MAX_NDIM:
        raise error(f"{what}: {ndim} dimensions, more than the limit of {MAX_NDIM}; "
                    f"reshape to at most {MAX_NDIM} dimensions")


def check_shape(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int,
                what: str = "layout", error: type[Exception] = ValueError) -> tuple[tuple[int, ...], int, int]:
    """Validate ``shape`` with ``strides`` (in elements; None: row-major) for elements of
    ``itemsize`` bytes (>= 1); no address is involved yet.

    Returns ``(strides, lo, nbytes)``: the strides (row-major ones filled in), ``lo`` the
    offset in bytes from element 0 to the lowest byte the view reaches (0 or negative),
    and ``nbytes`` the bytes from that byte to the highest one reached, inclusive (0 for
    zero elements). Raises ``error`` (ValueError by default; capsules pass BufferError),
    its message starting with ``what``, for: more than ``MAX_NDIM`` dimensions, a
    negative extent, an element count, a row-major stride or an extent in bytes of
    2**63 or more, a stride outside int64.
    """
    ndim = len(shape)
    check_ndim(ndim, what, error)
    size = 1
    for n in shape:
        if n < 0:
            raise error(f"{what}: negative extent {n} in the shape; extents must be >= 0")
        size *= n
    if size >= _INT64:
        raise error(f"{what}: its element count overflows int64 (2**63 elements or more; the limit is "
                    "2**63 - 1); no device can address it")
    if strides is None:
        row = [0] * ndim
        step = 1
        for i in range(ndim - 1, -1, -1):
            if step >= _INT64:
                raise error(f"{what}: its row-major stride for dimension {i} overflows int64 (the extents "
                            "after it multiply to 2**63 or more; the limit is 2**63 - 1), even with zero "
                            "elements; use smaller extents")
            row[i] = step
            step *= max(shape[i], 1)
        strides = tuple(row)
    else:
        for s in strides:
            if not -_INT64 <= s < _INT64:
                raise error(f"{what}: stride {s} overflows int64 (the limit is -2**63 to 2**63 - 1)")
    if size == 0:
        return strides, 0, 0
    lo = hi = 0
    for n, s in zip(shape, strides):
        if s < 0:
            lo += s * (n - 1)
        else:
            hi += s * (n - 1)
    nbytes = (hi - lo + 1) * itemsize
    if nbytes >= _INT64:
        raise error(f"{what}: its extent in bytes overflows int64 (its shape and strides reach 2**63 bytes "
                    "or more; the limit is 2**63 - 1); check the strides (in elements, not bytes)")
    return strides, lo * itemsize, nbytes


def check_address(data: int, byte_offset: int, lo: int, nbytes: int, what: str = "layout",
                  error: type[Exception] = ValueError) -> tuple[int, int]:
    """Validate the addresses of a layout that ``check_shape`` passed (``lo``, ``nbytes``
    from it) at ``data + byte_offset`` (bytes). Returns ``(element0, address)``: the
    address of element 0 and of the lowest byte reached (element 0's for zero elements).

    Raises ``error`` when element 0 or any byte reached lies outside ``[0, 2**64)``.
    """
    element0 = data + byte_offset
    if not 0 <= element0 < _ADDRESSES:
        raise error(f"{what}: data 0x{data:x} + byte_offset {byte_offset} is outside the address space "
                    "[0, 2**64)")
    if nbytes == 0:
        return element0, element0
    if element0 + lo < 0:
        raise error(f"{what}: its negative strides reach {-lo} bytes below element 0 at 0x{element0:x}, "
                    "below address 0 (every byte reached must lie in [0, 2**64))")
    if element0 + lo + nbytes > _ADDRESSES:
        raise error(f"{what}: it reaches {lo + nbytes} bytes from element 0 at 0x{element0:x}, past the "
                    "last address 2**64 - 1 (every byte reached must lie in [0, 2**64))")
    return element0, element0 + lo


def check_layout(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int, data: int,
                 byte_offset: int = 0, what: str = "layout",
                 error: type[Exception] = ValueError) -> tuple[tuple[int, ...], int, int, int]:
    """``check_shape`` then ``check_address``: returns ``(strides, element0, address,
    nbytes)``, the strides in elements (row-major for None), the address of element 0,
    the lowest byte reached and the extent in bytes from there (0 for zero elements).
    Raises ``error`` as those two do."""
    strides, lo, nbytes = check_shape(shape, strides, itemsize, what, error)
    element0, address = check_address(data, byte_offset, lo, nbytes, what, error)
    return strides, element0, address, nbytes
