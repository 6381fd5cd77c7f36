"""What --enable-lora may be combined with (adapters/serving_config.py),
checked when vLLM builds the config: the refusals name the alternative."""

from __future__ import annotations

import pytest

from vllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("extra,words", [
    (dict(tensor_parallel_size=3), "vllm-metal serves LoRA adapters on one rank"),
    (dict(pipeline_parallel_size=2), "vllm-metal serves LoRA adapters on one rank"),
    (dict(enable_tower_connector_lora=True), "multimodal LoRA options"),
    (dict(lora_target_modules=["o_proj"]), "--lora-target-modules"),
])
def test_refused_combinations(extra, words, model_dir):
    with pytest.raises(Exception, match=words):
        EngineArgs(model=model_dir, max_model_len=256, enable_lora=True, **extra).create_engine_config()


def test_lora_config_accepted_as_given(model_dir):
    config = EngineArgs(model=model_dir, max_model_len=256, enable_lora=True, max_loras=3, max_lora_rank=32,
                        max_cpu_loras=5).create_engine_config()
    lora = config.lora_config
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 32, 5)
    from vllm.entrypoints.openai.models import serving

    assert serving.OpenAIServingModels.load_lora_adapter._vllm_metal_patched  # refusals answered 400
