"""This process's runtime: its one background thread, its lazily made singletons, and
the one ordered list of its fork and exit hooks.

Owns:

* ``loop()``: the process's one background thread (``tx-runtime``), asleep in a selector
  until something happens; started on first need. Sharing (its sockets, pidfds, batched
  messages) and inspection (its listening socket and clients) register their work on it.
* ``Lazy``: a singleton made on first use, once per process: a forked child drops the
  parent's (calling its ``after_fork_in_child()``) and makes its own when next asked.
* The hooks, in three kinds: ``"before_fork"`` (in the parent, before ``os.fork``),
  ``"after_fork_in_child"`` (in the child, before anything else runs there) and
  ``"at_exit"`` (at the interpreter's exit, and at the end of a multiprocessing child,
  including a fork-started one, which ends with ``os._exit`` and skips ``atexit``). Hooks
  of one kind run by ascending ``order``, then by name: never in the order modules
  happened to be imported. The layers below give the orders the library uses; from the
  bottom up, so that in a child the lower layers are fresh before the upper ones clean up
  with them, and at exit the host streams have run their work (which may release shared
  tensors) before sharing sends its last batched messages.

This is the only module that calls ``os.register_at_fork`` or registers an exit hook with
the interpreter (tests/cpu/test_layout.py checks it). It is part of the bottom layer: the
backends (exchange.devices) use it, and it imports nothing but the standard library's
lightest modules and ``exchange.errors`` (``selectors`` loads when the thread starts).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Generic, TypeVar

from .errors import ExchangeWarning

#: The orders of the library's hooks, by layer (lower runs first, in every kind).
RUNTIME = 0       # the loop itself: in a child, a fresh selector before anyone unregisters from it
CORE = 100        # the registry and the capsule code: fresh locks and counts before anyone uses them
DEVICES = 200     # the backends' host streams: at exit, their queued work runs first
TRACING = 300     # the trace stops in a child
SHARING = 400     # fork counter, sharing server, connections to senders; at exit, the batched messages go
INSPECTION = 500  # the inspection server

KINDS = ("before_fork", "after_fork_in_child", "at_exit")


# One tuple per kind, kept sorted and replaced whole on registration: a hook run reads it
# without a lock (in a forked child, a lock another thread held at the fork stays held).
# A hook is (order, name, fn), a plain tuple, sorted by order, then name (names are unique
# per kind); a NamedTuple class would cost a third of a millisecond at import.
_HOOKS: dict[str, tuple[tuple[int, str, Callable[[], None]], ...]] = {kind: () for kind in KINDS}
_HOOKS_LOCK = threading.Lock()
_EXITED_PID = [0]  # the pid whose exit hooks have run (they run once per process)


def register(kind: str, name: str, fn: Callable[[], None], order: int) -> None:
    """Run ``fn()`` at ``kind`` (one of ``KINDS``), by ascending ``order`` (the layer
    constants above) and then ``name`` among the hooks of that kind. ``fn`` must not
    raise: an exception it lets out is reported as an ExchangeWarning and the other
    hooks still run. ValueError: an unknown kind, or ``name`` already registered for it
    (a hook is registered once, by the module that owns what it resets)."""
    if kind not in _HOOKS:
        raise ValueError(f"unknown hook kind {kind!r}; one of {KINDS}")
    with _HOOKS_LOCK:
        if any(h[1] == name for h in _HOOKS[kind]):
            raise ValueError(f"a {kind} hook named {name!r} is registered already")
        _HOOKS[kind] = tuple(sorted(_HOOKS[kind] + ((order, name, fn),), key=lambda h: (h[0], h[1])))


def hooks(kind: str) -> list[str]:
    """The names of the hooks of ``kind``, in the order they run."""
    return [name for _, name, _ in _HOOKS[kind]]


def _run(kind: str) -> None:
    for _, name, fn in _HOOKS[kind]:
        try:
            fn()
        except Exception as exc:  # one hook failing must not keep the others from running
            try:
                if not sys.is_finalizing():
                    warnings.warn(f"{kind} hook {name!r}: {type(exc).__name__}: {exc}", ExchangeWarning,
                                  stacklevel=1)
            except Exception:
                pass


def _before_fork() -> None:
    _run("before_fork")


def _after_fork_in_child() -> None:
    global _HOOKS_LOCK
    _HOOKS_LOCK = threading.Lock()  # another thread may have held it at the fork
    _run("after_fork_in_child")


def _at_exit() -> None:
    if _EXITED_PID[0] == os.getpid():
        return
    _EXITED_PID[0] = os.getpid()
    _run("at_exit")


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
# The exit hooks are registered twice and run once (the first call wins). threading's
# private _register_atexit is the only hook that runs both at a normal exit, before the
# interpreter joins its threads (a host-stream worker still inside a framework call when
# the interpreter tears down can abort the process), and at the end of a fork-started
# multiprocessing child, whose _bootstrap calls threading._shutdown() and then os._exit,
# which skips atexit. The public atexit covers an interpreter without it.
try:
    threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # none, or first imported while the interpreter shuts down
    pass
atexit.register(_at_exit)


# -- singletons ---------------------------------------------------------------------------------
T = TypeVar("T")


class Lazy(Generic[T]):
    """One ``make()`` per process, made on first ``get()`` (thread-safe). In a forked child
    the parent's object is dropped at ``order`` among the after-fork hooks: its
    ``after_fork_in_child()``, if it has one, is called (what it raises is ignored: the
    child must start), and the next ``get()`` makes the child's own."""

    def __init__(self, make: Callable[[], T], name: str, order: int) -> None:
        self._make = make
        self._value: T | None = None
        self._lock = threading.Lock()
        register("after_fork_in_child", name, self._after_fork_in_child, order)

    def get(self) -> T:
        """The object, made now if there is none (what ``make()`` raises propagates, and a
        later call tries again)."""
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._make()
                value = self._value
        return value

    def peek(self) -> T | None:
        """The object, or None if none was made (nothing is made)."""
        return self._value

    def take(self) -> T | None:
        """Forget the object and return it (None if none was made): the next ``get()``
        makes a new one."""
        with self._lock:
            value, self._value = self._value, None
        return value

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        old, self._value = self._value, None
        reset = getattr(old, "after_fork_in_child", None)
        if reset is not None:
            try:
                reset()
            except Exception:
                pass


