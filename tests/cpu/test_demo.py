"""``tensor-exchange demo`` and the command line dispatcher (exchange/cli.py).

The demo's check (issue 2, item 8): ``--report json`` prints exactly one JSON object
with accuracy >= 0.9 on the held-out split, every hop shared, no record left alive.
No timing assertions here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _name in ("sklearn", "onnx", "onnxruntime", "torch", "jax"):
    pytest.importorskip(_name, reason=f"the demo needs {_name} (pip install -e '.[demo]')")

import exchange as tx  # noqa: E402
from exchange import cli, demo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _check_report(report: dict) -> None:
    assert set(report) == {"accuracy", "hops", "live_records_end", "device"}
    assert isinstance(report["accuracy"], float)
    assert 0.9 <= report["accuracy"] <= 1.0
    assert isinstance(report["live_records_end"], int) and not isinstance(report["live_records_end"], bool)
    assert report["live_records_end"] == 0
    assert report["device"] == "cpu"
    hops = report["hops"]
    assert isinstance(hops, list) and len(hops) >= 3
    for h in hops:
        assert set(h) == {"from", "to", "bytes", "shared"}
        assert isinstance(h["from"], str) and isinstance(h["to"], str) and h["from"] != h["to"]
        assert isinstance(h["bytes"], int) and not isinstance(h["bytes"], bool) and h["bytes"] > 0
        assert h["shared"] is True, f"hop {h['from']} -> {h['to']} copied"
    frameworks = {h["from"] for h in hops} | {h["to"] for h in hops}
    assert len(frameworks) >= 3


@pytest.mark.slow
def test_cli_json_report_subprocess():
    """The acceptance check, as a user runs it: stdout is one JSON object and nothing else."""
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--report", "json"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout, so nothing else was printed
    assert proc.stdout.strip().count("\n") == 0
    _check_report(report)
    assert [(h["from"], h["to"]) for h in report["hops"]] == [
        ("numpy", "onnxruntime"), ("onnxruntime", "torch"), ("torch", "jax"), ("numpy", "jax")]


@pytest.fixture(scope="module")
def result() -> demo.DemoResult:
    return demo.run_demo()


def test_run_demo_in_process(result):
    _check_report(demo.report_json(result))
    assert result.ok
    assert result.n_test == 450 and result.n_train == 1347
    assert result.live_records_peak >= len(result.hops)  # the records really were alive
    assert result.records_end == []
    for h in result.hops:
        assert h.producer_ptr == h.tx_ptr == h.consumer_ptr != 0
    # The pixels hop moves the whole test batch: 450 images of 64 float32.
    assert result.hops[0].nbytes == 450 * 64 * 4
    json.dumps(demo.report_json(result))  # serialisable as is


def test_onnx_model_matches_numpy():
    """The hand-built ONNX graph computes the MLP the weights describe."""
    rng = np.random.default_rng(0)
    layers = ((rng.standard_normal((64, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)),
              (rng.standard_normal((8, 10), dtype=np.float32), rng.standard_normal(10, dtype=np.float32)))
    weights = demo.MLPWeights(layers=layers, input_scale=1 / 16)
    session = demo.make_session(demo.build_onnx_model(weights), threads=1)
    x = rng.integers(0, 17, size=(5, 64)).astype(np.float32)
    (got,) = session.run([demo.OUTPUT_NAME], {demo.INPUT_NAME: x})
    h = np.maximum(x / 16 @ layers[0][0] + layers[0][1], 0)
    np.testing.assert_allclose(got, h @ layers[1][0] + layers[1][1], rtol=1e-4, atol=1e-4)


def test_hop_reports_a_copy_as_copied():
    """A hop the consumer copies is reported as copied, not faked: JAX copies data that
    is not 64-byte aligned."""
    raw = np.zeros(4096 + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + 4  # 4 bytes past a 64-byte boundary
    labels = raw[start:start + 400].view(np.int32)
    out, h = demo.hop(labels, "numpy", "jax", "labels")
    assert h.producer_ptr == h.tx_ptr  # exchange itself shared
    assert h.consumer_ptr != h.tx_ptr and h.shared is False
    assert h.to_json() == {"from": "numpy", "to": "jax", "bytes": 400, "shared": False}
    del out
    tx.registry().collect(timeout=10)


def test_aligned():
    a = np.arange(7, dtype=np.int32)
    b = demo.aligned(a)
    assert b.ctypes.data % 64 == 0 and b.flags.c_contiguous
    np.testing.assert_array_equal(a, b)


def _fake_result(shared: bool = True) -> demo.DemoResult:
    hops = [demo.Hop("numpy", "onnxruntime", "pixels", 115200, True, 64, 64, 64),
            demo.Hop("torch", "jax", "probabilities", 18000, shared, 128, 128, 256 if not shared else 128)]
    return demo.DemoResult(accuracy=0.97, confidence=0.95, hops=hops, live_records_end=0, records_end=[],
                           live_records_peak=2, device="cpu", n_train=10, n_test=5,
                           seconds={"train": 1.0})


@pytest.mark.parametrize("with_rich", [True, False])
def test_text_report(monkeypatch, with_rich):
    if with_rich:
        pytest.importorskip("rich")
    else:  # as if rich were not installed
        for mod in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, mod, None)
    out = io.StringIO()
    demo.print_text(_fake_result(shared=False), file=out)
    text = out.getvalue()
    assert "accuracy 0.9700" in text
    assert "shared" in text and "copied" in text
    assert "0 alive at the end" in text
    assert "FAILED" in text  # a copied hop fails the check
    assert "\x1b[" not in text  # no colour codes into a non-terminal


def test_cli_without_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_cli_unknown_command():
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2


def test_cli_imports_subcommands_lazily():
    code = ("import sys, exchange.cli as c; c.build_parser(['--help']); "
            "print(sorted(m for m in ('exchange.demo', 'sklearn', 'torch', 'jax', 'onnxruntime') if m in sys.modules))")
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
