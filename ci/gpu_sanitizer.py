"""The sanitizer step of the GPU check (ci/gpu-check.sh): the two promises (no premature
free, nothing unordered) checked by NVIDIA's compute-sanitizer, and the check shown to
bite first.

    python ci/gpu_sanitizer.py --out DIR [--budget SECONDS]

1. Find ``compute-sanitizer`` (PATH, $CUDA_HOME/bin, beside nvcc, /usr/local/cuda*/bin).
   Absent: says so and stops (status ``absent``).
2. The plant: ``tests/gpu/sanitizer_plant.py`` with the test-only switch
   ``EXCHANGE_TEST_UNORDERED_FREE=1`` (a free that does not wait for the stream still
   reading the memory: devices/cuda.py), under ``compute-sanitizer --tool memcheck
   --leak-check full --track-stream-ordered-races all``. It must report at least one
   error (``caught``); none means the check does not bite (a failure). A sanitizer that
   prints no ERROR SUMMARY could not run here (status ``unavailable``, with its words;
   the gVisor sandbox, which refuses it, is named when detected).
3. The real code: pytest over SANITIZER_TESTS (release, handshake, chain, one share
   round trip; tests needing PyTorch or JAX are left out: those processes crawl under
   the sanitizer) under the same options, ``--target-processes all`` (the share test's
   child processes too). Every process's ERROR SUMMARY must be 0 and every test pass.

Each run's full output goes to DIR (sanitizer-plant.log, sanitizer-tests.log); DIR/
sanitizer.json holds the summary (``status``, ``reason``, ``plant``, ``real``,
``seconds``) that ci/check_gpu_results.py puts in the table. Exit 0 when the step
passed or could not run here (the table says which), 1 when it ran and failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The tests run under the sanitizer (pytest node ids and -k), small enough for its step.
SANITIZER_TESTS = ["tests/gpu/test_gpu_release.py", "tests/gpu/test_gpu_handshake.py", "tests/gpu/test_gpu_chain.py",
                   "tests/gpu/test_gpu_share.py::test_producer_kernel_consumer_kernel_then_release"]
SANITIZER_KEYWORDS = "not torch and not jax"
#: memcheck's options: device-memory leaks, and uses of stream-ordered allocations out of
#: stream order (before their allocation, after their free) whatever the timing. API
#: errors are not counted: tests provoke some on purpose (a device that does not exist)
#: and assert them themselves.
OPTIONS = ["--tool", "memcheck", "--leak-check", "full", "--track-stream-ordered-races", "all",
           "--report-api-errors", "no", "--print-limit", "50"]
PLANT_TIMEOUT_S = 40
TESTS_TIMEOUT_S = 150

_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
#: What the sanitizer says when it cannot instrument the process (a sandbox, a driver it
#: does not support): then a plant it did not catch says nothing about the check.
_REFUSED = re.compile(r"^=+ (Error:|Internal Sanitizer Error)|Target application terminated before first instrumented"
                      r"|Unable to (find|load|attach)|not supported on this", re.I)
_LEAKS = re.compile(r"LEAK SUMMARY: (\d+) bytes leaked in (\d+) allocations?")


def find() -> str | None:
    """The compute-sanitizer executable, or None."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    places = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        places.append(os.path.dirname(os.path.realpath(nvcc)))
    places += ["/usr/local/cuda/bin", *sorted(glob.glob("/usr/local/cuda-*/bin"), reverse=True),
               *sorted(glob.glob("/opt/nvidia/*/compute-sanitizer"), reverse=True)]
    for place in places:
        candidate = os.path.join(place, "compute-sanitizer")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def gvisor() -> bool:
    """True inside gVisor (runsc), whose kernel says 4.4.0 and whose dmesg names it."""
    try:
        text = Path("/proc/version").read_text()
    except OSError:
        text = ""
    if "gvisor" in text.lower():
        return True
    if platform.release() == "4.4.0":
        try:
            out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
            return "gvisor" in (out.stdout + out.stderr).lower()
        except (OSError, subprocess.SubprocessError):
            return False
    return False


