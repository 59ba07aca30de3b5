"""Memory layout in DLPack's terms: shapes as tuples of int, strides in elements.

The bottom layer of the library, beside the ABI and the dtypes: the backends
(``exchange.devices``), capsules, Tensors and borrowing all use these, and this module
imports nothing of the library.
"""

from __future__ import annotations

__all__ = ["row_major_strides", "is_c_contiguous"]


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
