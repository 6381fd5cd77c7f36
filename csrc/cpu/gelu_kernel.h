// Interface between GELU::eval_cpu and the CPU kernel variants (one per
// instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct GeluArgs {
  KernelDtype dtype;
  const void* x;  // row-contiguous, n elements
  void* out;
  int64_t n;
  bool approximate;  // the tanh form
};

void gelu_generic(const GeluArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void gelu_avx2(const GeluArgs& args);
void gelu_avx512(const GeluArgs& args);
#endif

} // namespace vllm_metal::cpu
