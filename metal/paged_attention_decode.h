// Decode kernel: one threadgroup per (token, chunk of the query heads of one
// KV head) and key partition, for the rows of sequences with few new tokens
// (decode, speculative decode; see is_prefill_row) and rows with invalid
// metadata. Its grid covers every row; threadgroups of prefill rows return at
// once.
//
// Grid: x = KV head * decode_chunks + chunk, y = token, z = partition. The
// chunk holds up to decode_heads consecutive query heads of the KV head's
// GQA group (see PagedAttentionArgs); HG == 1 is the per-head kernel (x =
// query head). In the verify regime (decode_tokens > 1: speculative
// decoding's verify rows, a few new tokens per sequence) the threadgroup at
// token y also computes the next tokens of its sequence up to decode_tokens
// (those decode_owner gives it; the threadgroups at those tokens return at
// once), decode_tokens x decode_heads <= HG rows in all. The host's plan
// (paged_attention_plan.h) picks HG, the chunks, the tokens and the
// simdgroup count from the shape-class table (paged_attention_tuning.h).
//
// Each simdgroup walks every n-th key (n simdgroups) of the union of its
// rows' visible keys with one lane per head dimension (lane l holds dims l,
// l + 32, ...: DPL_K of q and the key, DPL_V of the value and the
// accumulator). It loads each key and value row once and uses it for every
// row (token x head of the chunk) that sees the key, keeping each row's
// online softmax in float32; the simdgroups' states are merged per row at
// the end.
// With one partition the rows are written to `out` (the sink folded in);
// otherwise this partition's unnormalised state (m, l, acc) of each row goes
// to `partials` (per query row, as the reduce kernel reads them), and the
// reduce kernel folds the sink in.
#pragma once

#include "paged_attention_common.h"

