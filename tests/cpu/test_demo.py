"""``tensor-exchange demo`` and the command line dispatcher (exchange/cli/__init__.py).

The demo's check (issue 2, item 8; issue 5, item 6): ``--report json`` prints exactly one
JSON object with accuracy >= 0.9 on the held-out split, every hop shared, no record
left alive; with ``--batches 8`` the chain's stages and their times, and peak live bytes
below the sum of all stages' outputs. ``--device cuda`` without a usable GPU fails with
the reason. No timing assertions here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _name in ("sklearn", "onnx", "onnxruntime", "torch", "jax"):
    pytest.importorskip(_name, reason=f"the demo needs {_name} (pip install -e '.[demo]')")

from exchange import cli
from exchange.cli import demo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: The checkout (its Makefile): CI's wheel pass runs a copy of tests/ and names it (ci/cpu.sh).
SOURCE = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or ROOT)

KEYS = {"accuracy", "hops", "live_records_end", "device", "device_note", "batches", "stages", "peak_live_bytes",
        "stage_output_bytes_total", "chain_ms", "seconds"}
#: The phases of a run, in order, as the text report's time line and the JSON's "seconds" give them.
PHASES = ["load", "train", "build", "run", "score", "release"]
#: The chain's hops on the CPU: into each stage, out of the last one (two outputs), and
#: the two outputs taken into NumPy for scoring.
CPU_HOPS = [("input", "numpy"), ("numpy", "onnxruntime"), ("onnxruntime", "torch"), ("torch", "jax"),
            ("jax", "tx"), ("jax", "tx"), ("tx", "numpy"), ("tx", "numpy")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_report(report: dict, batches: int = 8) -> None:
    assert set(report) == KEYS
    assert isinstance(report["accuracy"], float)
    assert 0.9 <= report["accuracy"] <= 1.0
    assert _is_int(report["live_records_end"])
    assert report["live_records_end"] == 0
    assert report["device"] == "cpu"
    assert report["batches"] == batches
    hops = report["hops"]
    assert isinstance(hops, list) and len(hops) >= 3
    for h in hops:
        assert set(h) == {"from", "to", "tensor", "bytes", "shared"}
        assert isinstance(h["from"], str) and isinstance(h["to"], str) and h["from"] != h["to"]
        assert _is_int(h["bytes"]) and h["bytes"] > 0
        assert h["shared"] is True, f"hop {h['from']} -> {h['to']} copied"
    frameworks = {h["from"] for h in hops} | {h["to"] for h in hops}
    assert len(frameworks) >= 3
    assert [(h["from"], h["to"]) for h in hops] == CPU_HOPS
    # every hop names what it carries: the argmax stage's two outputs are told apart
    assert [h["tensor"] for h in hops] == list(demo.HOP_TENSORS)
    assert report["device_note"] is None  # the CPU was asked for

    stages = report["stages"]
    assert [(s["name"], s["framework"]) for s in stages] == [
        ("scale", "numpy"), ("mlp", "onnxruntime"), ("softmax", "torch"), ("argmax", "jax")]
    for s in stages:
        assert set(s) == {"name", "framework", "ms"}
        assert isinstance(s["name"], str) and isinstance(s["framework"], str)
        assert isinstance(s["ms"], float) and s["ms"] >= 0.0

    # The stages' outputs, over all batches: the hops out of the stages add up to them...
    total = report["stage_output_bytes_total"]
    assert _is_int(total)
    assert total == sum(h["bytes"] for h in hops if h["from"] not in ("input", "tx"))
    # ... and to what the shapes say: 450 images; scale float32 (n, 64), logits and
    # probabilities float32 (n, 10), predictions int32 (n,), confidence float32 (n,).
    assert total == 450 * 4 * (64 + 10 + 10 + 1 + 1)
    assert hops[0]["bytes"] == 450 * 64  # the uint8 pixels
    peak = report["peak_live_bytes"]
    assert _is_int(peak) and peak > 0
    if batches > 1:
        assert peak < total, "the registry held every stage's output at once"

    # the times the text report shows: the chain's, and each phase's
    assert isinstance(report["chain_ms"], float) and report["chain_ms"] > 0.0
    assert list(report["seconds"]) == PHASES
    assert all(isinstance(v, float) and v >= 0.0 for v in report["seconds"].values())
    assert report["seconds"]["run"] * 1e3 >= report["chain_ms"] - 1.0  # the chain runs inside the run phase (rounded to ms)


#: The in-process demo's phases as its progress lines name them, in order.
PHASE_LINES = ["load the digits", "train the MLP (scikit-learn)", "build the ONNX model, its session and the chain",
               "run the chain over {batches} batches", "score", "release"]


def _check_phase_lines(stderr: str, names: list[str]) -> None:
    """Where stderr is not a terminal, each phase is said twice, in order: ``demo: NAME ...``
    when it starts, ``demo: NAME (S s)`` when it ends (demo and --ray alike)."""
    said = [ln for ln in stderr.splitlines() if ln.startswith("demo: ")]
    expected = []
    for name in names:
        expected += [f"demo: {name} ...", f"demo: {name} (S s)"]
    got = [ln if ln.endswith(" ...") else ln.rsplit(" (", 1)[0] + " (S s)" for ln in said]
    assert got == expected, stderr[-3000:]
    for ln in said:
        if not ln.endswith(" ..."):
            seconds = ln.rsplit(" (", 1)[1]
            assert seconds.endswith(" s)") and float(seconds[:-3]) >= 0.0, ln


def _venvs_with_this_demo(tmp_path: Path) -> Path:
    """A VENVS folder for make whose demo environment counts as set up (its stamp newer
    than what it depends on) and whose tensor-exchange is this run's console script."""
    script = Path(sys.executable).parent / "tensor-exchange"
    if not script.exists() or shutil.which("make") is None or not (SOURCE / "Makefile").is_file():
        pytest.skip("needs make, the checkout's Makefile and the tensor-exchange script of this environment")
    (tmp_path / "demo" / "bin").mkdir(parents=True)
    (tmp_path / "demo" / "bin" / "tensor-exchange").symlink_to(script)
    (tmp_path / "demo" / ".installed").touch()
    return tmp_path


