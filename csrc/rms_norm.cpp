// The RMSNorm op (validation, the lazy array) and its GPU refusal.
#include "rms_norm.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.shape(-1) < 1) {
    throw std::invalid_argument("[rms_norm] x must have a non-empty last axis");
  }
  if (weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    std::ostringstream os;
    os << "[rms_norm] weight must have shape (" << x.shape(-1) << ",) for x of shape " << x.shape()
       << ", got " << weight.shape();
    throw std::invalid_argument(os.str());
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[rms_norm] x must be float32, float16 or bfloat16");
  }
  if (weight.dtype() != x.dtype()) {
    throw std::invalid_argument("[rms_norm] weight must have x's dtype");
  }
  if (!std::isfinite(eps) || eps < 0.0f) {
    throw std::invalid_argument("[rms_norm] eps must be finite and >= 0");
  }
  auto stream = mx::to_stream(s);
  auto xc = mx::contiguous(x, false, stream);
  auto wc = mx::contiguous(weight, false, stream);
  return mx::array(x.shape(), x.dtype(), std::make_shared<RMSNorm>(stream, eps), {xc, wc});
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[rms_norm] the RMSNorm primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.rms_norm calls MLX's own fused mx.fast.rms_norm");
}

} // namespace vllm_metal
