// Decode kernel: one threadgroup per (token, chunk of the query heads of one
// KV head) and key partition, for the rows of sequences with few new tokens
// (decode, speculative decode; see is_prefill_row) and rows with invalid
// metadata. Its grid covers every row; threadgroups of prefill rows return at
// once.
//
// Grid: x = KV head * decode_chunks + chunk, y = token, z = partition. The
// chunk holds up to decode_heads (<= HG) consecutive query heads of the KV
// head's GQA group (see PagedAttentionArgs); HG == 1 is the per-head kernel
// (x = query head). The host's plan (paged_attention_plan.h) picks HG,
// the chunks and the simdgroup count from the shape-class table
// (paged_attention_tuning.h).
//
// Each simdgroup walks every n-th visible key (n simdgroups) with one lane per
// head dimension (lane l holds dims l, l + 32, ...: DPL_K of q and the key,
// DPL_V of the value and the accumulator). It loads each key and value row
// once and uses it for every head of the chunk, keeping each head's online
// softmax in float32; the simdgroups' states are merged per head at the end.
// With one partition the rows are written to `out` (the sink folded in);
// otherwise this partition's unnormalised state (m, l, acc) of each row goes
// to `partials` (per query row, as the reduce kernel reads them), and the
// reduce kernel folds the sink in.
#pragma once

#include "paged_attention_common.h"

