"""A llama-shaped decoder layer as one lazy operation.

    from vllm_metal.native.decoder_layer import decoder_layer
    out, key_cache, value_cache = decoder_layer(
        x, input_norm, qkv_weight, table, key_cache, value_cache, slot_mapping,
        block_tables, seq_lens, cu_seqlens_q, o_weight, post_norm, gate_up_weight,
        down_weight, heads=..., kv_heads=..., head_dim=..., input_eps=..., post_eps=...,
        scale=..., sliding_window=None, traditional=False)

computes, for the step's packed tokens x [..., hidden]:

    q, k, v = split(rms_norm(x, input_norm) @ qkv_weight.T)        # q rows, then k, then v
    q, key_cache, value_cache = rope_write_kv(q, k, v, table, ...)  # rotated q; k, v into their slots
    h = x + paged_attention(q, key_cache, value_cache, ...) @ o_weight.T
    gate, up = split(rms_norm(h, post_norm) @ gate_up_weight.T)     # gate rows, then up
    out = h + swiglu(gate, up) @ down_weight.T

On MLX's CPU device this is vllm-metal's DecoderLayer primitive (one graph
node and one task a layer, csrc/decoder_layer.h): the same kernels and the
same BLAS calls as the operations above, so the same bits. Elsewhere (the
GPU) it is those operations, each MLX's or vllm-metal's own kernel
(`decoder_layer_composed`). float32 only; the index arrays and slots as
`ops.paged_attention` and `ops.rope_write_kv` take them (slots known on the
host).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.native import ops
from vllm_metal.native.ops import _check_array, _device_of, _ext, _slot_array


def decoder_layer(x: mx.array, input_norm: mx.array, qkv_weight: mx.array, table: mx.array,
                  key_cache: mx.array, value_cache: mx.array, slot_mapping, block_tables: mx.array,
                  seq_lens: mx.array, cu_seqlens_q: mx.array, o_weight: mx.array, post_norm: mx.array,
                  gate_up_weight: mx.array, down_weight: mx.array, *, heads: int, kv_heads: int, head_dim: int,
                  input_eps: float, post_eps: float, scale: float, sliding_window: int | None = None,
                  traditional: bool = False, in_place: bool = False,
                  stream=None) -> tuple[mx.array, mx.array, mx.array]:
    """(out in x's shape, key_cache', value_cache'); see the module docstring.
    in_place: an alias write of the caches (as `rope_write_kv`'s).
    Bad shapes, dtypes or slots raise ValueError here; bad block ids or
    lengths raise from the evaluation (as paged_attention's)."""
    arrays = (("x", x), ("input_norm", input_norm), ("qkv_weight", qkv_weight), ("table", table),
              ("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
              ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q), ("o_weight", o_weight),
              ("post_norm", post_norm), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight))
    for name, value in arrays:
        _check_array(value, name)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"[decoder_layer] x must be [..., hidden], got shape {tuple(x.shape)}")
    if key_cache.ndim != 4:
        raise ValueError("[decoder_layer] key_cache must have rank 4 [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(key_cache.shape)}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"[decoder_layer] sliding_window must be a positive int or None, got {sliding_window!r}")
    tokens = x.size // x.shape[-1]
    slots = _slot_array(slot_mapping, tokens, key_cache.shape[0] * key_cache.shape[1])
    if not isinstance(slots, ops.SlotMapping):
        raise ValueError("[decoder_layer] slot_mapping must be known on the host (a SlotMapping, host data or an "
                         "evaluated array)")
    if _device_of(stream).type != mx.DeviceType.cpu:
        return decoder_layer_composed(x, input_norm, qkv_weight, table, key_cache, value_cache, slots,
                                      block_tables, seq_lens, cu_seqlens_q, o_weight, post_norm, gate_up_weight,
                                      down_weight, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                      input_eps=input_eps, post_eps=post_eps, scale=scale,
                                      sliding_window=sliding_window, traditional=traditional, stream=stream)
    if slots.full is None:
        slots.full = mx.array(slots.host.astype(np.int32))
    out, kc, vc = _ext.decoder_layer(
        x, input_norm, qkv_weight, table, key_cache, value_cache, slots.full, block_tables, seq_lens, cu_seqlens_q,
        o_weight, post_norm, gate_up_weight, down_weight, heads=int(heads), kv_heads=int(kv_heads),
        head_dim=int(head_dim), input_eps=float(input_eps), post_eps=float(post_eps), scale=float(scale),
        sliding_window=int(sliding_window or 0), traditional=bool(traditional), in_place=bool(in_place),
        stream=stream)
    return out, kc, vc


def decoder_layer_composed(x, input_norm, qkv_weight, table, key_cache, value_cache, slot_mapping, block_tables,
                           seq_lens, cu_seqlens_q, o_weight, post_norm, gate_up_weight, down_weight, *, heads,
                           kv_heads, head_dim, input_eps, post_eps, scale, sliding_window=None, traditional=False,
                           stream=None) -> tuple[mx.array, mx.array, mx.array]:
    """The same layer as separate lazy operations (the GPU's path; on the
    CPU, the graph the primitive replaces), on `stream`'s device."""
    if stream is not None:
        with mx.stream(stream):
            return decoder_layer_composed(x, input_norm, qkv_weight, table, key_cache, value_cache, slot_mapping,
                                          block_tables, seq_lens, cu_seqlens_q, o_weight, post_norm,
                                          gate_up_weight, down_weight, heads=heads, kv_heads=kv_heads,
                                          head_dim=head_dim, input_eps=input_eps, post_eps=post_eps, scale=scale,
                                          sliding_window=sliding_window, traditional=traditional)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    n = rows.shape[0]
    q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
    qkv = ops.rms_norm(rows, input_norm, input_eps) @ qkv_weight.T
    q, k, v = mx.split(qkv, [q_cols, q_cols + kv_cols], axis=-1)
    q, kc, vc = ops.rope_write_kv(q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim),
                                  v.reshape(n, kv_heads, head_dim), table, key_cache, value_cache, slot_mapping,
                                  traditional=traditional)
    attended = ops.paged_attention(q, kc, vc, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                   sliding_window=sliding_window)
    h = rows + attended.reshape(n, q_cols) @ o_weight.T
    ffn = gate_up_weight.shape[0] // 2
    gate, up = mx.split(ops.rms_norm(h, post_norm, post_eps) @ gate_up_weight.T, [ffn], axis=-1)
    out = h + ops.swiglu(gate, up) @ down_weight.T
    return out.reshape(shape), kc, vc
