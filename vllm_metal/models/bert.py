"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: BGE-M3's dense model)
in MLX, over one packed step of whole prompts.

Bidirectional attention, no KV cache: an encoder sees a prompt in one step
(vLLM turns chunked prefill and prefix caching off for encoder-only
models). The projections and MLPs run on the packed tokens (no padding
wasted on matmuls); attention alone gathers the rows into a padded
[sequences, longest, heads, head_dim] batch for MLX's fused scaled-dot-
product attention with a key mask, and scatters the result back
(docs/pooling.md: why this dense path and not a non-causal paged mode).
The query/key/value projections are fused into one matmul at load.

Weight names are Hugging Face's (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...); models/encoders.py loads them.
"""

from __future__ import annotations

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x),
    "gelu_new": lambda x: nn.gelu_approx(x),
    "gelu_pytorch_tanh": lambda x: nn.gelu_approx(x),
    "gelu_fast": lambda x: nn.gelu_fast_approx(x),
    "relu": lambda x: nn.relu(x),
    "silu": lambda x: nn.silu(x),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"encoder activation {name!r} is not served (served: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class PaddedBatch:
    """Where a packed step's tokens sit in a padded [sequences, longest]
    batch: `index` [sequences * longest] gathers packed rows (the row past
    the last token, a zero row, fills the padding), `valid` [tokens]
    gathers them back, `mask` [sequences, 1, 1, longest] marks real keys.
    None of it when every sequence has the same length (a plain reshape)."""

    def __init__(self, cu_seqlens: np.ndarray):
        lens = np.diff(cu_seqlens).astype(np.int64)
        self.num_seqs, self.longest, self.num_tokens = len(lens), int(lens.max()), int(cu_seqlens[-1])
        self.uniform = bool((lens == self.longest).all())
        if self.uniform:
            self.index = self.valid = self.mask = None
            return
        j = np.arange(self.longest)[None, :]
        real = j < lens[:, None]
        index = np.where(real, cu_seqlens[:-1, None] + j, self.num_tokens)
        self.index = mx.array(index.reshape(-1).astype(np.int32))
        self.valid = mx.array(np.flatnonzero(real.reshape(-1)).astype(np.int32))
        self.mask = mx.array(real[:, None, None, :])

    def pad(self, x: mx.array) -> mx.array:
        """[tokens, ...] -> [sequences, longest, ...]"""
        if not self.uniform:
            x = mx.concatenate([x, mx.zeros((1, *x.shape[1:]), dtype=x.dtype)])[self.index]
        return x.reshape(self.num_seqs, self.longest, *x.shape[1:])

    def unpad(self, x: mx.array) -> mx.array:
        """[sequences, longest, ...] -> [tokens, ...]"""
        x = x.reshape(self.num_seqs * self.longest, *x.shape[2:])
        return x if self.uniform else x[self.valid]


def attention(q: mx.array, k: mx.array, v: mx.array, batch: PaddedBatch, scale: float) -> mx.array:
    """Bidirectional attention of packed [tokens, heads, head_dim] rows
    within each sequence. Returns packed [tokens, heads * head_dim]."""
    q, k, v = (batch.pad(t).transpose(0, 2, 1, 3) for t in (q, k, v))  # [seqs, heads, longest, dim]
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=batch.mask)
    out = out.transpose(0, 2, 1, 3)
    return batch.unpad(out.reshape(*out.shape[:2], -1))


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = act

    def __call__(self, h: mx.array, batch: PaddedBatch) -> mx.array:
        t = h.shape[0]
        q, k, v = mx.split(self.qkv(h).reshape(t, 3, self.heads, self.head_dim), 3, axis=1)
        a = attention(q[:, 0], k[:, 0], v[:, 0], batch, self.head_dim ** -0.5)
        h = self.attn_norm(h + self.attn_out(a))
        return self.mlp_norm(h + self.down(self.act(self.up(h))))


class BertEncoder(nn.Module):
    """Embeddings (word + position + token type, LayerNorm) and post-norm
    layers; `position_offset`: RoBERTa's positions start at pad id + 1."""

    def __init__(self, config: dict, position_offset: int = 0):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.position_offset = position_offset
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.type_vocab_size = config.get("type_vocab_size", 2)
        self.token_type_embeddings = nn.Embedding(max(self.type_vocab_size, 1), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        act = activation(config.get("hidden_act", "gelu"))
        self.layers = [BertLayer(hidden, config["num_attention_heads"], config["intermediate_size"], eps, act)
                       for _ in range(config["num_hidden_layers"])]

    def __call__(self, token_ids: mx.array, positions: mx.array, token_type_ids: mx.array | None,
                 batch: PaddedBatch) -> mx.array:
        h = self.word_embeddings(token_ids) + self.position_embeddings(positions + self.position_offset)
        types = token_type_ids if token_type_ids is not None else mx.zeros_like(token_ids)
        h = self.embed_norm(h + self.token_type_embeddings(types))
        for layer in self.layers:
            h = layer(h, batch)
        return h


def bert_weights(hf: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """Hugging Face BERT/RoBERTa encoder weights (prefix already stripped)
    -> BertEncoder's names, q/k/v concatenated. Raises KeyError naming the
    first missing tensor."""
    out = {"word_embeddings.weight": hf["embeddings.word_embeddings.weight"],
           "position_embeddings.weight": hf["embeddings.position_embeddings.weight"],
           "embed_norm.weight": hf["embeddings.LayerNorm.weight"],
           "embed_norm.bias": hf["embeddings.LayerNorm.bias"]}
    if "embeddings.token_type_embeddings.weight" in hf:
        out["token_type_embeddings.weight"] = hf["embeddings.token_type_embeddings.weight"]
    for i in range(num_layers):
        p, q = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            out[q + "qkv." + kind] = mx.concatenate(
                [hf[p + f"attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
            out[q + "attn_out." + kind] = hf[p + "attention.output.dense." + kind]
            out[q + "attn_norm." + kind] = hf[p + "attention.output.LayerNorm." + kind]
            out[q + "up." + kind] = hf[p + "intermediate.dense." + kind]
            out[q + "down." + kind] = hf[p + "output.dense." + kind]
            out[q + "mlp_norm." + kind] = hf[p + "output.LayerNorm." + kind]
    return out
