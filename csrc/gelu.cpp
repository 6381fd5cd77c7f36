// The GELU op (validation, the lazy array) and its GPU refusal.
#include "gelu.h"

#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

mx::array gelu(const mx::array& x, bool approximate, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[gelu] x must be float32, float16 or bfloat16");
  }
  auto stream = mx::to_stream(s);
  auto c = mx::contiguous(x, false, stream);  // row-contiguous for the kernel (a no-op when it is)
  return mx::array(x.shape(), x.dtype(), std::make_shared<GELU>(stream, approximate), {c});
}

void GELU::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[gelu] the GELU primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.gelu builds MLX's own (vectorised) GELU");
}

} // namespace vllm_metal
