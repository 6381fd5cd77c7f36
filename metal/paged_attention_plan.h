// Host-side launch plan of the paged-attention kernels: from the static shapes
// and strides of one call, which kernels run, on what grid, with what
// arguments and how much partition scratch. Plain C++ without Metal or MLX, so
// that eval_gpu and the executor tests (which run the kernels on Linux) share
// this logic instead of each having their own copy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "paged_attention_params.h"
#include "paged_attention_tuning.h"

namespace vllm_metal {

// One dispatch_threadgroups call.
struct KernelLaunch {
  std::string name;
  uint32_t grid[3];  // threadgroups per grid
  uint32_t threads;  // threads per threadgroup (one-dimensional)
};

// Dispatched in this order: decode, reduce (if partitioned), prefill (if any
// sequence can have kPrefillMinTokensPerSeq new tokens). Which rows each
// kernel writes is decided on the GPU, per row (is_prefill_row in the
// kernels), because the host does not know the batch's lengths when encoding.
// The decode launch follows the row of kDecodeShapeTable for the call's shape
// class (paged_attention_tuning.h).
struct PagedAttentionPlan {
  PagedAttentionArgs args;
  HeadDimClass dims_class;
  QueryClass query_class;
  BatchClass batch_class;
  int table_row;  // index into kDecodeShapeTable
  KernelLaunch decode;
  bool has_reduce;  // partitioned: decode writes partials, reduce writes rows
  KernelLaunch reduce;
  bool has_prefill;
  KernelLaunch prefill;
  // The output and the partition scratch share one allocation: out's bytes,
  // padded to kScratchAlign, then the partials (float32). The scratch is part
  // of the primitive's output buffer, not an encoder temporary, so it lives
  // exactly as long as the output and needs no add_temporary.
  size_t partials_offset;  // bytes from the start of the allocation
  size_t total_bytes;
};

constexpr size_t kScratchAlign = 256;

// Dims per lane for a head dim: the smallest of 1, 2, 4, 8 with
// 32 * dpl >= head_dim (head_dim is 1..256 here).
inline int dims_per_lane(int head_dim) {
  int dpl = 1;
  while (dpl * kSimdWidth < head_dim) {
    dpl *= 2;
  }
  return dpl;
}

// The head-dim tier serving a key head dim (1..576) and a value head dim
// (1..512), both checked by the op: the smallest of 32, 64, 128, 256 holding
// both (one dims-per-lane count for keys and values), else the large tier.
inline int head_dim_tier(int head_dim, int v_head_dim) {
  const int widest = std::max(head_dim, v_head_dim);
  return widest <= 8 * kSimdWidth ? dims_per_lane(widest) * kSimdWidth : int(kLargeTier);
}

// The kernels' dtype name: q's ("float32", "float16", "bfloat16"), then, for
// 8-bit float caches (PagedAttentionParams::cache_format 1: E4M3, 2: E5M2),
// the cache's ("float16_fp8e4m3"; 3: E4M3 rows with a float32 scale each,
// "_fp8row"): paged_attention.metal's instantiations.
inline std::string kernel_dtype(const std::string& q_dtype_name, int cache_format) {
  return cache_format == 1 ? q_dtype_name + "_fp8e4m3"
      : cache_format == 2  ? q_dtype_name + "_fp8e5m2"
      : cache_format == 3  ? q_dtype_name + "_fp8row"
                           : q_dtype_name;
}

// dtype_name: kernel_dtype's result. The reduce kernel reads no cache: one
// per dtype, whatever the cache format.
inline std::string kernel_name(const char* kind, const std::string& dtype_name, int head_dim,
                               int v_head_dim) {
  const bool reduce = std::string(kind) == "reduce";
  const std::string dtype = reduce ? dtype_name.substr(0, dtype_name.find("_fp8")) : dtype_name;
  return std::string("paged_attention_") + kind + "_" + dtype + "_d" +
      std::to_string(head_dim_tier(head_dim, v_head_dim));
}

// Grouped decode kernels: kind "decode_gqa<width>" (paged_attention.metal).
inline std::string decode_kind(int heads_per_threadgroup) {
  return heads_per_threadgroup <= 1 ? std::string("decode")
                                    : "decode_gqa" + std::to_string(heads_per_threadgroup);
}

// The shape classes of one call (see the table in paged_attention_tuning.h).
inline HeadDimClass head_dim_class(int tier) {
  return tier <= 4 * kSimdWidth ? kDimsUpTo128 : tier <= 8 * kSimdWidth ? kDims256 : kDimsLarge;
}

inline QueryClass query_class(int num_tokens, int num_seqs) {
  if (num_tokens <= num_seqs) {
    return kQueryDecode;
  }
  const int64_t prefill_tokens = int64_t(kPrefillMinTokensPerSeq) * num_seqs;
  return num_tokens >= prefill_tokens ? kQueryPrefill : kQueryVerify;
}

inline BatchClass batch_class(int num_tokens, int num_kv_heads) {
  return int64_t(num_tokens) * num_kv_heads >= kLargeBatchKvRows ? kBatchLarge : kBatchSmall;
}

// Test hooks (0: what the table says): a partition size to force; the most
// heads per decode threadgroup (1: the per-head kernel; else the tier's
// grouped width, also for a group of 1); decode simdgroups
// (1..kDecodeMaxSimdgroups); the most tokens per decode threadgroup
// (1..kDecodeMaxTokens, within the width as the table's).
struct PlanOverrides {
  int partition_size = 0;
  int decode_heads = 0;
  int decode_simdgroups = 0;
  int decode_tokens = 0;
};

// `args` arrives with shapes, strides and parameters filled in (v_head_dim
// and has_sinks too); the plan completes it (group, decode heads and chunks,
// partitions). out_bytes: size of the output array.
inline PagedAttentionPlan plan_paged_attention(
    PagedAttentionArgs args,
    const std::string& dtype_name,
    size_t out_bytes,
    PlanOverrides overrides = {}) {
  if (args.head_dim < 1 || args.head_dim > kLargeKeyDimsPerLane * kSimdWidth ||
      args.v_head_dim < 1 || args.v_head_dim > kLargeValueDimsPerLane * kSimdWidth) {
    throw std::invalid_argument(
        "[paged_attention] head dims outside the Metal kernels' 1..576 (keys), 1..512 (values)");
  }
  const int tier = head_dim_tier(args.head_dim, args.v_head_dim);
  args.group = args.num_heads / args.num_kv_heads;
  const int64_t rows = int64_t(args.num_tokens) * args.num_heads;
  const int64_t capacity = int64_t(args.max_blocks_per_seq) * args.block_size;
  const auto u32 = [](int64_t x) { return static_cast<uint32_t>(x); };

  PagedAttentionPlan plan{};
  plan.dims_class = head_dim_class(tier);
  plan.query_class = query_class(args.num_tokens, args.num_seqs);
  plan.batch_class = batch_class(args.num_tokens, args.num_kv_heads);
  plan.table_row = decode_shape_row(plan.dims_class, plan.query_class, plan.batch_class);
  const DecodeShapeConfig& config = kDecodeShapeTable[plan.table_row];

  // Heads per decode threadgroup: the row's width, the group split into
  // ceil(group / width) chunks whose sizes differ by at most one; a group of
  // 1 runs the per-head kernel, unless the row asks for several tokens per
  // threadgroup (the verify regime: the grouped kernel's rows then hold
  // tokens).
  const int tokens_wanted =
      overrides.decode_tokens > 0 ? overrides.decode_tokens : config.decode_tokens;
  if (tokens_wanted < 1 || tokens_wanted > kDecodeMaxTokens) {
    throw std::invalid_argument("[paged_attention] decode tokens per threadgroup outside 1..8");
  }
  const int width = overrides.decode_heads > 0 ? overrides.decode_heads
      : args.group > 1 || tokens_wanted > 1 ? config.decode_heads
                                            : 1;
  if (width != 1 && width != decode_group_heads(plan.dims_class)) {
    throw std::invalid_argument("[paged_attention] no decode kernel for " +
                                std::to_string(width) + " heads per threadgroup at this tier");
  }
  const int simdgroups =
      overrides.decode_simdgroups > 0 ? overrides.decode_simdgroups : config.decode_simdgroups;
  if (simdgroups < 1 || simdgroups > kDecodeMaxSimdgroups) {
    throw std::invalid_argument("[paged_attention] decode simdgroups outside 1..8");
  }
  const int group = std::max(args.group, 1);
  args.decode_chunks = (group + width - 1) / width;
  args.decode_heads = (group + args.decode_chunks - 1) / args.decode_chunks;  // <= width
  // Tokens per threadgroup: what the row asks, within the rows the width
  // leaves after the chunk's heads.
  args.decode_tokens = std::max(1, std::min(tokens_wanted, width / args.decode_heads));
  // Threadgroups that compute rows (in the verify regime about one per
  // decode_tokens tokens: the others return at once), for the partition
  // choice below.
  const int64_t decode_threadgroups =
      (int64_t(args.num_tokens) + args.decode_tokens - 1) / args.decode_tokens *
      args.num_kv_heads * args.decode_chunks;

  args.num_partitions = 1;
  args.partition_size = static_cast<int>(std::min<int64_t>(capacity, INT32_MAX));

  // Split keys only when the decode grid alone leaves the GPU short of
  // threadgroups (and the row allows it).
  int64_t parts = 1;
  int64_t size = capacity;
  if (overrides.partition_size > 0) {
    size = overrides.partition_size;
    parts = std::max<int64_t>(1, (capacity + size - 1) / size);
  } else if (config.partition && decode_threadgroups > 0 &&
             decode_threadgroups < kPartitionTargetThreadgroups && capacity > kPartitionMinKeys) {
    const int64_t wanted =
        (kPartitionTargetThreadgroups + decode_threadgroups - 1) / decode_threadgroups;
    const int64_t most = (capacity + kPartitionMinKeys - 1) / kPartitionMinKeys;
    parts = std::min(wanted, most);
    size = (capacity + parts - 1) / parts;
    size = (size + kSimdWidth - 1) / kSimdWidth * kSimdWidth;
    parts = (capacity + size - 1) / size;
  }
  plan.decode = {kernel_name(decode_kind(width).c_str(), dtype_name, args.head_dim,
                             args.v_head_dim),
                 {u32(int64_t(args.num_kv_heads) * args.decode_chunks), u32(args.num_tokens),
                  u32(parts)},
                 u32(simdgroups * kSimdWidth)};
  plan.has_reduce = parts > 1;
  if (plan.has_reduce) {
    args.num_partitions = static_cast<int>(parts);
    args.partition_size = static_cast<int>(size);
    plan.reduce = {kernel_name("reduce", dtype_name, args.head_dim, args.v_head_dim),
                   {u32(args.num_heads), u32(args.num_tokens), 1},
                   u32(kReduceSimdgroups * kSimdWidth)};
  }
  plan.has_prefill = args.num_tokens >= kPrefillMinTokensPerSeq;
  if (plan.has_prefill) {
    const int64_t tiles =
        (int64_t(args.num_tokens) + kPrefillTokensPerTile - 1) / kPrefillTokensPerTile;
    const int prefill_simdgroups =
        tier == kLargeTier ? kPrefillLargeSimdgroups : kPrefillSimdgroups;
    plan.prefill = {kernel_name("prefill", dtype_name, args.head_dim, args.v_head_dim),
                    {u32(tiles), u32(args.num_heads), 1},
                    u32(prefill_simdgroups * kSimdWidth)};
  }

  plan.partials_offset = (out_bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  const size_t partial_floats = plan.has_reduce
      ? size_t(rows) * size_t(args.num_partitions) * size_t(args.v_head_dim + 2)
      : 0;
  plan.total_bytes = plan.has_reduce ? plan.partials_offset + partial_floats * sizeof(float)
                                     : out_bytes;
  plan.args = args;
  return plan;
}

} // namespace vllm_metal