@pytest.mark.slow
def test_make_demo_json_report_through_a_pipe(tmp_path):
    """The acceptance check, as the README has a user run it: ``make demo ARGS="--report
    json" | python3 -m json.tool``. make echoes no command line onto stdout (nor
    "Entering directory", though this test may itself run under make), so the pipe gets
    the one JSON object and nothing else."""
    venvs = _venvs_with_this_demo(tmp_path)
    line = (f'set -o pipefail; make demo VENVS={venvs} ARGS="--report json --batches 8 --device cpu" '
            f"| {sys.executable} -m json.tool --compact")
    proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=_env(), cwd=SOURCE,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.stdout.strip().count("\n") == 0
    _check_report(json.loads(proc.stdout), batches=8)
    # stdout has the JSON alone, and stderr still shows the run's progress
    _check_phase_lines(proc.stderr, [p.format(batches=8) for p in PHASE_LINES])


def test_make_installs_show_their_progress_on_stderr(tmp_path):
    """Setting up an environment (what ``make -n`` would run where it is missing): every
    step writes to stderr, pip is not quieted, and only the demo itself writes to stdout."""
    if shutil.which("make") is None or not (SOURCE / "Makefile").is_file():
        pytest.skip("needs make and the checkout's Makefile")
    for target, extras in (("demo", "demo,ray"), ("test", "test,interop,demo,ray,metrics,plot,top")):
        proc = subprocess.run(["make", "-n", target, f"VENVS={tmp_path}"], capture_output=True, text=True,
                              cwd=SOURCE, timeout=60)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        setup = [ln for ln in lines if not ln.startswith("touch ")][:-1]  # the last line runs the target
        assert any(f'-e ".[{extras}]"' in ln for ln in setup), lines
        for ln in setup:
            assert ln.rstrip().endswith(">&2"), f"make {target}: {ln!r} writes to stdout"
            assert " -q" not in ln, f"make {target}: {ln!r} hides pip's progress"
    proc = subprocess.run(["make", "-n", "demo", f"VENVS={_venvs_with_this_demo(tmp_path / 'ready')}"],
                          capture_output=True, text=True, cwd=SOURCE, timeout=60)
    assert proc.stdout.strip().splitlines() == [f"{tmp_path / 'ready'}/demo/bin/tensor-exchange demo"]


