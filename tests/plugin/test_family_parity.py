"""Every served model family, proven against mlx-lm's own forward on the same
weights: a tiny random-weight model of the family (tests/plugin/families.py),
one engine per family that chunks prefills (64-token budget) and caches
prefixes, float32.

- greedy tokens by teacher forcing: each generated token's log-probability
  under mlx-lm's forward (float64 log-softmax) is within 1e-3 of the best;
- prompt log-probabilities within 1e-3 of mlx-lm's (this catches a dropped
  logit scale or softcap even where greedy tokens survive it);
- the same tokens alone, batched, and after a prefix-cache hit.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine
from families import FAMILIES, build, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_metal.models.registry import SERVED

LONG = GOLDEN[-1]["prompt_ids"]
PROMPTS = [LONG[:20], LONG[100:190], LONG[200:350]]  # short, over one chunk, over two (and the windows)
NUM_TOKENS = 12
TOL = 1e-3


def test_every_served_family_has_a_parity_model():
    assert set(FAMILIES) == set(SERVED)


def generate(llm, prompts, prompt_logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


# MLX 4-bit checkpoints (as mlx_lm.convert -q writes them): a dense family,
# MoE switch layers (qwen3_moe, olmoe), scaled and softcapped heads on
# quantized embeddings (granite, gemma2, cohere2), a packed quantized qkv
# (phi3). On MLX's CPU device the weights are expanded at load; the
# reference is mlx-lm's quantized forward.
QUANTIZED = ["llama", "qwen3_moe", "granite", "gemma2", "phi3", "olmoe", "cohere2"]


@pytest.mark.parametrize("model_type,bits", [(t, None) for t in sorted(FAMILIES)] + [(t, 4) for t in QUANTIZED])
def test_family_matches_mlx_lm(model_type, bits, model_dir, tmp_path):
    variant = build(model_type, tmp_path / model_type, model_dir, bits=bits)
    ref = reference_logprobs(variant)
    with engine(variant, max_model_len=512, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64,
                max_num_seqs=8, enable_prefix_caching=True) as llm:
        batched = generate(llm, PROMPTS, prompt_logprobs=0)
        solo = [generate(llm, [p])[0] for p in PROMPTS]
        again = generate(llm, [PROMPTS[2]])[0]
    for prompt, out in zip(PROMPTS, batched):
        tokens = list(out.outputs[0].token_ids)
        lp = ref(prompt + tokens[:-1])
        # Teacher forcing: each chosen token is (within float noise) mlx-lm's argmax.
        rows = lp[len(prompt) - 1:]
        chosen = rows[np.arange(len(tokens)), tokens]
        assert (chosen >= rows.max(axis=1) - TOL).all(), (
            f"{model_type}: token {int(np.argmax(chosen < rows.max(axis=1) - TOL))} is not mlx-lm's argmax")
        # Prompt log-probabilities.
        got = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        expected = lp[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(got, expected, atol=TOL, err_msg=f"{model_type}: prompt logprobs")
    tokens = [list(o.outputs[0].token_ids) for o in batched]
    assert [list(o.outputs[0].token_ids) for o in solo] == tokens, f"{model_type}: solo != batched"
    assert again.num_cached_tokens >= 128, f"{model_type}: the repeated prompt should hit the prefix cache"
    assert list(again.outputs[0].token_ids) == tokens[2], f"{model_type}: prefix-cache hit changed the tokens"


def test_docs_table_is_generated_from_the_registry():
    from pathlib import Path

    from vllm_metal.models.registry import markdown_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = text.split("<!-- models:begin (generated) -->")[1].split("<!-- models:end -->")[0]
    assert block.strip() == markdown_table(), "regenerate: python -m vllm_metal.models.registry"
