"""Model families, weight formats and dtypes through the plugin, each equal to
mlx-lm's own greedy generation on the same weights and dtype."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from engine_helpers import GOLDEN, engine, greedy
from model_variants import float32_weights, make_variant

from vllm_metal.models.attention_adapter import PagedAttentionLayer
from vllm_metal.models.loader import load_model

PROMPTS = [GOLDEN[0]["prompt_ids"], GOLDEN[4]["prompt_ids"], GOLDEN[7]["prompt_ids"]]
NUM_TOKENS = 16


def mlx_lm_greedy(model_dir, dtype=mx.float32, dequantize=False):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(Path(model_dir))
    if dequantize:
        model = dequantize_model(model)
    model.set_dtype(dtype)
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=NUM_TOKENS,
                                               sampler=lambda x: mx.argmax(x, axis=-1))] for p in PROMPTS]


@pytest.fixture(scope="module")
def weights(model_dir):
    return float32_weights(model_dir)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_matches_mlx_lm(model_dir, weights, tmp_path, family):
    variant = make_variant(model_dir, tmp_path / family, family, weights)
    with engine(variant) as llm:
        tokens, _ = greedy(llm, PROMPTS, NUM_TOKENS)
    assert tokens == mlx_lm_greedy(variant)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_mlx_lm(model_dir, weights, tmp_path, dtype):
    # All 30 layers: half precision needs the real model's peaked logits
    # (a truncated model's near-ties flip in bf16 after a dozen tokens).
    variant = make_variant(model_dir, tmp_path / "llama", "llama", weights, layers=30)
    with engine(variant, dtype=dtype) as llm:
        tokens, _ = greedy(llm, PROMPTS, NUM_TOKENS)
    assert tokens == mlx_lm_greedy(variant, dtype=getattr(mx, dtype))


def test_mlx_quantized_weights_kept_quantized(model_dir, monkeypatch):
    # The embedded model is MLX 4-bit (8-bit embeddings); served without
    # expanding the weights it must match mlx-lm on the quantized model.
    monkeypatch.setenv("VLLM_METAL_DEQUANTIZE", "0")
    with engine(model_dir) as llm:
        tokens, _ = greedy(llm, PROMPTS, NUM_TOKENS)
    assert tokens == mlx_lm_greedy(model_dir)


def test_unknown_architecture_is_a_clear_error(model_dir, tmp_path):
    variant = Path(make_variant(model_dir, tmp_path / "x", "llama", {}))
    (variant / "config.json").write_text((variant / "config.json").read_text().replace('"llama"', '"nosucharch"'))
    with pytest.raises(NotImplementedError, match="mlx-lm cannot build model type 'nosucharch'"):
        load_model(variant)


def test_attention_without_projections_is_a_clear_error():
    import mlx.nn as nn

    class OddAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

    with pytest.raises(NotImplementedError, match="lacks q_proj, k_proj, v_proj, o_proj, rope"):
        PagedAttentionLayer(OddAttention())


def test_missing_model_and_offline_hub_id_are_clear_errors(tmp_path, monkeypatch):
    from vllm_metal.models.loader import resolve_model_dir

    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        resolve_model_dir(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="cannot get model 'no-such-org/no-such-model' from the Hugging Face hub"):
        resolve_model_dir("no-such-org/no-such-model")