# -- the background thread ----------------------------------------------------------------------
def close_fds(fds: "list[int] | tuple[int, ...]") -> None:
    """Close each descriptor of ``fds``, ignoring one closed already (this process's
    loop, sharing's and the sets' messages all hand descriptors back this way)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _report(exc: Exception) -> None:
    try:
        if not sys.is_finalizing():
            warnings.warn(f"tx-runtime thread: {type(exc).__name__}: {exc}", ExchangeWarning, stacklevel=2)
    except Exception:
        pass


class Loop:
    """The thread and its selector. ``post(task)`` runs ``task()`` on the thread soon;
    ``register`` watches a file object with a callback ``callback(fileobj)`` (``modify``,
    ``unregister``: from any thread); ``call_at(when, fn)`` runs ``fn()`` on the thread at
    ``time.monotonic()`` time ``when``. Callbacks, tasks and timers run one at a time on
    the thread and must not block; what they raise is reported (ExchangeWarning) and the
    thread goes on."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.selector: Any = None  # a selectors.BaseSelector once started
        self.thread: threading.Thread | None = None
        self.tasks: list[Callable[[], None]] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.wake_r = self.wake_w = -1

    def start(self) -> None:
        """Start the thread (once). All or nothing: a failure (no file descriptor left,
        say) closes what it made, so a later call starts afresh and nothing leaks."""
        with self.lock:
            if self.thread is not None:
                return
            import selectors  # here: ``import exchange`` does not load it

            selector = selectors.DefaultSelector()
            wake_r = wake_w = -1
            try:
                wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                selector.register(wake_r, selectors.EVENT_READ, self._woken)
                thread = threading.Thread(target=self._run, args=(selector,), name="tx-runtime", daemon=True)
                self.selector, self.wake_r, self.wake_w = selector, wake_r, wake_w
                thread.start()
            except BaseException:
                self.selector, self.wake_r, self.wake_w = None, -1, -1
                selector.close()
                close_fds([fd for fd in (wake_r, wake_w) if fd >= 0])
                raise
            self.thread = thread

    def _run(self, selector: Any) -> None:
        while True:
            try:
                events = selector.select(self._due())
            except (OSError, ValueError):
                return  # closed after fork
            for key, _ in events:
                try:
                    key.data(key.fileobj)
                except Exception as exc:  # the thread must survive anything
                    _report(exc)

    def _due(self) -> float | None:
        """Run the timers that are due; seconds the selector may sleep (None: until
        something happens)."""
        while True:
            with self.lock:
                if not self.timers:
                    return None
                self.timers.sort(key=lambda t: t[0])
                when, fn = self.timers[0]
                left = when - time.monotonic()
                if left > 0:
                    return left
                self.timers.pop(0)
            try:
                fn()
            except Exception as exc:
                _report(exc)

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the thread at monotonic time ``when`` (starts the thread)."""
        with self.lock:
            self.start()
            self.timers.append((when, fn))
        self.wake()

    def post(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the thread soon (starts the thread)."""
        with self.lock:
            self.start()
            self.tasks.append(task)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _woken(self, fd: int) -> None:
        try:
            os.read(fd, 4096)
        except OSError:
            pass
        with self.lock:
            tasks, self.tasks = self.tasks, []
        for task in tasks:
            try:
                task()
            except Exception as exc:
                _report(exc)

    def register(self, fileobj: Any, events: int, callback: Callable[[Any], None]) -> None:
        """Watch ``fileobj`` for ``events`` (``selectors.EVENT_READ`` ...); the thread calls
        ``callback(fileobj)`` when one happens (starts the thread)."""
        self.start()
        self.selector.register(fileobj, events, callback)

    def modify(self, fileobj: Any, events: int, callback: Callable[[Any], None]) -> None:
        """Change what a registered file object is watched for (KeyError if it is not)."""
        self.selector.modify(fileobj, events, callback)

    def unregister(self, fileobj: Any) -> None:
        """Stop watching ``fileobj`` (nothing if it was not watched)."""
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError, OSError, AttributeError):
            pass

    def on_thread(self) -> bool:
        """The caller runs on this loop's thread."""
        return self.thread is threading.current_thread()

    def after_fork_in_child(self) -> None:
        # The selector and the wake-up pipe are the parent's; the thread did not survive.
        close_fds([fd for fd in (self.wake_r, self.wake_w) if fd >= 0])
        if self.selector is not None:
            try:
                self.selector.close()
            except OSError:
                pass


_LOOP: Lazy[Loop] = Lazy(Loop, "runtime.loop", RUNTIME)


def loop() -> Loop:
    """This process's Loop (made on first use; its thread starts on first need)."""
    return _LOOP.get()
