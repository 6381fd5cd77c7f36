"""A llama-shaped decoder block as one DecoderLayer primitive (MLX's CPU device).

On MLX's CPU device every operation of a decode step is built in Python,
evaluated on the thread running mx.eval and dispatched to the stream's thread:
a llama layer is ~36 graph nodes (products, norms, RoPE + KV write, attention,
SwiGLU, adds and the views between them). `fuse_decoder_layers` makes each
block that computes

    h = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))

with the pieces the CPU path already swapped in (PrimitiveRMSNorm norms, a
plain PagedAttentionLayer with fused q/k/v, a RoPE plan and the fused KV
write, a SwiGLUMLP with fused gate/up; float32, no biases) one node: the
block's class becomes a subclass whose `__call__` runs
`native.decoder_layer` on the block's own weights (the module tree, its
parameter names and weights are untouched). Which blocks compute that formula
is proven at load, per block class and configuration, by running the block's
own call and the fused one on random inputs through a private paged cache (a
prefill, then a decode step) and requiring the same outputs and caches.

Per step, a block falls back to its own call whenever the step or the block
has something the primitive does not do: an 8-bit KV cache, images attended
both ways or M-RoPE positions, slots computed in the graph, a per-layer hook
(VLLM_METAL_SYNC_PER_LAYER), or a projection replaced since load (a LoRA
adapter's wrapper, tensor parallelism's row-parallel products). Results are
the same bits either way (tests/models/test_fused_layer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import envs
from vllm_metal.models.attention_adapter import LayerCacheView, PagedAttentionLayer, PagedKVCache, \
    StepAttentionInputs
from vllm_metal.models.cpu_norm_rope import PrimitiveRMSNorm
from vllm_metal.models.fused_projections import SwiGLUMLP
from vllm_metal.native import ops
from vllm_metal.native.decoder_layer import decoder_layer

# Block children the formula names.
CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
PROBE_BLOCK_SIZE = 16


@dataclass(frozen=True)
class LayerPlan:
    """The primitive's non-array arguments for one block."""

    heads: int
    kv_heads: int
    head_dim: int
    input_eps: float
    post_eps: float
    scale: float
    sliding_window: int | None

    def kwargs(self, traditional: bool) -> dict:
        return dict(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, input_eps=self.input_eps,
                    post_eps=self.post_eps, scale=self.scale, sliding_window=self.sliding_window,
                    traditional=traditional)


def _plain(linear) -> bool:
    """A float32 nn.Linear without a bias (nothing wrapped it)."""
    return type(linear) is nn.Linear and "bias" not in linear and linear.weight.dtype == mx.float32


def _parts(block) -> tuple | None:
    """The six modules whose weights the primitive reads (input norm, q/k/v,
    o, post norm, gate/up, down) when each is what the plan fuses, else None."""
    attn, mlp = block.self_attn, block.mlp
    inner, mlp_inner = attn.inner, mlp.inner
    qkv = inner.get("fused_qkv_proj", None) if isinstance(inner, dict) else None
    o_proj = getattr(inner, attn._names["o_proj"], None)
    gate_up = mlp_inner.get("fused_gate_up_proj", None) if isinstance(mlp_inner, dict) else None
    down = getattr(mlp_inner, "down_proj", None)
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if not (all(_plain(m) for m in (qkv, o_proj, gate_up, down))
            and all(type(n) is PrimitiveRMSNorm and n.weight.dtype == mx.float32 for n in norms)):
        return None
    return (norms[0], qkv, o_proj, norms[1], gate_up, down)


