#!/usr/bin/env bash
# The CPU job: the package with its test extras in a virtual environment (VENV, default
# .venvs/test; made when missing), then the README's test command on both capsule
# paths: the compiled helper, and the pure-Python one (EXCHANGE_PURE_PYTHON=1). Runs on
# a machine with no GPU; tests/gpu skips with its reason. `make test` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venvs/test}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -e ".[test,interop,demo,ray]" -c ci/constraints.txt
fi
. "$venv/bin/activate"
pytest tests/cpu tests/gpu
EXCHANGE_PURE_PYTHON=1 pytest tests/cpu tests/gpu
