"""benchmarks/bench_pipeline.py's pure parts: the compute-balanced split, the
fit and the tables (the run itself starts servers: benchmarks/, not CI)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from bench_pipeline import balanced_split, fit, table  # noqa: E402


def test_balanced_split_counts_the_head_on_the_last_stage():
    assert balanced_split(2) == [10, 6] and balanced_split(3) == [7, 6, 3] and balanced_split(4) == [5, 5, 5, 1]
    for n in (2, 3, 4, 8):
        split = balanced_split(n)
        assert sum(split) == 16 and min(split) >= 1


def test_fit_recovers_compute_and_hops():
    rows = [dict(nodes=3, delay_ms=d, c1=dict(ms_per_token=80 + 2 * d, tok_s=1000 / (80 + 2 * d)),
                 cn=dict(tok_s=20.0)) for d in (0, 1, 5, 10, 20)]
    f = fit(rows)[3]
    assert abs(f["compute_ms"] - 80) < 1e-6 and abs(f["hops_per_token"] - 2) < 1e-6 and f["expected_hops"] == 2
    text = table(rows, {3: f})
    assert "| 3 | 5 ms | 11.1 | 20.0 | 1.80x |" in text and "| 3 | 80.0 | 2.00 | 2 |" in text
