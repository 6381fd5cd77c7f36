// Interface between RoPE::eval_cpu and the CPU kernel variants (one per
// instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct RopeArgs {
  KernelDtype dtype;
  const void* x;  // [tokens, heads, dim], row-contiguous
  const float* table;  // [tokens, rotated / 2, 2]: (cos, sin) of each pair, any scale folded in
  void* out;  // like x
  int64_t tokens;
  int heads;
  int dim;
  int rotated;  // leading dims rotated (even, <= dim); the rest are copied
  bool traditional;  // pairs (2i, 2i + 1) instead of (i, i + rotated / 2)
};

void rope_generic(const RopeArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void rope_avx2(const RopeArgs& args);
void rope_avx512(const RopeArgs& args);
#endif

} // namespace vllm_metal::cpu
