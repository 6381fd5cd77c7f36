// The CPU kernel of the GatedDelta primitive (csrc/gated_delta.h), compiled
// once per instruction set (VLLM_METAL_KERNEL_ENTRY names the variant).
//
// Work is split over (sequence, value head) pairs; each pair walks its
// tokens in order, and for every token makes one pass per state row: decay
// and the dot with k, then the rank-1 update and the dot with q, while the
// row sits in L1. The [Dv, Dk] float32 state of a pair (64 KiB at 128 x 128)
// stays in L2 for the whole sequence. Dot products keep 8 independent
// partial sums (one SIMD register's worth, so the compiler vectorises them
// without reassociating) combined in a fixed tree: a row's result does not
// depend on the batch, the number of tokens or the thread that ran it, so a
// sequence gives the same bits whether it is decoded, prefilled or chunked.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/convert.h"
#include "cpu/gated_delta_kernel.h"
#include "thread_pool.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int kLanes = 8;

inline float combine(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// s = s * gt; returns s . k   (n a multiple of kLanes)
inline float decay_dot(float* __restrict s, const float* __restrict k, float gt, int n) {
  float acc[kLanes] = {};
  for (int i = 0; i < n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      s[i + j] *= gt;
      acc[j] += s[i + j] * k[i + j];
    }
  }
  return combine(acc);
}

// s = s + k * delta; returns s . q
inline float update_dot(float* __restrict s, const float* __restrict k, const float* __restrict q,
                        float delta, int n) {
  float acc[kLanes] = {};
  for (int i = 0; i < n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      s[i + j] += k[i + j] * delta;
      acc[j] += s[i + j] * q[i + j];
    }
  }
  return combine(acc);
}

template <typename T>
void run(const GatedDeltaKernelArgs& a) {
  const int B = a.batch, Tn = a.steps, Hk = a.k_heads, Hv = a.v_heads;
  const int Dk = a.key_dim, Dv = a.value_dim, group = Hv / Hk;
  const auto* q = static_cast<const T*>(a.q);
  const auto* k = static_cast<const T*>(a.k);
  const auto* v = static_cast<const T*>(a.v);
  auto* y = static_cast<T*>(a.y);
  const int64_t state_size = int64_t(Dv) * Dk;

  parallel_for(std::size_t(B) * Hv, [&](std::size_t unit) {
    const int b = int(unit / Hv), h = int(unit % Hv), hk = h / group;
    const float* src = a.state_in + unit * state_size;
    float* S = a.state_out + unit * state_size;
    if (S != src) {
      std::memcpy(S, src, state_size * sizeof(float));
    }
    std::vector<float> buf(2 * Dk + 2 * Dv);
    float* kf = buf.data();
    float* qf = kf + Dk;
    float* vf = qf + Dk;
    float* yf = vf + Dv;
    for (int t = 0; t < Tn; ++t) {
      const int64_t bt = int64_t(b) * Tn + t;
      T* y_row = y + (bt * Hv + h) * Dv;
      if (a.mask != nullptr && !a.mask[bt]) {
        std::memset(static_cast<void*>(y_row), 0, Dv * sizeof(T));
        continue;
      }
      load_row(k + (bt * Hk + hk) * Dk, 1, Dk, kf);
      load_row(q + (bt * Hk + hk) * Dk, 1, Dk, qf);
      load_row(v + (bt * Hv + h) * Dv, 1, Dv, vf);
      const float gt = a.g[bt * Hv + h];
      const float beta = a.beta[bt * Hv + h];
      for (int r = 0; r < Dv; ++r) {
        float* row = S + int64_t(r) * Dk;
        const float kv = decay_dot(row, kf, gt, Dk);
        const float delta = (vf[r] - kv) * beta;
        yf[r] = update_dot(row, kf, qf, delta, Dk);
      }
      store_row(yf, Dv, y_row);
    }
  });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const GatedDeltaKernelArgs& args) {
  switch (args.dtype) {
    case KernelDtype::float32:
      return run<float>(args);
    case KernelDtype::float16:
      return run<mx::float16_t>(args);
    case KernelDtype::bfloat16:
      return run<mx::bfloat16_t>(args);
  }
}

} // namespace vllm_metal::cpu
