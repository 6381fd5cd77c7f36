// Interface between RMSNorm::eval_cpu and the CPU kernel variants (one per
// instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct RmsNormArgs {
  KernelDtype dtype;
  const void* x;  // [rows, dim], row-contiguous
  const void* weight;  // [dim]
  void* out;  // [rows, dim]
  int64_t rows;
  int dim;
  float eps;
  bool layer = false;  // LayerNorm: (x - mean) / sqrt(var + eps) * weight [+ bias]
  const void* bias = nullptr;  // [dim] or null (LayerNorm only)
};

void rms_norm_generic(const RmsNormArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void rms_norm_avx2(const RmsNormArgs& args);
void rms_norm_avx512(const RmsNormArgs& args);
#endif

} // namespace vllm_metal::cpu
