"""ModernBERT in MLX over one packed step of whole prompts: pre-norm layers,
RoPE (one base for global layers, another for local ones), local layers
attending within +-local_attention/2 tokens, GeGLU MLPs, bias-free
LayerNorms by default. Attention runs as in models/bert.py (the
paged-attention primitive, non-causal; a local layer's window is its
sliding window: keys at most local_attention/2 away on either side).
"""

from __future__ import annotations

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from vllm_metal.models.bert import EncoderBatch, LayerNorm, activation, attention  # noqa: E402


def _layer_types(config: dict) -> list[str]:
    types = config.get("layer_types")
    if types:
        return list(types)
    every = config.get("global_attn_every_n_layers", 3)
    return ["sliding_attention" if i % every else "full_attention" for i in range(config["num_hidden_layers"])]


def _rope_base(config: dict, layer_type: str) -> float:
    params = (config.get("rope_parameters") or {}).get(layer_type) or {}
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError(f"ModernBERT rope_type {params['rope_type']!r} is not served (default only)")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if layer_type == "sliding_attention":
        return float(config.get("local_rope_theta", 10000.0))
    return float(config.get("global_rope_theta", 160000.0))


def rope(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """Rotary embedding (halves rotated, not interleaved) of packed
    [tokens, heads, dim] rows, each at its own position."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-mx.arange(half, dtype=mx.float32) / half)
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None]  # [tokens, half]
    cos, sin = (f(angles)[:, None, :].astype(x.dtype) for f in (mx.cos, mx.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ModernBertLayer(nn.Module):
    def __init__(self, config: dict, index: int, layer_type: str):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps, bias = config.get("norm_eps", 1e-5), config.get("norm_bias", False)
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = LayerNorm(hidden, eps=eps, bias=bias) if index else None
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=config.get("attention_bias", False))
        self.Wo = nn.Linear(hidden, hidden, bias=config.get("attention_bias", False))
        self.mlp_norm = LayerNorm(hidden, eps=eps, bias=bias)
        self.Wi = nn.Linear(hidden, 2 * config["intermediate_size"], bias=config.get("mlp_bias", False))
        self.Wo_mlp = nn.Linear(config["intermediate_size"], hidden, bias=config.get("mlp_bias", False))
        self.act = activation(config.get("hidden_activation", "gelu"))
        self.base = _rope_base(config, layer_type)
        # keys less than `window` away: |i - j| <= local_attention / 2
        self.window = config.get("local_attention", 128) // 2 + 1 if layer_type == "sliding_attention" else None

    def __call__(self, h: mx.array, positions: mx.array, batch: EncoderBatch) -> mx.array:
        t = h.shape[0]
        x = self.attn_norm(h) if self.attn_norm is not None else h
        qkv = self.Wqkv(x).reshape(t, 3, self.heads, self.head_dim)
        q, k = (rope(qkv[:, i], positions, self.base) for i in (0, 1))
        a = attention(q, batch.cache(k), batch.cache(qkv[:, 2]), batch, self.head_dim ** -0.5, self.window)
        h = h + self.Wo(a)
        up, gate = mx.split(self.Wi(self.mlp_norm(h)), 2, axis=-1)
        return h + self.Wo_mlp(self.act(up) * gate)


class ModernBertEncoder(nn.Module):
    type_vocab_size = 0  # no token types
    position_offset = 0

    def __init__(self, config: dict):
        super().__init__()
        hidden, eps, bias = config["hidden_size"], config.get("norm_eps", 1e-5), config.get("norm_bias", False)
        self.tok_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.embed_norm = LayerNorm(hidden, eps=eps, bias=bias)
        self.layers = [ModernBertLayer(config, i, t) for i, t in enumerate(_layer_types(config))]
        self.final_norm = LayerNorm(hidden, eps=eps, bias=bias)

    def __call__(self, token_ids: mx.array, positions: mx.array, token_type_ids, batch: EncoderBatch) -> mx.array:
        h = self.embed_norm(self.tok_embeddings(token_ids))
        for layer in self.layers:
            h = layer(h, positions, batch)
        return self.final_norm(h)


def modernbert_weights(hf: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """Hugging Face ModernBERT weights (prefix `model.` stripped) -> ModernBertEncoder's names."""
    rename = {"embeddings.tok_embeddings.": "tok_embeddings.", "embeddings.norm.": "embed_norm.",
              "final_norm.": "final_norm."}
    out = {}
    for k, v in hf.items():
        for a, b in rename.items():
            if k.startswith(a):
                out[b + k[len(a):]] = v
        if k.startswith("layers."):
            i = int(k.split(".")[1])
            if i < num_layers:
                rest = k.split(".", 2)[2]
                rest = {"attn.Wqkv": "Wqkv", "attn.Wo": "Wo", "mlp.Wi": "Wi", "mlp.Wo": "Wo_mlp"}.get(
                    rest.rsplit(".", 1)[0], rest.rsplit(".", 1)[0]) + "." + rest.rsplit(".", 1)[1]
                out[f"layers.{i}.{rest}"] = v
    if "tok_embeddings.weight" not in out:
        raise KeyError("embeddings.tok_embeddings.weight")
    return out
