"""``tensor-exchange bench`` (exchange/cli/bench.py): ``--quick --json`` prints one JSON
object with every key, of the right type. No timing assertions: the numbers depend on
the machine; docs/performance.md reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exchange.cli import bench

ROOT = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    """``python -m exchange bench`` once the dispatcher has it, else the module itself."""
    try:
        from exchange import cli

        if "bench" in cli.COMMANDS:
            return [sys.executable, "-m", "exchange", "bench"]
    except ImportError:
        pass
    return [sys.executable, "-m", "exchange.cli.bench"]


def _run(*extra: str, pure: bool = False) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("EXCHANGE_PURE_PYTHON", None)
    if pure:
        env["EXCHANGE_PURE_PYTHON"] = "1"
    proc = subprocess.run([*_command(), "--quick", "--json", *extra], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().count("\n") == 0, "stdout must hold the JSON object and nothing else"
    # the ray section starts a local cluster, which prints Ray's token notice unless our command leaves it out
    assert "Token authentication" not in proc.stderr, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _is_number(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _check(result: dict) -> None:
    assert set(result) == set(bench.all_keys())
    for key in ("export_hop_ratio", "import_hop_ratio", "size_flatness", "chain_hop_ratio"):
        assert _is_number(result[key]), (key, result[key])
        assert result[key] > 0, (key, result[key])
    scaling = result["thread_scaling"]
    assert isinstance(scaling, dict) and set(scaling) == {"1", "2", "4", "8"}
    for n, rate in scaling.items():
        assert _is_number(rate) and rate > 0, (n, rate)
    details = result["details"]
    assert isinstance(details, dict)
    for key in ("native", "machine", "config", "export_hop", "import_hop", "sizes", "threads", "chain",
                "release", "missed_targets", "elapsed_s"):
        assert key in details, key
    assert isinstance(details["native"], bool)
    assert details["threads"]["errors"] == []
    assert details["threads"]["registry_balanced"] is True
    for name in ("cpu_default_stream", "cpu_host_stream_idle", "cpu_host_stream_busy"):
        assert details["release"][name]["samples"] > 0, (name, details["release"][name])
    assert details["release"]["cpu_host_stream_busy"]["ordered"] is True  # correctness, not timing
    assert "cuda" in details["release"]
    sizes = [row["bytes"] for row in details["sizes"]["rows"]]
    assert sizes[0] == 1024 and sizes[-1] <= 64 << 20
    _check_core(result)


def _check_core(result: dict) -> None:
    """The core section (exchange/cli/bench_core.py, issue 10): its keys, and what
    they rest on (the records held, the pure-Python child really pure)."""
    from exchange.cli import bench_core

    assert "core" in bench.SECTIONS
    for key in bench_core.KEYS:
        if key == "torch_import_ratio" and result[key] is None:
            continue  # no PyTorch here: the reason is in the details
        assert _is_number(result[key]), (key, result[key])
        # a difference of two timings (chain_small_hop_us) may come out below zero on a noisy machine
        assert key == "chain_small_hop_us" or result[key] > 0, (key, result[key])
    core = result["details"]["sections"]["core"]["details"]
    assert core["record"]["records"] == bench_core.RECORDS
    assert core["record"]["live_records_while_held"] >= bench_core.RECORDS
    assert core["pure_import"]["native"] is False
    assert core["chain"]["stages"] == bench_core.CHAIN_STAGES
    for key in ("hop_us", "run_hop_us", "inline_run_hop_us", "pipelined_hop_us"):
        assert math.isfinite(core["chain"][key]), key
    if result["torch_import_ratio"] is None:
        assert "skipped" in core["torch_import"]
    else:
        assert core["torch_import"]["torch_own_ratio"] > 0
    assert set(bench_core.TARGETS) <= set(bench_core.KEYS) and "pure_import_hop_ratio" not in bench_core.TARGETS


@pytest.mark.slow
@pytest.mark.once_per_ci  # its child runs the compiled path in either pass
def test_quick_json_subprocess(tmp_path):
    # without EXCHANGE_PURE_PYTHON: the compiled core wherever it is built; --plot draws the same run
    result = _run("--plot", str(tmp_path / "plots"))
    _check(result)
    import importlib.util

    assert result["details"]["native"] is (importlib.util.find_spec("exchange._native") is not None)
    _check_plots(tmp_path / "plots")
    curves = result["details"]["sections"]["release"]["details"]["curves"]
    assert [r["held"] for r in curves["live"]] == [0, 100, 1_000, 10_000, 100_000]
    assert [r["made"] for r in curves["pending"]] == [0, 100, 1_000, 10_000]
    for row in curves["live"] + curves["pending"]:
        assert _is_number(row["tx_ns"]) and _is_number(row["numpy_ns"]) and _is_number(row["ratio"]), row
    assert all(r["pending_releases"] >= r["made"] for r in curves["pending"])
    for row in result["details"]["sections"]["share"]["details"]["rows"]:
        assert _is_number(row["shm_us"]) and row["shm_us"] > 0, row


def _check_plots(directory: Path) -> None:
    """Each figure --plot writes is a PNG that matplotlib reads back, of a sane size."""
    from matplotlib.image import imread

    from exchange.cli import bench_plot

    assert sorted(p.name for p in directory.iterdir()) == sorted(bench_plot.FILES)
    for name in bench_plot.FILES:
        path = directory / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        image = imread(path)
        height, width = image.shape[:2]
        assert 300 <= height <= 1000 and 600 <= width <= 1600, (name, image.shape)
        assert image.std() > 0.05, f"{name} looks blank"
        assert path.stat().st_size < 120_000, (name, path.stat().st_size)


@pytest.mark.slow
# Its child runs the pure path in either pass, and it is the longest test (about 80 s):
# CI runs it in the pure-Python pass, the shorter of the two.
@pytest.mark.second_pass_in_ci
def test_quick_json_pure_python():
    result = _run("--samples", "5", "--max-size", "64K", pure=True)
    _check(result)
    assert result["details"]["native"] is False
    assert result["details"]["sizes"]["rows"][-1]["bytes"] == 64 << 10


def test_arguments_and_sizes():
    from exchange.cli import arguments

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--max-size", "16M", "--chain", "chain"])
    assert args.quick and args.json and args.max_size == 16 << 20 and args.chain == "chain"
    assert args.plot is None and parser.parse_args(["--plot", "figs"]).plot == "figs"
    size = arguments.byte_size
    assert size("1K") == 1024 and size("1GiB") == 1 << 30 and size("64mb") == 64 << 20
    for bad in ("2G", "12", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            arguments.byte_size(bad)
    from exchange.cli import bench_sizes

    cfg = bench.Config(True, max_size=100 << 10)
    assert bench_sizes._sizes(cfg) == [1024, 16 << 10, 100 << 10]


def test_compare_and_table():
    """The timing core on trivial candidates, and the table on a made-up result."""
    res = bench.compare([bench.Candidate("a", abs, -1), bench.Candidate("b", abs, -2, g=abs)], 3, 200_000)
    assert set(res) == {"a", "b"}
    for summary in res.values():
        assert summary["samples"] == 3 and summary["median_ns"] > 0 and summary["batch"] >= 1
    hop = {"tx_ns": 2000.0, "numpy_ns": 200.0, "torch_ns": 1000.0}
    fake = {"export_hop_ratio": 10.0, "import_hop_ratio": 20.0, "size_flatness": 1.0, "chain_hop_ratio": 1.1,
            "thread_scaling": {"1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}, "details": {
                "native": True, "config": {"quick": True}, "loop_overhead_ns": 30.0,
                "machine": {"cpu_model": "x", "cpu_count": 2, "python": "3", "numpy": "2"},
                "export_hop": hop, "import_hop": hop,
                "chain": {"ours": "o", "tx_ns": 1.1, "glued_ns": 1.0},
                "sizes": {"rows": [{"bytes": 1024, "import_ns": 1.0, "export_ns": 1.0, "numpy_ns": 1.0,
                                    "import_vs_1k": 1.0, "export_vs_1k": 1.0}]},
                "threads": {"exchanges_per_s": {"1": 1.0}, "speedup_vs_1": {"1": 1.0},
                            "peer_exchanges_per_s": {"1": 1.0}, "errors": [], "registry_balanced": True},
                "release": {"cuda": {"skipped": "no device"},
                            "cpu": {"samples": 1, "timeouts": 0, "median_us": 1.0, "max_us": 1.0}},
                "missed_targets": bench.missed({"export_hop_ratio": 10.0, "import_hop_ratio": 20.0,
                                                "size_flatness": 1.0, "chain_hop_ratio": 1.1}),
                "elapsed_s": 1.0}}
    table = bench.format_table(fake)
    assert table.splitlines()[0] == "tensor-exchange bench (quick; compiled core)"  # the README's and doctor's name
    assert f"import_hop_ratio = 20.00 > {bench.TARGETS['import_hop_ratio']}" in table and "skipped: no device" in table


def test_cli_dispatch(monkeypatch):
    """Registering ``bench`` in the dispatcher is one line: its module has what it needs."""
    cli = pytest.importorskip("exchange.cli")
    monkeypatch.setitem(cli.COMMANDS, "bench", ("exchange.cli.bench", "measure the DLPack hops"))
    argv = ["bench", "--quick", "--json", "--max-size", "1M"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._module == "exchange.cli.bench" and args.quick and args.json and args.max_size == 1 << 20
    calls = []
    monkeypatch.setattr(bench, "run", lambda a: calls.append(a) or 0)
    assert bench.main(args) == 0 and calls == [args]  # the dispatcher passes the Namespace


def test_samples_must_be_positive_and_device_is_checked(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--samples", bad])
    assert parser.parse_args(["--samples", "5"]).samples == 5
    assert parser.parse_args([]).device == "cpu"
    reason = bench.cuda_unusable_reason()
    if reason is None:
        pytest.skip("CUDA is usable here")
    assert bench.run(parser.parse_args(["--device", "cuda", "--quick"])) == 2
    err = capsys.readouterr().err
    assert "--device cuda cannot run here" in err and reason in err


def test_chain_row_fits_its_columns():
    """Every row of the hop table keeps the columns aligned, whatever the magnitudes."""
    assert bench._fmt_ns(412.0) == "0.412 us" and bench._fmt_ns(18_300.0) == "18.3 us"
    assert bench._fmt_ns(24_000_000.0) == "24.00 ms"
    for ns in (100.0, 5e4, 2.4e7, 1.2e9):
        assert len(bench._fmt_ns(ns)) <= 10


def test_help_names_the_defaults_the_run_uses():
    """Every default ``bench --help`` names is the parser's, or for the options whose
    default follows ``--quick``, the Config a run uses (``--chain`` once said ``hop``
    while the code ran ``chain``)."""
    from exchange import cli

    parser = cli.build_parser(["bench"])
    sub = parser.parse_known_args(["bench"])[0]._parser
    texts = {a.dest: a.help % dict(vars(a), prog=sub.prog) for a in sub._actions
             if a.help and "default" in a.help}
    from exchange.cli import arguments

    full, quick = bench.Config(False), bench.Config(True)
    assert f"default {arguments.size_text(full.max_size)}, --quick {arguments.size_text(quick.max_size)}" in texts.pop(
        "max_size")
    assert f"default {full.samples}, --quick {quick.samples}" in texts.pop("samples")
    assert texts, "no option with a default left to check"
    for action in sub._actions:
        if action.dest in texts:
            assert f"default {action.default}" in texts[action.dest], (action.dest, texts[action.dest])
    assert sub.parse_args([]).chain == "chain" and "(default chain)" in texts["chain"]
    assert arguments.size_text(64 << 20) == "64M" and arguments.size_text(1 << 30) == "1G"


def test_plot_without_matplotlib_fails_first_naming_the_extra(monkeypatch, capsys):
    """--plot with no matplotlib exits 2 with the reason before anything is measured."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured before checking matplotlib"))
    assert bench.run(parser.parse_args(["--quick", "--plot", "figs"])) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "tensor-exchange[plot]"' in err, err


