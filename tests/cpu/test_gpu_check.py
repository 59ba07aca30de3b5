"""The GPU check's machinery on a machine without a GPU (issue 17): what can be proved
here before the first GPU run, with real pytest runs, real processes, a real compiler.

- ci/gpu-check.sh stops in its preflight within seconds, saying why (no driver here),
  and hands back two files: the table (the versions line first) and an archive;
- ci/gpu_check.py's control flow over synthetic steps (sh, and a fake Python that plays
  each step as a scenario says, the table made for real): what does not fit is not
  started, what the budget cuts short fails nothing, a step's own timeout and a missing
  report fail, a step's processes and the groups it noted end with it;
- ci/check_gpu_results.py judges a module skipped as a whole by its real reason, a
  peer's skips by the preflight's findings, and a run that never wrote its JUnit file
  by the results written as they came (naming the test that hung);
- tests/gpu/conftest.py's time limits: a test past its limit fails and the run goes
  on; a test stuck beyond signals ends the process, its results so far kept; a test's
  child processes are ended after it;
- ci/build_native.py builds the compiled core with gcc and Python's flags, loads it,
  and says "expected but not loaded" for a build that fails;
- ci/gpu_sanitizer.py finds no compute-sanitizer here and says so; its reading of
  memcheck's summaries and its verdict; over a fake compute-sanitizer, a missed plant
  explained and planted again, and a SIGTERM ending its processes with the report kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

#: The checkout: the GPU check runs from a tree, not an install (in CI's wheel pass the
#: tests run from a copy of tests/, and ci/cpu.sh names the checkout in EXCHANGE_SOURCE_ROOT).
ROOT = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or Path(__file__).resolve().parents[2])
CI = ROOT / "ci"

sys.path.insert(0, str(CI))
import check_gpu_results  # noqa: E402
import gpu_sanitizer  # noqa: E402

#: CI's scripts, run from the checkout with neither path forced: the same in both passes.
pytestmark = pytest.mark.once_per_ci


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXCHANGE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _cuda_usable() -> bool:
    from exchange.devices.base import get_backend

    import exchange as tx

    try:
        get_backend(tx.DeviceType.kDLCUDA)
    except tx.BackendUnavailableError:
        return False
    return True


# -- the whole check without a GPU ---------------------------------------------------------------
def test_gpu_check_fails_fast_in_preflight_without_a_gpu(tmp_path):
    if _cuda_usable():
        pytest.skip("a CUDA device is usable here; this test is for machines without one")
    started = time.monotonic()
    out = subprocess.run(["bash", str(CI / "gpu-check.sh")], capture_output=True, text=True, timeout=120,
                         env=_env(PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path)))
    took = time.monotonic() - started
    assert out.returncode == 1, out.stdout + out.stderr
    assert "preflight driver: FAILED" in out.stdout and "no usable GPU" in out.stdout
    assert "preflight failed" in out.stdout and "nothing else runs" in out.stdout
    assert took < 60, f"the preflight took {took:.0f} s to say there is no GPU"  # seconds on an idle machine
    # two files come back: the table (the versions line first) and the archive of the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check-table.txt", "gpu-check.tar.gz"]
    shown = (tmp_path / "gpu-check-table.txt").read_text().splitlines()
    assert shown[0].startswith("versions: python") and "GPU CHECK FAILED in preflight: driver" in shown[2]
    files = _archived(tmp_path / "gpu-check.tar.gz")
    state = json.loads(files["preflight.json"])
    assert state["fatal"] == ["driver"] and "python" in state["versions"]
    assert "gpu-junit-compiled.xml" not in files  # nothing else ran
    assert files["steps.tsv"].splitlines()[1].startswith("preflight\tstatus 1")


def _archived(path: Path) -> dict[str, str]:
    """name -> text of each file in a gpu-check archive."""
    import tarfile

    with tarfile.open(path) as tar:
        return {m.name.removeprefix("gpu-check/"): tar.extractfile(m).read().decode(errors="replace")
                for m in tar.getmembers() if m.isfile()}


# -- the runner's control flow, with synthetic steps -------------------------------------------------
def _check(tmp_path: Path, budget: float, reserve: float = 0.0):
    import gpu_check

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return gpu_check.Check(work, budget, reserve=reserve, console=lambda line: None)


def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def _rows(check) -> dict[str, tuple[str, str]]:
    lines = (check.work / "steps.tsv").read_text().splitlines()[1:]
    return {line.split("\t")[0]: (line.split("\t")[1], line.split("\t")[3]) for line in lines}


def test_steps_take_what_is_left_and_what_does_not_fit_is_not_started(tmp_path):
    from gpu_check import Step

    check = _check(tmp_path, budget=6.0)
    assert check.run(Step("quick", _sh("exit 0"), cap=2, floor=1)).status == "ok"
    assert check.run(Step("fails", _sh("exit 3"), cap=2, floor=1)).status == "status 3"
    big = check.run(Step("big", _sh("exit 0"), cap=60, floor=30))
    assert big.status == "did not fit" and "needs 30 s" in big.note  # not started
    own = check.run(Step("own limit", _sh("sleep 30"), cap=1, floor=0.5))
    assert own.status == "timed out" and own.seconds < 5  # its own cap: a failure (the table's)
    short = check.run(Step("shortened", _sh("sleep 30"), cap=60, floor=1))
    assert short.status == "cut short" and "of its 60 s" in short.note  # the budget's doing: fails nothing
    assert check.elapsed() < 9
    rows = _rows(check)
    assert [rows[n][0] for n in ("quick", "fails", "big", "own limit", "shortened")] == [
        "ok", "status 3", "did not fit", "timed out", "cut short"]


def test_a_steps_processes_and_the_groups_it_noted_end_with_it(tmp_path):
    # Issue 31 item 8: compute-sanitizer runs in a process group of its own, which a
    # step's limit does not reach; the step notes it in GPU_CHECK_PGIDS and the runner
    # ends it after the step, as it ends what the step's own group left running.
    from gpu_check import Step

    check = _check(tmp_path, budget=30.0)
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)
        with open(os.environ["GPU_CHECK_PGIDS"], "a") as f:
            f.write(f"{{own.pid}}\\n")
        left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in the step's group
        open({str(pids)!r}, "w").write(f"{{own.pid}} {{left.pid}}")
        os._exit(0)  # the step ends at once, leaving both running
    """)
    assert check.run(Step("leaves", [sys.executable, "-c", script], cap=20)).status == "ok"
    for pid in map(int, pids.read_text().split()):
        assert _gone(pid), f"process {pid} outlived its step"


