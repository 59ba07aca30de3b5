"""Judge a GPU test run from pytest's JUnit XML, so that skipped GPU tests cannot look green.

    python ci/check_gpu_results.py JUNIT_XML [JUNIT_XML ...] [--max-skipped N] [--no-table]
                                   [--demo DEMO_JSON] [--bench BENCH_JSON] [--log PYTEST_LOG]

Prints the skip reasons, the failures, one table with a row per GPU test file (passed /
failed / skipped, one column group per JUnit file: the compiled and the pure-Python
path), the demo's accuracy and shared hops and the bench's GPU figures when their JSON
reports are given, and the totals last.

Exits 1 when any test failed or errored, when no test passed (none ran, or all were
skipped: no usable GPU), when a test was skipped for a reason that is not one of the
known ones (KNOWN_SKIPS: what the GPU machine is known to lack), when more than N were
skipped (``--max-skipped``), or when a JUnit file is missing or unreadable (pytest did
not finish: the last test the log shows as started is named); 0 otherwise.
"""

from __future__ import annotations

import argparse
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
]


def read_cases(path: Path) -> list[dict]:
    """One dict per test case: name, file, outcome (passed / failed / error / skipped),
    seconds, message."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        classname = case.get("classname", "")
        module = classname.rsplit(".", 1)[-1] if classname else ""
        if module and not module.startswith("test_") and "." in classname:  # a test class: its module before it
            module = classname.split(".")[-2]
        name = f"{module}::{case.get('name', '?')}" if module else case.get("name", "?")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or child.text or "").strip()
                break
        try:
            seconds = float(case.get("time", "0") or 0)
        except ValueError:
            seconds = 0.0
        cases.append({"name": name, "file": f"{module}.py" if module else "?", "outcome": outcome,
                      "seconds": seconds, "message": message})
    return cases


def known_skip(message: str) -> str | None:
    """What the machine lacks, when ``message`` is a known skip reason; else None."""
    for pattern, lacks in KNOWN_SKIPS:
        if re.search(pattern, message):
            return lacks
    return None


def render(cases: list[dict], width: int = 72) -> str:
    """Skip reasons and failures of one run, then a table of every test."""
    lines = []
    skips = Counter(c["message"] for c in cases if c["outcome"] == "skipped")
    if skips:
        lines.append("skip reasons:")
        for reason, n in skips.most_common():
            tag = "known" if known_skip(reason) else "UNKNOWN"
            lines.append(f"  {n:3d} x [{tag}] {reason[:200]}")
        lines.append("")
    failures = [c for c in cases if c["outcome"] in ("failed", "error")]
    for c in failures:
        lines.append(f"{c['outcome'].upper()}: {c['name']}: {c['message'].splitlines()[0][:200] if c['message'] else ''}")
    if failures:
        lines.append("")
    name_width = min(width, max([len(c["name"]) for c in cases] + [4]))
    lines.append(f"{'test':<{name_width}}  {'outcome':<7}  {'seconds':>7}")
    lines.append(f"{'-' * name_width}  {'-' * 7}  {'-' * 7}")
    for c in cases:
        name = c["name"] if len(c["name"]) <= name_width else "..." + c["name"][-(name_width - 3):]
        lines.append(f"{name:<{name_width}}  {c['outcome']:<7}  {c['seconds']:7.2f}")
    return "\n".join(lines)


def totals(cases: list[dict]) -> Counter:
    return Counter(c["outcome"] for c in cases)


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


def demo_summary(path: Path) -> tuple[list[str], list[str]]:
    """The demo's lines for the table, and its problems (a failed check)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return [f"demo: no report ({path.name} missing: the demo did not run or did not finish)"], []
    if not text.startswith("{"):
        return [f"demo: not run: {text[:300]}"], []
    report = json.loads(text)
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


def bench_summary(path: Path) -> list[str]:
    """The bench's GPU figures, one line each."""
    try:
        text = path.read_text().strip()
    except OSError:
        return [f"bench: no report ({path.name} missing: the bench did not run or did not finish)"]
    if not text.startswith("{"):
        return [f"bench: not run: {text[:300]}"]
    r = json.loads(text)
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
    for key, value in r.items():  # further sections' keys (release at scale, ...)
        if key not in ("export_hop_ratio", "import_hop_ratio", "size_flatness", "thread_scaling",
                       "chain_hop_ratio", "details") and isinstance(value, (int, float)):
            lines.append(f"  {key}: {value:.3g}")
    return lines


def last_started(log: Path) -> str | None:
    """The last test ``pytest -v`` shows as started without an outcome, from its log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    started = re.findall(r"^(tests/gpu/\S+::\S+)", text, flags=re.M)
    return started[-1] if started else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path, nargs="+", help="JUnit files; the first is the main run")
    parser.add_argument("--labels", default="", help="comma-separated column labels, one per JUnit file")
    parser.add_argument("--max-skipped", type=int, default=None, help="fail when more tests than this were skipped")
    parser.add_argument("--no-table", action="store_true", help="print only the skip reasons, failures and totals")
    parser.add_argument("--demo", type=Path, default=None, help="the demo's --report json output")
    parser.add_argument("--bench", type=Path, default=None, help="the bench's --json output")
    parser.add_argument("--log", type=Path, action="append", default=[], help="pytest -v logs, one per JUnit file")
    args = parser.parse_args(argv)
    labels = [s for s in args.labels.split(",") if s] or [p.stem for p in args.junit_xml]
    problems: list[str] = []
    runs: dict[str, list[dict]] = {}
    for i, (label, path) in enumerate(zip(labels, args.junit_xml)):
        try:
            cases = read_cases(path)
        except (OSError, ET.ParseError) as exc:
            where = last_started(args.log[i]) if i < len(args.log) else None
            problems.append(f"{label}: cannot read {path.name}: {type(exc).__name__} (pytest did not finish"
                            + (f"; the last test started was {where}" if where else "") + ")")
            continue
        runs[label] = cases
        if not args.no_table and i == 0:
            print(render(cases))
            print()
        elif not args.no_table:
            print(f"{label}: " + render(cases).split("\ntest ")[0])
        count = totals(cases)
        if count["failed"] or count["error"]:
            problems.append(f"{label}: {count['failed']} failed, {count['error']} errors")
        if not count["passed"]:
            problems.append(f"{label}: no GPU test passed (none ran, or all were skipped: is a GPU usable here?)")
        unknown = sorted({c["message"][:160] for c in cases if c["outcome"] == "skipped" and not known_skip(c["message"])})
        if unknown:
            problems.append(f"{label}: skipped for reasons not known to this machine: {unknown}")
        if args.max_skipped is not None and count["skipped"] > args.max_skipped:
            problems.append(f"{label}: {count['skipped']} skipped, more than the {args.max_skipped} allowed")
    summary: list[str] = []
    if runs:
        summary.append(per_file(runs))
    if args.demo is not None:
        lines, demo_problems = demo_summary(args.demo)
        summary += lines
        problems += demo_problems
    if args.bench is not None:
        summary += bench_summary(args.bench)
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
