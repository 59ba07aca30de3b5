#!/usr/bin/env bash
# The CPU job (`make test` runs this, and so does .ci/run where make is missing), on a
# machine with no GPU (tests/gpu skips with its reason). Two passes of
# `pytest tests/cpu tests/gpu`:
#
#   1. the wheel, as users install it: ci/dist.sh builds the sdist and from it
#      python3's wheel (dist/); a new environment, .venvs/wheel (made afresh each run),
#      gets that wheel from pip with no C compiler on PATH, and the suite runs against
#      it from a copy of tests/ (build/wheel-tests), where the checkout's exchange/ is
#      not importable:
#      every process of the run, subprocesses included, imports the installed package,
#      compiled core included (tests/cpu/test_installed.py checks it, with
#      EXCHANGE_TEST_INSTALLED=1), so a file missing from the wheel fails here;
#   2. the pure-Python path (EXCHANGE_PURE_PYTHON=1) on the checkout itself, in VENV
#      (default .venvs/test: the test, interop, demo, ray, metrics and plot extras over
#      an editable install, made when missing), as a source tree without a built core runs.
#
# Alongside both, in the background at a low priority (nice), `ci/dist.sh --add` (the
# other Pythons' wheels) and ci/wheel-smoke.sh: each wheel of dist/ installed in a fresh
# environment of its own Python, and a smoke test there on both paths (doctor, a NumPy
# round trip, a spawn Queue hand-off); their summary (build/wheel-smoke.log, a line per
# Python) is printed at the end, and a failure fails the job.
#
# .venvs/wheel takes the wheel and its one requirement, NumPy, from pip; the extras the
# tests use (PyTorch, JAX, Ray, prometheus_client, matplotlib, ...) it reads from VENV's
# site-packages, through a path entry placed after its own (a path entry runs no .pth
# file, so VENV's editable install of the checkout stays out): that saves installing them
# a second time (making VENV takes 1.1 to 1.9 min on 2 cores with pip's cache warm).
#
# The two passes run at the same time (on 2 cores, 12.9 min for both in a fresh-clone
# run: the wheel's pass 12.4, the pure-Python pass 12.8, as README.md gives them; one
# after the other is not measured with this suite; each process of
# either has its own registry, sockets and Ray cluster): pass 2's output goes to
# build/pure-pass.log and is printed when pass 1 ends. Tests that run both paths
# themselves, or do not depend on the path, are marked once_per_ci and run in pass 1 only
# (EXCHANGE_CI_SECOND_PASS=1 in pass 2; tests/conftest.py); long ones that do not depend
# on the path (Ray Compiled Graphs, Ray across nodes, the quick bench on the pure path) are marked second_pass_in_ci and run
# in pass 2 only (EXCHANGE_CI_FIRST_PASS=1 in pass 1), so the two passes end together. SEQUENTIAL=1 runs pass 2
# after pass 1 instead, its output as it comes.
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
    say "setting up $venv (the test, interop, demo, ray, metrics, plot and top extras: 1.1 to 1.9 min on 2 cores with pip's cache warm, once)"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -c ci/constraints.txt -e ".[test,interop,demo,ray,metrics,plot,top]" >&2
fi
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# 2. the pure-Python path, on the checkout: started first, so that it runs while the wheel
# is built and tested
pure_log=build/pure-pass.log
pure_pid=
venv_abs=$(cd "$venv" && pwd)
pass2_env=(env EXCHANGE_PURE_PYTHON=1 EXCHANGE_CI_SECOND_PASS=1 VIRTUAL_ENV="$venv_abs" PATH="$venv_abs/bin:$PATH")
mkdir -p build
if [ "${SEQUENTIAL:-}" != 1 ]; then
    say "pass 2: the pure-Python path on the checkout, in the background (its output: $pure_log)"
    "${pass2_env[@]}" "$venv_abs/bin/python" -m pytest "$@" >"$pure_log" 2>&1 &
    pure_pid=$!  # pytest itself, so that the trap below ends it if this script fails first
fi
smoke_pid=
# if this script fails first: end pass 2's pytest and the smoke tests' script
trap '[ -n "$pure_pid" ] && kill "$pure_pid" 2>/dev/null; [ -n "$smoke_pid" ] && kill "$smoke_pid" 2>/dev/null' EXIT

# 1. the wheel: the sdist and python3's wheel (the other Pythons' come in 3)
tag=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel=$(DIST_PYTHONS= bash ci/dist.sh | grep -- "-$tag-$tag-.*\.whl$")

# 3. in the background, at a low priority (the passes first; a core is idle once pass 2
# ends): the other Pythons' wheels, added to dist/, then every wheel's smoke test
smoke_log=build/wheel-smoke.log
say "the other Pythons' wheels and every wheel's smoke test, in the background (their output: $smoke_log)"
(nice -n 10 bash ci/dist.sh --add >/dev/null && nice -n 10 bash ci/wheel-smoke.sh) >"$smoke_log" 2>&1 &
smoke_pid=$!
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
rc1=0
(cd "$stage" && EXCHANGE_CI_FIRST_PASS=1 EXCHANGE_TEST_INSTALLED=1 EXCHANGE_SOURCE_ROOT="$root" PATH="$root/$wheel_venv/bin:$PATH" \
    "$root/$wheel_venv/bin/python" -m pytest "$@") || rc1=$?
say "pass 1 ended ($rc1) after $((SECONDS - start)) s"

rc2=0
if [ -n "$pure_pid" ]; then
    wait "$pure_pid" || rc2=$?
    pure_pid=
    say "pass 2, the pure-Python path on the checkout ($rc2), ran alongside; its output:"
    cat "$pure_log"
else
    say "pass 2: the pure-Python path on the checkout ($((SECONDS - start)) s so far)"
    "${pass2_env[@]}" "$venv_abs/bin/python" -m pytest "$@" || rc2=$?
fi
rc3=0
wait "$smoke_pid" || rc3=$?
smoke_pid=
say "the other Pythons' wheels and the smoke tests ($rc3), alongside:"
cat "$smoke_log"
verdict() { [ "$1" = 0 ] && echo passed || echo "failed ($1)"; }
say "done in $((SECONDS - start)) s: pass 1 (the wheel) $(verdict $rc1), pass 2 (pure Python) $(verdict $rc2)," \
    "the wheels' smoke tests $(verdict $rc3)"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ "$rc3" = 0 ]
