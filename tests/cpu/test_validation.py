"""One validation of a layout (issue 19, items 5 and 6): capsules, ``tx.empty`` and
``tx.borrow`` go through exchange/layout.py, and the compiled core's read of a capsule
(exchange/native/capsule.c) repeats it check for check and word for word.

The table (validation_cases.py) runs on the compiled path and on the pure-Python path,
each in its own process, and every case must give the same outcome there (the same
result, or the same exception with the same message) and the verdict it must have. A
seeded random search then compares the two implementations of the check directly.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

import exchange as tx
from exchange import _dlpack_abi as abi
from exchange import layout
from lifetime_helpers import no_leaks
from process_helpers import NEEDS_NATIVE

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import validation_cases  # noqa: E402

try:
    from exchange import _native
except ImportError:  # not built here: the comparisons that need it skip
    _native = None


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


def _run_cases(pure: bool) -> dict:
    env = dict(os.environ, EXCHANGE_PURE_PYTHON="1" if pure else "0")
    proc = subprocess.run([sys.executable, str(HERE / "validation_cases.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@NEEDS_NATIVE
def test_one_table_gives_one_outcome_on_both_paths():
    compiled, pure = _run_cases(pure=False), _run_cases(pure=True)
    assert compiled["native"] is True and pure["native"] is False
    verdicts = validation_cases.verdicts()
    assert set(compiled["outcomes"]) == set(pure["outcomes"]) == set(verdicts)
    different = {k: (v, pure["outcomes"][k]) for k, v in compiled["outcomes"].items() if v != pure["outcomes"][k]}
    assert not different, different
    wrong = {k: v for k, v in compiled["outcomes"].items() if v[0] != verdicts[k]}
    assert not wrong, wrong
    for key, got in compiled["outcomes"].items():
        if key.startswith("capsule"):
            assert got[-1] == 1, f"{key}: the producer's deleter ran {got[-1]} times, not once"


def test_the_issues_cases_are_refused_with_what_is_wrong_and_the_limit(reg):
    # on this process's path; the table above holds them for both
    data = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match=r"row-major stride for dimension 0 overflows int64 .*the limit is 2\*\*63 - 1"):
        tx.empty((0, 2**40, 2**40))
    t = tx.empty((2**40, 2**40, 0))
    assert t.strides == (2**40, 1, 1) and t.nbytes == 0
    with pytest.raises(ValueError, match="1100 dimensions, more than the limit of 1024"):
        tx.empty((1,) * 1100)
    with pytest.raises(ValueError, match="1100 dimensions, more than the limit of 1024"):
        with tx.borrow(data.ctypes.data, shape=(1,) * 1100, dtype="float32"):
            pass
    below = -(data.ctypes.data // 4 + 1)
    with pytest.raises(ValueError, match=r"negative strides reach \d+ bytes below element 0 .*below address 0"):
        with tx.borrow(data.ctypes.data, shape=(2,), strides=(below,), dtype="float32"):
            pass
    del t


def test_a_tensor_of_1024_dimensions_goes_out_and_comes_back(reg):
    # the pure path used to accept 1100 dims in tx.empty and then refuse its own capsules
    t = tx.empty((1,) * 1024, "uint8")
    back = tx.from_dlpack(t.__dlpack__(max_version=(1, 3)))
    assert back.shape == (1,) * 1024 and back.data_ptr == t.data_ptr
    legacy = tx.from_dlpack(t.__dlpack__())
    assert legacy.ndim == 1024
    del t, back, legacy


def test_the_dimension_limit_is_one_number():
    assert abi.MAX_NDIM is layout.MAX_NDIM
    if _native is not None:
        assert _native.check_layout((1,) * 1024, None, 1, 8, 0, "x", ValueError)[3] == 1
        with pytest.raises(ValueError, match="1025 dimensions, more than the limit of 1024"):
            _native.check_layout((1,) * 1025, None, 1, 8, 0, "x", ValueError)


# -- the two implementations, compared directly -------------------------------------------------
_EDGES = [0, 1, 2, 3, 2**31, 2**32, 2**40, 2**61, 2**62, 2**63 - 1]


def _extent(rng: random.Random) -> int:
    pick = rng.random()
    if pick < 0.5:
        return rng.randrange(0, 5)
    if pick < 0.9:
        return rng.choice(_EDGES) + rng.choice((-1, 0, 0, 1))
    return rng.randrange(0, 2**63)


def _stride(rng: random.Random) -> int:
    value = _extent(rng)
    value = min(value, 2**63 - 1)
    return -value if rng.random() < 0.3 else value


def _address(rng: random.Random) -> int:
    pick = rng.random()
    if pick < 0.3:
        return rng.randrange(0, 2**20)
    if pick < 0.6:
        return 2**64 - rng.randrange(1, 2**20)
    if pick < 0.8:
        return rng.choice((0, 2**63, 2**63 - 8, 2**64 - 1))
    return rng.randrange(0, 2**64)


def _random_case(rng: random.Random) -> tuple:
    ndim = rng.choice((0, 1, 1, 2, 2, 3, 4, 8, 9, 1024, 1025)) if rng.random() < 0.98 else rng.randrange(0, 1100)
    if ndim > 8:
        shape = tuple(rng.choice((1, 1, 1, 2)) for _ in range(ndim))
    else:
        shape = tuple(max(_extent(rng), 0) if rng.random() > 0.03 else -rng.randrange(1, 9) for _ in range(ndim))
        shape = tuple(min(n, 2**63 - 1) for n in shape)
    strides = None if rng.random() < 0.4 else tuple(_stride(rng) for _ in range(ndim))
    itemsize = rng.choice((1, 2, 4, 8, 16, 31))
    return shape, strides, itemsize, _address(rng), _address(rng) if rng.random() < 0.3 else 0


def _check(fn, case: tuple) -> tuple:
    try:
        return ("ok", tuple(fn(*case, "layout", BufferError)))
    except BufferError as exc:
        return ("refused", str(exc))


@NEEDS_NATIVE
def test_the_compiled_check_agrees_with_the_python_one_on_random_layouts():
    seed = int(os.environ.get("EXCHANGE_VALIDATION_SEED", random.randrange(2**32)))
    print(f"seed {seed} (replay: EXCHANGE_VALIDATION_SEED={seed})")
    rng = random.Random(seed)
    verdicts = {"ok": 0, "refused": 0}
    for i in range(20000):
        case = _random_case(rng)
        python, compiled = _check(layout.check_layout, case), _check(_native.check_layout, case)
        assert python == compiled, f"seed {seed}, case {i}: {case!r}: Python {python!r}, compiled {compiled!r}"
        verdicts[python[0]] += 1
    assert verdicts["ok"] > 1000 and verdicts["refused"] > 1000, verdicts  # both sides were exercised