def test_cuda_without_a_gpu_fails_with_the_reason():
    reason = demo.cuda_unusable_reason()
    if reason is None:
        pytest.skip("CUDA is usable here")
    with pytest.raises(demo.DeviceUnavailable, match="--device cuda"):
        demo.choose_device("cuda")
    assert demo.choose_device("auto") == ("cpu", reason)
    assert demo.choose_device("cpu") == ("cpu", None)
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--device", "cuda", "--report", "json"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "cuda" in proc.stderr.lower() and reason.splitlines()[0] in proc.stderr


@pytest.fixture(scope="module")
def result() -> demo.DemoResult:
    return demo.run_demo(batches=8, device="cpu")


def test_run_demo_in_process(result):
    _check_report(demo.report_json(result), batches=8)
    assert result.ok
    assert result.unshared == []
    assert result.n_test == 450 and result.n_train == 1347
    assert result.records_end == []
    assert result.peak_below_outputs
    assert 0.0 < result.confidence <= 1.0
    json.dumps(demo.report_json(result))  # serialisable as is


def test_piped_text_report_keeps_each_sentence_on_one_line():
    """The text report through a pipe (``tensor-exchange demo | less``, or into a file),
    one batch for the whole split: rich lays it out with no terminal, and no sentence is
    broken across lines (it was, at 80 columns); the phases are said on stderr when they
    start and when they end. Exit status 0: the check held for one batch too."""
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--device", "cpu", "--batches", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    assert "\x1b[" not in proc.stdout  # no colour codes into a pipe
    assert lines[0].startswith("digits: trained on 1347, tested on 450 held-out images in 1 batches, device cpu")
    assert lines[1].startswith("accuracy ") and "mean confidence" in lines[1]
    # every line is a table's, or a whole sentence
    tables = ("tx.Chain stages", "hops", "┏", "┃", "┡", "│", "└")
    sentences = [ln for ln in lines[2:] if not ln.startswith(tables)]
    assert [ln.split(" ", 1)[0] for ln in sentences] == ["peak", "registry:", "time:", "OK"], sentences
    assert sentences[0].endswith("bytes the stages output (below their sum)") or \
        sentences[0].endswith("bytes the stages output (NOT below their sum)"), sentences[0]
    assert sentences[2].startswith("time: chain ") and " release " in sentences[2] and sentences[2].endswith(" s")
    memory = [ln.rstrip(" │").rsplit("│", 1)[1].strip() for ln in lines if ln.startswith("│")][4:]  # after the stages
    assert memory == ["shared"] * len(CPU_HOPS), lines
    _check_phase_lines(proc.stderr, [p.format(batches=1) for p in PHASE_LINES])


_GONE_READER = """
import sys
import exchange.cli.demo as demo
from exchange import cli
sys.path.insert(0, sys.argv[2])
from test_demo import _fake_result
demo.run_demo = lambda **kwargs: _fake_result(shared=True)  # a passing check, at once
sys.stdin.read()  # until the parent has closed its end of our stdout
status = cli.main(["demo", "--device", "cpu", "--report", sys.argv[1]])
print("stderr still works", file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.parametrize("report", ["text", "json"])
def test_a_reader_that_leaves_early_does_not_change_the_verdict(report):
    """``tensor-exchange demo | head -1``: the reader leaves before the report is written.
    The exit status is still the check's (0: it held), with no traceback, and stderr is
    still there for what comes after. (Text mode exited 1, rich's way of leaving; JSON
    mode closed stderr.)"""
    if demo.missing_packages():
        pytest.skip("the demo's packages are not all installed")
    _run_with_the_reader_gone(["-c", _GONE_READER, report, str(Path(__file__).parent)])


def test_batches_are_aligned_and_cover_the_split():
    a = demo.aligned(np.arange(450 * 64, dtype=np.uint8).reshape(450, 64))
    y = demo.aligned(np.arange(450, dtype=np.int32))
    for arr in (a, y):
        parts = demo.split_batches(arr, 8)
        assert len(parts) == 8 and sum(p.shape[0] for p in parts) == 450
        assert all(p.ctypes.data % 64 == 0 and p.flags.c_contiguous for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), arr)
    with pytest.raises(ValueError):
        demo.split_batches(y, 0)
    with pytest.raises(ValueError):
        demo.split_batches(y, 451)


def test_onnx_model_matches_numpy():
    """The hand-built ONNX graph computes the MLP the weights describe, with the input
    scale in the graph or left to the caller."""
    rng = np.random.default_rng(0)
    layers = ((rng.standard_normal((64, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)),
              (rng.standard_normal((8, 10), dtype=np.float32), rng.standard_normal(10, dtype=np.float32)))
    weights = demo.MLPWeights(layers=layers, input_scale=1 / 16)
    x = rng.integers(0, 17, size=(5, 64)).astype(np.float32)
    h = np.maximum(x / 16 @ layers[0][0] + layers[0][1], 0)
    expected = h @ layers[1][0] + layers[1][1]
    session = demo.make_session(demo.build_onnx_model(weights), threads=1)
    (got,) = session.run([demo.OUTPUT_NAME], {demo.INPUT_NAME: x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    session = demo.make_session(demo.build_onnx_model(weights, scale_input=False), threads=1)
    (got,) = session.run([demo.OUTPUT_NAME], {demo.INPUT_NAME: demo.make_scale(1 / 16)(x.astype(np.uint8))})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_copied_hop_is_reported_and_fails_the_check():
    """The per-batch merge keeps a copy in any batch visible: that hop is not shared,
    the batch is named, and the demo's check fails."""
    hop = {"from": "torch", "to": "jax", "bytes": 40, "shared": True}
    merged, unshared = demo._merge_hops([[dict(hop)], [dict(hop, shared=False)], [dict(hop)]])
    assert merged == [{"from": "torch", "to": "jax", "tensor": demo.HOP_TENSORS[0], "bytes": 120, "shared": False}]
    assert unshared == [{"from": "torch", "to": "jax", "bytes": 40, "shared": False, "batch": 1}]
    assert not _fake_result(shared=False).ok


def test_aligned():
    a = np.arange(7, dtype=np.int32)
    b = demo.aligned(a)
    assert b.ctypes.data % 64 == 0 and b.flags.c_contiguous
    np.testing.assert_array_equal(a, b)


def _fake_result(shared: bool = True) -> demo.DemoResult:
    hops = [{"from": "input", "to": "numpy", "bytes": 28800, "shared": True},
            {"from": "torch", "to": "jax", "bytes": 18000, "shared": shared}]
    unshared = [] if shared else [{"from": "torch", "to": "jax", "bytes": 2280, "shared": False, "batch": 3}]
    stages = [{"name": "scale", "framework": "numpy", "ms": 1.5}, {"name": "argmax", "framework": "jax", "ms": 12.25}]
    return demo.DemoResult(accuracy=0.97, confidence=0.95, hops=hops, unshared=unshared, stages=stages,
                           peak_live_bytes=1000, stage_output_bytes_total=4000, live_records_end=0,
                           records_end=[], device="cpu", batches=8, n_train=10, n_test=5,
                           seconds={"train": 1.0}, chain_ms=20.0)


@pytest.mark.parametrize("with_rich", [True, False])
def test_text_report(monkeypatch, with_rich):
    if with_rich:
        pytest.importorskip("rich")
    else:  # as if rich were not installed
        for mod in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, mod, None)
    out = io.StringIO()
    note = "CuPy is not installed (the scale stage runs in CuPy on CUDA; pip install cupy-cuda13x), said in full"
    demo.print_text(dataclasses.replace(_fake_result(shared=False), device_note=note), file=out)
    text = out.getvalue()
    # not a terminal: no sentence is wrapped, however long
    assert text.splitlines()[0].endswith(f"device cpu (CUDA not used: {note})"), text
    assert "accuracy 0.9700" in text
    assert "shared" in text and "copied" in text
    assert "batch 3" in text  # the batch whose hop copied
    assert "argmax" in text and "jax" in text and "12.2" in text  # the stage table
    assert "peak live bytes 1000" in text and "4000" in text
    assert "0 records made by this run alive at the end" in text
    assert "FAILED" in text  # a copied hop fails the check
    assert "\x1b[" not in text  # no colour codes into a non-terminal


