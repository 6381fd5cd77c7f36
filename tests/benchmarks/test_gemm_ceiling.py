"""benchmarks/gemm_ceiling.py, run as its one command in its smoke mode: the C
program compiles and runs here, its whole GEMM matches double-precision sums,
and every case it reports is there with a plausible figure."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm_ceiling.py"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_quick_run_reports_every_case(tmp_path):
    out = tmp_path / "gemm.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert 0 < result["mlx_shim_gflops"] < 10_000
    cases = result["cases"]
    if "skipped" in cases[0]:
        pytest.skip(cases[0]["skipped"])
    kinds = [c["case"] for c in cases]
    assert kinds.count("fma_peak") == 1 and kinds.count("micro") == 6 and kinds.count("blis") == 4
    for c in cases:
        assert 0 < c["gflops"] < 10_000, c
        if c["case"] == "blis":  # K <= 1536 products of values in [-0.5, 0.5]: float32 sums within 1e-3
            assert c["max_abs_err"] < 1e-3, c
    assert "FMA peak" in run.stdout
