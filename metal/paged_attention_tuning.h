// Launch sizes of the paged-attention kernels, per regime: the one table to
// edit when tuning on Apple hardware. Shared by the host plan and the MSL
// kernels (enums, so the same text is valid C++ and MSL).
//
//   regime            threadgroup            one threadgroup computes
//   decode            8 simdgroups (256)     1 query row (token, head), or one
//                                            key partition of it
//   decode reduce     1 simdgroup  (32)      1 query row: merges its partitions
//   prefill           4 simdgroups (128)     16 consecutive tokens x 1 head
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
//   2 * kPartitionTargetThreadgroups * (head_dim + 2) floats (~2 MiB).
// - Prefill stages a tile of K and V (kPrefillKvTileFloats floats each,
//   16 KiB together, leaving room for two threadgroups per core) and reuses it
//   for all 16 tokens of the tile, so the cache is read once per 16 tokens.
// - A sequence needs about half a tile of new tokens before staging K/V for
//   the tile beats reading it per row; below that (decode, speculative
//   decode) rows go to the decode kernel, whose threadgroups are independent.
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
};

} // namespace vllm_metal
