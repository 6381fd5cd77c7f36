"""What the model-proposer tests (MTP, Qwen MTP, DeepSeek MTP, EAGLE-3, Gemma 4's
assistant) share: recording a runner's proposals for the reference checks, and
the check that the runner's counts are vLLM's spec-decode metrics, and the
seeded-sampling check: a request's first two tokens drawn with drafts follow
the target's exact joint top-K distribution (chi-square)."""

from __future__ import annotations

import numpy as np
from test_rejection import chi_square_p

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

K = 5  # the distribution tests' top-k


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


def top_k_distribution(llm, prompt):
    """The exact top-K next-token distribution at temperature 1 (vLLM's raw logprobs, renormalised)."""
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(temperature=0, max_tokens=1, logprobs=K), use_tqdm=False)
    d = out[0].outputs[0].logprobs[0]
    ids = sorted(d, key=lambda t: -d[t].logprob)[:K]
    lp = np.array([d[t].logprob for t in ids], np.float64)
    return ids, np.exp(lp - lp.max()) / np.exp(lp - lp.max()).sum()


def joint_of_two(llm, prompt) -> dict[tuple[int, int], float]:
    """The exact top-K joint distribution of a request's first two tokens (an engine without drafts)."""
    first_ids, p1 = top_k_distribution(llm, prompt)
    return {(a, b): pa * pb for a, pa in zip(first_ids, p1) for b, pb in zip(*top_k_distribution(llm, prompt + [a]))}


def seeded_pairs(llm, prompt, n: int) -> list[tuple[int, ...]]:
    """n requests' first two tokens at temperature 1, top-K, seeds 0 .. n - 1 (the second one verified
    against drafts: accepted by vLLM's rejection rule or replaced)."""
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n,
                       [SamplingParams(temperature=1.0, top_k=K, seed=i, max_tokens=2, ignore_eos=True)
                        for i in range(n)], use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in out]


def sampling_counts(speculator) -> tuple[int, int, int]:
    return speculator.verified_rows, speculator.accepted, speculator.drafted


def assert_keeps_the_distribution(samples, joint: dict, counts: tuple[int, int, int]) -> None:
    """counts: (rows verified, drafts accepted, drafted) while sampling: drafts were taken and refused."""
    verified, accepted, drafted = counts
    assert verified >= len(samples) // 2 and 0 < accepted < drafted, counts
    pairs = list(joint)
    observed = np.zeros(len(pairs))
    for t in samples:
        observed[pairs.index(t)] += 1
    assert chi_square_p(observed, len(samples) * np.array([joint[p] for p in pairs])) > 1e-3
