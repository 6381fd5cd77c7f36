"""benchmarks/profile_step.py, run as its one command in a tiny configuration
(`--quick`: 64-token contexts, one warm-up, one timed step; ~15 s): every
case and phase is reported with a sane number, and the parts add up to the
step measured end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py"
CASES = ["decode, batch 1", "decode, batch 8", "prefill, 64 tokens"]
# Not imported from the script: importing it sets VLLM_METAL_DEVICE for this process.
STEP_PHASES = ("prep", "graph", "eval", "sample")
PHASES = set(STEP_PHASES) | {"matmul", "attention", "logits", "rest", "total", "residual", "handoff", "sampler"}


def test_quick_profile_reports_every_case_and_phase(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["context"], result["batch"], result["reps"]) == (64, 8, 1)
    assert list(result["cases"]) == CASES
    # The malloc a served engine gets (vllm_metal/native/allocator.py): tcmalloc
    # where the plugin preloads it, by the script re-executing itself.
    from vllm_metal.native.allocator import find_tcmalloc

    if sys.platform.startswith("linux") and find_tcmalloc() is not None:
        assert result["malloc"].startswith("tcmalloc ("), result["malloc"]

    for name, r in result["cases"].items():
        assert set(r) == PHASES, name
        assert all(math.isfinite(v) for v in r.values()), (name, r)
        # Measured phases are times; rest (eval minus the estimated classes)
        # and residual (total minus the phases) are differences, either sign.
        for phase in PHASES - {"rest", "residual"}:
            assert r[phase] >= 0, (name, phase, r[phase])
        assert r["eval"] > 0 and r["matmul"] > 0 and r["attention"] > 0 and r["logits"] > 0, (name, r)
        # The step's phases add up to the step timed end to end (one timed
        # step: only the few Python calls between the stamps are left over).
        parts = sum(r[p] for p in STEP_PHASES)
        assert abs(parts - r["total"]) <= 0.05 * r["total"] + 0.5, (name, parts, r["total"])
        assert math.isclose(r["residual"], r["total"] - parts, abs_tol=1e-6)
        assert math.isclose(r["sample"], r["handoff"] + r["sampler"], rel_tol=1e-6, abs_tol=1e-6)
        # The classes and the remainder are the evaluation.
        assert math.isclose(r["matmul"] + r["attention"] + r["logits"] + r["rest"], r["eval"], abs_tol=1e-6)
    host = sum(result["cases"]["decode, batch 8"][p] for p in ("prep", "graph", "sample"))
    assert math.isclose(result["host_share_batched_decode"], host / result["cases"]["decode, batch 8"]["total"])

    printed = run.stdout
    for name in CASES:
        assert f"| {name} |" in printed
    assert "host work (prep + graph + sample) in the batch-8 decode step" in printed
