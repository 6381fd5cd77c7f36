"""docs/benchmarks.md's generated blocks and benchmarks/results/summaries/ hold exactly what the
committed raw JSON renders to (benchmarks/summaries.py), so published numbers cannot drift from
their measurements, and every table says when, at which commit and on which host it was measured
(or that the raw file does not record it)."""

from __future__ import annotations

import re

import pytest
import summaries
import summary_tables as st

BLOCKS = summaries.blocks()
_BEGIN = re.compile(r"<!--\s*(?:([\w.-]+):begin\b|BEGIN GENERATED:\s*([\w.-]+))[^>]*-->")


@pytest.fixture(scope="module")
def generated():
    return summaries.generate()


def _between(doc: str, block: summaries.Block) -> str:
    begin, end = block.begin_end()
    assert doc.count(begin) == 1 and doc.count(end) == 1, f"{block.name}: one begin and one end marker"
    return doc.split(begin, 1)[1].split(end, 1)[0]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_each_docs_block_is_what_its_raw_json_renders_to(block):
    doc = summaries.DOCS.read_text()
    assert _between(doc, block) == "\n" + block.text() + "\n", (
        f"{block.name} differs from {', '.join(block.raw)}: run `.venv/bin/python benchmarks/summaries.py`")


def test_the_docs_page_and_the_summaries_are_up_to_date(generated):
    doc, files = generated
    assert summaries.DOCS.read_text() == doc
    for path, text in files.items():
        assert path.exists() and path.read_text() == text, f"{path.name}: run benchmarks/summaries.py"
    stale = {p for p in summaries.SUMMARIES.glob("*.md")} - set(files)
    assert not stale, f"summaries no block writes: {sorted(p.name for p in stale)}"
    assert summaries.main(["--check"]) == 0


def test_every_generated_block_of_the_page_has_a_generator():
    doc = summaries.DOCS.read_text()
    names = [m.group(1) or m.group(2) for m in _BEGIN.finditer(doc)]
    assert sorted(names) == sorted(b.name for b in BLOCKS)
    assert len({b.name for b in BLOCKS}) == len(BLOCKS)


def test_every_raw_file_a_block_reads_exists():
    for block in BLOCKS:
        for path in block.raw:
            assert (summaries.REPO / path).is_file(), path


def _provenance_gaps(text: str) -> list[str]:
    """What of date, commit and host a table neither states nor names as not recorded."""
    head = text.split("\n\n", 1)[0]
    missing = " ".join(re.findall(r"([\w ,]+) not recorded", head)).lower()
    gaps = []
    if not re.search(r"20\d\d-\d\d-\d\d", head) and "date" not in missing:
        gaps.append("date")
    if not re.search(r"\b[0-9a-f]{7}\b", head) and "commit" not in missing:
        gaps.append("commit")
    if not re.search(r"AMD|Intel|x86_64|arm64", head) and "host" not in missing:
        gaps.append("host")
    return gaps


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_each_table_says_when_where_and_at_which_commit(block):
    assert not _provenance_gaps(block.text()), block.name


def test_a_table_names_what_its_raw_file_lacks():
    assert _provenance_gaps("Run 2026-01-02 03:04 UTC (vllm-metal at `abc1234`) on AMD EPYC.\n\n|x|") == []
    assert _provenance_gaps("Run on a machine.\n\n|x|") == ["date", "commit", "host"]
    text = st.provenance("r.json", "2026-01-02", None, "Intel Xeon")
    assert text == "Raw: `r.json`. Date 2026-01-02; host Intel Xeon; commit not recorded."
    assert st.provenance(["a.json", "b.json"]) == "Raw: `a.json`, `b.json`. Date, commit and host not recorded."
    assert _provenance_gaps(text + "\n\n|x|") == []


def test_host_classes():
    assert summaries.host_class("avx512", "AMD EPYC") == "avx512-amd"
    assert summaries.host_class("avx2 builds on an avx512 host", "Intel(R) Xeon(R) Processor") == "avx2-intel"
    assert summaries.host_class(None, "Intel(R) Xeon(R) Processor") == "intel"
    assert summaries.host_class(None, None) == "host-not-recorded"
    classes = {b.name: b.host_class() for b in BLOCKS}
    assert classes["serving-results"] != classes["serving-results-avx2"]  # one summary per ISA


def test_replacing_a_block_touches_only_it():
    block = next(b for b in BLOCKS if b.name == "pipeline")
    begin, end = block.begin_end()
    doc = f"# T\n\nbefore\n{begin}\nold\n{end}\nafter\n"
    assert summaries.replace_block(doc, block, "new") == f"# T\n\nbefore\n{begin}\nnew\n{end}\nafter\n"
    with pytest.raises(ValueError, match="no pipeline block"):
        summaries.replace_block("# T\n", block, "new")


def test_tiles_take_each_case_at_its_fastest_rows_per_tile():
    data = {"variant": "avx2", "tiles": [
        {"head_dim": 64, "case": "decode b1", "rows_per_tile": 0, "ms": 0.25},
        {"head_dim": 64, "case": "prefill 1024", "rows_per_tile": 64, "ms": 9.0},
        {"head_dim": 64, "case": "prefill 1024", "rows_per_tile": 128, "ms": 8.5}]}
    text = st.tiles([("t.json", data)], "What.")
    assert "| 64 | decode b1 | 0.25 |" in text and "| 64 | prefill 1024 | 8.5 (128) |" in text
    pivot = st.tiles_by_head_dim(data, "t.json", ["decode b1", "prefill 1024", "verify b1 x 2"], "What.")
    assert "| 64 | 0.25 | 8.5 (128) | - |" in pivot