@pytest.mark.parametrize("where", ["a file", "under a file", "empty"])
def test_plot_into_a_place_that_cannot_hold_figures_fails_first(tmp_path, monkeypatch, capsys, where):
    """--plot into a file, below a file, or "": exit 2 naming the place, before measuring."""
    pytest.importorskip("matplotlib")
    (tmp_path / "afile").write_text("")
    path = {"a file": tmp_path / "afile", "under a file": tmp_path / "afile" / "sub", "empty": ""}[where]
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured before checking --plot's folder"))
    assert bench.run(parser.parse_args(["--quick", "--plot", str(path)])) == 2
    err = capsys.readouterr().err
    assert "--plot:" in err and ("cannot write figures" in err or "give a folder" in err), err
    assert "Traceback" not in err


def test_plot_marks_the_sections_a_run_skipped(tmp_path):
    """The figures of a result with no release curves, no share rows and Ray skipped:
    each such panel says so instead of failing."""
    pytest.importorskip("matplotlib")
    from exchange.cli import bench_plot

    rows = [{"bytes": 1 << k, "import_ns": 200.0, "export_ns": 150.0, "numpy_ns": 130.0, "import_vs_1k": 1.0,
             "export_vs_1k": 1.0} for k in (10, 14, 18)]
    result = {"size_flatness": 1.0, "details": {
        "native": False, "config": {"quick": True}, "device": "cpu",
        "machine": {"cpu_model": "test CPU", "cpu_count": 2, "python": "3", "numpy": "2"},
        "targets": {"size_flatness": 1.5}, "sizes": {"rows": rows},
        "sections": {"share": {"details": {"skipped": "no spawn here"}}, "ray": {"details": {"skipped": "no Ray"}}}}}
    paths = bench_plot.write(result, tmp_path / "figs")
    assert [p.name for p in paths] == list(bench_plot.FILES)
    _check_plots(tmp_path / "figs")