// DPL_K, DPL_V: key and value head dims per lane (of the head-dim tier);
// HG: the most query heads per threadgroup (registers are sized for it);
// C: what the caches hold (T, or an 8-bit float: paged_attention_common.h).
template <typename T, int DPL_K, int DPL_V, int HG, typename C = T>
[[kernel]] void paged_attention_decode(
    constant vllm_metal::PagedAttentionArgs& args [[buffer(0)]],
    const device T* q [[buffer(1)]],
    const device C* k_cache [[buffer(2)]],
    const device C* v_cache [[buffer(3)]],
    const device int* block_tables [[buffer(4)]],
    const device int* seq_lens [[buffer(5)]],
    const device int* cu_seqlens_q [[buffer(6)]],
    device T* out [[buffer(7)]],
    device float* partials [[buffer(8)]],
    const device float* sinks [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint simdgroups [[simdgroups_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace vllm_metal;
  constexpr int MAX_NSG = kDecodeMaxSimdgroups;
  constexpr int W = kSimdWidth;
  static_assert(HG >= 1, "HG: at least one head");
  threadgroup float sg_m[MAX_NSG * HG];  // [simdgroup][head]
  threadgroup float sg_l[MAX_NSG * HG];
  threadgroup int sg_bad[MAX_NSG];
  threadgroup float sg_acc[HG * MAX_NSG * W];  // [head][simdgroup][lane]

  // The host launches 1..MAX_NSG simdgroups (the plan checks it).
  const int nsg = min(int(simdgroups), int(MAX_NSG));
  const int kv_head = int(tgid.x) / args.decode_chunks;
  const int chunk = int(tgid.x) - kv_head * args.decode_chunks;
  const int first = chunk * args.group / args.decode_chunks;  // within the group
  // 1..HG heads: the plan makes decode_chunks <= group, with at most HG each.
  const int nh = min((chunk + 1) * args.group / args.decode_chunks - first, HG);
  const int head0 = kv_head * args.group + first;  // query head of the chunk's head 0
  const int token = tgid.y;
  const int part = tgid.z;
  const int D = args.head_dim;
  const int Dv = args.v_head_dim;
  const TokenPlace place = locate_token(args, seq_lens, cu_seqlens_q, token);
  if (is_prefill_row(place)) {  // the same for the whole threadgroup
    return;
  }

  // Visible keys of this token, cut to this partition's absolute positions.
  int64_t key_lo = place.key_lo;
  int64_t key_hi = place.valid ? int64_t(place.key_hi) : 0;
  if (args.num_partitions > 1) {
    const int64_t part_lo = int64_t(part) * args.partition_size;
    const int64_t part_hi = part_lo + args.partition_size;
    key_lo = key_lo > part_lo ? key_lo : part_lo;
    key_hi = key_hi < part_hi ? key_hi : part_hi;
  }

  // Per head h < nh of the chunk (h >= nh: idle slots, uniform in the
  // threadgroup, never read or written).
  float qv[HG][DPL_K];
  float acc[HG][DPL_V];
  float m[HG];
  float l[HG];
  for (int h = 0; h < HG; ++h) {
    const int64_t q_row =
        int64_t(token) * args.q_strides[0] + int64_t(head0 + h) * args.q_strides[1];
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      qv[h][i] = (h < nh && d < D) ? load_float(q, q_row + d * args.q_strides[2]) : 0.0f;
    }
    for (int i = 0; i < DPL_V; ++i) {
      acc[h][i] = 0.0f;
    }
    m[h] = -INFINITY;
    l[h] = 0.0f;
  }
  bool bad = !place.valid;

  for (int key = int(key_lo) + int(sg); key < int(key_hi); key += nsg) {
    const int block = physical_block(args, block_tables, place.seq, key);
    if (block < 0) {  // same key for every lane: uniform in the simdgroup
      bad = true;
      continue;
    }
    const int slot = key - (key / args.block_size) * args.block_size;
    const int64_t k_row = cache_row(args.k_strides, block, slot, kv_head);
    const int64_t v_row = cache_row(args.v_strides, block, slot, kv_head);
    float kx[DPL_K];  // the key row's slice, loaded once for every head
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      kx[i] = d < D ? load_cache(k_cache, k_row, d, args.k_strides[3], D) : 0.0f;
    }
    float vx[DPL_V];  // the value row's slice, likewise
    for (int i = 0; i < DPL_V; ++i) {
      const int d = i * W + int(lane);
      vx[i] = d < Dv ? load_cache(v_cache, v_row, d, args.v_strides[3], Dv) : 0.0f;
    }
    for (int h = 0; h < HG; ++h) {
      if (h >= nh) {  // uniform in the threadgroup
        break;
      }
      float dot = 0.0f;
      for (int i = 0; i < DPL_K; ++i) {
        dot += qv[h][i] * kx[i];
      }
      const float s = finish_score(args, simd_sum(dot));
      const float m_new = max(m[h], s);
      const float alpha = exp(m[h] - m_new);
      const float w = exp(s - m_new);
      l[h] = l[h] * alpha + w;
      for (int i = 0; i < DPL_V; ++i) {
        acc[h][i] = acc[h][i] * alpha + w * vx[i];
      }
      m[h] = m_new;
    }
  }

  // Merge the simdgroups' states per head: a common max, then the rescaled
  // sums. Bad blocks poison every head of the token alike (they are the
  // same keys).
  if (lane == 0) {
    for (int h = 0; h < HG; ++h) {
      sg_m[int(sg) * HG + h] = m[h];
      sg_l[int(sg) * HG + h] = l[h];
    }
    sg_bad[sg] = bad ? 1 : 0;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int any_bad = 0;
  for (int j = 0; j < nsg; ++j) {
    any_bad |= sg_bad[j];
  }
  float m_all[HG];
  float l_all[HG];
  float mine[HG];
  for (int h = 0; h < HG; ++h) {
    m_all[h] = -INFINITY;
    for (int j = 0; j < nsg; ++j) {
      m_all[h] = max(m_all[h], sg_m[j * HG + h]);
    }
    l_all[h] = 0.0f;
    for (int j = 0; j < nsg; ++j) {
      l_all[h] += sg_l[j * HG + h] * merge_weight(sg_m[j * HG + h], m_all[h]);
    }
    mine[h] = merge_weight(m[h], m_all[h]);
  }
  const bool partitioned = args.num_partitions > 1;

  // Head h is finished by simdgroup h % nsg, for every value dim slice.
  for (int i = 0; i < DPL_V; ++i) {
    for (int h = 0; h < HG; ++h) {
      if (h < nh) {
        sg_acc[(h * MAX_NSG + int(sg)) * W + int(lane)] = acc[h][i] * mine[h];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int d = i * W + int(lane);
    for (int h = int(sg); h < nh; h += nsg) {
      const int head = head0 + h;
      const int64_t row = int64_t(token) * args.num_heads + head;
      const int64_t part_row = (row * args.num_partitions + part) * int64_t(Dv + 2);
      const bool nan_row = any_bad != 0 || !(l_all[h] > 0.0f);
      if (partitioned && i == 0 && lane == 0) {
        // An empty partition stays (m = -inf, l = 0); a bad row carries l = NaN.
        partials[part_row] = m_all[h];
        partials[part_row + 1] = any_bad != 0 ? NAN : l_all[h];
      }
      if (d >= Dv) {
        continue;
      }
      float sum = 0.0f;
      for (int j = 0; j < nsg; ++j) {
        sum += sg_acc[(h * MAX_NSG + j) * W + int(lane)];
      }
      if (partitioned) {
        partials[part_row + 2 + d] = sum;
      } else {
        // The row's denominator with the sink (written rows only; partials
        // keep the bare state for the reduce kernel).
        float l_row = l_all[h];
        const float sink_factor = fold_sink(args, sinks, head, m_all[h], l_row);
        out[row * Dv + d] = static_cast<T>(nan_row ? NAN : sum * sink_factor / l_row);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
