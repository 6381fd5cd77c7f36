// The screened greedy head's vector pieces (argmax_head_screen_kernel.cpp,
// one source compiled twice): per build, the accumulators of a block of R
// hidden rows against T tiles of 16 tokens and the lane-wise helpers the
// candidate scan uses. AVX-512 BF16: VDPBF16PS, a tile one vector; AVX2: each
// tile's bfloat16 pairs widened to float32 (a shift, a mask) and summed by
// two FMAs, a tile two vectors. Included by that source only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/argmax_head_screen.h"

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunkTiles = 16;  // 256 tokens a chunk
constexpr float kInf = std::numeric_limits<float>::infinity();

#if defined(__AVX512BF16__)
constexpr int kMaxRows = 8;  // rows a block: 4 tiles x up to 4 rows or 2 tiles x 5-8 (<= 16 accumulators; 12 rows x 2 measured level)
using Low = __m512;  // a row's running largest x - E, lane by lane
inline Low low_init() {
  return _mm512_set1_ps(-kInf);
}
inline float low_max(Low v) {
  return _mm512_reduce_max_ps(v);
}
// The lanes of a tile's x + E (u[0..16)) that reach thr, as bits.
inline uint32_t reach_mask(const float* u, float thr) {
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(u), _mm512_set1_ps(thr), _CMP_GE_OQ);
}

// acc += two bfloat16 products a lane. In place through asm: with the
// builtin, GCC copied every accumulator twice an iteration (register moves
// that took most of the loop's issue slots; measured on the 8-bit variant).
inline __m512 dpbf16(__m512 acc, __m512i w, __m512i h) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(h));
  return acc;
}
#else
constexpr int kMaxRows = 4;  // rows a block: 2 x 4 accumulators, 4 widened weights, 2 broadcasts (16 registers)
struct Low {
  __m256 a, b;  // a tile's lanes 0-7 and 8-15
};
inline Low low_init() {
  return {_mm256_set1_ps(-kInf), _mm256_set1_ps(-kInf)};
}
inline float low_max(Low v) {
  const __m256 m = _mm256_max_ps(v.a, v.b);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
inline uint32_t reach_mask(const float* u, float thr) {
  const __m256 t = _mm256_set1_ps(thr);
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(u), t, _CMP_GE_OQ))) |
      (static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(u + 8), t, _CMP_GE_OQ))) << 8);
}
#endif

struct Rounded {
  std::vector<uint32_t> h;  // [pairs][rows]: two bfloat16 a uint32 (k even low)
  std::vector<float> norm;  // |h_r|_2, rounded up
};

struct Shared {
  const ArgmaxScreenArgs& a;
  const Rounded& hr;
  int64_t pairs;
};

// R rows from r0 against T tiles from tile0 (token offset `col` in the
// chunk): x + E into up[r][col..], x - E into lowmax[r].
#if defined(__AVX512BF16__)
template <int T, int R>
inline void block(const Shared& s, int64_t tile0, int64_t r0, float* up, int64_t col, Low* lowmax) {
  const int64_t pairs = s.pairs, rows = s.a.rows;
  const uint16_t* w = s.a.wb + tile0 * pairs * kScreenTile * kScreenPair;
  const uint32_t* h = s.hr.h.data() + r0;
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      acc[t][r] = _mm512_setzero_ps();
    }
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i wv[T];
    for (int t = 0; t < T; ++t) {
      wv[t] = _mm512_loadu_si512(w + (t * pairs + j) * kScreenTile * kScreenPair);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i hb = _mm512_set1_epi32(static_cast<int32_t>(h[j * rows + r]));
      for (int t = 0; t < T; ++t) {
        acc[t][r] = dpbf16(acc[t][r], wv[t], hb);
      }
    }
  }
  const __m512 eabs = _mm512_set1_ps(std::ldexp(1.0f, -50)), ninf = _mm512_set1_ps(-kInf);
  for (int t = 0; t < T; ++t) {
    const int64_t tok = (tile0 + t) * kScreenTile;
    const __m512 ev = _mm512_loadu_ps(s.a.table + tok);
    // Lanes past the vocabulary (the last tile only) are never candidates.
    const int64_t valid = std::min<int64_t>(kScreenTile, s.a.vocab - tok);
    const __mmask16 live = valid >= kScreenTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const __m512 x = acc[t][r];
      const __m512 e = _mm512_fmadd_ps(ev, _mm512_set1_ps(s.hr.norm[row]), eabs);
      const __m512 u = _mm512_mask_blend_ps(live, ninf, _mm512_add_ps(x, e));
      const __m512 l = _mm512_mask_blend_ps(live, ninf, _mm512_sub_ps(x, e));
      _mm512_storeu_ps(up + row * (kChunkTiles * kScreenTile) + col + t * kScreenTile, u);
      lowmax[row] = _mm512_max_ps(lowmax[row], l);
    }
  }
}
#else
// A tile's 16 uint32 hold (w[t][2j], w[t][2j + 1]) as bfloat16 (even k low):
// as float32, the low half shifted up and the high half masked.
template <int T, int R>
inline void block(const Shared& s, int64_t tile0, int64_t r0, float* up, int64_t col, Low* lowmax) {
  const int64_t pairs = s.pairs, rows = s.a.rows;
  const uint16_t* w = s.a.wb + tile0 * pairs * kScreenTile * kScreenPair;
  const uint32_t* h = s.hr.h.data() + r0;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[T][2][R];
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      acc[t][0][r] = acc[t][1][r] = _mm256_setzero_ps();
    }
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m256 we[T][2], wo[T][2];
    for (int t = 0; t < T; ++t) {
      const uint16_t* wt = w + (t * pairs + j) * kScreenTile * kScreenPair;
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + half * kScreenTile));
        we[t][half] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[t][half] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t p = h[j * rows + r];
      const __m256 he = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(p << 16)));
      const __m256 ho = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(p & 0xFFFF0000u)));
      for (int t = 0; t < T; ++t) {
        for (int half = 0; half < 2; ++half) {
          acc[t][half][r] = _mm256_fmadd_ps(wo[t][half], ho, _mm256_fmadd_ps(we[t][half], he, acc[t][half][r]));
        }
      }
    }
  }
  const __m256 eabs = _mm256_set1_ps(std::ldexp(1.0f, -50)), ninf = _mm256_set1_ps(-kInf);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int t = 0; t < T; ++t) {
    const int64_t tok = (tile0 + t) * kScreenTile;
    const int64_t valid = std::min<int64_t>(kScreenTile, s.a.vocab - tok);
    for (int half = 0; half < 2; ++half) {
      const __m256 ev = _mm256_loadu_ps(s.a.table + tok + half * 8);
      // Lanes past the vocabulary (the last tile only) are never candidates.
      const __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(valid - half * 8)), _CMP_LT_OQ);
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m256 x = acc[t][half][r];
        const __m256 e = _mm256_fmadd_ps(ev, _mm256_set1_ps(s.hr.norm[row]), eabs);
        const __m256 u = _mm256_blendv_ps(ninf, _mm256_add_ps(x, e), live);
        const __m256 l = _mm256_blendv_ps(ninf, _mm256_sub_ps(x, e), live);
        _mm256_storeu_ps(up + row * (kChunkTiles * kScreenTile) + col + t * kScreenTile + half * 8, u);
        __m256& m = half ? lowmax[row].b : lowmax[row].a;
        m = _mm256_max_ps(m, l);
      }
    }
  }
}
#endif

} // namespace

} // namespace vllm_metal::cpu
