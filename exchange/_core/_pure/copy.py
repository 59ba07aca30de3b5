"""The pure-Python twin of exchange/native/copy.c: ``copy_streaming`` is a plain
``memmove`` here (the same bytes; ctypes lets the GIL go while it runs). The compiled
core streams large copies past the cache, which Python cannot ask for."""

from __future__ import annotations

import ctypes
import operator


def copy_streaming(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` bytes from address ``src`` to address ``dst`` (not overlapping).
    ValueError for a negative size or a null address."""
    nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise ValueError(f"copy_streaming: nbytes must be >= 0, got {nbytes}")
    if nbytes and (not dst or not src):
        raise ValueError("copy_streaming: a null address")
    ctypes.memmove(dst, src, nbytes)
