// The CPU paged-attention kernel, compiled once per instruction set (see
// CMakeLists.txt) and chosen at run time by paged_attention_cpu.cpp.
//
// Work is split into units of (sequence, tile of query tokens, kv head[, key
// partition]); each unit loads a cache block's K/V rows once and uses them for
// every query head of the GQA group and every token of the tile. Softmax is an
// online (streaming) softmax in float32. Scores use head_dim (q and key rows),
// the accumulator v_head_dim (the first values of each value row); an
// attention sink is folded into a row's finished state when it is written.
//
// Numerics are batch-invariant by construction: keys are visited in absolute
// partitions of kPartition positions; each partition is reduced with a fresh
// online softmax, and partitions are merged pairwise in position order. So a
// query row's result depends only on its own sequence, never on what else is
// in the batch, how tokens are tiled, or whether partitions ran in parallel.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/paged_attention_kernel.h"
#include "thread_pool.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int kPartition = 1024;  // keys per partition (multiple of any block size)
constexpr int kRowsPerTile = 64;  // query rows (tokens x group heads) per unit
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One independent piece of work.
struct Unit {
  int seq;
  int tok_begin, tok_end;    // token indices within the sequence's new tokens
  int kv_head;
  int part_begin, part_end;  // absolute key partitions this unit reduces
  int64_t partial_offset;    // -1: write rows to out; else offset into partials
};

// Running softmax state of one query row over some set of keys.
struct RowState {
  float m, l;  // max score and sum of exp(score - m)
};

inline float dot(const float* a, const float* b, int n) {
  // Sixteen independent accumulators in a fixed order: two vector registers'
  // worth of parallel FMA chains, deterministic without -ffast-math.
  float s[16] = {};
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int j = 0; j < 16; ++j) {
      s[j] += a[d + j] * b[d + j];
    }
  }
  for (int j = 0; d + j < n && j < 16; ++j) {  // tail, same lanes
    s[j] += a[d + j] * b[d + j];
  }
  float r = 0.0f;
  for (int j = 0; j < 8; ++j) {
    r += s[j] + s[j + 8];
  }
  return r;
}

// exp(x) for x <= 0 (scores minus their running max), vectorizable: Cephes'
// expf polynomial with round-to-nearest by the 1.5 * 2^23 trick, ~1 ulp.
// Below -87.3 it returns ~1e-38 instead of 0: negligible next to the max
// key's weight of 1.
inline void exp_inplace(float* x, int n) {
  for (int i = 0; i < n; ++i) {
    float v = x[i] < -87.3f ? -87.3f : x[i];
    v = v > 88.3f ? 88.3f : v;
    const float t = v * 1.44269504088896341f + 12582912.0f;  // round(v / ln 2) in the low bits
    const float k = t - 12582912.0f;
    const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t scale = (std::bit_cast<int32_t>(t) - 0x4B400000 + 127) << 23;  // 2^k
    x[i] = p * std::bit_cast<float>(scale);
  }
}

// acc[0:n] += sum_i w[i] * v[i * stride + 0:n], in i order for every element,
// a register-sized chunk of acc at a time.
inline void accumulate_rows(float* acc, const float* w, const float* v, int count,
                            int stride, int n) {
  constexpr int kChunk = 32;
  int d0 = 0;
  for (; d0 + kChunk <= n; d0 += kChunk) {
    float a[kChunk];
    for (int j = 0; j < kChunk; ++j) a[j] = acc[d0 + j];
    for (int i = 0; i < count; ++i) {
      const float* vi = v + i * stride + d0;
      for (int j = 0; j < kChunk; ++j) a[j] += w[i] * vi[j];
    }
    for (int j = 0; j < kChunk; ++j) acc[d0 + j] = a[j];
  }
  for (int i = 0; i < count; ++i) {
    for (int d = d0; d < n; ++d) acc[d] += w[i] * v[i * stride + d];
  }
}

// Merges state (m2, l2, acc2) into (m1, l1, acc1); the one combine rule used
// for blocks inside a partition and for partitions.
inline void merge_into(RowState& s1, float* acc1, RowState s2, const float* acc2, int n) {
  if (s2.l == 0.0f && s2.m == kNegInf) {
    return;
  }
  float m = std::max(s1.m, s2.m);
  float a = std::exp(s1.m - m);
  float b = std::exp(s2.m - m);
  s1.l = s1.l * a + s2.l * b;
  s1.m = m;
  for (int d = 0; d < n; ++d) {
    acc1[d] = acc1[d] * a + acc2[d] * b;
  }
}

// Per-thread scratch, grown on demand and kept between calls.
struct Scratch {
  std::vector<float> q, k, v, acc, part_acc, scores;
  std::vector<RowState> state, part_state;
};

