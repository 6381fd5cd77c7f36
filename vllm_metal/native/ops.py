"""Paged attention and KV-cache writes as lazy MLX operations.

    from vllm_metal.native import ops
    out = ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                              cu_seqlens_q, scale=..., sliding_window=None, softcap=None,
                              sinks=None, v_head_dim=None)
    key_cache, value_cache = ops.write_kv(key_cache, value_cache, k, v, slot_mapping)
    q, key_cache, value_cache = ops.rope_write_kv(q, k, v, table, key_cache, value_cache, slot_mapping)
    y, state = ops.gated_delta(q, k, v, g, beta, state, mask=None)


Both build graph nodes and return at once; nothing is computed until the
caller evaluates (e.g. one `mx.eval` per engine step). `paged_attention` runs
the native primitive (C++ on the CPU, Metal on an Apple GPU) and falls back to
`paged_attention_reference`, built from plain MLX ops, on devices without a
native kernel. The element-wise ops (swiglu, rms_norm, rope) and gated_delta
live in vllm_metal.native.elementwise, the cache writes in
vllm_metal.native.kv_writes; both are re-exported here. Layouts:

    q             [num_tokens, num_heads, head_dim]    new tokens of all sequences, packed
    key_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache   [num_blocks, block_size, num_kv_heads, >= v_head_dim]  (may be key_cache)
    sinks         float [num_heads]      optional: one extra softmax logit per query head
    out           [num_tokens, num_heads, v_head_dim]  (v_head_dim defaults to head_dim)
    block_tables  int32 [num_seqs, max_blocks_per_seq]
    seq_lens      int32 [num_seqs]       context length after this step (cached + new)
    cu_seqlens_q  int32 [num_seqs + 1]   offsets of each sequence's new tokens in q
    slot_mapping  int   [num_tokens]     block * block_size + offset, -1 = write nothing
"""

from __future__ import annotations

from vllm_metal import envs
from vllm_metal.native import fast_blas

fast_blas.preload()  # normally done already (see vllm_metal/__init__.py)
fast_blas.warn_if_too_late()

from vllm_metal.native import kv_quant  # noqa: E402
from vllm_metal.native.extension import load_extension  # noqa: E402

_ext = load_extension()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.native.elementwise import (  # noqa: E402,F401  (re-exported: ops.swiglu etc.)
    GATED_DELTA_KEY_DIMS, GATED_DELTA_MAX_VALUE_DIM, GATED_DELTA_PATHS, _check_array, _device_of, cpu_kernels,
    gated_delta, gated_delta_path, gelu, layer_norm, rms_norm, rope, rope_composed, swiglu)
from vllm_metal.native.greedy_head import (  # noqa: E402,F401  (re-exported: ops.argmax_head etc.)
    ARGMAX_HEAD_MIN_ROWS, HeadScreen, argmax_head, argmax_head_screen)
from vllm_metal.native.kv_writes import (  # noqa: E402,F401  (re-exported: ops.write_kv etc.)
    SlotMapping, _slot_array, rope_write_kv, write_cache, write_kv)

__all__ = ["paged_attention", "paged_attention_reference", "write_kv", "attention_path", "cpu_kernels",
           "gated_delta", "gated_delta_path", "swiglu", "argmax_head", "argmax_head_screen", "gelu", "layer_norm", "rms_norm", "rope",
           "rope_write_kv", "write_cache", "SlotMapping"]

_INDEX_ARGS = ("block_tables", "seq_lens", "cu_seqlens_q")


def _as_index_array(value, name: str) -> mx.array:
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        arr = np.asarray(value)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        # A plain astype would wrap e.g. block id 2**32 + 3 to block 3: a
        # silent wrong read instead of an error.
        outside = (arr < np.iinfo(np.int32).min) | (arr > np.iinfo(np.int32).max)
        if outside.any():
            at = tuple(int(i) for i in np.argwhere(outside)[0])
            raise ValueError(f"{name}[{', '.join(map(str, at))}] = {arr[at]} does not fit in int32")
        return mx.array(arr.astype(np.int32))
    raise TypeError(f"{name} must be an mx.array (or numpy array/list), got {type(value).__name__}")


