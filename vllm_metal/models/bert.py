"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: BGE-M3's dense model)
in MLX, over one packed step of whole prompts.

Bidirectional attention, no KV cache: an encoder sees a prompt in one step
(vLLM turns chunked prefill and prefix caching off for encoder-only
models). Everything runs on the packed tokens (no padding); attention is
the paged-attention primitive in its non-causal mode over the step's own
K/V laid out as blocks (`EncoderBatch`: a reshape when prompts fill whole
blocks), one primitive with a CPU and a Metal kernel (docs/pooling.md:
measured against a dense MLX path). The query/key/value projections are
fused into one matmul at load.

Weight names are Hugging Face's (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...); models/encoders.py loads them.
"""

from __future__ import annotations

from vllm_metal.native import ops  # (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

# GELU through vllm-metal's primitive (MLX's CPU erf / tanh run one element
# at a time; on the GPU ops.gelu is MLX's own).
ACTIVATIONS = {
    "gelu": lambda x: ops.gelu(x),
    "gelu_new": lambda x: ops.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximate=True),
    "gelu_fast": lambda x: nn.gelu_fast_approx(x),
    "relu": lambda x: nn.relu(x),
    "silu": lambda x: nn.silu(x),
}


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters) through ops.layer_norm: vllm-metal's
    multi-threaded norm primitive on MLX's CPU device, MLX's fused kernel on
    the GPU."""

    def __call__(self, x: mx.array) -> mx.array:
        return ops.layer_norm(x, self.weight, self.get("bias"), self.eps)


def activation(name: str):
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"encoder activation {name!r} is not served (served: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class EncoderBatch:
    """A packed step of whole prompts laid out for the paged-attention
    primitive: each prompt's keys in consecutive 16-token blocks (block
    table, lengths, cu_seqlens). When every prompt's length is a multiple of
    16 the packed K/V rows already are that layout (a reshape, no copy);
    otherwise `index` gathers each block slot's row (the zero row past the
    last token fills a prompt's partial last block)."""

    BLOCK = 16

    def __init__(self, cu_seqlens: np.ndarray):
        lens = np.diff(cu_seqlens).astype(np.int64)
        self.num_seqs, self.num_tokens = len(lens), int(cu_seqlens[-1])
        blocks = (lens + self.BLOCK - 1) // self.BLOCK
        first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        self.num_blocks = int(blocks.sum())
        table = first[:, None] + np.arange(max(int(blocks.max()), 1))[None, :]
        self.block_tables = mx.array(np.where(table < (first + blocks)[:, None], table, 0).astype(np.int32))
        self.seq_lens = mx.array(lens.astype(np.int32))
        self.cu_seqlens = mx.array(np.asarray(cu_seqlens, np.int32))
        self.index = None
        if (lens % self.BLOCK).any():
            rows = np.repeat(np.arange(self.num_seqs), lens)
            pos = np.arange(self.num_tokens) - np.repeat(cu_seqlens[:-1], lens)
            index = np.full(self.num_blocks * self.BLOCK, self.num_tokens, np.int32)
            index[first[rows] * self.BLOCK + pos] = np.arange(self.num_tokens)
            self.index = mx.array(index)

    def cache(self, x: mx.array) -> mx.array:
        """Packed [tokens, heads, dim] rows -> [blocks, 16, heads, dim]."""
        if self.index is not None:
            x = mx.concatenate([x, mx.zeros((1, *x.shape[1:]), dtype=x.dtype)])[self.index]
        return x.reshape(self.num_blocks, self.BLOCK, *x.shape[1:])

    def split_qkv(self, qkv: mx.array, heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """A fused projection's packed [tokens, 3 * heads * dim] -> q [tokens,
        heads, dim] and the key and value caches, as strided views of it where
        the prompts fill whole blocks (the kernel reads strides: no copies)."""
        t = qkv.shape[0]
        if self.index is None:
            blocks = qkv.reshape(self.num_blocks, self.BLOCK, 3, heads, -1)
            return qkv.reshape(t, 3, heads, -1)[:, 0], blocks[:, :, 1], blocks[:, :, 2]
        q, k, v = (x[:, 0] for x in mx.split(qkv.reshape(t, 3, heads, -1), 3, axis=1))
        return q, self.cache(k), self.cache(v)


def attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, batch: EncoderBatch, scale: float,
              window: int | None = None, one_row_each: bool = False) -> mx.array:
    """Bidirectional attention of packed [tokens, heads, head_dim] query rows
    over their prompt's keys (`batch.cache` / `batch.split_qkv` layout; keys
    less than `window` positions away, when given), through the
    paged-attention primitive's non-causal mode. Returns packed
    [rows, heads * head_dim]. `one_row_each`: q holds one row per prompt
    (with no window a row's keys do not depend on its position)."""
    cu = mx.arange(batch.num_seqs + 1, dtype=mx.int32) if one_row_each else batch.cu_seqlens
    out = ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, cu,
                              scale=scale, sliding_window=window, causal=False)
    return out.reshape(out.shape[0], -1)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.mlp_norm = LayerNorm(hidden, eps=eps)
        self.act = act

    def __call__(self, h: mx.array, batch: EncoderBatch, keep: mx.array | None = None) -> mx.array:
        """The layer's output for every packed row, or with `keep` (one row
        per prompt, in prompt order) for those rows only: every row's keys
        and values, the kept rows' queries, attention output and MLP (the
        same rows as the full layer's: the attention is batch-invariant)."""
        q, k, v = batch.split_qkv(self.qkv(h), self.heads)
        if keep is not None:
            q, h = q[keep], h[keep]
        a = attention(q, k, v, batch, self.head_dim ** -0.5, one_row_each=keep is not None)
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
        self.embed_norm = LayerNorm(hidden, eps=eps)
        act = activation(config.get("hidden_act", "gelu"))
        self.layers = [BertLayer(hidden, config["num_attention_heads"], config["intermediate_size"], eps, act)
                       for _ in range(config["num_hidden_layers"])]

    def __call__(self, token_ids: mx.array, positions: mx.array, token_type_ids: mx.array | None,
                 batch: EncoderBatch, keep: mx.array | None = None) -> mx.array:
        """Final hidden states of every packed row, or with `keep` (a row
        per prompt) of those rows only: the last layer then computes just
        them (what a CLS or last-token pooler reads)."""
        h = self.word_embeddings(token_ids) + self.position_embeddings(positions + self.position_offset)
        types = token_type_ids if token_type_ids is not None else mx.zeros_like(token_ids)
        h = self.embed_norm(h + self.token_type_embeddings(types))
        for layer in self.layers[:-1]:
            h = layer(h, batch)
        return self.layers[-1](h, batch, keep)


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
