"""Which ``exchange`` a run tests, in this process and in every kind of process the suite
starts (``python -c`` from the tests' root, the root on ``PYTHONPATH``, a script, a
``multiprocessing`` spawn child, the console script): one and the same package in all.

In CI's wheel pass (ci/cpu.sh sets ``EXCHANGE_TEST_INSTALLED=1`` and runs a copy of
tests/ against a new environment holding the built wheel) that package must be the
installed one, not the checkout (``EXCHANGE_SOURCE_ROOT``), with its compiled core, and
the installed distribution must hold every module of the checkout: a file left out of
the wheel fails here, and in every test that imports it. Ray workers: tests/cpu/test_ray.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

import exchange

#: Where the tests run from; the checkout, except in CI's wheel pass (a copy of tests/).
ROOT = Path(__file__).resolve().parents[2]
#: The checkout the package was built from.
SOURCE = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or ROOT)
INSTALLED = os.environ.get("EXCHANGE_TEST_INSTALLED", "") == "1"
installed_only = pytest.mark.skipif(not INSTALLED, reason="CI's wheel pass only (ci/cpu.sh: EXCHANGE_TEST_INSTALLED=1)")

PROBE = "import exchange, exchange._core; print(exchange.__file__); print(exchange._core.compiled())"

SPAWN = """
import multiprocessing as mp

def child(q):
    import exchange
    q.put(exchange.__file__)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60))
    p.join(60)
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def _package(file: str) -> Path:
    return Path(file).resolve().parent


def test_every_kind_of_subprocess_imports_the_package_of_this_run(tmp_path):
    here = _package(exchange.__file__)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    spawn = tmp_path / "spawn.py"
    spawn.write_text(SPAWN)
    on_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ways = {
        "python -c from the tests' root": ([sys.executable, "-c", PROBE], ROOT, _env()),
        "python -c, the root on PYTHONPATH": ([sys.executable, "-c", PROBE], tmp_path, _env(PYTHONPATH=on_path)),
        "a script, run from the root": ([sys.executable, str(script)], ROOT, _env(PYTHONPATH=on_path)),
        "a multiprocessing spawn child": ([sys.executable, str(spawn)], ROOT, _env(PYTHONPATH=on_path)),
    }
    for way, (cmd, cwd, env) in ways.items():
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (way, proc.stderr[-3000:])
        assert _package(proc.stdout.splitlines()[0]) == here, f"{way}: {proc.stdout.splitlines()[0]} is not {here}"


@installed_only
def test_the_package_is_the_installed_one_not_the_checkout():
    here = _package(exchange.__file__)
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    assert here.parent in site, f"exchange from {here}, not from this environment's site-packages {sorted(site)}"
    assert here != (SOURCE / "exchange").resolve(), f"exchange imported from the checkout {SOURCE}"
    dist = metadata.distribution("tensor-exchange")
    assert Path(dist.locate_file("exchange")).resolve() == here
    origin = json.loads(dist.read_text("direct_url.json") or "{}")  # PEP 610: how pip installed it
    assert "archive_info" in origin and origin["url"].endswith(".whl"), f"not installed from a wheel file: {origin}"


@installed_only
def test_the_compiled_core_is_the_wheels():
    from exchange import _native, capsule

    assert exchange._core.compiled(), "the wheel's compiled core did not load"
    assert _package(_native.__file__) == _package(exchange.__file__)


@installed_only
def test_the_installed_distribution_holds_every_module_of_the_checkout():
    listed = metadata.files("tensor-exchange") or []
    assert all(Path(f.locate()).exists() for f in listed), "a file of the wheel's RECORD is not installed"
    files = {str(f) for f in listed}
    wanted = {str(p.relative_to(SOURCE)) for p in (SOURCE / "exchange").rglob("*.py")}
    wanted |= {"exchange/devices/" + str(p.relative_to(SOURCE / "devices")) for p in (SOURCE / "devices").rglob("*.py")}
    wanted.add("exchange/py.typed")
    missing = sorted(wanted - files)
    assert not missing, f"not in the wheel: {missing}"
    assert any(f.startswith("exchange/_native.") and f.endswith(".so") for f in files), "no compiled core in the wheel"
    assert not any(f.startswith("devices/") for f in files), "a top-level devices package was installed"


@installed_only
def test_doctor_and_version_with_no_compiler_on_path(tmp_path):
    """The console script of the installed wheel, with only the environment's bin/ on
    PATH (no cc, no gcc): doctor reports the compiled core, --version the metadata's."""
    bin_dir = Path(sys.executable).parent
    assert not any((bin_dir / cc).exists() for cc in ("cc", "gcc"))
    env = _env(PATH=str(bin_dir))
    env.pop("EXCHANGE_PURE_PYTHON", None)
    command = str(bin_dir / "tensor-exchange")
    proc = subprocess.run([command, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tensor-exchange", metadata.version("tensor-exchange")]
    assert metadata.version("tensor-exchange") == exchange.__version__
    proc = subprocess.run([command, "doctor", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["path"]["native"] is True, report["path"]
    assert report["tensor_exchange"] == exchange.__version__


def test_the_wheel_pass_is_told_where_the_checkout_is():
    # the wheel pass reads the checkout's sources (test_layout.py) through EXCHANGE_SOURCE_ROOT
    assert (SOURCE / "exchange" / "__init__.py").is_file() and (SOURCE / "devices" / "__init__.py").is_file(), (
        f"{SOURCE} is not a checkout: run the wheel pass through ci/cpu.sh, which sets EXCHANGE_SOURCE_ROOT")
