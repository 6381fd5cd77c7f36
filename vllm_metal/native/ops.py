"""Paged attention and KV-cache writes as lazy MLX operations.

    from vllm_metal.native import ops
    out = ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                              cu_seqlens_q, scale=..., sliding_window=None, softcap=None,
                              sinks=None, v_head_dim=None)
    key_cache, value_cache = ops.write_kv(key_cache, value_cache, k, v, slot_mapping)
    y, state = ops.gated_delta(q, k, v, g, beta, state, mask=None)


Both build graph nodes and return at once; nothing is computed until the
caller evaluates (e.g. one `mx.eval` per engine step). `paged_attention` runs
the native primitive (C++ on the CPU, Metal on an Apple GPU) and falls back to
`paged_attention_reference`, built from plain MLX ops, on devices without a
native kernel. The element-wise ops (swiglu, rms_norm, rope) and gated_delta
live in vllm_metal.native.elementwise and are re-exported here. Layouts:

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
    ARGMAX_HEAD_MIN_ROWS, GATED_DELTA_KEY_DIMS, GATED_DELTA_MAX_VALUE_DIM, GATED_DELTA_PATHS, _check_array,
    _device_of, argmax_head, cpu_kernels, gated_delta, gated_delta_path, gelu, layer_norm, rms_norm, rope,
    rope_composed, swiglu)

__all__ = ["paged_attention", "paged_attention_reference", "write_kv", "attention_path", "cpu_kernels",
           "gated_delta", "gated_delta_path", "swiglu", "argmax_head", "gelu", "layer_norm", "rms_norm", "rope",
           "SlotMapping"]

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


def write_kv(key_cache: mx.array, value_cache: mx.array, k: mx.array, v: mx.array,
             slot_mapping, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
             v_scale: float = 1.0) -> tuple[mx.array, mx.array]:
    """Functional, graph-tracked cache write: returns the updated caches.

    Token i's k[i], v[i] land in slot slot_mapping[i] (block * block_size +
    offset); -1 writes nothing. The write is an MLX scatter: lazy, ordered by
    the graph, and done in place on the old buffer when the caller holds no
    other reference to the old cache arrays (`kc, vc = write_kv(kc, vc, ...)`).

    Slots outside [-1, num_blocks * block_size) raise ValueError when the
    mapping is host data or an already-computed array; in a still-lazy mapping
    they cannot be seen before evaluation and are dropped (written nowhere),
    so a write can never go out of bounds.
    """
    for name, value in (("key_cache", key_cache), ("value_cache", value_cache), ("k", k), ("v", v)):
        _check_array(value, name)
    if key_cache.ndim != 4:
        raise ValueError("key_cache must have rank 4 [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
                         f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    if kv_quant.cache_format(kv_cache_dtype):  # an 8-bit cache: K / k_scale, V / v_scale as 8-bit floats
        if key_cache.dtype != mx.uint8:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs uint8 caches, got {key_cache.dtype}")
        k, v = kv_quant.encode(k, kv_cache_dtype, float(k_scale)), kv_quant.encode(v, kv_cache_dtype, float(v_scale))
    return tuple(_write([key_cache, value_cache], [k, v], ["k", "v"], "key_cache", slot_mapping))


def write_cache(cache: mx.array, x: mx.array, slot_mapping) -> mx.array:
    """`write_kv` for one cache: latent attention (MLA) keeps a single row per
    token, [kv_latent, k_rope], read as K and (its first kv_lora_rank
    entries) as V. Same slots, laziness, donation and errors as `write_kv`."""
    _check_array(cache, "cache")
    _check_array(x, "x")
    return _write([cache], [x], ["x"], "cache", slot_mapping)[0]


def _write(caches: list[mx.array], news: list[mx.array], names: list[str], cache_name: str,
           slot_mapping) -> list[mx.array]:
    cache0 = caches[0]
    if cache0.ndim != 4:
        raise ValueError(f"{cache_name} must have rank 4 [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(cache0.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = cache0.shape
    for name, x in zip(names, news):
        if x.ndim != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match "
                             f"the cache, got shape {tuple(x.shape)}")
        if x.dtype != cache0.dtype:
            raise ValueError(f"{name} dtype {x.dtype} does not match the cache dtype {cache0.dtype}")

    num_slots = num_blocks * block_size
    num_tokens = news[0].shape[0]
    slots = _slot_array(slot_mapping, num_tokens, num_slots)
    if isinstance(slots, SlotMapping):
        # Known slots (the normal case): scatter only the real writes. The
        # cache is read by nothing here, so the scatter can be donated.
        if slots.keep.size == 0:
            return list(caches)
        pick = slots.pick
        what = (lambda new, _: new) if pick is None else (lambda new, _: new[pick])
        return [_scatter(c, x, slots.slots, what) for c, x in zip(caches, news)]

    if num_tokens == 0:
        return list(caches)
    # Lazy slots: padding and out-of-range slots are pointed at the first real
    # write with that write's value, so duplicates in the scatter agree; with
    # no real write at all they rewrite slot 0 with its own content. This path
    # reads the cache (slot 0), which may cost the in-place donation.
    valid = (slots >= 0) & (slots < num_slots)
    any_valid = mx.any(valid)
    first = mx.argmax(valid)
    safe_slots = mx.where(valid, slots, mx.where(any_valid, slots[first], 0))

    def anchored(new, flat):
        anchor_value = mx.where(any_valid, new[first], flat[0])
        return mx.where(valid[:, None, None], new, anchor_value)

    return [_scatter(c, x, safe_slots, anchored) for c, x in zip(caches, news)]


class SlotMapping:
    """Slots known on the host, checked and converted once: the real writes'
    slots as an mx.array, and which tokens they are when some tokens write
    nothing (-1). The runner builds one per step and KV-cache group, so every
    layer's `write_kv` reuses it instead of converting the numpy array again;
    `write_kv` makes one from any other host data."""

    def __init__(self, slot_mapping):
        host = np.asarray(slot_mapping)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slot_mapping must hold integers, got dtype {host.dtype}")
        self.host = host.astype(np.int64)
        self.low = int(self.host.min()) if host.size else 0
        self.high = int(self.host.max()) if host.size else -1
        self.keep = np.nonzero(self.host.reshape(-1) >= 0)[0]
        real = self.keep.size == self.host.size
        self.slots = mx.array(self.host if real else self.host.reshape(-1)[self.keep])
        self.pick = None if real else mx.array(self.keep.astype(np.int32))

    def check(self, num_tokens: int, num_slots: int) -> None:
        """Raises ValueError unless this maps num_tokens tokens into [-1, num_slots)."""
        if self.host.shape != (num_tokens,):
            raise ValueError(f"slot_mapping must be [num_tokens] = [{num_tokens}], got shape {self.host.shape}")
        if self.low < -1 or self.high >= num_slots:
            i = int(np.nonzero((self.host < -1) | (self.host >= num_slots))[0][0])
            raise ValueError(f"slot_mapping[{i}] = {int(self.host[i])} is outside [-1, {num_slots}) "
                             f"(num_blocks x block_size slots; -1 means no write)")


def _scatter(cache, new, where, what):
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    flat[where] = what(new, flat)
    return flat.reshape(num_blocks, block_size, num_kv_heads, head_dim)


def _slot_array(slot_mapping, num_tokens: int, num_slots: int):
    """A checked SlotMapping when the slots are known on the host (host data,
    or an already-computed mx.array), else the lazy mx.array (shape and dtype
    checked; its values are only known at evaluation)."""
    if isinstance(slot_mapping, mx.array):
        if slot_mapping.ndim != 1 or slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping must be [num_tokens] = [{num_tokens}], "
                             f"got shape {tuple(slot_mapping.shape)}")
        if not mx.issubdtype(slot_mapping.dtype, mx.integer):
            raise ValueError(f"slot_mapping must be an integer array, got {slot_mapping.dtype}")
        if not _ext.is_materialized(slot_mapping):
            return slot_mapping
        slot_mapping = SlotMapping(np.array(slot_mapping))
    elif isinstance(slot_mapping, (np.ndarray, list, tuple)):
        slot_mapping = SlotMapping(slot_mapping)
    elif not isinstance(slot_mapping, SlotMapping):
        raise TypeError("slot_mapping must be an mx.array (or numpy array/list), "
                        f"got {type(slot_mapping).__name__}")
    slot_mapping.check(num_tokens, num_slots)
    return slot_mapping
