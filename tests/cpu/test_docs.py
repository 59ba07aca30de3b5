"""The documents' cross-references resolve, for a reader who has only the repository:

* every path named in README.md, docs/*.md and the sources' comments and docstrings
  (``docs/processes.md``, ``exchange/cli/demo.py``, ``ci/cpu.sh``...) exists;
* every section named after a document (``docs/design.md, "Capsules"``) is a heading
  of that document;
* nothing points to documents outside the repository (the project's DESIGN, its
  reference notes on DLPack) or, in README.md and docs/, to work by issue number;
* docs/cuda.md's error example is what this machine prints without the CUDA extra;
* the compiled part has one name, "the compiled core".

Run against the checkout's files (in CI's wheel pass, EXCHANGE_SOURCE_ROOT).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

import exchange as tx

#: The checkout's text: the same in both passes.
pytestmark = pytest.mark.once_per_ci

SOURCE = Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or Path(__file__).resolve().parents[2])
DOCS = ["README.md", *sorted(str(p.relative_to(SOURCE)) for p in (SOURCE / "docs").glob("*.md"))]
SOURCES = sorted(str(p.relative_to(SOURCE)) for folder in ("exchange", "devices", "tests", "ci", ".ci")
                 for p in (SOURCE / folder).rglob("*")
                 if p.is_file() and (p.suffix in (".py", ".c", ".h", ".sh", ".yml") or p.name == "run")) \
    + ["Makefile", "setup.py", "pyproject.toml", "MANIFEST.in"]

#: A path in the repository: under one of its folders, or one of its top-level files;
#: ``*`` and ``<name>`` stand for any part of a name.
PATH = re.compile(r"(?<![\w./-])((?:docs|exchange|devices|tests|ci|\.ci)/(?:[\w./*-]|<\w+>)*(?:[\w*/]|<\w+>)"
                  r"|README\.md|MANIFEST\.in)")
#: A section of a document, as ``docs/design.md, "Capsules"`` (or single quotes; across a line break).
SECTION = re.compile(r"((?:docs/[\w-]+|README)\.md),\s+(?:#\s*)?[\"']([^\"'\n]+)[\"']")
#: Documents that are not in the repository.
OUTSIDE = re.compile(r"\bDESIGN\b|\b(?:dlpack|peers|style)\.md\b|reference/")
#: Work named by its issue number, which means nothing to a reader of the docs.
ISSUE = re.compile(r"\bissues? \d+")

#: Files that still cite documents outside the repository, owned by other work in flight:
#: the test fails once one no longer does, so that its entry goes.
NOT_YET = {
    "exchange/_core/_pure/capsules.py": "the pure path's owners (it cites dlpack.md for the structs' layout)",
    "exchange/native/capsule.c": "the compiled core's owners",
}
#: docs/performance.md's history sections name the work that changed each figure.
ISSUES_ALLOWED = {"docs/performance.md"}


def _text(name: str) -> str:
    return (SOURCE / name).read_text(errors="replace")


def _headings(name: str) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in _text(name).splitlines() if line.startswith("#")]


def _exists(ref: str) -> bool:
    if "_native" in ref:
        return True  # built, not in the repository
    ref = re.sub(r"<\w+>", "*", ref.rstrip("/."))
    if ref.startswith("exchange/devices"):  # the backends' installed name: devices/ in the repository
        ref = "devices" + ref[len("exchange/devices"):]
    if "*" in ref:
        return any(SOURCE.glob(ref))
    return (SOURCE / ref).exists()


def test_the_files_are_found():
    assert "docs/design.md" in DOCS and "exchange/cli/demo.py" in SOURCES and "ci/cpu.sh" in SOURCES
    assert len(SOURCES) > 80


def test_every_path_named_exists():
    broken = [f"{name}: {ref}" for name in DOCS + SOURCES for ref in PATH.findall(_text(name)) if not _exists(ref)]
    assert not broken, broken


def test_every_section_named_is_a_heading_of_its_document():
    seen, broken = 0, []
    for name in DOCS + SOURCES:
        for doc, heading in SECTION.findall(_text(name)):
            seen += 1
            if not (SOURCE / doc).is_file():
                broken.append(f"{name}: {doc} does not exist")
            elif not any(h.startswith(heading.lower()) for h in _headings(doc)):
                broken.append(f"{name}: {doc} has no section {heading!r}")
    assert not broken, broken
    assert seen >= 8  # the check would pass vacuously if the pattern missed them


def test_nothing_points_outside_the_repository():
    broken = {name: sorted(set(OUTSIDE.findall(_text(name)))) for name in DOCS + SOURCES
              if name != "tests/cpu/test_docs.py"}
    still = {name for name in NOT_YET if broken.get(name)}
    broken = {name: refs for name, refs in broken.items() if refs and name not in NOT_YET}
    assert not broken, broken
    assert still == set(NOT_YET), f"no longer needs an entry in NOT_YET: {sorted(set(NOT_YET) - still)}"


def test_the_docs_name_no_work_by_issue_number():
    broken = {name: ISSUE.findall(_text(name)) for name in DOCS if name not in ISSUES_ALLOWED}
    broken = {k: v for k, v in broken.items() if v}
    assert not broken, broken


#: Other names the compiled part (exchange/native/*.c, built as exchange._native) went by:
#: it is "the compiled core" in the docs, in doctor's and bench's output and in the sources.
OTHER_NAMES = re.compile(r"\b(?:compiled|native|C)\s+" + "helper" + r"\b|native_" + "helper")


def test_the_compiled_part_has_one_name():
    broken = {name: OTHER_NAMES.findall(_text(name)) for name in DOCS + SOURCES}
    broken = {k: v for k, v in broken.items() if v}
    assert not broken, broken


def test_the_cuda_docs_show_what_a_machine_without_the_cuda_extra_prints():
    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed here")
    with pytest.raises(tx.BackendUnavailableError) as exc:
        tx.empty((4,), device="cuda")
    shown = [line for line in _text("docs/cuda.md").splitlines() if line.startswith("BackendUnavailableError: ")]
    assert f"BackendUnavailableError: {exc.value}" in shown, shown
