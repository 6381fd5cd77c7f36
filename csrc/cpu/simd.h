// Sixteen-lane float vectors for the CPU kernels and the math they share.
// Each kernel source is compiled once per instruction set (CMakeLists.txt);
// every build computes the same values lane by lane (with
// -ffp-contract=fast, a * b + c is one FMA wherever the build has FMA).
//
// A vf is held in the build's own registers: one AVX-512 register, two AVX2
// ones, four SSE/NEON ones (kParts native vectors of kNative lanes). It is
// not a 64-byte GCC vector on the narrower builds: a vector type wider than
// any register of the target has no machine mode, so GCC keeps every such
// variable in memory and splits each operation into loads and stores -- the
// AVX2 kernels ran 20-30x slower than the AVX-512 ones that way (issue 34,
// docs/benchmarks.md, "AVX2-only hosts"). The operations work part by part; the lane
// reductions (hmax, hsum) use the same tree in every build.
#pragma once

#include <cstdint>
#include <cstring>

namespace vllm_metal::cpu {

// Everything here has internal linkage (an unnamed namespace): each kernel
// source is compiled once per instruction set into the same library, and
// inline functions with external linkage would be merged by the linker into
// one copy, possibly an AVX-512 one called on a CPU without it.
namespace {

constexpr int kLanes = 16;  // floats per vf
#if defined(__AVX512F__)
constexpr int kNative = 16;
#elif defined(__AVX__)
constexpr int kNative = 8;
#else
constexpr int kNative = 4;
#endif
constexpr int kParts = kLanes / kNative;  // native vectors per vf

using nf = float __attribute__((vector_size(kNative * sizeof(float))));
using ni = int32_t __attribute__((vector_size(kNative * sizeof(int32_t))));

#define VM_INLINE inline __attribute__((always_inline))

// Sixteen floats (aggregate: vf{} is zero) and sixteen int32 lanes (masks of
// comparisons: -1 true, 0 false; or the bits of floats).
struct vf {
  nf p[kParts];
};
struct vi {
  ni p[kParts];
};

VM_INLINE vf splat(float x) {
  vf r;
  for (int k = 0; k < kParts; ++k) r.p[k] = nf{} + x;
  return r;
}

VM_INLINE vf vload(const float* p) {
  vf v;
  for (int k = 0; k < kParts; ++k) std::memcpy(&v.p[k], p + k * kNative, sizeof(nf));
  return v;
}

VM_INLINE void vstore(float* p, vf v) {
  for (int k = 0; k < kParts; ++k) std::memcpy(p + k * kNative, &v.p[k], sizeof(nf));
}

// Keeps v in registers from here on: a loaded vf that several FMAs use may
// otherwise be re-read from memory by each (GCC folds the load into every
// FMA's memory operand), which made the AVX2 value accumulation bound by
// its loads (perf annotate: 10 loads for 8 FMAs). Changes no value.
VM_INLINE void keep_in_registers(vf& v) {
#if defined(__AVX512F__)
  for (int k = 0; k < kParts; ++k) asm("" : "+v"(v.p[k]));
#elif defined(__x86_64__) || defined(__i386__)
  for (int k = 0; k < kParts; ++k) asm("" : "+x"(v.p[k]));
#elif defined(__aarch64__)
  for (int k = 0; k < kParts; ++k) asm("" : "+w"(v.p[k]));
#else
  (void)v;
#endif
}

// Lane j (read only; write through vstore / vload).
VM_INLINE float lane(vf v, int j) { return v.p[j / kNative][j % kNative]; }

// {0, 1, ..., 15}
VM_INLINE vf iota() {
  float l[kLanes];
  for (int j = 0; j < kLanes; ++j) l[j] = static_cast<float>(j);
  return vload(l);
}

// The operator OP part by part, returning R (vf for arithmetic, vi masks for
// comparisons); a float operand is broadcast.
#define VM_PARTWISE(R, OP)                                                \
  VM_INLINE R operator OP(vf a, vf b) {                                   \
    R r;                                                                  \
    for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] OP b.p[k];           \
    return r;                                                             \
  }                                                                       \
  VM_INLINE R operator OP(vf a, float b) {                                \
    R r;                                                                  \
    for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] OP b;                \
    return r;                                                             \
  }                                                                       \
  VM_INLINE R operator OP(float a, vf b) {                                \
    R r;                                                                  \
    for (int k = 0; k < kParts; ++k) r.p[k] = a OP b.p[k];                \
    return r;                                                             \
  }
