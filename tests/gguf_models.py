"""Tiny random-weight GGUF files written as llama.cpp's converter writes them
(convert_hf_to_gguf.py: its tensor names, `llama`'s Q/K row permutation,
gemma's norms stored as 1 + w, its metadata keys), with the `gguf`
package's writer and quantizers, plus Q4_K and Q6_K encoders of our own (the
`gguf` package dequantizes K-quants but does not write them; the references
dequantize whatever bytes are written with the `gguf` package, so an
encoder's rounding choices cannot make a test pass).

`write(model_type, out, tokenizer_gguf, recipe)` returns (gguf path, the
mlx-lm float weights the file dequantizes to, config).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

COMMON = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=4096, tie_word_embeddings=False)
# model_type -> (GGUF architecture, config overrides): plain configs that
# llama.cpp's metadata expresses (its per-family constants included).
MODELS = {
    "llama": ("llama", dict(attention_bias=False, mlp_bias=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict()),
    "qwen3_moe": ("qwen3moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "gemma3_text": ("gemma3", dict(num_hidden_layers=7, sliding_window=16, sliding_window_pattern=6,
                                   query_pre_attn_scalar=64, rope_local_base_freq=10000.0, rope_scaling=None,
                                   tie_word_embeddings=True)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=64, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                              tie_word_embeddings=True)),
    "qwen2_moe": ("qwen2moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                   shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                                   norm_topk_prob=False)),
}
# GGUF block tensor name <- mlx-lm module (inverse of llama.cpp's naming).
BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
GEMMA_BLOCK = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


# GGML types served re-quantized (vllm_metal.formats.gguf_quants.REQUANT_BITS):
# the reference weights are what MLX's own quantizer makes of the file's
# values; the loss against the file's values is measured on its own.
REQUANTIZED = {"Q6_K": 8}


def config_of(model_type: str) -> dict:
    return {**COMMON, **MODELS[model_type][1], "model_type": model_type, "vocab_size": 49152}


def random_model(config: dict, seed: int = 0) -> dict:
    """mlx-lm float32 weights of the family, scaled as tests/families.py scales them."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(config))
    model = model_class(args_class.from_dict(dict(config)))
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:
            w = rng.standard_normal(value.shape) / np.sqrt(value.shape[-1])
            if "embed_tokens" in name or "lm_head" in name:
                w *= 4.0
        else:
            w = np.array(value) + 0.05 * rng.standard_normal(value.shape)
        out[name] = w.astype(np.float32)
    if config.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)  # gemma3_text's module has one either way
    return out


# -- K-quant encoders (the layouts of ggml-quants.c) ----------------------------

