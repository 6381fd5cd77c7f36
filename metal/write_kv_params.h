// The arguments of the KV-cache write kernel (metal/write_kv.metal): one
// struct shared by the host (RopeWriteKV::eval_gpu fills it and passes it
// with set_bytes) and the kernel. Compiled both as host C++ and as MSL, so
// it uses only what both accept.
#pragma once

#ifndef __METAL_VERSION__
#include <cstdint>
#endif

namespace vllm_metal {

// Buffer slots (the kernel spells them as literals in [[buffer(n)]]).
enum WriteKVBuffer : int {
  kWkvArgsBuffer = 0,
  kWkvKBuffer = 1,           // [tokens, heads, dim] T, any strides (k_strides)
  kWkvVBuffer = 2,           // [tokens, heads, dim] T, any strides (v_strides)
  kWkvSlotsBuffer = 3,       // int32 [tokens], contiguous: block * block_size + offset
  kWkvKeyCacheBuffer = 4,    // [num_blocks, block_size, heads, dim] T, row-contiguous
  kWkvValueCacheBuffer = 5,  // the same shape; the caches may be the inputs' buffers (in place)
};

// 8-byte members first, then an even number of 4-byte members, so host C++
// and MSL lay the struct out identically (checked below).
struct WriteKVArgs {
  int64_t k_strides[3];  // element strides of k (MLX hands the primitive arbitrary views)
  int64_t v_strides[3];
  int64_t num_slots;     // num_blocks * block_size: slots outside [0, num_slots) write nothing
  int tokens;
  int heads;             // kv heads
  int head_dim;
  int row;               // heads * head_dim: the elements of one token's (and one slot's) row
};

static_assert(sizeof(WriteKVArgs) == 7 * 8 + 4 * 4, "WriteKVArgs must have no padding");

} // namespace vllm_metal
