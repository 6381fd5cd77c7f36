"""Golden, bit-exact greedy tokens: the plugin equals mlx-lm's own generation.

The same model and dtype (the embedded SmolLM2, weights in float32) through
`vllm.LLM` on this plugin (paged cache, packed varlen batch) and through
mlx-lm's generate_step (contiguous cache, one sequence) must give the same
32 tokens for every prompt; both are also compared with the checked-in ids.
"""

from __future__ import annotations

import pytest
from engine_helpers import GOLDEN, engine, greedy
from make_golden import NUM_TOKENS, mlx_lm_greedy

PROMPTS = [g["prompt_ids"] for g in GOLDEN]
EXPECTED = [g["greedy_ids"] for g in GOLDEN]


@pytest.fixture(scope="module")
def plugin_tokens(model_dir):
    with engine(model_dir) as llm:
        tokens, _ = greedy(llm, PROMPTS, NUM_TOKENS)
    return tokens


def test_prompts_cover_varied_lengths():
    lengths = sorted(len(p) for p in PROMPTS)
    assert len(PROMPTS) >= 8 and lengths[0] < 8 and lengths[-1] > 500


def test_mlx_lm_reproduces_checked_in_golden(mlx_model_dir):
    # mlx-lm's own loader on the MLX-format copy of the weights the plugin serves from the GGUF
    assert mlx_lm_greedy(mlx_model_dir, PROMPTS) == EXPECTED


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_plugin_matches_golden(plugin_tokens, i):
    assert plugin_tokens[i] == EXPECTED[i], f"prompt {GOLDEN[i]['prompt'][:40]!r}"
