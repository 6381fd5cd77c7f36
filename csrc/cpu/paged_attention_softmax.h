// The online (streaming) softmax of the CPU paged-attention kernel
// (paged_attention_kernel.cpp): a query row's running state over the keys
// seen so far, one step of keys folded into it, and the merge of two states
// (key partitions). Float32 throughout; the same operations lane by lane in
// every build, like paged_attention_blocks.h, which it builds on.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/paged_attention_blocks.h"
#include "cpu/simd.h"

namespace vllm_metal::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Running softmax state of one query row over some set of keys.
struct RowState {
  float m, l;  // max score and sum of exp(score - m)
};

// Merges state (m2, l2, acc2) into (m1, l1, acc1); the one combine rule used
// for partitions (in place or from partials).
inline void merge_into(RowState& s1, float* acc1, RowState s2, const float* acc2, int n) {
  if (s2.l == 0.0f && s2.m == kNegInf) {
    return;
  }
  float m = std::max(s1.m, s2.m);
  float a = std::exp(s1.m - m);
  float b = std::exp(s2.m - m);
  s1.l = s1.l * a + s2.l * b;
  s1.m = m;
  for (int d = 0; d < n; ++d) {
    acc1[d] = acc1[d] * a + acc2[d] * b;
  }
}

// One step of a row over the lanes [lo, hi) of a step's scores (s, ng
// vectors of them; lanes outside are masked, whatever they hold): scores
// scaled (and soft-capped), s becomes the weights exp(score - m), acc
// (dvp floats) is rescaled to the new max; the caller adds the values.
inline void online_softmax_step(float* s, int ng, int lo, int hi, float scale, float softcap, RowState& st,
                                float* acc, int dvp) {
  const vf lanes = iota();
  const vf neg_inf = splat(kNegInf);
  const bool whole = lo == 0 && hi == ng * kLanes;  // no key of the groups masked
  vf vm = neg_inf;
  for (int g = 0; g < ng; ++g) {
    vf x = vload(s + g * kLanes) * scale;
    if (softcap > 0.0f) {
      float l[kLanes];
      for (int j = 0; j < kLanes; ++j) l[j] = softcap * std::tanh(lane(x, j) / softcap);
      x = vload(l);
    }
    if (!whole) {
      const vf idx = lanes + static_cast<float>(g * kLanes);
      x = select((idx >= static_cast<float>(lo)) & (idx < static_cast<float>(hi)), x, neg_inf);
    }
    vstore(s + g * kLanes, x);
    vm = vmax(vm, x);
  }
  const float m = std::max(st.m, hmax(vm));
  const float a = std::exp(st.m - m);
  if (a != 1.0f) {
    for (int c = 0; c < dvp; c += kLanes) vstore(acc + c, vload(acc + c) * a);
  }
  vf vsum = {};
  for (int g = 0; g < ng; ++g) {
    const vf x = vload(s + g * kLanes);
    vf e = vexp(x - m);
    if (!whole) e = select(x == neg_inf, vf{}, e);
    vstore(s + g * kLanes, e);
    vsum += e;
  }
  st = {m, st.l * a + hsum(vsum)};
}

} // namespace
} // namespace vllm_metal::cpu
