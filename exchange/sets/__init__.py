"""Sets: named, versioned tensor sets that any process of this user on this machine can
follow, zero-copy (docs/processes.md, "Sets").

``tx.publish``, ``tx.draft``, ``tx.subscribe``, ``tx.unpublish`` and the types ``tx.Version``,
``tx.Draft``, ``tx.Subscription``, ``tx.Snapshot``; ``stats()`` for the tools. One module
per concept: ``names`` (the directory of names and the name's lock), ``wire`` (the
messages), ``memory`` (a version's region), ``publisher``, ``subscriber``. Loaded when
first named, not by ``import exchange``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

from ..device import Device
from ..errors import ExchangeError
from ..runtime import SHARING, Lazy, register
from .memory import plan
from .names import check_name
from .publisher import MAX_LIVE_VERSIONS, Draft, Publisher, Version, copy_in
from .subscriber import Snapshot, Subscription

__all__ = ["publish", "draft", "subscribe", "unpublish", "stats", "Version", "Draft", "Subscription", "Snapshot",
           "MAX_LIVE_VERSIONS"]


class _State:
    """What this process publishes and reads (one per process: a forked child starts
    with none, and its copies of the parent's sockets and lock are closed)."""

    def __init__(self) -> None:
        self.publishers: dict[str, Publisher] = {}
        self.subscriptions: weakref.WeakSet = weakref.WeakSet()

    def after_fork_in_child(self) -> None:
        for p in self.publishers.values():
            p.after_fork_in_child()
        for s in list(self.subscriptions):
            s._lock = threading.Lock()  # (a parent's thread may have held it at the fork)
            conn = s._conn
            if conn is not None:
                conn.after_fork_in_child()
            s._conn = None


_STATE: Lazy[_State] = Lazy(_State, "sets.state", SHARING)


def _state() -> _State:
    return _STATE.get()


def _unlink_at_exit() -> None:
    # Tidiness only: the kernel drops the lock at exit anyway, and the next publisher of
    # the name replaces a socket file left behind.
    state = _STATE.peek()
    if state is not None:
        for p in list(state.publishers.values()):
            if not p.unpublished:
                p.lock.close()


register("at_exit", "sets.names", _unlink_at_exit, SHARING)


def _check_bound(max_live_versions: int | None, when_full: str, timeout: float | None) -> None:
    if max_live_versions is not None and (type(max_live_versions) is not int or max_live_versions < 1):
        raise ValueError(f"max_live_versions is an int >= 1, got {max_live_versions!r}")
    if when_full not in ("wait", "raise"):
        raise ValueError(f"when_full is 'wait' or 'raise', got {when_full!r}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout is None or seconds >= 0, got {timeout!r}")


def _publisher(name: str, max_live_versions: int | None) -> Publisher:
    state = _state()
    p = state.publishers.get(name)
    if p is not None and p.unpublished:
        p = None
    if p is None:
        p = state.publishers[name] = Publisher(name, max_live_versions or MAX_LIVE_VERSIONS)
    elif max_live_versions is not None:
        p.max_live = max_live_versions
    return p


def publish(name: str, tensors: Mapping[str, Any], *, copy: bool | None = None,
            max_live_versions: int | None = None, when_full: str = "wait",
            timeout: float | None = None) -> Version:
    """Make the next version of set ``name`` visible to every process of this user on
    this machine, atomically: a reader sees all of one version or none of it.

    ``name``: 1-64 characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..`` (ValueError).
    ``tensors``: a mapping of str to DLPack producers (tx.Tensor, NumPy, PyTorch, JAX,
    ...), all on one device: host memory, or a device whose memory channel carries
    sets (copied into an allocation its channel shares, in stream order: see
    docs/processes.md, sets on device memory); the first publish or draft fixes the
    set's device (BufferError for another later, or for memory sets cannot hold); or a
    ``tx.Draft`` of this set.
    ``copy``: None copies into the set's shared memory unless ``tensors`` is a draft
    (then no copy); False raises BufferError where a copy is needed; True always copies.

    The first publish of a name makes this process its publisher; another live process
    publishing it gets ExchangeError naming the publisher's pid (a dead one's name is
    taken over). ``max_live_versions`` (default 8, kept for later calls): the most
    versions alive at once, counting the newest, those readers still hold and drafts;
    at the bound ``when_full="wait"`` waits up to ``timeout`` seconds (None: for ever;
    TimeoutError) for readers to let go, ``"raise"`` raises ExchangeError at once.
    """
    check_name(name)
    _check_bound(max_live_versions, when_full, timeout)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors is a mapping of str to tensors, got {type(tensors).__name__}")
    if isinstance(tensors, Draft) and not copy:
        if tensors._publisher.name != name:
            raise ValueError(f"this draft is of the set {tensors._publisher.name!r}, not {name!r}")
        if max_live_versions is not None:
            tensors._publisher.max_live = max_live_versions
        return tensors.publish()  # (LifetimeError if its set was unpublished since)
    p = _publisher(name, max_live_versions)
    if copy is False:
        raise BufferError(f"publishing {name!r} needs a copy into the set's shared memory (copy=False); write into "
                          "tx.draft(name, layout) to publish without one")
    return Version(p, copy_in(p, tensors, when_full, timeout))


def draft(name: str, layout: Mapping[str, tuple], *, max_live_versions: int | None = None,
          when_full: str = "wait", timeout: float | None = None, device: Any = "cpu") -> Draft:
    """The next version of set ``name``, to write in place: a Mapping of writable
    tx.Tensors (``layout``: str -> ``(shape, dtype)``), C-contiguous, in that version's
    region on ``device`` ("cpu", or a device whose channel carries sets: the tensors
    are then ordered on the region's stream, and publish orders readers after the streams that wrote them);
    ``.publish()`` publishes it without a copy. Counts as a live version until
    published or dropped (``max_live_versions``, ``when_full``, ``timeout`` as in
    ``publish``). ExchangeError when another process publishes the name; BufferError
    for a device other than the set's, or one sets cannot hold."""
    check_name(name)
    _check_bound(max_live_versions, when_full, timeout)
    device = Device.parse(device)
    if not isinstance(layout, Mapping):
        raise TypeError(f"layout is a mapping of str to (shape, dtype), got {type(layout).__name__}")
    entries, nbytes = plan([(k, *_shape_dtype(k, v)) for k, v in layout.items()])
    p = _publisher(name, max_live_versions)
    region = p.reserve(nbytes, when_full, timeout, device)
    try:
        return Draft(p, region, entries, nbytes)
    except BaseException:
        p.unreserve(region)
        raise


def _shape_dtype(key: Any, value: Any) -> tuple:
    try:
        shape, dt = value
    except (TypeError, ValueError):
        raise TypeError(f"layout[{key!r}] is (shape, dtype), got {value!r}") from None
    return (shape, dt)


def subscribe(name: str) -> Subscription:
    """Follow set ``name``: a ``tx.Subscription`` (its publisher need not exist yet)."""
    return Subscription(name)


def unpublish(name: str) -> None:
    """Stop publishing set ``name`` (this process must be its publisher: ExchangeError
    otherwise): no new readers; its memory is freed once the last reader lets go;
    readers' next take raises LifetimeError; another process may publish the name."""
    check_name(name)
    p = _state().publishers.pop(name, None)
    if p is None or p.unpublished:
        raise ExchangeError(f"this process does not publish the set {name!r}")
    p.unpublish()


def stats() -> list[dict[str, Any]]:
    """The sets this process publishes or reads, one dict each: ``name``, ``role``
    ("publisher" or "reader"), ``version`` (the newest published, or the last taken),
    ``nbytes`` (its bytes), ``readers`` (processes connected, for a publisher),
    ``live_versions`` (versions alive: a publisher's, or those this reader holds)."""
    state = _STATE.peek()
    if state is None:
        return []
    out = [p.stats() for p in list(state.publishers.values()) if not p.unpublished]
    out += [s for s in (sub.stats() for sub in list(state.subscriptions)) if s is not None]
    return out
