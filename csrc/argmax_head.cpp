// The ArgmaxHead op (validation, the lazy array) and its GPU refusal.
#include "argmax_head.h"

#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

namespace vllm_metal {

mx::array argmax_head(const mx::array& hidden, const mx::array& weight, mx::StreamOrDevice s) {
  if (hidden.ndim() != 2 || weight.ndim() != 2 || hidden.shape(1) != weight.shape(1)) {
    std::ostringstream os;
    os << "[argmax_head] hidden must be [rows, hidden_size] and weight [vocab, hidden_size], got "
       << hidden.shape() << " and " << weight.shape();
    throw std::invalid_argument(os.str());
  }
  if (hidden.dtype() != mx::float32 || weight.dtype() != mx::float32) {
    throw std::invalid_argument("[argmax_head] hidden and weight must be float32");
  }
  if (weight.shape(0) == 0 || weight.shape(0) > (int64_t{1} << 31) - 1) {
    throw std::invalid_argument("[argmax_head] the vocabulary must have 1 to 2^31 - 1 rows");
  }
  auto stream = mx::to_stream(s);
  auto h = mx::contiguous(hidden, false, stream);
  auto w = mx::contiguous(weight, false, stream);
  return mx::array({hidden.shape(0)}, mx::int32, std::make_shared<ArgmaxHead>(stream), {h, w});
}

void ArgmaxHead::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[argmax_head] the ArgmaxHead primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.argmax_head builds MLX's own matmul and argmax");
}

} // namespace vllm_metal
