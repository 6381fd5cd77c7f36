// RoPE from a per-step table: each token's heads rotated by that token's
// (cos, sin) pairs, as one primitive for MLX's CPU device.
//
// On MLX's CPU device mx.fast.rope is not a kernel: it returns its fallback
// composition (~30 operations, the angles' cos and sin computed through libm
// for every call), twice per layer. Here the pairs come from a table the
// caller computes once per step and shares across layers
// (vllm_metal/models/cpu_norm_rope.py builds it with the model's own RoPE module),
// and the rotation is one pass. On Metal, MLX's own rope is a fused kernel:
// the adapter keeps calling the model's module there, and this primitive's
// eval_gpu refuses, naming the op to call.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// x: [tokens, heads, dim] float32, float16 or bfloat16; table: float32
// [tokens, rotated / 2, 2], (cos, sin) per rotated pair (rotated <= dim; the
// dims past `rotated` are copied). Pairs are (i, i + rotated / 2), or (2i,
// 2i + 1) when traditional. The result in x's dtype. Lazy.
mx::array rope(const mx::array& x, const mx::array& table, bool traditional, mx::StreamOrDevice s = {});

class RoPE : public mx::UnaryPrimitive {
 public:
  RoPE(mx::Stream stream, bool traditional) : mx::UnaryPrimitive(stream), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return traditional_ == static_cast<const RoPE&>(other).traditional_;
  }
  const char* name() const override {
    return "RoPE";
  }

 private:
  bool traditional_;
};

} // namespace vllm_metal
