"""The GPU check's runner (ci/gpu-check.sh runs it): every step under a limit of its own
inside one budget, what proves the promises first, and the evidence in one archive.

    python ci/gpu_check.py [--out DIR] [--budget SECONDS] [--serial] [-- PYTEST_ARGS...]

Steps, in this order (cap: the most a step may take; floor: the least it needs, with
less of the budget left it is not started and its row says "did not fit"):

====================  ====  =====  ==============================================
step                   cap  floor  what
====================  ====  =====  ==============================================
preflight               40      -  ci/gpu_preflight.py: versions; no GPU: stop here
build                   45     15  ci/build_native.py: the compiled core in place
suite compiled         150     60  pytest tests/gpu on the compiled path
suite pure-python      150     60  ... and on the pure-Python path
sanitizer              140     60  ci/gpu_sanitizer.py: the plant, then 0 errors
demo                    45     25  tensor-exchange demo --device cuda (demo.json)
bench                   60     35  tensor-exchange bench --device cuda --quick
doctor                  15      5  tensor-exchange doctor
====================  ====  =====  ==============================================

The suites and the sanitizer prove the promises and run first, at the same time (with
``--serial``, or GPU_CHECK_SERIAL=1: one after the other); the demo, the bench and
doctor take what is left. RESERVE_S of the budget is kept for the table and the
archive. A step stopped at its limit says ``timed out`` when that was its own cap, a
failure, and ``cut short`` when the budget had shortened it, which, like "did not fit",
fails nothing (ci/check_gpu_results.py; the suites excepted: a path whose pytest did
not finish fails).

Processes: each step runs in a process group of its own, ended with the step (on its
limit: SIGTERM, then SIGKILL 5 s later; after it: whatever it left). A step that starts
processes in groups of their own (compute-sanitizer) notes their ids in the file named
by ``GPU_CHECK_PGIDS``; those groups are ended after the step too. SIGTERM or SIGINT
to this runner ends every step's groups and still writes the archive.

Output: the work goes in a new temporary folder (logs, JUnit and results files, JSON
reports, steps.tsv, the full table with a row per test); ``--out`` (GPU_CHECK_OUT)
receives two files only, ``gpu-check-table.txt`` (the versions line first, then the
table and the verdict, as printed last on the console) and ``gpu-check.tar.gz`` (the
whole work folder), so a tool that returns only a few files returns all of it.

Exit status: the table's verdict (0 passed, 1 failed); 1 when the preflight failed or
the runner was stopped; 2 when the table could not be made.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 240.0
RESERVE_S = 12.0
TERM_GRACE_S = 5.0
TABLE_FILE = "gpu-check-table.txt"
ARCHIVE_FILE = "gpu-check.tar.gz"
FATAL = ("pytest", "driver", "cuda.core")
#: (cap, floor) of each step, seconds (the table in the docstring); the two suites share
#: "suite".
LIMITS: dict[str, tuple[float, float]] = {"preflight": (40, 0), "build": (45, 15), "suite": (150, 60),
                                          "sanitizer": (140, 60), "demo": (45, 25), "bench": (60, 35),
                                          "doctor": (15, 5)}


@dataclass
class Step:
    """One step: ``cmd`` (or a function of the limit it gets, in seconds), its cap and
    floor (seconds), where its output goes (``log``: both streams appended; ``stdout``:
    stdout alone into that file instead), extra environment, and whether its output is
    also shown on the console."""

    name: str
    cmd: list[str] | Callable[[float], list[str]]
    cap: float
    floor: float = 0.0
    log: str = "gpu-check.log"
    stdout: str | None = None
    env: dict = field(default_factory=dict)
    echo: bool = False


@dataclass
class Outcome:
    name: str
    status: str  # ok, status N, timed out, cut short, did not fit, not run
    seconds: float = 0.0
    note: str = ""
    rc: int | None = None


class Stop(Exception):
    """SIGTERM or SIGINT to the runner."""


class Check:
    """Runs steps inside one budget (seconds from the check's start), writing steps.tsv
    and a console line per step into ``work``."""

    def __init__(self, work: Path, budget: float, reserve: float = RESERVE_S, console=print) -> None:
        self.work, self.budget, self.reserve, self.console = work, budget, reserve, console
        self.started = time.monotonic()
        self.outcomes: list[Outcome] = []
        self._running: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        (work / "steps.tsv").write_text("step\tstatus\tseconds\tnote\n")

    # -- time ----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        """Seconds of the budget a step may still use (the reserve kept back)."""
        return self.budget - self.reserve - self.elapsed()

    # -- output --------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        line = f"gpu-check: {text}"
        self.console(line)
        with (self.work / "gpu-check.log").open("a") as fh:
            fh.write(line + "\n")

    def note(self, outcome: Outcome) -> Outcome:
        with self._lock:
            self.outcomes.append(outcome)
            with (self.work / "steps.tsv").open("a") as fh:
                note = outcome.note.replace("\t", " ").replace("\n", " ")
                fh.write(f"{outcome.name}\t{outcome.status}\t{outcome.seconds:.0f}\t{note}\n")
        self.say(f"{outcome.name}: {outcome.status} ({outcome.seconds:.0f} s)" + (f": {outcome.note}" if outcome.note
                                                                                     else ""))
        return outcome

    def skip(self, step: Step, status: str, note: str) -> Outcome:
        return self.note(Outcome(step.name, status, 0.0, note))

    # -- running -------------------------------------------------------------------------------
    def run(self, step: Step) -> Outcome:
        return self.run_group([step])[0]

    def run_group(self, steps: list[Step]) -> list[Outcome]:
        """Start every step that fits at once; wait for all. Outcomes in ``steps``' order."""
        left = self.left()
        outcomes: list[Outcome | None] = [None] * len(steps)
        threads = []
        for i, step in enumerate(steps):
            limit = min(step.cap, left)
            if limit < max(step.floor, 1.0):
                outcomes[i] = self.skip(step, "did not fit", f"it needs {step.floor:.0f} s; {max(left, 0):.0f} s of "
                                                             f"the {self.budget:.0f} s budget were left")
                continue
            thread = threading.Thread(target=self._run_into, args=(outcomes, i, step, limit), name=f"step-{step.name}",
                                      daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # short joins: a signal reaches the main thread
        return [o for o in outcomes if o is not None]

    def _run_into(self, outcomes: list, i: int, step: Step, limit: float) -> None:
        try:
            outcomes[i] = self._run_one(step, limit)
        except Exception as exc:  # the runner's own failure: said in the table, never a pass
            outcomes[i] = self.note(Outcome(step.name, "status 125", 0.0, f"the runner failed: {exc!r}", 125))

    def _run_one(self, step: Step, limit: float) -> Outcome:
        cmd = step.cmd(limit) if callable(step.cmd) else step.cmd
        pgids = self.work / f".pgids-{step.name.replace(' ', '-')}"
        env = {**os.environ, "GPU_CHECK_PGIDS": str(pgids)}
        for key, value in step.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        t0 = time.monotonic()
        log = (self.work / step.log).open("a")
        out = (self.work / step.stdout).open("w") if step.stdout else None
        try:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, process_group=0,
                                    stdout=out or (subprocess.PIPE if step.echo else log),
                                    stderr=log if out or not step.echo else subprocess.STDOUT,
                                    text=step.echo and out is None)
        except OSError as exc:
            log.close()
            if out:
                out.close()
            return self.note(Outcome(step.name, "status 127", 0.0, f"could not start: {exc}", 127))
        with self._lock:
            self._running[step.name] = proc
        reader = None
        if step.echo and out is None:
            reader = threading.Thread(target=self._echo, args=(proc, log), daemon=True)
            reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            self._end(step.name, proc, pgids)
            if reader is not None:
                reader.join(5)
            log.close()
            if out:
                out.close()
        seconds = time.monotonic() - t0
        rc = proc.returncode
        if timed_out and limit < step.cap:
            return self.note(Outcome(step.name, "cut short", seconds, f"stopped at {limit:.0f} s, all the budget left "
                                                                      f"it of its {step.cap:.0f} s", rc))
        if timed_out:
            return self.note(Outcome(step.name, "timed out", seconds, f"stopped after its limit of {limit:.0f} s", rc))
        return self.note(Outcome(step.name, "ok" if rc == 0 else f"status {rc}", seconds, "", rc))

    def _echo(self, proc: subprocess.Popen, log) -> None:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            self.console(line.rstrip("\n"))

    def _end(self, name: str, proc: subprocess.Popen, pgids: Path) -> None:
        """End the step's group and the groups it noted (whatever they left running)."""
        with self._lock:
            self._running.pop(name, None)
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            noted = pgids.read_text().split()
        except OSError:
            noted = []
        for pgid in noted:
            if pgid.isdigit():
                _signal_group(int(pgid), signal.SIGKILL)

    def end_all(self) -> None:
        with self._lock:
            running = list(self._running.items())
        for name, proc in running:
            _signal_group(proc.pid, signal.SIGKILL)
        for pgids in self.work.glob(".pgids-*"):
            for pgid in pgids.read_text().split():
                if pgid.isdigit():
                    _signal_group(int(pgid), signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:  # gone already
        pass


def _on_signal(signum: int, frame: object) -> None:
    raise Stop(f"stopped by signal {signum}")


# -- the GPU check's steps -------------------------------------------------------------------------------
def fatal_checks_passed(preflight: Path) -> bool:
    """True when the preflight's JSON says the fatal checks passed (it may have been
    stopped later, while trying a peer)."""
    try:
        checks = json.loads(preflight.read_text())["checks"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(checks.get(name, {}).get("ok") for name in FATAL)


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def suite_step(py: str, work: Path, label: str, pytest_args: list[str], limits: dict = LIMITS) -> Step:
    timeout = os.environ.get("EXCHANGE_GPU_TEST_TIMEOUT", "45")
    timeout_args = [f"--timeout={timeout}", "-o", "timeout_method=signal"] if _has("pytest_timeout") else []
    return Step(f"suite {label}", [py, "-m", "pytest", "tests/gpu", "-v", "-rs", "-p", "no:cacheprovider",
                                   f"--junitxml={work / f'gpu-junit-{label}.xml'}", "-o", "junit_family=xunit2",
                                   *timeout_args, *pytest_args],
                cap=limits["suite"][0], floor=limits["suite"][1], log=f"pytest-{label}.log",
                env={"EXCHANGE_PURE_PYTHON": "1" if label == "pure-python" else None,
                     "EXCHANGE_GPU_RESULTS": str(work / f"results-{label}.jsonl")})


def sanitizer_step(py: str, work: Path, limits: dict = LIMITS) -> Step:
    # its own budget ends before the step's limit, so it writes its report itself
    return Step("sanitizer", lambda limit: [py, "ci/gpu_sanitizer.py", "--out", work, "--budget",
                                            f"{max(limit - 8, 5):.0f}"],
                cap=limits["sanitizer"][0], floor=limits["sanitizer"][1], log="sanitizer.log")


def table(py: str, work: Path, labels: list[str], native: str, budget: float, rows: bool) -> tuple[int, str]:
    """ci/check_gpu_results.py over what the steps left: (its status, its output)."""
    cmd = [py, "ci/check_gpu_results.py", *[work / f"gpu-junit-{label}.xml" for label in labels],
           "--labels", ",".join(labels)]
    for label in labels:
        cmd += ["--results", work / f"results-{label}.jsonl"]
    cmd += ["--preflight", work / "preflight.json", "--steps", work / "steps.tsv", "--native", native,
            "--sanitizer", work / "sanitizer.json", "--demo", work / "demo.json", "--bench", work / "bench.json",
            "--budget", f"{budget:.0f}"]
    if not rows:
        cmd.append("--no-table")
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return 2, "GPU CHECK FAILED: the table took more than 60 s"
    text = proc.stdout + (f"\n{proc.stderr}" if proc.returncode not in (0, 1) else "")
    return (proc.returncode if proc.returncode in (0, 1) else 2), text


def archive(work: Path, out: Path) -> Path:
    """The whole work folder as out/gpu-check.tar.gz (under ``gpu-check/``), the process
    id files left out."""
    path = out / ARCHIVE_FILE
    with tarfile.open(path, "w:gz") as tar:
        for item in sorted(work.iterdir()):
            if not item.name.startswith(".pgids-"):
                tar.add(item, arcname=f"gpu-check/{item.name}")
    return path


def run_check(work: Path, out: Path, budget: float, serial: bool, pytest_args: list[str], py: str = sys.executable,
              console=print, limits: dict = LIMITS, reserve: float = RESERVE_S) -> int:
    """The whole check (the steps, the table, the archive); its exit status. ``py`` runs
    every step's Python, ``limits`` and ``reserve`` size them (tests give other ones)."""
    check = Check(work, budget, reserve=reserve, console=console)

    def step(name: str, cmd: list, **kw) -> Step:
        return Step(name, cmd, cap=limits[name][0], floor=limits[name][1], **kw)

    check.say(f"work in {work}; results to {out} ({TABLE_FILE}, {ARCHIVE_FILE}); budget {budget:.0f} s "
              f"({reserve:.0f} s kept for the table); per-test limit "
              f"{os.environ.get('EXCHANGE_GPU_TEST_TIMEOUT', '45')} s")
    verdict, text = 1, ""
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # 1. preflight: only pytest, the driver and cuda.core are fatal
        pre = check.run(step("preflight", [py, "ci/gpu_preflight.py", "--json", work / "preflight.json"], echo=True))
        if pre.status in ("timed out", "cut short") and fatal_checks_passed(work / "preflight.json"):
            check.say("preflight: the fatal checks passed; it was stopped while trying a peer (see the table)")
        elif pre.status != "ok":
            check.say(f"preflight failed ({pre.status}): nothing else runs; the reason is above "
                      f"({check.elapsed():.0f} s)")
            text = _preflight_reason(work / "preflight.json", pre)
            return 1

        # 2. the compiled core, in place
        build = check.run(step("build", [py, "ci/build_native.py"]))
        native = {"ok": "yes", "status 3": "no", "did not fit": "skipped"}.get(build.status, "failed")
        (work / "native.txt").write_text(native + "\n")
        check.say(f"compiled core: {native}")
        labels = (["compiled"] if native == "yes" else []) + ["pure-python"]

        # 3. what proves the promises: the GPU suite on both paths, and the sanitizer
        proofs = [suite_step(py, work, label, pytest_args, limits) for label in labels]
        proofs.append(sanitizer_step(py, work, limits))
        if serial:
            for proof in proofs:
                check.run(proof)
        else:
            check.run_group(proofs)
        for label in labels:
            tail = _tail(work / f"pytest-{label}.log", 2)
            for line in tail:
                check.say(f"[{label}] {line}")

        # 4. the rest, as the budget allows
        if _has("sklearn", "onnx", "onnxruntime"):
            check.run(step("demo", [py, "-m", "exchange", "demo", "--device", "cuda", "--report", "json"],
                           stdout="demo.json"))
        else:
            check.note(Outcome("demo", "not run", 0.0, "it needs scikit-learn, onnx and onnxruntime"))
        check.run(step("bench", [py, "-m", "exchange", "bench", "--device", "cuda", "--quick", "--json"],
                       stdout="bench.json"))
        check.run(step("doctor", [py, "-m", "exchange", "doctor"]))

        # 5. the table: a row per test into the archive, the rest on the console
        _, full = table(py, work, labels, native, budget, rows=True)
        (work / "table-full.txt").write_text(full)
        verdict, text = table(py, work, labels, native, budget, rows=False)
        return verdict
    except Stop as exc:
        check.end_all()
        check.say(f"{exc}: every step's processes ended; the archive holds what was done")
        text = f"GPU CHECK FAILED: {exc} after {check.elapsed():.0f} s, before the table"
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        check.say(f"done in {check.elapsed():.0f} s")
        (work / TABLE_FILE).write_text(text.rstrip("\n") + "\n")
        (out / TABLE_FILE).write_text(text.rstrip("\n") + "\n")
        archive(work, out)
        console("")
        console(text.rstrip("\n"))
        console(f"gpu-check: {out / TABLE_FILE} and {out / ARCHIVE_FILE} (the work folder, {work})")


def _preflight_reason(path: Path, outcome: Outcome) -> str:
    """The versions line, then the verdict of a preflight that failed, with its reason."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"GPU CHECK FAILED in preflight: it ended ({outcome.status}) and left no report"
    failed = [f"{name}: {state['checks'][name]['detail']}" for name in state.get("fatal", [])
              if name in state.get("checks", {})]
    return (f"versions: {state.get('versions', '?')}\n\nGPU CHECK FAILED in preflight: "
            + ("; ".join(failed) or f"it ended ({outcome.status})"))


def _tail(path: Path, n: int) -> list[str]:
    try:
        return [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-n:]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=os.environ.get("GPU_CHECK_OUT") or None,
                        help="folder for gpu-check-table.txt and gpu-check.tar.gz (GPU_CHECK_OUT; default: a new "
                             "temporary folder)")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET") or BUDGET_S),
                        help=f"seconds for the whole check (GPU_CHECK_BUDGET, default {BUDGET_S:.0f})")
    parser.add_argument("--serial", action="store_true", default=os.environ.get("GPU_CHECK_SERIAL") == "1",
                        help="the suites and the sanitizer one after the other (GPU_CHECK_SERIAL=1)")
    args = parser.parse_args(argv)
    # what ci/gpu-check.sh sets, for a run without it: the checkout first on the path
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take most of the GPU's memory
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
    return run_check(work, out, args.budget, args.serial, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
