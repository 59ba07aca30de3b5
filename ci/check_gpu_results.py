"""Judge a GPU check from what its steps left (ci/gpu-check.sh), so that nothing skipped,
hung or missing can look green, and print one table.

    python ci/check_gpu_results.py JUNIT_XML [JUNIT_XML ...] [--labels a,b]
        [--results JSONL ...] [--preflight JSON] [--steps TSV]
        [--native yes|no|failed|skipped] [--sanitizer JSON] [--demo JSON] [--bench JSON]
        [--budget S] [--max-skipped N] [--no-table]

Prints the versions line (from the preflight), the skip reasons and failures, a row per
test (not with ``--no-table``), the steps with their time and what did not fit, one row
per GPU test file (passed / failed / skipped, one column group per path: the compiled
and the pure-Python), the peers, the compiled core, compute-sanitizer's results, the
NVTX ranges seen, the demo's accuracy and shared hops, the bench's GPU figures, the
totals, and last the verdict.

A step's row in ``--steps`` (ci/gpu_check.py's steps.tsv) says how it went: ``ok``,
``status N``, ``timed out`` (stopped at its own full limit), ``cut short`` (stopped at a
limit the budget had shortened) or ``did not fit`` (not started: less than it needs was
left). A step that did not fit or was cut short fails nothing (the table says so); a
report missing for any other reason is never read as a pass.

A JUnit file that is missing or unreadable (pytest did not finish: a hang, a crash)
fails its path; its ``--results`` file (tests/gpu/conftest.py's JSON lines, written as
each test starts and ends) then still gives the outcomes so far and names the test that
was running. A module skipped as a whole is judged by its real reason (JUnit records
only ``message="collection skipped"``, the reason in its text).

Exits 1 when any test failed or errored, when a path passed no test (none ran, or all
were skipped: no usable GPU), when a test was skipped for a reason the machine is not
known to cause (KNOWN_SKIPS; ``peer unusable: <peer>`` only for a peer the preflight
found unusable), when more than N were skipped (``--max-skipped``), when a path did not
finish, when the compiled core was expected and did not load (``--native failed``),
when the sanitizer ran and found errors or missed its plant, or when the demo ran and
failed a check; 0 otherwise. (The GPU suite is the exception to "did not fit": a path
whose pytest did not finish fails, whatever the reason.)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

#: Skip reasons the GPU machine is known to cause (regex, what it lacks). A skip for any
#: other reason fails the check: it means a GPU test did not run where it should have.
KNOWN_SKIPS: list[tuple[str, str]] = [
    (r"needs \d+ CUDA devices", "a second GPU"),
    (r"no CUDAExecutionProvider", "onnxruntime-gpu (the machine has the CPU build)"),
    (r"apache-tvm-ffi is not installed", "tvm-ffi"),
    (r"the demo needs (sklearn|onnx|onnxruntime)", "the demo's packages (scikit-learn, onnx)"),
    (r"does not support \S+( \S+)? over DLPack", "a peer's support for a dtype or memory kind"),
    (r"has no float8", "float8 in that PyTorch"),
    (r"cuda\.core \S+ has no ", "a cuda.core feature of later releases (0.4.x lacks it)"),
    (r"the nvtx Python package is not installed", "the nvtx Python package (NVTX ranges not checked)"),
]
#: A peer's tests skip with this reason (tests/gpu/conftest.py); known only where the
#: preflight found that peer unusable too.
PEER_SKIP = re.compile(r"^peer unusable: (\w+): ")
PEERS = ("cupy", "torch", "jax", "demo")
#: Step statuses that fail nothing: the step was not started, or was stopped at a limit
#: the budget had shortened (ci/gpu_check.py).
DID_NOT_FIT = ("did not fit", "cut short", "not run")


# -- reading -------------------------------------------------------------------------------
def _module_and_file(classname: str, name: str) -> tuple[str, str]:
    module = classname.rsplit(".", 1)[-1] if classname else ""
    if module and not module.startswith("test_") and "." in classname:  # a test class: its module before it
        module = classname.split(".")[-2]
    return module, f"{module}.py" if module else "?"


def read_cases(path: Path) -> list[dict]:
    """One dict per test case: name, file, outcome (passed / failed / error / skipped),
    seconds, message."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "?")
        module, file = _module_and_file(classname, name)
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or child.text or "").strip()
                if tag == "skipped" and message == "collection skipped":
                    # a module skipped as a whole: the reason is in the text, ('path', line, 'Skipped: why')
                    message, module = _collection_skip(child.text or "", name)
                    file = f"{module}.py"
                break
        try:
            seconds = float(case.get("time", "0") or 0)
        except ValueError:
            seconds = 0.0
        full = f"{module}::{name}" if module and classname else (module or name)
        cases.append({"name": full, "file": file, "outcome": outcome, "seconds": seconds, "message": message})
    return cases