def test_main_passes_the_options(monkeypatch, capsys):
    """Both modes show the phases on stderr; in json mode stdout is the JSON only."""
    calls = []

    def fake_run_demo(**kwargs):
        calls.append(kwargs)
        return _fake_result()

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    parser = cli.build_parser(["demo"])
    demo.main(parser.parse_args(["demo", "--device", "cpu", "--batches", "3"]))
    assert calls[-1]["progress"] is True and calls[-1]["batches"] == 3 and calls[-1]["device"] == "cpu"
    capsys.readouterr()
    assert demo.main(parser.parse_args(["demo", "--device", "cpu", "--report", "json"])) == 0
    assert calls[-1]["progress"] is True and calls[-1]["batches"] == 8
    assert set(json.loads(capsys.readouterr().out)) == KEYS
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--batches", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--device", "tpu"])


def test_cli_without_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_cli_unknown_command():
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, unknown, usage", [
    (["demo", "--batches", "3", "--no-such-flag"], "--no-such-flag", "usage: tensor-exchange demo "),
    (["bench", "--quik"], "--quik", "usage: tensor-exchange bench "),
    (["doctor", "extra"], "extra", "usage: tensor-exchange doctor "),
    (["--no-such-flag", "demo"], "--no-such-flag", "usage: tensor-exchange [-h]"),  # before the subcommand
])
def test_an_unknown_option_prints_the_usage_of_its_subcommand(capsys, argv, unknown, usage):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"unrecognized arguments: {unknown}" in err


