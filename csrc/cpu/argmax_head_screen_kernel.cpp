// The screened greedy head's kernel (argmax_head_screen.h), one source
// compiled twice: an AVX-512 BF16 build (VDPBF16PS: two bfloat16 products a
// lane, a tile of 16 tokens one vector) and an AVX2 build (each tile's
// bfloat16 pairs widened to float32 by a shift and a mask, two FMAs a pair,
// a tile two vectors). Both read the same bfloat16 bytes and sum the same
// products in k order, within the same bound.
//
// Per call the hidden rows are rounded to bfloat16 and their norms taken,
// then the vocabulary is split into tasks of 1,024 tokens over the kernels'
// thread pool. A task walks its tokens in chunks of 256: for a block of R
// hidden rows and T tiles of 16 tokens, R x T accumulators take the products
// of every two k (the row's pair broadcast, the tile's 64 bytes loaded), then
// each lane's screen value x and bound E = |h_r|_2 e_t + 2^-50 give x + E,
// kept for the chunk, and x - E, folded into the row's running maximum (its
// threshold). At the chunk's end, the tokens whose x + E reach the threshold
// join the row's candidates (at most kCap a task and row; past that the
// task's tokens all are, for that row). At the end every row's threshold is
// the largest over the tasks, and its candidates that still reach it get
// their float32 logit computed as the ArgmaxHead kernel does: fma in k order
// from 0.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "cpu/argmax_head_screen.h"
#include "cpu/argmax_head_screen_blocks.h"
#include "cpu/dispatch.h"

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kTaskChunks = 4;  // 1,024 tokens a task
constexpr int64_t kCap = 32;  // candidates kept per task and row

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

// False when a row is outside the screen's range.
bool round_rows(const ArgmaxScreenArgs& a, int64_t pairs, Rounded& out) {
  out.h.assign(static_cast<size_t>(a.rows * pairs), 0);
  out.norm.resize(static_cast<size_t>(a.rows));
  const float lo = std::ldexp(1.0f, -40), hi = std::ldexp(1.0f, 40);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* h = a.hidden + r * a.dim;
    float m = 0.0f;
    double sq = 0.0;
    for (int64_t k = 0; k < a.dim; ++k) {
      const float v = std::fabs(h[k]);
      if (!(v <= hi)) {  // NaN or beyond the range
        return false;
      }
      m = std::max(m, v);
      sq += static_cast<double>(v) * v;
    }
    if (m < lo) {
      return false;
    }
    for (int64_t k = 0; k < a.dim; ++k) {
      out.h[(k / kScreenPair) * a.rows + r] |= static_cast<uint32_t>(to_bf16(h[k])) << (16 * (k % kScreenPair));
    }
    out.norm[r] = float_at_least(std::sqrt(sq) * (1.0 + std::ldexp(1.0, -30)));
  }
  return true;
}

struct Task {
  std::vector<float> thr;  // [rows]: the running largest x - E
  std::vector<int32_t> count;  // [rows]: candidates seen (> kCap: all the task's tokens)
  std::vector<int32_t> cand;  // [rows][kCap]
  std::vector<float> upper;  // [rows][kCap]: their x + E
};

// Rows [r0, r0 + R) over the chunk's tiles [c0, c1).
template <int R>
void rows_over_chunk(const Shared& s, int64_t c0, int64_t c1, int64_t r0, float* up, Low* lowmax) {
#if defined(__AVX512BF16__)
  constexpr int T = R <= 4 ? 4 : 2;
#else
  constexpr int T = R == 1 ? 2 : 1;
#endif
  int64_t tl = c0;
  for (; tl + T <= c1; tl += T) {
    block<T, R>(s, tl, r0, up, (tl - c0) * kScreenTile, lowmax);
  }
  for (; tl < c1; ++tl) {
    block<1, R>(s, tl, r0, up, (tl - c0) * kScreenTile, lowmax);
  }
}

void rows_over_chunk_n(const Shared& s, int n, int64_t c0, int64_t c1, int64_t r0, float* up, Low* lowmax) {
  switch (n) {
#define VLLM_METAL_SCREEN_ROWS(R) \
  case R:                         \
    rows_over_chunk<R>(s, c0, c1, r0, up, lowmax); \
    break;
    VLLM_METAL_SCREEN_ROWS(1)
    VLLM_METAL_SCREEN_ROWS(2)
    VLLM_METAL_SCREEN_ROWS(3)
#if defined(__AVX512BF16__)
    VLLM_METAL_SCREEN_ROWS(4)
    VLLM_METAL_SCREEN_ROWS(5)
    VLLM_METAL_SCREEN_ROWS(6)
    VLLM_METAL_SCREEN_ROWS(7)
#endif
    default:
      rows_over_chunk<kMaxRows>(s, c0, c1, r0, up, lowmax);
      break;
#undef VLLM_METAL_SCREEN_ROWS
  }
}

