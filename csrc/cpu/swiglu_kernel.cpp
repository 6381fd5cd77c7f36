// The CPU SwiGLU kernel, compiled once per instruction set: out = silu(gate)
// * up in 16-lane float32 vectors, in the order of MLX's own ops (sigmoid =
// 1 / (1 + exp(-g)), silu = g * sigmoid, then * up), with the shared
// polynomial exp (~1 ulp) in place of libm's. float16/bfloat16 are converted
// to float32 and back (round to nearest even), a chunk at a time. Chunks of
// kChunk elements are split over the kernels' thread pool.
#include <algorithm>

#include "cpu/convert.h"
#include "cpu/dispatch.h"
#include "cpu/simd.h"
#include "cpu/swiglu_kernel.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunk = 16384;  // elements per task (64 KiB of float32 per operand)

inline vf silu_times(vf g, vf u) {
  const vf s = 1.0f / (1.0f + vexp(-g));
  return (g * s) * u;
}

void range_f32(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vstore(out + i, silu_times(vload(g + i), vload(u + i)));
  }
  if (i < n) {  // the tail through a zero-padded vector
    float gb[kLanes] = {}, ub[kLanes] = {}, ob[kLanes];
    std::copy(g + i, g + n, gb);
    std::copy(u + i, u + n, ub);
    vstore(ob, silu_times(vload(gb), vload(ub)));
    std::copy(ob, ob + (n - i), out + i);
  }
}

template <typename T>
void range(const T* g, const T* u, T* out, int64_t n) {
  constexpr int kBlock = 256;
  float gb[kBlock], ub[kBlock], ob[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(kBlock, n - i));
    load_row(g + i, 1, m, gb);
    load_row(u + i, 1, m, ub);
    range_f32(gb, ub, ob, m);
    store_row(ob, m, out + i);
  }
}

template <typename T>
void span(const T* g, const T* u, T* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    range_f32(g, u, out, n);
  } else {
    range(g, u, out, n);
  }
}

template <typename T>
void run(const SwigluArgs& a) {
  const T* g = static_cast<const T*>(a.gate);
  const T* u = static_cast<const T*>(a.up);
  T* out = static_cast<T*>(a.out);
  const int64_t w = a.width;
  if (a.rows <= 1 || (a.gate_stride == w && a.up_stride == w)) {  // one flat run
    for_ranges(a.rows * w, kChunk, [&](int64_t lo, int64_t hi) { span(g + lo, u + lo, out + lo, hi - lo); });
    return;
  }
  // Rows of strided operands (a fused gate/up product's two column halves,
  // read in place): whole rows per task. Each element's operations are the
  // flat path's: the same bits.
  for_ranges(a.rows, std::max<int64_t>(1, kChunk / std::max<int64_t>(w, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) span(g + r * a.gate_stride, u + r * a.up_stride, out + r * w, w);
  });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const SwigluArgs& args) {
  with_storage_type(args.dtype, [&](auto tag) { run<decltype(tag)>(args); });
}

} // namespace vllm_metal::cpu