def _as_scale(scale) -> float:
    try:
        return float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {scale!r}") from None



_settings: dict[str, str] = {}


def reload_settings() -> None:
    """Re-reads the environment settings the ops cache (VLLM_METAL_ATTENTION);
    they are read once, not on every call of a layer's hot path."""
    _settings["attention"] = (envs.get("VLLM_METAL_ATTENTION") or "auto").strip()


reload_settings()


def attention_path(stream=None) -> tuple[str, str]:
    """Which implementation `paged_attention` uses on `stream`: (name, reason).

    name is "metal", "cpu" or "reference" (VLLM_METAL_ATTENTION, read at import
    or by `reload_settings`).
    """
    device = _device_of(stream)
    if _settings["attention"] == "reference":
        return "reference", "VLLM_METAL_ATTENTION=reference"
    if device.type == mx.DeviceType.cpu:
        return "cpu", f"native C++ primitive on MLX's CPU device ({_ext.cpu_attention_variant()} kernel)"
    if _ext.HAS_METAL:
        return "metal", "native Metal kernel on MLX's GPU device"
    return "reference", "this build has no native kernel for MLX's GPU device"


def _as_sinks(sinks) -> mx.array | None:
    if sinks is None or isinstance(sinks, mx.array):
        return sinks
    if isinstance(sinks, (np.ndarray, list, tuple)):
        return mx.array(np.asarray(sinks))
    raise TypeError(f"sinks must be an mx.array (or numpy array/list) or None, got {type(sinks).__name__}")


def _as_v_head_dim(v_head_dim) -> int | None:
    if v_head_dim is None:
        return None
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, (int, np.integer)):
        raise TypeError(f"v_head_dim must be an int or None, got {type(v_head_dim).__name__}")
    return int(v_head_dim)


def _prepare(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q):
    for name, value in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check_array(value, name)
    block_tables, seq_lens, cu_seqlens_q = (
        _as_index_array(v, n) for v, n in zip((block_tables, seq_lens, cu_seqlens_q), _INDEX_ARGS)
    )
    return q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, *,
                    scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, sinks=None, v_head_dim: int | None = None,
                    causal: bool = True, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                    v_scale: float = 1.0, stream=None) -> mx.array:
    """Lazy varlen paged attention; returns [num_tokens, num_heads, v_head_dim] in q's dtype.

    kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2": the caches are uint8 8-bit
    floats (native/kv_quant.py) holding K / k_scale and V / v_scale.

    causal=False (encoders): every query row sees all seq_lens[s] keys of its
    sequence (with sliding_window: those less than sliding_window positions
    away on either side) instead of the keys up to its own position.

    sinks: optional float [num_heads]; query head h gets one extra logit
    sinks[h] in its softmax denominator that contributes no value (not scaled,
    not softcapped), as in mx.fast.scaled_dot_product_attention(..., sinks=).
    v_head_dim: values are the first v_head_dim entries of each value_cache row
    (default: the key head dim, and value_cache rows must then be that long);
    value_cache may be key_cache itself (latent attention, MLA).

    Shape/dtype/rank mistakes raise ValueError naming the argument; bad block
    ids or lengths (known only once the inputs are computed) raise RuntimeError
    when the result is evaluated.
    """
    args = _prepare(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)
    fmt = kv_quant.cache_format(kv_cache_dtype)
    if attention_path(stream)[0] == "reference":
        return paged_attention_reference(*args, scale=scale, sliding_window=sliding_window,
                                         softcap=softcap, sinks=sinks, v_head_dim=v_head_dim,
                                         causal=causal, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                                         v_scale=v_scale, stream=stream)
    out = _ext.paged_attention(*args, scale=_as_scale(scale) * float(k_scale), sliding_window=sliding_window,
                               softcap=softcap, sinks=_as_sinks(sinks), v_head_dim=_as_v_head_dim(v_head_dim),
                               causal=bool(causal), cache_format=fmt, stream=stream)
    return out if float(v_scale) == 1.0 else out * float(v_scale)


