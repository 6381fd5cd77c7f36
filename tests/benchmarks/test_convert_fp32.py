"""The float32 converter, on a tiny MLX-quantized llama it builds itself."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import convert_fp32


def test_fp32_config_drops_quantization():
    cfg = convert_fp32.fp32_config({"model_type": "llama", "quantization": {"bits": 4},
                                    "quantization_config": {"bits": 4}, "dtype": "bfloat16"})
    assert cfg == {"model_type": "llama", "torch_dtype": "float32"}


@pytest.fixture
def tiny_quantized_model(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": 96, "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"]}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model, config = quantize_model(model, config, group_size=32, bits=4)
    src = tmp_path / "q4"
    save_model(src, model)
    save_config(config, src / "config.json")
    (src / "tokenizer.json").write_text("{}")
    return src, dict(tree_flatten(model.parameters()))


def test_convert_dequantizes_to_float32_with_hf_names(tiny_quantized_model, tmp_path):
    src, quantized = tiny_quantized_model
    out = convert_fp32.convert(src, tmp_path / "fp32")
    weights = mx.load(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    # Independent reference: MLX's affine dequantization of the stored groups.
    expected = mx.dequantize(quantized[f"{name}.weight"], quantized[f"{name}.scales"],
                             quantized[f"{name}.biases"], group_size=32, bits=4)
    assert weights[f"{name}.weight"].dtype == mx.float32
    assert mx.allclose(weights[f"{name}.weight"], expected).item()
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").exists()


def test_convert_is_skipped_when_up_to_date(tiny_quantized_model, tmp_path):
    src, _ = tiny_quantized_model
    out = convert_fp32.convert(src, tmp_path / "fp32")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    convert_fp32.convert(src, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    convert_fp32.convert(src, out, force=True)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
