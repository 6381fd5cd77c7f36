"""An mlx_lm.lora adapter on every served family: mlx-lm's own tuner writes
it (rank 4, every Linear of every decoder layer, MoE experts aside: see
docs/lora.md), mlx-lm's own load_adapters is the reference; the same adapter
in PEFT's layout goes through the PEFT reader. One engine per family serves
the base model and both adapters in one batch: each adapter's greedy tokens
by teacher forcing and its prompt log-probabilities within 1e-3 of the
reference, the base row still the base model's, and the adapter moving the
prompt log-probabilities far beyond that tolerance (it is not silently
dropped).

Refused, with the reason: an adapter on latent attention's kv_b_proj
(absorbed at load), and --enable-lora on an architecture vLLM's own config
declares LoRA-less (stablelm).
"""

from __future__ import annotations

import mlx.nn as nn
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine
from families import FAMILIES, build
from lora_adapters import make_mlx_adapter, peft_from_mlx_adapter, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

PROMPT = GOLDEN[-1]["prompt_ids"][100:190]
TOL = 1e-3
# vLLM 0.33's config refuses --enable-lora for these architectures (its torch model lacks SupportsLoRA).
VLLM_REFUSES = {"stablelm": "LoRA is not supported for StableLmForCausalLM"}


def linear_keys(variant: str) -> list[str]:
    from pathlib import Path

    from mlx_lm.utils import load_model

    model, _ = load_model(Path(variant), lazy=True)
    return sorted({p for layer in model.layers for p, m in layer.named_modules()
                   if isinstance(m, (nn.Linear, nn.QuantizedLinear))})


def logprobs_of(prompt, out):
    return np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_mlx_lm_adapter_on_every_family(model_type, model_dir, tmp_path):
    variant = build(model_type, tmp_path / model_type, model_dir)
    keys = linear_keys(variant)
    settings = dict(max_model_len=512, kv_cache_memory_bytes=16 << 20, enable_lora=True, max_loras=2,
                    max_lora_rank=8, max_num_batched_tokens=64)
    if model_type in VLLM_REFUSES:
        with pytest.raises(Exception, match=VLLM_REFUSES[model_type]):
            with engine(variant, **settings):
                pass
        return
    absorbed = [k for k in keys if k.endswith("kv_b_proj")]
    adapter = make_mlx_adapter(variant, tmp_path / "adapter", rank=4, scale=2.0,
                               keys=[k for k in keys if k not in absorbed], num_layers=64, seed=3)
    ref, base_ref = reference_logprobs(variant, adapter), reference_logprobs(variant)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with engine(variant, **settings) as llm:
        if absorbed:
            mla = make_mlx_adapter(variant, tmp_path / "mla", rank=4, keys=absorbed, num_layers=64)
            with pytest.raises(Exception, match="absorbs kv_b_proj"):
                llm.llm_engine.add_lora(LoRARequest("mla", 9, mla))
        peft = peft_from_mlx_adapter(adapter, tmp_path / "peft")
        base, tuned, as_peft = llm.generate(
            [TokensPrompt(prompt_token_ids=PROMPT)] * 3, params, use_tqdm=False,
            lora_request=[None, LoRARequest("tuned", 1, adapter), LoRARequest("peft", 2, peft)])
    for out, reference, what in ((tuned, ref, "adapter"), (as_peft, ref, "PEFT adapter"), (base, base_ref, "base")):
        tokens = list(out.outputs[0].token_ids)
        rows = reference(PROMPT + tokens[:-1])[len(PROMPT) - 1:]
        chosen = rows[np.arange(len(tokens)), tokens]
        assert (chosen >= rows.max(axis=1) - TOL).all(), f"{model_type} {what}: a token off the reference's argmax"
        expected = reference(PROMPT)[np.arange(len(PROMPT) - 1), PROMPT[1:]]
        np.testing.assert_allclose(logprobs_of(PROMPT, out), expected, atol=TOL,
                                   err_msg=f"{model_type} {what}: prompt logprobs")
    moved = np.abs(logprobs_of(PROMPT, tuned) - logprobs_of(PROMPT, base)).max()
    assert moved > 50 * TOL, f"{model_type}: the adapter moved the prompt logprobs only {moved:.2e}"
