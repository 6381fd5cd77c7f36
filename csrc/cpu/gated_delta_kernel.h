// Interface between GatedDelta::eval_cpu and the CPU kernel variants (one
// per instruction set, same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

// Row-contiguous arrays (see csrc/gated_delta.h for shapes and meaning).
struct GatedDeltaKernelArgs {
  KernelDtype dtype;  // of q, k, v and y
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const float* state_in;
  const bool* mask;  // nullptr: every step is real
  void* y;
  float* state_out;  // may equal state_in
  int batch, steps, k_heads, v_heads, key_dim, value_dim;
};

void gated_delta_generic(const GatedDeltaKernelArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void gated_delta_avx2(const GatedDeltaKernelArgs& args);  // AVX2 + FMA + F16C
#endif

} // namespace vllm_metal::cpu