// DPL_K, DPL_V: key and value head dims per lane (of the head-dim tier);
// HG: the most rows (tokens x query heads) per threadgroup (registers are
// sized for it);
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
  threadgroup float sg_m[MAX_NSG * HG];  // [simdgroup][row]
  threadgroup float sg_l[MAX_NSG * HG];
  threadgroup int sg_bad[MAX_NSG];             // bit k: token k of the threadgroup
  threadgroup float sg_acc[HG * MAX_NSG * W];  // [row][simdgroup][lane]

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
  // Verify regime (decode_tokens > 1): this threadgroup computes the tokens
  // it owns (decode_owner) among token .. token + decode_tokens - 1, all of
  // one sequence, so each key and value row is read once for all their rows;
  // a token owned by another threadgroup leaves this one idle.
  const int tokens_per_tg = max(1, min(args.decode_tokens, int(kDecodeMaxTokens)));
  if (decode_owner(args, seq_lens, cu_seqlens_q, token, place, tokens_per_tg) != token) {
    return;
  }
  int nt = 1;  // tokens of this threadgroup: token + tok_off[k]
  int tok_off[kDecodeMaxTokens];
  tok_off[0] = 0;
  for (int k = 1; k < tokens_per_tg && token + k < args.num_tokens; ++k) {
    const TokenPlace other = locate_token(args, seq_lens, cu_seqlens_q, token + k);
    if (decode_owner(args, seq_lens, cu_seqlens_q, token + k, other, tokens_per_tg) == token) {
      tok_off[nt++] = k;
    }
  }
  // Rows r < nt * nh (at most HG: the plan sizes decode_tokens so) are
  // (token tok_off[r / nh], head r % nh of the chunk), each with its own keys.
  const int nrows = min(nt * nh, HG);

  // Visible keys of each row's token, cut to this partition's absolute
  // positions; the threadgroup walks their union.
  int64_t part_lo = 0;
  int64_t part_hi = int64_t(1) << 40;  // past any key
  if (args.num_partitions > 1) {
    part_lo = int64_t(part) * args.partition_size;
    part_hi = part_lo + args.partition_size;
  }
  int row_lo[HG];
  int row_hi[HG];
  int64_t key_lo = part_hi;
  int64_t key_hi = 0;
  for (int r = 0; r < HG; ++r) {
    const int pos = place.pos + tok_off[min(r / nh, nt - 1)];
    int64_t lo = place.valid ? int64_t(visible_from(args, pos)) : 0;
    int64_t hi = place.valid ? int64_t(visible_to(args, place.len, pos)) : 0;
    lo = lo > part_lo ? lo : part_lo;
    hi = hi < part_hi ? hi : part_hi;
    hi = hi > lo ? hi : lo;  // empty: lo == hi
    row_lo[r] = int(lo);
    row_hi[r] = int(hi);
    if (r < nrows && hi > lo) {
      key_lo = lo < key_lo ? lo : key_lo;
      key_hi = hi > key_hi ? hi : key_hi;
    }
  }
  key_lo = key_lo < key_hi ? key_lo : key_hi;  // no keys at all: an empty walk

  // Per row r < nrows (r >= nrows: idle slots, uniform in the threadgroup,
  // never read or written).
  float qv[HG][DPL_K];
  float acc[HG][DPL_V];
  float m[HG];
  float l[HG];
  for (int r = 0; r < HG; ++r) {
    const int t = token + tok_off[min(r / nh, nt - 1)];
    const int64_t q_row =
        int64_t(t) * args.q_strides[0] + int64_t(head0 + r % nh) * args.q_strides[1];
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      qv[r][i] = (r < nrows && d < D) ? load_float(q, q_row + d * args.q_strides[2]) : 0.0f;
    }
    for (int i = 0; i < DPL_V; ++i) {
      acc[r][i] = 0.0f;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // A row is bad (NaN) when its token's metadata is, or a key it sees has
  // no valid block: every head of a token alike (they see the same keys).
  int bad = place.valid ? 0 : (1 << kDecodeMaxTokens) - 1;  // bit k: token tok_off[k]

  for (int key = int(key_lo) + int(sg); key < int(key_hi); key += nsg) {
    const int block = physical_block(args, block_tables, place.seq, key);
    if (block < 0) {  // same key for every lane: uniform in the simdgroup
      for (int k = 0; k < nt; ++k) {
        const int r = k * nh;  // the token's first row: its keys are its heads'
        if (key >= row_lo[r] && key < row_hi[r]) {
          bad |= 1 << k;
        }
      }
      continue;
    }
    const int slot = key - (key / args.block_size) * args.block_size;
    const int64_t k_row = cache_row(args.k_strides, block, slot, kv_head);
    const int64_t v_row = cache_row(args.v_strides, block, slot, kv_head);
    float kx[DPL_K];  // the key row's slice, loaded once for every row
    for (int i = 0; i < DPL_K; ++i) {
      const int d = i * W + int(lane);
      kx[i] = d < D ? load_cache(k_cache, k_row, d, args.k_strides[3], D) : 0.0f;
    }
    float vx[DPL_V];  // the value row's slice, likewise
    for (int i = 0; i < DPL_V; ++i) {
      const int d = i * W + int(lane);
      vx[i] = d < Dv ? load_cache(v_cache, v_row, d, args.v_strides[3], Dv) : 0.0f;
    }
    for (int r = 0; r < HG; ++r) {
      if (r >= nrows) {  // uniform in the threadgroup
        break;
      }
      if (key < row_lo[r] || key >= row_hi[r]) {  // the same key for the simdgroup
        continue;
      }
      float dot = 0.0f;
      for (int i = 0; i < DPL_K; ++i) {
        dot += qv[r][i] * kx[i];
      }
      const float s = finish_score(args, simd_sum(dot));
      const float m_new = max(m[r], s);
      const float alpha = exp(m[r] - m_new);
      const float w = exp(s - m_new);
      l[r] = l[r] * alpha + w;
      for (int i = 0; i < DPL_V; ++i) {
        acc[r][i] = acc[r][i] * alpha + w * vx[i];
      }
      m[r] = m_new;
    }
  }

  // Merge the simdgroups' states per row: a common max, then the rescaled
  // sums; a token's bad bits from every simdgroup.
  if (lane == 0) {
    for (int r = 0; r < HG; ++r) {
      sg_m[int(sg) * HG + r] = m[r];
      sg_l[int(sg) * HG + r] = l[r];
    }
    sg_bad[sg] = bad;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int any_bad = 0;
  for (int j = 0; j < nsg; ++j) {
    any_bad |= sg_bad[j];
  }
  float m_all[HG];
  float l_all[HG];
  float mine[HG];
  for (int r = 0; r < HG; ++r) {
    m_all[r] = -INFINITY;
    for (int j = 0; j < nsg; ++j) {
      m_all[r] = max(m_all[r], sg_m[j * HG + r]);
    }
    l_all[r] = 0.0f;
    for (int j = 0; j < nsg; ++j) {
      l_all[r] += sg_l[j * HG + r] * merge_weight(sg_m[j * HG + r], m_all[r]);
    }
    mine[r] = merge_weight(m[r], m_all[r]);
  }
  const bool partitioned = args.num_partitions > 1;

  // Row r is finished by simdgroup r % nsg, for every value dim slice.
  for (int i = 0; i < DPL_V; ++i) {
    for (int r = 0; r < HG; ++r) {
      if (r < nrows) {
        sg_acc[(r * MAX_NSG + int(sg)) * W + int(lane)] = acc[r][i] * mine[r];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int d = i * W + int(lane);
    for (int r = int(sg); r < nrows; r += nsg) {
      const int head = head0 + r % nh;
      const int64_t row = int64_t(token + tok_off[r / nh]) * args.num_heads + head;
      const int64_t part_row = (row * args.num_partitions + part) * int64_t(Dv + 2);
      const bool row_bad = ((any_bad >> (r / nh)) & 1) != 0;
      const bool nan_row = row_bad || !(l_all[r] > 0.0f);
      if (partitioned && i == 0 && lane == 0) {
        // An empty partition stays (m = -inf, l = 0); a bad row carries l = NaN.
        partials[part_row] = m_all[r];
        partials[part_row + 1] = row_bad ? NAN : l_all[r];
      }
      if (d >= Dv) {
        continue;
      }
      float sum = 0.0f;
      for (int j = 0; j < nsg; ++j) {
        sum += sg_acc[(r * MAX_NSG + j) * W + int(lane)];
      }
      if (partitioned) {
        partials[part_row + 2 + d] = sum;
      } else {
        // The row's denominator with the sink (written rows only; partials
        // keep the bare state for the reduce kernel).
        float l_row = l_all[r];
        const float sink_factor = fold_sink(args, sinks, head, m_all[r], l_row);
        out[row * Dv + d] = static_cast<T>(nan_row ? NAN : sum * sink_factor / l_row);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
