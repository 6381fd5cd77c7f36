"""Prompt logprobs follow vLLM's contract: one entry per prompt token (the
first None), values equal to the model's log-softmax (float64 reference from
mlx-lm's own forward), the requested number of alternatives, handed over
exactly once -- also when a chunk ends at the prompt's last position (the
hand-over waits for the step that samples), and when a preempted request
recomputes its prompt."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

LONG = GOLDEN[-1]["prompt_ids"]  # 571 tokens
BUDGET = 64  # max_num_batched_tokens of the chunked engine


@pytest.fixture(scope="module")
def reference(mlx_model_dir):
    """prompt -> float64 log-softmax rows [len - 1, vocab] of mlx-lm's forward."""
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(mlx_model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)

    def logprobs(prompt):
        logits = np.array(model(mx.array(prompt)[None])[0, :-1].astype(mx.float32)).astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))

    return logprobs


def run(llm, prompts, **params):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, **params)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def check(out, prompt, ref, k):
    """Shape, values and alternatives of one request's prompt logprobs."""
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt), f"{len(plp)} prompt logprob entries for a {len(prompt)}-token prompt"
    assert plp[0] is None
    rows = np.arange(len(prompt) - 1)
    value = ref[rows, prompt[1:]]
    np.testing.assert_allclose([plp[i][prompt[i]].logprob for i in range(1, len(prompt))], value, atol=1e-3)
    # rank = 1 + number of tokens more likely than the prompt token (float32 noise aside)
    low = 1 + (ref > value[:, None] + 1e-4).sum(axis=1)
    high = (ref >= value[:, None] - 1e-4).sum(axis=1)
    ranks = np.array([plp[i][prompt[i]].rank for i in range(1, len(prompt))])
    assert ((low <= ranks) & (ranks <= high)).all(), np.nonzero((low > ranks) | (ranks > high))
    if k == 0:
        assert all(len(plp[i]) == 1 for i in range(1, len(prompt)))
        return
    best = -np.sort(-np.partition(ref, ref.shape[1] - k, axis=1)[:, -k:], axis=1)  # top-k values, descending
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert len(entry) in (k, k + 1), f"position {i}: {len(entry)} alternatives for prompt_logprobs={k}"
        # The alternatives are the model's top k, in rank order.
        alternatives = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _ in alternatives] == list(range(1, k + 1)), f"position {i}"
        np.testing.assert_allclose(ref[i - 1][[t for _, t in alternatives]], best[i - 1], atol=1e-4)


@pytest.fixture(scope="module")
def chunked(model_dir):
    with engine(model_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4, enable_prefix_caching=False) as llm:
        yield llm


@pytest.mark.parametrize("length", [BUDGET + 1, 2 * BUDGET + 1, BUDGET, BUDGET - 1, 2])
def test_prompt_lengths_around_the_chunk_budget(chunked, reference, length):
    # BUDGET * k + 1: the first chunks compute every prompt row while the
    # request still prefills its last token (vLLM 0.32-0.33 asserted on a
    # hand-over with that partial prefill and the engine died).
    prompt = LONG[:length]
    out = run(chunked, [prompt], prompt_logprobs=1)[0]
    check(out, prompt, reference(prompt), 1)
    assert len(out.outputs[0].token_ids) == 2


def test_one_token_prompt_and_counts(chunked, reference):
    out = run(chunked, [LONG[:1]], prompt_logprobs=3)[0]
    assert out.prompt_logprobs == [None]
    prompt = LONG[:40]
    for k in (0, 2, 5):
        check(run(chunked, [prompt], prompt_logprobs=k)[0], prompt, reference(prompt), k)


def test_mixed_batch_with_and_without_prompt_logprobs(chunked, reference):
    prompts = [LONG[:BUDGET + 1], LONG[100:150], LONG[:BUDGET * 2 + 1]]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k, ignore_eos=True) for k in (2, None, 0)]
    outs = chunked.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    check(outs[0], prompts[0], reference(prompts[0]), 2)
    assert outs[1].prompt_logprobs is None
    check(outs[2], prompts[2], reference(prompts[2]), 0)


def test_prompt_logprobs_exactly_once_after_preemption(model_dir, reference):
    # 100-170-token prompts, 8 at once, room for about 2.5 of them: the scheduler
    # preempts and resumes (recomputing prompts). Each request's prompt
    # logprobs arrive once, with one entry per prompt token.
    prompts = [LONG[:100 + 10 * i] for i in range(8)]  # 100..170 tokens
    bytes_per_block = 30 * 2 * 16 * 3 * 64 * 4
    with engine(model_dir, kv_cache_memory_bytes=24 * bytes_per_block, max_num_seqs=8, max_model_len=256,
                enable_prefix_caching=False) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2),
                            use_tqdm=False)
        resumed = runner_of(llm).batch.num_resumed
    assert resumed > 0, "the KV cache was meant to be too small: no request was preempted"
    for out, prompt in zip(outs, prompts):
        check(out, prompt, reference(prompt), 2)


def test_prompt_logprobs_over_a_cached_prefix_are_refused_per_request(chunked, reference):
    """skip_reading_prefix_cache=False with prompt logprobs would read a
    prefix whose positions are never computed (no scores for them): that
    request is refused with the reason (before it reaches the engine, which
    crashed on the uninitialised rows' token ids), and the next is served."""
    prompt = LONG[:40]
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        run(chunked, [prompt], prompt_logprobs=1, skip_reading_prefix_cache=False)
    check(run(chunked, [prompt], prompt_logprobs=1)[0], prompt, reference(prompt), 1)


def test_fixed_id_scoring_is_refused_by_vllm_on_the_v1_contract(chunked):
    # vLLM's prompt_logprob_token_ids needs its V2 runner; the plugin keeps
    # the V1 contract, and vLLM itself refuses the request with its reason.
    prompt = LONG[:5]
    with pytest.raises(Exception, match="prompt_logprob_token_ids requires the V2 model runner"):
        run(chunked, [prompt], prompt_logprob_token_ids=[[1, 2]] * 4)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_logprobs_mode_is_honoured(mode):
    # As vLLM's GPU runner: logit modes report the logits themselves.
    import torch

    from vllm_metal.engine import prompt_logprobs
    from vllm_metal.engine.persistent_batch import RequestState

    state = RequestState("r", [5, 1, 3], SamplingParams(prompt_logprobs=1), None, [[1]], 0)
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    prompt_logprobs.record(state, logits, 0, 6, mode)
    got = prompt_logprobs.hand_over(state)
    expected = logits if mode == "raw_logits" else torch.log_softmax(logits, dim=-1)
    assert got.logprobs[:, 0].tolist() == pytest.approx(expected[[0, 1], [1, 3]].tolist())  # prompt tokens 1, 3
    assert got.logprob_token_ids[:, 1].tolist() == [3, 5]  # each row's top-1
    assert prompt_logprobs.wants_prompt_logprobs(state) is False
