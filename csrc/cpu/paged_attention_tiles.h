// Tile configuration of the CPU paged-attention kernel per shape class: the
// one table to edit when tuning it. Each row is backed by the sweep in
// benchmarks/bench_paged_attention.py (`--tiles` for prefill, `--shapes` for
// the verify rows), for head dims 64, 128, 256 (and 512 for verify)
// (docs/primitives.md#cpu-tile-table has the numbers behind each row).
//
// A unit of work is (sequence, tile of query rows, kv head[s][, key
// partition]); it transposes each cache block's keys once and scores them
// against every row of its tile with a micro-kernel of `row_block` rows x 16
// keys. Nothing here changes numerics: every query row goes through the same
// operations in the same order whatever its tile, row block, heads per unit
// or thread (the kernel's batch-invariance argument), so the table is free to
// differ per class.
//
//   class     new tokens of the sequence   tile
//   decode    1                            the GQA group (one token); with
//                                          enough sequences, all KV heads
//                                          of the sequence in one unit
//   verify    2 .. kVerifyMaxTokens        kVerifyTiles[head-dim class]
//                                          [batch class]: tokens per tile,
//                                          KV heads per unit
//   prefill   more                         kPrefillRowsPerTile[head-dim class]
//                                          rows per tile
//
// Why (measured, see the docs section above):
// - decode: a row's keys are read once per KV head for the whole GQA group;
//   a larger tile cannot exist (one token).
// - verify (speculative decoding's verify rows: the last token + k drafts,
//   k + 1 = 2..8; short chunks too): all of the sequence's tokens per tile;
//   at large batch all KV heads per unit (see kVerifyTiles).
// - prefill: the key transposition and the block loads are paid once per
//   tile, so taller tiles amortise them; past ~128 rows the tile's queries
//   and scores leave L1/L2 and the count of units drops below what keeps
//   both cores busy on one long prompt. Head dim 256 halves the rows.
// - batch: with fewer units than 2 x threads (long-context decode of few
//   sequences), key partitions become units of their own (plan()).
#pragma once

namespace vllm_metal::cpu {

enum class QueryClass : int { decode = 0, verify = 1, prefill = 2 };

constexpr int kVerifyMaxTokens = 8;

// Indexed by head-dim class: <= 64, <= 128, <= 256, larger (latent attention).
constexpr int kPrefillRowsPerTile[4] = {128, 128, 64, 32};

// A verify sequence's tile: `tokens` of its new tokens per unit (0: all of
// them), and `kv_heads` KV heads per unit (1: one; 0: all of them, each
// step's keys and values loaded head after head before any is scored, as
// decode units do). Units over all KV heads are used only when the batch has
// enough tiles to occupy the cores without splitting keys (plan_units).
struct VerifyTile {
  int tokens;
  int kv_heads;
};

// Batch class of a verify call: the sequences of the call (any class).
enum class VerifyBatch : int { small = 0, large = 1 };
constexpr int kVerifyLargeBatchSeqs = 8;

// [head-dim class][batch class]: {small batch, large batch}. Before this
// table every verify sequence ran one tile of up to 64 rows on one KV head
// per unit: all its tokens for GQA groups up to 8, i.e. {0, 1} everywhere
// (bench_paged_attention.py --shapes shows it as "old").
//
// Why (bench_paged_attention.py --shapes, AVX2 build on a 2-core AMD EPYC,
// timed by CPU time on one kernel thread because other jobs loaded the
// machine: identical tiles differed by up to +-10-25% between runs; the sweep
// in benchmarks/results/paged_attention_shapes_sweep_avx2_amd.md chose the
// entries, benchmarks/results/paged_attention_shapes_avx2_amd.json has the
// old and new tiles side by side):
// - All of a sequence's tokens in one tile, at every batch and head dim: a
//   verify sequence's tokens see the same keys but their last few, so one
//   tile reads and transposes each block once for all of them; tiles of 1, 2
//   or 4 tokens were never faster beyond the noise.
// - Large batch (>= 8 sequences): all KV heads of a tile in one unit, its
//   blocks read for every head in one pass in address order (as decode
//   units do): without a window the verify rows are bound by reading the
//   cache, and this read is faster wherever the cache is large -- 8192
//   cached tokens at batch 8, 5 new tokens each: -20% at head dim 64, -26%
//   at 128, -17% at 256, -12% at 512 (the sweep: -45% at 128 with 2 new
//   tokens); 1024 at batch 32: -4% to -14%, and +9% at 128 in the recorded
//   run (-18% in the sweep). With a 512-token window (little to read) within
//   the noise (-12% to +3%).
// - Small batch: as before. Units over all KV heads apply only with enough
//   tiles to occupy the cores without splitting keys (plan_units), which a
//   batch of 1 never has; no other tile beat it beyond the noise.
constexpr VerifyTile kVerifyTiles[4][2] = {
    {{0, 1}, {0, 0}},  // head dim <= 64
    {{0, 1}, {0, 0}},  // <= 128
    {{0, 1}, {0, 0}},  // <= 256
    {{0, 1}, {0, 0}},  // larger (512: Gemma 4's global layers; latent attention)
};

inline int head_dim_class(int head_dim) {
  return head_dim <= 64 ? 0 : head_dim <= 128 ? 1 : head_dim <= 256 ? 2 : 3;
}

inline QueryClass query_class(int new_tokens) {
  return new_tokens <= 1                  ? QueryClass::decode
         : new_tokens <= kVerifyMaxTokens ? QueryClass::verify
                                          : QueryClass::prefill;
}

inline VerifyBatch verify_batch(int num_seqs) {
  return num_seqs >= kVerifyLargeBatchSeqs ? VerifyBatch::large : VerifyBatch::small;
}

// Benchmark hooks (ops._ext.set_cpu_tile_override): when > 0, replace the
// table's rows per tile for prefill-class sequences, and (verify_tokens,
// verify_kv_heads: 0 keeps the table's; verify_tokens >= kVerifyMaxTokens
// is all of a sequence's tokens, verify_kv_heads 1 one KV head per unit and
// anything larger all of them) the verify tile, so the sweeps can time the
// alternatives the table chose between. Never set while serving.
struct TileOverride {
  int prefill_rows = 0;
  int verify_tokens = 0;
  int verify_kv_heads = 0;
};
TileOverride& tile_override();

// The verify tile of a call: the table's entry, or the benchmark override.
inline VerifyTile verify_tile(int head_dim, int num_seqs) {
  VerifyTile t = kVerifyTiles[head_dim_class(head_dim)][static_cast<int>(verify_batch(num_seqs))];
  const TileOverride& o = tile_override();
  if (o.verify_tokens > 0) t.tokens = o.verify_tokens >= kVerifyMaxTokens ? 0 : o.verify_tokens;
  if (o.verify_kv_heads > 0) t.kv_heads = o.verify_kv_heads == 1 ? 1 : 0;
  return t;
}

// Query rows per tile of a decode or prefill sequence (rows = tokens x
// group; a tile always holds whole tokens, so at least `group` rows).
inline int rows_per_tile(QueryClass c, int head_dim, int group) {
  if (c == QueryClass::prefill) {
    const int o = tile_override().prefill_rows;
    return o > 0 ? o : kPrefillRowsPerTile[head_dim_class(head_dim)];
  }
  return group;
}

} // namespace vllm_metal::cpu
