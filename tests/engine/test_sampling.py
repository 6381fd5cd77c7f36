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


def test_prompt_logprobs_match_the_model_across_chunks(llm, mlx_model_dir):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    got = np.array([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    # Independent: mlx-lm's own forward over the whole prompt at once, fp32.
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(mlx_model_dir))
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


@pytest.fixture(scope="module")
def reference_logits(mlx_model_dir):
    """tokens -> float64 logits of mlx-lm's own forward (row i predicts token i + 1)."""
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(mlx_model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    return lambda tokens: np.array(model(mx.array(tokens)[None])[0].astype(mx.float32)).astype(np.float64)


def penalized(logits, prompt, output, repetition, frequency, presence):
    """vLLM's documented penalties (vllm.model_executor.layers.utils.apply_penalties),
    in float64: repetition divides positive / multiplies negative logits of
    every token seen in the prompt or output; frequency and presence subtract
    per output occurrence / once per output token."""
    logits = logits.copy()
    seen = np.zeros(len(logits), bool)
    seen[list(set(prompt) | set(output))] = True
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(logits))[:len(logits)]
    return logits - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("repetition,frequency,presence", [(1.8, 0.0, 0.0), (1.0, 2.0, 0.0), (1.2, 0.3, 1.5)])
def test_each_penalized_choice_is_the_argmax_of_the_penalized_logits(llm, reference_logits, repetition,
                                                                     frequency, presence):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=repetition,
                            frequency_penalty=frequency, presence_penalty=presence)
    out = list(generate(llm, params).outputs[0].token_ids)
    logits = reference_logits(PROMPT + out[:-1])[len(PROMPT) - 1:]  # row t predicts out[t]
    changed = 0
    for t, token in enumerate(out):
        scores = penalized(logits[t], PROMPT, out[:t], repetition, frequency, presence)
        assert scores[token] >= scores.max() - 2e-3, f"step {t}: chose {token}, argmax {int(scores.argmax())}"
        changed += int(np.argmax(logits[t]) != token)
    assert changed, "the penalties never changed a choice: the test would not notice them missing"


def test_allowed_ids_logit_bias_min_tokens(llm):
    allowed = [GREEDY[0], 11, 12]
    out = generate(llm, SamplingParams(temperature=1.0, max_tokens=12, seed=1, allowed_token_ids=allowed))
    assert set(out.outputs[0].token_ids) <= set(allowed)
    biased = generate(llm, SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}))
    assert list(biased.outputs[0].token_ids) == [42] * 4
    eos = 2
    short = generate(llm, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5))
    assert len(short.outputs[0].token_ids) == 6 and short.outputs[0].token_ids[-1] == eos


class ForceToken:
    """A custom logits processor (vLLM's v1 LogitsProcessor interface): rows
    whose request carries extra_args={"force": id} may only emit that id.
    Tracks rows through vLLM's BatchUpdate, so it also checks the persistent
    batch's add/remove/move bookkeeping."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update):
        from vllm.v1.sample.logits_processor import MoveDirectionality

        if not update:
            return
        for index, params, _, _ in update.added:
            force = (params.extra_args or {}).get("force") if params is not None else None
            if force is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = force
        for index in update.removed:
            self.rows.pop(index, None)
        for a, b, direction in update.moved:
            va, vb = self.rows.pop(a, None), self.rows.pop(b, None)
            if va is not None:
                self.rows[b] = va
            if direction == MoveDirectionality.SWAP and vb is not None:
                self.rows[a] = vb

    def apply(self, logits):
        for row, token in self.rows.items():
            keep = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = keep
        return logits


def test_custom_logits_processor_and_generation_config_override(model_dir):
    from vllm.v1.sample.logits_processor import LogitsProcessor

    processor = type("ForceTokenProcessor", (ForceToken, LogitsProcessor), {})
    with engine(model_dir, logits_processors=[processor], max_num_seqs=4,
                override_generation_config={"max_new_tokens": 3, "temperature": 0.0}) as llm:
        from engine_helpers import runner_of

        # A custom processor may edit any row's logits: nothing is sampled in the graph.
        assert runner_of(llm).sample_in_graph is False
        prompts = [GOLDEN[i]["prompt_ids"] for i in (0, 1, 2, 3)]
        params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                 extra_args={"force": 77} if i % 2 else None) for i in range(4)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        for i, out in enumerate(outs):
            expected = [77] * 8 if i % 2 else GOLDEN[i]["greedy_ids"][:8]
            assert list(out.outputs[0].token_ids) == expected, i
        # No sampling params: the overridden generation config gives 3 greedy tokens.
        default = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], use_tqdm=False)[0]
        assert list(default.outputs[0].token_ids) == GOLDEN[0]["greedy_ids"][:3]


@pytest.mark.parametrize("params,in_graph", [
    (dict(temperature=0), True),
    (dict(temperature=0, top_k=5, top_p=0.5, min_p=0.3), True),  # argmax-invariant for greedy
    (dict(temperature=0, min_tokens=3), False),  # stop tokens masked until 3 tokens exist
    (dict(temperature=0, logprobs=1), False),
    (dict(temperature=0, prompt_logprobs=0), False),
    (dict(temperature=0, repetition_penalty=1.1), False),
    (dict(temperature=0, presence_penalty=0.1), False),
    (dict(temperature=0, frequency_penalty=0.1), False),
    (dict(temperature=0, logit_bias={3: 1.0}), False),
    (dict(temperature=0, allowed_token_ids=[3, 4]), False),
    (dict(temperature=0.5), False),
    (dict(temperature=0.5, seed=3), False),
])
def test_which_rows_sample_in_the_graph(params, in_graph):
    """engine/sampling.greedy_in_graph: exactly the rows vLLM's Sampler would
    answer with the argmax of the raw logits."""
    from vllm_metal.engine.persistent_batch import RequestState
    from vllm_metal.engine.sampling import greedy_in_graph

    state = RequestState("r", [1, 2], SamplingParams(**params), None, [[]], 0)
    assert greedy_in_graph(state) is in_graph
    if params.get("min_tokens"):
        state.output_token_ids.extend([5, 6, 7])  # min_tokens reached: the mask is gone
        assert greedy_in_graph(state)
