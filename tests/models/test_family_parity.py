"""Every served model family, proven against mlx-lm's own forward on the same
weights: a tiny random-weight model of the family (tests/families.py),
one engine per family that chunks prefills (64-token budget) and caches
prefixes, float32.

- greedy tokens by teacher forcing: each generated token's log-probability
  under mlx-lm's forward (float64 log-softmax) is within 1e-3 of the best;
- prompt log-probabilities within 1e-3 of mlx-lm's (this catches a dropped
  logit scale or softcap even where greedy tokens survive it);
- the same tokens alone, batched, and after a prefix-cache hit, with vLLM's
  defaults (prefix caching on: for hybrid linear-attention families its
  "align" mode, the state checkpointed at block boundaries);
- hybrids: a prompt sharing only a prefix with earlier ones resumes from the
  cached state at the shared block boundary (vLLM checkpoints that boundary
  on the second such prompt), with tokens and log-probabilities still
  mlx-lm's.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from families import FAMILIES, VISION_LANGUAGE, build, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_metal.models.registry import SERVED

LONG = GOLDEN[-1]["prompt_ids"]
PROMPTS = [LONG[:20], LONG[100:190], LONG[200:350]]  # short, over one chunk, over two (and the windows)
# Hybrids: three prompts sharing an 80-token prefix (five 16-token blocks), different tails.
SHARED_PREFIX = 80
SHARED = [LONG[300:300 + SHARED_PREFIX] + LONG[start:start + 14] for start in (400, 450, 500)]
NUM_TOKENS = 12
TOL = 1e-3


def test_every_served_family_has_a_parity_model():
    assert set(FAMILIES) == set(SERVED)


def check_registry_facts(model_type, variant):
    """What docs/models.md states about the family holds for its parity model."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from vllm_metal.models.loader import load_model

    family, loaded = SERVED[model_type], load_model(variant, materialize=False)
    assert any(loaded.sliding_windows) == family.sliding, f"{model_type}: sliding windows"
    moe = any(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in loaded.model.named_modules())
    assert moe == family.moe, f"{model_type}: MoE layers"
    first = next(i for i, kv in enumerate(loaded.layer_kv) if kv.layout != "state")
    attention = loaded.model.layers[first].self_attn
    kind = "mla" if loaded.layer_kv[first].layout == "latent" else "sinks" if attention.has_sinks else "gqa"
    assert kind == family.attention, f"{model_type}: attention kind"
    assert loaded.has_linear == bool(family.linear), f"{model_type}: linear-attention layers"
    linear = {m.kind for _, m in loaded.model.named_modules() if hasattr(m, "state_shapes")}
    assert linear == ({family.linear} if family.linear else set()), f"{model_type}: linear-attention kind"


def generate(llm, prompts, prompt_logprobs=None, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=prompt_logprobs,
                            logprobs=logprobs)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


# Quantized checkpoints are proven for every family by test_family_quantized.py
# (the step the runner evaluates); one also runs through the whole engine:
# MLX 4-bit MoE switch layers, expanded at load as the CPU device serves them.
QUANTIZED = ["qwen3_moe"]


@pytest.mark.parametrize("model_type,bits", [(t, None) for t in sorted(FAMILIES)] + [(t, 4) for t in QUANTIZED])
def test_family_matches_mlx_lm(model_type, bits, model_dir, tmp_path):
    variant = build(model_type, tmp_path / model_type, model_dir, bits=bits)
    if bits is None:
        check_registry_facts(model_type, variant)
    ref = reference_logprobs(variant)
    hybrid = bool(SERVED[model_type].linear)
    # Vision-language families' text model (their images: tests/multimodal); the parity model has no tower.
    text_only = {"language_model_only": True} if model_type in VISION_LANGUAGE else {}
    with engine(variant, max_model_len=512, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64,
                max_num_seqs=8, **text_only) as llm:
        batched = generate(llm, PROMPTS, prompt_logprobs=0)
        solo = [generate(llm, [p])[0] for p in PROMPTS]
        again = generate(llm, [PROMPTS[2]])[0]
        shared = [generate(llm, [p], logprobs=1)[0] for p in SHARED] if hybrid else []
        block = min(runner_of(llm).block_sizes)
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
    if hybrid:
        check_shared_prefix(model_type, ref, shared, block)


def check_shared_prefix(model_type, ref, outs, block):
    """P+A misses; by P+C the state at P's last block boundary is cached
    (where P+A's prefill chunks ended, or checkpointed by P+B, vLLM's
    shared-prefix junction), and P+C resumes there. Every one's tokens and
    sampled log-probabilities are mlx-lm's (teacher forcing)."""
    assert outs[0].num_cached_tokens == 0, f"{model_type}: unexpected early hit"
    assert outs[2].num_cached_tokens == SHARED_PREFIX // block * block, (
        f"{model_type}: P+C should resume at the shared prefix's block boundary "
        f"(cached {outs[2].num_cached_tokens})")
    for prompt, out in zip(SHARED, outs):
        tokens = list(out.outputs[0].token_ids)
        rows = ref(prompt + tokens[:-1])[len(prompt) - 1:]
        chosen = rows[np.arange(len(tokens)), tokens]
        assert (chosen >= rows.max(axis=1) - TOL).all(), f"{model_type}: shared-prefix prompt off mlx-lm's argmax"
        got = np.array([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        np.testing.assert_allclose(got, chosen, atol=TOL, err_msg=f"{model_type}: shared-prefix logprobs")


def test_docs_table_is_generated_from_the_registry():
    from pathlib import Path

    from vllm_metal.models.registry import markdown_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = text.split("<!-- models:begin (generated) -->")[1].split("<!-- models:end -->")[0]
    assert block.strip() == markdown_table(), "regenerate: python -m vllm_metal.models.registry"
