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

from vllm_metal.models.kv_store import LayerArrays, PagedKVCache  # noqa: F401  (re-exported)
from vllm_metal.native import ops


@dataclass
class StepAttentionInputs:
    """What every layer needs about the step's batch (built once per step)."""

    positions: mx.array  # int32 [num_tokens], each token's absolute position
    seq_lens: mx.array  # int32 [num_seqs]
    cu_seqlens_q: mx.array  # int32 [num_seqs + 1]
    # Per KV-cache group (layers with different attention specs, e.g. sliding
    # window layers, can have their own block tables).
    block_tables: list[mx.array]  # int32 [num_seqs, max_blocks]
    # Per group: each token's cache slot, checked and converted once per step.
    slot_mappings: list[ops.SlotMapping]
    # Hybrid models: the rows as a padded batch for linear-attention layers
    # (models/state_slots.LinearStepInputs), else None.
    linear: object = None
    # RoPE (cos, sin) tables of this step by plan key (models/cpu_norm_rope.py),
    # computed by the first layer that needs one and shared by the others.
    rope_tables: dict = field(default_factory=dict)
    # M-RoPE models with images in the step (multimodal/mrope.py): int32 [3,
    # num_tokens], each token's temporal / height / width position; None: the
    # positions above in all three streams.
    mrope_positions: mx.array | None = None
    # Images attended both ways (Gemma 3, vLLM's mm prefix LM): the image
    # tokens' rows re-attended as sequences of their own that end at their
    # image's last token, without the causal limit (ImageSpans).
    image_spans: object = None


@dataclass
class ImageSpans:
    """The query rows of a step that attend to their whole image: `rows`
    int32 [m] (packed token indices), grouped into one sequence per image
    span (cu_seqlens [spans + 1]) whose context ends at the span's last
    token (seq_lens [spans]), reading its request's block table row
    (`table_rows` [spans])."""

    rows: mx.array
    cu_seqlens: mx.array
    seq_lens: mx.array
    table_rows: mx.array


def attend_image_spans(out: mx.array, q: mx.array, kc: mx.array, vc: mx.array, block_tables: mx.array,
                       spans: ImageSpans, **kwargs) -> mx.array:
    """The causal attention output `out` [tokens, heads, dim] with the rows
    of image tokens replaced by attention to their whole image (and
    everything before it): each span is a sequence of its own ending at the
    image's last token, attended without the causal limit (`causal=False`:
    every key below its end; with a sliding window, those less than the
    window away on either side, as vLLM's prefix-LM ranges within a window)."""
    both_ways = ops.paged_attention(q[spans.rows], kc, vc, block_tables[spans.table_rows], spans.seq_lens,
                                    spans.cu_seqlens, causal=False, **kwargs)
    out[spans.rows] = both_ways.astype(out.dtype)
    return out


def merged_rope_table(tables: list[mx.array], streams: mx.array) -> mx.array:
    """M-RoPE: three (cos, sin) tables [tokens, half, 2], one per position
    stream (temporal, height, width) -> one, each frequency from its stream
    (`streams` int32 [half]: 0, 1 or 2)."""
    s = streams.reshape(1, -1, 1)
    return mx.where(s == 0, tables[0], mx.where(s == 1, tables[1], tables[2]))


class LayerCacheView:
    """What an mlx-lm model passes to a layer as its `cache`."""

    def __init__(self, store: PagedKVCache, layer: int):
        self.store = store
        self.layer = layer

    # mlx-lm models read `cache.offset` (the first new token's position in
    # their one-sequence cache) to build masks and RoPE offsets. The paged
    # path replaces both -- masks live in the primitive, RoPE rotates each
    # token at its own position in the adapter -- so 0 is what such code
    # sees. A family that uses the offset for anything else gets its own
    # module (ministral3's query scale); its parity test is what proves it.
    offset = 0

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


def _first(module: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if getattr(module, n, None) is not None), None)


