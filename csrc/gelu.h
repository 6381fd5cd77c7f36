// GELU: x * Phi(x), element-wise, as one primitive for MLX's CPU device:
// exact (erf) or tanh-approximated, as transformers' "gelu" and
// "gelu_pytorch_tanh" / "gelu_new" define them. Encoders (BERT, XLM-R,
// ModernBERT's GeGLU) spend more time in MLX's CPU erf (libm, one element at
// a time: ~25 ns an element) than in their matmuls. This primitive runs it
// in 16-lane vectors on the CPU; on Metal MLX's own element-wise kernels are
// already vectorised, so vllm_metal.native.ops.gelu builds MLX's composition
// on GPU streams and this primitive only on CPU streams (its eval_gpu
// refuses, naming the op to call), as SwiGLU does.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// gelu(x) in x's dtype (float32, float16 or bfloat16; computed in float32).
// approximate: the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// instead of 0.5 x (1 + erf(x / sqrt(2))). Lazy.
mx::array gelu(const mx::array& x, bool approximate = false, mx::StreamOrDevice s = {});

class GELU : public mx::UnaryPrimitive {
 public:
  GELU(mx::Stream stream, bool approximate) : mx::UnaryPrimitive(stream), approximate_(approximate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return approximate_ == static_cast<const GELU&>(other).approximate_;
  }
  const char* name() const override {
    return "GELU";
  }

 private:
  bool approximate_;
};

} // namespace vllm_metal
