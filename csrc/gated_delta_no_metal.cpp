// GatedDelta::eval_gpu for builds without Metal: say so plainly. The Python
// layer (vllm_metal.native.ops.gated_delta) routes such devices to mlx-lm's ops.
#include <stdexcept>

#include "gated_delta.h"

namespace vllm_metal {

void GatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[gated_delta] this vllm_metal build has no Metal kernels (MLX was built "
      "without Metal); run on the CPU stream");
}

} // namespace vllm_metal
