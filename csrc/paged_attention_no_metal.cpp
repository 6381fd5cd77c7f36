// PagedAttention::eval_gpu for builds without Metal (Linux, or an MLX built
// without it): there is no native GPU kernel, so say so plainly. The Python
// layer (vllm_metal.native.ops) routes such devices to paged_attention_reference.
#include <stdexcept>

#include "paged_attention.h"

namespace vllm_metal {

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[paged_attention] this vllm_metal build has no Metal kernels (MLX was "
      "built without Metal); run on the CPU stream or use "
      "vllm_metal.native.ops.paged_attention_reference");
}

} // namespace vllm_metal
