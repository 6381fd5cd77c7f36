"""What the model-proposer tests (MTP, Qwen MTP, DeepSeek MTP, EAGLE-3, Gemma 4's
assistant) share: recording a runner's proposals for the reference checks, and
the check that the runner's counts are vLLM's spec-decode metrics."""

from __future__ import annotations


def record(runner, into: list, vary_up_to: int | None = None) -> None:
    """Every proposal with drafts of the runner's drafting model as (the request's
    tokens, its drafts). vary_up_to: rows ask for 1, 2, ... up to that many drafts by
    their batch row (as the draft budget may), so passes drop rows as they finish."""
    drafter = runner.speculator.model
    propose = drafter.propose

    def recording(rows, req_ids, positions, newest, want, inputs_for):
        if vary_up_to is not None:
            want = [min(w, 1 + int(r) % vary_up_to) for r, w in zip(rows, want)]
        out = propose(rows, req_ids, positions, newest, want, inputs_for)
        states = runner.batch.states()
        into.extend((states[r].prompt_token_ids + states[r].output_token_ids, d) for r, d in zip(rows, out) if d)
        return out

    drafter.propose = recording


def metrics(llm, prefix: str = "vllm:spec_decode") -> dict:
    """The engine's metrics whose names start with `prefix` (counters and gauges)."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith(prefix) and hasattr(m, "value")}


def assert_counts_are_vllms_metrics(counts: tuple[int, int, int], got: dict) -> None:
    """(drafted, accepted, verified rows) as the runner counted them == vLLM's spec-decode counters."""
    drafted, accepted, rows = counts
    assert got["vllm:spec_decode_num_draft_tokens"] == drafted
    assert got["vllm:spec_decode_num_accepted_tokens"] == accepted
    assert got["vllm:spec_decode_num_drafts"] == rows
