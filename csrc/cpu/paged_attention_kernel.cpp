// The CPU paged-attention kernel, compiled once per instruction set (see
// CMakeLists.txt) and chosen at run time by paged_attention_cpu.cpp.
//
// Work is split into units of (sequence, tile of query rows, kv head[, key
// partition]); tile sizes come from the shape-class table in
// paged_attention_tiles.h. A unit walks the keys its rows can see in steps
// (128 keys of 16-, 32- or 64-key blocks, else one block): it loads a step's keys
// once, transposed (head dim x keys, keys across the SIMD lanes), and scores
// them against every row of the tile with a register-blocked micro-kernel
// (row_block rows x 16 keys, one FMA chain per lane over the head dim;
// a few rows score several 16-key groups side by side);
// each value row is then loaded once per kValueRowBlock rows that see the
// same keys and accumulated into them. Softmax is an online (streaming)
// softmax in float32, one update per step. Scores use head_dim (q and key rows),
// the accumulator v_head_dim (the first values of each value row); an
// attention sink is folded into a row's finished state when it is written.
//
// Numerics are batch-invariant by construction: a row's score for a key is a
// dot product in head-dim order; its softmax advances one step of keys at a
// time (absolute, aligned ranges: 128 keys of 16-, 32- or 64-key blocks, else one
// block; kChunkKeys), masked keys contribute exact zeros;
// keys are visited in absolute partitions of kPartition positions, each
// reduced with a fresh online softmax and merged pairwise in position order.
// So a query row's result depends only on its own sequence, never on what
// else is in the batch, how rows are tiled or blocked, which instruction set
// ran (the AVX2 and AVX-512 builds make the same FMAs lane by lane), or
// whether partitions ran in parallel.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/simd.h"
#include "cpu/paged_attention_blocks.h"
#include "cpu/paged_attention_kernel.h"
#include "cpu/paged_attention_plan.h"
#include "cpu/paged_attention_scratch.h"
#include "cpu/paged_attention_softmax.h"
#include "cpu/paged_attention_tiles.h"
#include "thread_pool.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

// The transposed keys of the heads loaded together stay within this (L2).
constexpr int kSlotBytes = 128 << 10;

// T: q and the output; C: what the caches hold (T, or an 8-bit float).
template <typename T, typename C = T>
class CpuPagedAttention {
 public:
  explicit CpuPagedAttention(const KernelArgs& a)
      : q_(static_cast<const T*>(a.q)),
        k_(static_cast<const C*>(a.key_cache)),
        v_(static_cast<const C*>(a.value_cache)),
        bt_(a.block_tables),
        out_(static_cast<T*>(a.out)),
        sinks_(a.sinks),
        sinks_stride_(a.sinks_stride),
        p_(a.params),
        g_(a.geometry),
        cu_(a.cu_seqlens_q),
        dvp_(round_up(g_.v_head_dim, kLanes)),
        chunk_(g_.block_size % kLanes == 0 && g_.block_size < kChunkKeys && kChunkKeys % g_.block_size == 0
                   ? kChunkKeys
                   : g_.block_size),
        kp_(round_up(chunk_, kLanes) + kLanes),
        slots_(std::clamp(kSlotBytes / (g_.head_dim * kp_ * static_cast<int>(sizeof(float))), 1, kMaxSlots)),
        keys_{a.params, a.seq_lens, a.cu_seqlens_q} {}

  void run() {
    plan_units(g_, keys_, cpu_thread_count(), units_, merges_, partials_);
    parallel_for(units_.size(), [this](std::size_t i) { run_unit(units_[i]); });
    if (!merges_.empty()) {
      parallel_for(merges_.size(), [this](std::size_t i) { merge_partials(i); });
    }
  }