# What mlx-lm families call each piece (first match wins).
ALIASES = {
    "n_heads": ("n_heads", "num_heads", "num_attention_heads"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads", "num_kv_heads"),
    "o_proj": ("o_proj", "dense", "out_proj"),  # phi's dense, lfm2's out_proj
    "scale": ("scale", "sm_scale", "softmax_scale"),
    "q_norm": ("q_norm", "q_layernorm"),  # before RoPE (stablelm's name)
    "k_norm": ("k_norm", "k_layernorm"),
}


class PagedAttentionLayer(nn.Module):
    """Wraps one mlx-lm attention module (its weights stay where they are),
    taking from it exactly what its own attention does: projections (separate
    or packed, with their biases), q/k norms per head or over the projection, before RoPE or
    after it, its RoPE (or none on NoPE layers), scale and logit softcap."""

    def __init__(self, inner: nn.Module, sliding_window: int | None = None):
        super().__init__()
        names = {key: _first(inner, options) for key, options in ALIASES.items()}
        # phi3 packs q, k and v into one projection (split [H*D, KV*D, KV*D]).
        self.packed_qkv = getattr(inner, "q_proj", None) is None and getattr(inner, "qkv_proj", None) is not None
        missing = [] if self.packed_qkv else [a for a in ("q_proj", "k_proj", "v_proj")
                                              if getattr(inner, a, None) is None]
        missing += [key for key in ("o_proj", "n_heads", "n_kv_heads") if names[key] is None]
        if missing:
            raise NotImplementedError(
                f"attention module {type(inner).__module__}.{type(inner).__name__} lacks "
                f"{', '.join(missing)}: its architecture does not fit the paged attention path")
        self.inner = inner
        self.sliding_window = sliding_window
        self._names = names
        self.kv_layout = "kv"  # separate K and V caches [blocks, block_size, kv_heads, head_dim]
        self.owns_kv = True  # writes its own K/V (gemma4's shared layers read an earlier layer's)
        self.n_heads = int(getattr(inner, names["n_heads"]))
        self.num_kv_heads = int(getattr(inner, names["n_kv_heads"]))
        q_rows = inner.qkv_proj.weight.shape[0] if self.packed_qkv else inner.q_proj.weight.shape[0]
        self.head_dim = int(getattr(inner, "head_dim", None) or q_rows // self.n_heads)
        if self.packed_qkv and q_rows != (self.n_heads + 2 * self.num_kv_heads) * self.head_dim:
            raise NotImplementedError(f"{type(inner).__name__}: a packed qkv_proj of {q_rows} rows does not split "
                                      f"into {self.n_heads} + 2 x {self.num_kv_heads} heads of {self.head_dim}")
        # The K/V cache's head size (K's output rows per KV head).
        self.kv_head_dim = self.head_dim if self.packed_qkv else inner.k_proj.weight.shape[0] // self.num_kv_heads
        self.scale = float(getattr(inner, names["scale"])) if names["scale"] else self.head_dim ** -0.5
        # gemma2's attention logit softcap: tanh(s / c) * c on the scaled
        # scores, as the primitive's `softcap` does.
        self.softcap = getattr(inner, "attn_logit_softcapping", None)
        # gpt_oss's attention sinks: one learned logit per query head that
        # joins the softmax denominator (the primitive's `sinks`).
        sinks = getattr(inner, "sinks", None)
        if sinks is not None and tuple(sinks.shape) != (self.n_heads,):
            raise NotImplementedError(f"{type(inner).__name__}: sinks of shape {tuple(sinks.shape)}, expected "
                                      f"one per query head ({self.n_heads})")
        self.has_sinks = sinks is not None
        # NoPE layers: exaone4's global layers have no `rope`; cohere2 keeps a
        # `rope` but applies it on its sliding layers only.
        rope = getattr(inner, "rope", None)
        if getattr(inner, "use_sliding_window", True) is False:
            rope = None
        # A `rope` attribute set to None says NoPE too (granitemoehybrid's
        # position_embedding_type "nope"); a module without one does not.
        if rope is None and getattr(inner, "use_rope", None) is None \
                and not hasattr(inner, "use_sliding_window") and "rope" not in vars(inner):
            raise NotImplementedError(f"attention module {type(inner).__name__} has no rope and does not say "
                                      "it is a NoPE layer")
        self.uses_rope = rope is not None
        self.rope_dims = self.head_dim
        self.rope_plan = None  # set by models/cpu_norm_rope.py on MLX's CPU device
        # RoPE and the cache write as one primitive where the plan allows
        # (VLLM_METAL_FUSED_KV_WRITE; set with the plan by cpu_norm_rope.py).
        self.fused_write = False
        # M-RoPE (multimodal/loader.py sets both): the module's rotation as a
        # table plan, and int32 [rotated / 2]: the position stream of each frequency.
        self.mrope_plan = None
        self.mrope_streams = None
        # q/k norms: per head (qwen3, gemma3) or over the whole projection
        # before the heads are split (olmo2, olmoe): told apart by the norm's size.
        norm = getattr(inner, names["q_norm"]) if names["q_norm"] else None
        width = getattr(norm, "weight", None)
        self.qk_norm = None if norm is None else (
            "projection" if width is not None and width.shape[-1] == self.n_heads * self.head_dim
            and self.n_heads > 1 else "head")

    def __getattr__(self, key: str):
        # The decoder block may read its attention's own attributes (exaone4's
        # `is_local` picks the mask): answer for the wrapped module.
        value = self.get(key, None)
        if value is not None:
            return value
        inner = self.get("inner", None)
        if inner is None:
            raise AttributeError(key)
        return getattr(inner, key)

    def rope(self):
        """The RoPE module this layer applies, or None (NoPE)."""
        return getattr(self.inner, "rope", None) if self.uses_rope else None

    def rope_table(self, step: StepAttentionInputs) -> tuple[mx.array, bool] | None:
        """The step's (cos, sin) table of this layer's RoPE and its pairing
        (`traditional`), where a plan reproduces the module (MLX's CPU device):
        built by the first layer that asks, shared by those with the same plan."""
        if step.mrope_positions is not None and self.mrope_plan is not None:
            plan = self.mrope_plan
            key = ("mrope", plan.key)
            table = step.rope_tables.get(key)
            if table is None:
                table = step.rope_tables[key] = merged_rope_table(
                    [plan.table(self.inner.rope, step.mrope_positions[i]) for i in range(3)], self.mrope_streams)
            return table, plan.traditional
        plan = self.rope_plan
        if plan is None:
            return None
        table = step.rope_tables.get(plan.key)
        if table is None:
            table = step.rope_tables[plan.key] = plan.table(self.inner.rope, step.positions)
        return table, plan.traditional

    def apply_rope(self, q: mx.array, k: mx.array, step: StepAttentionInputs) -> tuple[mx.array, mx.array]:
        """q [tokens, heads, dim] and k rotated, each token at its own position."""
        planned = self.rope_table(step)
        if planned is not None:  # MLX's CPU device: one table per step, the RoPE primitive
            table, traditional = planned
            return ops.rope(q, table, traditional=traditional), ops.rope(k, table, traditional=traditional)
        # RoPE over a length-1 axis with one offset per token = each token at
        # its own position, whatever sequence it belongs to.
        rope = self.inner.rope
        return (rope(q[:, :, None, :], offset=step.positions)[:, :, 0, :],
                rope(k[:, :, None, :], offset=step.positions)[:, :, 0, :])

    def rope_and_write(self, q: mx.array, k: mx.array, v: mx.array, store: "PagedKVCache", layer: int,
                       step: StepAttentionInputs) -> tuple[mx.array, mx.array, mx.array] | None:
        """RoPE of q and k and the K/V cache write as one operation (the
        RopeWriteKV primitive, MLX's CPU device) where this layer allows it:
        its own plain cache, rotation by a plan, nothing between RoPE and the
        write (hunyuan's post-RoPE norms), the slots known on the host, one
        dtype. Returns (q, kc, vc), or None for the separate operations."""
        group = store.layer_group[layer]
        slots = step.slot_mappings[group]
        if not (self.uses_rope and self.owns_kv and self.fused_write and store.kv_cache_dtype == "auto"
                and isinstance(slots, ops.SlotMapping) and not hasattr(self.inner, "query_layernorm")):
            return None
        kc, vc = store.keys[layer], store.values[layer]
        if not (q.dtype == k.dtype == v.dtype == kc.dtype == vc.dtype) or k.shape[-1] != kc.shape[-1]:
            return None
        planned = self.rope_table(step)
        if planned is None:
            return None
        table, traditional = planned
        q, kc, vc = ops.rope_write_kv(q, k, v, table, kc, vc, slots, traditional=traditional,
                                      in_place=store.alias_write(layer))
        store.keys[layer], store.values[layer] = kc, vc
        return q, kc, vc

    def scale_queries(self, q: mx.array, step: StepAttentionInputs) -> mx.array:
        """Hook for a family that scales queries per token after RoPE (ministral3)."""
        return q

    def __call__(self, x: mx.array, mask=None, cache: LayerCacheView | None = None) -> mx.array:
        a, names = self.inner, self._names
        store, step = cache.store, cache.store.step
        n = x.shape[1]
        x = x.reshape(n, -1)
        if self.packed_qkv:
            q_end = self.n_heads * self.head_dim
            q, k, v = mx.split(a.qkv_proj(x), [q_end, q_end + self.num_kv_heads * self.head_dim], axis=-1)
        else:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        if self.qk_norm == "projection":
            q, k = getattr(a, names["q_norm"])(q), getattr(a, names["k_norm"])(k)
        q = q.reshape(n, self.n_heads, -1)
        k = k.reshape(n, self.num_kv_heads, -1)
        v = v.reshape(n, self.num_kv_heads, -1)
        if self.qk_norm == "head":
            q, k = getattr(a, names["q_norm"])(q), getattr(a, names["k_norm"])(k)
        layer, group = cache.layer, store.layer_group[cache.layer]
        fused = self.rope_and_write(q, k, v, store, layer, step)
        if fused is not None:
            q, kc, vc = fused
            q = self.scale_queries(q, step)
        else:
            if self.uses_rope:
                q, k = self.apply_rope(q, k, step)
            if hasattr(a, "query_layernorm"):  # hunyuan_v1_dense: per-head norms after RoPE
                q, k = a.query_layernorm(q), a.key_layernorm(k)
            q = self.scale_queries(q, step)
            kc, vc = store.write(layer, k, v, step.slot_mappings[group])
        q, cache_args = store.query(q)
        sinks = a.sinks.astype(mx.float32) if self.has_sinks else None
        out = ops.paged_attention(q, kc, vc, step.block_tables[group], step.seq_lens,
                                  step.cu_seqlens_q, scale=self.scale, sliding_window=self.sliding_window,
                                  softcap=self.softcap, sinks=sinks, **cache_args)
        if step.image_spans is not None:
            out = attend_image_spans(out, q, kc, vc, step.block_tables[group], step.image_spans, scale=self.scale,
                                     sliding_window=self.sliding_window, softcap=self.softcap, sinks=sinks,
                                     **cache_args)
        out = getattr(a, names["o_proj"])(out.reshape(1, n, -1).astype(x.dtype))
        if store.after_layer is not None:
            store.after_layer(out, kc, vc)
        return out