def test_cli_imports_subcommands_lazily():
    code = ("import sys, exchange.cli as c; c.build_parser(['--help']); "
            "print(sorted(m for m in ('exchange.cli.demo', 'sklearn', 'torch', 'jax', 'onnxruntime') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_cli_commands_are_well_formed():
    import importlib

    for name, (module, help_text) in cli.COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.main), name
        assert help_text
    parser = cli.build_parser(["demo"])
    args = parser.parse_args(["demo", "--report", "json"])
    assert args.command == "demo" and args.report == "json"


def test_missing_demo_packages_name_the_extra(monkeypatch, capsys):
    """A bare ``pip install -e .`` then ``tensor-exchange demo``: the reason and the extra
    to install, not a raw ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if scikit-learn were not installed
    assert demo.missing_packages() == ["scikit-learn"]
    parser = cli.build_parser(["demo"])
    assert demo.main(parser.parse_args(["demo", "--device", "cpu"])) == 2
    err = capsys.readouterr().err
    assert "scikit-learn" in err and "tensor-exchange[demo]" in err and "Traceback" not in err
    assert f"{sys.executable} -m pip install" in err  # this environment's pip, not whatever pip is on PATH


def test_demo_ray_without_ray_names_this_environments_pip(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    parser = cli.build_parser(["demo"])
    assert demo.main(parser.parse_args(["demo", "--ray"])) == 2
    err = capsys.readouterr().err
    assert f"{sys.executable} -m pip install 'tensor-exchange[ray]'" in err and "make demo ARGS=--ray" in err
    assert "Traceback" not in err


#: A reason longer than any terminal is wide: the report keeps it on one line off a terminal.
RAY_REASON = ("the store is read-only (READ_ONLY) and PyTorch ignores DLPack's flag, so the hop into it copies "
              "into memory PyTorch may write")


def _fake_ray_result():
    from exchange.cli import demo_ray

    hops = [{"from": "input", "to": "numpy", "tensor": "pixels", "bytes": 28800, "shared": True,
             "transport": "in-process"},
            {"from": "onnxruntime", "to": "torch", "tensor": "logits", "bytes": 18000, "shared": False,
             "transport": "ray-object-store", "reason": RAY_REASON}]
    return demo_ray.RayDemoResult(
        accuracy=0.97, reference_accuracy=0.97, same_predictions=1.0, hops=hops, unshared=[], stages=[
            {"name": "scale", "framework": "numpy", "ms": 1.5}, {"name": "argmax", "framework": "jax", "ms": 12.25}],
        peak_live_bytes=1000, stage_output_bytes_total=4000, live_records_end=0,
        live_records_by_process={"driver": 0, "stage 0 scale": 0}, records_end=[], batches=8, n_train=10, n_test=5,
        seconds={"cluster": 4.0, "run": 1.0}, chain_ms=20.0, actors={"scale": 4242, "argmax": 4343}, ray_version="2.60.0")


@pytest.mark.parametrize("with_rich", [True, False])
def test_demo_ray_text_report_is_tables(monkeypatch, with_rich):
    from exchange.cli import demo_ray

    if with_rich:
        pytest.importorskip("rich")
    else:
        for mod in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, mod, None)
    out = io.StringIO()
    demo_ray.print_text(_fake_ray_result(), file=out)
    text = out.getvalue()
    assert "tx.Chain stages, one Ray actor each" in text
    stage_line = next(ln for ln in text.splitlines() if "argmax" in ln)
    assert "jax" in stage_line and "4343" in stage_line and "12.2" in stage_line  # one row per stage
    hop_line = next(ln for ln in text.splitlines() if "logits" in ln and "18000" in ln)
    assert "ray-object-store" in hop_line and "copied" in hop_line
    assert f"copied: onnxruntime -> torch: {RAY_REASON}" in text.splitlines()
    assert "time: chain 20.0 ms; cluster 4.00 s, run 1.00 s" in text and text.rstrip().endswith("OK")
    assert "\x1b[" not in text
    report = demo_ray.report_json(_fake_ray_result())
    assert report["chain_ms"] == 20.0 and report["hops"][1]["tensor"] == "logits"


def test_json_report_says_why_cuda_was_not_used(monkeypatch, capsys):
    reason = demo.cuda_unusable_reason()
    if reason is None:
        pytest.skip("CUDA is usable here")
    seen = []

    def fake_run_demo(**kwargs):
        seen.append(kwargs)
        return dataclasses.replace(_fake_result(), device_note=kwargs["device_note"])

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    parser = cli.build_parser(["demo"])
    assert demo.main(parser.parse_args(["demo", "--report", "json"])) == 0  # --device auto
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["device_note"] == reason and seen[-1]["device"] == "cpu"
    # said once, without a pip hint: the install hint belongs to doctor, where a driver is present
    assert "pip install" not in reason


def test_hops_that_copy_by_design_carry_the_reason_and_pass():
    """On a CUDA run with the CPU build of ONNX Runtime the model's two hops copy: they
    are reported as copies with the reason, and the check still holds."""
    batch = [{"from": "input", "to": "cupy", "bytes": 8, "shared": True},
             {"from": "cupy", "to": "cupy", "bytes": 8, "shared": True},
             {"from": "cupy", "to": "torch", "bytes": 4, "shared": True},
             {"from": "torch", "to": "jax", "bytes": 4, "shared": True}]
    marked = demo._mark_host_model(batch)
    assert [(h["from"], h["to"], h["shared"]) for h in marked] == [
        ("input", "cupy", True), ("cupy", "onnxruntime", False), ("onnxruntime", "torch", False), ("torch", "jax", True)]
    assert marked[1]["reason"] == marked[2]["reason"] == demo.ORT_CPU_REASON
    hops, unshared = demo._merge_hops([marked, demo._mark_host_model(batch)])
    result = dataclasses.replace(_fake_result(), hops=hops, unshared=unshared)
    assert result.ok
    report = demo.report_json(result)
    assert [h.get("reason") for h in report["hops"]] == [None, demo.ORT_CPU_REASON, demo.ORT_CPU_REASON, None]
    out = io.StringIO()
    demo.print_text(result, file=out)
    assert "copied by design" in out.getvalue() and "CPU build" in out.getvalue()


def test_doctor_reports_the_path_and_devices(capsys):
    import exchange._core
    from exchange.cli import doctor

    data = doctor.report()
    assert data["path"]["native"] is exchange._core.compiled() and data["path"]["why"]
    assert data["devices"][0] == {"device": "cpu", "available": True}
    cuda = [d for d in data["devices"] if d["device"].startswith("cuda")]
    assert cuda, data["devices"]
    if not cuda[0]["available"]:
        assert "pip install" not in cuda[0]["reason"]  # the hint is doctor's one line, and only with a driver
        from exchange.devices.cuda import driver_cuda_major

        assert (data["cuda_install_hint"] is None) == (driver_cuda_major() is None)
    parser = cli.build_parser(["doctor"])
    assert doctor.main(parser.parse_args(["doctor"])) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].startswith("path: ")
    header = next(line for line in text.splitlines() if line.split()[:1] == ["framework"])
    assert header.split() == ["framework", "version", "exports", "takes", "asks"]  # every column has a header


def test_doctor_probes_every_framework_of_the_adapters_table():
    """doctor's rows are exchange.frameworks.FRAMEWORKS, so an adapter added there shows
    with no edit to doctor; the installed ones are probed on both sides through it."""
    from exchange.cli import doctor
    from exchange.frameworks import FRAMEWORKS

    rows = doctor._frameworks()
    assert [r["framework"] for r in rows] == list(FRAMEWORKS)
    numpy_row = next(r for r in rows if r["framework"] == "numpy")
    assert numpy_row["installed"] and numpy_row["producer"]["versioned"] is True
    assert numpy_row["consumer"]["passes"]["max_version"] == [1, 0], numpy_row
    for row in rows:
        assert row["installed"] or "pip install" in row["reason"], row


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_doctor_through_a_reader_that_leaves_early(json_flag):
    """``tensor-exchange doctor | head -1``: no BrokenPipeError traceback; the exit status
    is the self-check's."""
    code = ("import sys; from exchange import cli; sys.stdin.read(); status = cli.main(sys.argv[1:]); "
            "print('stderr still works', file=sys.stderr); sys.exit(status)")
    _run_with_the_reader_gone(["-c", code, "doctor", *json_flag])