def paged_attention_reference(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                              *, scale: float, sliding_window: int | None = None,
                              softcap: float | None = None, sinks=None,
                              v_head_dim: int | None = None, causal: bool = True, kv_cache_dtype: str = "auto",
                              k_scale: float = 1.0, v_scale: float = 1.0, stream=None) -> mx.array:
    """The same attention from plain MLX ops, on any device; a test oracle.

    Gathers every token's whole block table, so it costs memory proportional to
    num_tokens x max_blocks_per_seq x block_size; block ids are clamped into
    range rather than validated.
    """
    q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q = _prepare(
        q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)
    sinks, v_head_dim = _as_sinks(sinks), _as_v_head_dim(v_head_dim)
    # Same static validation as the primitive (building the lazy node is free).
    fmt = kv_quant.cache_format(kv_cache_dtype)
    _ext.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                         scale=_as_scale(scale), sliding_window=sliding_window, softcap=softcap,
                         sinks=sinks, v_head_dim=v_head_dim, causal=bool(causal), cache_format=fmt, stream=stream)
    if fmt:
        key_cache = kv_quant.decode(key_cache, kv_cache_dtype, mx.float32, float(k_scale))
        value_cache = kv_quant.decode(value_cache, kv_cache_dtype, mx.float32, float(v_scale))
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    num_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    context = max_blocks * block_size
    with mx.stream(stream if stream is not None else mx.default_device()):
        tokens = mx.arange(num_tokens, dtype=mx.int32)
        seq_of_token = (tokens[:, None] >= cu_seqlens_q[None, 1:]).astype(mx.int32).sum(axis=1)
        seq_of_token = mx.minimum(seq_of_token, max(num_seqs - 1, 0))
        new_tokens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        positions = (seq_lens[seq_of_token] - new_tokens[seq_of_token]
                     + tokens - cu_seqlens_q[seq_of_token])

        table = mx.clip(block_tables, 0, num_blocks - 1)[seq_of_token]  # [N, M]

        def gather(cache, dims):  # -> [N, kv_heads, context, dims] float32
            x = cache[table].reshape(num_tokens, context, num_kv_heads, cache.shape[3])
            return x[..., :dims].astype(mx.float32).transpose(0, 2, 1, 3)

        qf = q.astype(mx.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
        scores = (qf @ gather(key_cache, head_dim).swapaxes(-1, -2)) * scale  # [N, kvh, G, ctx]
        if softcap is not None:
            scores = softcap * mx.tanh(scores / softcap)
        key_pos = mx.arange(context, dtype=mx.int32)[None, :]
        if causal:
            visible = key_pos <= positions[:, None]
        else:
            visible = key_pos < seq_lens[seq_of_token][:, None]
            if sliding_window is not None:
                visible = visible & (key_pos < positions[:, None] + sliding_window)
        if sliding_window is not None:
            visible = visible & (key_pos > positions[:, None] - sliding_window)
        scores = mx.where(visible[:, None, None, :], scores, -mx.inf)
        if sinks is not None:
            # One more logit per head, after scale and softcap, whose value is 0.
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, num_kv_heads, group, 1),
                                   (num_tokens, num_kv_heads, group, 1))
            probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :context]
        else:
            probs = mx.softmax(scores, axis=-1)
        out = probs @ gather(value_cache, v_head_dim)  # [N, kvh, G, Dv]
        return out.reshape(num_tokens, num_heads, v_head_dim).astype(q.dtype)
