"""qwen3_next (and qwen3_5 / qwen3_5_moe, whose mlx-lm code imports this very
attention class): what its full-attention layers add to the generic path.

The query projection carries an output gate beside the queries (per head:
[queries | gate]); the attention output is multiplied by sigmoid(gate)
before o_proj. q/k norms per head and partial RoPE are the generic
adapter's. (Its Gated DeltaNet layers are models/gated_delta.py's.)
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.native import ops
from vllm_metal.models.attention_adapter import LayerCacheView, PagedAttentionLayer


class Attention(PagedAttentionLayer):
    def __init__(self, inner, sliding_window: int | None = None):
        super().__init__(inner, sliding_window)
        if inner.q_proj.weight.shape[0] != 2 * self.n_heads * self.head_dim:
            raise NotImplementedError(f"{type(inner).__name__}: q_proj of {inner.q_proj.weight.shape[0]} rows is not "
                                      f"{self.n_heads} heads of {self.head_dim} queries plus their gates")

    def __call__(self, x: mx.array, mask=None, cache: LayerCacheView | None = None) -> mx.array:
        a = self.inner
        store, step = cache.store, cache.store.step
        n = x.shape[1]
        x = x.reshape(n, -1)
        q, gate = mx.split(a.q_proj(x).reshape(n, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        k = a.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
        v = a.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
        q, k = a.q_norm(q), a.k_norm(k)
        q, k = self.apply_rope(q, k, step)
        layer, group = cache.layer, store.layer_group[cache.layer]
        kc, vc = store.write(layer, k, v, step.slot_mappings[group])
        q, cache_args = store.query(q)
        out = ops.paged_attention(q, kc, vc, step.block_tables[group], step.seq_lens,
                                  step.cu_seqlens_q, scale=self.scale, sliding_window=self.sliding_window, **cache_args)
        out = out.reshape(n, -1).astype(x.dtype) * mx.sigmoid(gate.reshape(n, -1))
        out = a.o_proj(out[None])
        if store.after_layer is not None:
            store.after_layer(out, kc, vc)
        return out
