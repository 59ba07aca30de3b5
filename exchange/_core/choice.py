"""Which path the core seam runs, chosen once, at import: the compiled core
``exchange._native`` (C), or its pure-Python twin (``exchange._core._pure``) where the
core is not built (no compiler, a tree run from PYTHONPATH) or ``EXCHANGE_PURE_PYTHON=1``
asks for it. This module owns that choice and its reasons; ``exchange._core`` owns the
API both paths give.

A build that could not compile the core left a note beside the package (setup.py's
``_native_not_built.json``: the reason and the fix). Then the first import warns once
(an ExchangeWarning naming the reason and the fix) unless ``EXCHANGE_PURE_PYTHON=1``
chose the pure path or ``EXCHANGE_IGNORE_MISSING_CORE=1`` silences it; ``WHY_PURE`` and
``FIX_PURE`` (what ``tensor-exchange doctor`` prints) give the recorded reason.
"""

from __future__ import annotations

import os
from typing import Any

#: The module behind the path: exchange._native, or the pure path's capsule layer.
impl: Any
#: Why the pure-Python path is in use ("" with the compiled core).
WHY_PURE = ""
#: How to get the compiled core ("" with it, or where EXCHANGE_PURE_PYTHON chose the pure path).
FIX_PURE = ""
#: What a build that could not compile the core recorded ({"reason", "fix", "python"}), else None.
NOT_BUILT: dict[str, str] | None = None
#: setup.py's note, beside the place of the core, when the build could not compile it.
NOT_BUILT_NOTE = "_native_not_built.json"
#: Set to 1 to silence the warning a package built without its core gives at first use.
IGNORE_MISSING_CORE = "EXCHANGE_IGNORE_MISSING_CORE"


#: The package's directory (exchange/), where the compiled core and setup.py's note lie.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = __package__.rpartition(".")[0]  # "exchange"


def _read_note() -> dict[str, str] | None:
    """setup.py's note, or None (absent, or unreadable: then it says nothing)."""
    import json

    try:
        with open(os.path.join(_PACKAGE_DIR, NOT_BUILT_NOTE)) as f:
            note = json.load(f)
        return {"reason": str(note["reason"]), "fix": str(note["fix"]), "python": str(note.get("python", ""))}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _why_not_loaded(exc: ImportError) -> tuple[str, str]:
    """Why ``exchange._native`` did not import, and the fix, from what is on disk."""
    import importlib.util

    if NOT_BUILT is not None:
        return (f"the compiled core exchange._native was not built when this package was built: "
                f"{NOT_BUILT['reason']}"), NOT_BUILT["fix"]
    if importlib.util.find_spec(f"{_PACKAGE}._native") is not None:
        return (f"the compiled core is built but does not import ({exc})",
                "rebuild it (python setup.py build_ext --inplace, or reinstall)")
    if not os.path.isdir(os.path.join(_PACKAGE_DIR, "devices")):  # an installed package has it
        return ("the compiled core exchange._native is not built in this source tree",
                "python setup.py build_ext --inplace (a C compiler and Python's headers needed), or install "
                "tensor-exchange from a wheel")
    return ("the compiled core exchange._native is not in this installed package, and its build recorded "
            "no reason", "reinstall tensor-exchange from a wheel, or from the sdist with a C compiler at hand")


def _warn_not_built(note: dict[str, str]) -> None:
    """The one warning at first use of a package built without its core."""
    import warnings

    from ..errors import ExchangeWarning

    warnings.warn(
        f"tensor-exchange runs on its pure-Python path, where an import hop costs about 50x NumPy's own (about "
        f"1.4x with the compiled core): the core was not built when this package was built: {note['reason']}. "
        f"To get it: {note['fix']}. {IGNORE_MISSING_CORE}=1 silences this warning; EXCHANGE_PURE_PYTHON=1 "
        "chooses the pure-Python path.", ExchangeWarning, stacklevel=3)


if os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0"):
    from ._pure import capsules as impl

    WHY_PURE = "EXCHANGE_PURE_PYTHON is set"
else:
    try:
        from .. import _native as impl  # type: ignore[attr-defined, no-redef]
    except ImportError as exc:
        from ._pure import capsules as impl

        NOT_BUILT = _read_note()
        WHY_PURE, FIX_PURE = _why_not_loaded(exc)
        if NOT_BUILT is not None and os.environ.get(IGNORE_MISSING_CORE, "") in ("", "0"):
            _warn_not_built(NOT_BUILT)

#: True when the compiled core is in use (False: the pure-Python path). Read it through
#: ``exchange._core.compiled()``: nothing outside the seam branches on it.
NATIVE: bool = impl.__name__.endswith("_native")
