#!/usr/bin/env bash
# The CPU job: a new virtual environment, the package with its test extras, then the
# README's test command. Runs on a machine with no GPU; tests/gpu skips with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q -e ".[test,interop,demo]" -c ci/constraints.txt
pytest tests/cpu tests/gpu