// Tiles [t0, t1) of the vocabulary: the task's thresholds and candidates.
void run_task(const Shared& s, int64_t t0, int64_t t1, Task& task) {
  const int64_t rows = s.a.rows;
  task.thr.assign(static_cast<size_t>(rows), -kInf);
  task.count.assign(static_cast<size_t>(rows), 0);
  task.cand.resize(static_cast<size_t>(rows * kCap));
  task.upper.resize(static_cast<size_t>(rows * kCap));
  constexpr int64_t kChunkTokens = kChunkTiles * kScreenTile;
  std::unique_ptr<float[]> up(new float[static_cast<size_t>(rows * kChunkTokens)]);
  std::unique_ptr<Low[]> lowmax(new Low[static_cast<size_t>(rows)]);
  for (int64_t r = 0; r < rows; ++r) {
    lowmax[r] = low_init();
  }
  for (int64_t c0 = t0; c0 < t1; c0 += kChunkTiles) {
    const int64_t c1 = std::min(t1, c0 + kChunkTiles);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      rows_over_chunk_n(s, static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0)), c0, c1, r0, up.get(),
                        lowmax.get());
    }
    const int64_t n = (c1 - c0) * kScreenTile;
    for (int64_t r = 0; r < rows; ++r) {
      const float thr = task.thr[r] = std::max(task.thr[r], low_max(lowmax[r]));
      const float* u = up.get() + r * kChunkTokens;
      for (int64_t i = 0; i < n; i += kScreenTile) {
        uint32_t m = reach_mask(u + i, thr);
        while (m) {
          const int lane = __builtin_ctz(m);
          m &= m - 1;
          const int32_t c = task.count[r]++;
          if (c < kCap) {
            task.cand[r * kCap + c] = static_cast<int32_t>(c0 * kScreenTile + i + lane);
            task.upper[r * kCap + c] = u[i + lane];
          }
        }
      }
    }
  }
}

// The exact float32 logits of n <= kLanes tokens for one hidden row: n
// independent fma chains interleaved (one chain's latency would leave the
// FMA units idle), each in k order from 0 as the ArgmaxHead kernel's lanes.
constexpr int kLanes = 8;

template <int N>
void exact_logits(const float* weight, int64_t dim, const float* h, const int32_t* toks, float* out) {
  const float* w[N];
  float acc[N];
  for (int i = 0; i < N; ++i) {
    w[i] = weight + static_cast<int64_t>(toks[i]) * dim;
    acc[i] = 0.0f;
  }
  for (int64_t k = 0; k < dim; ++k) {
    const float hk = h[k];
    for (int i = 0; i < N; ++i) {
      acc[i] = std::fma(w[i][k], hk, acc[i]);
    }
  }
  for (int i = 0; i < N; ++i) {
    out[i] = acc[i];
  }
}

// Row r's token: the candidates that reach the row's threshold over every
// task (every token of a task that kept too many), in vocabulary order.
int32_t pick(const ArgmaxScreenArgs& a, const std::vector<Task>& tasks, int64_t per_task, int64_t r,
             std::vector<int32_t>& toks) {
  float thr = -kInf;
  for (const Task& t : tasks) {
    thr = std::max(thr, t.thr[r]);
  }
  toks.clear();
  for (size_t ti = 0; ti < tasks.size(); ++ti) {
    const Task& t = tasks[ti];
    if (t.count[r] > kCap) {
      const int64_t lo = static_cast<int64_t>(ti) * per_task * kScreenTile;
      const int64_t hi = std::min(a.vocab, lo + per_task * kScreenTile);
      for (int64_t tok = lo; tok < hi; ++tok) {
        toks.push_back(static_cast<int32_t>(tok));
      }
      continue;
    }
    for (int32_t c = 0; c < t.count[r]; ++c) {
      if (t.upper[r * kCap + c] >= thr) {
        toks.push_back(t.cand[r * kCap + c]);
      }
    }
  }
  const float* h = a.hidden + r * a.dim;
  int32_t best = -1;
  float best_v = 0.0f;
  float v[kLanes];
  for (size_t i = 0; i < toks.size(); i += kLanes) {
    const size_t n = std::min<size_t>(kLanes, toks.size() - i);
    if (n == kLanes) {
      exact_logits<kLanes>(a.weight, a.dim, h, toks.data() + i, v);
    } else {
      for (size_t j = 0; j < n; ++j) {
        exact_logits<1>(a.weight, a.dim, h, toks.data() + i + j, v + j);
      }
    }
    for (size_t j = 0; j < n; ++j) {
      if (best < 0 || v[j] > best_v) {  // in vocabulary order: the first index wins ties
        best = toks[i + j];
        best_v = v[j];
      }
    }
  }
  return best;
}

} // namespace

bool VLLM_METAL_KERNEL_ENTRY(const ArgmaxScreenArgs& a) {
  if (a.rows == 0) {
    return true;
  }
  Rounded hr;
  const int64_t pairs = screen_pairs(a.dim), tiles = screen_tiles(a.vocab);
  if (!round_rows(a, pairs, hr)) {
    count_screen_work({0, 0, 0, 1});
    return false;
  }
  const Shared s{a, hr, pairs};
  const int64_t per_task = kChunkTiles * kTaskChunks;
  const int64_t ntasks = (tiles + per_task - 1) / per_task;
  std::vector<Task> tasks(static_cast<size_t>(ntasks));
  for_ranges(ntasks, 1, [&](int64_t t, int64_t) {
    run_task(s, t * per_task, std::min(tiles, (t + 1) * per_task), tasks[t]);
  });
  std::atomic<int64_t> exact{0};
  for_ranges(a.rows, 4, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> toks;
    int64_t n = 0;
    for (int64_t r = lo; r < hi; ++r) {
      a.out[r] = pick(a, tasks, per_task, r, toks);
      n += static_cast<int64_t>(toks.size());
    }
    exact.fetch_add(n, std::memory_order_relaxed);
  });
  count_screen_work({1, a.rows, exact.load(), 0});
  return true;
}

} // namespace vllm_metal::cpu
