// PagedAttention::eval_cpu: the CPU backend of the paged-attention primitive.
//
// Work is split into units of (sequence, tile of query tokens, kv head[, key
// partition]); each unit loads a cache block's K/V rows once and uses them for
// every query head of the GQA group and every token of the tile. Softmax is an
// online (streaming) softmax in float32.
//
// Numerics are batch-invariant by construction: keys are visited in absolute
// partitions of kPartition positions; each partition is reduced with a fresh
// online softmax, and partitions are merged pairwise in position order. So a
// query row's result depends only on its own sequence, never on what else is
// in the batch, how tokens are tiled, or whether partitions ran in parallel.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "paged_attention.h"
#include "thread_pool.h"

namespace vllm_metal {

namespace {

constexpr int kPartition = 1024;  // keys per partition (multiple of any block size)
constexpr int kRowsPerTile = 64;  // query rows (tokens x group heads) per unit
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sizes and element strides of the inputs, read once from the arrays.
struct Geometry {
  int num_tokens, num_heads, head_dim;
  int num_blocks, block_size, num_kv_heads, group;
  int num_seqs, max_blocks;
  int64_t q_st[3], k_st[4], v_st[4], bt_st[2];
};

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
  // Eight independent accumulators in a fixed order: vectorizable and
  // deterministic without -ffast-math.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; ++j) {
      s[j] += a[d + j] * b[d + j];
    }
  }
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; d < n; ++d) {
    r += a[d] * b[d];
  }
  return r;
}

template <typename T>
inline void load_row(const T* src, int64_t stride, int n, float* dst) {
  if (stride == 1) {
    for (int d = 0; d < n; ++d) {
      dst[d] = static_cast<float>(src[d]);
    }
  } else {
    for (int d = 0; d < n; ++d) {
      dst[d] = static_cast<float>(src[d * stride]);
    }
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
  CpuPagedAttention(
      const std::vector<mx::array>& in,
      mx::array& out,
      const PagedAttentionParams& params,
      const Geometry& g,
      std::vector<int> seq_lens,
      std::vector<int> cu)
      : q_(in[0].data<T>()),
        k_(in[1].data<T>()),
        v_(in[2].data<T>()),
        bt_(in[3].data<int32_t>()),
        out_(out.data<T>()),
        p_(params),
        g_(g),
        seq_lens_(std::move(seq_lens)),
        cu_(std::move(cu)) {}

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
          partial_floats += rows * (g_.head_dim + 2);
        }
      }
    }
    partials_.resize(partial_floats);
  }

  void run_unit(const Unit& u) {
    thread_local Scratch sc;
    const int D = g_.head_dim;
    const int rows = (u.tok_end - u.tok_begin) * g_.group;
    sc.q.resize(rows * D);
    sc.acc.assign(rows * D, 0.0f);
    sc.state.assign(rows, RowState{kNegInf, 0.0f});
    sc.part_acc.resize(rows * D);
    sc.part_state.resize(rows);
    sc.k.resize(g_.block_size * D);
    sc.v.resize(g_.block_size * D);
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
        merge_into(sc.state[r], &sc.acc[r * D], sc.part_state[r], &sc.part_acc[r * D], D);
      }
    }

    if (u.partial_offset < 0) {
      for (int r = 0; r < rows; ++r) {
        write_row(u, r, sc.state[r], &sc.acc[r * D]);
      }
    } else {
      float* dst = &partials_[u.partial_offset];
      for (int r = 0; r < rows; ++r) {
        dst[0] = sc.state[r].m;
        dst[1] = sc.state[r].l;
        std::copy_n(&sc.acc[r * D], D, dst + 2);
        dst += D + 2;
      }
    }
  }

  // Fresh online softmax of every row of the unit over one key partition,
  // into sc.part_state / sc.part_acc.
  void reduce_partition(const Unit& u, int part, int rows, Scratch& sc) {
    const int D = g_.head_dim, bs = g_.block_size;
    std::fill(sc.part_acc.begin(), sc.part_acc.begin() + rows * D, 0.0f);
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
        load_row(v_ + v_off, g_.v_st[3], D, &sc.v[(p - p0) * D]);
      }
      for (int r = 0; r < rows; ++r) {
        const int pos = first_pos + r / g_.group;
        const int lo = std::max(p0, row_lo(pos)), hi = std::min(p1, pos + 1);
        if (lo >= hi) {
          continue;
        }
        block_update(&sc.q[r * D], sc.part_state[r], &sc.part_acc[r * D],
                     &sc.k[(lo - p0) * D], &sc.v[(lo - p0) * D], hi - lo, sc);
      }
    }
  }

  // Online-softmax step of one row over n consecutive keys.
  void block_update(const float* q, RowState& st, float* acc, const float* k,
                    const float* v, int n, Scratch& sc) {
    const int D = g_.head_dim;
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
      for (int d = 0; d < D; ++d) {
        acc[d] *= a;
      }
    }
    float l = st.l * a;
    for (int i = 0; i < n; ++i) {
      const float e = std::exp(s[i] - m);
      l += e;
      const float* vi = v + i * D;
      for (int d = 0; d < D; ++d) {
        acc[d] += e * vi[d];
      }
    }
    st = {m, l};
  }

  void write_row(const Unit& u, int r, RowState st, const float* acc) {
    const int D = g_.head_dim;
    const int t = cu_[u.seq] + u.tok_begin + r / g_.group;
    const int h = u.kv_head * g_.group + r % g_.group;
    T* dst = out_ + (static_cast<int64_t>(t) * g_.num_heads + h) * D;
    const float inv = 1.0f / st.l;
    for (int d = 0; d < D; ++d) {
      dst[d] = static_cast<T>(acc[d] * inv);
    }
  }

  // Merges the partials of split unit group i in partition order, exactly as
  // run_unit does in place, and writes the rows.
  void merge_partials(std::size_t i) {
    const Unit& u = merges_[i];
    const int D = g_.head_dim;
    const int rows = (u.tok_end - u.tok_begin) * g_.group;
    std::vector<float> acc(D);
    for (int r = 0; r < rows; ++r) {
      RowState st{kNegInf, 0.0f};
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int p = 0; p < u.part_end - u.part_begin; ++p) {
        const float* src = &partials_[u.partial_offset + (p * rows + r) * (D + 2)];
        merge_into(st, acc.data(), RowState{src[0], src[1]}, src + 2, D);
      }
      write_row(u, r, st, acc.data());
    }
  }

  const T* q_;
  const T* k_;
  const T* v_;
  const int32_t* bt_;
  T* out_;
  PagedAttentionParams p_;
  Geometry g_;
  std::vector<int> seq_lens_, cu_;
  std::vector<Unit> units_, merges_;
  std::vector<float> partials_;
};

