// The Metal library of the KV-cache write (RopeWriteKV with a table of no
// pairs: vllm_metal.native.kv_writes.write_kv(..., in_place=True) on a GPU
// stream). Token t's rows k[t, h, :] and v[t, h, :] are copied into
// key_cache / value_cache[slot / block_size, slot % block_size, h, :] for
// slot = slots[t] in [0, num_blocks * block_size); any other slot (-1: the
// token writes nothing) is skipped. Values are copied exactly.
//
// One thread per element of a token's row: thread_position_in_grid.x is the
// element e = h * head_dim + d, .y the token (grid in write_kv_plan.h). The
// caches are row-contiguous, so a slot's row starts at slot * row. The cache
// buffers are the outputs; with in_place they are the input caches' own
// buffers, and the kernel touches nothing but the rows of the step's slots
// (two tokens never share a slot in a vLLM step; if they did, the last
// writer would be unspecified, as with MLX's scatter).
//
// The build embeds this file, with its quoted includes inlined, into the
// extension (cmake/embed_metal_source.cmake) as kWriteKVMetalSource; MLX
// compiles it once per process at first use. Keep it ASCII.
#include <metal_stdlib>

using namespace metal;

#include "write_kv_params.h"

template <typename T>
[[kernel]] void write_kv(
    constant vllm_metal::WriteKVArgs& args [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device int* slots [[buffer(3)]],
    device T* key_cache [[buffer(4)]],
    device T* value_cache [[buffer(5)]],
    uint3 pos [[thread_position_in_grid]]) {
  const int e = int(pos.x);
  const int t = int(pos.y);
  if (e >= args.row || t >= args.tokens) {  // the last threadgroup's surplus threads
    return;
  }
  const int slot = slots[t];
  if (slot < 0 || int64_t(slot) >= args.num_slots) {
    return;
  }
  const int h = e / args.head_dim;
  const int d = e - h * args.head_dim;
  const int64_t dst = int64_t(slot) * args.row + e;
  key_cache[dst] = k[int64_t(t) * args.k_strides[0] + int64_t(h) * args.k_strides[1] +
                     int64_t(d) * args.k_strides[2]];
  value_cache[dst] = v[int64_t(t) * args.v_strides[0] + int64_t(h) * args.v_strides[1] +
                       int64_t(d) * args.v_strides[2]];
}

#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// Names: write_kv_<dtype>, built the same way by vllm_metal::write_kv_kernel_name
// in write_kv_plan.h. (8-bit caches keep MLX's scatter: kv_writes.write_kv.)
instantiate_kernel("write_kv_float32", write_kv, float)
instantiate_kernel("write_kv_float16", write_kv, half)
instantiate_kernel("write_kv_bfloat16", write_kv, bfloat)
