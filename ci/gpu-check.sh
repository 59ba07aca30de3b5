#!/usr/bin/env bash
# The GPU check, for a bare GPU machine, in one call of at most 4.5 minutes: no install
# step (the packages are already there: pytest, numpy, cuda-python, CuPy, PyTorch,
# JAX...), the project on PYTHONPATH.
#
#   bash ci/gpu-check.sh [extra pytest arguments]
#
# ci/gpu_check.py runs the steps (its docstring has their caps and floors), each under a
# limit of its own inside one budget, what proves the promises first: the preflight
# (ci/gpu_preflight.py: no GPU, and it stops here within seconds, saying why), the
# compiled core built in place, then the GPU suite on both paths and compute-sanitizer
# (ci/gpu_sanitizer.py) at the same time, then the demo, the bench and doctor as the
# budget allows (a step that does not fit is not started, and the table says so), then
# one table (ci/check_gpu_results.py) with the verdict. It exits non-zero when the
# preflight fails or the verdict is a failure.
#
# Environment: PYTHON (default python3); GPU_CHECK_OUT (the folder that receives
# gpu-check-table.txt and gpu-check.tar.gz, all the logs and reports: two files; default
# a new temporary folder); GPU_CHECK_BUDGET (seconds for the whole check, default 240);
# GPU_CHECK_SERIAL=1 (the suites and the sanitizer one after the other);
# EXCHANGE_GPU_TEST_TIMEOUT (seconds one test may take, default 45: pytest-timeout's
# --timeout where installed, else tests/gpu/conftest.py's own; either way a timeout
# fails that test, not the run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would take most of the GPU's memory
export EXCHANGE_GPU_TEST_TIMEOUT="${EXCHANGE_GPU_TEST_TIMEOUT:-45}"
exec "$PY" ci/gpu_check.py -- "$@"
