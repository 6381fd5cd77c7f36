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
#include "cpu/paged_attention_steps.h"
#include "cpu/paged_attention_tiles.h"
#include "thread_pool.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {


// T: q and the output; C: what the caches hold (T, or an 8-bit float). The
// cache reads (a step's keys transposed, its value segments, the prefetches)
// are StepLoader's (paged_attention_steps.h); this class plans the units and
// scores, reduces and writes their rows.
template <typename T, typename C = T>
class CpuPagedAttention : private StepLoader<C> {
  using Loader = StepLoader<C>;
  using Loader::chunk_;
  using Loader::dvp_;
  using Loader::g_;
  using Loader::kp_;
  using Loader::kt_of;
  using Loader::load_step;
  using Loader::slots_;

 public:
  explicit CpuPagedAttention(const KernelArgs& a)
      : Loader(a),
        q_(static_cast<const T*>(a.q)),
        bt_(a.block_tables),
        out_(static_cast<T*>(a.out)),
        sinks_(a.sinks),
        sinks_stride_(a.sinks_stride),
        p_(a.params),
        cu_(a.cu_seqlens_q),
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
  const int32_t* bt_;
  T* out_;
  const float* sinks_;
  int64_t sinks_stride_;
  PagedAttentionParams p_;
  const std::vector<int>& cu_;
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
