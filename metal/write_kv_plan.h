// Host-side launch plan of the KV-cache write kernel (metal/write_kv.metal):
// from the static shapes and strides of one call, the kernel name, grid and
// threadgroup size. Plain C++ without Metal or MLX, so that
// RopeWriteKV::eval_gpu (csrc/rope_write_kv_metal.cpp) and the executor
// driver (tests/metal/msl/write_kv_driver.cpp) share this one choice.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "write_kv_params.h"

namespace vllm_metal {

// Threads per threadgroup, at most: a token's row (heads * head_dim
// elements) in chunks of up to 256, rounded up to whole 32-lane simdgroups.
constexpr int kWriteKVMaxThreads = 256;

struct WriteKVPlan {
  WriteKVArgs args;
  std::string name;
  uint32_t grid[3];  // threadgroups per grid: (row chunks, tokens, 1)
  uint32_t threads;  // threads per threadgroup (one-dimensional)
};

// dtype_name: "float32", "float16" or "bfloat16" (MLX's names).
inline std::string write_kv_kernel_name(const std::string& dtype_name) {
  return "write_kv_" + dtype_name;
}

// `args` arrives with every field filled in but `row`. tokens == 0 or an
// empty row: nothing to dispatch (grid of zero threadgroups; the caller
// skips the dispatch).
inline WriteKVPlan plan_write_kv(const WriteKVArgs& args, const std::string& dtype_name) {
  if (args.tokens < 0 || args.heads < 0 || args.head_dim < 0 || args.num_slots < 0) {
    throw std::invalid_argument("[write_kv] negative shape");
  }
  WriteKVPlan plan{};
  plan.args = args;
  plan.args.row = args.heads * args.head_dim;
  plan.name = write_kv_kernel_name(dtype_name);
  const int row = plan.args.row;
  const int threads = std::min(kWriteKVMaxThreads, std::max(32, (row + 31) / 32 * 32));
  plan.threads = static_cast<uint32_t>(threads);
  plan.grid[0] = static_cast<uint32_t>(row == 0 ? 0 : (row + threads - 1) / threads);
  plan.grid[1] = static_cast<uint32_t>(row == 0 ? 0 : args.tokens);
  plan.grid[2] = 1;
  return plan;
}

} // namespace vllm_metal
