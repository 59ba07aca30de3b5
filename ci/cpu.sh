#!/usr/bin/env bash
# The CPU job (`make test` runs this, and so does .ci/run where make is missing), on a
# machine with no GPU (tests/gpu skips with its reason). Two passes of
# `pytest tests/cpu tests/gpu`:
#
#   1. the wheel, as users install it: ci/dist.sh builds the sdist and from it the wheel
#      (dist/); a new environment, .venvs/wheel (made afresh each run), gets that wheel
#      from pip with no C compiler on PATH, and the suite runs against it from a copy of
#      tests/ (build/wheel-tests), where the checkout's exchange/ is not importable:
#      every process of the run, subprocesses included, imports the installed package,
#      compiled core included (tests/cpu/test_installed.py checks it, with
#      EXCHANGE_TEST_INSTALLED=1), so a file missing from the wheel fails here;
#   2. the pure-Python path (EXCHANGE_PURE_PYTHON=1) on the checkout itself, in VENV
#      (default .venvs/test: the test, interop, demo and ray extras over an editable
#      install, made when missing), as a source tree without a built core runs.
#
# .venvs/wheel takes the wheel and its one requirement, NumPy, from pip; the extras the
# tests use (PyTorch, JAX, Ray, ...) it reads from VENV's site-packages, through a path
# entry placed after its own (a path entry runs no .pth file, so VENV's editable install
# of the checkout stays out): that saves installing them twice (2.5 to 3.5 min on 2 cores).
#
# Arguments, if any, go to pytest in place of `tests/cpu tests/gpu` (both passes).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
if [ "$#" -eq 0 ]; then set -- tests/cpu tests/gpu; fi
venv="${VENV:-.venvs/test}"
wheel_venv=.venvs/wheel
stage=build/wheel-tests
say() { echo "ci/cpu.sh: $*" >&2; }
start=$SECONDS

if [ ! -x "$venv/bin/python" ]; then
    say "setting up $venv (the test, interop, demo and ray extras: about 2.5 min on 2 cores with pip's cache warm, once)"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -c ci/constraints.txt -e ".[test,interop,demo,ray]" >&2
fi
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# 1. the wheel
wheel=$(bash ci/dist.sh | grep '\.whl$')
say "installing $(basename "$wheel") into a new $wheel_venv, no compiler on PATH"
rm -rf "$wheel_venv"
python3 -m venv "$wheel_venv"
numpy=$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')
env PATH="$root/$wheel_venv/bin" "$wheel_venv/bin/python" -m pip install --progress-bar off \
    "numpy==$numpy" "$wheel" >&2
if (PATH="$root/$wheel_venv/bin"; command -v cc || command -v gcc) >/dev/null; then
    say "a C compiler was on the install's PATH"; exit 1
fi
site "$venv" >"$(site "$wheel_venv")/zz_ci_extras_from_test_venv.pth"
rm -rf "$stage"
mkdir -p "$stage"
cp -r tests pyproject.toml "$stage"/
say "pass 1: the installed wheel, from $stage ($((SECONDS - start)) s so far)"
(cd "$stage" && EXCHANGE_TEST_INSTALLED=1 EXCHANGE_SOURCE_ROOT="$root" PATH="$root/$wheel_venv/bin:$PATH" \
    "$root/$wheel_venv/bin/python" -m pytest "$@")

# 2. the pure-Python path, on the checkout
say "pass 2: the pure-Python path on the checkout ($((SECONDS - start)) s so far)"
. "$venv/bin/activate"
EXCHANGE_PURE_PYTHON=1 pytest "$@"
say "done in $((SECONDS - start)) s"
