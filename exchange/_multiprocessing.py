"""``multiprocessing`` Queues and Pipes carry a ``tx.Tensor`` with no call first, and
``import exchange`` pays nothing for it.

The reducer (``ForkingPickler.register(Tensor, ...)``) must be in place before the first
Tensor is pickled for another process, but importing ``multiprocessing.reduction``
costs about 11 ms, and the sharing machinery (exchange/sharing/: sockets, secrets)
about 25 ms more. So: when ``multiprocessing.reduction`` is already loaded, the reducer
is registered at once; otherwise a one-shot finder on ``sys.meta_path`` registers it
the moment that module finishes loading, and then removes itself. The reducer itself
imports exchange.sharing only when a Tensor is actually sent.

A send that fails leaves nothing behind: multiprocessing pickles with
``ForkingPickler.dumps`` (Queues, Pipes) and ``reduction.dump`` (a spawned Process's
arguments), and the reducer runs in the middle of that pickle, which may still fail
later (``q.put((t, lambda: 0))``). So both run in a *send* (``sending()``): the handles
pickled in it count as sent only once the whole pickle has succeeded; if it fails, the
handles the reducer made (and the shared copies they hold) are closed at once, and the
user's own handles stay unsent (exchange._current_send keeps which send runs on each thread).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from . import _current_send

_MODULE = "multiprocessing.reduction"


def _reduce_tensor(tensor: Any) -> Any:
    """multiprocessing's reducer for tx.Tensor: share it (a copy where its memory is
    private) and attach it on the other side (exchange.sharing)."""
    from .sharing import reduce_tensor

    return reduce_tensor(tensor)


def _in_send(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a pickling of multiprocessing) run as a send (see the module's docstring)."""
    def send(*args: Any, **kwargs: Any) -> Any:
        handles, pickled = None, False
        try:
            handles = _current_send.begin()
            result = function(*args, **kwargs)
            pickled = True
            return result
        finally:
            if handles is not None:
                _current_send.end(handles)
            if handles:
                from .sharing.handle import settle_send

                settle_send(handles, pickled)

    send.__wrapped__ = function  # type: ignore[attr-defined]
    send._tx_send = True  # type: ignore[attr-defined]
    return send


def _register(reduction: Any) -> None:
    from .tensor import Tensor

    reduction.ForkingPickler.register(Tensor, _reduce_tensor)
    pickler = reduction.ForkingPickler
    if not getattr(pickler.dumps, "_tx_send", False):  # once, whoever loads first
        pickler.dumps = classmethod(_in_send(pickler.__dict__["dumps"].__func__))
    if not getattr(reduction.dump, "_tx_send", False):
        reduction.dump = _in_send(reduction.dump)


class _Loader:
    """Runs the real loader of multiprocessing.reduction, then registers the reducer."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename... (tracebacks, inspect)
        return getattr(self._inner, name)


class _Watcher:
    """A meta path finder that finds nothing itself: it wraps the loader of
    multiprocessing.reduction once, then leaves sys.meta_path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        _unwatch()
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def _unwatch() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]


def install() -> None:
    """Register the Tensor reducer now if multiprocessing.reduction is loaded, else when it is."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _register(module)
    elif not any(isinstance(f, _Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())
