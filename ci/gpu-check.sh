#!/usr/bin/env bash
# The GPU check, for a bare GPU machine, in one call of at most 6 minutes: no install
# step (the packages are already there: pytest, numpy, cuda-python, CuPy, PyTorch,
# JAX...), the project on PYTHONPATH.
#
#   bash ci/gpu-check.sh [extra pytest arguments]
#
# Steps, each under its own time limit inside one overall budget (a step that no longer
# fits is not started, and the table names it), each step's processes ended with it:
#   1. preflight (ci/gpu_preflight.py, 10-20 s): the versions, then pytest, the driver and
#      cuda.core Device(0), which are fatal (no GPU: it stops here within a few seconds,
#      saying why), then the peers (a CuPy kernel, torch.cuda, jax.devices("gpu"), the
#      demo's packages), whose failure only skips their tests (the table says so);
#   2. the compiled core built in place (ci/build_native.py: setup.py build_ext with
#      setuptools >= 77, else gcc over exchange/native/*.c with Python's flags); where a
#      compiler and Python.h are here and it does not load, the check FAILS;
#   3. tensor-exchange doctor;
#   4. pytest tests/gpu on the compiled path and on the pure-Python path
#      (EXCHANGE_PURE_PYTHON=1), at the same time (GPU_CHECK_SERIAL=1: one after the
#      other), each with a JUnit file and its results written as they come;
#   5. compute-sanitizer (ci/gpu_sanitizer.py): a planted premature free that memcheck
#      must catch, then the release, handshake, chain and share tests with 0 errors;
#      where it cannot run (absent; the gVisor sandbox refuses it) the table says why;
#   6. tensor-exchange demo --device cuda --report json (stdout alone: demo.json);
#   7. tensor-exchange bench --device cuda --quick --json (stdout alone: bench.json);
#   8. ci/check_gpu_results.py: one table (versions, steps, each GPU test file on both
#      paths, the peers, the sanitizer, the demo, the bench's GPU figures) and the verdict.
# Exits non-zero when the preflight fails, or the table's verdict is a failure: a test
# failed, none passed, a test was skipped for a reason the machine is not known to
# cause, a path did not finish (the test that hung is named), the compiled core was
# expected and did not load, the sanitizer ran and found errors or missed the plant.
#
# Environment: PYTHON (default python3); GPU_CHECK_OUT (folder for the log, the JUnit
# and results files, the JSON reports; default a new temporary folder); GPU_CHECK_BUDGET
# (seconds for the whole check, default 330); EXCHANGE_GPU_TEST_TIMEOUT (seconds one test
# may take, default 45: pytest-timeout's --timeout where installed, else
# tests/gpu/conftest.py's own; either way a timeout fails that test, not the run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would take most of the GPU's memory
export EXCHANGE_GPU_TEST_TIMEOUT="${EXCHANGE_GPU_TEST_TIMEOUT:-45}"
budget="${GPU_CHECK_BUDGET:-330}"
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
mkdir -p "$out"
log="$out/gpu-check.log"
steps="$out/steps.tsv"
: >"$log"
printf 'step\tstatus\tseconds\tnote\n' >"$steps"
start=$SECONDS

