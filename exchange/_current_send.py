"""Which multiprocessing send is running on this thread (exchange._multiprocessing runs
multiprocessing's pickling as sends; exchange.sharing notes in the send the handles it
pickles). Kept apart and tiny: every multiprocessing pickle passes here, with or without
a tx Tensor, and must not load the sharing machinery.
"""

from __future__ import annotations

import threading

_LOCAL = threading.local()


def sending() -> list | None:
    """The list of ``(handle, made by the reducer)`` pickled so far by the send running
    on this thread (the innermost), or None when no send runs here."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def begin() -> list:
    """Start a send on this thread; returns its list, for ``end``."""
    handles: list = []
    _LOCAL.__dict__.setdefault("stack", []).append(handles)
    return handles


def end(handles: list) -> None:
    _LOCAL.stack.remove(handles)
