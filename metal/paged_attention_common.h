// Pieces shared by the paged-attention kernels: finding a packed query token's
// sequence and position, block-table lookups, strided loads and the score.
//
// The GPU cannot raise, and the data-dependent checks of the CPU backend
// (block ids in range, seq_lens within capacity, cu_seqlens_q monotone) would
// need the metadata on the host before encoding. So every lookup here checks
// what it reads and reports failure instead of reading out of bounds; the
// kernels write NaN for every row whose metadata failed a check.
#pragma once

#include <metal_stdlib>

// Before our shared headers: they name int64_t the way MLX's kernels do,
// after this directive.
using namespace metal;

#include "paged_attention_params.h"
#include "paged_attention_tuning.h"

namespace vllm_metal {

// Where packed query token `t` sits. valid == false: the batch metadata does
// not describe t consistently, and nothing may be read on its behalf.
struct TokenPlace {
  int seq;
  int pos;         // absolute position of the token in its sequence
  int key_lo;      // first visible key: the token sees keys key_lo..key_hi - 1
  int key_hi;      // one past its last visible key (pos + 1 when causal)
  int len;         // its sequence's length (seq_lens)
  int new_tokens;  // query rows of its sequence in this batch
  bool valid;
};

inline int read_index(const device int* a, int64_t stride, int i) {
  return a[int64_t(i) * stride];
}

inline int visible_from(constant PagedAttentionArgs& args, int pos) {
  return args.sliding_window > 0 ? max(0, pos - args.sliding_window + 1) : 0;
}

// One past the last key a row at `pos` sees: its own position (causal), else
// its sequence's end `len` or the window's far side.
inline int visible_to(constant PagedAttentionArgs& args, int len, int pos) {
  if (args.causal != 0) {
    return pos + 1;
  }
  return args.sliding_window > 0 ? min(len, pos + args.sliding_window) : len;
}

inline TokenPlace locate_token(
    constant PagedAttentionArgs& args,
    const device int* seq_lens,
    const device int* cu_seqlens_q,
    int t) {
  TokenPlace place = {0, 0, 0, 0, 0, 0, false};
  if (args.num_seqs <= 0) {
    return place;
  }
  // The last s with cu_seqlens_q[s] <= t. Only meaningful for a monotone
  // cu_seqlens_q, so the result is verified below rather than trusted; every
  // index read stays within [0, num_seqs].
  const int64_t cu_stride = args.cu_seqlens_q_stride;
  int lo = 0;
  int hi = args.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (read_index(cu_seqlens_q, cu_stride, mid) <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int begin = read_index(cu_seqlens_q, cu_stride, lo);
  const int end = read_index(cu_seqlens_q, cu_stride, lo + 1);
  const int len = read_index(seq_lens, args.seq_lens_stride, lo);
  const int64_t capacity = int64_t(args.max_blocks_per_seq) * args.block_size;
  if (begin < 0 || t < begin || t >= end || end > args.num_tokens) {
    return place;
  }
  if (len < end - begin || int64_t(len) > capacity) {
    return place;
  }
  place.seq = lo;
  place.pos = len - (end - begin) + (t - begin);
  place.key_lo = visible_from(args, place.pos);
  place.key_hi = visible_to(args, len, place.pos);
  place.len = len;
  place.new_tokens = end - begin;
  place.valid = true;
  return place;
}

// Which kernel owns a query row, decided per row from the metadata so that
// one batch can mix both: rows of sequences with at least
// kPrefillMinTokensPerSeq new tokens belong to the prefill kernel; all other
// rows, including those with invalid metadata (written as NaN), to decode.
// Every row is written by exactly one of them.
inline bool is_prefill_row(TokenPlace place) {
  return place.valid && place.new_tokens >= kPrefillMinTokensPerSeq;
}

// The decode threadgroup (by its token, grid y) that computes token `t`
// (`place`: locate_token's for t) when each computes up to `tokens`
// consecutive tokens of one sequence (the verify regime): the one at the
// sequence's new token j - j % tokens (j: t's index among them), if that
// token's own lookup puts it in the same sequence at the matching position;
// else, and with invalid metadata or one token per threadgroup, t's own.
// Every threadgroup evaluates this the same way for the same token, so each
// row is written by exactly one of them, whatever the metadata.
inline int decode_owner(
    constant PagedAttentionArgs& args,
    const device int* seq_lens,
    const device int* cu_seqlens_q,
    int t,
    TokenPlace place,
    int tokens) {
  if (tokens <= 1 || !place.valid) {
    return t;
  }
  const int j = place.pos - (place.len - place.new_tokens);
  const int c = t - j % tokens;
  if (c == t) {
    return t;
  }
  const TokenPlace lead = locate_token(args, seq_lens, cu_seqlens_q, c);
  return (lead.valid && lead.seq == place.seq && lead.pos == place.pos - (t - c)) ? c : t;
}

// Cache block holding key position `key` of sequence `seq`, or -1 when the
// block table names a block outside the cache. Callers pass only keys below
// a validated seq_len, so the table index is within max_blocks_per_seq.
inline int physical_block(
    constant PagedAttentionArgs& args,
    const device int* block_tables,
    int seq,
    int key) {
  const int b = key / args.block_size;
  const int id = block_tables
      [int64_t(seq) * args.block_table_strides[0] +
       int64_t(b) * args.block_table_strides[1]];
  return (id >= 0 && id < args.num_blocks) ? id : -1;
}

// Element offset of (block, slot, kv_head, dim 0) in a cache with `strides`.
inline int64_t cache_row(constant int64_t* strides, int block, int slot, int kv_head) {
  return int64_t(block) * strides[0] + int64_t(slot) * strides[1] +
      int64_t(kv_head) * strides[2];
}

template <typename T>
inline float load_float(const device T* base, int64_t offset) {
  return static_cast<float>(base[offset]);
}

// 8-bit float cache elements (PagedAttentionParams::cache_format), decoded
// exactly as the CPU backend decodes them (csrc/cpu/convert.h).
struct fp8_e4m3 {
  uchar bits;
};
struct fp8_e5m2 {
  uchar bits;
};

// OCP FP8 E4M3 "fn": 2^(e-7) * (1 + m/8), subnormals m * 2^-9, S.1111.111 NaN.
inline float load_float(const device fp8_e4m3* base, int64_t offset) {
  const uint b = base[offset].bits;
  const uint e = (b >> 3) & 15u, m = b & 7u;
  float v = e == 0u ? float(m) * 0.001953125f : ldexp(1.0f + float(m) * 0.125f, int(e) - 7);
  v = (e == 15u && m == 7u) ? NAN : v;
  return (b & 0x80u) != 0u ? -v : v;
}

// E4M3 codes of a row followed by the row's float32 scale (cache_format 3,
// vLLM's fp8_per_token_head).
struct fp8_e4m3_row {
  uchar bits;
};

// E5M2 (the top byte of a float16): 2^(e-15) * (1 + m/4), subnormals
// m * 2^-16, exponent 31 infinity (m = 0) or NaN.
inline float load_float(const device fp8_e5m2* base, int64_t offset) {
  const uint b = base[offset].bits;
  const uint e = (b >> 2) & 31u, m = b & 3u;
  float v = e == 0u ? float(m) * 0.0000152587890625f : ldexp(1.0f + float(m) * 0.25f, int(e) - 15);
  v = e == 31u ? (m == 0u ? INFINITY : NAN) : v;
  return (b & 0x80u) != 0u ? -v : v;
}

// Element d of the cache row at element offset `row` (elements `stride`
// apart; n: the row's values), as a float.
template <typename C>
inline float load_cache(const device C* base, int64_t row, int d, int64_t stride, int n) {
  return load_float(base, row + d * stride);
}

// A row with its own scale: the E4M3 code times the float32 after the n codes.
inline float load_cache(const device fp8_e4m3_row* base, int64_t row, int d, int64_t stride, int n) {
  const device fp8_e4m3* codes = reinterpret_cast<const device fp8_e4m3*>(base);
  uint bits = 0u;
  for (int i = 0; i < 4; ++i) {
    bits |= uint(base[row + (n + i) * stride].bits) << (8 * i);
  }
  return load_float(codes, row + d * stride) * as_type<float>(bits);
}

// q.k -> the logit the softmax sees, in the CPU backend's order: scale, then
// the optional tanh soft cap.
inline float finish_score(constant PagedAttentionArgs& args, float dot) {
  float x = dot * args.scale;
  if (args.softcap > 0.0f) {
    x = args.softcap * tanh(x / args.softcap);
  }
  return x;
}

// Weight of a softmax state with running max m inside a merge whose max is
// m_all. An empty state (m = -inf) weighs 0, also when m_all is -inf
// (exp(-inf - -inf) would be NaN).
inline float merge_weight(float m, float m_all) {
  return m == -INFINITY ? 0.0f : exp(m - m_all);
}

// Folds the attention sink of `head` into a row's finished softmax state
// (m, l): one more logit, sinks[head] (neither scaled nor soft-capped), in
// the denominator, with no value. Returns the factor for the accumulator: the
// row is then acc * factor / l. Without sinks: 1, l unchanged. Every kernel
// calls it once per row, when it writes the row (the reduce kernel, not the
// partitions, in partitioned decode), so the sink is counted once.
inline float fold_sink(
    constant PagedAttentionArgs& args,
    const device float* sinks,
    int head,
    float m,
    thread float& l) {
  if (args.has_sinks == 0) {
    return 1.0f;
  }
  const float sink = sinks[int64_t(head) * args.sinks_stride];
  const float m_all = max(m, sink);
  const float factor = merge_weight(m, m_all);
  l = l * factor + exp(sink - m_all);
  return factor;
}

} // namespace vllm_metal