def _collection_skip(text: str, name: str) -> tuple[str, str]:
    """(reason, module) of a module-level skip's JUnit text."""
    module = name.rsplit(".", 1)[-1]
    try:
        where, _line, reason = ast.literal_eval(text.strip())
        module = Path(str(where)).stem
    except (ValueError, SyntaxError, TypeError):
        reason = text.strip()
    return str(reason).removeprefix("Skipped: ").strip(), module


def read_results(path: Path) -> tuple[list[dict], str | None]:
    """The cases of a results file (tests/gpu/conftest.py's JSON lines), and the test
    that had started without an outcome (the one running when the run ended), if any."""
    outcomes: dict[str, dict] = {}
    started: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the end of the process
        if entry.get("event") == "note":  # a test's findings for the table (nvtx_summary)
            continue
        nodeid = entry.get("nodeid", "?")
        if entry.get("event") == "start":
            started.append(nodeid)
            continue
        outcome = entry.get("outcome", "failed")
        if entry.get("event") in ("setup", "teardown") and outcome == "failed":
            outcome = "error"
        previous = outcomes.get(nodeid)
        if previous is None or previous["outcome"] == "passed":  # a teardown error outranks a pass
            module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
            test = nodeid.split("::", 1)[1] if "::" in nodeid else ""
            outcomes[nodeid] = {"name": f"{module}::{test}" if test else module, "file": f"{module}.py",
                                "outcome": outcome, "seconds": float(entry.get("seconds", 0.0)),
                                "message": str(entry.get("message", ""))}
    running = next((n for n in reversed(started) if n not in outcomes), None)
    if running is not None:
        module = running.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        outcomes[running] = {"name": f"{module}::{running.split('::', 1)[-1]}", "file": f"{module}.py",
                             "outcome": "failed", "seconds": 0.0,
                             "message": "started and never finished: the run ended in it (a hang or a crash)"}
    return list(outcomes.values()), running


