// Prefill kernel: one threadgroup per tile of kPrefillTokensPerTile
// consecutive packed tokens and one query head, for the rows of sequences
// with many new tokens (see is_prefill_row; the decode kernel writes all other
// rows). K and V of a tile of keys are staged once in threadgroup memory (as
// float32) and used by every token of the tile, instead of every token
// reading the cache on its own.
//
// A tile of packed tokens may straddle sequences; it is processed as its
// segments (runs of tokens of one sequence), one after another, skipping
// segments that belong to the decode kernel. Each simdgroup owns R tokens and
// keeps their online softmax states in registers, one lane per head dimension
// as in decode. The tier's sizes (dims per lane, simdgroups, rows, keys per
// staged tile) are template arguments: see paged_attention.metal.
#pragma once

#include "paged_attention_common.h"

// DPL_K, DPL_V: key and value head dims per lane; NSG simdgroups of R rows
// each (NSG * R = kPrefillTokensPerTile); KT keys staged per tile; C: what
// the caches hold (T, or an 8-bit float: paged_attention_common.h).
template <typename T, int DPL_K, int DPL_V, int NSG, int R, int KT, typename C = T>
[[kernel]] void paged_attention_prefill(
    constant vllm_metal::PagedAttentionArgs& args [[buffer(0)]],
    const device T* q [[buffer(1)]],
    const device C* k_cache [[buffer(2)]],
    const device C* v_cache [[buffer(3)]],
    const device int* block_tables [[buffer(4)]],
    const device int* seq_lens [[buffer(5)]],
    const device int* cu_seqlens_q [[buffer(6)]],
    device T* out [[buffer(7)]],
    const device float* sinks [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace vllm_metal;
  constexpr int W = kSimdWidth;
  constexpr int DTK = DPL_K * W;  // floats per staged key row
  constexpr int DTV = DPL_V * W;  // floats per staged value row
  constexpr int NT = NSG * W;     // threads per threadgroup
  static_assert(KT >= 1 && KT <= NT, "one thread looks up each tile key's block");
  static_assert(NSG * R == kPrefillTokensPerTile, "the host plans tiles of this many tokens");
  static_assert(DTV <= DTK, "values are staged alongside keys");
  threadgroup float k_tile[KT * DTK];
  threadgroup float v_tile[KT * DTV];
  threadgroup int tile_blocks[KT];  // cache block of each tile key, -1: none

  const int head = tgid.y;
  const int D = args.head_dim;
  const int Dv = args.v_head_dim;
  const int kv_head = head / args.group;
  const int t0 = int(tgid.x) * kPrefillTokensPerTile;
  const int t_end = min(t0 + int(kPrefillTokensPerTile), args.num_tokens);
  const int row0 = t0 + int(sg) * R;  // first token owned by this simdgroup

  float qv[R][DPL_K];
  float acc[R][DPL_V];
  float m[R];
  float l[R];
  bool seen[R];  // the row is this kernel's: it belongs to a prefill segment
  bool bad[R];   // the row needed a block id outside the cache
  for (int r = 0; r < R; ++r) {
    const int t = row0 + r;
    const int64_t q_row = int64_t(t) * args.q_strides[0] + int64_t(head) * args.q_strides[1];
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      qv[r][i] = (t < t_end && d < D) ? load_float(q, q_row + d * args.q_strides[2]) : 0.0f;
    }
    for (int i = 0; i < DPL_V; ++i) {
      acc[r][i] = 0.0f;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
    seen[r] = false;
    bad[r] = false;
  }

  // Every thread walks the same segments (it reads the same metadata), so
  // the barriers below are reached uniformly.
  int t = t0;
  while (t < t_end) {
    const TokenPlace first = locate_token(args, seq_lens, cu_seqlens_q, t);
    if (!first.valid) {
      ++t;  // the decode kernel writes NaN for it
      continue;
    }
    const int seg_end =
        min(read_index(cu_seqlens_q, args.cu_seqlens_q_stride, first.seq + 1), t_end);
    if (!is_prefill_row(first)) {
      t = seg_end;  // a short sequence: the decode kernel's
      continue;
    }
    // Positions grow by one per token, so the segment sees keys from its
    // first token's window start up to its last token's last visible key.
    const int key_lo = first.key_lo;
    const int key_hi = visible_to(args, first.len, first.pos + (seg_end - t) - 1);

    for (int kb = key_lo; kb < key_hi; kb += KT) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // last tile consumed
      if (int(tid) < KT) {
        const int key = kb + int(tid);
        tile_blocks[tid] =
            key < key_hi ? physical_block(args, block_tables, first.seq, key) : -1;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // One pass over the key rows; a value row is staged with the first
      // DTV elements of its key row.
      for (int e = int(tid); e < KT * DTK; e += NT) {
        const int j = e / DTK;
        const int d = e - j * DTK;
        const int block = tile_blocks[j];
        float kx = 0.0f;
        float vx = 0.0f;
        if (block >= 0 && (d < D || d < Dv)) {
          const int key = kb + j;
          const int slot = key - (key / args.block_size) * args.block_size;
          if (d < D) {
            kx = load_cache(k_cache, cache_row(args.k_strides, block, slot, kv_head), d,
                            args.k_strides[3], D);
          }
          if (d < Dv) {
            vx = load_cache(v_cache, cache_row(args.v_strides, block, slot, kv_head), d,
                            args.v_strides[3], Dv);
          }
        }
        k_tile[e] = kx;
        if (d < DTV) {
          v_tile[j * DTV + d] = vx;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      for (int r = 0; r < R; ++r) {
        const int tr = row0 + r;
        if (tr < t || tr >= seg_end) {  // uniform in the simdgroup
          continue;
        }
        const int pos = first.pos + (tr - t);
        const int lo = max(kb, visible_from(args, pos));
        const int hi = min(kb + KT, visible_to(args, first.len, pos));
        for (int key = lo; key < hi; ++key) {
          const int j = key - kb;
          if (tile_blocks[j] < 0) {
            bad[r] = true;
            continue;
          }
          float dot = 0.0f;
          for (int i = 0; i < DPL_K; ++i) {
            dot += qv[r][i] * k_tile[j * DTK + i * W + int(lane)];
          }
          const float s = finish_score(args, simd_sum(dot));
          const float m_new = max(m[r], s);
          const float alpha = exp(m[r] - m_new);
          const float w = exp(s - m_new);
          l[r] = l[r] * alpha + w;
          for (int i = 0; i < DPL_V; ++i) {
            acc[r][i] = acc[r][i] * alpha + w * v_tile[j * DTV + i * W + int(lane)];
          }
          m[r] = m_new;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int tr = row0 + r;
      seen[r] = seen[r] || (tr >= t && tr < seg_end);
    }
    t = seg_end;
  }

  for (int r = 0; r < R; ++r) {
    const int tr = row0 + r;
    if (tr >= t_end || !seen[r]) {
      continue;
    }
    const bool nan_row = bad[r] || !(l[r] > 0.0f);
    const int64_t o_row = (int64_t(tr) * args.num_heads + head) * Dv;
    float l_row = l[r];
    const float sink_factor = fold_sink(args, sinks, head, m[r], l_row);
    for (int i = 0; i < DPL_V; ++i) {
      const int d = i * W + int(lane);
      if (d < Dv) {
        out[o_row + d] = static_cast<T>(nan_row ? NAN : acc[r][i] * sink_factor / l_row);
      }
    }
  }
}
