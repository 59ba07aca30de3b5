"""The GPU check's machinery on a machine without a GPU (issue 17): what can be proved
here before the first GPU run, with real pytest runs, real processes, a real compiler.

- ci/gpu-check.sh stops in its preflight within seconds, saying why (no driver here);
- ci/check_gpu_results.py judges a module skipped as a whole by its real reason, a
  peer's skips by the preflight's findings, and a run that never wrote its JUnit file
  by the results written as they came (naming the test that hung);
- tests/gpu/conftest.py's time limits: a test past its limit fails and the run goes
  on; a test stuck beyond signals ends the process, its results so far kept; a test's
  child processes are ended after it;
- ci/build_native.py builds the compiled core with gcc and Python's flags, loads it,
  and says "expected but not loaded" for a build that fails;
- ci/gpu_sanitizer.py finds no compute-sanitizer here and says so; its reading of
  memcheck's summaries and its verdict.
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
    state = json.loads((tmp_path / "preflight.json").read_text())
    assert state["fatal"] == ["driver"] and "python" in state["versions"]
    assert not (tmp_path / "gpu-junit-compiled.xml").exists()  # nothing else ran


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
    steps.write_text("step\tstatus\tseconds\tnote\npreflight\tok\t12\t\nsanitizer\ttimed out\t120\tstopped\n"
                     "bench\tnot run\t0\tno time left in the 330 s budget\n")
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--steps", str(steps), "--native", "yes",
                                   "--bench", str(tmp_path / "bench.json"), "--budget", "330"]) == 0
    shown = capsys.readouterr().out
    assert "did not fit: sanitizer, bench" in shown and "bench: not run: no time left" in shown
    assert check_gpu_results.main([str(tmp_path / "j.xml"), "--native", "failed", "--no-table"]) == 1
    assert "compiled core was expected" in capsys.readouterr().out


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
           "plant": {**plant, "caught": True, "said": "plant: ..."},
           "real": {**clean, "rc": 0, "timed_out": False, "pytest": {"passed": 9, "failed": 0, "skipped": 0}}}
    assert gpu_sanitizer.verdict(ran) == []
    missed = {**ran, "plant": {**ran["plant"], "errors": 0, "caught": False}}
    assert "did NOT catch the planted premature free" in gpu_sanitizer.verdict(missed)[0]
    dirty = {**ran, "real": {**ran["real"], "errors": 3, "first_error": "Invalid __global__ read"}}
    assert "3 errors on the real code" in gpu_sanitizer.verdict(dirty)[0]
    assert gpu_sanitizer.verdict({"status": "unavailable", "plant": None, "real": None}) == []


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
