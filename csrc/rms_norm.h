// RMSNorm: x / sqrt(mean(x^2) + eps) * weight over the last axis, and
// LayerNorm, as one primitive for MLX's CPU device.
//
// On MLX's CPU device mx.fast.rms_norm is not a kernel: it returns its
// fallback composition (~15 operations: cast, square, mean, add, rsqrt,
// multiplies), each dispatched separately, twice or more per layer. This
// primitive is one pass per row. On Metal, MLX's own rms_norm is a fused
// kernel: vllm_metal.native.ops.rms_norm calls it on GPU streams and builds this
// primitive only on CPU streams (its eval_gpu refuses, naming the op to call).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// x: [..., dim] float32, float16 or bfloat16; weight: [dim], x's dtype.
// Statistics in float32; the result in x's dtype. Lazy.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// LayerNorm the same way: (x - mean) / sqrt(var + eps) * weight [+ bias]
// (encoders; MLX's CPU mx.fast.layer_norm is also a fallback composition).
mx::array layer_norm(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                     float eps, mx::StreamOrDevice s = {});

// One primitive for both norms (`layer`: LayerNorm; inputs x, weight[, bias]).
class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool layer = false)
      : mx::UnaryPrimitive(stream), eps_(eps), layer_(layer) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && layer_ == o.layer_;
  }
  const char* name() const override {
    return layer_ ? "LayerNorm" : "RMSNorm";
  }

 private:
  float eps_;
  bool layer_;
};

} // namespace vllm_metal