def _run_with_the_reader_gone(args: list[str]) -> None:
    """A child Python with ``args``, whose stdout's reader has gone before a byte is
    written: it exits 0, with no traceback, and its stderr still works after the report
    (the child says so last: "stderr still works")."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    proc.stdout.close()  # the reader has gone before a byte is written
    proc.stdin.close()
    err = proc.stderr.read()
    assert proc.wait(120) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.rstrip().endswith("stderr still works"), err


def test_install_hint_names_the_extra_of_the_driver():
    """doctor's hint names the extra for the driver's CUDA: R580 and later speak CUDA 13."""
    from exchange.devices import cuda

    assert cuda._cuda_major_of_driver(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:40 UTC 2025") == 13
    assert cuda._cuda_major_of_driver(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  Tue Mar  5 2024") == 12
    assert cuda._cuda_major_of_driver("no version here") is None
    hint = cuda.install_hint()
    if cuda.driver_cuda_major() is None:
        assert hint is None  # no driver: nothing to install, nothing said
    else:
        assert f"cuda{min(cuda.driver_cuda_major(), 13)}" in hint


@pytest.mark.parametrize("argv, reason", [
    (["demo", "--batches", "0"], "expected an integer from 1 to 450, got '0'"),
    (["demo", "--batches", "451"], "expected an integer from 1 to 450, got '451'"),
    (["demo", "--seed", "-1"], "expected an integer >= 0, got '-1'"),
    (["demo", "--threads", "x"], "expected an integer >= 1, got 'x'"),
    (["bench", "--samples", "0"], "expected an integer >= 1, got '0'"),
    (["bench", "--max-size", "2G"], "must be from 1K to 1G"),
    (["snapshot", "1", "--indent", "65"], "expected an integer from 0 to 64, got '65'"),
    (["top", "0"], "a process id is from 1"),
    (["top", "1", "--interval", "0.1"], "must be at least 0.2"),
])
def test_an_option_out_of_range_says_why_with_the_usage(capsys, argv, reason):
    """The commands share their argparse types (exchange/cli/arguments.py): a value out of
    range exits with status 2, the command's usage and the reason."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tensor-exchange {argv[0]} ") and reason in err, err