#define VM_ARITHMETIC(OP)                                                 \
  VM_PARTWISE(vf, OP)                                                     \
  VM_INLINE vf& operator OP##=(vf& a, vf b) { return a = a OP b; }        \
  VM_INLINE vf& operator OP##=(vf& a, float b) { return a = a OP b; }
VM_ARITHMETIC(+)
VM_ARITHMETIC(-)
VM_ARITHMETIC(*)
VM_ARITHMETIC(/)
VM_PARTWISE(vi, <)
VM_PARTWISE(vi, >)
VM_PARTWISE(vi, <=)
VM_PARTWISE(vi, >=)
VM_PARTWISE(vi, ==)
#undef VM_ARITHMETIC
#undef VM_PARTWISE

VM_INLINE vf operator-(vf a) {
  vf r;
  for (int k = 0; k < kParts; ++k) r.p[k] = -a.p[k];
  return r;
}

VM_INLINE vi operator&(vi a, vi b) {
  vi r;
  for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] & b.p[k];
  return r;
}

// m ? a : b, lane by lane.
VM_INLINE vf select(vi m, vf a, vf b) {
  vf r;
  for (int k = 0; k < kParts; ++k) r.p[k] = m.p[k] ? a.p[k] : b.p[k];
  return r;
}

VM_INLINE vf vmax(vf a, vf b) { return select(a > b, a, b); }
VM_INLINE vf vmin(vf a, vf b) { return select(a < b, a, b); }

// Lane reductions by halving: lanes j and j + 8, then j and j + 4, then
// (0 + 2) + (1 + 3) -- the same tree in every build, so the builds agree to
// the bit. Sum first, then each build's parts in that order.
template <typename Op>
VM_INLINE float reduce_tree(vf v, Op op) {
  using v4 = float __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  using v8 = float __attribute__((vector_size(32)));
  const v8 a = op(__builtin_shufflevector(v.p[0], v.p[0], 0, 1, 2, 3, 4, 5, 6, 7),
                  __builtin_shufflevector(v.p[0], v.p[0], 8, 9, 10, 11, 12, 13, 14, 15));
  const v4 c = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#elif defined(__AVX__)
  const nf a = op(v.p[0], v.p[1]);
  const v4 c = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#else
  const v4 c = op(op(v.p[0], v.p[2]), op(v.p[1], v.p[3]));
#endif
  const float x = op(c[0], c[2]), y = op(c[1], c[3]);
  return op(x, y);
}

struct MaxOp {
  template <typename T>
  VM_INLINE T operator()(T a, T b) const { return a > b ? a : b; }
};
struct SumOp {
  template <typename T>
  VM_INLINE T operator()(T a, T b) const { return a + b; }
};

VM_INLINE float hmax(vf v) { return reduce_tree(v, MaxOp{}); }
VM_INLINE float hsum(vf v) { return reduce_tree(v, SumOp{}); }

// exp(x) lane-wise: Cephes' expf polynomial with round-to-nearest by the
// 1.5 * 2^23 trick, ~1 ulp. x is clamped to [-87.3, 88.3] (below, ~1e-38
// instead of 0: callers that need exact zeros mask them).
VM_INLINE nf vexp_part(nf x) {
  const nf lo = nf{} - 87.3f, hi = nf{} + 88.3f;
  nf v = x < lo ? lo : x;
  v = v > hi ? hi : v;
  const nf t = v * 1.44269504088896341f + 12582912.0f;  // round(v / ln 2) in the low bits
  const nf k = t - 12582912.0f;
  const nf r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
  nf p = nf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ni scale = (((ni)t) - 0x4B400000 + 127) << 23;  // 2^k (the bits of t as integers)
  return p * (nf)scale;
}

VM_INLINE vf vexp(vf x) {
  vf r;
  for (int k = 0; k < kParts; ++k) r.p[k] = vexp_part(x.p[k]);
  return r;
}

#undef VM_INLINE

} // namespace

} // namespace vllm_metal::cpu
