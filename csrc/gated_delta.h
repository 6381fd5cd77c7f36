// GatedDelta: a lazy MLX primitive for the gated delta rule recurrence of
// Gated DeltaNet layers (qwen3_next, qwen3_5): a whole right-padded batch of
// token sequences through one fused loop per (sequence, value head), instead
// of a handful of MLX ops per token.
//
// For each sequence b and value head h (key head h / (Hv / Hk)), with the
// state S = state[b, h] a [Dv, Dk] float32 matrix and, for t = 0 .. T-1
// where mask[b, t] (every t when there is no mask):
//   S      = S * g[b, t, h]                 (decay)
//   kv     = S @ k[b, t, hk]                ([Dv])
//   delta  = (v[b, t, h] - kv) * beta[b, t, h]
//   S      = S + outer(delta, k[b, t, hk])
//   y[b, t, h] = S @ q[b, t, hk]            (in q's dtype)
// and where mask[b, t] is false: y[b, t, h] = 0 and S is left as it is.
// Outputs: y [B, T, Hv, Dv] and the final states [B, Hv, Dv, Dk] (float32).
// This is mlx-lm's gated_delta_update after its g / beta computation (its
// `gated_delta_ops` / `gated_delta_kernel` with scalar gating), all math in
// float32. q is expected L2-normalised and pre-scaled by the caller.
//
// Inputs (the op makes them row-contiguous, the state only on the GPU stream;
// g and beta become float32):
//   q, k  [B, T, Hk, Dk]   float32 | float16 | bfloat16 (the same dtype)
//   v     [B, T, Hv, Dv]   q's dtype
//   g     [B, T, Hv]       float32
//   beta  [B, T, Hv]       float32
//   state [B, Hv, Dv, Dk]  float32
//   mask  [B, T]           bool (optional, the 7th input)
// Supported: Dk in {32, 64, 128, 256} (32 lanes x Dk/32 values on the GPU;
// the CPU accepts the same set), 1 <= Dv <= 256, Hv a multiple of Hk.
// The final state may be written into the input state's buffer (when MLX
// lets the primitive donate it): each (b, h, row) reads its state row before
// writing it, and no other row reads it.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

bool is_supported_gated_delta_key_dim(int dk);
constexpr int kGatedDeltaMaxValueDim = 256;

// Validates static shapes and dtypes (std::invalid_argument -> ValueError)
// and returns the lazy {y, state_out}.
std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask = std::nullopt,
    mx::StreamOrDevice s = {});

// Same invariant as PagedAttention: no encoder.add_temporary().
class GatedDelta : public mx::Primitive {
 public:
  explicit GatedDelta(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  const char* name() const override {
    return "GatedDelta";
  }

  // Both backends begin here: releases the siblings' inputs, gives y its own
  // buffer and the final state the input state's buffer where it can be
  // donated (row-contiguous, referenced by nothing else), else its own.
  static void allocate_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs);

  static constexpr int kStateInput = 5;
  static constexpr int kMaskInput = 6;
  static bool has_mask(const std::vector<mx::array>& inputs) {
    return inputs.size() > kMaskInput;
  }
};

} // namespace vllm_metal
