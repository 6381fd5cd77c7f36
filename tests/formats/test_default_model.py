"""Tests for vllm_metal.formats.default_model (the GGUF with config and tokenizer beside it)."""

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
    assert {"config.json", dm.GGUF_FILENAME, "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", dm.STAMP_FILE} == names  # no converted weights: served from the GGUF
    assert os.path.realpath(os.path.join(model_dir, dm.GGUF_FILENAME)) == os.path.realpath(dm.gguf_path())
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
    assert "quantization" not in cfg  # the GGUF's tensor types say it
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    assert 2 in gen["eos_token_id"]

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    assert hf.model_type == "llama" and hf.num_key_value_heads == 3 and hf.head_dim == 64


def _mlx_gguf_reference() -> dict:
    """What the default model's weights were before it was served from its
    GGUF: MLX's own GGUF loader (mx.load: Q4_0/Q4_1/Q8_0 as MLX affine) with
    llama.cpp's Q/K row permutation undone -- an independent path to the same
    numbers."""
    import mlx.core as mx

    tensors, meta = mx.load(str(dm.gguf_path()), return_metadata=True)
    heads = {"attn_q": meta["llama.attention.head_count"].item(), "attn_k": meta["llama.attention.head_count_kv"].item()}
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    out = {}
    for name, x in tensors.items():
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".", 2)
            target = f"model.layers.{layer}.{names[kind]}"
        else:
            kind, target = stem, names[stem]
        if kind in heads:
            rows = x.shape[0]
            x = x.reshape(heads[kind], rows // heads[kind] // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        out[f"{target}.{suffix}"] = x if x.dtype == mx.uint32 else x.astype(mx.float32)
    return out


def test_weights_equal_mlx_gguf_loader(model_dir):
    """Served from the GGUF == the MLX-format conversion served before (bit for bit)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from vllm_metal.formats.checkpoint import build_model, open_checkpoint

    checkpoint = open_checkpoint(model_dir)
    assert checkpoint.format == "gguf" and checkpoint.details["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    model, config = build_model(checkpoint)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    got = dict(tree_flatten(model.parameters()))
    want = _mlx_gguf_reference()
    assert set(got) == set(want) and "lm_head.weight" not in got  # tied to the embedding
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(np.array(got[name]), np.array(value)), name
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32


def test_export_mlx_is_the_same_model(model_dir, mlx_model_dir):
    import mlx.core as mx
    import numpy as np

    exported = mx.load(os.path.join(mlx_model_dir, "model.safetensors"))
    want = _mlx_gguf_reference()
    assert set(exported) == set(want)
    assert all(np.array_equal(np.array(exported[k]), np.array(v)) for k, v in want.items())
    cfg = json.load(open(os.path.join(mlx_model_dir, "config.json")))
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8


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
    mtime = os.path.getmtime(os.path.join(model_dir, "config.json"))
    assert dm.ensure_default_model(model_dir) == model_dir
    assert os.path.getmtime(os.path.join(model_dir, "config.json")) == mtime  # reused
    assert dm.ensure_default_model(model_dir, force=True) == model_dir
    assert _hashes(model_dir) == before


def test_greedy_chat_answers_paris(mlx_model_dir):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tok = mlx_lm.load(mlx_model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    out = mlx_lm.generate(model, tok, prompt, max_tokens=12, sampler=make_sampler(temp=0.0))
    assert "Paris" in out
