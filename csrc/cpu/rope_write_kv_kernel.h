// Interface between RopeWriteKV::eval_cpu and the CPU kernel variants (one
// per instruction set, the same source compiled with different flags).
#pragma once

#include <cstdint>

#include "cpu/paged_attention_kernel.h"  // KernelDtype

namespace vllm_metal::cpu {

struct RopeWriteKvArgs {
  KernelDtype dtype;  // of q, k, v, the output and the caches
  // q [tokens, heads, dim], k and v [tokens, kv_heads, dim] in any layout:
  // element (t, h, i) at x + t * st[0] + h * st[1] + i * st[2].
  const void* q;
  const void* k;
  const void* v;
  int64_t q_st[3], k_st[3], v_st[3];
  const float* table;  // [tokens, rotated / 2, 2]: (cos, sin) of each pair
  const int32_t* slots;  // [tokens]: a token's cache slot; outside [0, num_slots): no write
  void* q_out;  // [tokens, heads, dim], row-contiguous
  void* key_cache;  // [num_slots, kv_heads, dim], row-contiguous (written in place)
  void* value_cache;
  int64_t tokens;
  int64_t num_slots;
  int heads;
  int kv_heads;
  int dim;
  int rotated;  // leading dims rotated (even, <= dim); the rest are copied
  bool traditional;  // pairs (2i, 2i + 1) instead of (i, i + rotated / 2)
};

void rope_write_kv_generic(const RopeWriteKvArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
void rope_write_kv_avx2(const RopeWriteKvArgs& args);
void rope_write_kv_avx512(const RopeWriteKvArgs& args);
#endif

} // namespace vllm_metal::cpu
