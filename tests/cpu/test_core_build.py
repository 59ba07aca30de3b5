"""Building and installing tensor-exchange where the compiled core cannot be built, and
finding the Pythons ``make dist`` builds wheels for.

* A build with no C compiler (what pip does with the sdist on such a machine) says so
  where pip's user sees it (the terminal pip runs in: pip shows a successful build's
  output only with -v), and records the reason in the package (setup.py); the package
  then warns once at first use, naming the reason and the fix, unless
  ``EXCHANGE_IGNORE_MISSING_CORE=1`` or ``EXCHANGE_PURE_PYTHON=1``; doctor gives the
  recorded reason (exchange/_core/choice.py, exchange/cli/doctor.py).
* ci/pythons.sh finds a CPython X.Y on PATH or under pyenv, past a pyenv shim that does
  not run (what made ``BUILD_PYTHON=python3.12 make dist`` fail), and finds nothing,
  quietly, where there is none (ci/dist.sh then skips that version, saying so).

The per-Python wheels themselves: ci/wheel-smoke.sh (ci/cpu.sh runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The checkout (CI's wheel pass runs a copy of tests/: ci/cpu.sh says where the checkout is).
SOURCE = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or ROOT)

#: Runs argv[1:] on a new pseudo-terminal (its controlling terminal), its output to stdout.
ON_A_TERMINAL = "import os, pty, sys; sys.exit(os.waitstatus_to_exitcode(pty.spawn(sys.argv[1:])))"

PROBE = r"""
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numpy as np
    import exchange as tx
    a = np.arange(4.0)
    assert np.from_dlpack(tx.from_dlpack(a)).ctypes.data == a.ctypes.data  # used, not only imported
from exchange import _core
print(json.dumps({"file": tx.__file__, "native": _core.compiled(), "why": _core.WHY_PURE, "fix": _core.FIX_PURE,
                  "warnings": [[w.category.__name__, str(w.message)] for w in caught if "exchange" in w.filename]}))
