"""ci/dist.sh (``make dist``) on stderr: a line per step, the C compiler's warnings and
errors, and where a step fails the end of its output; the rest of what the tools print
(about 520 lines of pip, setuptools and auditwheel) goes to build/dist.log.

The real build takes 15 to 40 s and its tools come from PyPI, so here the script runs
in a scratch copy of its folder with a stand-in toolchain (BUILD_VENV): a ``python``
whose ``-m build`` prints as much as the real one and writes an sdist and a wheel (with
or without a compiled core), an ``auditwheel`` that copies the wheel; every other
``python`` call is the real interpreter. ci/cpu.sh runs the real build in every CI run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once_per_ci  # a shell script's plumbing: the same on both paths

SOURCE = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or Path(__file__).resolve().parents[2])
WHEEL = "tensor_exchange-0.1.0-cp311-cp311-linux_x86_64.whl"
NOISE = 500

PYTHON = f"""#!/bin/sh
if [ "$1 $2" = "-m build" ]; then
    out="$4"
    i=0
    while [ $i -lt {NOISE} ]; do echo "copying noise$i.py -> build/lib"; i=$((i + 1)); done
    echo "exchange/native/module.c:12:5: warning: unused variable 'x' [-Wunused-variable]" >&2
    [ -n "$FAIL_BUILD" ] && {{ echo "exchange/native/module.c:40:1: error: expected ';'" >&2; exit 1; }}
    mkdir -p "$out" && echo sdist > "$out/tensor_exchange-0.1.0.tar.gz"
    exec {sys.executable} -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as z:
    z.writestr("exchange/__init__.py", "")
    if sys.argv[2] != "1":
        z.writestr("exchange/_native.cpython-311-x86_64-linux-gnu.so", "")' "$out/{WHEEL}" "${{NO_CORE:-0}}"
fi
exec {sys.executable} "$@"
"""

AUDITWHEEL = """#!/bin/sh
echo "auditwheel: $1"
if [ "$1" = repair ]; then cp "$4" "$3/"; fi
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    root = tmp_path / "checkout"
    (root / "ci").mkdir(parents=True)
    for name in ("dist.sh", "pythons.sh"):
        shutil.copy(SOURCE / "ci" / name, root / "ci" / name)
    tools = tmp_path / "tools" / "bin"
    tools.mkdir(parents=True)
    # the stamp dist.sh reads to know the tools' environment is made (its TOOLS line)
    stamp = re.search(r'^TOOLS="(.*)"$', (SOURCE / "ci" / "dist.sh").read_text(), re.M).group(1)
    (tools.parent / ".dist-tools").write_text(stamp + "\n")
    for name, text in (("python", PYTHON), ("auditwheel", AUDITWHEEL), ("patchelf", "#!/bin/sh\n")):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    return subprocess.run(["bash", str(root / "ci" / "dist.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUILD_PYTHON": sys.executable, "BUILD_VENV": str(tools.parent),
                               "DIST_PYTHONS": "",  # BUILD_PYTHON's wheel alone (the others: test_core_build.py)
                               **env})


def test_a_build_says_a_line_per_step_and_logs_the_rest(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "checkout"
    assert sorted(proc.stdout.splitlines()) == [f"{root}/dist/{WHEEL}", f"{root}/dist/tensor_exchange-0.1.0.tar.gz"]
    lines = proc.stderr.splitlines()
    assert len(lines) <= 6, lines
    assert lines[0].startswith("dist: building the sdist, then the CPython 3.") and lines[0].endswith(" wheel from it (python -m build)")
    assert "exchange/native/module.c:12:5: warning: unused variable 'x' [-Wunused-variable]" in lines  # kept in sight
    assert lines[-1].startswith("dist: done in ") and lines[-1].endswith("(what the tools printed: build/dist.log)")
    log = (root / "build" / "dist.log").read_text()
    assert log.count("copying noise") == NOISE and "auditwheel: repair" in log and "auditwheel: show" in log


def test_a_failed_step_shows_the_end_of_its_output_and_the_log(tmp_path):
    proc = _run(tmp_path, FAIL_BUILD="1")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) <= 45, lines[:5]
    assert "exchange/native/module.c:40:1: error: expected ';'" in lines
    assert lines[-1].startswith("dist: failed: ") and lines[-1].endswith("all of it in build/dist.log)")
    assert proc.stdout == ""


def test_a_wheel_without_its_core_is_not_released(tmp_path):
    proc = _run(tmp_path, NO_CORE="1")
    assert proc.returncode == 1
    assert "the wheel has no compiled core" in proc.stderr and "build/dist.log" in proc.stderr
    assert not list((tmp_path / "checkout" / "dist").glob("*.whl"))
