"""The pure-Python (ctypes) capsule path: the produce, consume and bad-input tests run
again in a child process with EXCHANGE_PURE_PYTHON=1 and must pass there too."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FILES = ["test_produce.py", "test_consume.py", "test_bad_input.py"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["EXCHANGE_PURE_PYTHON"] = "1"
    return env


def test_pure_python_switch_selects_the_ctypes_twin():
    code = "import exchange._core; print(exchange._core.compiled(), exchange._core.impl.__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "exchange._core._pure.capsules"]


@pytest.mark.skipif(os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0"),
                    reason="already running on the pure-Python path")
def test_core_tests_pass_on_the_pure_python_path():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra --strict-markers",
           *[str(HERE / f) for f in FILES]]
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
    # test_consume.py's test_capsule_implementation_matches_environment checked there
    # that exchange._core.compiled() is False.


DOCTOR_PATH = r"""
import json, warnings
warnings.simplefilter("error")  # a note, never a warning
from exchange.cli import doctor
path = doctor._path()
print(json.dumps(path))
print("\n".join(doctor._path_lines(path)))
"""


def test_doctor_says_the_pure_path_is_in_use_why_and_what_it_costs():
    out = subprocess.run([sys.executable, "-c", DOCTOR_PATH], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, *lines = out.stdout.splitlines()
    path = json.loads(first)
    assert path["native"] is False and "EXCHANGE_PURE_PYTHON is set" in path["why"]
    assert path["fix"] == "unset EXCHANGE_PURE_PYTHON"
    cost = path["cost"]
    assert cost["tx_us"] > 0 and cost["numpy_us"] > 0
    assert cost["ratio"] == pytest.approx(cost["tx_us"] / cost["numpy_us"], rel=0.01, abs=0.06)
    assert lines[0].startswith("path: pure Python (ctypes): EXCHANGE_PURE_PYTHON is set")
    assert f"{cost['ratio']:g}x np.from_dlpack" in lines[1] and "with the compiled core" in lines[1]
    assert lines[2] == "  for the compiled core: unset EXCHANGE_PURE_PYTHON"
    assert not out.stderr, out.stderr


def test_doctor_gives_the_import_hop_on_the_path_in_use():
    import exchange._core
    from exchange.cli import doctor

    path = doctor._path()
    assert path["native"] is exchange._core.compiled() and path["cost"]["tx_us"] > 0
    assert doctor._path_lines(path)[0].startswith("path: compiled core:" if exchange._core.compiled() else "path: pure Python")
