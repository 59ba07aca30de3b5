#!/usr/bin/env bash
# The smoke test of each wheel in dist/ (ci/dist.sh builds them; ci/cpu.sh runs this in
# the background alongside its two passes; `bash ci/wheel-smoke.sh` alone after
# `make dist`). For each wheel, its CPython (ci/pythons.sh; one not found here is skipped
# with a line saying so) gets a fresh environment, build/smoke/<X.Y>, into which pip
# installs the wheel (and NumPy) with no C compiler on PATH (BUILD_PYTHON's pip, default
# python3's, through its --python: an environment made without its own pip is made in
# 0.1 s instead of 5); then ci/smoke.py runs there,
# from outside the checkout, once on the compiled core and once with
# EXCHANGE_PURE_PYTHON=1: doctor reports the path, a NumPy round trip, a hand-off
# through a spawn Queue. Each Python's output goes to build/smoke/<X.Y>.log; stderr gets
# a line per Python. Fails when any found Python's smoke test fails, or dist/ has no wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
source ci/pythons.sh
say() { echo "wheel-smoke: $*" >&2; }
if ! pip_python=$(resolve_python "${BUILD_PYTHON:-python3}") || ! "$pip_python" -m pip --version >/dev/null; then
    say "BUILD_PYTHON=${BUILD_PYTHON:-python3} has no pip to install the wheels with"
    exit 1
fi
start=$SECONDS
shopt -s nullglob
wheels=(dist/*.whl)
if [ "${#wheels[@]}" = 0 ]; then
    say "no wheel in dist/: run make dist (ci/dist.sh) first"
    exit 1
fi
mkdir -p build/smoke

# The smoke test of the wheel $1 with the Python $2 in the new environment $3.
smoke() {
    local wheel="$1" py="$2" env="$3"
    # (called as a condition, where set -e does not apply: each step says || return)
    rm -rf "$env" && "$py" -m venv --without-pip "$env" || return
    PATH="$root/$env/bin" "$pip_python" -m pip --python "$env/bin/python" install --progress-bar off "$root/$wheel" ||
        return
    if (PATH="$root/$env/bin"; command -v cc || command -v gcc); then
        echo "a C compiler was on the install's PATH"; return 1
    fi
    (cd "$env" && env -u EXCHANGE_PURE_PYTHON PATH="$root/$env/bin" bin/python "$root/ci/smoke.py" native) || return
    (cd "$env" && EXCHANGE_PURE_PYTHON=1 PATH="$root/$env/bin" bin/python "$root/ci/smoke.py" pure)
}

failed=0
for wheel in "${wheels[@]}"; do
    tag=$(basename "$wheel" | cut -d- -f3)  # cp312
    v="${tag:2:1}.${tag:3}"
    if ! py=$(find_python "$v"); then
        say "CPython $v: skipped, no such Python here (python$v on PATH, pyenv): $(basename "$wheel") not tried"
        continue
    fi
    one=$SECONDS
    if smoke "$wheel" "$py" "build/smoke/$v" >"build/smoke/$v.log" 2>&1; then
        say "CPython $v: passed in $((SECONDS - one)) s ($(basename "$wheel"))"
    else
        failed=1
        say "CPython $v: FAILED after $((SECONDS - one)) s; the end of build/smoke/$v.log:"
        tail -n 30 "build/smoke/$v.log" >&2
    fi
done
say "done in $((SECONDS - start)) s"
exit "$failed"
