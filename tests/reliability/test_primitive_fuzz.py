"""Primitive fuzzing: randomized and adversarial inputs to ops.paged_attention
and ops.write_kv (fuzz_primitives.py) in a subprocess, so that a crash or a
hang fails here instead of taking pytest down. Every case gives a correct
result or a Python exception naming the problem, and valid calls afterwards
are still correct."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_helpers import SCALE

FUZZ = Path(__file__).with_name("fuzz_primitives.py")


def run_fuzz(tmp_path, *args: str, timeout: float) -> dict:
    trace = tmp_path / "trace.txt"
    cmd = [sys.executable, str(FUZZ), "--trace", str(trace), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        last = trace.read_text().splitlines()[-1:] if trace.exists() else []
        pytest.fail(f"the fuzz hung for {timeout:.0f}s; last case started: {last}")
    if proc.returncode != 0:
        last = trace.read_text().splitlines()[-1:] if trace.exists() else []
        pytest.fail(f"the fuzz process died (exit {proc.returncode}) during case {last}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz(tmp_path, figures, seed):
    cases = 1500 * SCALE
    report = run_fuzz(tmp_path, "--cases", str(cases), "--seed", str(seed), timeout=120 * SCALE)
    assert not report["unexpected"], "\n".join(report["unexpected"][:20])
    assert report["outcomes"].get("ok", 0) > cases // 4 and report["outcomes"].get("error", 0) > cases // 4
    figures.setdefault("fuzz", {})[f"seed{seed}"] = report["outcomes"]


def test_hundreds_of_errors_at_eval_then_success(tmp_path):
    """Regression: each failed eval once leaked a task in MLX's CPU scheduler
    (the error was thrown from inside the primitive's CPU task), and after
    ~100 of them the next mx.eval waited forever."""
    report = run_fuzz(tmp_path, "--cases", "600", "--only", "block_id_out_of_range",
                      "--only", "lazy_bad_block_id", "--only", "cu_seqlens_inconsistent", timeout=60)
    assert not report["unexpected"], "\n".join(report["unexpected"][:20])
    assert report["outcomes"] == {"error": 600}