def _gone(pid: int, wait: float = 5.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours (a child of this test process) is gone too
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_group_of_steps_runs_at_once(tmp_path):
    from gpu_check import Step

    check = _check(tmp_path, budget=30.0)
    t0 = time.monotonic()
    outcomes = check.run_group([Step("a", _sh("sleep 2"), cap=10), Step("b", _sh("sleep 2"), cap=10),
                                Step("c", _sh("exit 0"), cap=60, floor=40)])
    assert [o.status for o in outcomes] == ["ok", "ok", "did not fit"]
    assert time.monotonic() - t0 < 3.5  # (one after the other: 4 s)


# -- the whole check over synthetic steps (a fake Python runs them) -------------------------------------
FAKE_PYTHON = r"""#!{python}
# Stands in for Python in ci/gpu_check.py's steps: each step does what the scenario
# (JSON in FAKE_GPU_SCENARIO) says; ci/check_gpu_results.py runs for real.
import json, os, sys, time

REAL = {python!r}
args = sys.argv[1:]
if args[0] == "ci/check_gpu_results.py":
    os.execv(REAL, [REAL, *args])
key = {{"ci/gpu_preflight.py": "preflight", "ci/build_native.py": "build", "ci/gpu_sanitizer.py": "sanitizer"}}.get(
    args[0]) or (args[1] if args[1] == "pytest" else args[2])  # -m pytest / -m exchange demo|bench|doctor
scenario = json.loads(os.environ["FAKE_GPU_SCENARIO"]).get(key, {{}})


def value(flag):
    return next((a.split("=", 1)[1] for a in args if a.startswith(flag + "=")), None) or args[args.index(flag) + 1]


if key == "preflight":
    ok = {{"ok": True, "detail": "fake"}}
    checks = {{n: ok for n in ("pytest", "driver", "cuda.core", "cupy", "torch", "jax", "demo")}}
    print("versions: python fake; cupy fake", flush=True)
    open(value("--json"), "w").write(json.dumps({{"versions": "python fake; cupy fake", "checks": checks,
                                                  "running": None, "fatal": []}}))
elif key == "pytest":
    path = value("--junitxml")
    cases = "".join(f'<testcase classname="tests.gpu.test_gpu_fake" name="test_{{i}}" time="0.1"/>' for i in range(3))
    open(path, "w").write(f'<testsuites><testsuite name="pytest">{{cases}}</testsuite></testsuites>')
    with open(os.environ["EXCHANGE_GPU_RESULTS"], "a") as f:
        f.write(json.dumps({{"event": "note", "kind": "nvtx", "packages": {{"nvtx": "0.2", "nvidia-nvtx": None}},
                            "ranges": {{"stages": ["stage 0: double"], "releases": 2, "release_example": "release #1",
                                       "calls": {{}}}}, "why": ""}}) + "\n")
elif key == "sanitizer" and "report" in scenario:
    open(os.path.join(value("--out"), "sanitizer.json"), "w").write(json.dumps(scenario["report"]))
elif key in ("demo", "bench") and "report" in scenario:
    print(json.dumps(scenario["report"]))
time.sleep(scenario.get("sleep", 0))
sys.exit(scenario.get("rc", 0))
"""

SANITIZER_PASSED = {"status": "ran", "reason": "", "seconds": 50,
                    "plant": {"caught": True, "errors": 1, "first_error": "Invalid __global__ read", "said": "plant"},
                    "second_plant": None, "problems": [], "unfinished": [],
                    "real": {"errors": 0, "processes": 1, "leaked_allocations": 0, "leaked_bytes": 0, "rc": 0,
                             "timed_out": False, "pytest": {"passed": 9, "failed": 0, "skipped": 0}, "seconds": 40,
                             "limit_s": 90, "slowest": [["test_a", 5.0]]}}
DEMO = {"device": "cuda", "accuracy": 0.95, "hops": [{"from": "a", "to": "b", "shared": True}], "live_records_end": 0}
BENCH = {"export_hop_ratio": 1.1, "import_hop_ratio": 1.2, "chain_hop_ratio": 1.0, "size_flatness": 1.0,
         "details": {"device": "cuda", "export_hop": {"tx_ns": 900, "peer": "cupy"},
                     "import_hop": {"tx_ns": 1100, "peer": "cupy"}, "chain": {"method": "fake"}}}
LIMITS = {"preflight": (5, 0), "build": (5, 1), "suite": (5, 1), "sanitizer": (3, 1), "demo": (5, 1),
          "bench": (100, 1), "doctor": (3, 1)}  # bench: any limit it gets is cut short


def _whole_check(tmp_path: Path, scenario: dict, budget: float, monkeypatch) -> tuple[int, str, dict[str, str]]:
    import gpu_check

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_GPU_SCENARIO", json.dumps(scenario))
    monkeypatch.setattr(gpu_check, "_has", lambda *modules: True)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    shown: list[str] = []
    code = gpu_check.run_check(work, out, budget, False, [], py=str(fake), console=shown.append, limits=LIMITS,
                               reserve=1.0)
    assert len(list(out.iterdir())) <= 8  # what a device tool returns
    table = (out / "gpu-check-table.txt").read_text()
    assert table.startswith("versions: python fake") and table.strip() in "\n".join(shown)
    return code, table, _archived(out / "gpu-check.tar.gz")


def test_whole_check_passes_with_a_bench_the_budget_cut_short(tmp_path, monkeypatch):
    # Issue 31 item 1: a bench stopped at a limit the budget shortened, and doctor that
    # did not fit, fail nothing; the table says so, and every log comes back.
    code, table, files = _whole_check(tmp_path, {"sanitizer": {"report": SANITIZER_PASSED}, "demo": {"report": DEMO},
                                                 "bench": {"sleep": 30}}, budget=8, monkeypatch=monkeypatch)
    assert code == 0, table
    assert "GPU CHECK PASSED" in table and "bench: cut short" in table
    assert "did not fit (fails nothing): bench, doctor" in table
    assert "planted unordered free CAUGHT" in table and "in 40 s of the 90 s allowed" in table
    assert "NVTX (nvtx 0.2), EXCHANGE_NVTX=1: stage ranges stage 0: double" in table
    assert {"steps.tsv", "gpu-check.log", "preflight.json", "gpu-junit-compiled.xml", "gpu-junit-pure-python.xml",
            "results-compiled.jsonl", "sanitizer.json", "demo.json", "table-full.txt",
            "gpu-check-table.txt"} <= files.keys()
    assert "test_gpu_fake::test_0" in files["table-full.txt"] and "test_gpu_fake::test_0" not in table


def test_whole_check_fails_when_the_sanitizer_left_no_report(tmp_path, monkeypatch):
    # Issue 31 item 1: a sanitizer stopped at its own limit leaves no sanitizer.json;
    # that is never read as a pass.
    code, table, files = _whole_check(tmp_path, {"sanitizer": {"sleep": 30}, "demo": {"report": DEMO}},
                                      budget=60, monkeypatch=monkeypatch)
    assert code == 1
    assert "compute-sanitizer: NO REPORT" in table and "sanitizer: no report (timed out" in table
    assert files["steps.tsv"].count("\tok\t") >= 4


def test_whole_check_passes_when_the_sanitizer_did_not_fit(tmp_path, monkeypatch):
    monkeypatch.setitem(LIMITS, "sanitizer", (100, 50))
    fake = {"sanitizer": {"report": SANITIZER_PASSED}, "demo": {"report": DEMO}, "bench": {"report": BENCH}}
    code, table, _ = _whole_check(tmp_path, fake, budget=10, monkeypatch=monkeypatch)
    assert code == 0, table
    assert "compute-sanitizer: did not fit: it needs 50 s" in table and "bench (cuda): export hop 0.90 us" in table


# -- judging results -------------------------------------------------------------------------
def _pytest(folder: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", str(folder), "-q", "-p", "no:cacheprovider",
                           "-o", "junit_family=xunit2", *args], capture_output=True, text=True, cwd=folder,
                          env=env or _env(), timeout=timeout)


