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
def first_new(ids: list[int], at_least: int) -> int:
    return next(j for j, t in enumerate(ids) if j >= at_least and t not in ids[:j])


STOP_AT = first_new(GOLDEN[5]["greedy_ids"], 3)
STOP_AT_2 = first_new(GOLDEN[2]["greedy_ids"], 5)  # greedy_workload's request 2


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


def greedy_workload():
    """Every request greedy (sampled inside the step's graph, its tokens fed to
    the next step's graph), with mixed lengths, an early stop, min_tokens past
    which the graph samples again, and a request whose penalties make its
    steps sample on the host, joining and leaving the greedy batch."""
    g = GOLDEN
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[g[2]["greedy_ids"][STOP_AT_2]]),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[g[4]["greedy_ids"][2]]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3),
    ]


def run(llm, prompts, params=None):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params or workload(), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        logprobs = None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
        prompt = None if o.prompt_logprobs is None else \
            [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]
        result.append((list(c.token_ids), c.finish_reason, logprobs, prompt))
    return result


BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # the embedded model's K/V bytes per 16-token block
# Each configuration's prompts and engine arguments. Preempted: prompts one token short of 10, 11 or
# 12 full blocks: four are admitted (43 of 48 blocks), and their decodes need two blocks each within
# 24 tokens.
CONFIGS = {
    "chunked": (PROMPTS, dict(max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)),
    "preempted": ([GOLDEN[-1]["prompt_ids"][:16 * (10 + i % 3) - 1] for i in range(8)],
                  dict(kv_cache_memory_bytes=48 * BYTES_PER_BLOCK, max_num_seqs=8, max_model_len=512,
                       enable_prefix_caching=False)),
}
COUNTS = ("finished_by_next_step", "tokens_fed", "steps_sampled_in_graph", "forward_passes", "steps_deferred")


def generate_both(model_dir, prompts, workloads, **kwargs):
    """Each workload (a SamplingParams factory), one after the other, on one engine per
    scheduling mode: its outputs, and the runner's counts over that workload alone."""
    runs = {}
    for mode in (True, False):
        with engine(model_dir, async_scheduling=mode, **kwargs) as llm:
            runner = runner_of(llm)
            core = llm.llm_engine.engine_core.engine_core
            assert runner.async_scheduling is mode
            assert (core.batch_queue is not None) is mode  # the engine's async step loop

            def counts():
                return {name: getattr(runner, name) for name in COUNTS} | {"resumed": runner.batch.num_resumed}

            for name, params in workloads.items():
                before = counts()
                out = run(llm, prompts, params())
                c = {k: v - before[k] for k, v in counts().items()}
                runs[name, mode] = out, c["finished_by_next_step"], c["resumed"]
                runs[name, mode, "fed"] = c["tokens_fed"], c["steps_sampled_in_graph"], c["forward_passes"]
                runs[name, mode, "deferred"] = c["steps_deferred"]
    return runs


@pytest.fixture(scope="module", params=list(CONFIGS))
def both(request, model_dir):
    """(configuration, runs): both workloads on an async and a sync engine of the configuration
    (shared by the tests of that configuration)."""
    prompts, kwargs = CONFIGS[request.param]
    return request.param, generate_both(model_dir, prompts, {"mixed": workload, "greedy": greedy_workload}, **kwargs)


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


def test_async_gives_the_sync_outputs(both):
    """With chunked prefill, and under preemption."""
    config, runs = both
    (async_out, overlapped, resumed), (sync_out, sync_overlapped, sync_resumed) = runs["mixed", True], \
        runs["mixed", False]
    assert_same_outputs(async_out, sync_out)
    if config == "chunked":
        # Under async scheduling, steps were finished by the next execute_model:
        # the engine really ran ahead of the outputs.
        assert overlapped > 0 and sync_overlapped == 0
        tokens, reason, _, _ = async_out[5]
        assert reason == "stop" and tokens == GOLDEN[5]["greedy_ids"][:STOP_AT + 1]
        assert async_out[0][0] == GOLDEN[0]["greedy_ids"][:24]
    else:
        assert resumed > 0 and sync_resumed > 0, "the tiny cache should have forced preemptions"


def test_greedy_steps_sample_in_the_graph_and_feed_the_next(both, model_dir, monkeypatch):
    """All-greedy steps are sampled in the graph and, under async scheduling,
    the next step's graph reads their tokens there (built before they reach
    the host). Tokens and finish reasons: those of synchronous scheduling and
    of vLLM's Sampler on the host (VLLM_METAL_SAMPLE_IN_GRAPH=0), through an
    early stop, min_tokens, a request sampling on the host in the batch,
    chunked prefill or preemption."""
    case, runs = both
    prompts, kwargs = CONFIGS[case]
    assert_same_outputs(runs["greedy", True][0], runs["greedy", False][0])
    fed, in_graph, passes = runs["greedy", True, "fed"]
    assert in_graph > passes // 3 and fed > 20, runs["greedy", True, "fed"]
    sync_fed, sync_in_graph, _ = runs["greedy", False, "fed"]
    assert sync_fed == 0 and sync_in_graph > 0  # synchronous: sampled in the graph, nothing to feed
    if case == "preempted":
        assert runs["greedy", True][2] > 0
    # On MLX's CPU device a step starts only after the previous step's output
    # is handed over (mx.async_eval would hold that output back a whole step).
    assert runs["greedy", False, "deferred"] == 0 and runs["greedy", True, "deferred"] > 0, runs
    monkeypatch.setenv("VLLM_METAL_SAMPLE_IN_GRAPH", "0")
    with engine(model_dir, **kwargs) as llm:
        host = run(llm, prompts, greedy_workload())
        assert runner_of(llm).steps_sampled_in_graph == 0 and runner_of(llm).tokens_fed == 0
    assert_same_outputs(runs["greedy", True][0], host)
    assert len(host[4][0]) >= 6
    if case == "chunked":  # the golden prompts: the golden greedy tokens
        tokens, reason, _, _ = host[2]
        assert reason == "stop" and tokens == GOLDEN[2]["greedy_ids"][:STOP_AT_2 + 1]
        assert host[0][0] == GOLDEN[0]["greedy_ids"][:24]
