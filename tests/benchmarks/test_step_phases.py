"""benchmarks/step_phases.py's step timing: each step is timed from the previous
step's output reaching the scheduler to its own (so an engine that overlaps
steps is timed the same way as one that does not), and labelled by kind."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace


def load(monkeypatch):
    # The module switches vLLM to an in-process engine at import; keep that out of this process.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
    return importlib.import_module("step_phases")


def test_steps_are_timed_by_kind_between_outputs(monkeypatch):
    step_phases = load(monkeypatch)
    clock = iter([10.5, 13.0, 13.05, 13.1, 13.4])
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: next(clock))
    seen = []
    scheduler = SimpleNamespace(update_from_output=lambda so, out: seen.append(so) or "outputs")
    finished: list = []
    step_phases.record_steps(scheduler, finished)
    steps = [{"a": 2048},  # one prompt's chunk
             {"a": 1, "b": 1, "c": 1},  # three decode rows
             {"a": 1, "b": 1, "c": 1},
             {},  # nothing scheduled
             {"a": 1, "b": 300}]  # a decode row riding along a prompt's last 300 tokens
    for tokens in steps:
        so = SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()))
        assert scheduler.update_from_output(so, None) == "outputs"
    assert len(seen) == 5 and [f[1:] for f in finished] == [(2048, 1, 0), (3, 3, 3), (3, 3, 3), (0, 0, 0),
                                                            (301, 2, 1)]
    kinds = step_phases.step_kinds(finished, start=10.0)
    assert list(kinds) == ["decode 3", "empty", "prefill 2048", "prefill 512"]
    assert kinds["prefill 2048"]["steps"] == 1 and abs(kinds["prefill 2048"]["total_s"] - 0.5) < 1e-9
    assert kinds["decode 3"]["steps"] == 2 and abs(kinds["decode 3"]["total_s"] - 2.55) < 1e-9
    assert abs(kinds["decode 3"]["mean_ms"] - 1275.0) < 1e-6
    assert abs(kinds["empty"]["total_s"] - 0.05) < 1e-9 and abs(kinds["prefill 512"]["total_s"] - 0.3) < 1e-9