def parse(text: str) -> dict:
    """Sum the ERROR and LEAK SUMMARY lines of every process in a sanitizer's output."""
    errors = [int(n) for n in _SUMMARY.findall(text)]
    leaks = _LEAKS.findall(text)
    return {"processes": len(errors), "errors": sum(errors), "leaked_bytes": sum(int(b) for b, _ in leaks),
            "leaked_allocations": sum(int(n) for _, n in leaks),
            "first_error": next((line.strip("= ").strip() for line in text.splitlines()
                                 if line.startswith("=========") and re.search(r"Invalid|race|leak|Leaked|error:",
                                                                              line, re.I)
                                 and "SUMMARY" not in line), "")}


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, str, bool]:
    """Run ``cmd`` with its output (both streams) in ``log``; (status, output, timed out).
    The whole process group is ended on a timeout (the share test's children too)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    try:
        os.killpg(proc.pid, 9)  # children left behind
    except OSError:
        pass
    return rc, log.read_text(errors="replace"), timed_out


def step(out: Path, budget: float) -> dict:
    started = time.monotonic()
    result: dict = {"status": "absent", "reason": "", "plant": None, "real": None}
    sanitizer = find()
    sandbox = gvisor()
    if sanitizer is None:
        result["reason"] = "compute-sanitizer is not installed here (not on PATH, in CUDA_HOME, beside nvcc, " \
                           "or in /usr/local/cuda*/bin)"
        return result
    result["sanitizer"] = sanitizer
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["EXCHANGE_GPU_SANITIZER"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    # 2. the plant: the check must bite
    plant_env = {**env, "EXCHANGE_TEST_UNORDERED_FREE": "1", "EXCHANGE_DEBUG_POISON": "1"}
    left = budget - (time.monotonic() - started)
    rc, text, timed_out = run([sanitizer, *OPTIONS, sys.executable, "tests/gpu/sanitizer_plant.py"], plant_env,
                              out / "sanitizer-plant.log", min(PLANT_TIMEOUT_S, max(5.0, left)))
    found = parse(text)
    seen = next((line for line in text.splitlines() if line.startswith("plant:")), "")
    result["plant"] = {**found, "rc": rc, "timed_out": timed_out, "said": seen, "caught": found["errors"] > 0}
    refused = [line.strip("= ").strip() for line in text.splitlines() if _REFUSED.search(line)]
    if not found["processes"] or (refused and not found["errors"]):
        result["status"] = "unavailable"
        tail = refused[0] if refused else " | ".join(line.strip() for line in text.strip().splitlines()[-4:])
        why = "timed out" if timed_out else f"status {rc}"
        result["reason"] = (f"compute-sanitizer could not check here ({why}): "
                            + ("this is the gVisor sandbox, which refuses it; " if sandbox else "") + tail[:400])
        return result
    result["status"] = "ran"

    # 3. the real code: 0 errors
    left = budget - (time.monotonic() - started)
    if left < 20:
        result["reason"] = f"no time left for the tests under the sanitizer ({left:.0f} s)"
        return result
    junit = out / "sanitizer-junit.xml"
    cmd = [sanitizer, *OPTIONS, "--target-processes", "all", sys.executable, "-m", "pytest", *SANITIZER_TESTS,
           "-k", SANITIZER_KEYWORDS, "-v", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit2"]
    test_env = {**env, "EXCHANGE_GPU_TEST_TIMEOUT": env.get("EXCHANGE_GPU_SANITIZER_TEST_TIMEOUT", "60"),
                "EXCHANGE_GPU_SHARE_TIMEOUT": "40", "EXCHANGE_GPU_RESULTS": str(out / "sanitizer-results.jsonl")}
    rc, text, timed_out = run(cmd, test_env, out / "sanitizer-tests.log", min(TESTS_TIMEOUT_S, left))
    result["real"] = {**parse(text), "rc": rc, "timed_out": timed_out, "pytest": junit_counts(junit)}
    return result


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped of a pytest JUnit file ({} when it is missing)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def verdict(result: dict) -> list[str]:
    """The step's problems (empty: it passed, or could not run here)."""
    problems = []
    plant, real = result.get("plant"), result.get("real")
    if result["status"] != "ran":
        return problems
    if not plant["caught"]:
        problems.append("memcheck did NOT catch the planted premature free: the check does not bite "
                        f"({plant['said'] or 'the plant printed nothing'})")
    if real is None:
        problems.append(result["reason"] or "the tests did not run under the sanitizer")
    else:
        if real["timed_out"]:
            problems.append("the tests under the sanitizer ran out of time")
        if real["errors"]:
            problems.append(f"memcheck: {real['errors']} errors on the real code ({real['first_error']})")
        tests = real["pytest"]
        if not tests:
            problems.append("pytest under the sanitizer wrote no JUnit file (it did not finish)")
        elif tests["failed"] or not tests["passed"]:
            problems.append(f"tests under the sanitizer: {tests['passed']} passed, {tests['failed']} failed, "
                            f"{tests['skipped']} skipped")
        elif real["rc"] != 0 and not real["errors"]:
            problems.append(f"pytest under the sanitizer exited with status {real['rc']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs and sanitizer.json")
    parser.add_argument("--budget", type=float, default=PLANT_TIMEOUT_S + TESTS_TIMEOUT_S,
                        help="seconds for the whole step")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = step(args.out, args.budget)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["problems"] = verdict(result)
    (args.out / "sanitizer.json").write_text(json.dumps(result))
    if result["status"] != "ran":
        print(f"sanitizer: not run: {result['reason']}")
        return 0
    plant, real = result["plant"], result["real"]
    print(f"sanitizer: plant {'caught' if plant['caught'] else 'NOT CAUGHT'} ({plant['errors']} errors; {plant['said']})")
    if real is not None:
        print(f"sanitizer: real code: {real['errors']} errors in {real['processes']} processes, "
              f"{real['leaked_allocations']} leaked allocations ({real['leaked_bytes']} bytes); pytest {real['pytest']}")
    for problem in result["problems"]:
        print(f"sanitizer: FAILED: {problem}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