@pytest.mark.slow
@pytest.mark.once_per_ci  # runs both paths itself, in child processes
@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_publish_demo_json(pure):
    """``demo --publish --report json``: a PyTorch trainer publishes a version per epoch;
    the JAX and the NumPy reader each saw every version, read each in place (their
    framework's pointer in a shared read-only mapping), found the trainer's checksum (no
    torn version), scored the accuracy rising to 0.9 or more; 0 records alive in all
    three processes; stdout is the JSON alone. Bounded by the subprocess's timeout."""
    from exchange.cli import demo_publish

    env = _env()
    env.pop("EXCHANGE_PURE_PYTHON", None)
    if pure:
        env["EXCHANGE_PURE_PYTHON"] = "1"
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--publish", "--report", "json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and all(report["checks"].values()), report["checks"]
    assert report["errors"] == []
    published = {p["version"]: p for p in report["published"]}
    assert [p["epoch"] for p in report["published"]] == list(range(demo_publish.EPOCHS + 1))
    assert set(report["readers"]) == set(demo_publish.READERS)
    for name, reader in report["readers"].items():
        seen = reader["versions"]
        assert [r["version"] for r in seen] == sorted(published), (name, seen)  # paced: every version
        for r in seen:
            assert r["zero_copy"] is True, (name, r)
            assert r["checksum"] == r["checksum_in_set"] == published[r["version"]]["checksum"], (name, r)
        assert seen[-1]["accuracy"] >= demo_publish.MIN_ACCURACY > seen[0]["accuracy"], (name, seen)
        assert reader["live_records_end"] == 0
    assert report["live_records_end"] == 0
    assert "tx-demo-weights" in report["set"]


