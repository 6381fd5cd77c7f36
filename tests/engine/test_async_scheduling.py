"""vLLM's async scheduling (on by default) against synchronous scheduling.

Under async scheduling the engine schedules step N+1, and processes step N-1's
output, while step N evaluates; the runner finishes step N (waits, samples)
before the batch changes. The outputs must be exactly those of synchronous
scheduling, for a workload that exercises everything that depends on step
order: greedy and seeded random sampling, sample and prompt logprobs, a
request stopping early in a running batch (async scheduling computes one
step past the stop and throws it away), chunked prefill, and preemption.
"""

from __future__ import annotations

import pytest
from engine_helpers import GOLDEN, engine, runner_of

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.slow

PROMPTS = [g["prompt_ids"] for g in GOLDEN[:8]]
# Request 5 stops on the first token greedy decoding produces for the first time at step >= 3.
STOP_AT = next(j for j, t in enumerate(GOLDEN[5]["greedy_ids"]) if j >= 3 and t not in GOLDEN[5]["greedy_ids"][:j])


def workload():
    """Eight requests, each with different sampling needs."""
    g = GOLDEN
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=24, seed=123, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True),
        # Stops early, while the others run on.
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[g[5]["greedy_ids"][STOP_AT]]),
        SamplingParams(temperature=0.7, max_tokens=5, seed=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=0.5),
    ]


def run(llm, prompts):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], workload(), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        logprobs = None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
        prompt = None if o.prompt_logprobs is None else \
            [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]
        result.append((list(c.token_ids), c.finish_reason, logprobs, prompt))
    return result


def generate_both(model_dir, prompts=PROMPTS, **kwargs):
    runs = {}
    for mode in (True, False):
        with engine(model_dir, async_scheduling=mode, **kwargs) as llm:
            runner = runner_of(llm)
            core = llm.llm_engine.engine_core.engine_core
            assert runner.async_scheduling is mode
            assert (core.batch_queue is not None) is mode  # the engine's async step loop
            runs[mode] = run(llm, prompts), runner.finished_by_next_step, runner.batch.num_resumed
    return runs


def assert_same_outputs(async_out, sync_out):
    """Tokens and finish reasons exactly; log-probabilities to float32 rounding.

    The two modes batch differently (async scheduling computes one step past a
    request's end and discards it), and a BLAS product of a different row
    count may round its last bit differently: logprobs agree to ~1e-7, and no
    token may change."""
    assert len(async_out) == len(sync_out)
    for a, s in zip(async_out, sync_out):
        assert a[0] == s[0] and a[1] == s[1]
        for got, want in ((a[2], s[2]), (a[3], s[3])):
            assert (got is None) == (want is None) and len(got or []) == len(want or [])
            for g, w in zip(got or [], want or []):
                assert (g is None) == (w is None)
                if g is not None:
                    assert g.keys() == w.keys()
                    assert all(abs(g[t] - w[t]) <= 1e-5 for t in g), (g, w)


def test_default_is_async(model_dir):
    with engine(model_dir) as llm:
        assert runner_of(llm).async_scheduling


def test_async_gives_the_sync_outputs_with_chunked_prefill(model_dir):
    runs = generate_both(model_dir, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)
    (async_out, overlapped, _), (sync_out, sync_overlapped, _) = runs[True], runs[False]
    assert_same_outputs(async_out, sync_out)
    # Under async scheduling, steps were finished by the next execute_model:
    # the engine really ran ahead of the outputs.
    assert overlapped > 0 and sync_overlapped == 0
    tokens, reason, _, _ = async_out[5]
    assert reason == "stop" and tokens == GOLDEN[5]["greedy_ids"][:STOP_AT + 1]
    assert async_out[0][0] == GOLDEN[0]["greedy_ids"][:24]


def test_async_gives_the_sync_outputs_under_preemption(model_dir):
    bytes_per_block = 30 * 2 * 16 * 3 * 64 * 4  # the embedded model's K/V bytes per 16-token block
    # Prompts one token short of 10, 11 or 12 full blocks: four are admitted
    # (43 of 48 blocks), and their decodes need two blocks each within 24 tokens.
    prompts = [GOLDEN[-1]["prompt_ids"][:16 * (10 + i % 3) - 1] for i in range(8)]
    runs = generate_both(model_dir, prompts, kv_cache_memory_bytes=48 * bytes_per_block, max_num_seqs=8,
                         max_model_len=512, enable_prefix_caching=False)
    assert_same_outputs(runs[True][0], runs[False][0])
    assert runs[True][2] > 0 and runs[False][2] > 0, "the tiny cache should have forced preemptions"