template <typename T>
class CpuPagedAttention {
 public:
  explicit CpuPagedAttention(const KernelArgs& a)
      : q_(static_cast<const T*>(a.q)),
        k_(static_cast<const T*>(a.key_cache)),
        v_(static_cast<const T*>(a.value_cache)),
        bt_(a.block_tables),
        out_(static_cast<T*>(a.out)),
        sinks_(a.sinks),
        sinks_stride_(a.sinks_stride),
        p_(a.params),
        g_(a.geometry),
        seq_lens_(a.seq_lens),
        cu_(a.cu_seqlens_q) {}

  void run() {
    plan();
    parallel_for(units_.size(), [this](std::size_t i) { run_unit(units_[i]); });
    if (!merges_.empty()) {
      parallel_for(merges_.size(), [this](std::size_t i) { merge_partials(i); });
    }
  }

 private:
  int row_pos(int seq, int tok) const {
    int n = cu_[seq + 1] - cu_[seq];
    return seq_lens_[seq] - n + tok;
  }

  int row_lo(int pos) const {
    return p_.sliding_window > 0 ? std::max(0, pos - p_.sliding_window + 1) : 0;
  }

  // Builds the unit list. Partitions of a tile run in one unit (merged in
  // place) unless there are too few units to occupy the cores, as in
  // long-context decode of few sequences; then they become separate units
  // whose partials are merged afterwards, in the same order.
  void plan() {
    const int tile_tokens = std::max(1, kRowsPerTile / g_.group);
    struct Tile { int seq, tb, te, pb, pe; };
    std::vector<Tile> tiles;
    for (int s = 0; s < g_.num_seqs; ++s) {
      int n = cu_[s + 1] - cu_[s];
      for (int tb = 0; tb < n; tb += tile_tokens) {
        int te = std::min(n, tb + tile_tokens);
        int lo = row_lo(row_pos(s, tb));
        int hi = row_pos(s, te - 1);  // inclusive
        tiles.push_back({s, tb, te, lo / kPartition, hi / kPartition + 1});
      }
    }
    const std::size_t base_units = tiles.size() * g_.num_kv_heads;
    const bool split = base_units < 2 * static_cast<std::size_t>(cpu_thread_count());
    int64_t partial_floats = 0;
    for (const auto& t : tiles) {
      for (int h = 0; h < g_.num_kv_heads; ++h) {
        if (!split || t.pe - t.pb == 1) {
          units_.push_back({t.seq, t.tb, t.te, h, t.pb, t.pe, -1});
          continue;
        }
        // Partials of consecutive partitions lie back to back from here.
        merges_.push_back({t.seq, t.tb, t.te, h, t.pb, t.pe, partial_floats});
        const int64_t rows = (t.te - t.tb) * g_.group;
        for (int p = t.pb; p < t.pe; ++p) {
          units_.push_back({t.seq, t.tb, t.te, h, p, p + 1, partial_floats});
          partial_floats += rows * (g_.v_head_dim + 2);
        }
      }
    }
    partials_.resize(partial_floats);
  }

  void run_unit(const Unit& u) {
    thread_local Scratch sc;
    const int D = g_.head_dim, Dv = g_.v_head_dim;
    const int rows = (u.tok_end - u.tok_begin) * g_.group;
    sc.q.resize(rows * D);
    sc.acc.assign(rows * Dv, 0.0f);
    sc.state.assign(rows, RowState{kNegInf, 0.0f});
    sc.part_acc.resize(rows * Dv);
    sc.part_state.resize(rows);
    sc.k.resize(g_.block_size * D);
    sc.v.resize(g_.block_size * Dv);
    sc.scores.resize(g_.block_size);

    // Gather the tile's query rows (token-major, then head within the group).
    const int tok0 = cu_[u.seq] + u.tok_begin;
    for (int r = 0; r < rows; ++r) {
      int t = tok0 + r / g_.group;
      int h = u.kv_head * g_.group + r % g_.group;
      load_row(q_ + t * g_.q_st[0] + h * g_.q_st[1], g_.q_st[2], D, &sc.q[r * D]);
    }

    for (int part = u.part_begin; part < u.part_end; ++part) {
      reduce_partition(u, part, rows, sc);
      for (int r = 0; r < rows; ++r) {
        merge_into(sc.state[r], &sc.acc[r * Dv], sc.part_state[r], &sc.part_acc[r * Dv], Dv);
      }
    }

    if (u.partial_offset < 0) {
      for (int r = 0; r < rows; ++r) {
        write_row(u, r, sc.state[r], &sc.acc[r * Dv]);
      }
    } else {
      float* dst = &partials_[u.partial_offset];
      for (int r = 0; r < rows; ++r) {
        dst[0] = sc.state[r].m;
        dst[1] = sc.state[r].l;
        std::copy_n(&sc.acc[r * Dv], Dv, dst + 2);
        dst += Dv + 2;
      }
    }
  }

