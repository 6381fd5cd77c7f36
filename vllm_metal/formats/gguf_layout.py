"""llama.cpp's GGUF tensor layout per architecture -> the Hugging Face /
mlx-lm parameter names and values each family's mlx-lm model loads.

What llama.cpp's converter (convert_hf_to_gguf.py) does that is undone here:

* names: `blk.N.attn_q` for `model.layers.N.self_attn.q_proj`, ... (NAMES);
* `llama`: the rows of Q and K permuted for its rope kernel (unpermute_rows);
* `gemma2` / `gemma3`: every RMSNorm weight stored as 1 + w (the HF weight
  is w; norm_offset);
* MoE experts are already stacked [experts, out, in], which is mlx-lm's
  `switch_mlp` layout; `phi3` keeps HF's fused `qkv_proj` / `gate_up_proj`.

An architecture not in ARCHITECTURES, or a tensor name not in NAMES, is
refused with the name (a silently dropped tensor would be a wrong model).
"""

from __future__ import annotations

import re

# GGUF `general.architecture` -> the model_type transformers' GGUF config
# conversion produces (and mlx-lm builds).
ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
}
PERMUTED_QK = {"llama"}  # llama.cpp's LlamaModel converter permutes Q/K rows
NORM_PLUS_ONE = {"gemma2", "gemma3"}

GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Where a family names a block tensor differently.
_BLOCK_BY_ARCH = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_BLOCK_BY_ARCH["gemma3"] = _BLOCK_BY_ARCH["gemma2"]
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"([a-z_0-9]+)\.(weight|bias)$")


class UnsupportedLayout(ValueError):
    pass


def check_architecture(arch: str) -> str:
    if arch not in ARCHITECTURES:
        raise UnsupportedLayout(
            f"GGUF architecture {arch!r} is not mapped by vllm-metal; mapped: {', '.join(sorted(ARCHITECTURES))}. "
            "Serve the model's Hugging Face or MLX checkpoint instead (mlx_lm.convert makes one)")
    return ARCHITECTURES[arch]


def hf_name(arch: str, gguf_name: str) -> str:
    """The mlx-lm parameter name of GGUF tensor `gguf_name`."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        target = _BLOCK_BY_ARCH.get(arch, {}).get(kind) or _BLOCK.get(kind)
        if target is not None:
            return f"model.layers.{layer}.{target}.{suffix}"
    else:
        m = _GLOBAL_RE.match(gguf_name)
        if m and m.group(1) in GLOBAL:
            return f"{GLOBAL[m.group(1)]}.{m.group(2)}"
    raise UnsupportedLayout(f"GGUF tensor {gguf_name!r} of architecture {arch!r} has no known place in the "
                            "model; vllm-metal refuses the file rather than serve it without that tensor")


def permuted_heads(arch: str, gguf_name: str, config: dict) -> int | None:
    """The head count whose rope permutation llama.cpp applied to this
    tensor's rows (undo with unpermute_rows), or None."""
    if arch not in PERMUTED_QK:
        return None
    if ".attn_q." in gguf_name:
        return config["num_attention_heads"]
    if ".attn_k." in gguf_name:
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def unpermute_rows(x, n_heads: int):
    """Undo llama.cpp's `permute` on the rows (output features) of any
    row-major array: float weights, packed quantized words, scales, biases."""
    rows = x.shape[0]
    x = x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
    return x.swapaxes(1, 2).reshape(rows, *x.shape[3:])


def norm_offset(arch: str, gguf_name: str) -> float:
    """What llama.cpp added to this (float) tensor: 1.0 for a gemma norm."""
    return 1.0 if arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight") else 0.0


def reshape_for(arch: str, gguf_name: str, value):
    """Shape fixes where GGUF drops a dimension mlx-lm keeps."""
    if gguf_name.endswith("ffn_gate_inp_shexp.weight") and value.ndim == 1:
        return value.reshape(1, -1)
    return value