say() { echo "gpu-check: $*" | tee -a "$log"; }
# note NAME STATUS SECONDS TEXT: one row of the steps table
note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >>"$steps"; }
# seconds for the next step: its own cap, but never past the overall budget
limit() { local left=$((budget - (SECONDS - start))); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

# run_limited NAME SECS LOGFILE STDOUT cmd...: run cmd under timeout(1) (its own process
# group), both streams appended to LOGFILE as they come, or stdout alone into the file
# STDOUT when it is not "-"; then end whatever the group left running (a hung test's
# spawned children would keep their GPU contexts). Returns cmd's status (124: timed out).
run_limited() {
    local name="$1" secs="$2" to="$3" dest="$4"; shift 4
    local pidf="$out/.$name.pid" rcf="$out/.$name.rc"
    rm -f "$pidf" "$rcf"
    if [ "$dest" != "-" ]; then
        { timeout -k 5 "$secs" "$@" >"$dest" & echo $! >"$pidf"; wait $!; echo $? >"$rcf"; } 2>&1 | tee -a "$to"
    else
        { timeout -k 5 "$secs" "$@" & echo $! >"$pidf"; wait $!; echo $? >"$rcf"; } 2>&1 | tee -a "$to"
    fi
    local pid
    pid="$(cat "$pidf" 2>/dev/null)"
    [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null
    return "$(cat "$rcf" 2>/dev/null || echo 125)"
}

# step NAME CAP STDOUT cmd...: run_limited into the main log, timed, with its row in the table
step() {
    local name="$1" cap="$2" dest="$3"; shift 3
    local secs t0=$SECONDS rc
    secs="$(limit "$cap")"
    if [ "$secs" -lt 5 ]; then
        say "$name: not run: no time left in the ${budget} s budget"
        note "$name" "not run" 0 "no time left in the ${budget} s budget"
        return 124
    fi
    run_limited "$name" "$secs" "$log" "$dest" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "$name: stopped after its limit of ${secs} s"
        note "$name" "timed out" "$((SECONDS - t0))" "stopped after its limit of ${secs} s"
    else
        note "$name" "$([ "$rc" -eq 0 ] && echo ok || echo "status $rc")" "$((SECONDS - t0))" ""
    fi
    return "$rc"
}

say "output in $out; budget ${budget} s; per-test limit ${EXCHANGE_GPU_TEST_TIMEOUT} s"

# 1. preflight: only the driver and cuda.core (and pytest) are fatal
step preflight 45 - "$PY" ci/gpu_preflight.py --json "$out/preflight.json"
pre=$?
# A preflight stopped by its limit while trying a peer (a hung import) has passed the
# fatal checks: go on, that peer's tests then skip or fail, and the table names it.
if [ "$pre" -eq 124 ] && "$PY" -c 'import json, sys; s = json.load(open(sys.argv[1]))
sys.exit(0 if all(s["checks"].get(n, {}).get("ok") for n in ("pytest", "driver", "cuda.core")) else 1)' \
        "$out/preflight.json" 2>/dev/null; then
    say "preflight: the fatal checks passed; it was stopped while trying a peer (see the table)"
elif [ "$pre" -ne 0 ]; then
    say "preflight failed (status $pre): nothing else runs; the reason is above ($((SECONDS - start)) s)"
    exit 1
fi

# 2. the compiled core, in place
step build 60 - "$PY" ci/build_native.py
case $? in
    0) native=yes ;;
    3) native=no ;;      # no compiler or no Python.h: the pure-Python path only
    *) native=failed ;;  # expected and not loaded: the table's verdict fails
esac
echo "$native" >"$out/native.txt"
say "compiled core: $native"

# 3. doctor
step doctor 30 - "$PY" -m exchange doctor

# 4. the GPU suite on both paths
timeout_args=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_args=(--timeout="$EXCHANGE_GPU_TEST_TIMEOUT" -o timeout_method=signal)  # signal: the test fails, the run goes on
fi
# suite LABEL: pytest tests/gpu into gpu-junit-LABEL.xml, results-LABEL.jsonl, pytest-LABEL.log
suite() {
    local label="$1" secs="$2"; shift 2
    rm -f "$out/gpu-junit-$label.xml" "$out/results-$label.jsonl" "$out/results-$label.jsonl.stacks"
    : >"$out/pytest-$label.log"
    run_limited "pytest-$label" "$secs" "$out/pytest-$label.log" - env "$@" \
        EXCHANGE_GPU_RESULTS="$out/results-$label.jsonl" "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider \
        --junitxml="$out/gpu-junit-$label.xml" -o junit_family=xunit2 ${timeout_args[@]+"${timeout_args[@]}"} \
        ${pytest_args[@]+"${pytest_args[@]}"} \
        >/dev/null
}
pytest_args=("$@")
labels=()
[ "$native" = "yes" ] && labels+=(compiled)
labels+=(pure-python)
secs="$(limit 170)"
t0=$SECONDS
if [ "$secs" -lt 30 ]; then
    say "the GPU suite: not run: only ${secs} s of the budget left"
    note suite "not run" 0 "only ${secs} s of the budget left"
