// The CPU kernel of RoPE + KV-cache write, compiled once per instruction set:
// per token, its query heads rotated into the output, its key heads rotated
// and its value heads copied into the token's cache slot (no slot: nothing
// written). The rotation is the RoPE kernel's (rope_rotate.h: the same
// float32 arithmetic, one rounding to the storage dtype), values are copied
// exactly. q, k and v are read where they lie (strided views of a fused
// projection's output need no copy). Token ranges are split over the
// kernels' thread pool; tokens with the same slot (vLLM never schedules
// two) would race, as with MLX's own scatter.
#include <algorithm>

#include "cpu/convert.h"
#include "cpu/dispatch.h"
#include "cpu/rope_rotate.h"
#include "cpu/rope_write_kv_kernel.h"

#ifndef VLLM_METAL_KERNEL_ENTRY
#error "compile with -DVLLM_METAL_KERNEL_ENTRY=<entry point name>"
#endif

namespace vllm_metal::cpu {

namespace {

constexpr int64_t kChunkElements = 32768;  // per task

template <typename T>
void tokens_range(const RopeWriteKvArgs& a, int64_t lo, int64_t hi) {
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* q_out = static_cast<T*>(a.q_out);
  T* kc = static_cast<T*>(a.key_cache);
  T* vc = static_cast<T*>(a.value_cache);
  const int d = a.dim, half = a.rotated / 2;
  float* row = scaled_row_buffer(2 * d + 2 * half);
  float* y = row + d;
  float* c = y + d;
  float* s = c + half;
  for (int64_t t = lo; t < hi; ++t) {
    split_pairs(a.table + t * half * 2, half, c, s);
    for (int h = 0; h < a.heads; ++h) {
      load_row(q + t * a.q_st[0] + h * a.q_st[1], a.q_st[2], d, row);
      rotate_row(row, c, s, d, a.rotated, a.traditional, y);
      store_row(y, d, q_out + (t * a.heads + h) * d);
    }
    const int64_t slot = a.slots[t];
    if (slot < 0 || slot >= a.num_slots) {
      continue;
    }
    for (int h = 0; h < a.kv_heads; ++h) {
      const int64_t dst = (slot * a.kv_heads + h) * d;
      load_row(k + t * a.k_st[0] + h * a.k_st[1], a.k_st[2], d, row);
      rotate_row(row, c, s, d, a.rotated, a.traditional, y);
      store_row(y, d, kc + dst);
      const T* src = v + t * a.v_st[0] + h * a.v_st[1];
      if (a.v_st[2] == 1) {
        std::copy(src, src + d, vc + dst);
      } else {
        for (int i = 0; i < d; ++i) {
          vc[dst + i] = src[i * a.v_st[2]];
        }
      }
    }
  }
}

template <typename T>
void run(const RopeWriteKvArgs& a) {
  const int64_t per_token = std::max<int64_t>(static_cast<int64_t>(a.heads + 2 * a.kv_heads) * a.dim, 1);
  for_ranges(a.tokens, kChunkElements / per_token, [&](int64_t lo, int64_t hi) { tokens_range<T>(a, lo, hi); });
}

} // namespace

void VLLM_METAL_KERNEL_ENTRY(const RopeWriteKvArgs& args) {
  with_storage_type(args.dtype, [&](auto tag) { run<decltype(tag)>(args); });
}

} // namespace vllm_metal::cpu
