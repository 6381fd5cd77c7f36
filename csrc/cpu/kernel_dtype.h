// The kernels' dtype tag for an MLX dtype, for the eval_cpu side (host code,
// compiled once). The primitives validate dtypes before building the array,
// so only float32, float16 and bfloat16 reach here.
#pragma once

#include "cpu/paged_attention_kernel.h"  // KernelDtype
#include "mlx/dtype.h"

namespace vllm_metal::cpu {

inline KernelDtype kernel_dtype(mlx::core::Dtype dtype) {
  return dtype == mlx::core::float32 ? KernelDtype::float32
      : dtype == mlx::core::float16  ? KernelDtype::float16
                                     : KernelDtype::bfloat16;
}

} // namespace vllm_metal::cpu
