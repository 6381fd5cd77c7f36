// The CPU greedy-head kernel, compiled once per instruction set: each row's
// argmax over the vocabulary of hidden @ weight^T without writing the logits.
//
// The hidden rows are transposed once per call into [dim][rows padded to a
// vector] so that a vector's worth of rows (kW: 16 on AVX-512, 8 on AVX2, 4
// otherwise) sits in one register; the weight is read in place, one
// element broadcast against those vectors, so each vocabulary row's dot
// products with those rows accumulate lane-wise (one FMA per k, in k order)
// and the running maximum is a lane-wise compare-and-blend: no horizontal
// reduction anywhere. A micro-tile is kVocab vocabulary rows x kGroups
// groups of rows (AVX-512: 4 x 4 accumulators in 32 registers; AVX2: 4 x 2
// in 16). The vectors are one register of this build (simd.h's nf), not
// its 16-lane vf: the tile is shaped by the register count. The
// vocabulary is split into chunks over the kernels' thread pool; chunk
// maxima are merged in vocabulary order, and a later index replaces the best
// only when strictly greater, so the first index wins ties (argmax's rule).
// NaN logits are never chosen.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/argmax_head_kernel.h"
#include "cpu/dispatch.h"
#include "cpu/simd.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

#if defined(__AVX512F__)
constexpr int kVocab = 4;
constexpr int kGroups = 4;
#elif defined(__AVX2__)
constexpr int kVocab = 4;
constexpr int kGroups = 2;
#else
constexpr int kVocab = 2;
constexpr int kGroups = 2;
#endif
constexpr int kW = kNative;  // rows per vector
using hv = nf;
using hvi = ni;
constexpr int64_t kChunk = 256;  // vocabulary rows per task
// The next tile's vocabulary rows are prefetched into L2 one cache line
// (16 floats) per row for each line of this tile's rows read: a vocabulary
// row is a stream too short for the hardware prefetchers (the BLAS shim's
// one-row kernel does the same, csrc/blas_few_rows_kernels.h).
constexpr int64_t kLineFloats = 16;

