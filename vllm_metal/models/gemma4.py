"""gemma4_text (dense and MoE): what its attention adds to the generic path.

- Head sizes differ per layer: sliding layers use `head_dim`, full layers
  `global_head_dim` (and, with keys-as-values, `num_global_key_value_heads`),
  so the two kinds of layers have caches of different shapes (the runner
  gives each layer its own spec; vLLM groups them).
- Keys as values (`attention_k_eq_v`, full layers): V = v_norm(k_proj(x)),
  K = RoPE(k_norm(k_proj(x))).
- Every layer normalizes V without a scale (`v_norm`), queries and keys per
  head (`q_norm`, `k_norm`); the softmax scale is 1.
- KV sharing: the last `num_kv_shared_layers` layers have no K/V projections
  and read the cache of the last earlier layer of their kind; mlx-lm's
  decoder routes each layer's returned "kvs" to them. Here a layer returns
  its own index as that token, so the shared layer attends over the source
  layer's paged cache, already written this step.
- Per-layer input embeddings and the MoE block are mlx-lm's own decoder code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.native import ops
from vllm_metal.models.attention_adapter import LayerCacheView


class Attention(nn.Module):
    def __init__(self, inner: nn.Module, sliding_window: int | None = None):
        super().__init__()
        self.inner = inner
        self.sliding_window = sliding_window
        self.n_heads = int(inner.n_heads)
        self.num_kv_heads = int(inner.n_kv_heads)
        self.head_dim = self.kv_head_dim = int(inner.head_dim)
        self.rope_dims = self.head_dim
        self.kv_layout = "kv"
        self.owns_kv = bool(inner.has_kv)
        self.k_eq_v = bool(inner.use_k_eq_v)
        self.uses_rope = True
        self.has_sinks = False
        self.scale = float(inner.scale)
        self.softcap = None

    def rope(self):
        return self.inner.rope

    def __call__(self, x: mx.array, mask=None, cache: LayerCacheView | None = None, shared_kv=None, offset=None):
        a = self.inner
        store, step = cache.store, cache.store.step
        n = x.shape[1]
        x = x.reshape(n, -1)
        q = a.q_norm(a.q_proj(x).reshape(n, self.n_heads, self.head_dim))
        q = a.rope(q[:, :, None, :], offset=step.positions)[:, :, 0, :]
        layer = cache.layer
        if self.owns_kv:
            k = a.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else a.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
            k = a.rope(a.k_norm(k)[:, :, None, :], offset=step.positions)[:, :, 0, :]
            v = a.v_norm(v)
            group = store.layer_group[layer]
            kc, vc = store.write(layer, k, v, step.slot_mappings[group])
            source = layer
        else:
            source = shared_kv
            if not isinstance(source, int) or store.keys[source] is None:
                raise RuntimeError(f"gemma4 layer {layer} shares K/V but was routed {shared_kv!r}, not an earlier "
                                   "layer with a cache")
            kc, vc = store.keys[source], store.values[source]
        group = store.layer_group[source]
        q, cache_args = store.query(q)
        out = ops.paged_attention(q, kc, vc, step.block_tables[group], step.seq_lens,
                                  step.cu_seqlens_q, scale=self.scale, sliding_window=self.sliding_window, **cache_args)
        out = a.o_proj(out.reshape(1, n, -1).astype(x.dtype))
        if store.after_layer is not None and self.owns_kv:
            store.after_layer(out, kc, vc)
        return out, source, offset