def _weights(block) -> tuple[mx.array, ...] | None:
    """The six weights, or None where a module is no longer the one the
    block was fused with (a LoRA or tensor-parallel wrapper put in its
    place): checked every step by identity, which is cheap."""
    parts, o_name = block._fused_parts  # (children read as dict items: nn.Module's __getattr__ is slow)
    attn, mlp = block["self_attn"], block["mlp"]
    inner, mlp_inner = attn["inner"], mlp["inner"]
    n1, qkv, o, n2, gate_up, down = parts
    if (block.get("input_layernorm") is not n1 or inner.get("fused_qkv_proj") is not qkv or inner.get(o_name) is not o
            or block.get("post_attention_layernorm") is not n2 or mlp_inner.get("fused_gate_up_proj") is not gate_up
            or mlp_inner.get("down_proj") is not down):
        return None
    return (n1["weight"], qkv["weight"], o["weight"], n2["weight"], gate_up["weight"], down["weight"])


def static_plan(block) -> LayerPlan | None:
    """The plan for a block whose pieces are the fusable ones, else None
    (the probe then decides whether its call is the formula)."""
    if not isinstance(block, nn.Module) or any(getattr(block, c, None) is None for c in CHILDREN):
        return None
    attn, mlp = block.self_attn, block.mlp
    if type(attn) is not PagedAttentionLayer or type(mlp) is not SwiGLUMLP:
        return None  # subclasses (query scaling, MLA...) add to the attention
    if (attn.packed_qkv or attn.qk_norm is not None or not attn.uses_rope or attn.rope_plan is None
            or not attn.fused_write or attn.has_sinks or attn.softcap is not None or not attn.owns_kv
            or attn.kv_head_dim != attn.head_dim or attn.mrope_plan is not None
            or hasattr(attn.inner, "query_layernorm") or attn.rope_plan.rotated > attn.head_dim):
        return None
    if _parts(block) is None:
        return None
    qkv_rows = block.self_attn.inner.fused_qkv_proj.weight.shape[0]
    if qkv_rows != (attn.n_heads + 2 * attn.num_kv_heads) * attn.head_dim:
        return None
    return LayerPlan(heads=attn.n_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                     input_eps=float(block.input_layernorm.eps), post_eps=float(block.post_attention_layernorm.eps),
                     scale=float(attn.scale), sliding_window=attn.sliding_window or None)


def _fused_forward(block, plan: LayerPlan, x: mx.array, cache) -> mx.array | None:
    """The block's output through one DecoderLayer primitive (the layer's
    caches replaced in the store), or None where this step or block has
    something the primitive does not do."""
    weights = _weights(block) if isinstance(cache, LayerCacheView) else None
    store = cache.store if weights is not None else None
    step = store.step if store is not None else None
    if step is None or store.kv_cache_dtype != "auto" or store.after_layer is not None \
            or step.image_spans is not None or step.mrope_positions is not None or x.dtype != mx.float32:
        return None
    layer, attn = cache.layer, block.self_attn
    group = store.layer_group[layer]
    slots = step.slot_mappings[group]
    kc, vc = store.keys[layer], store.values[layer]
    if not isinstance(slots, ops.SlotMapping) or kc.dtype != mx.float32 or vc.dtype != mx.float32:
        return None
    table, traditional = attn.rope_table(step)
    w_in, w_qkv, w_o, w_post, w_gate_up, w_down = weights
    out, kc, vc = decoder_layer(x, w_in, w_qkv, table, kc, vc, slots, step.block_tables[group], step.seq_lens,
                                step.cu_seqlens_q, w_o, w_post, w_gate_up, w_down, **plan.kwargs(traditional),
                                in_place=store.alias_write(layer))
    store.keys[layer], store.values[layer] = kc, vc
    return out


