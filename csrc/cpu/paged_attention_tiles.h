// Tile configuration of the CPU paged-attention kernel per shape class: the
// one table to edit when tuning it. Each row is backed by the sweep in
// benchmarks/bench_paged_attention.py (`--tiles`), for head dims 64, 128 and
// 256 (docs/primitives.md#cpu-tile-table has the numbers behind each row).
//
// A unit of work is (sequence, tile of query rows, kv head[, key partition]);
// it transposes each cache block's keys once and scores them against every
// row of its tile with a micro-kernel of `row_block` rows x 16 keys. Nothing
// here changes numerics: every query row goes through the same operations in
// the same order whatever its tile, row block or thread (the kernel's
// batch-invariance argument), so the table is free to differ per class.
//
//   class     new tokens of the sequence   rows per tile
//   decode    1                            the GQA group (one token)
//   short     2 .. kShortMaxTokens         every row of the sequence's tokens,
//                                          up to kShortRowsPerTile
//   prefill   more                         kPrefillRowsPerTile[head-dim class]
//
// Why (measured, see the docs section above):
// - decode: a row's keys are read once per KV head for the whole GQA group;
//   a larger tile cannot exist (one token).
// - short (speculative decode, small chunks): one tile per sequence and KV
//   head reads the blocks once for all tokens.
// - prefill: the key transposition and the block loads are paid once per
//   tile, so taller tiles amortise them; past ~128 rows the tile's queries
//   and scores leave L1/L2 and the count of units drops below what keeps
//   both cores busy on one long prompt. Head dim 256 halves the rows.
// - batch: with fewer units than 2 x threads (long-context decode of few
//   sequences), key partitions become units of their own (plan()).
#pragma once

namespace vllm_metal::cpu {

enum class QueryClass : int { decode = 0, short_ = 1, prefill = 2 };

constexpr int kShortMaxTokens = 8;
constexpr int kShortRowsPerTile = 64;

// Indexed by head-dim class: <= 64, <= 128, <= 256, larger (latent attention).
constexpr int kPrefillRowsPerTile[4] = {128, 128, 64, 32};

inline int head_dim_class(int head_dim) {
  return head_dim <= 64 ? 0 : head_dim <= 128 ? 1 : head_dim <= 256 ? 2 : 3;
}

inline QueryClass query_class(int new_tokens) {
  return new_tokens <= 1                 ? QueryClass::decode
         : new_tokens <= kShortMaxTokens ? QueryClass::short_
                                         : QueryClass::prefill;
}

// Query rows per tile for a sequence of this class (rows = tokens x group;
// a tile always holds whole tokens, so at least `group` rows).
inline int rows_per_tile(QueryClass c, int head_dim, int group) {
  switch (c) {
    case QueryClass::decode:
      return group;
    case QueryClass::short_:
      return kShortRowsPerTile;
    case QueryClass::prefill:
      return kPrefillRowsPerTile[head_dim_class(head_dim)];
  }
  return group;
}

// Benchmark hook (ops._ext.set_cpu_tile_override): when > 0, replaces the
// table's rows per tile for prefill-class sequences, so the sweep can time
// the alternatives the table chose between. Never set while serving.
int& prefill_rows_override();

} // namespace vllm_metal::cpu
