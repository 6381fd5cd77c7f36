"""KV-cache writes as lazy, functional MLX operations.

    key_cache, value_cache = ops.write_kv(key_cache, value_cache, k, v, slot_mapping)
    q, key_cache, value_cache = ops.rope_write_kv(q, k, v, table, key_cache, value_cache,
                                                  slot_mapping, traditional=False)

Each returns the updated caches; nothing is computed until the caller
evaluates. A write is done in place on the old buffer when the caller holds
no other reference to the old cache arrays (`kc, vc = write_kv(kc, vc, ...)`).

`in_place=True` (an alias write; MLX's CPU device, and the GPU of a build
with Metal): the updated caches take the old caches' buffers even while other
operations still hold them, instead of copying the whole cache. The caller
promises that every reader of the old contents comes before this write in
stream order: layers sharing one vLLM KV-cache tensor
(models/kv_store.PagedKVCache), where a later layer's K/V depend, through the
residual stream, on the earlier layer's attention. On the CPU the write is
the RopeWriteKV primitive's CPU backend; on Metal its eval_gpu, the KV-cache
write kernel of metal/write_kv.metal (docs/metal.md). Elsewhere (a GPU without
our Metal kernels, 8-bit caches, lazy slots) the write is the ordinary one:
the same result, by a copy when the buffer cannot be donated.
Layouts as in vllm_metal.native.ops; re-exported there.
"""

from __future__ import annotations

from vllm_metal.native import fast_blas

fast_blas.preload()  # normally done already (see vllm_metal/__init__.py)

from vllm_metal.native import kv_quant  # noqa: E402
from vllm_metal.native.elementwise import _check_array, _device_of, rope  # noqa: E402
from vllm_metal.native.extension import load_extension  # noqa: E402

_ext = load_extension()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def write_kv(key_cache: mx.array, value_cache: mx.array, k: mx.array, v: mx.array,
             slot_mapping, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
             v_scale: float = 1.0, in_place: bool = False) -> tuple[mx.array, mx.array]:
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
    elif in_place and _alias_write_ok(key_cache, k, v):
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        slots = _slot_array(slot_mapping, k.shape[0], num_slots)
        if isinstance(slots, SlotMapping):
            if slots.full is None:
                slots.full = mx.array(slots.host.astype(np.int32))
            # RopeWriteKV with a table of no pairs: the rows copied, nothing rotated.
            table = mx.zeros((k.shape[0], 0, 2), dtype=mx.float32)
            _, kc, vc = _ext.rope_write_kv(k, k, v, table, key_cache, value_cache, slots.full, False,
                                           in_place=True)
            return kc, vc
    return tuple(_write([key_cache, value_cache], [k, v], ["k", "v"], "key_cache", slot_mapping))


def _alias_write_ok(cache: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether the RopeWriteKV primitive can make an alias write of k, v into
    `cache` (MLX's CPU device, or the GPU where the extension has its Metal
    kernels; one float dtype, K and V rows alike)."""
    return (alias_writes_supported(_device_of(None))
            and cache.dtype in (mx.float32, mx.float16, mx.bfloat16)
            and k.dtype == v.dtype == cache.dtype and k.shape == v.shape and k.ndim == 3
            and k.shape[1:] == cache.shape[2:])


def alias_writes_supported(device: mx.Device | None = None) -> bool:
    """Whether `write_kv(..., in_place=True)` writes in place on `device`
    (default: MLX's default device): the CPU always, the GPU where this
    build has its Metal kernels (RopeWriteKV::eval_gpu)."""
    device = _device_of(device)
    return device.type == mx.DeviceType.cpu or bool(_ext.HAS_METAL)


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
        self.full = None  # every token's slot as int32, made by rope_write_kv's first use

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


def rope_write_kv(q: mx.array, k: mx.array, v: mx.array, table: mx.array, key_cache: mx.array,
                  value_cache: mx.array, slot_mapping, *, traditional: bool = False, in_place: bool = False,
                  stream=None) -> tuple[mx.array, mx.array, mx.array]:
    """`rope` of q and k, then `write_kv` of the rotated k and v, as one
    operation: returns (rotated q, key_cache', value_cache').

    q [tokens, heads, dim], k and v [tokens, kv_heads, dim] of one dtype (the
    caches' dtype; 8-bit caches go through `write_kv`), in any layout (the
    column slices of a fused q/k/v product are read in place); table and
    `traditional` as for `rope`; slot_mapping as for `write_kv` but known on
    the host (a SlotMapping, host data or a computed array: the slots are
    checked before anything is built). On MLX's CPU device this is vllm-metal's
    RopeWriteKV primitive (one operation instead of five, each cache written
    in place when nothing else holds it); elsewhere `rope` and `write_kv`.
    Results are identical either way: the same rotation arithmetic, values
    copied exactly. in_place: an alias write (module docstring).
    """
    for name, value in (("q", q), ("k", k), ("v", v), ("table", table), ("key_cache", key_cache),
                        ("value_cache", value_cache)):
        _check_array(value, name)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"[rope_write_kv] q, k and v must be [tokens, heads, dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if key_cache.ndim != 4:
        raise ValueError("[rope_write_kv] key_cache must have rank 4 [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(key_cache.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = _slot_array(slot_mapping, q.shape[0], num_slots)
    if not isinstance(slots, SlotMapping):
        raise ValueError("[rope_write_kv] slot_mapping must be known on the host (a SlotMapping, host data or "
                         "an evaluated array); with slots computed in the graph, call rope and write_kv")
    if _device_of(stream).type != mx.DeviceType.cpu:
        q_rot, k_rot = rope(q, table, traditional=traditional, stream=stream), \
            rope(k, table, traditional=traditional, stream=stream)
        return (q_rot, *write_kv(key_cache, value_cache, k_rot, v, slots, in_place=in_place))
    if slots.full is None:
        slots.full = mx.array(slots.host.astype(np.int32))
    q_rot, kc, vc = _ext.rope_write_kv(q, k, v, table, key_cache, value_cache, slots.full, bool(traditional),
                                       in_place=bool(in_place), stream=stream)
    return q_rot, kc, vc
