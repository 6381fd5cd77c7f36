// The Metal library of the paged-attention primitive: every kernel,
// instantiated for every dtype and head-dim tier, in this one list.
//
// The build embeds this file, with its quoted includes inlined, into the
// extension (cmake/embed_metal_source.cmake); MLX compiles it once per process
// at first use. The executor tests compile the very same embedded text.
// Keep it ASCII: MLX hands the source to Metal as an ASCII string.
#include "paged_attention_decode.h"
#include "paged_attention_prefill.h"
#include "paged_attention_reduce.h"

#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// Names: paged_attention_<kind>_<dtype>_d<tier>, built the same way by
// vllm_metal::kernel_name in paged_attention_plan.h. Tiers 32..256 serve key
// and value head dims up to their size with (tier / 32) dims per lane; the
// large tier 576 serves keys up to 576 and values up to 512 (18 and 16 dims
// per lane) with its own prefill tiling (paged_attention_tuning.h). Decode
// comes per head (kind "decode") and grouped (kind "decode_gqa<width>": up
// to `width` query heads of one KV head per threadgroup, the tier's width in
// paged_attention_tuning.h).
// The kernels that read the caches (cache: their element type), then the
// whole tier (with the reduce kernel, which reads only partials).
#define instantiate_cache_reads(tname, type, cache, tier, dpl_k, dpl_v, heads, sg, rows, keys) \
  instantiate_kernel("paged_attention_decode_" #tname "_d" #tier, paged_attention_decode,     \
                     type, dpl_k, dpl_v, 1, cache)                                             \
  instantiate_kernel("paged_attention_decode_gqa" #heads "_" #tname "_d" #tier,               \
                     paged_attention_decode, type, dpl_k, dpl_v, heads, cache)                 \
  instantiate_kernel("paged_attention_prefill_" #tname "_d" #tier, paged_attention_prefill,   \
                     type, dpl_k, dpl_v, sg, rows, keys, cache)

#define instantiate_tier(tname, type, cache, tier, dpl_k, dpl_v, heads, sg, rows, keys, reduce) \
  instantiate_cache_reads(tname, type, cache, tier, dpl_k, dpl_v, heads, sg, rows, keys)      \
  reduce(instantiate_kernel("paged_attention_reduce_" #tname "_d" #tier, paged_attention_reduce, \
                            type, dpl_v))

#define with_reduce(x) x
#define no_reduce(x)

// (The grouped widths are spelled as numbers, for the kernel names; the
// static_asserts below hold them to the tuning enums.)
#define instantiate_small_tier(tname, type, cache, tier, dpl, heads, reduce)             \
  instantiate_tier(tname, type, cache, tier, dpl, dpl, heads, vllm_metal::kPrefillSimdgroups, \
                   vllm_metal::kPrefillRowsPerSimdgroup,                                 \
                   vllm_metal::kPrefillKvTileFloats / (tier), reduce)

// tname: the dtype's name, then the cache format's when the caches are
// 8-bit floats ("float16_fp8e4m3": paged_attention_plan.h's kernel_dtype;
// those share the dtype's reduce kernels: kernel_name drops the suffix).
#define instantiate_dtype_cache(tname, type, cache, reduce)                              \
  instantiate_small_tier(tname, type, cache, 32, 1, 8, reduce)                           \
  instantiate_small_tier(tname, type, cache, 64, 2, 8, reduce)                           \
  instantiate_small_tier(tname, type, cache, 128, 4, 8, reduce)                          \
  instantiate_small_tier(tname, type, cache, 256, 8, 4, reduce)                          \
  instantiate_tier(tname, type, cache, 576, vllm_metal::kLargeKeyDimsPerLane,            \
                   vllm_metal::kLargeValueDimsPerLane, 2, vllm_metal::kPrefillLargeSimdgroups, \
                   vllm_metal::kPrefillLargeRowsPerSimdgroup,                            \
                   vllm_metal::kPrefillLargeKvTileKeys, reduce)

#define instantiate_dtype(tname, type) instantiate_dtype_cache(tname, type, type, with_reduce)
#define instantiate_fp8(tname, type, cache) instantiate_dtype_cache(tname, type, cache, no_reduce)

static_assert(vllm_metal::kDecodeGroupHeadsSmall == 8 && vllm_metal::kDecodeGroupHeads256 == 4 &&
                  vllm_metal::kDecodeGroupHeadsLarge == 2,
              "the grouped decode widths in the kernel names below follow the tuning enums");

instantiate_dtype(float32, float)
instantiate_dtype(float16, half)
instantiate_dtype(bfloat16, bfloat)
instantiate_fp8(float32_fp8e4m3, float, vllm_metal::fp8_e4m3)
instantiate_fp8(float16_fp8e4m3, half, vllm_metal::fp8_e4m3)
instantiate_fp8(bfloat16_fp8e4m3, bfloat, vllm_metal::fp8_e4m3)
instantiate_fp8(float32_fp8e5m2, float, vllm_metal::fp8_e5m2)
instantiate_fp8(float16_fp8e5m2, half, vllm_metal::fp8_e5m2)
instantiate_fp8(bfloat16_fp8e5m2, bfloat, vllm_metal::fp8_e5m2)
instantiate_fp8(float32_fp8row, float, vllm_metal::fp8_e4m3_row)
instantiate_fp8(float16_fp8row, half, vllm_metal::fp8_e4m3_row)
instantiate_fp8(bfloat16_fp8row, bfloat, vllm_metal::fp8_e4m3_row)
