// Reduce kernel of partitioned decode: one simdgroup per query row merges the
// row's partition states (m, l, acc) in partition order, with the same rule
// the CPU backend uses to merge its partitions, folds in the row's sink (once,
// here: the partitions leave it out) and writes the row (the decode kernel's
// rows only; see is_prefill_row).
#pragma once

#include "paged_attention_common.h"

template <typename T, int DPL_V>  // DPL_V: value head dims per lane (of the tier)
[[kernel]] void paged_attention_reduce(
    constant vllm_metal::PagedAttentionArgs& args [[buffer(0)]],
    const device int* seq_lens [[buffer(5)]],
    const device int* cu_seqlens_q [[buffer(6)]],
    device T* out [[buffer(7)]],
    const device float* partials [[buffer(8)]],
    const device float* sinks [[buffer(9)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace vllm_metal;
  constexpr int W = kSimdWidth;
  const int head = tgid.x;
  const int token = tgid.y;
  const int Dv = args.v_head_dim;
  const int64_t row = int64_t(token) * args.num_heads + head;
  const int64_t stride = Dv + 2;
  const int64_t first = row * args.num_partitions * stride;
  if (is_prefill_row(locate_token(args, seq_lens, cu_seqlens_q, token))) {
    return;  // no partials: the prefill kernel writes this row
  }

  float m = -INFINITY;
  float l = 0.0f;
  float acc[DPL_V];
  for (int i = 0; i < DPL_V; ++i) {
    acc[i] = 0.0f;
  }
  bool bad = false;
  for (int p = 0; p < args.num_partitions; ++p) {
    const int64_t at = first + p * stride;
    const float pm = partials[at];
    const float pl = partials[at + 1];
    if (isnan(pl)) {
      bad = true;
      continue;
    }
    if (pl == 0.0f && pm == -INFINITY) {  // no visible key in this partition
      continue;
    }
    const float m_new = max(m, pm);
    const float a = merge_weight(m, m_new);
    const float b = exp(pm - m_new);
    l = l * a + pl * b;
    for (int i = 0; i < DPL_V; ++i) {
      const int d = i * W + int(lane);
      const float x = d < Dv ? partials[at + 2 + d] : 0.0f;
      acc[i] = acc[i] * a + x * b;
    }
    m = m_new;
  }
  const bool nan_row = bad || !(l > 0.0f);
  const float sink_factor = fold_sink(args, sinks, head, m, l);
  for (int i = 0; i < DPL_V; ++i) {
    const int d = i * W + int(lane);
    if (d < Dv) {
      out[row * Dv + d] = static_cast<T>(nan_row ? NAN : acc[i] * sink_factor / l);
    }
  }
}
