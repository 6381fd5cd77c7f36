// The CPU paged-attention kernel's per-thread working state
// (paged_attention_kernel.cpp): how many keys a softmax step takes, the value
// rows a step accumulates, and the scratch buffers a unit reuses.
//
// Internal linkage (an unnamed namespace), like simd.h: the kernel is compiled
// once per instruction set into one library.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/paged_attention_softmax.h"

namespace vllm_metal::cpu {
namespace {

// Keys per softmax step: whole 16-, 32- or 64-key blocks are scored and
// reduced eight, four or two at a time (the per-step work of a row, its max,
// rescale, horizontal sums and scalar exp, amortised over 128 keys: a
// 1024-token prefill layer ~4% faster than with 64-key steps on AVX-512,
// decode level; docs/primitives.md); other block sizes one block per step.
constexpr int kChunkKeys = 128;

// The value rows of one block's keys within a step: lanes [off, off + n) of
// the step's scores weigh rows v, v + stride, ... (sc.v or the cache itself).
struct ValueSegment {
  const float* v;
  int64_t stride;
  int off, n;
};

// KV heads of a decode unit whose keys of a step are loaded together (each
// into its own slot of kt, v and seg) before any of them is scored.
constexpr int kMaxSlots = 4;

// Per-thread scratch, grown on demand and kept between calls.
struct Scratch {
  std::vector<float> q, kt, krows, zeros, v, acc, part_acc, scores;
  ValueSegment seg[kMaxSlots][kChunkKeys / 16];
  int nseg[kMaxSlots] = {};
  std::vector<int> lo, hi;  // each row's lanes of the current step
  std::vector<RowState> state, part_state;
};

} // namespace
} // namespace vllm_metal::cpu