std::vector<int> read_ints(const mx::array& a) {
  std::vector<int> v(a.size());
  const int32_t* p = a.data<int32_t>();
  const int64_t st = a.strides(0);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = p[i * st];
  }
  return v;
}

[[noreturn]] void fail_at_eval(const std::string& msg) {
  throw std::runtime_error("[paged_attention] " + msg);
}

// Data-dependent checks: everything a kernel would otherwise read out of
// bounds. Runs before any output is written.
void validate_batch(const Geometry& g, const std::vector<int>& seq_lens,
                    const std::vector<int>& cu, const mx::array& block_tables) {
  std::ostringstream os;
  if (cu[0] != 0 || cu[g.num_seqs] != g.num_tokens) {
    os << "cu_seqlens_q must start at 0 and end at num_tokens = " << g.num_tokens
       << ", got [" << cu[0] << ", ..., " << cu[g.num_seqs] << "]";
    fail_at_eval(os.str());
  }
  const int capacity = g.max_blocks * g.block_size;
  const int32_t* bt = block_tables.data<int32_t>();
  for (int s = 0; s < g.num_seqs; ++s) {
    const int n = cu[s + 1] - cu[s];
    if (n < 0) {
      os << "cu_seqlens_q must be non-decreasing, but cu_seqlens_q[" << s + 1
         << "] = " << cu[s + 1] << " < cu_seqlens_q[" << s << "] = " << cu[s];
      fail_at_eval(os.str());
    }
    if (seq_lens[s] < n || seq_lens[s] > capacity) {
      os << "seq_lens[" << s << "] = " << seq_lens[s] << " must be >= the "
         << n << " new tokens of that sequence and <= the block table capacity "
         << g.max_blocks << " blocks x " << g.block_size << " = " << capacity;
      fail_at_eval(os.str());
    }
    const int used_blocks = (seq_lens[s] + g.block_size - 1) / g.block_size;
    for (int b = 0; b < used_blocks; ++b) {
      const int id = bt[s * g.bt_st[0] + b * g.bt_st[1]];
      if (id < 0 || id >= g.num_blocks) {
        os << "block_tables[" << s << ", " << b << "] = " << id
           << " is out of range [0, " << g.num_blocks << ")";
        fail_at_eval(os.str());
      }
    }
  }
}

} // namespace

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));

  const auto& q = inputs[0];
  const auto& kc = inputs[1];
  const auto& vc = inputs[2];
  Geometry g{};
  g.num_tokens = q.shape(0);
  g.num_heads = q.shape(1);
  g.head_dim = q.shape(2);
  g.num_blocks = kc.shape(0);
  g.block_size = kc.shape(1);
  g.num_kv_heads = kc.shape(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.num_seqs = inputs[4].shape(0);
  g.max_blocks = inputs[3].shape(1);
  for (int i = 0; i < 3; ++i) g.q_st[i] = q.strides(i);
  for (int i = 0; i < 4; ++i) g.k_st[i] = kc.strides(i);
  for (int i = 0; i < 4; ++i) g.v_st[i] = vc.strides(i);
  for (int i = 0; i < 2; ++i) g.bt_st[i] = inputs[3].strides(i);

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  // The arrays are captured by value: the task keeps their buffers alive
  // until it has run, without any encoder temporaries.
  encoder.dispatch([inputs, out, params = params_, g]() mutable {
    auto seq_lens = read_ints(inputs[4]);
    auto cu = read_ints(inputs[5]);
    validate_batch(g, seq_lens, cu, inputs[3]);
    switch (out.dtype()) {
      case mx::float32:
        CpuPagedAttention<float>(inputs, out, params, g, std::move(seq_lens), std::move(cu)).run();
        break;
      case mx::float16:
        CpuPagedAttention<mx::float16_t>(inputs, out, params, g, std::move(seq_lens), std::move(cu)).run();
        break;
      case mx::bfloat16:
        CpuPagedAttention<mx::bfloat16_t>(inputs, out, params, g, std::move(seq_lens), std::move(cu)).run();
        break;
      default:
        fail_at_eval("unsupported dtype");
    }
  });
}

} // namespace vllm_metal
