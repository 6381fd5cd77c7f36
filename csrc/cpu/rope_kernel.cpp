// The CPU RoPE kernel, compiled once per instruction set. Each token's
// (cos, sin) pairs come from a table computed once per step (the model's own
// RoPE module applied to a probe, vllm_metal/models/cpu_norm_rope.py), so no
// trigonometry runs here: per pair (a, b) -> (a cos - b sin, b cos + a sin),
// the formula of MLX's own composition, in float32, rounded once to the
// storage dtype. Token ranges are split over the kernels' thread pool.
#include <algorithm>

#include "cpu/convert.h"
#include "cpu/dispatch.h"
#include "cpu/rope_kernel.h"
#include "cpu/rope_rotate.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunkElements = 32768;  // per task

template <typename T>
void tokens_range(const RopeArgs& a, int64_t lo, int64_t hi) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const int d = a.dim, half = a.rotated / 2;
  float* row = scaled_row_buffer(2 * d + 2 * half);
  float* y = row + d;
  float* c = y + d;
  float* s = c + half;
  for (int64_t t = lo; t < hi; ++t) {
    split_pairs(a.table + t * half * 2, half, c, s);
    for (int h = 0; h < a.heads; ++h) {
      const int64_t base = (t * a.heads + h) * d;
      load_row(x + base, 1, d, row);
      rotate_row(row, c, s, d, a.rotated, a.traditional, y);
      store_row(y, d, out + base);
    }
  }
}

template <typename T>
void run(const RopeArgs& a) {
  const int64_t per_token = std::max<int64_t>(static_cast<int64_t>(a.heads) * a.dim, 1);
  for_ranges(a.tokens, kChunkElements / per_token, [&](int64_t lo, int64_t hi) { tokens_range<T>(a, lo, hi); });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const RopeArgs& args) {
  with_storage_type(args.dtype, [&](auto tag) { run<decltype(tag)>(args); });
}

} // namespace vllm_metal::cpu