def test_module_level_skip_is_judged_by_its_real_reason(tmp_path):
    (tmp_path / "test_demo_like.py").write_text(textwrap.dedent("""
        import pytest
        pytest.importorskip("no_such_module_here", reason="the demo needs sklearn (pip install -e '.[demo]')")
        def test_never(): pass
    """))
    (tmp_path / "test_fine.py").write_text("def test_ok():\n    pass\n")
    _pytest(tmp_path, f"--junitxml={tmp_path / 'known.xml'}")
    cases = check_gpu_results.read_cases(tmp_path / "known.xml")
    skipped = [c for c in cases if c["outcome"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["message"].startswith("the demo needs sklearn")
    assert skipped[0]["file"] == "test_demo_like.py"
    assert check_gpu_results.main([str(tmp_path / "known.xml"), "--no-table"]) == 0
    # another module-level reason is not known: the check fails, naming it
    (tmp_path / "test_demo_like.py").write_text(textwrap.dedent("""
        import pytest
        pytest.skip("something this machine should have", allow_module_level=True)
    """))
    _pytest(tmp_path, f"--junitxml={tmp_path / 'unknown.xml'}")
    assert check_gpu_results.main([str(tmp_path / "unknown.xml"), "--no-table"]) == 1


def test_peer_skips_are_known_only_where_the_preflight_found_the_peer_unusable(tmp_path, capsys):
    (tmp_path / "test_peer.py").write_text(textwrap.dedent("""
        import pytest
        def test_torch_thing():
            pytest.skip("peer unusable: torch: PyTorch 2.11 has no usable CUDA device (CPU build?)")
        def test_plain(): pass
    """))
    _pytest(tmp_path, f"--junitxml={tmp_path / 'j.xml'}")
    pre = tmp_path / "preflight.json"
    checks = {"pytest": {"ok": True, "detail": ""}, "driver": {"ok": True, "detail": ""},
              "cuda.core": {"ok": True, "detail": ""}, "cupy": {"ok": True, "detail": "ran"}}
    pre.write_text(json.dumps({"versions": "python x", "fatal": [], "running": None,
                               "checks": {**checks, "torch": {"ok": False, "detail": "CPU build"}}}))
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--preflight", str(pre)]) == 0
    shown = capsys.readouterr().out
    assert "torch UNUSABLE, its tests skip" in shown and "versions: python x" in shown
    pre.write_text(json.dumps({"versions": "python x", "fatal": [], "running": None,
                               "checks": {**checks, "torch": {"ok": True, "detail": "ok"}}}))
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--preflight", str(pre)]) == 1


def _gpu_like_folder(tmp_path: Path, tests: str) -> Path:
    """A test folder ruled by tests/gpu/conftest.py as it is, told that a device is usable
    (its probe's result set), holding ``tests``."""
    folder = tmp_path / "gpu_like"
    folder.mkdir()
    conftest = (ROOT / "tests" / "gpu" / "conftest.py").read_text()
    (folder / "conftest.py").write_text(conftest + "\n_probe_result[:] = [None, 1]  # these tests need no device\n")
    (folder / "test_limits.py").write_text(textwrap.dedent(tests))
    return folder


def test_a_test_past_its_limit_fails_and_the_run_goes_on(tmp_path):
    folder = _gpu_like_folder(tmp_path, f"""
        import multiprocessing, os, time

        def _sleep():
            time.sleep(120)

        def test_leaves_a_child():
            child = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
            child.start()
            open({str(tmp_path / 'child.pid')!r}, "w").write(str(child.pid))

        def test_hangs():
            time.sleep(120)

        def test_after():
            assert not os.path.exists("/proc/" + open({str(tmp_path / 'child.pid')!r}).read())
    """)
    results = tmp_path / "results.jsonl"
    started = time.monotonic()
    out = _pytest(folder, f"--junitxml={tmp_path / 'j.xml'}",
                  env=_env(EXCHANGE_GPU_TEST_TIMEOUT="3", EXCHANGE_GPU_RESULTS=str(results)))
    assert time.monotonic() - started < 60, "the hung test was not stopped at its limit"
    assert "1 failed, 2 passed" in out.stdout, out.stdout
    assert "GPUTestTimeout" in out.stdout and "ran past its limit of 3 s" in out.stdout
    assert "ending child process" in out.stdout  # the child left by the first test, ended after it
    cases = {c["name"].split("::")[-1]: c["outcome"] for c in check_gpu_results.read_cases(tmp_path / "j.xml")}
    assert cases == {"test_leaves_a_child": "passed", "test_hangs": "failed", "test_after": "passed"}
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["outcome"] for line in lines if line["event"] == "call"] == ["passed", "failed", "passed"]


def test_a_test_stuck_beyond_signals_ends_the_run_and_its_results_name_it(tmp_path):
    folder = _gpu_like_folder(tmp_path, """
        import signal, time

        def test_first():
            pass

        def test_stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as a driver call that never returns
            time.sleep(120)

        def test_never_reached():
            pass
    """)
    results = tmp_path / "results.jsonl"
    out = _pytest(folder, f"--junitxml={tmp_path / 'j.xml'}",
                  env=_env(EXCHANGE_GPU_TEST_TIMEOUT="2", EXCHANGE_GPU_TEST_HARD_GRACE="2",
                           EXCHANGE_GPU_RESULTS=str(results)))
    assert out.returncode != 0 and not (tmp_path / "j.xml").exists()
    stacks = Path(str(results) + ".stacks").read_text()
    assert "Timeout" in stacks and "test_stuck" in stacks  # faulthandler's stacks show where it was
    cases, running = check_gpu_results.read_results(results)
    assert running.endswith("::test_stuck")
    assert {c["name"].split("::")[-1]: c["outcome"] for c in cases} == {"test_first": "passed", "test_stuck": "failed"}
    code = check_gpu_results.main([str(tmp_path / "j.xml"), "--labels", "compiled", "--results", str(results),
                                   "--no-table"])
    assert code == 1


def test_the_table_names_steps_that_did_not_fit_and_a_core_that_did_not_load(tmp_path, capsys):
    (tmp_path / "test_fine.py").write_text("def test_ok():\n    pass\n")
    _pytest(tmp_path, f"--junitxml={tmp_path / 'j.xml'}")
    steps = tmp_path / "steps.tsv"
    steps.write_text("step\tstatus\tseconds\tnote\npreflight\tok\t12\t\nsanitizer\tdid not fit\t0\tit needs 60 s\n"
                     "demo\tcut short\t20\tstopped at 20 s\nbench\tdid not fit\t0\tit needs 35 s\n")
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--steps", str(steps), "--native", "yes",
                                   "--sanitizer", str(tmp_path / "sanitizer.json"),
                                   "--demo", str(tmp_path / "demo.json"),
                                   "--bench", str(tmp_path / "bench.json"), "--budget", "240"]) == 0
    shown = capsys.readouterr().out
    assert "did not fit (fails nothing): sanitizer, demo, bench" in shown
    assert "bench: did not fit: it needs 35 s" in shown and "demo: cut short" in shown
    assert "compute-sanitizer: did not fit: it needs 60 s" in shown
    # the same missing reports after steps that ran past their own limits: failures
    steps.write_text("step\tstatus\tseconds\tnote\nsanitizer\ttimed out\t140\tstopped after its limit of 140 s\n"
                     "bench\ttimed out\t60\tstopped after its limit of 60 s\n")
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--steps", str(steps), "--no-table",
                                   "--sanitizer", str(tmp_path / "sanitizer.json"),
                                   "--bench", str(tmp_path / "bench.json")]) == 1
    shown = capsys.readouterr().out
    assert "sanitizer: no report (timed out" in shown and "bench: timed out, no report" in shown
    assert "ran past their own limit: sanitizer, bench" in shown
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--native", "failed", "--no-table"]) == 1
    assert "compiled core was expected" in capsys.readouterr().out
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--native", "skipped", "--no-table"]) == 0
    assert "the build did not fit" in capsys.readouterr().out


