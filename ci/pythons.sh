# Finds CPython interpreters by version; sourced by ci/dist.sh and ci/wheel-smoke.sh.
#
#   find_python X.Y    prints the path of a CPython X.Y that runs here (its sys.executable,
#                      not a pyenv shim), else fails (status 1) and prints nothing. Where
#                      it looks, in order:
#                        1. pythonX.Y on PATH, if it runs and is CPython X.Y (a pyenv shim
#                           of a version pyenv has not selected does not run: "pyenv:
#                           python3.12: command not found");
#                        2. pyenv's versions (`pyenv root`, else $PYENV_ROOT, else
#                           ~/.pyenv): the newest X.Y.N there that runs (not a free-threaded
#                           "t" build, nor a pre-release).
#   resolve_python CMD prints CMD's sys.executable where it runs; for a CMD named pythonX.Y
#                      that does not, find_python X.Y's; else fails.
#   DIST_VERSIONS      the Python versions wheels are built for (DIST_PYTHONS, where set,
#                      even empty, overrides).

DIST_VERSIONS="${DIST_PYTHONS-3.10 3.11 3.12 3.13}"

# The sys.executable of $1 if it runs and is a CPython $2 with the GIL, else nothing.
_cpython_exe() {
    "$1" -c 'import sys, sysconfig
ok = sys.implementation.name == "cpython" and not sysconfig.get_config_var("Py_GIL_DISABLED")
print(sys.executable if ok and "%d.%d" % sys.version_info[:2] == sys.argv[1] else "")' "$2" 2>/dev/null
}

_pyenv_root() {
    if command -v pyenv >/dev/null 2>&1; then
        pyenv root 2>/dev/null && return
    fi
    echo "${PYENV_ROOT:-$HOME/.pyenv}"
}

find_python() {
    local version="$1" candidate exe root dir
    candidate=$(command -v "python$version" 2>/dev/null) && exe=$(_cpython_exe "$candidate" "$version") &&
        [ -n "$exe" ] && { echo "$exe"; return 0; }
    root=$(_pyenv_root)
    [ -d "$root/versions" ] || return 1
    for dir in $(ls -1 "$root/versions" | grep -E "^${version//./\\.}\.[0-9]+$" | sort -rV); do
        candidate="$root/versions/$dir/bin/python$version"
        [ -x "$candidate" ] && exe=$(_cpython_exe "$candidate" "$version") && [ -n "$exe" ] &&
            { echo "$exe"; return 0; }
    done
    return 1
}

resolve_python() {
    local found
    if found=$(command -v "$1" 2>/dev/null) && found=$("$found" -c 'import sys; print(sys.executable)' 2>/dev/null) &&
        [ -n "$found" ]; then
        echo "$found"
    elif [[ "$(basename "$1")" =~ ^python([0-9]+\.[0-9]+)$ ]]; then
        find_python "${BASH_REMATCH[1]}"
    else
        return 1
    fi
}
