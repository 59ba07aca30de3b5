"""The pure-Python (ctypes) capsule path: the produce, consume and bad-input tests run
again in a child process with EXCHANGE_PURE_PYTHON=1 and must pass there too."""

from __future__ import annotations

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
    code = "import exchange.capsule as c; print(c.NATIVE, c._impl.__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "exchange._capsule_ctypes"]


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
    # that exchange.capsule.NATIVE is False.
