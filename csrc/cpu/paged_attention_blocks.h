// The SIMD building blocks of the CPU paged-attention kernel
// (paged_attention_kernel.cpp): the in-register key transposes, the
// register-blocked score micro-kernel and the value accumulation. Keys lie
// across the 16 lanes of a vector, so a score is one FMA chain per lane over
// the head dim, in head-dim order (no horizontal sums), and a value element
// accumulates its keys in key order: the same operations, lane by lane, in
// every build, which is what keeps the kernel batch-invariant.
//
// Internal linkage (an unnamed namespace), like simd.h: the kernel is compiled
// once per instruction set into one library.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu/simd.h"

namespace vllm_metal::cpu {
namespace {

// Rows scored together: the accumulators (row_block x 16 floats) must stay
// in registers: 32 vector registers on AVX-512, 16 on AVX2.
#if defined(__AVX512F__)
constexpr int kMaxRowBlock = 8;
#else
constexpr int kMaxRowBlock = 4;
#endif

// Key groups (of 16) scored together by a micro-kernel of RB rows: each
// accumulator is one FMA chain over the head dim, and a chain waits on its
// previous FMA (4 cycles), so a few rows alone (decode: the GQA group) leave
// the FMA units idle unless several key groups run side by side. RB x NG
// accumulators must fit the build's registers (32 on AVX-512, 16 on AVX2, a
// vf being two AVX2 or four SSE registers there).
template <int RB>
constexpr int score_groups() {
#if defined(__AVX512F__)
  return RB <= 4 ? 4 : 2;
#elif defined(__AVX__)
  return RB == 1 ? 4 : RB == 2 ? 2 : 1;
#else
  return RB <= 2 ? 2 : 1;
#endif
}

// scores[r][g * 16 : (g + NG) * 16] = q[r] . keys of groups g .. g + NG - 1,
// for RB rows; kt is head_dim x kp. Every score is one chain over d in order,
// whatever RB and NG: the same bits.
template <int RB, int NG>
inline void score_groups_at(const float* q, int D, const float* kt, int kp, int g, float* scores) {
  vf acc[RB][NG] = {};
  const float* col = kt + g * kLanes;
  for (int d = 0; d < D; ++d) {
    vf k[NG];
    for (int j = 0; j < NG; ++j) k[j] = vload(col + static_cast<int64_t>(d) * kp + j * kLanes);
    for (int r = 0; r < RB; ++r) {
      const float x = q[r * D + d];
      for (int j = 0; j < NG; ++j) acc[r][j] += x * k[j];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NG; ++j) vstore(scores + r * kp + (g + j) * kLanes, acc[r][j]);
}

// scores[r][0 : ng * 16] = q[r] . keys, for RB rows.
template <int RB>
inline void score_rows(const float* q, int D, const float* kt, int kp, int ng, float* scores) {
  constexpr int NG = score_groups<RB>();
  int g = 0;
  for (; g + NG <= ng; g += NG) score_groups_at<RB, NG>(q, D, kt, kp, g, scores);
  for (; g < ng; ++g) score_groups_at<RB, 1>(q, D, kt, kp, g, scores);
}

void score_block(const float* q, int rows, int D, const float* kt, int kp, int ng,
                 float* scores, int row_block) {
  int r = 0;
  for (; r < rows;) {
    const int n = std::min(rows - r, row_block);
    const float* qr = q + r * D;
    float* sr = scores + r * kp;
    switch (n) {
      case 8: score_rows<8>(qr, D, kt, kp, ng, sr); break;
      case 7: score_rows<7>(qr, D, kt, kp, ng, sr); break;
      case 6: score_rows<6>(qr, D, kt, kp, ng, sr); break;
      case 5: score_rows<5>(qr, D, kt, kp, ng, sr); break;
      case 4: score_rows<4>(qr, D, kt, kp, ng, sr); break;
      case 3: score_rows<3>(qr, D, kt, kp, ng, sr); break;
      case 2: score_rows<2>(qr, D, kt, kp, ng, sr); break;
      default: score_rows<1>(qr, D, kt, kp, ng, sr); break;
    }
    r += n;
  }
}

// acc[r][0:dvp] += sum_i w[r][i] * v[i * stride + 0:dvp] for i in [lo, hi)
// and RB rows at once (row r's weights at w + r * w_stride, its accumulator
// at acc + r * acc_stride): a value row is loaded once for all RB rows, NV
// vectors of each accumulator in registers at a time. Every element's sum
// runs over its keys in i order, one FMA each, so a row's bits depend
// neither on RB nor on the instruction set.
#if defined(__AVX512F__)
constexpr int kValueRowBlock = 4, kValueVectors = 4;
#else
constexpr int kValueRowBlock = 2, kValueVectors = 2;
#endif

template <int RB>
inline void accumulate_values_rows(float* acc, int64_t acc_stride, const float* w, int64_t w_stride,
                                   const float* v, int64_t stride, int lo, int hi, int dvp) {
  constexpr int NV = kValueVectors;
  int c = 0;
  for (; c + NV * kLanes <= dvp; c += NV * kLanes) {
    vf a[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) a[r][j] = vload(acc + r * acc_stride + c + j * kLanes);
    for (int i = lo; i < hi; ++i) {
      const float* vr = v + static_cast<int64_t>(i) * stride + c;
      vf x[NV];
      for (int j = 0; j < NV; ++j) {
        x[j] = vload(vr + j * kLanes);
        keep_in_registers(x[j]);  // loaded once for the RB rows
      }
      for (int r = 0; r < RB; ++r) {
        const float wi = w[r * w_stride + i];
        for (int j = 0; j < NV; ++j) a[r][j] += wi * x[j];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) vstore(acc + r * acc_stride + c + j * kLanes, a[r][j]);
  }
  for (; c < dvp; c += kLanes) {
    vf a[RB];
    for (int r = 0; r < RB; ++r) a[r] = vload(acc + r * acc_stride + c);
    for (int i = lo; i < hi; ++i) {
      const vf x = vload(v + static_cast<int64_t>(i) * stride + c);
      for (int r = 0; r < RB; ++r) a[r] += w[r * w_stride + i] * x;
    }
    for (int r = 0; r < RB; ++r) vstore(acc + r * acc_stride + c, a[r]);
  }
}

// accumulate_values_rows<n> for n = 1 .. kValueRowBlock rows.
inline void accumulate_values_n(int n, float* acc, int64_t acc_stride, const float* w, int64_t w_stride,
                                const float* v, int64_t stride, int lo, int hi, int dvp) {
  switch (n) {
    case 4: accumulate_values_rows<4>(acc, acc_stride, w, w_stride, v, stride, lo, hi, dvp); break;
    case 3: accumulate_values_rows<3>(acc, acc_stride, w, w_stride, v, stride, lo, hi, dvp); break;
    case 2: accumulate_values_rows<2>(acc, acc_stride, w, w_stride, v, stride, lo, hi, dvp); break;
    default: accumulate_values_rows<1>(acc, acc_stride, w, w_stride, v, stride, lo, hi, dvp); break;
  }
}

// kt[d * kp + i] = rows[i][d] for i < 16, d < D: sixteen float32 key rows
// (absent ones point at zeros) transposed into key-across-lanes columns,
// in registers where the instruction set allows.
inline void transpose_keys(const float* const* rows, int D, float* kt, int64_t kp) {
  int d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[i] + d);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 1]), e = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
    }
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
        t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
      }
    }
    for (int j = 0; j < 8; ++j) {
      _mm512_storeu_ps(kt + (d + j) * kp, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
      _mm512_storeu_ps(kt + (d + 8 + j) * kp, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
    }
  }
#elif defined(__AVX2__)
  for (; d + 8 <= D; d += 8) {
    for (int h = 0; h < 16; h += 8) {
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[h + i] + d);
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(kt + (d + j) * kp + h, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
        _mm256_storeu_ps(kt + (d + 4 + j) * kp + h, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
      }
    }
  }
#endif
  for (; d < D; ++d) {
    for (int i = 0; i < 16; ++i) kt[d * kp + i] = rows[i][d];
  }
}

} // namespace
} // namespace vllm_metal::cpu
