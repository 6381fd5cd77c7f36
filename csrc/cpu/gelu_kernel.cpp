// The CPU GELU kernel, compiled once per instruction set, in 16-lane float32
// vectors:
//   exact: 0.5 x (1 + erf(x / sqrt(2))), erf as the rational minimax
//          approximation Eigen and XLA use for float32 (odd degree-13 over
//          even degree-8 polynomial on [-4, 4], +-1 beyond; max abs error
//          ~4e-7 measured in float32 against math.erf);
//   tanh:  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(y) =
//          1 - 2 / (exp(2y) + 1) with the shared polynomial exp (~1 ulp).
// float16/bfloat16 are converted to float32 and back (round to nearest
// even), a chunk at a time. Chunks of kChunk elements are split over the
// kernels' thread pool.
#include <algorithm>

#include "cpu/convert.h"
#include "cpu/dispatch.h"
#include "cpu/gelu_kernel.h"
#include "cpu/simd.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunk = 16384;  // elements per task

inline vf verf(vf a) {
  const vf lo = splat(-4.0f), hi = splat(4.0f);
  vf x = select(a < lo, lo, a);  // NaN stays NaN
  x = select(x > hi, hi, x);
  const vf x2 = x * x;
  vf p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = x2 * p + -2.10102402082508e-06f;
  p = x2 * p + -5.69250639462346e-05f;
  p = x2 * p + -7.34990630326855e-04f;
  p = x2 * p + -2.95459980854025e-03f;
  p = x2 * p + -1.60960333262415e-02f;
  p = x * p;
  vf q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = x2 * q + -1.68282697438203e-03f;
  q = x2 * q + -7.37332916720468e-03f;
  q = x2 * q + -1.42647390514189e-02f;
  return p / q;
}

inline vf gelu_exact(vf x) { return 0.5f * x * (1.0f + verf(x * 0.70710678118654752f)); }

inline vf gelu_tanh(vf x) {
  const vf y = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  const vf t = 1.0f - 2.0f / (vexp(2.0f * y) + 1.0f);
  return 0.5f * x * (1.0f + t);
}

void range_f32(const float* x, float* out, int64_t n, bool approximate) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = vload(x + i);
    vstore(out + i, approximate ? gelu_tanh(v) : gelu_exact(v));
  }
  if (i < n) {  // the tail through a zero-padded vector
    float xb[kLanes] = {}, ob[kLanes];
    std::copy(x + i, x + n, xb);
    const vf v = vload(xb);
    vstore(ob, approximate ? gelu_tanh(v) : gelu_exact(v));
    std::copy(ob, ob + (n - i), out + i);
  }
}

template <typename T>
void range(const T* x, T* out, int64_t n, bool approximate) {
  constexpr int kBlock = 256;
  float xb[kBlock], ob[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(kBlock, n - i));
    load_row(x + i, 1, m, xb);
    range_f32(xb, ob, m, approximate);
    store_row(ob, m, out + i);
  }
}

template <typename T>
void run(const GeluArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  for_ranges(a.n, kChunk, [&](int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>) {
      range_f32(x + lo, out + lo, hi - lo, a.approximate);
    } else {
      range(x + lo, out + lo, hi - lo, a.approximate);
    }
  });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const GeluArgs& args) {
  with_storage_type(args.dtype, [&](auto tag) { run<decltype(tag)>(args); });
}

} // namespace vllm_metal::cpu