def test_compiled_graphs_are_measured_one_at_a_time(monkeypatch):
    """Section ray's compiled-graph comparison (issue 27): each turn starts, times and
    tears down its own graph, so no two are ever up at once (six actors polling on 2
    cores made the ratio swing 1.19-1.57); the order alternates from round to round and
    the key is the median of the rounds' own ratios. The turns are stand-ins here (no
    Ray): what is checked is the schedule."""
    from exchange.cli import bench_ray

    up: list[str] = []
    log: list[str] = []
    times = iter([10.0, 20.0, 40.0, 20.0, 10.0, 30.0])  # (tx, by hand) per round, in call order

    def turn(name):
        def run(samples, sample_ns):
            assert not up, f"{name} started while {up} was up"
            up.append(name)
            log.append(name)
            try:
                return next(times), 1.0
            finally:
                up.remove(name)
        return run

    monkeypatch.setattr(bench_ray, "COMPILED_ROUNDS", 3)
    monkeypatch.setattr(bench_ray, "_turn_tx", turn("tx"))
    monkeypatch.setattr(bench_ray, "_turn_by_hand", turn("by_hand"))
    out = bench_ray._compiled_chain(bench.Config(False), 5)
    assert log == ["tx", "by_hand", "by_hand", "tx", "tx", "by_hand"]
    # round ratios: 10/20, 20/40 (by hand ran first), 10/30
    assert [r["ratio"] for r in out["rounds"]] == [0.5, 0.5, 1 / 3]
    assert out["ratio"] == 0.5 and [r["first"] for r in out["rounds"]] == ["tx", "by_hand", "tx"]
    hops = bench_ray.CHAIN_BATCHES * bench_ray.CHAIN_STAGES
    assert out["hop_us"] == 10.0 / hops / 1e3 and out["hand_hop_us"] == 30.0 / hops / 1e3