  // Fresh online softmax of every row of the unit over one key partition,
  // into sc.part_state / sc.part_acc.
  void reduce_partition(const Unit& u, int part, int rows, Scratch& sc) {
    const int D = g_.head_dim, Dv = g_.v_head_dim, bs = g_.block_size;
    std::fill(sc.part_acc.begin(), sc.part_acc.begin() + rows * Dv, 0.0f);
    std::fill(sc.part_state.begin(), sc.part_state.begin() + rows, RowState{kNegInf, 0.0f});

    const int first_pos = row_pos(u.seq, u.tok_begin);
    const int last_pos = row_pos(u.seq, u.tok_end - 1);
    const int key_lo = std::max(part * kPartition, row_lo(first_pos));
    const int key_hi = std::min((part + 1) * kPartition, last_pos + 1);  // exclusive
    if (key_lo >= key_hi) {
      return;
    }
    const int32_t* table = bt_ + u.seq * g_.bt_st[0];
    for (int b = key_lo / bs; b * bs < key_hi; ++b) {
      const int block_id = table[b * g_.bt_st[1]];
      const int p0 = std::max(key_lo, b * bs), p1 = std::min(key_hi, (b + 1) * bs);
      for (int p = p0; p < p1; ++p) {
        const int64_t k_off = block_id * g_.k_st[0] + (p - b * bs) * g_.k_st[1] + u.kv_head * g_.k_st[2];
        const int64_t v_off = block_id * g_.v_st[0] + (p - b * bs) * g_.v_st[1] + u.kv_head * g_.v_st[2];
        load_row(k_ + k_off, g_.k_st[3], D, &sc.k[(p - p0) * D]);
        load_row(v_ + v_off, g_.v_st[3], Dv, &sc.v[(p - p0) * Dv]);
      }
      for (int r = 0; r < rows; ++r) {
        const int pos = first_pos + r / g_.group;
        const int lo = std::max(p0, row_lo(pos)), hi = std::min(p1, pos + 1);
        if (lo >= hi) {
          continue;
        }
        block_update(&sc.q[r * D], sc.part_state[r], &sc.part_acc[r * Dv],
                     &sc.k[(lo - p0) * D], &sc.v[(lo - p0) * Dv], hi - lo, sc);
      }
    }
  }

  // Online-softmax step of one row over n consecutive keys.
  void block_update(const float* q, RowState& st, float* acc, const float* k,
                    const float* v, int n, Scratch& sc) {
    const int D = g_.head_dim, Dv = g_.v_head_dim;
    float* s = sc.scores.data();
    float mb = kNegInf;
    for (int i = 0; i < n; ++i) {
      float x = dot(q, k + i * D, D) * p_.scale;
      if (p_.softcap > 0.0f) {
        x = p_.softcap * std::tanh(x / p_.softcap);
      }
      s[i] = x;
      mb = std::max(mb, x);
    }
    const float m = std::max(st.m, mb);
    const float a = std::exp(st.m - m);
    if (a != 1.0f) {
      for (int d = 0; d < Dv; ++d) {
        acc[d] *= a;
      }
    }
    float l = st.l * a;
    for (int i = 0; i < n; ++i) {
      s[i] -= m;
    }
    exp_inplace(s, n);
    for (int i = 0; i < n; ++i) {
      l += s[i];
    }
    accumulate_rows(acc, s, v, n, Dv, Dv);
    st = {m, l};
  }

  // Normalises a row's finished state and stores it. The sink, if any, is
  // one more logit in the denominator with no value: folded in here, once
  // per row, whichever way the row's partitions were reduced.
  void write_row(const Unit& u, int r, RowState st, const float* acc) {
    const int Dv = g_.v_head_dim;
    const int t = cu_[u.seq] + u.tok_begin + r / g_.group;
    const int h = u.kv_head * g_.group + r % g_.group;
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
    const int rows = (u.tok_end - u.tok_begin) * g_.group;
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
  const T* k_;
  const T* v_;
  const int32_t* bt_;
  T* out_;
  const float* sinks_;
  int64_t sinks_stride_;
  PagedAttentionParams p_;
  Geometry g_;
  const std::vector<int>& seq_lens_;
  const std::vector<int>& cu_;
  std::vector<Unit> units_, merges_;
  std::vector<float> partials_;
};

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const KernelArgs& args) {
  switch (args.dtype) {
    case KernelDtype::float32:
      CpuPagedAttention<float>(args).run();
      break;
    case KernelDtype::float16:
      CpuPagedAttention<mx::float16_t>(args).run();
      break;
    case KernelDtype::bfloat16:
      CpuPagedAttention<mx::bfloat16_t>(args).run();
      break;
  }
}

} // namespace vllm_metal::cpu