inline hv hload(const float* p) {
  hv v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void hstore(float* p, hv v) { std::memcpy(p, &v, sizeof v); }

inline void hstore_i(int32_t* p, hvi v) { std::memcpy(p, &v, sizeof v); }

// x in every lane, as one broadcast: x - 0 is x for every x (-0.0 included,
// unlike 0 + x), so the compiler drops the subtraction.
inline hv hsplat(float x) { return x - hv{}; }

inline hvi isplat(int32_t x) { return x - hvi{}; }

// acc[n][g] += rows[n][k] * (group g's rows at k), for k in [k0, k1).
template <int G>
inline void tile_steps(const float* const* rows, const float* x0, int64_t ld, int64_t k0, int64_t k1,
                       hv (&acc)[kVocab][G]) {
  for (int64_t k = k0; k < k1; ++k) {
    hv x[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      x[g] = hload(x0 + k * ld + g * kW);
    }
#pragma GCC unroll 4
    for (int n = 0; n < kVocab; ++n) {
      const hv b = hsplat(rows[n][k]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        acc[n][g] += b * x[g];
      }
    }
  }
}

// Vocabulary rows [lo, hi) against groups [g0, g0 + G) of the transposed
// hidden rows: each lane's best value and index so far, updated in place.
template <int G, bool kPrefetch>
void tile_groups(const float* w, const float* ht, int64_t ld, int64_t dim, int64_t lo, int64_t hi, int g0,
                 hv* best, hvi* idx) {
  const float* x0 = ht + static_cast<int64_t>(g0) * kW;
  int64_t v = lo;
  for (; v + kVocab <= hi; v += kVocab) {
    hv acc[kVocab][G] = {};
    const float* rows[kVocab];
    for (int n = 0; n < kVocab; ++n) {
      rows[n] = w + (v + n) * dim;
    }
    if constexpr (kPrefetch) {
      const bool ahead = v + 2 * kVocab <= hi;
      for (int64_t k0 = 0; k0 < dim; k0 += kLineFloats) {
        if (ahead) {  // the next tile's rows: one line each per line of this tile's
          for (int n = 0; n < kVocab; ++n) {
            __builtin_prefetch(rows[n] + kVocab * dim + k0, 0, 2);
          }
        }
        tile_steps<G>(rows, x0, ld, k0, std::min(dim, k0 + kLineFloats), acc);
      }
    } else {
      tile_steps<G>(rows, x0, ld, 0, dim, acc);
    }
    for (int n = 0; n < kVocab; ++n) {
      const hvi id = isplat(static_cast<int32_t>(v + n));
      for (int g = 0; g < G; ++g) {
        const hvi m = acc[n][g] > best[g];
        best[g] = m ? acc[n][g] : best[g];
        idx[g] = m ? id : idx[g];
      }
    }
  }
  for (; v < hi; ++v) {  // the chunk's last rows, one at a time
    hv acc[G] = {};
    const float* row = w + v * dim;
    for (int64_t k = 0; k < dim; ++k) {
      const hv b = hsplat(row[k]);
      for (int g = 0; g < G; ++g) {
        acc[g] += b * hload(x0 + k * ld + g * kW);
      }
    }
    const hvi id = isplat(static_cast<int32_t>(v));
    for (int g = 0; g < G; ++g) {
      const hvi m = acc[g] > best[g];
      best[g] = m ? acc[g] : best[g];
      idx[g] = m ? id : idx[g];
    }
  }
}

template <int G, bool kPrefetch>
void chunk_groups(const ArgmaxHeadArgs& a, const float* ht, int64_t ld, int64_t lo, int64_t hi, int g0,
                  float* best_out, int32_t* idx_out) {
  hv best[G];
  hvi idx[G];
  for (int g = 0; g < G; ++g) {
    best[g] = hsplat(-std::numeric_limits<float>::infinity());
    idx[g] = isplat(static_cast<int32_t>(lo));
  }
  tile_groups<G, kPrefetch>(a.weight, ht, ld, a.dim, lo, hi, g0, best, idx);
  for (int g = 0; g < G; ++g) {
    hstore(best_out + (g0 + g) * kW, best[g]);
    hstore_i(idx_out + (g0 + g) * kW, idx[g]);
  }
}

void run(const ArgmaxHeadArgs& a) {
  const int64_t rows = a.rows, dim = a.dim, vocab = a.vocab;
  if (rows == 0) {
    return;
  }
  const int groups = static_cast<int>((rows + kW - 1) / kW);
  const int64_t ld = static_cast<int64_t>(groups) * kW;  // padded rows: the transposed row length
  std::vector<float> ht(static_cast<size_t>(dim * ld), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.hidden + r * dim;
    for (int64_t k = 0; k < dim; ++k) {
      ht[k * ld + r] = src[k];
    }
  }
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<float> best(static_cast<size_t>(chunks * ld));
  std::vector<int32_t> idx(static_cast<size_t>(chunks * ld));
  for_ranges(chunks, 1, [&](int64_t c, int64_t) {
    const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
    float* bo = best.data() + c * ld;
    int32_t* io = idx.data() + c * ld;
    // One or two groups of rows (<= 32 on AVX-512, <= 16 on AVX2): the
    // weight's streaming decides, so its next rows are prefetched; with more
    // groups the tile is compute-bound and the prefetch measured slower.
    if (groups == 1) {
      chunk_groups<1, true>(a, ht.data(), ld, lo, hi, 0, bo, io);
      return;
    }
    if (groups == 2) {
      chunk_groups<2, true>(a, ht.data(), ld, lo, hi, 0, bo, io);
      return;
    }
    for (int g0 = 0; g0 < groups; g0 += kGroups) {
      switch (std::min(kGroups, groups - g0)) {
        case 1:
          chunk_groups<1, false>(a, ht.data(), ld, lo, hi, g0, bo, io);
          break;
        case 2:
          chunk_groups<2, false>(a, ht.data(), ld, lo, hi, g0, bo, io);
          break;
#if defined(__AVX512F__)  // kGroups 4: the only build with three or four groups a pass
        case 3:
          chunk_groups<3, false>(a, ht.data(), ld, lo, hi, g0, bo, io);
          break;
        default:
          chunk_groups<4, false>(a, ht.data(), ld, lo, hi, g0, bo, io);
          break;
#endif
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // chunks in vocabulary order: the first index wins ties
    float b = best[r];
    int32_t i = idx[r];
    for (int64_t c = 1; c < chunks; ++c) {
      if (best[c * ld + r] > b) {
        b = best[c * ld + r];
        i = idx[c * ld + r];
      }
    }
    a.out[r] = i;
  }
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const ArgmaxHeadArgs& args) {
  run(args);
}

} // namespace vllm_metal::cpu
