// The RoPE op (validation, the lazy array) and its GPU refusal.
#include "rope.h"

#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

mx::array rope(const mx::array& x, const mx::array& table, bool traditional, mx::StreamOrDevice s) {
  if (x.ndim() != 3) {
    std::ostringstream os;
    os << "[rope] x must be [tokens, heads, dim], got shape " << x.shape();
    throw std::invalid_argument(os.str());
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[rope] x must be float32, float16 or bfloat16");
  }
  if (table.ndim() != 3 || table.shape(0) != x.shape(0) || table.shape(2) != 2 || table.shape(1) < 1 ||
      2 * table.shape(1) > x.shape(2)) {
    std::ostringstream os;
    os << "[rope] table must be [tokens, rotated / 2, 2] with tokens = " << x.shape(0)
       << " and rotated <= dim = " << x.shape(2) << ", got shape " << table.shape();
    throw std::invalid_argument(os.str());
  }
  if (table.dtype() != mx::float32) {
    throw std::invalid_argument("[rope] table must be float32");
  }
  auto stream = mx::to_stream(s);
  auto xc = mx::contiguous(x, false, stream);
  auto tc = mx::contiguous(table, false, stream);
  return mx::array(x.shape(), x.dtype(), std::make_shared<RoPE>(stream, traditional), {xc, tc});
}

void RoPE::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[rope] the RoPE primitive runs on MLX's CPU device only; on the GPU, call the model's "
      "RoPE module (MLX's fused mx.fast.rope)");
}

} // namespace vllm_metal
