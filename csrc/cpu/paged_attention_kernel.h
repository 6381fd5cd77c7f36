// Interface between PagedAttention::eval_cpu and the CPU kernel variants
// (one per instruction set, same source compiled with different flags).
#pragma once

#include <cstdint>
#include <vector>

#include "paged_attention.h"

namespace vllm_metal::cpu {

// Sizes and element strides of the inputs, read once from the arrays.
struct Geometry {
  int num_tokens, num_heads, head_dim, v_head_dim;  // head_dim: q and keys
  int num_blocks, block_size, num_kv_heads, group;
  int num_seqs, max_blocks;
  int64_t q_st[3], k_st[4], v_st[4], bt_st[2];
};

enum class KernelDtype { float32, float16, bfloat16 };

// Everything one kernel call needs; the index data is already validated.
struct KernelArgs {
  KernelDtype dtype;
  const void* q;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  void* out;  // row-contiguous [num_tokens, num_heads, v_head_dim]
  const float* sinks;  // [num_heads] with stride sinks_stride, or nullptr
  int64_t sinks_stride;
  PagedAttentionParams params;
  Geometry geometry;
  std::vector<int> seq_lens;
  std::vector<int> cu_seqlens_q;
};

void paged_attention_generic(const KernelArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void paged_attention_avx2(const KernelArgs& args);  // AVX2 + FMA + F16C
void paged_attention_avx512(const KernelArgs& args);  // AVX-512 F/VL/BW/DQ + the above
#endif

} // namespace vllm_metal::cpu
