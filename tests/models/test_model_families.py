"""Weight formats and dtypes through the plugin, each equal to mlx-lm's own
greedy generation on the same weights and dtype, and the load-time refusals
(families are proven one by one in test_family_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from engine_helpers import GOLDEN, engine, greedy
from model_variants import float32_weights, make_variant

from vllm_metal.models.attention_adapter import PagedAttentionLayer
from vllm_metal.models.loader import load_model

PROMPTS = [GOLDEN[0]["prompt_ids"], GOLDEN[4]["prompt_ids"], GOLDEN[7]["prompt_ids"]]
NUM_TOKENS = 16
# The whole 30-layer model in half precision or MLX-quantized, whose reference (mlx-lm on
# MLX's CPU device: no BLAS for these) costs a second a token: fewer tokens.
SLOW_TOKENS = 8


def mlx_lm_greedy(model_dir, dtype=mx.float32, dequantize=False, num_tokens=NUM_TOKENS):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(Path(model_dir))
    if dequantize:
        model = dequantize_model(model)
    model.set_dtype(dtype)
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=num_tokens,
                                               sampler=lambda x: mx.argmax(x, axis=-1))] for p in PROMPTS]


@pytest.fixture(scope="module")
def weights(mlx_model_dir):
    return float32_weights(mlx_model_dir)


@pytest.fixture(scope="module")
def whole_variant(model_dir, weights, tmp_path_factory):
    # All 30 layers: half precision needs the real model's peaked logits
    # (a truncated model's near-ties flip in bf16 after a dozen tokens). Written once (540 MB):
    # each dtype is chosen at load.
    return make_variant(model_dir, tmp_path_factory.mktemp("whole") / "llama", "llama", weights, layers=30)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_mlx_lm(whole_variant, dtype):
    variant = whole_variant
    with engine(variant, dtype=dtype) as llm:
        tokens, _ = greedy(llm, PROMPTS, SLOW_TOKENS)
    assert tokens == mlx_lm_greedy(variant, dtype=getattr(mx, dtype), num_tokens=SLOW_TOKENS)


def test_mlx_quantized_weights_kept_quantized(model_dir, mlx_model_dir, monkeypatch):
    # The embedded model's GGUF is Q4_1 (Q8_0 embedding), kept as MLX 4-bit / 8-bit;
    # served without expanding the weights it must match mlx-lm on the MLX-format copy.
    monkeypatch.setenv("VLLM_METAL_DEQUANTIZE", "0")
    with engine(model_dir) as llm:
        tokens, _ = greedy(llm, PROMPTS, SLOW_TOKENS)
    assert tokens == mlx_lm_greedy(mlx_model_dir, num_tokens=SLOW_TOKENS)


def test_unknown_architecture_is_a_clear_error(model_dir, tmp_path):
    from vllm_metal.models.registry import UnservedModelError

    variant = Path(make_variant(model_dir, tmp_path / "x", "llama", {}))
    config = json.loads((variant / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**config, "model_type": "nosucharch"}))
    with pytest.raises(UnservedModelError, match="model type 'nosucharch' is not served"):
        load_model(variant)  # refused before anything is built
    del config["hidden_size"]  # a served family whose config mlx-lm cannot build
    (variant / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="mlx-lm cannot build model type 'llama'.*hidden_size"):
        load_model(variant)


def test_attention_without_projections_is_a_clear_error():
    import mlx.nn as nn

    class OddAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

    with pytest.raises(NotImplementedError, match="lacks q_proj, k_proj, v_proj, o_proj, n_heads, n_kv_heads"):
        PagedAttentionLayer(OddAttention())


def test_missing_model_and_offline_hub_id_are_clear_errors(tmp_path, monkeypatch):
    from vllm_metal.formats.model_dir import resolve_model_dir

    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        resolve_model_dir(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="cannot get model 'no-such-org/no-such-model' from the Hugging Face hub"):
        resolve_model_dir("no-such-org/no-such-model")


def _with_rope_scaling(model_dir, tmp_path, weights, scaling, layers=2):
    variant = Path(make_variant(model_dir, tmp_path / scaling["type"], "llama",
                                {k: v for k, v in weights.items()}, layers=layers))
    config = json.loads((variant / "config.json").read_text())
    config["rope_scaling"] = scaling
    (variant / "config.json").write_text(json.dumps(config))
    return variant


def test_dynamic_ntk_rope_is_refused_at_load(model_dir, weights, tmp_path):
    # mlx-lm's DynamicNTKScalingRoPE takes one integer offset per call (its
    # base depends on the call's length); per-token positions cannot be served
    # the same way, so the model is refused with the reason -- at load, and
    # through vLLM before any request.
    variant = _with_rope_scaling(model_dir, tmp_path, weights, {"type": "dynamic", "factor": 2.0})
    message = r"model type 'llama' with rope scaling .*dynamic.* cannot be served .*DynamicNTKScalingRoPE"
    with pytest.raises(NotImplementedError, match=message):
        load_model(variant)
    with pytest.raises(Exception, match="DynamicNTKScalingRoPE"):
        with engine(str(variant)):
            pass


@pytest.mark.parametrize("scaling", [
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024, "type": "llama3"},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
])
def test_rope_variants_take_per_token_positions(model_dir, weights, tmp_path, scaling):
    from vllm_metal.models.attention_adapter import check_rope

    model = load_model(_with_rope_scaling(model_dir, tmp_path, weights, scaling))
    check_rope(model.model.layers[0].self_attn.rope(), model.layer_kv[0].head_dim)  # the load ran it too


def test_warm_up_failure_stops_start_up_with_the_model_named(model_dir, monkeypatch):
    # Whatever breaks in a multi-row, multi-token step shows at start-up.
    from vllm_metal.models import attention_adapter

    real = attention_adapter.PagedAttentionLayer.__call__

    def broken(self, x, mask=None, cache=None):
        if x.shape[1] > 1:
            raise ValueError("cannot do several tokens")
        return real(self, x, mask, cache)

    monkeypatch.setattr(attention_adapter.PagedAttentionLayer, "__call__", broken)
    with pytest.raises(Exception, match="cannot serve .*warm-up step .*cannot do several tokens"):
        with engine(model_dir):
            pass


def test_unproven_family_is_refused_not_served_wrong(model_dir, tmp_path):
    # minicpm loads in mlx-lm and its attention fits the adapter, but no
    # parity test proves it (vLLM cannot read its config offline): refused,
    # with the family named.
    from mlx.utils import tree_flatten
    from mlx_lm.models import minicpm

    from vllm_metal.models.registry import SERVED, UnservedModelError

    args = dict(model_type="minicpm", hidden_size=64, dim_model_base=32, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=49152, num_key_value_heads=2, scale_depth=1.4,
                scale_emb=6.0)
    out = tmp_path / "minicpm"
    out.mkdir()
    model = minicpm.Model(minicpm.ModelArgs(**args))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps({**args, "architectures": ["MiniCPMForCausalLM"]}))
    with pytest.raises(UnservedModelError, match=r"model type 'minicpm' is not served by vllm-metal yet.*"
                                                 r"Served: cohere, .*llama, .*qwen3"):
        load_model(out)
    assert "minicpm" not in SERVED


def test_doctor_says_up_front_whether_a_model_is_served(model_dir, weights, tmp_path, capsys):
    from vllm_metal.doctor import cli

    assert cli.main(["doctor", "--model", model_dir]) == 0
    assert "(llama): will be served: 30 layers, 3 KV heads of 64" in capsys.readouterr().out
    variant = _with_rope_scaling(model_dir, tmp_path, weights, {"type": "dynamic", "factor": 2.0})
    assert cli.main(["doctor", "--model", str(variant)]) == 1
    out = capsys.readouterr().out
    assert "(llama): refused: " in out and "DynamicNTKScalingRoPE" in out
    (variant / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert cli.main(["doctor", "--model", str(variant)]) == 1
    assert "(mamba): refused: UnservedModelError: model type 'mamba' is not served" in capsys.readouterr().out