def _fused_call(self, x: mx.array, mask=None, cache=None):
    """A fused block's call: the primitive where the step allows, else the block's own."""
    out = _fused_forward(self, self._layer_plan, x, cache)
    return self._unfused_call(x, mask, cache) if out is None else out


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """cls with its call replaced by the fused one (its own kept as `_unfused_call`)."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {
            "__call__": _fused_call, "_unfused_call": cls.__call__, "__module__": cls.__module__,
            "__doc__": f"{cls.__name__} run as one DecoderLayer primitive (vllm_metal/models/fused_layer.py)."})
    return _FUSED_CLASSES[cls]


def _probe_store(plan: LayerPlan) -> PagedKVCache:
    shape = (2, PROBE_BLOCK_SIZE, plan.kv_heads, plan.head_dim)
    return PagedKVCache(keys=[mx.zeros(shape)], values=[mx.zeros(shape)], layer_group=[0])


def _probe_step(start: int, n: int) -> StepAttentionInputs:
    """One sequence whose tokens start..start+n-1 are this step's (block 1 first, then 0)."""
    table_row = np.array([[1, 0]], np.int32)
    positions = np.arange(start, start + n)
    slots = table_row[0, positions // PROBE_BLOCK_SIZE] * PROBE_BLOCK_SIZE + positions % PROBE_BLOCK_SIZE
    return StepAttentionInputs(positions=mx.array(positions.astype(np.int32)),
                               seq_lens=mx.array([start + n], dtype=mx.int32),
                               cu_seqlens_q=mx.array([0, n], dtype=mx.int32), block_tables=[mx.array(table_row)],
                               slot_mappings=[ops.SlotMapping(slots)])


def computes_formula(block, plan: LayerPlan) -> bool:
    """Whether the block's own call equals the fused one: a prefill of 19
    random tokens (crossing a cache block) at two scales, then one decode
    step, through private caches; outputs and caches within float32 rounding
    (the same kernels: in practice the same bits)."""
    own_call = type(block).__call__
    hidden = block.input_layernorm.weight.shape[0]
    for scale in (1.0, 20.0):
        stores = [_probe_store(plan), _probe_store(plan)]
        key = mx.random.key(3)
        for start, n in ((0, PROBE_BLOCK_SIZE + 3), (PROBE_BLOCK_SIZE + 3, 1)):
            x = scale * mx.random.normal((1, n, hidden), key=key)
            key = mx.random.split(key)[0]
            outs = []
            for store, fused in zip(stores, (False, True)):
                store.step = _probe_step(start, n)
                view = LayerCacheView(store, 0)
                try:
                    out = _fused_forward(block, plan, x, view) if fused else own_call(block, x, None, view)
                    if out is None:
                        return False
                    mx.eval(out, store.keys[0], store.values[0])
                except Exception:  # noqa: BLE001 -- whatever it raises, the answer is "not this formula"
                    return False
                outs.append(out)
            if outs[0].shape != outs[1].shape or not mx.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5).item():
                return False
            for a, b in ((stores[0].keys[0], stores[1].keys[0]), (stores[0].values[0], stores[1].values[0])):
                if not mx.allclose(a, b, rtol=1e-5, atol=1e-6).item():
                    return False
    return True


def fuse_decoder_layers(layers: list) -> dict[str, int]:
    """Turns every block proven to compute the formula into its fused class.
    Returns {"layers": blocks fused}."""
    proven: dict[tuple, bool] = {}
    fused = 0
    for block in layers:
        plan = static_plan(block)
        if plan is None:
            continue
        object.__setattr__(block, "_fused_parts", (_parts(block), block.self_attn._names["o_proj"]))
        attn = block.self_attn
        key = (type(block), type(attn.inner), type(block.mlp.inner), plan, attn.rope_plan.key)
        if key not in proven:
            proven[key] = computes_formula(block, plan)
        if proven[key]:
            object.__setattr__(block, "_layer_plan", plan)
            block.__class__ = _fused_class(type(block))
            fused += 1
    return {"layers": fused}


def fused_layers_enabled() -> bool:
    """VLLM_METAL_FUSED_LAYER: applies where the fused projections and the CPU
    norm/RoPE primitives do (MLX's CPU device by default); a value it does
    not know is refused, not ignored."""
    return envs.strict_switch("VLLM_METAL_FUSED_LAYER")
