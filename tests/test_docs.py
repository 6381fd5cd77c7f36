"""The README and docs/ describe what is true now: no run logs (timestamps,
dates of runs, issue numbers) outside generated blocks, and no links to
pages or anchors that do not exist.

A generated block is written by a script from raw results and carries the
date, commit and host of its measurement; it starts with
`<!-- NAME:begin ... -->` (or `<!-- BEGIN GENERATED: NAME -->`) and ends with
`<!-- NAME:end -->` (or `<!-- END GENERATED: NAME -->`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_BEGIN = re.compile(r"<!--\s*(?:([\w.-]+):begin\b|BEGIN GENERATED:\s*([\w.-]+))[^>]*-->")
_END = re.compile(r"<!--\s*(?:([\w.-]+):end\b|END GENERATED:\s*([\w.-]+))[^>]*-->")

# What a run log leaves behind: a time of day in UTC, a date, an issue number.
RUN_LOG = {
    "a UTC timestamp": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*UTC\b|\bUTC\b"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an issue number": re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w/&#])#\d{1,4}\b(?![\w-])"),
}


def prose_lines(text: str, name: str = "") -> list[tuple[int, str]]:
    """(line number, line) outside generated blocks and fenced code."""
    out, block, fenced = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        begin, end = _BEGIN.search(line), _END.search(line)
        if block is None and begin:
            block = begin.group(1) or begin.group(2)
            continue
        if block is not None:
            if end and (end.group(1) or end.group(2)) == block:
                block = None
            continue
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    assert block is None, f"{name}: generated block {block!r} never ends"
    return out


def run_log_findings(text: str, name: str = "") -> list[str]:
    found = []
    for number, line in prose_lines(text, name):
        for what, pattern in RUN_LOG.items():
            if pattern.search(line):
                found.append(f"{name}:{number}: {what}: {line.strip()[:120]}")
    return found


def test_the_check_finds_run_logs_and_skips_generated_blocks():
    text = ("Measured at 18:49 UTC.\nOn 2026-11-28 it took 3 min.\nSee issue 31.\nAs in #12.\n"
            "<!-- serving:begin (generated) -->\n| 2026-11-28 20:02 UTC | x |\n<!-- serving:end -->\n"
            "<!-- BEGIN GENERATED: pooling -->\nissue 7\n<!-- END GENERATED: pooling -->\n"
            "```\n# 2026-01-01 in a code block\n```\n"
            "Plain prose about `#include` and [a link](usage.md#speculative-decoding) and C#.\n")
    found = run_log_findings(text)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "4"], found
    with pytest.raises(AssertionError, match="never ends"):
        prose_lines("<!-- x:begin -->\nopen", "doc.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_hold_no_run_log(doc: Path):
    found = run_log_findings(doc.read_text(), doc.relative_to(ROOT).as_posix())
    assert not found, "run-log material belongs in benchmarks/results/ and git history:\n" + "\n".join(found)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings."""
    anchors = set()
    for _, line in prose_lines(text):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_to_pages_and_anchors_exist(doc: Path):
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        if not page.exists():
            broken.append(target)
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page.read_text()):
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"
