// One row's rotary rotation, shared by the RoPE and RoPE + KV-write kernels
// (compiled into each instruction-set build): per pair (a, b) ->
// (a cos - b sin, b cos + a sin), MLX's own formula, in float32; the dims
// past `rotated` copied.
#pragma once

#include <algorithm>

namespace vllm_metal::cpu {

namespace {

// y = row rotated by the pairs' (c, s); pairs (i, i + rotated / 2), or
// (2i, 2i + 1) when traditional.
inline void rotate_row(const float* row, const float* c, const float* s, int d, int rotated, bool traditional,
                       float* y) {
  const int half = rotated / 2;
  if (traditional) {
    for (int i = 0; i < half; ++i) {
      const float p = row[2 * i], q = row[2 * i + 1];
      y[2 * i] = p * c[i] - q * s[i];
      y[2 * i + 1] = q * c[i] + p * s[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float p = row[i], q = row[i + half];
      y[i] = p * c[i] - q * s[i];
      y[i + half] = q * c[i] + p * s[i];
    }
  }
  std::copy(row + rotated, row + d, y + rotated);
}

// A token's table entry [rotated / 2, 2] split into its cos and sin arrays.
inline void split_pairs(const float* pairs, int half, float* c, float* s) {
  for (int i = 0; i < half; ++i) {
    c[i] = pairs[2 * i];
    s[i] = pairs[2 * i + 1];
  }
}

} // namespace

} // namespace vllm_metal::cpu
