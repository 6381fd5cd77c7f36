// RopeWriteKV::eval_gpu for builds without Metal: say so plainly. The Python
// layer (vllm_metal.native.kv_writes) routes GPU streams of such builds to
// MLX's fused RoPE and scatter.
#include <stdexcept>

#include "rope_write_kv.h"

namespace vllm_metal {

void RopeWriteKV::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[rope_write_kv] the RopeWriteKV primitive runs on MLX's CPU device only in this build (MLX "
      "without Metal); on the GPU, call the model's RoPE module (MLX's fused mx.fast.rope) and "
      "vllm_metal.native.ops.write_kv");
}

} // namespace vllm_metal
