"""8-bit float KV caches: vLLM's `--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 |
fp8_per_token_head` as uint8 arrays of FP8 bit patterns.

Written by `ops.write_kv` (the values divided by the layer's scale, then
rounded to the nearest 8-bit float, saturating: E4M3 "fn" at +-448, E5M2 at
+-57344), read by the paged-attention primitive, which decodes each element
exactly inside its kernels (CPU and Metal) and applies the scales: the key
scale folded into the softmax scale, the value scale on the output.

Scales follow vLLM's semantics: one float per layer for K and one for V,
1.0 unless the checkpoint provides `k_scale` / `v_scale`
(docs/checkpoints.md). `fp8_per_token_head` (vLLM's name for dynamic
per-token-head scales) is E4M3 with its own float32 scale per token and head,
absmax / 448, stored after the row's codes: each cache row is head_dim + 4
bytes.
"""

from __future__ import annotations

from vllm_metal.native import fast_blas

fast_blas.preload()  # before the first `import mlx.core`

import mlx.core as mx  # noqa: E402

# vLLM's --kv-cache-dtype names -> the primitive's cache_format.
FORMATS = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2, "fp8_per_token_head": 3}
PER_ROW = 3  # the format whose rows end in their float32 scale
SCALE_BYTES = 4
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def cache_format(kv_cache_dtype: str | None) -> int:
    """0 (the model dtype) or the primitive's 8-bit cache_format."""
    if kv_cache_dtype in (None, "auto"):
        return 0
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not served; use auto, {', '.join(FORMATS)}")
    return FORMATS[kv_cache_dtype]


def encode(x: mx.array, kv_cache_dtype: str, scale: float = 1.0) -> mx.array:
    """x / scale as 8-bit float bit patterns (uint8), round to nearest even,
    saturating at the format's largest finite value; fp8_per_token_head: each
    row (last axis) by its own scale, appended as 4 bytes."""
    fmt = cache_format(kv_cache_dtype)
    x = x.astype(mx.float32)
    if scale != 1.0:
        x = x / scale
    if fmt == PER_ROW:  # each row by its own scale: its absmax maps to E4M3's largest value
        row_scale = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True), 1e-30) / E4M3_MAX
        codes = mx.to_fp8(mx.clip(x / row_scale, -E4M3_MAX, E4M3_MAX))
        return mx.concatenate([codes, row_scale.astype(mx.float32).view(mx.uint8)], axis=-1)
    if fmt == 1:
        return mx.to_fp8(mx.clip(x, -E4M3_MAX, E4M3_MAX))  # MLX's own E4M3 conversion
    # E5M2: rounded once, from float32 (not float32 -> float16 -> E5M2, which
    # rounds twice): normals keep 2 mantissa bits (nearest, ties to even, on
    # the float32 bits), subnormals are multiples of 2^-16. The result is a
    # float16 exactly; its top byte is the E5M2 pattern.
    x = mx.clip(x, -E5M2_MAX, E5M2_MAX)
    u = x.view(mx.uint32)
    normal = ((u + 0xFFFFF + ((u >> 21) & 1)) & 0xFFE00000).view(mx.float32)
    small = mx.round(x * 65536.0) / 65536.0  # round half to even
    rounded = mx.where(mx.abs(x) < 2.0 ** -14, small, normal)
    return (rounded.astype(mx.float16).view(mx.uint16) >> 8).astype(mx.uint8)


def decode(b: mx.array, kv_cache_dtype: str, dtype=mx.float32, scale: float = 1.0) -> mx.array:
    """The values an 8-bit cache holds (times its scale), in `dtype`."""
    fmt = cache_format(kv_cache_dtype)
    if fmt == PER_ROW:
        row_scale = b[..., -SCALE_BYTES:].view(mx.float32)
        x = mx.from_fp8(b[..., :-SCALE_BYTES], dtype=mx.float32) * row_scale
    elif fmt == 1:
        x = mx.from_fp8(b, dtype=mx.float32)
    else:
        x = (b.astype(mx.uint16) << 8).view(mx.float16).astype(mx.float32)
    return (x * scale if scale != 1.0 else x).astype(dtype)


def row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes of one cached row of `head_dim` values."""
    return head_dim + (SCALE_BYTES if cache_format(kv_cache_dtype) == PER_ROW else 0)