def _json(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(path: Path | None) -> list[dict]:
    if path is None:
        return []
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return []
    rows = []
    for line in lines:
        parts = (line.split("\t") + ["", "", "", ""])[:4]
        rows.append({"step": parts[0], "status": parts[1], "seconds": parts[2], "note": parts[3]})
    return rows


# -- judging ---------------------------------------------------------------------------------
def unusable_peers(preflight: dict | None) -> dict[str, str]:
    """Peers the preflight found unusable (or was trying when it was stopped): name -> why."""
    if not preflight:
        return {}
    out = {name: check["detail"] for name, check in preflight.get("checks", {}).items()
           if name in PEERS and not check.get("ok")}
    if preflight.get("running") in PEERS:
        out[preflight["running"]] = "the preflight was stopped while trying it (a hang)"
    return out


def known_skip(message: str, unusable: dict[str, str] | None = None) -> str | None:
    """What the machine lacks, when ``message`` is a known skip reason; else None."""
    peer = PEER_SKIP.match(message)
    if peer is not None:
        name = peer.group(1)
        return f"{name}, unusable here (preflight: {unusable[name][:80]})" if unusable and name in unusable else None
    for pattern, lacks in KNOWN_SKIPS:
        if re.search(pattern, message):
            return lacks
    return None


def totals(cases: list[dict]) -> Counter:
    return Counter(c["outcome"] for c in cases)


def judge(label: str, cases: list[dict], unusable: dict[str, str], max_skipped: int | None) -> list[str]:
    problems = []
    count = totals(cases)
    if count["failed"] or count["error"]:
        problems.append(f"{label}: {count['failed']} failed, {count['error']} errors")
    if not count["passed"]:
        problems.append(f"{label}: no GPU test passed (none ran, or all were skipped: is a GPU usable here?)")
    unknown = sorted({c["message"][:160] for c in cases if c["outcome"] == "skipped"
                      and not known_skip(c["message"], unusable)})
    if unknown:
        problems.append(f"{label}: skipped for reasons not known to this machine: {unknown}")
    if max_skipped is not None and count["skipped"] > max_skipped:
        problems.append(f"{label}: {count['skipped']} skipped, more than the {max_skipped} allowed")
    return problems


# -- rendering -------------------------------------------------------------------------------
def render(cases: list[dict], unusable: dict[str, str] | None = None, width: int = 72, rows: bool = True) -> str:
    """Skip reasons and failures of one run, then (``rows``) a table of every test."""
    lines = []
    skips = Counter(c["message"] for c in cases if c["outcome"] == "skipped")
    if skips:
        lines.append("skip reasons:")
        for reason, n in skips.most_common():
            tag = "known" if known_skip(reason, unusable) else "UNKNOWN"
            lines.append(f"  {n:3d} x [{tag}] {reason[:200]}")
        lines.append("")
    failures = [c for c in cases if c["outcome"] in ("failed", "error")]
    for c in failures:
        lines.append(f"{c['outcome'].upper()}: {c['name']}: {c['message'].splitlines()[0][:200] if c['message'] else ''}")
    if failures:
        lines.append("")
    if not rows:
        return "\n".join(lines).rstrip("\n")
    name_width = min(width, max([len(c["name"]) for c in cases] + [4]))
    lines.append(f"{'test':<{name_width}}  {'outcome':<7}  {'seconds':>7}")
    lines.append(f"{'-' * name_width}  {'-' * 7}  {'-' * 7}")
    for c in cases:
        name = c["name"] if len(c["name"]) <= name_width else "..." + c["name"][-(name_width - 3):]
        lines.append(f"{name:<{name_width}}  {c['outcome']:<7}  {c['seconds']:7.2f}")
    return "\n".join(lines)


def per_file(runs: dict[str, list[dict]]) -> str:
    """One row per test file, passed / failed / skipped for each run (column group)."""
    files = sorted({c["file"] for cases in runs.values() for c in cases})
    width = max([len(f) for f in files] + [10])
    head = f"{'GPU test file':<{width}}" + "".join(f"  {label + ' p/f/s':>18}" for label in runs)
    lines = [head, "-" * len(head)]
    for f in files + ["(all)"]:
        row = f"{f:<{width}}"
        for cases in runs.values():
            mine = [c for c in cases if f == "(all)" or c["file"] == f]
            n = totals(mine)
            row += f"  {n['passed']:>6}/{n['failed'] + n['error']}/{n['skipped']:<6}".rjust(20)
        lines.append(row)
    return "\n".join(lines)


def steps_summary(steps: list[dict], budget: str | None) -> list[str]:
    if not steps:
        return []
    lines = [f"steps ({'budget ' + budget + ' s' if budget else 'no budget given'}):"]
    for s in steps:
        lines.append(f"  {s['step']:<18} {s['status']:<11} {s['seconds']:>4} s  {s['note']}")
    missed = [s["step"] for s in steps if s["status"] in DID_NOT_FIT]
    lines.append("  did not fit (fails nothing): " + (", ".join(missed) if missed else "nothing"))
    stopped = [s["step"] for s in steps if s["status"] == "timed out"]
    if stopped:
        lines.append("  ran past their own limit: " + ", ".join(stopped))
    return lines


def _row(steps: list[dict] | None, name: str) -> dict | None:
    return next((s for s in steps or [] if s["step"] == name), None)


def peers_summary(preflight: dict | None) -> list[str]:
    if not preflight:
        return ["peers: no preflight results"]
    checks = preflight.get("checks", {})
    parts = []
    for name in PEERS:
        check = checks.get(name)
        if check is None:
            parts.append(f"{name} {'(stopped while trying it)' if preflight.get('running') == name else 'not tried'}")
        elif check.get("ok"):
            parts.append(f"{name} ok")
        else:
            parts.append(f"{name} UNUSABLE, its tests skip ({check['detail'][:120]})")
    return ["peers: " + "; ".join(parts)]


def native_summary(native: str | None) -> tuple[list[str], list[str]]:
    if native is None:
        return [], []
    if native == "yes":
        return ["compiled core: built and loaded; the suite ran on both paths"], []
    if native == "no":
        return ["compiled core: not expected here (no C compiler or no Python.h): the pure-Python path only"], []
    if native == "skipped":
        return ["compiled core: not built (the build did not fit the budget): the pure-Python path only"], []
    return ["compiled core: EXPECTED AND NOT LOADED (see the build step): the pure-Python path only"], [
        "the compiled core was expected (a compiler and Python.h are here) and did not load"]


def sanitizer_summary(path: Path | None, steps: list[dict] | None = None) -> tuple[list[str], list[str]]:
    """compute-sanitizer's lines for the table, and its problems. A missing report is a
    problem unless the step did not fit; so is a step that did not finish, unless the
    budget cut it short."""
    if path is None:
        return [], []
    row = _row(steps, "sanitizer")
    cut = row is not None and row["status"] in DID_NOT_FIT
    result = _json(path)
    if result is None:
        if cut:
            return [f"compute-sanitizer: {row['status']}{': ' + row['note'] if row['note'] else ''}"], []
        how = f"{row['status']}{': ' + row['note'] if row['note'] else ''}" if row else "it did not run or finish"
        return [f"compute-sanitizer: NO REPORT ({path.name} missing: {how})"], [
            f"sanitizer: no report ({how})"]
    if result.get("status") not in ("ran", "running"):
        return [f"compute-sanitizer: not run: {result.get('reason', '?')}"], []
    lines = []
    plant, second, real = result.get("plant"), result.get("second_plant"), result.get("real")
    if plant:
        lines.append(f"compute-sanitizer memcheck ({result.get('seconds', '?')} s): planted unordered free "
                     f"{'CAUGHT' if plant.get('caught') else 'NOT CAUGHT'} ({plant.get('errors', 0)} errors"
                     + (f": {plant['first_error'][:100]}" if plant.get("first_error") else "") + ")")
        if not plant.get("caught"):
            lines.append(f"  why: {plant.get('why', '?')}")
    if second:
        caught = "CAUGHT" if second.get("caught") else "NOT CAUGHT"
        lines.append(f"  second plant, a read ordered after the free: {caught} ({second.get('errors', 0)} errors)"
                     + (": the check bites on stream-ordered use after free" if second.get("caught") else ""))
    if real is not None and not real.get("running"):
        tests = real.get("pytest") or {}
        lines.append(f"  real code: {real['errors']} errors (target 0) in {real['processes']} processes, "
                     f"{real['leaked_allocations']} leaked allocations ({real['leaked_bytes']} bytes); tests "
                     f"{tests.get('passed', '?')} passed, {tests.get('failed', '?')} failed, "
                     f"{tests.get('skipped', '?')} skipped in {real.get('seconds', '?')} s of the "
                     f"{real.get('limit_s', '?')} s allowed"
                     + (f"; slowest {', '.join(f'{n} {t:g} s' for n, t in real['slowest'])}" if real.get("slowest")
                        else ""))
    unfinished = result.get("unfinished", [])
    if unfinished:
        lines.append(f"  did not finish{' (cut short by the budget: fails nothing)' if cut else ''}: "
                     + "; ".join(unfinished))
    problems = [f"sanitizer: {p}" for p in result.get("problems", [])]
    if not cut:
        problems += [f"sanitizer: {p}" for p in unfinished]
    return lines, problems


def nvtx_summary(results: list[Path]) -> list[str]:
    """The NVTX line: which ranges tests/gpu/test_gpu_nvtx.py saw (its note in the
    results files), or why none were checked."""
    notes = []
    for path in results:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "note" and entry.get("kind") == "nvtx":
                notes.append(entry)
    if not notes:
        return ["NVTX: not checked (test_gpu_nvtx.py left no note)"]
    note = next((n for n in notes if n.get("ranges")), notes[0])
    packages = note.get("packages") or {}
    have = ", ".join(f"{k} {v}" for k, v in packages.items() if v) or "neither nvtx nor nvidia-nvtx installed"
    ranges = note.get("ranges")
    if not ranges:
        return [f"NVTX ({have}): no ranges checked: {note.get('why', '?')}"]
    return [f"NVTX ({have}), EXCHANGE_NVTX=1: stage ranges {', '.join(ranges['stages']) or 'none'}; "
            f"{ranges['releases']} release ranges (e.g. {ranges['release_example'][:60]!r}); calls {ranges['calls']}"]


def _no_report(name: str, path: Path, steps: list[dict] | None) -> tuple[str, str | None]:
    """The table's line for a step that left no report, and its problem (None when it
    was not run by design: no time left, packages missing)."""
    row = _row(steps, name)
    if row is None:
        return f"{name}: no report ({path.name} missing or empty: it did not run or did not finish)", None
    if row["status"] in DID_NOT_FIT:
        return f"{name}: {row['status']}: {row['note']}", None
    return (f"{name}: no report ({row['status']}{': ' + row['note'] if row['note'] else ''}; its reason is in "
            "gpu-check.log)", f"{name}: {row['status']}, no report")


def demo_summary(path: Path, steps: list[dict] | None = None) -> tuple[list[str], list[str]]:
    """The demo's lines for the table, and its problems (a failed check)."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    if not text:
        line, problem = _no_report("demo", path, steps)
        return [line], [problem] if problem else []
    try:
        report = json.loads(text)
    except ValueError:
        return [f"demo: its report is not JSON: {text[:200]}"], ["demo: its report is not JSON"]
    hops = report["hops"]
    shared = sum(h["shared"] for h in hops)
    by_design = [h for h in hops if not h["shared"] and h.get("reason")]
    bad = [h for h in hops if not h["shared"] and not h.get("reason")]
    lines = [f"demo: device {report['device']}, accuracy {report['accuracy']:.4f}, {shared} of {len(hops)} hops shared"
             f" ({len(by_design)} copied by design), {report['live_records_end']} records alive at the end"]
    for reason in sorted({h["reason"] for h in by_design}):
        lines.append(f"  copied by design: {reason}")
    problems = []
    if bad:
        problems.append(f"demo: {len(bad)} hops copied without a reason: {[(h['from'], h['to']) for h in bad]}")
    if report["live_records_end"]:
        problems.append(f"demo: {report['live_records_end']} records left alive")
    if report["device"] != "cuda":
        problems.append(f"demo ran on {report['device']}, not cuda: {report.get('device_note')}")
    return lines, problems


def bench_summary(path: Path, steps: list[dict] | None = None) -> tuple[list[str], list[str]]:
    """The bench's GPU figures, one line each (docs/cuda.md, "Figures on the GPU"), and
    its problems (it failed, or its report is not JSON)."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    if not text:
        line, problem = _no_report("bench", path, steps)
        return [line], [problem] if problem else []
    try:
        r = json.loads(text)
    except ValueError:
        return [f"bench: its output is not JSON: {text[:200]}"], ["bench: its output is not JSON"]
    d = r["details"]
    ex, im, ch = d["export_hop"], d["import_hop"], d["chain"]
    lines = [f"bench ({d.get('device', 'cpu')}): export hop {ex['tx_ns'] / 1e3:.2f} us, {r['export_hop_ratio']:.2f}x "
             f"{ex['peer']}" + (f", torch.from_dlpack(tx) {ex['torch_ns'] / 1e3:.2f} us" if "torch_ns" in ex else ""),
             f"  import hop {im['tx_ns'] / 1e3:.2f} us, {r['import_hop_ratio']:.2f}x {im['peer']}"
             + (f", {im['ratio_vs_torch']:.2f}x torch.from_dlpack" if "ratio_vs_torch" in im else ""),
             f"  chain ({ch.get('method')}): {r['chain_hop_ratio']:.2f}x glued by hand; size flatness "
             f"{r['size_flatness']:.2f}"]
    cuda = d.get("release", {}).get("cuda", {})
    if "skipped" in cuda:
        lines.append(f"  release on CUDA: skipped: {cuda['skipped']}")
    elif cuda.get("samples"):
        text = f"  release on CUDA: median {cuda['median_us']:.1f} us from the drop to the producer's deleter"
        after = cuda.get("after_kernel") or {}
        if after.get("samples"):
            text += (f"; {after['after_kernel_median_us']:.1f} us after a {after['busy_ms']:g} ms kernel ended"
                     f" ({'ordered' if after['ordered'] else 'NOT ORDERED'})")
        lines.append(text)
    sections = d.get("sections", {})
    scale = sections.get("release", {}).get("details", {}).get("cuda", {})
    if "skipped" in scale:
        lines.append(f"  pending releases at scale on CUDA: skipped: {scale['skipped']}")
    elif scale:
        lines.append(f"  pending releases at scale on CUDA: {scale['pending']:,} pending on a busy stream, build "
                     f"{scale['build_s']:.3f} s, drained {scale['drained']} after {scale['drain_wait_s']:.2f} s, CPU "
                     f"{scale['cpu_fraction_while_waiting']:.4f} of a core while waiting")
    hot = sections.get("cuda", {}).get("details")
    if hot is not None:
        from importlib import import_module

        try:
            lines += ["  " + line for line in import_module("exchange.cli.bench_cuda").format({"details": hot})]
        except Exception as exc:  # an older report: say so rather than fail the table
            lines.append(f"  cuda hot path: cannot show ({type(exc).__name__}: {exc})")
    for key, value in r.items():  # further sections' keys (release at scale, ...)
        if key not in ("export_hop_ratio", "import_hop_ratio", "size_flatness", "thread_scaling",
                       "chain_hop_ratio", "details") and isinstance(value, (int, float)):
            lines.append(f"  {key}: {value:.3g}")
    return lines, []


# -- the whole -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path, nargs="+", help="JUnit files, one per path; the first is the main run")
    parser.add_argument("--labels", default="", help="comma-separated column labels, one per JUnit file")
    parser.add_argument("--results", type=Path, action="append", default=[],
                        help="the results file (JSON lines) of each JUnit file, in the same order")
    parser.add_argument("--preflight", type=Path, default=None, help="ci/gpu_preflight.py's --json file")
    parser.add_argument("--steps", type=Path, default=None, help="ci/gpu-check.sh's steps.tsv")
    parser.add_argument("--native", choices=("yes", "no", "failed", "skipped"), default=None,
                        help="the compiled core: built and loaded, not expected, expected and not loaded, or "
                             "not built (its step did not fit)")
    parser.add_argument("--sanitizer", type=Path, default=None, help="ci/gpu_sanitizer.py's sanitizer.json")
    parser.add_argument("--budget", default=None, help="the check's budget in seconds (for the steps table)")
    parser.add_argument("--max-skipped", type=int, default=None, help="fail when more tests than this were skipped")
    parser.add_argument("--no-table", action="store_true", help="no row per test: the skip reasons, failures, the "
                                                                   "summary and totals")
    parser.add_argument("--demo", type=Path, default=None, help="the demo's --report json output")
    parser.add_argument("--bench", type=Path, default=None, help="the bench's --json output")
    args = parser.parse_args(argv)
    labels = [s for s in args.labels.split(",") if s] or [p.stem for p in args.junit_xml]
    preflight = _json(args.preflight)
    unusable = unusable_peers(preflight)
    steps = read_steps(args.steps)
    problems: list[str] = []
    runs: dict[str, list[dict]] = {}
    if preflight:
        print(f"versions: {preflight.get('versions', '?')}\n")
    for i, (label, path) in enumerate(zip(labels, args.junit_xml)):
        try:
            cases = read_cases(path)
        except (OSError, ET.ParseError) as exc:
            results = args.results[i] if i < len(args.results) else None
            cases, running = [], None
            if results is not None and results.is_file():
                cases, running = read_results(results)
            problems.append(f"{label}: pytest did not finish (cannot read {path.name}: {type(exc).__name__})"
                            + (f"; the test running when it ended: {running}" if running else "")
                            + (f"; {len(cases)} outcomes from {results.name}" if cases else ""))
            stacks = Path(f"{results}.stacks") if results is not None else None
            if stacks is not None and stacks.is_file() and stacks.stat().st_size:
                print(f"[{label}] the stacks when the run was ended ({stacks.name}, last lines):")
                print("\n".join(stacks.read_text(errors="replace").splitlines()[-25:]) + "\n")
            if not cases:
                continue
        runs[label] = cases
        shown = render(cases, unusable, rows=not args.no_table and i == 0)
        if shown:
            print(f"[{label}]\n{shown}\n")
        problems += judge(label, cases, unusable, args.max_skipped)
    summary: list[str] = steps_summary(steps, args.budget)
    if runs:
        summary.append(per_file(runs))
    if args.preflight is not None:
        summary += peers_summary(preflight)
    lines, more = native_summary(args.native)
    summary += lines
    problems += more
    lines, more = sanitizer_summary(args.sanitizer, steps)
    summary += lines
    problems += more
    if args.results:
        summary += nvtx_summary(args.results)
    if args.demo is not None:
        lines, more = demo_summary(args.demo, steps)
        summary += lines
        problems += more
    if args.bench is not None:
        lines, more = bench_summary(args.bench, steps)
        summary += lines
        problems += more
    print("\n".join(summary))
    for label, cases in runs.items():
        count = totals(cases)
        print(f"\n{label} totals: {count['passed']} passed, {count['failed']} failed, {count['error']} errors, "
              f"{count['skipped']} skipped, {len(cases)} tests in {sum(c['seconds'] for c in cases):.1f} s")
    if problems:
        print("GPU CHECK FAILED: " + "; ".join(problems))
        return 1
    print("GPU CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