def _f16(x):
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _k_quant(w: np.ndarray, top: int):
    """Q4_K / Q5_K's shared part: per 32-value group an unsigned q in [0, top]
    with w = d*sc*q - dmin*m, and the 12 bytes of 6-bit (sc, m) pairs as
    get_scale_min_k4 reads them. Returns (d, dmin, packed scales, q [n, 8, 32])."""
    v = w.reshape(-1, 8, 32).astype(np.float32)  # super-blocks of 8 groups
    lo = np.minimum(v.min(axis=2), 0)
    scale = np.maximum((v.max(axis=2) - lo) / top, 1e-8)
    d = np.maximum(scale.max(axis=1) / 63, 1e-8).astype(np.float16).astype(np.float32)
    dmin = np.maximum((-lo).max(axis=1) / 63, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.rint((v + (dmin[:, None] * mn)[..., None]) / (d[:, None] * sc)[..., None]), 0, top).astype(np.uint8)
    packed = np.zeros((len(v), 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return d, dmin, packed, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """(rows, n) float -> Q4_K blocks (rows, n / 256 * 144) uint8."""
    d, dmin, packed, q = _k_quant(w, 15)
    chunks = q.reshape(-1, 4, 2, 32)  # chunk j: groups 2j (low nibbles) and 2j + 1 (high)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """(rows, n) float -> Q5_K blocks (rows, n / 256 * 176) uint8: Q4_K's
    scales, a fifth bit per value in qh (bit g: group g)."""
    d, dmin, packed, groups = _k_quant(w, 31)
    qs = ((groups[:, 0::2] & 15) | ((groups[:, 1::2] & 15) << 4)).reshape(-1, 128)
    qh = np.zeros((len(groups), 32), np.uint8)
    for g in range(8):
        qh |= (groups[:, g] >> 4) << g
    return np.concatenate([_f16(d), _f16(dmin), packed, qh, qs], axis=1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """(rows, n) float -> Q6_K blocks (rows, n / 256 * 210) uint8."""
    v = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.maximum(np.abs(v).max(axis=2) / 31, 1e-8)
    d = np.maximum(scale.max(axis=1) / 127, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
    q = (np.clip(np.rint(v / (d[:, None] * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1).reshape(w.shape[0], -1)


def encode(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(bytes or float array, GGMLQuantizationType) of `w` in `type_name`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), qtype
    if type_name == "F16":
        return w.astype(np.float16), qtype
    lead = w.shape[:-1]
    flat = w.reshape(-1, w.shape[-1])
    if type_name == "Q4_K":
        data = quantize_q4_k(flat)
    elif type_name == "Q5_K":
        data = quantize_q5_k(flat)
    elif type_name == "Q6_K":
        data = quantize_q6_k(flat)
    else:
        data = gguf.quants.quantize(flat.astype(np.float32), qtype)
    return data.reshape(*lead, -1), qtype


def dequantized(data: np.ndarray, qtype, shape) -> np.ndarray:
    """The `gguf` package's float32 values of what was written."""
    import gguf

    if qtype.name in ("F32", "F16"):
        return np.asarray(data, np.float32).reshape(shape)
    return gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(shape)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` of Q / K rows (any trailing shape)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(model_type: str, name: str) -> str:
    module, suffix = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        table = {**BLOCK, **GEMMA_BLOCK} if model_type.startswith("gemma") else BLOCK
        return f"blk.{layer}.{table[rest]}.{suffix}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[module] + "." + suffix


def write(model_type: str, out: Path, tokenizer_gguf: str, recipe, seed: int = 0,
          config_json: bool = False) -> SimpleNamespace:
    """A GGUF of the tiny `model_type` model at out / model.gguf. recipe:
    mlx-lm name -> GGML type name for 2-D+ tensors (norms stay F32).
    Returns path; served: the file's values, re-quantized types as MLX
    re-quantizes them; exact: the file's own values; original: the float
    weights it was written from; config."""
    import gguf

    from vllm_metal.formats.gguf_file import GGUFFile

    arch = MODELS[model_type][0]
    config = config_of(model_type)
    weights = random_model(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {model_type}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config["head_dim"]
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * config["partial_rotary_factor"]))
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if "num_experts" in config:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if "attn_logit_softcapping" in config:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    tok = GGUFFile(tokenizer_gguf).metadata
    writer.add_tokenizer_model(tok["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    writer.add_token_list(tok["tokenizer.ggml.tokens"])
    writer.add_token_types(tok["tokenizer.ggml.token_type"])
    writer.add_token_merges(tok["tokenizer.ggml.merges"])
    writer.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(tok["tokenizer.chat_template"])
    served, exact = {}, {}
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    for name in sorted(weights):
        w = weights[name]
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]
        stored = w
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            stored = w + np.float32(1.0)  # llama.cpp stores gemma's 1 + w
        if arch == "llama" and module in heads:
            stored = _permute(stored, heads[module])
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp writes this [1, hidden] gate as a vector
            stored = stored.reshape(-1)
        type_name = recipe(name, w) if stored.ndim >= 2 else "F32"
        data, qtype = encode(stored, type_name)
        writer.add_tensor(gguf_name(model_type, name), data, raw_shape=data.shape if qtype.name in ("F32", "F16")
                          else None, raw_dtype=qtype)
        back = dequantized(data, qtype, stored.shape)
        if arch == "llama" and module in heads:  # what the file means: llama.cpp's permutation undone
            back = _unpermute(back, heads[module])
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            back = back - np.float32(1.0)
        exact[name] = back
        if qtype.name in REQUANTIZED:  # served as MLX affine at REQUANTIZED bits: MLX's own quantizer says how
            bits = REQUANTIZED[qtype.name]
            back = np.array(mx.dequantize(*mx.quantize(mx.array(back), group_size=32, bits=bits), group_size=32,
                                          bits=bits))
        served[name] = back.reshape(w.shape)
        exact[name] = exact[name].reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if config_json:
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return SimpleNamespace(path=path, served=served, exact=exact, original=weights, config=config)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_model(config: dict, weights: dict):
    """mlx-lm's float32 model of `config` holding `weights` (numpy)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(config))
    model = model_class(args_class.from_dict(dict(config)))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    if hasattr(model, "sanitize"):  # gemma3_text: a tied head is decided here
        arrays = model.sanitize(arrays)
    model.load_weights(list(arrays.items()), strict=True)
    return model
