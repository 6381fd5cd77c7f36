// The SwiGLU op (validation, the lazy array) and its GPU refusal.
#include "swiglu.h"

#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  if (gate.shape() != up.shape()) {
    std::ostringstream os;
    os << "[swiglu] gate and up must have the same shape, got " << gate.shape() << " and " << up.shape();
    throw std::invalid_argument(os.str());
  }
  if (gate.dtype() != up.dtype()) {
    throw std::invalid_argument("[swiglu] gate and up must have the same dtype");
  }
  if (gate.dtype() != mx::float32 && gate.dtype() != mx::float16 && gate.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[swiglu] gate and up must be float32, float16 or bfloat16");
  }
  auto stream = mx::to_stream(s);
  // Any layout: eval_cpu reads evenly spaced contiguous rows in place (the
  // halves of a fused gate/up product) and copies other layouts itself.
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<SwiGLU>(stream), {gate, up});
}

void SwiGLU::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[swiglu] the SwiGLU primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.swiglu builds MLX's own (vectorised) silu(gate) * up");
}

} // namespace vllm_metal
