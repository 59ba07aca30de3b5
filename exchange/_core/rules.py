"""Rules both paths of the core share, written once, in Python: how a release is run
(and its failure reported), the warning the core gives, how ``max_version`` is read,
and how the compiled core's classes get their Python attributes.

The compiled core does the same steps in C on its hot paths (exchange/native/); these
are the Python side's one copy, used by the pure path's hot paths and by the paths
both share (the stream-ordered release in exchange/registry.py, the export slow path).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any


def warn(message: str) -> None:
    """An ExchangeWarning, never an exception (a release or a deleter calls this), and
    nothing at all once the interpreter is finalizing."""
    from ..errors import ExchangeWarning

    try:
        if sys.is_finalizing():
            return
        warnings.warn(message, ExchangeWarning, stacklevel=2)
    except Exception:
        pass


def run_release(record: Any, release: Any) -> None:
    """Run a record's release: ``release()``, or ``(function, *args)`` (the import hot
    path's producer deleter). A failure becomes a warning naming the record: a release
    never raises into a deleter."""
    try:
        if type(release) is tuple:
            release[0](*release[1:])
        else:
            release()
    except BaseException as exc:
        warn(f"release of record #{record.id} failed ({type(exc).__name__}: {exc}); the memory may have leaked")


def parse_max_version(max_version: Any) -> bool:
    """True for a versioned capsule. TypeError unless None or a 2-tuple of ints."""
    if max_version is None:
        return False
    if type(max_version) is tuple and len(max_version) == 2 and type(max_version[0]) is int \
            and type(max_version[1]) is int:
        return max_version[0] >= 1
    if (not isinstance(max_version, tuple) or len(max_version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in max_version)):
        raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, got {max_version!r}")
    return max_version[0] >= 1


def attach(to: type, *views: type) -> type:
    """Give class ``to`` (made by the compiled core) the Python attributes of ``views``."""
    for view in views:
        for name, value in vars(view).items():
            if name not in ("__dict__", "__weakref__", "__module__", "__qualname__", "__slots__"):
                setattr(to, name, value)
    return to
