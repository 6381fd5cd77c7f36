// Launch sizes of the paged-attention kernels, per regime and shape class: the
// one place to edit when tuning on Apple hardware. The enums are shared by the
// host plan and the MSL kernels (the same text is valid C++ and MSL); the
// shape-class table at the end is host-only (paged_attention_plan.h reads it).
//
//   regime            threadgroup            one threadgroup computes
//   decode, grouped   4 or 8 simdgroups      1 token x the query heads of one
//                     (the table below)      KV head (up to kDecodeGroupHeads*
//                                            of them), or one key partition
//   decode, per head  4 or 8 simdgroups      1 query row (token, head), or one
//                                            key partition of it (group 1)
//   decode, verify    4 or 8 simdgroups      up to decode_tokens consecutive
//                     (the table's verify    tokens of one sequence x the
//                     rows)                  query heads of one KV head (the
//                                            grouped kernel: tokens x heads
//                                            <= its width), or one partition
//   decode reduce     1 simdgroup  (32)      1 query row: merges its partitions
//   prefill           4 simdgroups (128)     16 consecutive tokens x 1 head
//   prefill, large    8 simdgroups (256)     16 consecutive tokens x 1 head
//     head dims (> 256)
//
// Rows of sequences with >= kPrefillMinTokensPerSeq new tokens go to prefill,
// all others (decode, speculative decoding's verify rows: up to 8) to decode; the kernels decide per row on the GPU, so a mixed
// batch (chunked prefill next to decodes) runs both, each on its own rows.
//
// Why these numbers (first choices, not yet measured on a Mac):
// - Decode reads each key once per threadgroup: a simdgroup takes every
//   n-th key (n simdgroups) with one lane per head dimension (coalesced K/V
//   reads, one simd_sum per key and query head, the layout of MLX's
//   sdpa_vector). With GQA the threadgroup serves every query head of its KV
//   head (all `group` heads, or a chunk of them: see the grouped widths), so
//   each key and value row is read once per KV head instead of once per
//   query head; decode is bound by those reads.
// - Grouped widths: each lane keeps, per query head of the chunk, its q slice
//   and accumulator (DPL_K + DPL_V floats). The widths keep that near 64
//   floats per lane, as the prefill tiles do at 256 and the large tier
//   (8 x (4 + 4) at d128, 4 x (8 + 8) at d256, 2 x (18 + 16) at the large
//   tier), so a lane's registers stay within what the per-head kernel and
//   prefill already use. A larger group is split into equal chunks
//   (ceil(group / width) of them, sizes differing by at most one), each read
//   of K/V then serving a chunk; the common groups (4, 5, 7, 8: 32/8, 40/8,
//   28/4, 64/8 heads) stay one chunk at d <= 128.
// - Long contexts with few threadgroups would leave most of the GPU idle, so
//   decode splits keys into partitions of at least kPartitionMinKeys (>= 64
//   keys per simdgroup, amortising the merge), aiming at
//   kPartitionTargetThreadgroups threadgroups in flight (a dozen per core on
//   the largest Apple GPUs). The scratch holds a state per query row and
//   partition: at most about 2 * kPartitionTargetThreadgroups * heads per
//   threadgroup * (v_head_dim + 2) floats (~8 MiB at each tier's width).
// - Prefill stages a tile of K and V (kPrefillKvTileFloats floats each,
//   16 KiB together, leaving room for two threadgroups per core) and reuses it
//   for all 16 tokens of the tile, so the cache is read once per 16 tokens.
// - A sequence needs about half a tile of new tokens before staging K/V for
//   the tile beats reading it per row; below that (decode, speculative
//   decode) rows go to the decode kernel, whose threadgroups are independent.
//   Verify rows of up to 8 tokens (the last token + 7 drafts) stay there too
//   (kPrefillMinTokensPerSeq 9): the verify regime reads each K/V row once
//   for several of a sequence's tokens, and prefill, which reads K/V once
//   per query head, would split 8-token sequences across its 16-token tiles.
// - Verify regime: the grouped kernel's registers hold `width` rows (q slice
//   and accumulator each, see the widths above); a chunk of the group leaves
//   width / heads of them for more tokens of the same sequence, each K/V row
//   then read once for tokens x heads rows instead of heads (MHA at d128: 8
//   tokens per read instead of 1; GQA 4 at d128: 2; a group that fills the
//   width: 1, as in decode).
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

  // Decode runs 1..kDecodeMaxSimdgroups simdgroups per threadgroup (the
  // table's choice, read by the kernel from simdgroups_per_threadgroup; its
  // threadgroup arrays are sized for the most).
  kDecodeMaxSimdgroups = 8,
  // Grouped decode: the most query heads one threadgroup computes, per
  // head-dim tier (each width is one instantiation per dtype and tier).
  kDecodeGroupHeadsSmall = 8,  // tiers 32, 64, 128
  kDecodeGroupHeads256 = 4,    // tier 256
  kDecodeGroupHeadsLarge = 2,  // the large tier
  kPartitionMinKeys = 512,
  kPartitionTargetThreadgroups = 1024,
  kReduceSimdgroups = 1,

  // The most tokens of one sequence a decode threadgroup computes (verify
  // regime; the table's decode_tokens).
  kDecodeMaxTokens = 8,

  kPrefillMinTokensPerSeq = 9,
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

  // Shape classes (host-only table below). Batch: "large" once the batch has
  // this many (token, KV head) pairs, i.e. decode threadgroups before any
  // key split (half the partition target: splitting keys could at most
  // double the grid, not worth a scratch pass).
  kLargeBatchKvRows = kPartitionTargetThreadgroups / 2,
};

