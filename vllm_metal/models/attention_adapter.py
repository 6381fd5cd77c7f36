"""Plugs paged attention into mlx-lm models without rewriting them.

Each layer's mlx-lm `Attention` module is wrapped by `PagedAttentionLayer`,
which reuses the module's own projections, q/k norms and RoPE but writes K/V
into the paged cache (`ops.write_kv`) and attends through
`ops.paged_attention`. The model is called on all of a step's tokens packed
as one row ([1, num_tokens]); every token is rotated at its own position.
Nothing here evaluates: the whole step stays one lazy graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import ops

# Attributes an mlx-lm attention module must have for the paged path.
REQUIRED_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")


@dataclass
class StepAttentionInputs:
    """What every layer needs about the step's batch (built once per step)."""

    positions: mx.array  # int32 [num_tokens], each token's absolute position
    seq_lens: mx.array  # int32 [num_seqs]
    cu_seqlens_q: mx.array  # int32 [num_seqs + 1]
    # Per KV-cache group (layers with different attention specs, e.g. sliding
    # window layers, can have their own block tables).
    block_tables: list[mx.array]  # int32 [num_seqs, max_blocks]
    slot_mappings: list[np.ndarray]  # int64 [num_tokens], host data


@dataclass
class PagedKVCache:
    """The per-layer K/V arrays; layers replace them functionally each step."""

    keys: list[mx.array]
    values: list[mx.array]
    layer_group: list[int]  # KV-cache group of each layer
    step: StepAttentionInputs | None = None
    # Hook for VLLM_METAL_SYNC_PER_LAYER: called with each layer's outputs.
    after_layer: object = field(default=None, repr=False)

    def layer_views(self) -> list["LayerCacheView"]:
        return [LayerCacheView(self, i) for i in range(len(self.keys))]


class LayerCacheView:
    """What an mlx-lm model passes to a layer as its `cache`."""

    def __init__(self, store: PagedKVCache, layer: int):
        self.store = store
        self.layer = layer

    def make_mask(self, *args, **kwargs):
        return None  # masking is inside the paged primitive


def check_rope(rope, head_dim: int) -> None:
    """Refuses a RoPE module that cannot rotate each token of a packed step
    at its own position: the adapter calls it with one offset per token, and
    the result must equal rotating each token alone at its integer position
    (what mlx-lm does). A model that fails this is refused at load, never
    discovered by a user's request (e.g. mlx-lm's DynamicNTKScalingRoPE,
    whose base depends on the call's length)."""
    positions = [3, 17, 1000]
    x = mx.random.normal((len(positions), 2, 1, head_dim), key=mx.random.key(0))
    try:
        packed = rope(x, offset=mx.array(positions, dtype=mx.int32))
        alone = mx.concatenate([rope(x[i:i + 1], offset=p) for i, p in enumerate(positions)])
        mx.eval(packed, alone)
    except Exception as e:  # noqa: BLE001 -- whatever it raises, the answer is "cannot"
        raise NotImplementedError(f"{type(rope).__name__} cannot take per-token positions "
                                  f"({type(e).__name__}: {e})") from e
    if packed.shape != alone.shape or not mx.allclose(packed, alone, rtol=1e-4, atol=1e-4).item():
        raise NotImplementedError(f"{type(rope).__name__} gives different results for per-token positions "
                                  "than for each token alone")


class PagedAttentionLayer(nn.Module):
    """Wraps one mlx-lm attention module (its weights stay where they are)."""

    def __init__(self, inner: nn.Module, sliding_window: int | None = None):
        super().__init__()
        missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(inner, a)]
        if missing:
            raise NotImplementedError(
                f"attention module {type(inner).__module__}.{type(inner).__name__} lacks "
                f"{', '.join(missing)}: its architecture does not fit the paged attention path")
        self.inner = inner
        self.sliding_window = sliding_window

    def __call__(self, x: mx.array, mask=None, cache: LayerCacheView | None = None) -> mx.array:
        a = self.inner
        store, step = cache.store, cache.store.step
        n = x.shape[1]
        x = x.reshape(n, -1)
        q = a.q_proj(x).reshape(n, a.n_heads, -1)
        k = a.k_proj(x).reshape(n, a.n_kv_heads, -1)
        v = a.v_proj(x).reshape(n, a.n_kv_heads, -1)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        # RoPE over a length-1 axis with one offset per token = each token at
        # its own position, whatever sequence it belongs to.
        q = a.rope(q[:, :, None, :], offset=step.positions)[:, :, 0, :]
        k = a.rope(k[:, :, None, :], offset=step.positions)[:, :, 0, :]

        layer, group = cache.layer, store.layer_group[cache.layer]
        kc, vc = ops.write_kv(store.keys[layer], store.values[layer], k.astype(store.keys[layer].dtype),
                              v.astype(store.values[layer].dtype), step.slot_mappings[group])
        store.keys[layer], store.values[layer] = kc, vc
        out = ops.paged_attention(q.astype(kc.dtype), kc, vc, step.block_tables[group], step.seq_lens,
                                  step.cu_seqlens_q, scale=a.scale, sliding_window=self.sliding_window)
        out = a.o_proj(out.reshape(1, n, -1).astype(x.dtype))
        if store.after_layer is not None:
            store.after_layer(out, kc, vc)
        return out
