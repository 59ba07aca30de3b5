"""What the CPU tests share to run code in a child process, and to skip what needs the
compiled core where it is not built.

The compiled core is optional: a source tree on PYTHONPATH without ``build_ext``, or an
install without a compiler, has none, and the tests of it skip there, saying so.
``COMPILED_CORE`` names its module, once, for every test that asks.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: The repository's root (the folder holding exchange/ and tests/).
REPO = Path(__file__).resolve().parents[2]

#: The compiled core's module: where it is importable, the compiled path can run.
COMPILED_CORE = "exchange._native"

#: True where the compiled core is built here (whichever path this process uses).
NATIVE_BUILT = importlib.util.find_spec(COMPILED_CORE) is not None

#: Marks a test (or a parameter) that needs the compiled core: skipped, with the reason,
#: where it is not built.
NEEDS_NATIVE = pytest.mark.skipif(not NATIVE_BUILT, reason=f"the compiled core {COMPILED_CORE} is not built here "
                                                           "(python setup.py build_ext --inplace builds it)")


def run_python(code: str, timeout: float = 120, **env: str | None) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a child Python from the repository's root, this checkout
    first on its PYTHONPATH; ``env`` adds variables to the child's environment, or with
    None removes them. Output is captured as text; TimeoutExpired after ``timeout`` s."""
    child = dict(os.environ)
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), child.get("PYTHONPATH", "")) if p)
    for key, value in env.items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=child)
