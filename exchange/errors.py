"""The library's exceptions and its one warning class.

BufferError, TypeError and ValueError are raised where the DLPack and array-API rules
name them; everything else specific to this library derives from ExchangeError.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = [
    "ExchangeError",
    "LifetimeError",
    "LeakError",
    "BackendUnavailableError",
    "DeviceError",
    "ExchangeWarning",
]


class ExchangeError(Exception):
    """Base class of every error this library defines."""


class LifetimeError(ExchangeError):
    """Memory was used outside its lifetime: a closed borrowed view, or a borrow scope
    that ended while something still held the borrowed memory."""


class LeakError(ExchangeError):
    """``tx.track()`` found records made inside its block still alive at its end."""


class BackendUnavailableError(ExchangeError, ImportError):
    """A device backend cannot load here (no driver, no package); the message says why."""


class DeviceError(ExchangeError):
    """A device call failed (for CUDA: the driver's error name and text)."""


class ExchangeWarning(UserWarning):
    """Something went wrong where raising is not allowed: a deleter, a finaliser, the reaper."""


def require_module(name: str, needed_by: str, install: str) -> Any:
    """The module ``name`` (imported once); BackendUnavailableError (an ImportError)
    saying ``needed_by`` needs it, and how to get it (``install``), where it is not
    installed or fails to import. What every optional package (Ray, prometheus_client,
    matplotlib, a framework) is loaded through."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{needed_by} needs the package {name!r}, which is not installed here ({exc}); {install}") from exc


def report_unraisable(exc: BaseException, err_msg: str, obj: Any) -> None:
    """Report ``exc``, raised where no caller can catch it (a task posted to a host stream,
    a hook of a host stream's worker), as the interpreter reports an exception in
    ``__del__``: to ``sys.unraisablehook``, given the fields ``UnraisableHookArgs`` has.
    The interpreter's own hook takes nothing but its own ``UnraisableHookArgs``, which
    Python code cannot make: with that hook in place (or a hook that raises) the report
    is written to stderr as that hook writes it. Never raises."""
    try:
        hook = sys.unraisablehook
        if hook is not sys.__unraisablehook__:
            try:
                hook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__,
                                           err_msg=err_msg, object=obj))
                return
            except BaseException:
                pass
        stream = sys.stderr
        if stream is None:
            return
        import traceback  # only here, where something went wrong

        stream.write(f"{err_msg}: {obj!r}\n" if obj is not None else f"{err_msg}\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
        stream.flush()
    except BaseException:
        pass
