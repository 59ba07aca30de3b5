"""argparse types shared by the ``tensor-exchange`` commands: each parses one option's
text, or raises ``argparse.ArgumentTypeError`` with the reason (argparse then prints the
command's usage and exits with status 2)."""

from __future__ import annotations

import argparse
import math
from typing import Callable

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """The argparse type of an integer from ``low`` to ``high`` (inclusive; no upper
    bound when ``high`` is None)."""
    bounds = f">= {low}" if high is None else f"from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {text!r}")
        return value

    return parse


#: An integer of 1 or more.
positive = integer(1)
#: An integer of 0 or more.
non_negative = integer(0)


def byte_size(text: str) -> int:
    """A size in bytes with an optional unit (``64M``, ``1GiB``, ``512k``), from 1 KiB to
    1 GiB."""
    units = {"k": KiB, "m": MiB, "g": GiB}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(s[-1:], 1)
    if s[-1:] in units:
        s = s[:-1]
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)") from None
    if not KiB <= value <= GiB:
        raise argparse.ArgumentTypeError(f"size {text!r} must be from 1K to 1G (one array is held at a time)")
    return value


def size_text(n: int) -> str:
    """``n`` bytes as :func:`byte_size` takes them: 64M, 1G."""
    for unit, size in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def seconds(text: str) -> float:
    """A finite number of seconds, more than 0 and at most the inspection's longest wait
    (``exchange.inspection.MAX_TIMEOUT_S``, 3600)."""
    from ..inspection import MAX_TIMEOUT_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {text!r}")
    return value


def interval(text: str) -> float:
    """Seconds between refreshes: at least 0.2 and at most 3600."""
    from ..inspection import MAX_TIMEOUT_S

    try:
        value = seconds(text)
    except argparse.ArgumentTypeError:
        value = 0.0
    if value < 0.2:
        raise argparse.ArgumentTypeError(f"must be at least 0.2 and at most {MAX_TIMEOUT_S:g} seconds, got {text!r}")
    return value


def pid(text: str) -> int:
    """A process id the kernel can name: 1 to 2**31 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if not 0 < value < 1 << 31:
        raise argparse.ArgumentTypeError(f"a process id is from 1 to {(1 << 31) - 1}, got {value}")
    return value