def test_publish_demo_checks_catch_a_torn_or_copied_version():
    """The demo's verdict fails on a version whose checksum differs from the trainer's,
    on one read through a copy, on accuracy that did not rise, on a record left alive."""
    from exchange.cli.demo_publish import PublishResult

    def result(**change) -> PublishResult:
        row = {"version": 1, "epoch": 0, "accuracy": 0.1, "checksum": 7, "checksum_in_set": 7, "zero_copy": True}
        last = {**row, "version": 2, "epoch": 1, "accuracy": 0.95, "checksum": 9, "checksum_in_set": 9,
                **change.pop("last", {})}
        readers = {fw: {"framework": fw, "versions": [dict(row), dict(last)], "live_records_end": 0}
                   for fw in ("jax", "numpy")}
        published = [{"version": 1, "checksum": 7}, {"version": 2, "checksum": 9}]
        return PublishResult("s", published, readers, change.pop("live", 0), [], 1.0)

    assert result().ok
    assert not result(last={"checksum": 8}).checks()["no_torn_version"]
    assert not result(last={"checksum": 8, "checksum_in_set": 8}).checks()["no_torn_version"]
    assert not result(last={"zero_copy": False}).checks()["zero_copy"]
    assert not result(last={"accuracy": 0.05}).checks()["accuracy_rising"]
    assert not result(live=1).checks()["no_records_alive"]
