// Decode kernel: one threadgroup per query row (token, head) and key
// partition, for the rows of sequences with few new tokens (decode,
// speculative decode; see is_prefill_row) and rows with invalid metadata.
// Its grid covers every row; threadgroups of prefill rows return at once.
//
// Each simdgroup walks every kDecodeSimdgroups-th visible key with one lane
// per head dimension (lane l holds dims l, l + 32, ...: DPL_K of q and the
// key, DPL_V of the value and the accumulator), keeping its own online
// softmax in float32; the simdgroups' states are merged at the end. With one
// partition the row is written to `out` (the sink folded in); otherwise this
// partition's unnormalised state (m, l, acc) goes to `partials` for the
// reduce kernel, which folds the sink in.
#pragma once

#include "paged_attention_common.h"

// DPL_K, DPL_V: key and value head dims per lane (of the head-dim tier).
template <typename T, int DPL_K, int DPL_V>
[[kernel]] void paged_attention_decode(
    constant vllm_metal::PagedAttentionArgs& args [[buffer(0)]],
    const device T* q [[buffer(1)]],
    const device T* k_cache [[buffer(2)]],
    const device T* v_cache [[buffer(3)]],
    const device int* block_tables [[buffer(4)]],
    const device int* seq_lens [[buffer(5)]],
    const device int* cu_seqlens_q [[buffer(6)]],
    device T* out [[buffer(7)]],
    device float* partials [[buffer(8)]],
    const device float* sinks [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace vllm_metal;
  constexpr int NSG = kDecodeSimdgroups;
  constexpr int W = kSimdWidth;
  threadgroup float sg_m[NSG];
  threadgroup float sg_l[NSG];
  threadgroup int sg_bad[NSG];
  threadgroup float sg_acc[NSG * W];

  const int head = tgid.x;
  const int token = tgid.y;
  const int part = tgid.z;
  const int D = args.head_dim;
  const int Dv = args.v_head_dim;
  const int kv_head = head / args.group;
  const TokenPlace place = locate_token(args, seq_lens, cu_seqlens_q, token);
  if (is_prefill_row(place)) {  // the same for the whole threadgroup
    return;
  }

  // Visible keys of this row, cut to this partition's absolute positions.
  int64_t key_lo = place.key_lo;
  int64_t key_hi = place.valid ? int64_t(place.pos) + 1 : 0;
  if (args.num_partitions > 1) {
    const int64_t part_lo = int64_t(part) * args.partition_size;
    const int64_t part_hi = part_lo + args.partition_size;
    key_lo = key_lo > part_lo ? key_lo : part_lo;
    key_hi = key_hi < part_hi ? key_hi : part_hi;
  }

  float qv[DPL_K];
  float acc[DPL_V];
  const int64_t q_row = int64_t(token) * args.q_strides[0] + int64_t(head) * args.q_strides[1];
  for (int i = 0; i < DPL_K; ++i) {
    const int d = i * W + int(lane);
    qv[i] = d < D ? load_float(q, q_row + d * args.q_strides[2]) : 0.0f;
  }
  for (int i = 0; i < DPL_V; ++i) {
    acc[i] = 0.0f;
  }
  float m = -INFINITY;
  float l = 0.0f;
  bool bad = !place.valid;

  for (int key = int(key_lo) + int(sg); key < int(key_hi); key += NSG) {
    const int block = physical_block(args, block_tables, place.seq, key);
    if (block < 0) {  // same key for every lane: uniform in the simdgroup
      bad = true;
      continue;
    }
    const int slot = key - (key / args.block_size) * args.block_size;
    const int64_t k_row = cache_row(args.k_strides, block, slot, kv_head);
    const int64_t v_row = cache_row(args.v_strides, block, slot, kv_head);
    float dot = 0.0f;
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      if (d < D) {
        dot += qv[i] * load_float(k_cache, k_row + d * args.k_strides[3]);
      }
    }
    const float s = finish_score(args, simd_sum(dot));
    const float m_new = max(m, s);
    const float alpha = exp(m - m_new);
    const float w = exp(s - m_new);
    l = l * alpha + w;
    for (int i = 0; i < DPL_V; ++i) {
      const int d = i * W + int(lane);
      const float v = d < Dv ? load_float(v_cache, v_row + d * args.v_strides[3]) : 0.0f;
      acc[i] = acc[i] * alpha + w * v;
    }
    m = m_new;
  }

  // Merge the simdgroups' states: a common max, then the rescaled sums.
  if (lane == 0) {
    sg_m[sg] = m;
    sg_l[sg] = l;
    sg_bad[sg] = bad ? 1 : 0;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float m_all = -INFINITY;
  int any_bad = 0;
  for (int j = 0; j < NSG; ++j) {
    m_all = max(m_all, sg_m[j]);
    any_bad |= sg_bad[j];
  }
  float l_all = 0.0f;
  for (int j = 0; j < NSG; ++j) {
    l_all += sg_l[j] * merge_weight(sg_m[j], m_all);
  }
  const float mine = merge_weight(m, m_all);
  const bool partitioned = args.num_partitions > 1;
  const int64_t row = int64_t(token) * args.num_heads + head;
  const int64_t part_row = (row * args.num_partitions + part) * int64_t(Dv + 2);
  const bool nan_row = any_bad != 0 || !(l_all > 0.0f);
  // The row's denominator with the sink (written rows only; partials keep
  // the bare state for the reduce kernel).
  float l_row = l_all;
  const float sink_factor = partitioned ? 1.0f : fold_sink(args, sinks, head, m_all, l_row);

  for (int i = 0; i < DPL_V; ++i) {
    sg_acc[sg * W + lane] = acc[i] * mine;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int d = i * W + int(lane);
    if (sg == 0 && d < Dv) {
      float sum = 0.0f;
      for (int j = 0; j < NSG; ++j) {
        sum += sg_acc[j * W + lane];
      }
      if (partitioned) {
        partials[part_row + 2 + d] = sum;
      } else {
        out[row * Dv + d] = static_cast<T>(nan_row ? NAN : sum * sink_factor / l_row);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (partitioned && sg == 0 && lane == 0) {
    // An empty partition stays (m = -inf, l = 0); a bad row carries l = NaN.
    partials[part_row] = m_all;
    partials[part_row + 1] = any_bad != 0 ? NAN : l_all;
  }
}