"""

DOCTOR = "import json; from exchange.cli import doctor; print(json.dumps(doctor._path()))"


def _copy_tree(dest: Path) -> Path:
    """What the sdist builds from: the package, the backends, the C core, the build files."""
    skip = shutil.ignore_patterns("__pycache__", "*.so", "_native_not_built.json", "*.egg-info")
    for name in ("exchange", "devices"):
        shutil.copytree(SOURCE / name, dest / name, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(SOURCE / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def built_without_compiler(tmp_path_factory):
    """pip's build of a wheel with no C compiler on PATH, on a terminal: (the terminal's
    text, the wheel unpacked as pip would install it)."""
    tmp = tmp_path_factory.mktemp("nocc")
    src = _copy_tree(tmp / "src")
    (tmp / "bin").mkdir()  # PATH: nothing, so no cc, no gcc
    env = {k: v for k, v in os.environ.items()
           if k not in ("CC", "LDSHARED", "CFLAGS") and not k.startswith("EXCHANGE_")}
    env["PATH"] = str(tmp / "bin")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--progress-bar", "off",
           "--disable-pip-version-check", "-w", str(tmp / "out"), str(src)]
    proc = subprocess.run([sys.executable, "-c", ON_A_TERMINAL, *pip], env=env, cwd=tmp, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=600)
    terminal = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, terminal[-4000:] + proc.stderr.decode(errors="replace")[-2000:]
    (wheel,) = (tmp / "out").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp / "installed")
    return terminal, names, tmp / "installed"


def _run(installed: Path, code: str, **extra: str) -> dict:
    """``code`` in a child that imports the unpacked wheel (NumPy from this environment;
    -S: no .pth file, so no editable install of a checkout answers for exchange._native)."""
    import numpy

    env = {k: v for k, v in os.environ.items() if not k.startswith("EXCHANGE_")}
    env.update(extra, PYTHONPATH=os.pathsep.join([str(installed), str(Path(numpy.__file__).parents[1])]))
    proc = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=installed.parent, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not proc.stderr.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.once_per_ci
@pytest.mark.slow
def test_a_build_without_a_compiler_says_so_on_pips_terminal_and_records_why(built_without_compiler):
    terminal, names, installed = built_without_compiler
    said = " ".join(terminal.split())
    assert "the compiled core exchange._native was NOT built: no C compiler" in said, terminal[-4000:]
    assert "To get the core: install one" in said and "--no-cache-dir" in said, terminal[-4000:]
    assert "Successfully built tensor-exchange" in said, terminal[-4000:]
    assert not any(n.startswith("exchange/_native.") for n in names), "a core was built with no compiler on PATH"
    note = json.loads((installed / "exchange" / "_native_not_built.json").read_text())
    assert note["reason"].startswith("no C compiler: 'gcc'") or note["reason"].startswith("no C compiler: 'cc'"), note
    assert note["python"] == sys.version.split()[0]


@pytest.mark.once_per_ci
@pytest.mark.slow
def test_that_package_warns_once_at_first_use_with_the_reason_and_the_fix(built_without_compiler):
    _, _, installed = built_without_compiler
    seen = _run(installed, PROBE)
    assert Path(seen["file"]).resolve().parent == (installed / "exchange").resolve()
    assert seen["native"] is False
    assert len(seen["warnings"]) == 1, seen["warnings"]
    category, message = seen["warnings"][0]
    assert category == "ExchangeWarning"
    assert "not built when this package was built: no C compiler" in message, message
    assert "To get it: install one" in message and "EXCHANGE_IGNORE_MISSING_CORE=1 silences" in message, message
    assert "not built when this package was built: no C compiler" in seen["why"] and seen["fix"].startswith(
        "install one")


@pytest.mark.once_per_ci
@pytest.mark.slow
def test_the_warning_is_silenced_by_its_setting_and_not_given_on_the_chosen_pure_path(built_without_compiler):
    _, _, installed = built_without_compiler
    quiet = _run(installed, PROBE, EXCHANGE_IGNORE_MISSING_CORE="1")
    assert quiet["warnings"] == [] and quiet["native"] is False
    assert "no C compiler" in quiet["why"]  # silenced, still known
    chosen = _run(installed, PROBE, EXCHANGE_PURE_PYTHON="1")
    assert chosen["warnings"] == [] and chosen["why"] == "EXCHANGE_PURE_PYTHON is set"


@pytest.mark.once_per_ci
@pytest.mark.slow
def test_doctor_gives_the_recorded_reason_not_a_guess(built_without_compiler):
    _, _, installed = built_without_compiler
    path = _run(installed, DOCTOR, EXCHANGE_IGNORE_MISSING_CORE="1")
    assert path["native"] is False
    assert path["why"].startswith("the compiled core exchange._native was not built when this package was built: "
                                  "no C compiler"), path
    assert path["fix"].startswith("install one (Debian/Ubuntu: apt install gcc"), path
    assert "--force-reinstall --no-deps --no-cache-dir" in path["fix"], path


def _find(version: str, path: Path, pyenv_root: Path, what: str = "find_python") -> subprocess.CompletedProcess:
    env = {"PATH": str(path), "PYENV_ROOT": str(pyenv_root), "HOME": str(pyenv_root.parent)}
    script = f'source "{SOURCE}/ci/pythons.sh"; {what} {version}'
    return subprocess.run([shutil.which("bash") or "/bin/bash", "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.once_per_ci
def test_pythons_are_found_past_a_pyenv_shim_that_does_not_run_and_missing_ones_quietly(tmp_path):
    version = "%d.%d" % sys.version_info[:2]
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()  # this CPython, outside any venv
    tools = tmp_path / "bin"  # the few tools ci/pythons.sh uses, and a shim like pyenv's for a version not selected
    tools.mkdir()
    for tool in ("ls", "grep", "sort", "basename"):
        (tools / tool).symlink_to(shutil.which(tool))
    shim = tools / f"python{version}"
    shim.write_text(f"#!{shutil.which('bash')}\necho 'pyenv: python{version}: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    root = tmp_path / "pyenv"
    for name in (f"{version}.98", f"{version}.99", f"{version}.100t", f"{version}.101rc1"):
        (root / "versions" / name / "bin").mkdir(parents=True)
    (root / "versions" / f"{version}.98" / "bin" / f"python{version}").symlink_to(base)
    (root / "versions" / f"{version}.99" / "bin" / f"python{version}").symlink_to(base)
    (root / "versions" / f"{version}.100t" / "bin" / f"python{version}").symlink_to(base)

    found = _find(version, tools, root)
    assert found.returncode == 0, found.stderr
    newest = root / "versions" / f"{version}.99" / "bin" / f"python{version}"  # not the "t" build, nor the rc
    assert found.stdout.strip() == str(newest)
    resolved = _find(f"python{version}", tools, root, what="resolve_python")  # BUILD_PYTHON=pythonX.Y
    assert resolved.returncode == 0 and resolved.stdout.strip() == str(newest), resolved.stderr

    missing = _find("3.99", tools, root)
    assert missing.returncode == 1 and missing.stdout == "" and missing.stderr == ""
