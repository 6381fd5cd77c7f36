// The CPU paged-attention kernel's work plan: which keys each query row
// sees, and the units (sequence, tile of query rows, KV heads, key
// partitions) the thread pool runs. Included by paged_attention_kernel.cpp
// only (compiled once per instruction set; nothing here is ISA-specific).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/paged_attention_kernel.h"
#include "cpu/paged_attention_tiles.h"

namespace vllm_metal::cpu {
namespace {

constexpr int kPartition = 512;   // keys per partition (multiple of any block size)

// One independent piece of work.
struct Unit {
  int seq;
  int tok_begin, tok_end;    // token indices within the sequence's new tokens
  int kv_head;
  int num_heads;             // KV heads kv_head .. kv_head + num_heads - 1 (decode: all of them)
  int part_begin, part_end;  // absolute key partitions this unit reduces
  int64_t partial_offset;    // -1: write rows to out; else offset into partials
};

// Which keys a query row sees: positions [lo(pos), hi(seq, pos)).
struct RowKeys {
  PagedAttentionParams p;
  const std::vector<int>& seq_lens;
  const std::vector<int>& cu;

  // The position of new token `tok` of sequence `seq`.
  int pos(int seq, int tok) const {
    int n = cu[seq + 1] - cu[seq];
    return seq_lens[seq] - n + tok;
  }

  int lo(int pos) const {
    return p.sliding_window > 0 ? std::max(0, pos - p.sliding_window + 1) : 0;
  }

  // One past the last key a row at `pos` of sequence `seq` sees: its own
  // position (causal), else the sequence's end or the window's far side.
  int hi(int seq, int pos) const {
    if (p.causal) return pos + 1;
    const int len = seq_lens[seq];
    return p.sliding_window > 0 ? std::min(len, pos + p.sliding_window) : len;
  }
};

// Builds the unit list: each sequence's tokens in tiles of its shape
// class's rows. Partitions of a tile run in one unit (merged in place)
// unless there are too few units to occupy the cores, as in long-context
// decode of few sequences; then they become separate units whose partials
// are merged afterwards, in the same order.
//
// Units run in any order on any thread; merges (one per split tile) after
// all units; `partials` sized for the split units' partial rows.
inline void plan_units(const Geometry& g, const RowKeys& keys, int thread_count, std::vector<Unit>& units,
                       std::vector<Unit>& merges, std::vector<float>& partials) {
  // all_heads: the tile's KV heads may share one unit (decode tiles, and
  // verify tiles whose table entry says so).
  struct Tile { int seq, tb, te, pb, pe; bool all_heads; };
  std::vector<Tile> tiles;
  const VerifyTile verify = verify_tile(g.head_dim, g.num_seqs);
  for (int s = 0; s < g.num_seqs; ++s) {
    int n = keys.cu[s + 1] - keys.cu[s];
    const QueryClass c = query_class(n);
    const int tile_tokens = c == QueryClass::verify
        ? (verify.tokens > 0 ? verify.tokens : n)
        : std::max(1, rows_per_tile(c, g.head_dim, g.group) / g.group);
    const bool all_heads = n == 1 || (c == QueryClass::verify && verify.kv_heads == 0);
    for (int tb = 0; tb < n; tb += tile_tokens) {
      int te = std::min(n, tb + tile_tokens);
      int lo = keys.lo(keys.pos(s, tb));
      int hi = keys.hi(s, keys.pos(s, te - 1)) - 1;  // inclusive
      tiles.push_back({s, tb, te, lo / kPartition, hi / kPartition + 1, all_heads});
    }
  }
  const std::size_t threads = static_cast<std::size_t>(std::max(1, thread_count));
  const std::size_t base_units = tiles.size() * g.num_kv_heads;
  const bool split = base_units < 2 * threads;
  // With enough sequences to occupy the cores, a decode sequence's KV heads
  // (and a verify tile's, where kVerifyTiles says so) go in one unit, which walks the key steps once for all of them: each
  // block's rows are then read for every head within one step, in address
  // order, instead of a third (or an eighth) of each row by units that run
  // at different times -- the access the memory system streams best
  // (docs/benchmarks.md, "Where the gap is"). A row's arithmetic does not
  // change.
  const bool whole_seq = tiles.size() >= 2 * threads;
  int64_t partial_floats = 0;
  for (const auto& t : tiles) {
    if (whole_seq && t.all_heads) {
      units.push_back({t.seq, t.tb, t.te, 0, g.num_kv_heads, t.pb, t.pe, -1});
      continue;
    }
    const int parts = t.pe - t.pb;
    if (split && parts > 1 && g.num_kv_heads > 1 && keys.cu[t.seq + 1] - keys.cu[t.seq] == 1 &&
        parts >= static_cast<int>(threads) &&
        (parts % static_cast<int>(threads) == 0 || parts >= 2 * static_cast<int>(threads))) {
      // Few long decode sequences with enough partitions to share out
      // evenly: one unit per partition over all KV heads (address order,
      // as whole_seq above); merged per row afterwards as below.
      merges.push_back({t.seq, t.tb, t.te, 0, g.num_kv_heads, t.pb, t.pe, partial_floats});
      const int64_t rows = static_cast<int64_t>(t.te - t.tb) * g.group * g.num_kv_heads;
      for (int p = t.pb; p < t.pe; ++p) {
        units.push_back({t.seq, t.tb, t.te, 0, g.num_kv_heads, p, p + 1, partial_floats});
        partial_floats += rows * (g.v_head_dim + 2);
      }
      continue;
    }
    for (int h = 0; h < g.num_kv_heads; ++h) {
      if (!split || t.pe - t.pb == 1) {
        units.push_back({t.seq, t.tb, t.te, h, 1, t.pb, t.pe, -1});
        continue;
      }
      // Partials of consecutive partitions lie back to back from here.
      merges.push_back({t.seq, t.tb, t.te, h, 1, t.pb, t.pe, partial_floats});
      const int64_t rows = (t.te - t.tb) * g.group;
      for (int p = t.pb; p < t.pe; ++p) {
        units.push_back({t.seq, t.tb, t.te, h, 1, p, p + 1, partial_floats});
        partial_floats += rows * (g.v_head_dim + 2);
      }
    }
  }
  partials.resize(partial_floats);
}

} // namespace
} // namespace vllm_metal::cpu
