// The gated delta rule kernel (see csrc/gated_delta.h for the recurrence):
// one 32-lane simdgroup per value row (sequence b, value head h, row dv) of
// the [Dv, Dk] float32 state, looping over the T steps with the row in
// registers, the layout of mlx-lm's generic gated_delta kernel.
//
// Lane l holds the state values of key dims l, l + 32, ... (DPL = Dk / 32 of
// them), so the loads of q, k and the state row are coalesced. Per step: the
// row is decayed by g, kv = row . k and y = row . q are simd_sums, and lane 0
// writes y; a masked step (mask[b, t] false) writes y = 0 and leaves the row.
// All math is float32; q, k, v and y are T.
//
// The grid (gated_delta_plan.h): threadgroups of one or more simdgroups, one
// row each, rows dv = tgid.x * simdgroups + simdgroup; tgid.y = h, tgid.z = b.
// Simdgroups past Dv (the last threadgroup when Dv is not a multiple of the
// rows per threadgroup) return at once, as whole simdgroups, before any simd
// operation. The state output may be the state input's memory (donated):
// each simdgroup reads its own row before the loop and writes it after, and
// no other simdgroup touches that row.
#pragma once

#include <metal_stdlib>

// Before our shared headers: they name int64_t the way MLX's kernels do,
// after this directive.
using namespace metal;

#include "gated_delta_params.h"

// DPL: key dims per lane (Dk / 32).
template <typename T, int DPL>
[[kernel]] void gated_delta(
    constant vllm_metal::GatedDeltaArgs& args [[buffer(0)]],
    const device T* q [[buffer(1)]],
    const device T* k [[buffer(2)]],
    const device T* v [[buffer(3)]],
    const device float* g [[buffer(4)]],
    const device float* beta [[buffer(5)]],
    const device float* state_in [[buffer(6)]],
    const device bool* mask [[buffer(7)]],
    device T* y [[buffer(8)]],
    device float* state_out [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int W = 32;
  constexpr int Dk = DPL * W;  // == args.key_dim (the plan picks the kernel by it)
  const int Dv = args.value_dim;
  const int dv = int(tgid.x * simdgroups + sg);
  if (dv >= Dv) {  // the same for every lane of the simdgroup
    return;
  }
  const int h = int(tgid.y);
  const int b = int(tgid.z);
  const int steps = args.steps;
  const int Hk = args.k_heads;
  const int Hv = args.v_heads;
  const int hk = h / (Hv / Hk);

  // Element offsets at step 0, advanced by one step per iteration.
  int64_t qk = (int64_t(b) * steps * Hk + hk) * Dk + int(lane);  // q, k [B, T, Hk, Dk]
  int64_t vy = (int64_t(b) * steps * Hv + h) * Dv + dv;          // v, y [B, T, Hv, Dv]
  int64_t gb = int64_t(b) * steps * Hv + h;                      // g, beta [B, T, Hv]
  const int64_t qk_step = int64_t(Hk) * Dk;
  const int64_t vy_step = int64_t(Hv) * Dv;
  const int64_t mask_row = int64_t(b) * steps;                   // mask [B, T]
  const int64_t row = ((int64_t(b) * Hv + h) * Dv + dv) * Dk + int(lane);  // state

  float s[DPL];
  for (int i = 0; i < DPL; ++i) {
    s[i] = state_in[row + i * W];
  }

  for (int t = 0; t < steps; ++t) {
    // Without a mask the slot holds q: never read it then.
    const bool active = args.has_mask == 0 || mask[mask_row + t];
    if (active) {  // uniform in the simdgroup (one (b, t))
      const float decay = g[gb];
      const float rate = beta[gb];
      float kt[DPL];
      float kv = 0.0f;
      for (int i = 0; i < DPL; ++i) {
        kt[i] = static_cast<float>(k[qk + i * W]);
        s[i] *= decay;
        kv += s[i] * kt[i];
      }
      kv = simd_sum(kv);
      const float delta = (static_cast<float>(v[vy]) - kv) * rate;
      float out = 0.0f;
      for (int i = 0; i < DPL; ++i) {
        s[i] += kt[i] * delta;
        out += s[i] * static_cast<float>(q[qk + i * W]);
      }
      out = simd_sum(out);
      if (lane == 0) {
        y[vy] = static_cast<T>(out);
      }
    } else if (lane == 0) {
      y[vy] = static_cast<T>(0.0f);
    }
    qk += qk_step;
    vy += vy_step;
    gb += Hv;
  }

  for (int i = 0; i < DPL; ++i) {
    state_out[row + i * W] = s[i];
  }
}
