"""What every test run shares (tests/cpu and tests/gpu).

- Once collected, what the collection imported (NumPy, PyTorch, JAX, ONNX Runtime, Ray,
  the test modules) is frozen out of the garbage collector (``gc.freeze``): a full
  ``gc.collect()`` over it takes about 0.2 s on this project's 2-core machines, and the
  tests collect before and after most cases that check what is left alive. What a test
  makes is collected as ever.
- ``@pytest.mark.once_per_ci``: a test that runs both capsule paths itself (in child
  processes) or does not depend on the path, so CI's second pass, the pure-Python one
  (ci/cpu.sh sets ``EXCHANGE_CI_SECOND_PASS=1``), skips it with that reason instead of
  running the same thing twice. Any other run runs it.
"""

from __future__ import annotations

import gc
import os

import pytest

SECOND_PASS = os.environ.get("EXCHANGE_CI_SECOND_PASS", "") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "once_per_ci: runs both paths itself, or either: skipped in CI's second pass")


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not SECOND_PASS:
        return
    skip = pytest.mark.skip(reason="runs both paths itself (or does not depend on the path): "
                                   "CI's first pass ran it (EXCHANGE_CI_SECOND_PASS=1)")
    for item in items:
        if item.get_closest_marker("once_per_ci"):
            item.add_marker(skip)
