// Sixteen-lane float vectors for the CPU kernels (GCC vector extensions) and
// the math they share. Each kernel source is compiled once per instruction
// set (CMakeLists.txt); GCC lowers the same lane-wise operations to AVX-512,
// AVX2 or SSE, so every build computes the same values lane by lane (with
// -ffp-contract=fast, a * b + c is one FMA wherever the build has FMA).
#pragma once

#include <cstdint>
#include <cstring>

namespace vllm_metal::cpu {

// Everything here has internal linkage (an unnamed namespace): each kernel
// source is compiled once per instruction set into the same library, and
// inline functions with external linkage would be merged by the linker into
// one copy, possibly an AVX-512 one called on a CPU without it.
namespace {

// Sixteen floats: one AVX-512 register, two AVX2 ones, four SSE ones. GCC
// lowers the same lane-wise operations to each, so every build computes the
// same values lane by lane.
constexpr int kLanes = 16;  // floats per vector
using vf = float __attribute__((vector_size(64)));
using vi = int32_t __attribute__((vector_size(64)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp(x) lane-wise: Cephes' expf polynomial with round-to-nearest by the
// 1.5 * 2^23 trick, ~1 ulp. x is clamped to [-87.3, 88.3] (below, ~1e-38
// instead of 0: callers that need exact zeros mask them).
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.3f;
  vf v = x < lo ? lo : x;
  v = v > hi ? hi : v;
  const vf t = v * 1.44269504088896341f + 12582912.0f;  // round(v / ln 2) in the low bits
  const vf k = t - 12582912.0f;
  const vf r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi scale = (((vi)t) - 0x4B400000 + 127) << 23;  // 2^k
  return p * (vf)scale;
}

} // namespace

} // namespace vllm_metal::cpu