def test_a_sanitizer_report_cut_short_fails_nothing_but_its_findings(tmp_path):
    report = {"status": "ran", "seconds": 99, "plant": {"caught": True, "errors": 1, "said": "plant"},
              "second_plant": None, "real": None, "stopped": "stopped by signal 15",
              "problems": [], "unfinished": ["stopped by signal 15 (the check's limit for this step)"]}
    path = tmp_path / "sanitizer.json"
    path.write_text(json.dumps(report))
    cut = [{"step": "sanitizer", "status": "cut short", "seconds": "99", "note": "stopped at 99 s"}]
    lines, problems = check_gpu_results.sanitizer_summary(path, cut)
    assert problems == [] and "cut short by the budget" in lines[-1]
    own = [{"step": "sanitizer", "status": "timed out", "seconds": "140", "note": ""}]
    assert check_gpu_results.sanitizer_summary(path, own)[1] == ["sanitizer: stopped by signal 15 (the check's "
                                                                  "limit for this step)"]
    path.write_text(json.dumps({**report, "problems": ["memcheck: 2 errors on the real code (Invalid read)"]}))
    assert check_gpu_results.sanitizer_summary(path, cut)[1] == [
        "sanitizer: memcheck: 2 errors on the real code (Invalid read)"]


def test_nvtx_notes_are_read_for_the_table_and_are_no_outcome(tmp_path):
    results = tmp_path / "results.jsonl"
    note = {"event": "note", "kind": "nvtx", "packages": {"nvtx": None, "nvidia-nvtx": "13.0.85 (nvidia-nvtx)"},
            "ranges": None, "why": "the nvtx Python package is not installed (nvidia-nvtx 13.0.85 is: ...)"}
    results.write_text(json.dumps({"nodeid": "tests/gpu/test_gpu_release.py::test_x", "event": "start"}) + "\n"
                       + json.dumps(note) + "\n"
                       + json.dumps({"nodeid": "tests/gpu/test_gpu_release.py::test_x", "event": "call",
                                     "outcome": "passed", "seconds": 0.1}) + "\n")
    cases, running = check_gpu_results.read_results(results)
    assert running is None and [c["outcome"] for c in cases] == ["passed"]
    line = check_gpu_results.nvtx_summary([results])[0]
    assert line.startswith("NVTX (nvidia-nvtx 13.0.85 (nvidia-nvtx)): no ranges checked: the nvtx Python package")
    assert check_gpu_results.known_skip(note["why"])  # its skip is a known one
    assert check_gpu_results.nvtx_summary([tmp_path / "none.jsonl"]) == [
        "NVTX: not checked (test_gpu_nvtx.py left no note)"]


