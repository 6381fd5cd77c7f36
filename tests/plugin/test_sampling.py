"""Sampling features through the plugin (vLLM's own Sampler on our logits)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

PROMPT = GOLDEN[7]["prompt_ids"]  # 109 tokens
GREEDY = GOLDEN[7]["greedy_ids"]


@pytest.fixture(scope="module")
def llm(model_dir):
    # Small batches: the 109-token prompt is prefilled in chunks of 32.
    with engine(model_dir, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False) as llm:
        yield llm


def generate(llm, params, prompt=PROMPT):
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]


def test_top_k_1_is_greedy_and_chunked_prefill_changes_nothing(llm):
    out = generate(llm, SamplingParams(temperature=0.7, top_k=1, max_tokens=32, ignore_eos=True, seed=3))
    assert list(out.outputs[0].token_ids) == GREEDY


def test_prompt_logprobs_match_the_model_across_chunks(llm, model_dir):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    got = np.array([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    # Independent: mlx-lm's own forward over the whole prompt at once, fp32.
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    logits = model(mx.array(PROMPT)[None])[0, :-1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    expected = np.array(mx.take_along_axis(logprobs, mx.array(PROMPT[1:])[:, None], axis=-1))[:, 0]
    assert out.prompt_logprobs[0] is None and len(got) == len(PROMPT) - 1
    np.testing.assert_allclose(got, expected, atol=2e-3)


def test_sample_logprobs_and_ranks(llm):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    for token, lps in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert len(lps) >= 3 and lps[token].rank == 1
        assert lps[token].logprob == max(lp.logprob for lp in lps.values())


def test_seeds_n_and_reproducibility(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, n=3, seed=11, ignore_eos=True)
    first = [list(o.token_ids) for o in generate(llm, params).outputs]
    again = [list(o.token_ids) for o in generate(llm, params).outputs]
    assert len(first) == 3 and first == again
    assert len({tuple(x) for x in first}) > 1


def test_stop_strings_and_tokens(llm):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[GREEDY[5]]))
    assert list(out.outputs[0].token_ids) == GREEDY[:6] and out.outputs[0].finish_reason == "stop"
    text = generate(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).outputs[0].text
    stop = text[10:14]
    out = generate(llm, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))
    assert out.outputs[0].text == text[:text.index(stop)]


def test_penalties_allowed_ids_logit_bias_min_tokens(llm):
    penalized = generate(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                             repetition_penalty=1.8)).outputs[0].token_ids
    assert list(penalized) != GREEDY
    allowed = [GREEDY[0], 11, 12]
    out = generate(llm, SamplingParams(temperature=1.0, max_tokens=12, seed=1, allowed_token_ids=allowed))
    assert set(out.outputs[0].token_ids) <= set(allowed)
    biased = generate(llm, SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}))
    assert list(biased.outputs[0].token_ids) == [42] * 4
    eos = 2
    short = generate(llm, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5))
    assert len(short.outputs[0].token_ids) == 6 and short.outputs[0].token_ids[-1] == eos