#ifndef __METAL_VERSION__
// ---- Host only: the shape-class table -------------------------------------
//
// One row per (head-dim class, query-length class, batch class); the plan
// classifies a call from its static shapes (the host does not know the
// per-sequence lengths: they are lazy arrays) and launches the decode kernel
// the row names. Classes are launch-size hints only: every kernel handles any
// row it owns correctly, whatever the class.
//
//   head-dim class   the tier: 32..128 | 256 | large (576)
//   query class      decode:  num_tokens <= num_seqs (one new token each)
//                    verify:  fewer than kPrefillMinTokensPerSeq new tokens
//                             per sequence on average (speculative
//                             decoding's verify rows, 2..8 each; a short
//                             chunk next to decodes)
//                    prefill: at least that many (most rows are prefill's)
//   batch class      small:   num_tokens * num_kv_heads < kLargeBatchKvRows
//                    large:   otherwise
//
// Columns: decode_heads, the most query heads (of one KV head) a decode
// threadgroup computes: 1 runs the per-head kernel, otherwise the tier's
// grouped width (the only other instantiation); a group of 1 always runs the
// per-head kernel. decode_simdgroups: threads / 32 of a decode threadgroup.
// decode_tokens: the most consecutive tokens of one sequence a decode
// threadgroup computes (> 1: the verify regime, on the grouped kernel also
// for a group of 1; the plan gives it min(decode_tokens, width / heads of a
// chunk), so 1 where the group fills the width).
// partition: whether decode may split keys (see above) when the grid is short
// of threadgroups. Prefill has one tile configuration per tier (its template
// arguments, the enums above); the table does not vary it.
//
// Reasons of the rows (first choices, not measured on a Mac):
// - Every row groups heads (decode_heads = the tier's width): decode is bound
//   by K/V reads and grouping divides them by the chunk size; nothing argues
//   for re-reading K/V per query head in any class.
// - decode/verify, small batch: 8 simdgroups and partitions. Few threadgroups
//   (grouping made them fewer still), so each keeps many keys in flight and
//   long contexts split keys until the GPU is full.
// - decode/verify, large batch: 4 simdgroups, no partitions. The grid alone
//   fills the GPU; smaller threadgroups halve the merge each one ends with and
//   let more of them share a core.
// - verify, any batch: decode_tokens 8, i.e. as many of a sequence's verify
//   tokens as the width leaves room for: K/V reads bound these rows as they
//   bound decode, and the tokens of a sequence see the same keys but their
//   last few. (The same trade the CPU kernel's verify tiles measure,
//   csrc/cpu/paged_attention_tiles.h; an SGLang study of this shape found the
//   right tile worth 25-82% per shape on GPUs.) decode and prefill rows: 1
//   (one token per sequence; prefill's decode rows are mostly decodes).
// - prefill, any batch: 4 simdgroups. Most decode threadgroups belong to
//   prefill rows and return after one lookup, so they should be cheap to
//   launch; the decode rows of a mixed batch are a few. Partitions stay
//   allowed in small batches (a decode with a long context next to a short
//   chunk).
// - The rows per head-dim class are the same apart from the grouped width,
//   which follows registers (above); they are separate rows so that tuning
//   can make them differ.
enum HeadDimClass : int { kDimsUpTo128 = 0, kDims256 = 1, kDimsLarge = 2 };
enum QueryClass : int { kQueryDecode = 0, kQueryVerify = 1, kQueryPrefill = 2 };
enum BatchClass : int { kBatchSmall = 0, kBatchLarge = 1 };

