#!/usr/bin/env bash
# Run the whole GPU suite (tests/gpu) on a bare GPU machine: no install step, the
# project on PYTHONPATH, the packages (pytest, numpy, cuda-python, CuPy; PyTorch, JAX
# and the other peers where present) already there. Pure Python: without the compiled
# helper the ctypes capsule path runs.
#
#   bash ci/gpu-check.sh [extra pytest arguments]
#
# Environment: PYTHON (default python3), GPU_CHECK_TIMEOUT (seconds for pytest, default
# 270, so the whole check ends inside 5 minutes), GPU_CHECK_OUT (folder for the JUnit XML
# and the log; default a new temporary folder), GPU_CHECK_MAX_SKIPPED (fail when more
# tests were skipped; default no limit).
#
# Prints the skip reasons, a table of every test (name / outcome / seconds) and the
# totals last. Exits non-zero when any test failed or errored, when none passed (all
# skipped: no usable GPU), or when pytest did not finish in time.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would take most of the GPU's memory
budget="${GPU_CHECK_TIMEOUT:-270}"
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$out"
junit="$out/gpu-junit.xml"
rm -f "$junit"

"$PY" - <<'PY' || true
import importlib, platform
print(f"python {platform.python_version()}")
for name in ("numpy", "cuda.core", "cuda.bindings", "cupy", "torch", "jax", "tvm_ffi", "onnxruntime"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except Exception as exc:
        print(f"  {name}: not importable ({type(exc).__name__})")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

extra=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    extra+=(--timeout=120)  # one hung test must not eat the whole budget
fi

timeout -k 10 "$budget" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider \
    --junitxml="$junit" -o junit_family=xunit2 "${extra[@]}" "$@" 2>&1 | tee "$out/gpu-pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu-check: pytest did not finish within ${budget} s and was stopped"
fi

echo
"$PY" ci/check_gpu_results.py "$junit" ${GPU_CHECK_MAX_SKIPPED:+--max-skipped "$GPU_CHECK_MAX_SKIPPED"}
check=$?
echo "(JUnit XML and log in $out)"
if [ "$check" -ne 0 ]; then
    exit "$check"
fi
if [ "$rc" -ne 0 ]; then
    echo "gpu-check: pytest exited with status $rc"
    exit "$rc"
fi
exit 0
