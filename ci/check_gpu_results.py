"""Judge a GPU test run from pytest's JUnit XML, so that skipped GPU tests cannot look green.

    python ci/check_gpu_results.py JUNIT_XML [--max-skipped N] [--no-table]

Prints the skip reasons, then a compact table (test / outcome / seconds) and the totals
last. Exits 1 when any test failed or errored, when no test passed (none ran, or all
were skipped: no usable GPU), when more than N were skipped (``--max-skipped``; no
limit by default), or when the XML is missing or unreadable; 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read_cases(path: Path) -> list[dict]:
    """One dict per test case: name, outcome (passed / failed / error / skipped), seconds, message."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        classname = case.get("classname", "")
        module = classname.rsplit(".", 1)[-1] if classname else ""
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
        cases.append({"name": name, "outcome": outcome, "seconds": seconds, "message": message})
    return cases


def render(cases: list[dict], width: int = 72) -> str:
    lines = []
    skips = Counter(c["message"] for c in cases if c["outcome"] == "skipped")
    if skips:
        lines.append("skip reasons:")
        for reason, n in skips.most_common():
            lines.append(f"  {n:3d} x {reason[:200]}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--max-skipped", type=int, default=None, help="fail when more tests than this were skipped")
    parser.add_argument("--no-table", action="store_true", help="print only the skip reasons, failures and totals")
    args = parser.parse_args(argv)
    try:
        cases = read_cases(args.junit_xml)
    except (OSError, ET.ParseError) as exc:
        print(f"gpu results: cannot read {args.junit_xml}: {exc} (did pytest run to the end?)")
        return 1
    if not args.no_table:
        print(render(cases))
    count = totals(cases)
    seconds = sum(c["seconds"] for c in cases)
    problems = []
    if count["failed"] or count["error"]:
        problems.append(f"{count['failed']} failed, {count['error']} errors")
    if not count["passed"]:
        problems.append("no GPU test passed (none ran, or all were skipped: is a GPU usable here?)")
    if args.max_skipped is not None and count["skipped"] > args.max_skipped:
        problems.append(f"{count['skipped']} skipped, more than the {args.max_skipped} allowed")
    print(f"\ntotals: {count['passed']} passed, {count['failed']} failed, {count['error']} errors, "
          f"{count['skipped']} skipped, {len(cases)} tests in {seconds:.1f} s")
    if problems:
        print("GPU CHECK FAILED: " + "; ".join(problems))
        return 1
    print("GPU CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
