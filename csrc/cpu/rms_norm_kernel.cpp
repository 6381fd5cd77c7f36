// The CPU RMSNorm / LayerNorm kernel, compiled once per instruction set:
// per row, y = (x * 1 / sqrt(mean(x^2) + eps)) rounded to the storage dtype,
// then times the weight -- the order of MLX's own composition (mlx/fast.cpp's
// fallback: float32 statistics, the normalised row cast back, then the
// weight product in the storage dtype). LayerNorm the same with the row's
// mean subtracted first (the variance is the mean of the centred squares, as
// MLX computes it) and the bias added last. Sums run in 16 float32 lanes.
// Rows are split over the kernels' thread pool in chunks.
#include <algorithm>
#include <cmath>

#include "cpu/convert.h"
#include "cpu/dispatch.h"
#include "cpu/rms_norm_kernel.h"
#include "cpu/simd.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunkElements = 32768;  // per task

float sum_of(const float* x, int n) {
  vf acc = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += vload(x + i);
  float lanes[kLanes];
  vstore(lanes, acc);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; i < n; ++i) s += x[i];
  return s;
}

float sum_of_squares(const float* x, int n) {
  vf acc = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = vload(x + i);
    acc += v * v;
  }
  float lanes[kLanes];
  vstore(lanes, acc);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

template <typename T>
void rows_range(const RmsNormArgs& a, int64_t lo, int64_t hi) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  const int d = a.dim;
  const float inv_d = 1.0f / static_cast<float>(d);
  float* row = scaled_row_buffer(4 * d);
  float* wf = row + d;
  float* y = row + 2 * d;
  float* bf = row + 3 * d;
  load_row(w, 1, d, wf);
  if (b != nullptr) load_row(b, 1, d, bf);
  for (int64_t r = lo; r < hi; ++r) {
    load_row(x + r * d, 1, d, row);
    if (a.layer) {
      const float mean = sum_of(row, d) * inv_d;
      for (int i = 0; i < d; ++i) row[i] -= mean;
    }
    // mean = sum * (1 / dim), rsqrt = 1 / sqrt: as MLX computes them.
    const float scale = 1.0f / std::sqrt(sum_of_squares(row, d) * inv_d + a.eps);
    for (int i = 0; i < d; ++i) y[i] = row[i] * scale;
    if constexpr (!std::is_same_v<T, float>) {
      // The normalised row is rounded to the storage dtype before the weight
      // product, as MLX's composition does (astype, then multiply).
      store_row(y, d, out + r * d);
      load_row(out + r * d, 1, d, y);
    }
    for (int i = 0; i < d; ++i) y[i] *= wf[i];
    if (b != nullptr) {
      if constexpr (!std::is_same_v<T, float>) {
        store_row(y, d, out + r * d);  // the weight product rounded, then the bias added
        load_row(out + r * d, 1, d, y);
      }
      for (int i = 0; i < d; ++i) y[i] += bf[i];
    }
    store_row(y, d, out + r * d);
  }
}

template <typename T>
void run(const RmsNormArgs& a) {
  for_ranges(a.rows, kChunkElements / std::max(a.dim, 1), [&](int64_t lo, int64_t hi) { rows_range<T>(a, lo, hi); });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const RmsNormArgs& args) {
  with_storage_type(args.dtype, [&](auto tag) { run<decltype(tag)>(args); });
}

} // namespace vllm_metal::cpu
