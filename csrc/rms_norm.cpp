// The RMSNorm and LayerNorm ops (validation, the lazy array) and its GPU refusal.
#include "rms_norm.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

namespace {

void check_vector(const char* op, const char* name, const mx::array& x, const mx::array& v) {
  if (v.ndim() != 1 || v.shape(0) != x.shape(-1)) {
    std::ostringstream os;
    os << "[" << op << "] " << name << " must have shape (" << x.shape(-1) << ",) for x of shape "
       << x.shape() << ", got " << v.shape();
    throw std::invalid_argument(os.str());
  }
  if (v.dtype() != x.dtype()) {
    throw std::invalid_argument(std::string("[") + op + "] " + name + " must have x's dtype");
  }
}

mx::array norm(const char* op, const mx::array& x, const mx::array& weight,
               const std::optional<mx::array>& bias, float eps, bool layer, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.shape(-1) < 1) {
    throw std::invalid_argument(std::string("[") + op + "] x must have a non-empty last axis");
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument(std::string("[") + op + "] x must be float32, float16 or bfloat16");
  }
  check_vector(op, "weight", x, weight);
  if (bias) check_vector(op, "bias", x, *bias);
  if (!std::isfinite(eps) || eps < 0.0f) {
    throw std::invalid_argument(std::string("[") + op + "] eps must be finite and >= 0");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream), mx::contiguous(weight, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  return mx::array(x.shape(), x.dtype(), std::make_shared<RMSNorm>(stream, eps, layer), std::move(inputs));
}

} // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  return norm("rms_norm", x, weight, std::nullopt, eps, false, s);
}

mx::array layer_norm(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                     float eps, mx::StreamOrDevice s) {
  return norm("layer_norm", x, weight, bias, eps, true, s);
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      std::string("[") + name() + "] the " + name() + " primitive runs on MLX's CPU device only; on the "
      "GPU, vllm_metal.native.ops.rms_norm / layer_norm call MLX's own fused mx.fast.rms_norm / layer_norm");
}

} // namespace vllm_metal