 private:
  // Row r of a unit: its token (index into q/out) and query head. Rows run
  // KV head by KV head, each head's rows token-major, then head within the group.
  void row_token_head(const Unit& u, int r, int& t, int& h) const {
    const int per_head = (u.tok_end - u.tok_begin) * g_.group;
    const int hl = r / per_head, rr = r % per_head;
    t = cu_[u.seq] + u.tok_begin + rr / g_.group;
    h = (u.kv_head + hl) * g_.group + rr % g_.group;
  }

  void run_unit(const Unit& u) {
    thread_local Scratch sc;
    const int D = g_.head_dim, Dv = g_.v_head_dim;
    const int rows = (u.tok_end - u.tok_begin) * g_.group * u.num_heads;
    sc.q.resize(rows * D);
    sc.acc.assign(rows * dvp_, 0.0f);
    sc.state.assign(rows, RowState{kNegInf, 0.0f});
    sc.part_acc.resize(rows * dvp_);
    sc.part_state.resize(rows);
    sc.kt.resize(static_cast<std::size_t>(slots_) * D * kp_);
    sc.v.resize(static_cast<std::size_t>(slots_) * (chunk_ + kLanes) * dvp_);
    sc.krows.resize(static_cast<std::size_t>(kLanes) * D);
    sc.zeros.assign(D, 0.0f);
    sc.scores.resize(static_cast<std::size_t>(rows) * kp_);
    sc.lo.resize(rows);
    sc.hi.resize(rows);

    // Gather the tile's query rows (KV head, then token, then head within
    // the group).
    for (int r = 0; r < rows; ++r) {
      int t, h;
      row_token_head(u, r, t, h);
      load_row(q_ + t * g_.q_st[0] + h * g_.q_st[1], g_.q_st[2], D, &sc.q[r * D]);
    }

    for (int part = u.part_begin; part < u.part_end; ++part) {
      reduce_partition(u, part, rows, sc);
      for (int r = 0; r < rows; ++r) {
        merge_into(sc.state[r], &sc.acc[r * dvp_], sc.part_state[r], &sc.part_acc[r * dvp_],
                   Dv);
      }
    }

    if (u.partial_offset < 0) {
      for (int r = 0; r < rows; ++r) {
        write_row(u, r, sc.state[r], &sc.acc[r * dvp_]);
      }
    } else {
      float* dst = &partials_[u.partial_offset];
      for (int r = 0; r < rows; ++r) {
        dst[0] = sc.state[r].m;
        dst[1] = sc.state[r].l;
        std::copy_n(&sc.acc[r * dvp_], Dv, dst + 2);
        dst += Dv + 2;
      }
    }
  }

