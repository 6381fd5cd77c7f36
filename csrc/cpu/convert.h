// Row conversions between the cache/query storage types and float32 for the
// CPU kernel. bfloat16 -> float is a 16-bit shift; float16 uses the F16C
// instructions where the variant is compiled with them. Every conversion is
// exact (to float) or round-to-nearest-even (from float), like MLX's own.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "mlx/types/half_types.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace mx = mlx::core;

namespace vllm_metal::cpu {

// Everything here has internal linkage (an unnamed namespace): each kernel
// source is compiled once per instruction set into the same library, and
// inline functions with external linkage would be merged by the linker into
// one copy, possibly an AVX-512 one called on a CPU without it.
namespace {

inline void load_row(const float* src, int64_t stride, int n, float* dst) {
  if (stride == 1) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (int d = 0; d < n; ++d) {
    dst[d] = src[d * stride];
  }
}

inline void load_row(const mx::bfloat16_t* src, int64_t stride, int n, float* dst) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  for (int d = 0; d < n; ++d) {
    uint32_t wide = static_cast<uint32_t>(bits[d * stride]) << 16;
    std::memcpy(&dst[d], &wide, sizeof(float));
  }
}

inline void load_row(const mx::float16_t* src, int64_t stride, int n, float* dst) {
  int d = 0;
#if defined(__F16C__)
  if (stride == 1) {
    for (; d + 8 <= n; d += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(h));
    }
  }
#endif
  for (; d < n; ++d) {
    dst[d] = static_cast<float>(src[d * stride]);
  }
}

// 8-bit float cache elements (uint8 bit patterns; PagedAttentionParams::
// cache_format). Decoded exactly through a 256-entry table per format.
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};
// E4M3 codes of a row followed by the row's float32 scale (cache_format 3).
struct Fp8E4M3Row {
  uint8_t bits;
};

// OCP FP8 E4M3 ("fn": no infinities; S.1111.111 is NaN): 2^(e-7) * (1 + m/8),
// subnormals m * 2^-9.
inline float fp8_e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v = (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN()
      : e == 0                   ? std::ldexp(static_cast<float>(m), -9)
                                 : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

// E5M2: the top byte of a float16.
inline float fp8_e5m2_value(uint8_t b) {
  mx::float16_t h;
  const uint16_t bits = static_cast<uint16_t>(b) << 8;
  std::memcpy(&h, &bits, sizeof(bits));
  return static_cast<float>(h);
}

template <float (*Decode)(uint8_t)>
const float* fp8_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = Decode(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

inline void load_row(const Fp8E4M3* src, int64_t stride, int n, float* dst) {
  const float* table = fp8_table<fp8_e4m3_value>();
  for (int d = 0; d < n; ++d) dst[d] = table[src[d * stride].bits];
}

inline void load_row(const Fp8E5M2* src, int64_t stride, int n, float* dst) {
  const float* table = fp8_table<fp8_e5m2_value>();
  for (int d = 0; d < n; ++d) dst[d] = table[src[d * stride].bits];
}

// The n codes of a row, each times the float32 scale stored after them.
inline void load_row(const Fp8E4M3Row* src, int64_t stride, int n, float* dst) {
  const float* table = fp8_table<fp8_e4m3_value>();
  uint8_t bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = src[(n + i) * stride].bits;
  float scale;
  std::memcpy(&scale, bytes, sizeof(scale));
  for (int d = 0; d < n; ++d) dst[d] = table[src[d * stride].bits] * scale;
}

inline void store_row(const float* src, int n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void store_row(const float* src, int n, mx::bfloat16_t* dst) {
  for (int d = 0; d < n; ++d) {
    dst[d] = static_cast<mx::bfloat16_t>(src[d]);
  }
}

inline void store_row(const float* src, int n, mx::float16_t* dst) {
  int d = 0;
#if defined(__F16C__)
  for (; d + 8 <= n; d += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), h);
  }
#endif
  for (; d < n; ++d) {
    dst[d] = static_cast<mx::float16_t>(src[d]);
  }
}

// Per-thread staging row for output conversion.
inline float* scaled_row_buffer(int n) {
  thread_local std::vector<float> row;
  row.resize(n);
  return row.data();
}

} // namespace

} // namespace vllm_metal::cpu
