#!/usr/bin/env bash
# The GPU check, for a bare GPU machine: no install step (the packages are already
# there: pytest, numpy, cuda-python, CuPy, PyTorch, JAX...), the project on PYTHONPATH.
#
#   bash ci/gpu-check.sh [extra pytest arguments]
#
# Steps, each under its own time limit inside one overall budget, everything streamed
# to the log as it runs (so a crash or a timeout still shows where):
#   1. preflight (ci/gpu_preflight.py, about 10-20 s): the versions, then pytest, the
#      driver, cuda.core Device(0), a CuPy kernel, torch.cuda, jax.devices("gpu");
#      fails fast, with the reason, where any is missing (no GPU: a few seconds);
#   2. the compiled helper built in place when a compiler and Python's headers are
#      there (setuptools' build_ext, else gcc directly), else the reason;
#   3. tensor-exchange doctor;
#   4. pytest tests/gpu -v with a JUnit file (the compiled helper's path);
#   5. tensor-exchange demo --device cuda --report json;
#   6. tensor-exchange bench --device cuda --quick --json;
#   7. pytest tests/gpu on the pure-Python path (EXCHANGE_PURE_PYTHON=1), with the time
#      that is left, or the reason it did not run;
#   8. ci/check_gpu_results.py: one table (each GPU test file: passed / failed / skipped
#      on both paths; the demo's accuracy and shared hops; the bench's GPU figures).
# Exits non-zero when the preflight fails, any test failed, none passed, a test was
# skipped for a reason the GPU machine is not known to cause, or pytest did not finish.
#
# Environment: PYTHON (default python3); GPU_CHECK_OUT (folder for the log, the JUnit
# files and the JSON reports; default a new temporary folder); GPU_CHECK_BUDGET (seconds
# for the whole check, default 330); EXCHANGE_GPU_TEST_TIMEOUT (seconds one test may
# take, default 60; tests/gpu/conftest.py enforces it without pytest-timeout).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would take most of the GPU's memory
export EXCHANGE_GPU_TEST_TIMEOUT="${EXCHANGE_GPU_TEST_TIMEOUT:-60}"
budget="${GPU_CHECK_BUDGET:-330}"
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$out"
log="$out/gpu-check.log"
: >"$log"
start=$SECONDS

say() { echo "gpu-check: $*" | tee -a "$log"; }
# seconds for the next step: its own cap, but never past the overall budget
limit() { local left=$((budget - (SECONDS - start))); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
# run a step under a time limit, streaming its output to the terminal and the log
step() {
    local secs="$1"; shift
    if [ "$secs" -lt 5 ]; then say "no time left for: $*"; return 124; fi
    timeout -k 5 "$secs" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then say "stopped after ${secs} s: $*"; fi
    return "$rc"
}

say "output in $out; budget ${budget} s"

# 1. preflight
step "$(limit 45)" "$PY" ci/gpu_preflight.py
pre=$?
if [ "$pre" -ne 0 ]; then
    say "preflight failed (status $pre): nothing else runs; the reason is above"
    exit 1
fi

# 2. the compiled helper, in place
native="no"
inc="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)"
suffix="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))' 2>/dev/null)"
cc="$(command -v gcc || command -v cc || true)"
if [ -z "$cc" ]; then
    say "compiled helper: not built (no C compiler); the pure-Python path only"
elif [ ! -f "$inc/Python.h" ]; then
    say "compiled helper: not built (no Python.h in $inc: the python3-dev headers are missing)"
else
    rm -f exchange/_native*.so
    if "$PY" -c "import setuptools" 2>/dev/null; then
        step "$(limit 60)" "$PY" setup.py -q build_ext --inplace
    else
        step "$(limit 60)" "$cc" -shared -fPIC -O2 -I"$inc" exchange/native/*.c -o "exchange/_native$suffix"
    fi
    if "$PY" -c "import sys, exchange.capsule as c; sys.exit(0 if c.NATIVE else 1)" 2>>"$log"; then
        native="yes"
        say "compiled helper: built and loaded"
    else
        say "compiled helper: the build did not give an importable exchange._native; the pure-Python path only"
    fi
fi

# 3. doctor
step "$(limit 40)" "$PY" -m exchange doctor
say "doctor exited with status $?"

# 4. the GPU suite (the compiled helper's path, where it was built)
junit="$out/gpu-junit.xml"
rm -f "$junit"
plog="$out/gpu-pytest.log"
step "$(limit 150)" "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider --junitxml="$junit" \
    -o junit_family=xunit2 "$@" | tee "$plog"
rc=${PIPESTATUS[0]}
say "pytest tests/gpu (compiled helper: $native) exited with status $rc"

# 5. the demo on CUDA
missing="$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("sklearn", "onnx", "onnxruntime") if u.find_spec(m) is None))')"
if [ -n "$missing" ]; then
    echo "the demo needs $missing, not installed on this machine" >"$out/demo.json"
    say "demo: not run: needs $missing"
else
    step "$(limit 60)" "$PY" -m exchange demo --device cuda --report json >"$out/demo.json"
    say "demo exited with status $?"
fi

# 6. the bench on CUDA
step "$(limit 75)" "$PY" -m exchange bench --device cuda --quick --json >"$out/bench.json"
say "bench exited with status $?"

# 7. the GPU suite on the pure-Python path, with the time that is left
pjunit="$out/gpu-junit-pure.xml"
rm -f "$pjunit"
pplog="$out/gpu-pytest-pure.log"
labels="compiled"
[ "$native" = "no" ] && labels="pure-python"
extra_runs=()
if [ "$native" = "yes" ]; then
    left=$(limit 120)
    if [ "$left" -ge 30 ]; then
        step "$left" env EXCHANGE_PURE_PYTHON=1 "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider \
            --junitxml="$pjunit" -o junit_family=xunit2 "$@" | tee "$pplog"
        say "pytest tests/gpu (pure-Python path) exited with status ${PIPESTATUS[0]}"
        extra_runs=("$pjunit")
        labels="compiled,pure-python"
    else
        say "pure-Python path: not run (only ${left} s of the budget left)"
    fi
else
    say "pure-Python path: the run above was already on it (no compiled helper)"
fi

# 8. the table
echo | tee -a "$log"
logs=(--log "$plog")
[ "${#extra_runs[@]}" -gt 0 ] && logs+=(--log "$pplog")
"$PY" ci/check_gpu_results.py "$junit" "${extra_runs[@]}" --labels "$labels" --demo "$out/demo.json" \
    --bench "$out/bench.json" "${logs[@]}" 2>&1 | tee -a "$log"
check=${PIPESTATUS[0]}
say "done in $((SECONDS - start)) s; log, JUnit files and JSON reports in $out"
if [ "$check" -ne 0 ]; then
    exit "$check"
fi
if [ "$rc" -ne 0 ]; then
    say "pytest exited with status $rc"
    exit "$rc"
fi
exit 0