def test_bench_and_demo_reports_must_be_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text("bench: hops ...\n{}")  # what merging stderr into the file gave
    lines, problems = check_gpu_results.bench_summary(bench)
    assert lines[0].startswith("bench: its output is not JSON") and problems
    demo = tmp_path / "demo.json"
    demo.write_text("demo: starting\n")
    lines, problems = check_gpu_results.demo_summary(demo)
    assert problems and "not JSON" in lines[0]
    # an empty report of a step that failed is a problem; of a step not run by design, not
    demo.write_text("")
    failed = [{"step": "demo", "status": "status 2", "seconds": "1", "note": ""}]
    lines, problems = check_gpu_results.demo_summary(demo, failed)
    assert problems == ["demo: status 2, no report"] and "gpu-check.log" in lines[0]
    skipped = [{"step": "demo", "status": "not run", "seconds": "0", "note": "it needs scikit-learn"}]
    assert check_gpu_results.demo_summary(demo, skipped) == (["demo: not run: it needs scikit-learn"], [])


# -- building the compiled core ------------------------------------------------------------------
def _copy_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for part in ("exchange", "devices"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    return tree


@pytest.mark.slow
def test_build_native_with_gcc_and_pythons_flags_loads(tmp_path):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    tree = _copy_tree(tmp_path)
    out = subprocess.run([sys.executable, str(CI / "build_native.py"), "--gcc", "--root", str(tree)],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "built (" in out.stdout and "and loaded" in out.stdout
    assert list((tree / "exchange").glob("_native*.so"))


def test_build_native_says_expected_but_not_loaded_when_the_build_fails(tmp_path):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    tree = _copy_tree(tmp_path)
    (tree / "exchange" / "native" / "module.c").write_text("this is not C\n")
    out = subprocess.run([sys.executable, str(CI / "build_native.py"), "--gcc", "--root", str(tree)],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "EXPECTED BUT NOT LOADED" in out.stdout.splitlines()[-1]


def test_build_native_without_a_compiler_is_not_expected(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = subprocess.run([sys.executable, str(CI / "build_native.py"), "--root", str(_copy_tree(tmp_path))],
                         capture_output=True, text=True, timeout=120, env=_env(PATH=str(empty), CC=""))
    assert out.returncode == 3, out.stdout + out.stderr
    assert "not expected: no C compiler" in out.stdout


# -- the sanitizer step --------------------------------------------------------------------------
MEMCHECK_PLANT = """\
========= COMPUTE-SANITIZER
plant: unordered free on; the reader saw freed memory (the poison pattern)
========= Invalid __global__ read of size 4 bytes
=========     at spin_then_copy+0x90
========= ERROR SUMMARY: 1 error
"""
MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
========= LEAK SUMMARY: 0 bytes leaked in 0 allocations
========= ERROR SUMMARY: 0 errors
========= ERROR SUMMARY: 0 errors
"""


def test_sanitizer_summaries_and_verdict():
    plant = gpu_sanitizer.parse(MEMCHECK_PLANT)
    assert plant["errors"] == 1 and plant["processes"] == 1 and "Invalid __global__ read" in plant["first_error"]
    clean = gpu_sanitizer.parse(MEMCHECK_CLEAN)
    assert clean == {**clean, "errors": 0, "processes": 2, "leaked_allocations": 0}
    ran = {"status": "ran", "reason": "",
           "plant": {**plant, "caught": True, "said": "plant unordered: ..."}, "second_plant": None,
           "real": {**clean, "rc": 0, "timed_out": False, "pytest": {"passed": 9, "failed": 0, "skipped": 0},
                    "limit_s": 90}}
    assert gpu_sanitizer.verdict(ran) == ([], [])
    why = gpu_sanitizer.NOT_CAUGHT_WHY["its data"]
    missed = {**ran, "plant": {**ran["plant"], "errors": 0, "caught": False, "why": why}}
    problems, _ = gpu_sanitizer.verdict(missed)
    assert "did NOT catch the planted unordered free (the reader saw its data" in problems[0]
    second = {"caught": True, "errors": 1, "said": "plant after-free: ..."}
    assert gpu_sanitizer.verdict({**missed, "second_plant": second}) == ([], [])  # it bites, on the second plant
    problems, _ = gpu_sanitizer.verdict({**missed, "second_plant": {**second, "caught": False, "why": "x"}})
    assert "the check does not bite" in problems[0]
    dirty = {**ran, "real": {**ran["real"], "errors": 3, "first_error": "Invalid __global__ read"}}
    assert "3 errors on the real code" in gpu_sanitizer.verdict(dirty)[0][0]
    late = {**ran, "real": {**ran["real"], "timed_out": True, "pytest": {}}}
    assert gpu_sanitizer.verdict(late) == ([], ["the tests under the sanitizer ran past their limit of 90 s",
                                               "pytest under the sanitizer wrote no JUnit file (it did not finish)"])
    assert gpu_sanitizer.verdict({"status": "unavailable", "plant": None, "real": None}) == ([], [])
    slow = {**missed, "plant": {**missed["plant"], "timed_out": True}}  # never read as "unavailable"
    assert gpu_sanitizer.verdict(slow)[1][0].startswith("the plant ran past its limit")


def test_sanitizer_set_leaves_the_share_test_out():
    # Issue 31 item 4: memcheck may not know memory imported through
    # cuMemPoolImportPointer; the share round trip stays out of the first run's set.
    assert not [t for t in gpu_sanitizer.SANITIZER_TESTS if "share" in t]
    assert "torch" in gpu_sanitizer.SANITIZER_KEYWORDS and "jax" in gpu_sanitizer.SANITIZER_KEYWORDS


FAKE_SANITIZER = r"""#!{python}
# compute-sanitizer as the scenario (JSON in FAKE_SANITIZER) says, without a GPU.
import json, os, subprocess, sys, time

cfg = json.loads(os.environ["FAKE_SANITIZER"])
args = sys.argv[1:]
if "tests/gpu/sanitizer_plant.py" in args:
    mode = args[args.index("--mode") + 1] if "--mode" in args else "unordered"
    plant = cfg[mode]
    print(f"plant {{mode}}: unordered free on; the reader saw {{plant['saw']}}")
    if plant["errors"]:
        print("========= Invalid __global__ read of size 4 bytes")
    print(f"========= ERROR SUMMARY: {{plant['errors']}} errors")
    sys.exit(0)
if cfg.get("hang"):  # the tests hang, with a child of their own
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(cfg["pids"], "w").write(f"{{os.getpid()}} {{child.pid}}")
    time.sleep(120)
junit = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
open(junit, "w").write('<testsuites><testsuite name="pytest"><testcase classname="tests.gpu.test_gpu_release" '
                       'name="test_a" time="2.5"/><testcase classname="tests.gpu.test_gpu_chain" name="test_b" '
                       'time="1.0"/></testsuite></testsuites>')
print("========= LEAK SUMMARY: 0 bytes leaked in 0 allocations")
print("========= ERROR SUMMARY: 0 errors")
"""


def _fake_sanitizer(tmp_path: Path, scenario: dict) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable))
    fake.chmod(0o755)
    return _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SANITIZER=json.dumps(scenario))


def test_sanitizer_step_says_why_the_plant_was_missed_and_plants_again(tmp_path):
    # Issue 31 item 5: a plant not caught is explained from what its reader saw, and
    # the second plant (a read ordered after the free) runs; caught, the check bites.
    env = _fake_sanitizer(tmp_path, {"unordered": {"saw": "its data", "errors": 0},
                                     "after-free": {"saw": "freed memory (the poison pattern)", "errors": 1}})
    out = subprocess.run([sys.executable, str(CI / "gpu_sanitizer.py"), "--out", str(tmp_path), "--budget", "130"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "sanitizer.json").read_text())
    assert report["plant"]["caught"] is False and report["plant"]["why"].startswith("the reader saw its data")
    assert report["second_plant"]["caught"] and report["second_plant"]["mode"] == "after-free"
    assert report["real"]["pytest"] == {"passed": 2, "failed": 0, "skipped": 0}
    assert report["real"]["slowest"][0] == ["test_a", 2.5] and report["real"]["limit_s"] == 90
    lines, problems = check_gpu_results.sanitizer_summary(tmp_path / "sanitizer.json")
    assert problems == [] and "NOT CAUGHT" in lines[0] and "why: the reader saw its data" in lines[1]
    assert "second plant, a read ordered after the free: CAUGHT" in lines[2]


def test_sanitizer_stopped_by_the_check_ends_its_processes_and_still_reports(tmp_path):
    # Issue 31 item 8: compute-sanitizer and its pytest run in a process group of their
    # own, which the step's limit does not reach: SIGTERM to the step ends them, and the
    # report says it was stopped (without one the table would fail it: no report).
    pids = tmp_path / "pids"
    env = _fake_sanitizer(tmp_path, {"unordered": {"saw": "freed memory (the poison pattern)", "errors": 1},
                                     "hang": True, "pids": str(pids)})
    import gpu_check

    work = tmp_path / "work"
    work.mkdir()
    check = gpu_check.Check(work, 60, reserve=0, console=lambda line: None)
    small = "import sys; sys.path.insert(0, 'ci'); import gpu_sanitizer as g; g.TESTS_FLOOR_S = 1; sys.exit(g.main())"
    step = gpu_check.Step("sanitizer", [sys.executable, "-c", small, "--out", str(tmp_path), "--budget", "100"],
                          cap=6, env={k: v for k, v in env.items() if k in ("PATH", "FAKE_SANITIZER", "PYTHONPATH")})
    outcome = check.run(step)
    assert outcome.status == "timed out"
    assert pids.exists(), "the fake tests never started"
    for pid in map(int, pids.read_text().split()):
        assert _gone(pid), f"process {pid} of the sanitizer outlived its step"
    report = json.loads((tmp_path / "sanitizer.json").read_text())
    assert report["stopped"].startswith("stopped by signal 15") and report["plant"]["caught"]
    assert report["unfinished"][0].startswith("stopped by signal 15")


def test_sanitizer_step_without_compute_sanitizer_says_so(tmp_path):
    if gpu_sanitizer.find() is not None:
        pytest.skip("compute-sanitizer is installed here")
    out = subprocess.run([sys.executable, str(CI / "gpu_sanitizer.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0 and "not run: compute-sanitizer is not installed here" in out.stdout
    report = json.loads((tmp_path / "sanitizer.json").read_text())
    assert report["status"] == "absent"
    lines, problems = check_gpu_results.sanitizer_summary(tmp_path / "sanitizer.json")
    assert lines[0].startswith("compute-sanitizer: not run") and problems == []
