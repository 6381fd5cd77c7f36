"""Tests for vllm_metal.formats.default_model (GGUF -> MLX/HF model directory)."""

import hashlib
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_metal.formats.default_model as dm  # noqa: E402


def _hashes(path):
    return {
        name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(path))
    }


def test_files_present(model_dir):
    names = set(os.listdir(model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", dm.STAMP_FILE} <= names
    assert not any(n.startswith(".") for n in os.listdir(os.path.dirname(model_dir)))


def test_config_values(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["quantization"]["group_size"] == 32 and cfg["quantization"]["bits"] == 4
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    assert 2 in gen["eos_token_id"]

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    assert hf.model_type == "llama" and hf.num_key_value_heads == 3 and hf.head_dim == 64


def test_weights(model_dir):
    import mlx.core as mx

    w = mx.load(os.path.join(model_dir, "model.safetensors"))
    assert "lm_head.weight" not in w  # tied to the embedding
    q = "model.layers.0.self_attn.q_proj"
    assert w[f"{q}.weight"].dtype == mx.uint32
    assert w[f"{q}.scales"].dtype == mx.float32 and w[f"{q}.biases"].dtype == mx.float32
    assert w["model.norm.weight"].dtype == mx.float32
    assert w[f"{q}.weight"].shape == (576, 576 * 4 // 32)
    assert len([k for k in w if k.endswith("k_proj.scales")]) == 30


def test_tokenizer_offline(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("2024") == [34, 32, 34, 36]  # digits are split one by one
    for text in ["Hello world!", "  spaces\tand\nnewlines ", "café 日本語 🤖", "x = f(1)**2"]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_rebuild_is_reused_and_deterministic(model_dir):
    before = _hashes(model_dir)
    mtime = os.path.getmtime(os.path.join(model_dir, "model.safetensors"))
    assert dm.ensure_default_model(model_dir) == model_dir
    assert os.path.getmtime(os.path.join(model_dir, "model.safetensors")) == mtime  # reused
    assert dm.ensure_default_model(model_dir, force=True) == model_dir
    assert _hashes(model_dir) == before


def test_greedy_chat_answers_paris(model_dir):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tok = mlx_lm.load(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    out = mlx_lm.generate(model, tok, prompt, max_tokens=12, sampler=make_sampler(temp=0.0))
    assert "Paris" in out
