// Interface between SwiGLU::eval_cpu and the CPU kernel variants (one per
// instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct SwigluArgs {
  KernelDtype dtype;
  const void* gate;  // rows of `width` contiguous elements, row r at gate + r * gate_stride
  const void* up;    // the same at up + r * up_stride
  void* out;         // row-contiguous: rows * width elements
  int64_t rows, width, gate_stride, up_stride;
};

void swiglu_generic(const SwigluArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void swiglu_avx2(const SwigluArgs& args);
void swiglu_avx512(const SwigluArgs& args);
#endif

} // namespace vllm_metal::cpu
