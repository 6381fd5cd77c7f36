// Kernel-side helpers shared by the element-wise CPU kernels (SwiGLU,
// RMSNorm, RoPE): run a kernel template for the arguments' storage type, and
// split a range of items into tasks over the kernels' thread pool.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype
#include "mlx/types/half_types.h"
#include "thread_pool.h"

namespace vllm_metal::cpu {

// Internal linkage, like every kernel-side helper: each kernel source is
// compiled once per instruction set into the same library.
namespace {

// fn(T{}) with T the storage type of `dtype`: float, float16_t or bfloat16_t.
template <typename F>
void with_storage_type(KernelDtype dtype, F&& fn) {
  switch (dtype) {
    case KernelDtype::float32:
      fn(float{});
      break;
    case KernelDtype::float16:
      fn(mlx::core::float16_t{});
      break;
    case KernelDtype::bfloat16:
      fn(mlx::core::bfloat16_t{});
      break;
  }
}

// fn(lo, hi) for consecutive ranges of `per_task` items covering [0, n), on
// the pool when there is more than one range.
template <typename F>
void for_ranges(int64_t n, int64_t per_task, F&& fn) {
  per_task = std::max<int64_t>(per_task, 1);
  const int64_t tasks = (n + per_task - 1) / per_task;
  auto task = [&](std::size_t t) {
    const int64_t lo = static_cast<int64_t>(t) * per_task;
    fn(lo, std::min(n, lo + per_task));
  };
  if (tasks == 1) {
    task(0);
  } else if (tasks > 1) {
    parallel_for(static_cast<std::size_t>(tasks), task);
  }
}

} // namespace

} // namespace vllm_metal::cpu
