// SwiGLU: silu(gate) * up, element-wise, as one primitive for MLX's CPU device.
//
// MLX's CPU backend computes exp/sigmoid one element at a time through libm
// (~20 ns an element in the Linux wheels; measured in docs/primitives.md), so
// a gated MLP's activation costs more than its matmuls in a long prefill.
// This primitive runs it in 16-lane vectors on the CPU. On Metal, MLX's own
// element-wise kernels are already vectorised: vllm_metal.native.ops.swiglu builds
// MLX's composition on GPU streams and this primitive only on CPU streams
// (its eval_gpu refuses, naming the op to call).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// silu(gate) * up in gate's dtype (float32, float16 or bfloat16; computed in
// float32). gate and up: the same shape and dtype. Lazy.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

class SwiGLU : public mx::UnaryPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  const char* name() const override {
    return "SwiGLU";
  }
};

} // namespace vllm_metal
