// Interface between ArgmaxHead::eval_cpu and the CPU kernel variants (one
// per instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

namespace vllm_metal::cpu {

struct ArgmaxHeadArgs {
  const float* hidden;  // [rows, dim], row-contiguous
  const float* weight;  // [vocab, dim], row-contiguous
  int32_t* out;  // [rows]
  int64_t rows;
  int64_t vocab;
  int64_t dim;
};

void argmax_head_generic(const ArgmaxHeadArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void argmax_head_avx2(const ArgmaxHeadArgs& args);
void argmax_head_avx512(const ArgmaxHeadArgs& args);
#endif

} // namespace vllm_metal::cpu
