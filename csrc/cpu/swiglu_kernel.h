// Interface between SwiGLU::eval_cpu and the CPU kernel variants (one per
// instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct SwigluArgs {
  KernelDtype dtype;
  const void* gate;  // row-contiguous, n elements
  const void* up;
  void* out;
  int64_t n;
};

void swiglu_generic(const SwigluArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void swiglu_avx2(const SwigluArgs& args);
void swiglu_avx512(const SwigluArgs& args);
#endif

} // namespace vllm_metal::cpu
