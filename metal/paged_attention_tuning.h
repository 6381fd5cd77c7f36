// Launch sizes of the paged-attention kernels, per regime: the one table to
// edit when tuning on Apple hardware. Shared by the host plan and the MSL
// kernels (enums, so the same text is valid C++ and MSL).
//
//   regime            threadgroup            one threadgroup computes
//   decode            8 simdgroups (256)     1 query row (token, head), or one
//                                            key partition of it
//   decode reduce     1 simdgroup  (32)      1 query row: merges its partitions
//   prefill           4 simdgroups (128)     16 consecutive tokens x 1 head
//   prefill, large    8 simdgroups (256)     16 consecutive tokens x 1 head
//     head dims (> 256)
//
// Rows of sequences with >= kPrefillMinTokensPerSeq new tokens go to prefill,
// all others to decode; the kernels decide per row on the GPU, so a mixed
// batch (chunked prefill next to decodes) runs both, each on its own rows.
//
// Why these numbers (first choices, not yet measured on a Mac):
// - Decode reads each key once per row: a simdgroup takes every 8th key with
//   one lane per head dimension (coalesced K/V reads, one simd_sum per key,
//   the layout of MLX's sdpa_vector). 8 simdgroups keep a few hundred keys in
//   flight per row while the final merge of 8 softmax states stays cheap.
// - Long contexts with few rows would leave most of the GPU idle, so decode
//   splits keys into partitions of at least kPartitionMinKeys (>= 64 keys per
//   simdgroup, amortising the merge), aiming at kPartitionTargetThreadgroups
//   threadgroups in flight (a dozen per core on the largest Apple GPUs). This
//   also bounds the partial-result scratch to about
//   2 * kPartitionTargetThreadgroups * (v_head_dim + 2) floats (~4 MiB at 512).
// - Prefill stages a tile of K and V (kPrefillKvTileFloats floats each,
//   16 KiB together, leaving room for two threadgroups per core) and reuses it
//   for all 16 tokens of the tile, so the cache is read once per 16 tokens.
// - A sequence needs about half a tile of new tokens before staging K/V for
//   the tile beats reading it per row; below that (decode, speculative
//   decode) rows go to the decode kernel, whose threadgroups are independent.
// - Head dims past 256 (latent attention, MLA: keys of kv_lora_rank + rope
//   dims, e.g. 512 + 64, values of kv_lora_rank) use one large tier: 18 key
//   dims and 16 value dims per lane. Its prefill keeps 2 rows per simdgroup
//   (8 simdgroups, still 16 tokens per tile), so a thread holds about as many
//   floats as in the 256 tier (2 x (18 + 16) against 4 x (8 + 8)), and stages
//   6 keys per tile: 6 x (576 + 512) floats = 25.5 KiB, within the 32 KiB of
//   threadgroup memory (one threadgroup per core instead of two).
#pragma once

namespace vllm_metal {

enum PagedAttentionTuning : int {
  kSimdWidth = 32,  // Apple GPUs; the host checks the pipeline agrees

  kDecodeSimdgroups = 8,
  kPartitionMinKeys = 512,
  kPartitionTargetThreadgroups = 1024,
  kReduceSimdgroups = 1,

  kPrefillMinTokensPerSeq = 8,
  kPrefillSimdgroups = 4,
  kPrefillRowsPerSimdgroup = 4,
  kPrefillTokensPerTile = kPrefillSimdgroups * kPrefillRowsPerSimdgroup,
  kPrefillKvTileFloats = 2048,  // keys per tile = this / head-dim tier

  kLargeTier = 576,             // kernel name suffix of the large tier
  kLargeKeyDimsPerLane = 18,    // q and keys up to 576
  kLargeValueDimsPerLane = 16,  // values up to 512
  kPrefillLargeSimdgroups = 8,
  kPrefillLargeRowsPerSimdgroup = 2,
  kPrefillLargeKvTileKeys = 6,
};

} // namespace vllm_metal
