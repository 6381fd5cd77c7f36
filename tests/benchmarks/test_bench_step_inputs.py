"""benchmarks/bench_step_inputs.py, run as its one command: a row per batch
size with two positive timings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step_inputs.py"


def test_reports_both_paths_for_every_batch():
    run = subprocess.run([sys.executable, str(SCRIPT), "--reps", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines()[2:] if line.startswith("|")]
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
