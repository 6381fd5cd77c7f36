// The arguments of the paged-attention Metal kernels: one struct, shared by the
// host (which fills it and passes it with set_bytes) and the kernels (which
// read it from the constant address space). This header is compiled both as
// host C++ and as Metal Shading Language, so it uses only what both accept.
#pragma once

#ifndef __METAL_VERSION__
#include <cstdint>
#endif
// (In MSL, paged_attention_common.h includes this after <metal_stdlib>.)

namespace vllm_metal {

// Buffer slots. The kernels spell these numbers as literals in their
// [[buffer(n)]] attributes (MSL wants them there); the host binds by name, and
// the executor tests bind by name too, so a mismatch fails those tests.
enum PagedAttentionBuffer : int {
  kArgsBuffer = 0,
  kQBuffer = 1,
  kKeyCacheBuffer = 2,
  kValueCacheBuffer = 3,
  kBlockTablesBuffer = 4,
  kSeqLensBuffer = 5,
  kCuSeqlensQBuffer = 6,
  kOutBuffer = 7,
  kPartialsBuffer = 8,
  kSinksBuffer = 9,  // float32 [num_heads]; q sits in the slot when has_sinks == 0
};

// 8-byte members first and 4-byte members after, an even number of them, so
// host C++ and MSL lay the struct out identically (checked below).
struct PagedAttentionArgs {
  // Element strides of the inputs: MLX hands the primitive arbitrary views
  // (their layout is known only at eval), and copying them to contiguous
  // temporaries would need encoder temporaries, which we never use.
  int64_t q_strides[3];
  int64_t k_strides[4];
  int64_t v_strides[4];
  int64_t block_table_strides[2];
  int64_t seq_lens_stride;
  int64_t cu_seqlens_q_stride;
  int64_t sinks_stride;

  int num_tokens;
  int num_heads;
  int head_dim;    // q and key rows
  int v_head_dim;  // values read from each value row (its first ones); out's last axis
  int num_kv_heads;
  int group;  // num_heads / num_kv_heads (GQA)
  int num_seqs;
  int num_blocks;
  int block_size;
  int max_blocks_per_seq;
  // Decode only: key partitions per query row and keys per partition. With
  // one partition the decode kernel writes the output itself.
  int num_partitions;
  int partition_size;
  int sliding_window;  // <= 0: off
  float scale;
  float softcap;  // <= 0: off
  int has_sinks;  // 1: sinks[head] joins each row's softmax denominator
  // Decode only: decode_chunks threadgroups per KV head (and token) share
  // its `group` query heads, chunk c taking heads [c * group / decode_chunks,
  // (c + 1) * group / decode_chunks) of the group: decode_heads or one fewer
  // (decode_heads: the most, 1 for the per-head kernel).
  int decode_heads;
  int decode_chunks;
  int causal;    // 1: keys up to the row's position; 0: the whole sequence (encoders)
  // Decode only: the most consecutive tokens of one sequence a threadgroup
  // computes (1 .. kDecodeMaxTokens; > 1: the verify regime), with
  // decode_tokens x decode_heads <= the kernel's rows.
  int decode_tokens;
};

static_assert(sizeof(PagedAttentionArgs) == 16 * 8 + 20 * 4,
              "PagedAttentionArgs must have no padding (host/MSL layout)");

} // namespace vllm_metal