elif [ "${GPU_CHECK_SERIAL:-}" = "1" ] || [ "${#labels[@]}" -eq 1 ]; then
    for label in "${labels[@]}"; do
        secs="$(limit 120)"
        t1=$SECONDS
        if [ "$secs" -lt 30 ]; then
            note "suite $label" "not run" 0 "only ${secs} s of the budget left"
            continue
        fi
        pure=1
        [ "$label" = "compiled" ] && pure=
        suite "$label" "$secs" EXCHANGE_PURE_PYTHON="$pure"
        rc=$?
        note "suite $label" "$([ "$rc" -eq 0 ] && echo ok || echo "status $rc")" "$((SECONDS - t1))" ""
        say "pytest tests/gpu ($label path) exited with status $rc"
    done
else
    say "the GPU suite on both paths at once (output in pytest-compiled.log and pytest-pure-python.log)"
    suite compiled "$secs" EXCHANGE_PURE_PYTHON= &
    p1=$!
    suite pure-python "$secs" EXCHANGE_PURE_PYTHON=1 &
    p2=$!
    wait $p1; rc1=$?
    wait $p2; rc2=$?
    note "suite compiled" "$([ "$rc1" -eq 0 ] && echo ok || echo "status $rc1")" "$((SECONDS - t0))" "both paths at once"
    note "suite pure-python" "$([ "$rc2" -eq 0 ] && echo ok || echo "status $rc2")" "$((SECONDS - t0))" "both paths at once"
    say "pytest tests/gpu exited with status $rc1 (compiled path) and $rc2 (pure-Python path)"
fi
for label in "${labels[@]}"; do
    tail -n 3 "$out/pytest-$label.log" | sed "s/^/[$label] /" | tee -a "$log"
done

# 5. compute-sanitizer: the plant, then the real code
secs="$(limit 120)"
step sanitizer 120 - "$PY" ci/gpu_sanitizer.py --out "$out" --budget "$((secs > 10 ? secs - 10 : secs))"

# 6. the demo on CUDA (its JSON alone on stdout)
if "$PY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("sklearn", "onnx", "onnxruntime")))'; then
    step demo 50 "$out/demo.json" "$PY" -m exchange demo --device cuda --report json
else
    say "demo: not run: it needs scikit-learn, onnx and onnxruntime"
    note demo "not run" 0 "it needs scikit-learn, onnx and onnxruntime"
fi

# 7. the bench on CUDA (its JSON alone on stdout)
step bench 75 "$out/bench.json" "$PY" -m exchange bench --device cuda --quick --json

# 8. the table
echo | tee -a "$log"
junits=() results=()
for label in "${labels[@]}"; do
    junits+=("$out/gpu-junit-$label.xml")
    results+=(--results "$out/results-$label.jsonl")
done
"$PY" ci/check_gpu_results.py "${junits[@]}" --labels "$(IFS=,; echo "${labels[*]}")" "${results[@]}" \
    --preflight "$out/preflight.json" --steps "$steps" --native "$native" --sanitizer "$out/sanitizer.json" \
    --demo "$out/demo.json" --bench "$out/bench.json" --budget "$budget" 2>&1 | tee -a "$log"
check=${PIPESTATUS[0]}
say "done in $((SECONDS - start)) s; log, JUnit and results files, JSON reports in $out"
exit "$check"
