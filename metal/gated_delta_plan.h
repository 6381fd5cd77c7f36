// Host-side launch plan of the gated-delta kernel: from the static shapes of
// one call, the kernel name, grid and threadgroup size. Plain C++ without
// Metal or MLX, so that eval_gpu (csrc/gated_delta_metal.cpp) and the executor
// driver (tests/metal/msl/gated_delta_driver.cpp) share this one choice.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "gated_delta_params.h"

namespace vllm_metal {

// Apple GPUs' SIMD width: one simdgroup works one state row, Dk / 32 key
// dims per lane (eval_gpu checks the pipeline's width).
constexpr int kGatedDeltaSimdWidth = 32;
// State rows (simdgroups) per threadgroup, as mlx-lm's kernel (32 x 4). A
// first choice, not yet measured on a Mac.
constexpr int kGatedDeltaRowsPerThreadgroup = 4;

struct GatedDeltaPlan {
  GatedDeltaArgs args;
  std::string name;
  uint32_t grid[3];  // threadgroups per grid: (row groups, Hv, B)
  uint32_t threads;  // threads per threadgroup (one-dimensional): rows x 32
};

inline bool gated_delta_key_dim_has_kernel(int key_dim) {
  return key_dim == 32 || key_dim == 64 || key_dim == 128 || key_dim == 256;
}

// dtype_name: "float32", "float16" or "bfloat16" (MLX's names).
inline std::string gated_delta_kernel_name(const std::string& dtype_name, int key_dim) {
  return "gated_delta_" + dtype_name + "_dk" + std::to_string(key_dim);
}

// `args` arrives with every field filled in (shapes, has_mask).
inline GatedDeltaPlan plan_gated_delta(const GatedDeltaArgs& args, const std::string& dtype_name) {
  if (!gated_delta_key_dim_has_kernel(args.key_dim)) {
    throw std::invalid_argument("[gated_delta] no Metal kernel for key dim " +
                                std::to_string(args.key_dim) + " (32, 64, 128, 256)");
  }
  if (args.value_dim < 1 || args.value_dim > 256 || args.k_heads < 1 ||
      args.v_heads % args.k_heads != 0) {
    throw std::invalid_argument(
        "[gated_delta] value dim or heads outside the Metal kernel's range");
  }
  const int rows = std::min(kGatedDeltaRowsPerThreadgroup, args.value_dim);
  GatedDeltaPlan plan{};
  plan.args = args;
  plan.name = gated_delta_kernel_name(dtype_name, args.key_dim);
  plan.grid[0] = static_cast<uint32_t>((args.value_dim + rows - 1) / rows);
  plan.grid[1] = static_cast<uint32_t>(args.v_heads);
  plan.grid[2] = static_cast<uint32_t>(args.batch);
  plan.threads = static_cast<uint32_t>(rows * kGatedDeltaSimdWidth);
  return plan;
}

} // namespace vllm_metal
