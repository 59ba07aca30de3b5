"""The sanitizer step of the GPU check (ci/gpu_check.py): the two promises (no premature
free, nothing unordered) checked by NVIDIA's compute-sanitizer, and the check shown to
bite first.

    python ci/gpu_sanitizer.py --out DIR [--budget SECONDS]

1. Find ``compute-sanitizer`` (PATH, $CUDA_HOME/bin, beside nvcc, /usr/local/cuda*/bin).
   Absent: says so and stops (status ``absent``).
2. The plant: ``tests/gpu/sanitizer_plant.py --mode unordered`` with the test-only
   switch ``EXCHANGE_TEST_UNORDERED_FREE=1`` (the library's own release frees without
   waiting for the stream still reading the memory: devices/cuda.py), under
   ``compute-sanitizer --tool memcheck --leak-check full --track-stream-ordered-races
   all``. It must report at least one error (``caught``). Not caught: the report says
   why, from what the reader saw (its data: the read ended before the free, launches
   ran one after another; the poison: the free came first and memcheck did not report
   it), and a second plant runs, ``--mode after-free``: a read ordered after the free in
   stream order (an explicit ordering bug), which memcheck reports whatever the timing.
   One of them caught: the check bites (the table says which); neither: a failure. A
   sanitizer that ends printing no ERROR SUMMARY could not run here (status
   ``unavailable``, with its words; the gVisor sandbox, which refuses it, is named when
   detected); one that runs past the plant's limit did not finish, which fails.
3. The real code: pytest over SANITIZER_TESTS (release, handshake, chain; tests needing
   PyTorch or JAX are left out: those processes crawl under the sanitizer) under the
   same options. Every process's ERROR SUMMARY must be 0 and every test pass. The share
   tests are left out of this first set: memcheck may not know memory a consumer
   process imported through ``cuMemPoolImportPointer``, and would count its reads as
   invalid, an error of the sanitizer's and not of the code; they run (on both paths)
   in the GPU suite. Their time is measured against the step's limit (``real.seconds``,
   ``real.limit_s``, the slowest tests) so the set can be sized from a run.

Sizes: the plant gets at most PLANT_TIMEOUT_S, the tests at most TESTS_TIMEOUT_S and
need at least TESTS_FLOOR_S (less left: "did not fit", said, not run).

Processes: each run is in a process group of its own, whose id is appended to the file
``$GPU_CHECK_PGIDS`` when set (the check ends those groups after the step, whatever
became of this script), and ended with this script: on its own limits, and on SIGTERM
(the check's limit), after which the report is still written, marked ``stopped``.

Each run's full output goes to DIR (sanitizer-plant.log, sanitizer-plant-after-free.log,
sanitizer-tests.log); DIR/sanitizer.json holds the summary (``status``, ``reason``,
``plant``, ``second_plant``, ``real``, ``seconds``, ``problems``: what it found wrong,
``unfinished``: why it did not finish) that ci/check_gpu_results.py puts in the table.
Exit 0 when the step passed or could not run here (the table says which), 1 when it ran
and failed or did not finish.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The tests run under the sanitizer (pytest paths, with -k SANITIZER_KEYWORDS). Not the
#: share tests: memcheck cannot follow memory another process imported (module docstring).
SANITIZER_TESTS = ["tests/gpu/test_gpu_release.py", "tests/gpu/test_gpu_handshake.py", "tests/gpu/test_gpu_chain.py"]
SANITIZER_KEYWORDS = "not torch and not jax"
#: memcheck's options: device-memory leaks, and uses of stream-ordered allocations out of
#: stream order (before their allocation, after their free) whatever the timing. API
#: errors are not counted: tests provoke some on purpose (a device that does not exist)
#: and assert them themselves.
OPTIONS = ["--tool", "memcheck", "--leak-check", "full", "--track-stream-ordered-races", "all",
           "--report-api-errors", "no", "--print-limit", "50"]
PLANT_TIMEOUT_S = 40
TESTS_TIMEOUT_S = 90
TESTS_FLOOR_S = 45
#: Seconds a test may take under the sanitizer (its kernels and module loads are
#: instrumented) and a share wait (none run here now; kept for a later set).
TEST_TIMEOUT_S = "40"

_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
#: What the sanitizer says when it cannot instrument the process (a sandbox, a driver it
#: does not support): then a plant it did not catch says nothing about the check.
_REFUSED = re.compile(r"^=+ (Error:|Internal Sanitizer Error)|Target application terminated before first instrumented"
                      r"|Unable to (find|load|attach)|not supported on this", re.I)
_LEAKS = re.compile(r"LEAK SUMMARY: (\d+) bytes leaked in (\d+) allocations?")

#: Why the plant was not caught, from what its reader saw (the plant's last words).
NOT_CAUGHT_WHY = {
    "its data": "the reader saw its data: the read ended before the free ran (the sanitizer ran the launches "
                "one after another), and memcheck did not report the free as unordered with the read",
    "freed memory (the poison pattern)": "the reader saw the poison: the free did run before the read, and "
                                         "memcheck's stream-ordered race tracking did not report it",
    "other values": "the reader saw neither its data nor the poison (see sanitizer-plant.log)",
}


class Stopped(Exception):
    """SIGTERM arrived (the GPU check's limit for this step)."""


def _on_term(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by signal {signum} (the check's limit for this step)")


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


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, str, bool]:
    """Run ``cmd`` in a process group of its own with its output (both streams) in
    ``log``; (status, output, timed out). The group (the share test's children too) is
    ended when the run ends, on its timeout, and on Stopped; its id is noted in
    $GPU_CHECK_PGIDS first, so the check can end it should this script be killed."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env, process_group=0)
        noted = os.environ.get("GPU_CHECK_PGIDS")
        if noted:
            with open(noted, "a") as pg:
                pg.write(f"{proc.pid}\n")
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _end_group(proc.pid)
            rc, timed_out = proc.wait(), True
        except BaseException:  # Stopped, KeyboardInterrupt: the group goes with us
            _end_group(proc.pid)
            proc.wait()
            raise
        finally:
            _end_group(proc.pid)  # children left behind
    return rc, log.read_text(errors="replace"), timed_out


def _plant(sanitizer: str, env: dict, out: Path, mode: str, timeout: float) -> tuple[dict, str]:
    """One plant under memcheck: its findings, and its whole output."""
    log = out / ("sanitizer-plant.log" if mode == "unordered" else f"sanitizer-plant-{mode}.log")
    rc, text, timed_out = run([sanitizer, *OPTIONS, sys.executable, "tests/gpu/sanitizer_plant.py", "--mode", mode],
                              env, log, timeout)
    found = parse(text)
    said = next((line for line in text.splitlines() if line.startswith("plant")), "")
    plant = {**found, "mode": mode, "rc": rc, "timed_out": timed_out, "said": said, "caught": found["errors"] > 0}
    if not plant["caught"]:
        seen = said.rsplit("the reader saw ", 1)[-1] if "the reader saw " in said else ""
        plant["why"] = NOT_CAUGHT_WHY.get(seen, "the plant printed nothing: it did not finish (see "
                                                f"{log.name})" if not said else f"it said: {said}")
    return plant, text


def step(out: Path, budget: float, result: dict) -> None:
    """Fill ``result`` (the report) as the step goes, so a stopped step still says how
    far it got."""
    started = time.monotonic()

    def left() -> float:
        return budget - (time.monotonic() - started)

    sanitizer = find()
    sandbox = gvisor()
    if sanitizer is None:
        result["reason"] = "compute-sanitizer is not installed here (not on PATH, in CUDA_HOME, beside nvcc, " \
                           "or in /usr/local/cuda*/bin)"
        return
    result["sanitizer"] = sanitizer
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["EXCHANGE_GPU_SANITIZER"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    # 2. the plant: the check must bite
    plant_env = {**env, "EXCHANGE_TEST_UNORDERED_FREE": "1", "EXCHANGE_DEBUG_POISON": "1"}
    result["status"] = "running"
    plant, text = _plant(sanitizer, plant_env, out, "unordered", min(PLANT_TIMEOUT_S, max(5.0, left())))
    result["plant"] = plant
    refused = [line.strip("= ").strip() for line in text.splitlines() if _REFUSED.search(line)]
    if not plant["timed_out"] and (not plant["processes"] or (refused and not plant["errors"])):
        result["status"] = "unavailable"
        tail = refused[0] if refused else " | ".join(line.strip() for line in text.strip().splitlines()[-4:])
        why = "timed out" if plant["timed_out"] else f"status {plant['rc']}"
        result["reason"] = (f"compute-sanitizer could not check here ({why}): "
                            + ("this is the gVisor sandbox, which refuses it; " if sandbox else "") + tail[:400])
        return
    result["status"] = "ran"
    if not plant["caught"] and not plant["timed_out"] and left() >= TESTS_FLOOR_S + 20:
        second_env = {**env, "EXCHANGE_DEBUG_POISON": "1"}
        result["second_plant"], _ = _plant(sanitizer, second_env, out, "after-free",
                                           min(PLANT_TIMEOUT_S, left() - TESTS_FLOOR_S))

    # 3. the real code: 0 errors
    if left() < TESTS_FLOOR_S:
        result["did_not_fit"] = (f"the tests under the sanitizer need {TESTS_FLOOR_S} s; {left():.0f} s of the "
                                 f"step's {budget:.0f} s were left")
        return
    junit = out / "sanitizer-junit.xml"
    cmd = [sanitizer, *OPTIONS, "--target-processes", "all", sys.executable, "-m", "pytest", *SANITIZER_TESTS,
           "-k", SANITIZER_KEYWORDS, "-v", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit2"]
    test_env = {**env, "EXCHANGE_GPU_TEST_TIMEOUT": env.get("EXCHANGE_GPU_SANITIZER_TEST_TIMEOUT", TEST_TIMEOUT_S),
                "EXCHANGE_GPU_SHARE_TIMEOUT": "30", "EXCHANGE_GPU_RESULTS": str(out / "sanitizer-results.jsonl")}
    limit = min(TESTS_TIMEOUT_S, left())
    t0 = time.monotonic()
    result["real"] = {"limit_s": round(limit, 1), "running": True}
    rc, text, timed_out = run(cmd, test_env, out / "sanitizer-tests.log", limit)
    result["real"] = {**parse(text), "rc": rc, "timed_out": timed_out, "pytest": junit_counts(junit),
                      "seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit, 1),
                      "slowest": slowest(junit)}


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


def slowest(path: Path, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` slowest tests of a JUnit file, (name, seconds)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    times = [(case.get("name", "?"), float(case.get("time", "0") or 0)) for case in root.iter("testcase")]
    return [(name, round(s, 1)) for name, s in sorted(times, key=lambda x: -x[1])[:n]]


def verdict(result: dict) -> tuple[list[str], list[str]]:
    """The step's problems: (what it found wrong, why it did not finish). Both empty: it
    passed, or could not run here."""
    problems: list[str] = []
    unfinished: list[str] = []
    if result.get("stopped"):
        unfinished.append(result["stopped"])
    plant, second, real = result.get("plant"), result.get("second_plant"), result.get("real")
    if result.get("status") not in ("ran", "running"):
        return problems, unfinished
    if plant is None:
        unfinished.append("the plant did not run")
    elif plant.get("timed_out") and not plant["caught"]:
        unfinished.append("the plant ran past its limit: memcheck never said whether it catches it")
    elif not plant["caught"]:
        if second is not None and second["caught"]:
            pass  # it bites, on the second plant: the table says which, and why the first was missed
        elif second is None:
            problems.append(f"memcheck did NOT catch the planted unordered free ({plant['why']}); no time was left "
                            "for the second plant (a read ordered after the free)")
        else:
            problems.append(f"memcheck did NOT catch the planted unordered free ({plant['why']}), nor the read "
                            f"ordered after the free ({second.get('why', second['said'])}): the check does not bite")
    if result.get("did_not_fit"):
        unfinished.append(result["did_not_fit"])
    elif real is None or real.get("running"):
        if not result.get("stopped"):
            unfinished.append("the tests did not run under the sanitizer")
    else:
        if real["errors"]:
            problems.append(f"memcheck: {real['errors']} errors on the real code ({real['first_error']})")
        tests = real["pytest"]
        if real["timed_out"]:
            unfinished.append(f"the tests under the sanitizer ran past their limit of {real['limit_s']:g} s")
        if not tests:
            unfinished.append("pytest under the sanitizer wrote no JUnit file (it did not finish)")
        elif tests["failed"] or not tests["passed"]:
            problems.append(f"tests under the sanitizer: {tests['passed']} passed, {tests['failed']} failed, "
                            f"{tests['skipped']} skipped")
        elif real["rc"] != 0 and not real["errors"] and not real["timed_out"]:
            problems.append(f"pytest under the sanitizer exited with status {real['rc']}")
    return problems, unfinished


def write(out: Path, result: dict, t0: float) -> None:
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["problems"], result["unfinished"] = verdict(result)
    (out / "sanitizer.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs and sanitizer.json")
    parser.add_argument("--budget", type=float, default=2 * PLANT_TIMEOUT_S + TESTS_TIMEOUT_S,
                        help="seconds for the whole step")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result: dict = {"status": "absent", "reason": "", "plant": None, "second_plant": None, "real": None}
    signal.signal(signal.SIGTERM, _on_term)
    try:
        step(args.out, args.budget, result)
    except Stopped as exc:
        result["stopped"] = str(exc)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        write(args.out, result, t0)
    if result["status"] not in ("ran", "running"):
        print(f"sanitizer: not run: {result['reason']}")
        return 0
    plant, second, real = result["plant"], result["second_plant"], result["real"]
    if plant is not None:
        print(f"sanitizer: plant {'caught' if plant['caught'] else 'NOT CAUGHT'} ({plant['errors']} errors; "
              f"{plant['said'] or 'it said nothing'})" + ("" if plant["caught"] else f": {plant['why']}"))
    if second is not None:
        caught = "caught" if second["caught"] else "NOT CAUGHT"
        print(f"sanitizer: second plant (a read ordered after the free) {caught} ({second['errors']} errors; "
              f"{second['said'] or 'it said nothing'})")
    if real is not None and not real.get("running"):
        print(f"sanitizer: real code: {real['errors']} errors in {real['processes']} processes, "
              f"{real['leaked_allocations']} leaked allocations ({real['leaked_bytes']} bytes); "
              f"pytest {real['pytest']} in {real['seconds']:g} s of {real['limit_s']:g} s")
    for problem in result["problems"] + result["unfinished"]:
        print(f"sanitizer: FAILED: {problem}")
    return 1 if result["problems"] or result["unfinished"] else 0


if __name__ == "__main__":
    sys.exit(main())
