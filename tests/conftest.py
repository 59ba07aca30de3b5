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
- ``@pytest.mark.second_pass_in_ci``: a long test that does not depend on the path (the
  Ray Compiled Graph and multi-node tests, the quick bench on the pure path): CI's first pass, the wheel's, which is the
  longer of the two that run side by side (ci/cpu.sh sets ``EXCHANGE_CI_FIRST_PASS=1``),
  skips it, and the second runs it, so that both end at about the same time. Any other
  run runs it.
"""

from __future__ import annotations

import gc
import os

import pytest

# Sets give back the regions they keep free after 1 s here, not 10: the bench's publish
# section (run by test_bench in child processes) waits that long before it measures an
# idle set's memory. test_sets checks the give-back itself, with its own delay.
os.environ.setdefault("EXCHANGE_SETS_SPARE_S", "1")
SECOND_PASS = os.environ.get("EXCHANGE_CI_SECOND_PASS", "") == "1"
FIRST_PASS = os.environ.get("EXCHANGE_CI_FIRST_PASS", "") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "once_per_ci: runs both paths itself, or either: skipped in CI's second pass")
    config.addinivalue_line("markers", "second_pass_in_ci: does not depend on the path and takes long: run in CI's "
                                       "second pass only, which has time to spare")


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if SECOND_PASS:
        marker, skip = "once_per_ci", pytest.mark.skip(
            reason="runs both paths itself (or does not depend on the path): CI's first pass ran it "
                   "(EXCHANGE_CI_SECOND_PASS=1)")
    elif FIRST_PASS:
        marker, skip = "second_pass_in_ci", pytest.mark.skip(
            reason="does not depend on the path: CI's second pass runs it, which has time to spare "
                   "(EXCHANGE_CI_FIRST_PASS=1)")
    else:
        return
    for item in items:
        if item.get_closest_marker(marker):
            item.add_marker(skip)
