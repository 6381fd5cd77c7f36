"""benchmarks/profile_step.py in a tiny configuration: every case and phase
is reported, non-negative where measured, and the phases add up to the step."""

from __future__ import annotations

import json

import profile_step


def test_profile_reports_every_case_and_phase(tmp_path, capsys):
    out = tmp_path / "profile.json"
    result = profile_step.main(["--context", "32", "--batch", "2", "--reps", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cases = result["cases"]
    assert list(cases) == ["decode, batch 1", "decode, batch 2", "prefill, 32 tokens"]
    for name, phases in cases.items():
        assert set(phases) == set(profile_step.PHASES), name
        for phase in ("prep", "graph", "eval", "matmul", "attention", "logits", "sample", "total"):
            assert phases[phase] >= 0, (name, phase)
        # The estimated classes and the rest are the evaluation; prep, graph,
        # eval and sample are the step (medians of separate runs: near, not equal).
        assert abs(phases["matmul"] + phases["attention"] + phases["logits"] + phases["rest"]
                   - phases["eval"]) < 1e-6
        parts = phases["prep"] + phases["graph"] + phases["eval"] + phases["sample"]
        assert 0.5 * phases["total"] <= parts <= 1.5 * phases["total"], (name, parts, phases["total"])
    printed = capsys.readouterr().out
    assert "| decode, batch 2 |" in printed and "host work (prep + graph + sample)" in printed