  // L2 prefetch of `rows` cache rows of `width` elements, `stride` apart:
  // decode reads each block's rows of a head once, in pieces too short for
  // the hardware prefetchers. With the value rows of the step being scored
  // and the next block's key rows: decode over 30 layers' caches, batch 1
  // 5.0-6.0 -> 4.8-5.3 ms, batch 8 31-37 -> 27 ms (docs/benchmarks.md,
  // "Where the gap is"); an L1 hint measured no better.
  static void prefetch_rows(const C* first, int64_t stride, int rows, int width) {
    const int64_t bytes = width * static_cast<int64_t>(sizeof(C));
    for (int i = 0; i < rows; ++i) {
      const char* r = reinterpret_cast<const char*>(first + i * stride);
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(r + b, 0, 2);
      }
    }
  }

  // Loads keys [p0, p1) of one cache block transposed into sc.kt's lanes
  // from `col` (head_dim rows of kp_; the lanes up to the next multiple of 16
  // past them zero) and appends their value segment: the cache's own rows
  // where they are float32 vectors, else rows of dvp_ in sc.v from row `col`
  // (converted, zero past v_head_dim).
  void load_block(int block_id, int b0, int p0, int p1, int kv_head, int col, int slot, Scratch& sc) {
    const int D = g_.head_dim, Dv = g_.v_head_dim;
    const int n = p1 - p0;
    const float* rows[kLanes];
    for (int g0 = 0; g0 < n; g0 += kLanes) {
      for (int i = 0; i < kLanes; ++i) {
        const int p = p0 + g0 + i;
        if (g0 + i >= n) {
          rows[i] = sc.zeros.data();
          continue;
        }
        const int64_t k_off = block_id * g_.k_st[0] + (p - b0) * g_.k_st[1] + kv_head * g_.k_st[2];
        if constexpr (std::is_same_v<C, float>) {
          if (g_.k_st[3] == 1) {
            rows[i] = k_ + k_off;
            continue;
          }
        }
        float* staged = &sc.krows[static_cast<int64_t>(i) * D];
        load_row(k_ + k_off, g_.k_st[3], D, staged);
        rows[i] = staged;
      }
      transpose_keys(rows, D, kt_of(sc, slot) + col + g0, kp_);
    }
    const int64_t v_row0 = block_id * g_.v_st[0] + (p0 - b0) * g_.v_st[1] + kv_head * g_.v_st[2];
    // This head's value rows of these keys, into L2 while the step's keys
    // are transposed and scored: the accumulation reads them from memory
    // otherwise (perf put the step's stall on those loads).
    prefetch_rows(v_ + v_row0, g_.v_st[1], n, Dv);
    if constexpr (std::is_same_v<C, float>) {
      // Float32 rows of whole vectors are read in place: no copy.
      if (g_.v_st[3] == 1 && dvp_ == Dv) {
        sc.seg[slot][sc.nseg[slot]++] = {v_ + v_row0, g_.v_st[1], col, n};
        return;
      }
    }
    float* dst = &sc.v[(static_cast<int64_t>(slot) * (chunk_ + kLanes) + col) * dvp_];
    sc.seg[slot][sc.nseg[slot]++] = {dst, dvp_, col, n};
    for (int i = 0; i < n; ++i) {
      const int64_t v_off = v_row0 + i * g_.v_st[1];
      float* vr = dst + static_cast<int64_t>(i) * dvp_;
      load_row(v_ + v_off, g_.v_st[3], Dv, vr);
      std::fill(vr + Dv, vr + dvp_, 0.0f);
    }
  }

  // Fresh online softmax of every row of the unit over one key partition,
  // into sc.part_state / sc.part_acc.
  void reduce_partition(const Unit& u, int part, int rows, Scratch& sc) {
    std::fill(sc.part_acc.begin(), sc.part_acc.begin() + rows * dvp_, 0.0f);
    std::fill(sc.part_state.begin(), sc.part_state.begin() + rows, RowState{kNegInf, 0.0f});

    const int first_pos = keys_.pos(u.seq, u.tok_begin);
    const int last_pos = keys_.pos(u.seq, u.tok_end - 1);
    const int key_lo = std::max(part * kPartition, keys_.lo(first_pos));
    const int key_hi = std::min((part + 1) * kPartition, keys_.hi(u.seq, last_pos));  // exclusive
    if (key_lo >= key_hi) {
      return;
    }
    const int32_t* table = bt_ + u.seq * g_.bt_st[0];
    const int per_head = (u.tok_end - u.tok_begin) * g_.group;
    // Steps over absolute, aligned key ranges [c0, c0 + chunk_) (a partition
    // is a whole number of them); lane i of a step is key c0 + i. A unit of
    // several KV heads (decode) loads a step for up to slots_ of them, block
    // by block, before scoring any: each block's rows of those heads are read
    // one after another, in address order, instead of a third of each row per
    // pass over the step (batch-8 decode over 30 layers' caches streamed from
    // memory: 25.8-26.5 -> 24.7-25.4 ms; docs/benchmarks.md). A row's
    // arithmetic does not change.
    for (int c0 = key_lo / chunk_ * chunk_; c0 < key_hi; c0 += chunk_) {
      const int p0 = std::max(key_lo, c0), p1 = std::min(key_hi, c0 + chunk_);
      for (int h0 = 0; h0 < u.num_heads; h0 += slots_) {
        const int nh = std::min(slots_, u.num_heads - h0);
        load_step(u.kv_head + h0, nh, c0, p0, p1, table, sc);
        for (int s = 0; s < nh; ++s) {
          step_head(u, s, (h0 + s) * per_head, per_head, c0, p0, p1, first_pos, sc);
        }
      }
    }
  }

  float* kt_of(Scratch& sc, int slot) const { return sc.kt.data() + static_cast<int64_t>(slot) * g_.head_dim * kp_; }

  // Loads a step's keys [p0, p1) of KV heads kv_head .. kv_head + nh - 1
  // (transposed) and their value segments into slots 0 .. nh - 1, block by
  // block, each block's heads one after another.
  void load_step(int kv_head, int nh, int c0, int p0, int p1, const int32_t* table, Scratch& sc) {
    const int D = g_.head_dim, bs = g_.block_size;
    for (int s = 0; s < nh; ++s) sc.nseg[s] = 0;
    for (int b = p0 / bs; b * bs < p1; ++b) {
      const int q0 = std::max(p0, b * bs), q1 = std::min(p1, (b + 1) * bs);
      for (int s = 0; s < nh; ++s) {
        if ((b + 1) * bs < p1) {  // the step's next block's key rows of this head, into L2
          prefetch_rows(k_ + table[(b + 1) * g_.bt_st[1]] * g_.k_st[0] + (kv_head + s) * g_.k_st[2], g_.k_st[1], bs, D);
        }
        load_block(table[b * g_.bt_st[1]], b * bs, q0, q1, kv_head + s, q0 - c0, s, sc);
      }
    }
  }

  // One step [c0, c0 + chunk_) (keys [p0, p1)) of the KV head loaded into
  // `slot`, for its rows [base, base + rows) of the unit: the rows scored,
  // their softmax advanced and their values accumulated.
  void step_head(const Unit& u, int slot, int base, int rows, int c0, int p0, int p1, int first_pos, Scratch& sc) {
    const int D = g_.head_dim;
    const int ng = (p1 - c0 + kLanes - 1) / kLanes;

    // Rows that see none of these keys (the first rows of a causal tile
    // against its last keys, rows whose window ended) are not scored.
    int r_first = 0;
    while (r_first < rows && keys_.hi(u.seq, first_pos + r_first / g_.group) <= p0) ++r_first;
    int r_end = rows;
    while (r_end > r_first && keys_.lo(first_pos + (r_end - 1) / g_.group) >= p1) --r_end;
    if (r_first >= r_end) {
      return;
    }
    score_block(&sc.q[(base + r_first) * D], r_end - r_first, D, kt_of(sc, slot), kp_, ng,
                &sc.scores[(base + r_first) * kp_], kMaxRowBlock);

    for (int r = r_first; r < r_end; ++r) {
      const int pos = first_pos + r / g_.group;
      const int lo = std::max(p0, keys_.lo(pos)) - c0, hi = std::min(p1, keys_.hi(u.seq, pos)) - c0;
      sc.lo[base + r] = lo;
      sc.hi[base + r] = hi;
      if (lo < hi) {
        online_softmax_step(&sc.scores[(base + r) * kp_], ng, lo, hi, p_.scale, p_.softcap,
                            sc.part_state[base + r], &sc.part_acc[(base + r) * dvp_], dvp_);
      }
    }
    // The values, into rows with the same keys kValueRowBlock at a time.
    for (int r = base + r_first; r < base + r_end;) {
      int n = 1;
      while (n < kValueRowBlock && r + n < base + r_end && sc.lo[r + n] == sc.lo[r] && sc.hi[r + n] == sc.hi[r]) ++n;
      if (sc.lo[r] < sc.hi[r]) {
        accumulate_step(r, n, slot, sc);
      }
      r += n;
    }
  }

  // acc += p . values for rows [r, r + n) of a step (the same lanes
  // [lo, hi)), segment by segment in key order.
  void accumulate_step(int r, int n, int slot, Scratch& sc) {
    const int lo = sc.lo[r], hi = sc.hi[r];
    float* acc = &sc.part_acc[r * dvp_];
    const float* w = &sc.scores[r * kp_];
    for (int j = 0; j < sc.nseg[slot]; ++j) {
      const ValueSegment& g = sc.seg[slot][j];
      const int a0 = std::max(lo, g.off) - g.off, a1 = std::min(hi, g.off + g.n) - g.off;
      if (a0 >= a1) continue;
      accumulate_values_n(n, acc, dvp_, w + g.off, kp_, g.v, g.stride, a0, a1, dvp_);
    }
  }

  // Normalises a row's finished state and stores it. The sink, if any, is
  // one more logit in the denominator with no value: folded in here, once
  // per row, whichever way the row's partitions were reduced.
  void write_row(const Unit& u, int r, RowState st, const float* acc) {
    const int Dv = g_.v_head_dim;
    int t, h;
    row_token_head(u, r, t, h);
    T* dst = out_ + (static_cast<int64_t>(t) * g_.num_heads + h) * Dv;
    float inv = 1.0f / st.l;
    if (sinks_ != nullptr) {
      const float sink = sinks_[h * sinks_stride_];
      const float m = std::max(st.m, sink);
      const float c = std::exp(st.m - m);
      inv = c / (st.l * c + std::exp(sink - m));
    }
    float* row = scaled_row_buffer(Dv);
    for (int d = 0; d < Dv; ++d) {
      row[d] = acc[d] * inv;
    }
    store_row(row, Dv, dst);
  }

  // Merges the partials of split unit group i in partition order, exactly as
  // run_unit does in place, and writes the rows.
  void merge_partials(std::size_t i) {
    const Unit& u = merges_[i];
    const int Dv = g_.v_head_dim;
    const int rows = (u.tok_end - u.tok_begin) * g_.group * u.num_heads;
    std::vector<float> acc(Dv);
    for (int r = 0; r < rows; ++r) {
      RowState st{kNegInf, 0.0f};
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int p = 0; p < u.part_end - u.part_begin; ++p) {
        const float* src = &partials_[u.partial_offset + (p * rows + r) * (Dv + 2)];
        merge_into(st, acc.data(), RowState{src[0], src[1]}, src + 2, Dv);
      }
      write_row(u, r, st, acc.data());
    }
  }

  const T* q_;
  const C* k_;
  const C* v_;
  const int32_t* bt_;
  T* out_;
  const float* sinks_;
  int64_t sinks_stride_;
  PagedAttentionParams p_;
  Geometry g_;
  const std::vector<int>& cu_;
  const int dvp_;    // v_head_dim padded to whole vectors
  const int chunk_;  // keys per softmax step (absolute, aligned ranges): kChunkKeys or a block
  const int kp_;     // a step's keys padded to whole vectors, plus one (row stride of kt, scores)
  const int slots_;  // KV heads whose step is loaded before any is scored (kt within kSlotBytes)
  const RowKeys keys_;  // which keys each query row sees
  std::vector<Unit> units_, merges_;
  std::vector<float> partials_;
};

template <typename T>
void run_with_cache(const KernelArgs& args) {
  switch (args.params.cache_format) {
    case kCacheFp8E4M3:
      CpuPagedAttention<T, Fp8E4M3>(args).run();
      break;
    case kCacheFp8E5M2:
      CpuPagedAttention<T, Fp8E5M2>(args).run();
      break;
    case kCacheFp8E4M3Row:
      CpuPagedAttention<T, Fp8E4M3Row>(args).run();
      break;
    default:
      CpuPagedAttention<T>(args).run();
  }
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const KernelArgs& args) {
  switch (args.dtype) {
    case KernelDtype::float32:
      run_with_cache<float>(args);
      break;
    case KernelDtype::float16:
      run_with_cache<mx::float16_t>(args);
      break;
    case KernelDtype::bfloat16:
      run_with_cache<mx::bfloat16_t>(args);
      break;
  }
}

} // namespace vllm_metal::cpu
