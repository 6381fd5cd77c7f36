"""Multi-head latent attention (MLA): deepseek_v2 / v3, minicpm3, glm4_moe_lite.

Each token's keys and values come from one compressed vector: a latent
c (kv_lora_rank, after kv_a_layernorm) and a shared rotary key k_pe
(qk_rope_head_dim). Per head h, with up-projections W_uk[h] (nope x rank)
and W_uv[h] (v_head_dim x rank):

    score  = scale * (q_nope[h] . W_uk[h] c  +  q_pe[h] . k_pe)
           = scale * [q_nope[h] W_uk[h], q_pe[h]] . [c, k_pe]
    output = W_uv[h] (sum_j p_j c_j)

so the cache holds one row [c, k_pe] per token (no heads, no separate V:
the paged primitive reads V as the first kv_lora_rank entries of the same
row, `v_head_dim=kv_lora_rank`), queries are absorbed into latent space and
the attended latent is projected out per head afterwards -- for prefill and
decode alike. deepseek_v3 and glm4_moe_lite carry the absorbed projections
in mlx-lm (`embed_q`, `unembed_out`); deepseek_v2 and minicpm3 carry
`kv_b_proj`, split and absorbed here at load.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.native import ops
from vllm_metal.models.attention_adapter import LayerCacheView


def _dense_weight(linear: nn.Module) -> mx.array:
    """A (possibly MLX-quantized) Linear's weight as a float32 matrix."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, linear.get("biases"), group_size=linear.group_size,
                             bits=linear.bits, mode=getattr(linear, "mode", "affine")).astype(mx.float32)
    return linear.weight.astype(mx.float32)


class Attention(nn.Module):
    def __init__(self, inner: nn.Module, sliding_window: int | None = None):
        super().__init__()
        if sliding_window:
            raise NotImplementedError(f"{type(inner).__name__}: latent attention with a sliding window")
        need = ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "kv_a_proj_with_mqa",
                "kv_a_layernorm", "o_proj", "rope")
        missing = [n for n in need if getattr(inner, n, None) is None]
        if missing:
            raise NotImplementedError(f"latent attention module {type(inner).__name__} lacks {', '.join(missing)}")
        self.inner = inner
        self.sliding_window = None
        self.n_heads = int(inner.num_heads)
        self.rank = int(inner.kv_lora_rank)
        self.nope = int(inner.qk_nope_head_dim)
        self.rope_dims = int(inner.qk_rope_head_dim)
        self.num_kv_heads = 1
        self.head_dim = self.kv_head_dim = self.rank + self.rope_dims  # one latent row per token
        self.kv_layout = "latent"
        self.v_head_dim = self.rank  # V = the first kv_lora_rank entries of the row
        self.owns_kv = True
        self.uses_rope = True
        self.scale = float(getattr(inner, "scale", None) or inner.softmax_scale)
        if getattr(inner, "embed_q", None) is not None and getattr(inner, "unembed_out", None) is not None:
            self.absorbed = None  # mlx-lm's own (possibly quantized) per-head projections
        elif getattr(inner, "kv_b_proj", None) is not None:
            w = _dense_weight(inner.kv_b_proj)  # [heads * (nope + v), rank]
            w = w.reshape(self.n_heads, -1, self.rank)
            if w.shape[1] <= self.nope:
                raise NotImplementedError(f"{type(inner).__name__}: kv_b_proj of shape {tuple(w.shape)} has no "
                                          "value rows")
            dtype = inner.kv_a_layernorm.weight.dtype  # the model's dtype (norms are never quantized)
            self.w_uk = w[:, :self.nope, :].astype(dtype)  # [H, nope, rank]: q_nope -> latent
            self.w_uv_t = mx.contiguous(w[:, self.nope:, :].swapaxes(1, 2)).astype(dtype)  # [H, rank, v]
            del inner["kv_b_proj"]  # absorbed: keeping it would hold the same weights twice
            self.absorbed = True
        else:
            raise NotImplementedError(f"latent attention module {type(inner).__name__} has neither embed_q / "
                                      "unembed_out nor kv_b_proj")

    def rope(self):
        return self.inner.rope

    def _queries(self, x: mx.array) -> mx.array:
        a = self.inner
        if getattr(a, "q_lora_rank", None) is None and getattr(a, "q_proj", None) is not None:
            return a.q_proj(x)
        return a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))

    def __call__(self, x: mx.array, mask=None, cache: LayerCacheView | None = None) -> mx.array:
        a = self.inner
        store, step = cache.store, cache.store.step
        n = x.shape[1]
        x = x.reshape(n, -1)
        q = self._queries(x).reshape(n, self.n_heads, self.nope + self.rope_dims)
        q_nope, q_pe = mx.split(q, [self.nope], axis=-1)
        latent, k_pe = mx.split(a.kv_a_proj_with_mqa(x), [self.rank], axis=-1)
        latent = a.kv_a_layernorm(latent)
        q_pe = a.rope(q_pe[:, :, None, :], offset=step.positions)[:, :, 0, :]
        k_pe = a.rope(k_pe[:, None, None, :], offset=step.positions)[:, :, 0, :]  # [n, 1, rope]

        # Queries into latent space, per head: [H, n, nope] -> [H, n, rank].
        q_nope = q_nope.swapaxes(0, 1)
        q_lat = a.embed_q(q_nope) if self.absorbed is None else q_nope @ self.w_uk.astype(q_nope.dtype)
        q_full = mx.concatenate([q_lat.swapaxes(0, 1), q_pe], axis=-1)  # [n, H, rank + rope]

        layer, group = cache.layer, store.layer_group[cache.layer]
        kc = store.keys[layer]
        row = mx.concatenate([latent[:, None, :], k_pe], axis=-1).astype(kc.dtype)  # [n, 1, rank + rope]
        kc = ops.write_cache(kc, row, step.slot_mappings[group])
        store.keys[layer] = kc
        out = ops.paged_attention(q_full.astype(kc.dtype), kc, kc, step.block_tables[group], step.seq_lens,
                                  step.cu_seqlens_q, scale=self.scale, v_head_dim=self.rank)  # [n, H, rank]
        out = out.astype(x.dtype).swapaxes(0, 1)  # [H, n, rank]
        out = a.unembed_out(out) if self.absorbed is None else out @ self.w_uv_t.astype(out.dtype)
        out = a.o_proj(out.swapaxes(0, 1).reshape(1, n, -1))
        if store.after_layer is not None:
            store.after_layer(out, kc)
        return out
