"""benchmarks/attention_decode.py, run as its one command on a tiny shape:
both cases (caches streamed, caches shared) reported with sane numbers, and
the KV it streams counted from the shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_decode.py"


@pytest.mark.parametrize("layout", [[], ["--head-major"]])
def test_reports_streamed_and_cached_times(tmp_path, layout):
    out = tmp_path / "attention.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--batch", "2", "--context", "40", "--layers", "2",
                          "--heads", "4", "--kv-heads", "2", "--dim", "32", "--reps", "2", "--json", str(out),
                          *layout], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kv_mb"] == 2 * 2 * 2 * 40 * 2 * 32 * 4 / 1e6
    assert 0 < result["streamed_ms"] < 1000 and 0 < result["cached_ms"] < 1000
    assert "ms streamed from memory" in run.stdout
    assert result["head_major"] == bool(layout) and ("head-major blocks" in run.stdout) == bool(layout)