struct DecodeShapeConfig {
  HeadDimClass dims;
  QueryClass queries;
  BatchClass batch;
  int decode_heads;
  int decode_simdgroups;
  bool partition;
  int decode_tokens;
};

inline constexpr DecodeShapeConfig kDecodeShapeTable[] = {
    // dims        queries        batch        decode_heads            sg  part.  tokens
    {kDimsUpTo128, kQueryDecode,  kBatchSmall, kDecodeGroupHeadsSmall, 8, true,  1},
    {kDimsUpTo128, kQueryDecode,  kBatchLarge, kDecodeGroupHeadsSmall, 4, false, 1},
    {kDimsUpTo128, kQueryVerify,  kBatchSmall, kDecodeGroupHeadsSmall, 8, true,  8},
    {kDimsUpTo128, kQueryVerify,  kBatchLarge, kDecodeGroupHeadsSmall, 4, false, 8},
    {kDimsUpTo128, kQueryPrefill, kBatchSmall, kDecodeGroupHeadsSmall, 4, true,  1},
    {kDimsUpTo128, kQueryPrefill, kBatchLarge, kDecodeGroupHeadsSmall, 4, false, 1},
    {kDims256,     kQueryDecode,  kBatchSmall, kDecodeGroupHeads256,   8, true,  1},
    {kDims256,     kQueryDecode,  kBatchLarge, kDecodeGroupHeads256,   4, false, 1},
    {kDims256,     kQueryVerify,  kBatchSmall, kDecodeGroupHeads256,   8, true,  8},
    {kDims256,     kQueryVerify,  kBatchLarge, kDecodeGroupHeads256,   4, false, 8},
    {kDims256,     kQueryPrefill, kBatchSmall, kDecodeGroupHeads256,   4, true,  1},
    {kDims256,     kQueryPrefill, kBatchLarge, kDecodeGroupHeads256,   4, false, 1},
    {kDimsLarge,   kQueryDecode,  kBatchSmall, kDecodeGroupHeadsLarge, 8, true,  1},
    {kDimsLarge,   kQueryDecode,  kBatchLarge, kDecodeGroupHeadsLarge, 4, false, 1},
    {kDimsLarge,   kQueryVerify,  kBatchSmall, kDecodeGroupHeadsLarge, 8, true,  8},
    {kDimsLarge,   kQueryVerify,  kBatchLarge, kDecodeGroupHeadsLarge, 4, false, 8},
    {kDimsLarge,   kQueryPrefill, kBatchSmall, kDecodeGroupHeadsLarge, 4, true,  1},
    {kDimsLarge,   kQueryPrefill, kBatchLarge, kDecodeGroupHeadsLarge, 4, false, 1},
};

inline constexpr int kDecodeShapeTableRows =
    int(sizeof(kDecodeShapeTable) / sizeof(kDecodeShapeTable[0]));

// The grouped width instantiated for a head-dim class.
constexpr int decode_group_heads(HeadDimClass dims) {
  return dims == kDimsUpTo128 ? int(kDecodeGroupHeadsSmall)
      : dims == kDims256       ? int(kDecodeGroupHeads256)
                               : int(kDecodeGroupHeadsLarge);
}

// Index of the row for a class, -1 if none.
constexpr int decode_shape_row(HeadDimClass dims, QueryClass queries, BatchClass batch) {
  for (int i = 0; i < kDecodeShapeTableRows; ++i) {
    const DecodeShapeConfig& r = kDecodeShapeTable[i];
    if (r.dims == dims && r.queries == queries && r.batch == batch) {
      return i;
    }
  }
  return -1;
}

// Every class has exactly one row, and each row names what is instantiated.
constexpr bool decode_shape_table_is_valid() {
  if (kDecodeShapeTableRows != 3 * 3 * 2) {
    return false;
  }
  for (int i = 0; i < kDecodeShapeTableRows; ++i) {
    const DecodeShapeConfig& r = kDecodeShapeTable[i];
    if (decode_shape_row(r.dims, r.queries, r.batch) != i) {
      return false;  // a duplicate key
    }
    if (r.decode_heads != 1 && r.decode_heads != decode_group_heads(r.dims)) {
      return false;  // no kernel for that width
    }
    if (r.decode_simdgroups < 1 || r.decode_simdgroups > kDecodeMaxSimdgroups) {
      return false;
    }
    if (r.decode_tokens < 1 || r.decode_tokens > kDecodeMaxTokens) {
      return false;
    }
  }
  return true;
}
static_assert(decode_shape_table_is_valid(),
              "kDecodeShapeTable: one row per class, instantiated widths, 1..8 simdgroups, "
              "1..kDecodeMaxTokens tokens");
#endif  // __METAL_VERSION__

} // namespace vllm_metal