_PUBLISH_SECTION = """
import json, sys
from exchange.cli import bench, bench_publish
section = bench_publish.measure(bench.Config(True), bench._peers())
print(json.dumps(section))
"""


@pytest.mark.slow
@pytest.mark.once_per_ci  # runs both paths itself, in child processes
@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_publish_section_quick(pure):
    """Section publish (tensor sets to three reader processes), --quick, alone: every
    key a positive number, the readers' registries empty at the end, the set's memory
    found in the four processes. No timing is checked."""
    from exchange.cli import bench_publish

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("EXCHANGE_PURE_PYTHON", None)
    if pure:
        env["EXCHANGE_PURE_PYTHON"] = "1"
    proc = subprocess.run([sys.executable, "-c", _PUBLISH_SECTION], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    section = json.loads(proc.stdout)
    assert "publish" in bench.SECTIONS
    assert set(section["keys"]) == set(bench_publish.KEYS) <= set(bench.all_keys())
    for key, value in section["keys"].items():
        assert _is_number(value) and value > 0, (key, value)
    assert set(bench_publish.TARGETS) == set(bench_publish.KEYS)
    d = section["details"]
    assert d["readers_balanced"] is True, d["reader_registries"]
    assert d["memory"]["mappings"] >= bench_publish.READERS + 1  # each reader's, and the publisher's
    assert d["aging"]["after_last"]["pss_bytes"] > 0
    assert _is_number(d["shm_ms"]) and d["shm_ms"] > 0  # the standard library's way, beside them
    assert bench_publish.format(section)  # the table's lines are made from it
